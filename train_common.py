"""The parser and training worker shared by both launchers.

``train_multi_gpu_using_launch.py`` and ``train_multi_gpu_using_spawn.py`` differ only in how the
processes start; each process then runs :func:`train` with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from model import MODELS, get_model
from multi_train_utils.checkpoint import (CheckpointError, capture_rng_state, extract_state_dict,
                                          load_file, load_matching_weights, prune_weights,
                                          restore_rng_state, save_atomic, unwrap)
from multi_train_utils.distributed_utils import (DistInfo, LaunchError, all_gather_object,
                                                 all_ranks_ok, broadcast_object, cleanup,
                                                 init_distributed_mode)
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (EvalResult, evaluate, resolve_amp_dtype,
                                               train_one_epoch)
from my_dataset import MyDataSet
from utils import (DataError, default_demo_root, get_transforms, make_demo_data,
                   plot_class_distribution, scan_image_folder, split_train_val, write_json_atomic)

log = logging.getLogger("train")


class ConfigError(ValueError):
    """Flags that contradict each other or the data (one sentence, with the fix)."""


USER_ERRORS = (DataError, CheckpointError, ConfigError, LaunchError)
EXIT_USER_ERROR = 2


# ---------------------------------------------------------------- arguments
class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, and also ``--x False`` as the classic template's users typed it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"
        self.metavar = "BOOL"

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-") or values is None:
            return super().__call__(parser, namespace, values, option_string)
        text = str(values).lower()
        if text not in ("true", "false", "1", "0", "yes", "no"):
            parser.error(f"{option_string} takes no value or one of true/false, not {values!r}")
        setattr(namespace, self.dest, text in ("true", "1", "yes"))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones (their help text says what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def default_workers(batch_size: int) -> int:
    # The template's rule: one worker per sample of the batch, at most 8 and the CPU count.
    return min(os.cpu_count() or 1, batch_size if batch_size > 1 else 0, 8)


def get_args_parser(add_help: bool = True, launcher: str = "launch") -> argparse.ArgumentParser:
    """Flags of both launchers (``launcher="spawn"`` adds how many processes to start)."""
    parser = argparse.ArgumentParser(
        description="Data-parallel image classification (ResNet) with DistributedDataParallel.",
        formatter_class=HelpFormatter, add_help=add_help)

    data = parser.add_argument_group("data")
    data.add_argument("--data-path", "--data_path", default=None,
                      help="folder with one sub-folder of images per class (e.g. flower_photos); "
                           "default: the generated demo dataset")
    data.add_argument("--demo-dir", default=None,
                      help="where the demo dataset is generated and cached "
                           "(default: $DDP_DEMO_DATA or ~/.cache/ddp-template/demo_flowers_v1)")
    data.add_argument("--val-rate", type=float, default=0.2, help="fraction of each class held out")
    data.add_argument("--img-size", type=int, default=224, help="training/validation crop size")
    data.add_argument("--num-classes", "--num_classes", type=int, default=None,
                      help="number of classes (default: the number of class folders)")
    data.add_argument("--workers", type=int, default=None,
                      help="DataLoader workers per process (default: min(cpus, batch size, 8))")
    data.add_argument("--verify-images", action=BoolFlag, default=True,
                      help="check every image's header (and end marker) before training; "
                           "unreadable files are skipped and listed")

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet34", choices=sorted(MODELS), help="architecture")
    model.add_argument("--weights", default=None,
                       help="initial weights (state dict or checkpoint); tensors whose shape "
                            "does not fit, e.g. a 1000-class head, are skipped and listed")
    model.add_argument("--freeze-layers", "--freeze_layers", action=BoolFlag, default=False,
                       help="train only the classifier (fc)")
    model.add_argument("--sync-bn", "--syncBN", dest="sync_bn", action=BoolFlag, default=True,
                       help="synchronise BatchNorm statistics across processes "
                            "(torch's SyncBatchNorm on CUDA, ours on CPU)")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=int, default=30, help="total, resumed epochs included")
    optim.add_argument("--batch-size", "--batch_size", type=int, default=16,
                       help="per process; the global batch is this x world size")
    optim.add_argument("--lr", type=float, default=0.001,
                       help="learning rate for one process; multiplied by world size")
    optim.add_argument("--scale-lr", action=BoolFlag, default=True,
                       help="linear scaling: lr x world size (Goyal et al. 2017, arXiv:1706.02677)")
    optim.add_argument("--lrf", type=float, default=0.1,
                       help="final lr as a fraction of the initial (cosine schedule)")
    optim.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    optim.add_argument("--weight-decay", type=float, default=0.005, help="SGD weight decay")
    optim.add_argument("--grad-accum-steps", type=int, default=1,
                       help="optimizer step every K batches; DDP syncs only on the K-th")
    optim.add_argument("--clip-grad-norm", type=float, default=None, help="max gradient norm")

    speed = parser.add_argument_group("speed")
    speed.add_argument("--amp", action=BoolFlag, default=None,
                       help="mixed precision: bf16 where supported, else fp16 with GradScaler "
                            "(default: on for CUDA, off for CPU)")
    speed.add_argument("--channels-last", action=BoolFlag, default=None,
                       help="NHWC memory format (default: on for CUDA)")
    speed.add_argument("--compile", action=BoolFlag, default=False, help="torch.compile the model")
    speed.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP gradient bucket size")

    dist = parser.add_argument_group("distributed")
    dist.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                      help="auto: CUDA if available (NCCL), else CPU (gloo)")
    dist.add_argument("--dist-url", "--dist_url", default="env://",
                      help="env:// (torchrun/SLURM/spawn set the variables) or tcp://HOST:PORT")
    dist.add_argument("--dist-timeout", type=float, default=1800.0,
                      help="seconds a collective may wait for a peer before failing")
    # torch.distributed.launch without --use_env passes --local-rank; LOCAL_RANK is read instead.
    dist.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    if launcher == "spawn":
        dist.add_argument("--world-size", "--world_size", type=int, default=None,
                          help="processes on this node (default: visible GPUs, or 2 on CPU)")
        dist.add_argument("--nnodes", type=int, default=1, help="number of machines")
        dist.add_argument("--node-rank", type=int, default=0, help="this machine's index")

    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default="runs/train",
                     help="checkpoints, weights/, metrics.jsonl, TensorBoard, class_indices.json")
    run.add_argument("--resume", default="auto",
                     help="'auto': continue from <output-dir>/checkpoint.pth if it exists; "
                          "a path; or 'none' to start fresh")
    run.add_argument("--keep-last", type=int, default=0,
                     help="keep only the newest K weights/model-{epoch}.pth (0: keep all)")
    run.add_argument("--eval-only", action=BoolFlag, default=False,
                     help="evaluate the resumed/--weights model and exit")
    run.add_argument("--seed", type=int, default=0, help="data split, shuffling and init")
    run.add_argument("--print-freq", type=int, default=50,
                     help="reduce and show the running loss every N steps")
    run.add_argument("--tensorboard", action=BoolFlag, default=True,
                     help="write TensorBoard logs to <output-dir>/tensorboard")
    return parser


# ---------------------------------------------------------------- worker
def setup_logging(rank: int) -> None:
    # One gate for chatter: rank 0 logs INFO, the others only warnings and errors.
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True, stream=sys.stderr)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    _expect_worker_deaths()
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _expect_worker_deaths() -> None:
    # DataLoader workers stop with us (torchrun signals the whole process group; multiprocessing
    # terminates daemon children at exit). Their SIGCHLD would otherwise raise "DataLoader worker
    # is killed by signal" in the middle of the clean-up and replace the interrupt. A no-op
    # handler, not SIG_DFL: Python raises OSError for a pending signal whose handler went away.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)


def train(args: argparse.Namespace) -> None:
    """Run one training process to the end; exits with 2 on a user error, 130/143 on a signal.

    Every rank raises the same user error (data is checked on rank 0 and the verdict broadcast),
    so no rank is left waiting in a collective.
    """
    # SIGTERM (torchrun, SLURM, the spawn launcher, `kill`) unwinds like Ctrl-C: finally-blocks
    # run, the process group is destroyed and DataLoader workers are shut down.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    setup_logging(int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))))
    info = None
    try:
        info = init_distributed_mode(device=args.device, dist_url=args.dist_url,
                                     timeout_s=args.dist_timeout)
        setup_logging(info.rank)
        _run(args, info)
    except USER_ERRORS as exc:
        if info is None or info.is_main:
            log.error("error: %s", exc)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt as exc:
        _expect_worker_deaths()
        signame = str(exc) or "SIGINT"
        if info is None or info.is_main:
            log.error("interrupted by %s; the last complete checkpoint is in %s - run the same "
                      "command again to resume.", signame, args.output_dir)
        sys.exit(143 if signame == "SIGTERM" else 130)
    finally:
        cleanup()


def _seed_everything(seed: int, rank: int) -> None:
    # seed + rank: ranks must not draw identical random numbers (e.g. dropout masks).
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def _scan_on_rank0(root: str, verify: bool, info: DistInfo):
    """Scan once (rank 0) and hand every rank the same result or the same error."""
    result: Any = None
    if info.is_main:
        try:
            result = scan_image_folder(root, verify=verify)
        except DataError as exc:
            result = exc
    result = broadcast_object(result)
    if isinstance(result, DataError):
        raise result
    return result


def _build_data(args: argparse.Namespace, info: DistInfo, out: Path):
    root = args.data_path
    if root is None:
        root = str(make_demo_data(args.demo_dir or default_demo_root()))
        log.info("no --data-path given: training on the generated demo dataset in %s", root)
    scan = _scan_on_rank0(root, args.verify_images, info)
    if info.is_main:
        log.info(scan.summary())
        if scan.skipped:  # nothing is lost silently: the full list stays with the run
            (out / "skipped_files.txt").write_text(
                "".join(f"{p}\t{why}\n" for p, why in scan.skipped), encoding="utf-8")
        write_json_atomic(out / "class_indices.json", {str(i): c for i, c in enumerate(scan.classes)})
        plot_class_distribution(scan, out / "class_distribution.png")

    num_classes = len(scan.classes)
    if args.num_classes is not None and args.num_classes != num_classes:
        raise ConfigError(f"--num-classes {args.num_classes} disagrees with the {num_classes} class "
                          f"folders found in {root} ({', '.join(scan.classes)}); drop the flag "
                          "or fix the folders.")
    train_p, train_y, val_p, val_y, warnings = split_train_val(scan.images, args.val_rate,
                                                               args.seed, scan.classes)
    for warning in warnings if info.is_main else ():  # same split on every rank: say it once
        log.warning(warning)
    if not val_p:
        raise DataError(f"the validation split of {root} is empty (val rate {args.val_rate}); "
                        "raise --val-rate or add images.")
    needed = info.world_size * args.batch_size
    if len(train_p) < needed:
        raise DataError(f"{len(train_p)} training images are fewer than world size "
                        f"{info.world_size} x batch size {args.batch_size} = {needed}, so no full "
                        "batch could be formed; lower --batch-size or add images.")

    transforms = get_transforms(args.img_size)
    train_set = MyDataSet(train_p, train_y, transforms["train"], decoder="tensor", seed=args.seed,
                          report_errors=info.is_main)
    val_set = MyDataSet(val_p, val_y, transforms["val"], decoder="tensor",
                        report_errors=info.is_main)
    train_sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
                                       shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=info.world_size, rank=info.rank,
                                     shuffle=False)
    workers = default_workers(args.batch_size) if args.workers is None else args.workers
    loader_kwargs: dict[str, Any] = dict(num_workers=workers, collate_fn=MyDataSet.collate_fn,
                                         pin_memory=info.device.type == "cuda")
    if workers > 0:
        loader_kwargs.update(persistent_workers=True, prefetch_factor=4)
    train_loader = DataLoader(train_set, batch_sampler=BatchSampler(
        train_sampler, args.batch_size, drop_last=True), **loader_kwargs)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            **loader_kwargs)
    log.info("%d training / %d validation images, %d classes, %d loader workers per process",
             len(train_set), len(val_set), num_classes, workers)
    return scan.classes, train_set, val_set, train_sampler, train_loader, val_loader


def _build_model(args: argparse.Namespace, info: DistInfo, num_classes: int) -> nn.Module:
    model = get_model(args.model, num_classes=num_classes)
    if args.weights:
        skipped, missing = load_matching_weights(model, args.weights)
        log.info("loaded %s; skipped %d tensor(s) that do not fit%s; %d left as initialised%s",
                 args.weights, len(skipped), f" ({', '.join(skipped)})" if skipped else "",
                 len(missing), f" ({', '.join(missing)})" if missing else "")
    if args.freeze_layers:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("fc."))
    if args.sync_bn and info.distributed:
        model = convert_sync_batchnorm(model, info.device)
    return model


def _resolve_resume(args: argparse.Namespace, out: Path) -> str | None:
    """The checkpoint every rank resumes from, decided by rank 0 (None: start fresh).

    Only rank 0 writes checkpoints, so on several machines without a shared --output-dir the
    other ranks would not find it and would silently start from epoch 0 with other weights.
    """
    if args.resume in (None, "", "none"):
        return None
    path = args.resume
    if args.resume == "auto":
        path = str(out / "checkpoint.pth") if (out / "checkpoint.pth").is_file() else None
    path = broadcast_object(path)
    if path is not None and not all_ranks_ok(os.path.isfile(path)):
        raise CheckpointError(f"checkpoint {path} is not readable on every rank; put --output-dir "
                              "on storage all machines share, or copy the file to each of them.")
    return path


def _load_checkpoint(path: str, args: argparse.Namespace, num_classes: int) -> dict[str, Any]:
    ckpt = load_file(path)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "epoch" not in ckpt:
        raise CheckpointError(f"{path} is not a training checkpoint (no 'model'/'epoch'); to start "
                              "from bare weights use --weights instead of --resume.")
    saved = ckpt.get("args", {})
    for key, now in (("model", args.model), ("num_classes", num_classes)):
        if key in saved and saved[key] != now:
            raise CheckpointError(f"{path} was trained with {key}={saved[key]} but this run has "
                                  f"{key}={now}; use a matching --{key.replace('_', '-')} or "
                                  "another --output-dir.")
    return ckpt


def _jsonable(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v))
            for k, v in {**vars(args), **extra}.items()}


def _run(args: argparse.Namespace, info: DistInfo) -> None:
    out = Path(args.output_dir)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    _seed_everything(args.seed, info.rank)
    device = info.device
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N processes x all-cores threads oversubscribe the CPU (2-5x slower here); share them.
        local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_procs)))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick the fastest
    classes, train_set, val_set, train_sampler, train_loader, val_loader = _build_data(args, info, out)
    num_classes = len(classes)

    model = _build_model(args, info, num_classes)
    resume_path = _resolve_resume(args, out)
    ckpt = _load_checkpoint(resume_path, args, num_classes) if resume_path else None
    if ckpt is not None:
        state, own = extract_state_dict(ckpt, resume_path), model.state_dict()
        # Checkpoints without recorded args (or from edited code) are checked by shape.
        unfit = sorted(k for k in state.keys() | own.keys()
                       if k not in state or k not in own or state[k].shape != own[k].shape)
        if unfit:
            raise CheckpointError(f"{resume_path} does not fit --model {args.model} with "
                                  f"{num_classes} classes ({len(unfit)} tensor(s) differ, e.g. "
                                  f"{unfit[0]}); resume with the model and data it was trained "
                                  "on, or use another --output-dir.")
        model.load_state_dict(state)
    channels_last = device.type == "cuda" if args.channels_last is None else args.channels_last
    model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    model_without_ddp = model
    if info.distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
    if args.compile:
        model = torch.compile(model)

    amp_dtype = resolve_amp_dtype(args.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    lr = args.lr * info.world_size if args.scale_lr else args.lr
    params = [p for p in model_without_ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    # Cosine from lr to lr * lrf over the run (as the template; SGDR, arXiv:1608.03983).
    lr_lambda = lambda e: ((1 + math.cos(e * math.pi / args.epochs)) / 2) * (1 - args.lrf) + args.lrf  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_lambda)

    start_epoch, best_acc, history = 0, 0.0, []
    if args.eval_only and ckpt is None and not args.weights:
        raise ConfigError("--eval-only needs a model: give --resume CHECKPOINT or --weights FILE.")
    if ckpt is not None:
        if not args.eval_only:
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["lr_scheduler"])
            if "scaler" in ckpt and scaler.is_enabled():
                scaler.load_state_dict(ckpt["scaler"])
            rng = ckpt.get("rng_states") or []
            if len(rng) == info.world_size:
                restore_rng_state(rng[info.rank])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt.get("best_acc", 0.0)
        history = [m for m in ckpt.get("metrics", []) if m["epoch"] < start_epoch]
        log.info("resumed from %s: epoch %d done, best val acc %.4f", resume_path, ckpt["epoch"],
                 best_acc)

    if args.eval_only:
        result = evaluate(model, val_loader, device, amp_dtype=amp_dtype, channels_last=channels_last)
        _report_eval(result, classes)
        return

    if info.is_main:
        write_json_atomic(out / "args.json", _jsonable(args, world_size=info.world_size,
                                                       backend=info.backend, device=str(device)))
        # metrics.jsonl is rebuilt from the checkpoint: each finished epoch exactly once, even
        # if the previous attempt died between appending a line and saving the checkpoint.
        _write_metrics(out / "metrics.jsonl", history)
    writer = _tensorboard(args, info, out, start_epoch, train_set, classes)

    if start_epoch >= args.epochs:
        log.info("all %d epochs already done in %s; nothing to train.", args.epochs, out)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        t0 = time.perf_counter()
        train_loss = train_one_epoch(
            model, optimizer, train_loader, device, epoch, scaler=scaler, amp_dtype=amp_dtype,
            grad_accum_steps=args.grad_accum_steps, clip_grad_norm=args.clip_grad_norm,
            print_freq=args.print_freq, channels_last=channels_last,
            log_fn=_step_logger(writer))
        train_seconds = time.perf_counter() - t0
        lr_used = optimizer.param_groups[0]["lr"]
        scheduler.step()
        result = evaluate(model, val_loader, device, amp_dtype=amp_dtype, channels_last=channels_last)
        epoch_seconds = time.perf_counter() - t0
        val_acc = result.top1
        images = len(train_loader) * args.batch_size * info.world_size
        record = {"epoch": epoch, "train_loss": round(train_loss, 6), "val_acc": round(val_acc, 6),
                  "val_loss": round(result.loss, 6), "val_top5": result.top5, "lr": lr_used,
                  "epoch_seconds": round(epoch_seconds, 3),
                  "train_images_per_sec": round(images / train_seconds, 2)}
        history.append(record)
        is_best = val_acc > best_acc
        best_acc = max(best_acc, val_acc)
        rng_states = all_gather_object(capture_rng_state())
        if info.is_main:
            state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                     "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                     "args": _jsonable(args, num_classes=num_classes, world_size=info.world_size),
                     "classes": classes, "metrics": history, "rng_states": rng_states}
            if scaler.is_enabled():
                state["scaler"] = scaler.state_dict()
            save_atomic(state["model"], out / "weights" / f"model-{epoch}.pth")
            prune_weights(out / "weights", args.keep_last)
            if is_best:
                save_atomic(state, out / "model_best.pth")
            save_atomic(state, out / "checkpoint.pth")  # last: it marks the epoch as done
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            log.info("[epoch %d] train loss %.4f  val acc %.4f%s  val loss %.4f  lr %.2e  %.1fs  "
                     "%.0f img/s", epoch, train_loss, val_acc,
                     f"  top5 {result.top5:.4f}" if result.top5 is not None else "", result.loss,
                     lr_used, epoch_seconds, record["train_images_per_sec"])
            if writer:
                for tag, value in (("loss", train_loss), ("accuracy", val_acc),
                                   ("learning_rate", lr_used), ("val_loss", result.loss),
                                   ("top5", result.top5),
                                   ("images_per_sec", record["train_images_per_sec"])):
                    if value is not None:
                        writer.add_scalar(tag, value, epoch)
                if epoch == args.epochs - 1:
                    writer.add_figure("confusion_matrix", _confusion_figure(result, classes), epoch)
                writer.flush()
    if writer:
        writer.close()


def _step_logger(writer):
    """``log_fn`` for train_one_epoch: running loss and lr every --print-freq steps."""
    if writer is None:
        return None

    def log_step(step: int, loss: float, lr: float) -> None:
        writer.add_scalar("step/loss", loss, step)
        writer.add_scalar("step/lr", lr, step)
    return log_step


def _write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")
    os.replace(tmp, path)


def _tensorboard(args, info: DistInfo, out: Path, start_epoch: int, train_set, classes):
    if not (args.tensorboard and info.is_main):
        return None
    from torch.utils.tensorboard import SummaryWriter  # optional extra: imported lazily
    from torchvision.utils import make_grid

    writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_epoch or None)
    if start_epoch == 0:
        images = torch.stack([train_set[i][0] for i in range(min(16, len(train_set)))])
        writer.add_image("train_images_augmented", make_grid(images, nrow=8), 0)
        writer.add_text("args", json.dumps(_jsonable(args), indent=2), 0)
    return writer


def _confusion_figure(result: EvalResult, classes: list[str]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = result.confusion.numpy()
    fig, ax = plt.subplots(figsize=(1 + 0.5 * len(classes), 1 + 0.5 * len(classes)))
    ax.imshow(cm, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=90)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for (i, j), v in np.ndenumerate(cm):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=7)
    fig.tight_layout()
    return fig


def _report_eval(result: EvalResult, classes: list[str]) -> None:
    lines = [f"val images: {result.num_samples}", f"top-1 accuracy: {result.top1:.4f}"]
    if result.top5 is not None:
        lines.append(f"top-5 accuracy: {result.top5:.4f}")
    lines.append(f"val loss: {result.loss:.4f}")
    lines += [f"  {name}: {acc:.4f}" for name, acc in zip(classes, result.per_class_acc)]
    log.info("\n".join(lines))

