"""The training script's flags in one place: the parser (each flag, and what a continued run
does with it), the checks of flags that contradict each other, the flags a continued run takes
from its checkpoint, and the mapping of flags to the keyword arguments the library takes."""

import argparse
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from augment import AUTO_AUGMENT
from demo_data import default_demo_root, make_demo_data
from flags import BoolFlag, HelpFormatter, number, path_flag
from image_folder import imagenet_layout
from model import check_model, weights_size
from multi_train_utils.checkpoint_io import CheckpointError, load_file
from multi_train_utils.distributed_utils import (COMM_HOOKS, DistInfo, cpus_per_process, get_rank,
                                                 run_on_main)
from multi_train_utils.guard import ConfigError
from multi_train_utils.recipe import OPTIMIZERS, SCHEDULES, inert_flags, resolve_recipe
from multi_train_utils.run_folder import claim_output_dir, move_earlier_run, resume_path
from multi_train_utils.strategy import STRATEGIES, check_strategy
from multi_train_utils.train_eval_utils import LoopOptions, resolve_amp_dtype
from my_dataset import default_workers, loader_kwargs

log = logging.getLogger("train")


def run_args(args: argparse.Namespace, info: DistInfo, images_per_step: int) -> dict:
    """The flags as recorded in args.json and every checkpoint (a resume compares them)."""
    return {**vars(args), "world_size": info.world_size, "images_per_step": images_per_step}


def pick(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags ``names`` as keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names}


def augment_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags :func:`augment.get_transforms` takes."""
    return pick(args, "auto_augment", "ra_magnitude", "augmix_severity", "random_erase",
                "interpolation", "val_resize_size", "val_crop_size")


def check_args(args: argparse.Namespace, world_size: int
               ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Flags that contradict each other: one sentence each, before anything is read. Returns a
    copy of ``args`` completed (torchvision's recipe and data layout), and the defaults of the
    flags a continued run takes from its run (:func:`run_flags`)."""
    args = argparse.Namespace(**vars(args))  # main(args) twice: the same run
    args.data_path, args.val_path = imagenet_layout(  # D holding train/ and val/: D/train, D/val
        args.data_path, args.val_path, eval_only=args.eval_only)
    flags, val_sizes = resolve_recipe(  # torchvision's flags keep its meanings and defaults
        **pick(args, "opt", "lr_scheduler", "lr_step_size", "lr_gamma", "scale_lr"))
    vars(args).update(flags)  # recorded: a continued run compares them with its own
    defaults = {**RUN_DEFAULTS, **val_sizes}  # given sizes, or the continued run's, come first
    if args.lr_warmup_epochs >= args.epochs:
        raise ConfigError(f"--lr-warmup-epochs {args.lr_warmup_epochs} leaves no epoch of the "
                          f"{args.epochs} for the schedule; lower it or raise --epochs.")
    if args.model:  # a ViT's weights by name: the size they were trained at
        defaults["img_size"] = weights_size(args.model, args.weights) or defaults["img_size"]
    out, data = Path(args.output_dir).resolve(), Path(args.data_path or default_demo_root())
    if not args.eval_only and out.is_relative_to(data.resolve()):
        raise ConfigError(f"--output-dir {args.output_dir} is inside the data folder {data}, "
                          "where its files would be read as images; choose another folder.")
    if args.val_rate >= 1 and not (args.eval_only or args.val_path):
        raise ConfigError("--val-rate 1 leaves no image to train on (it is for --eval-only).")
    has_model = args.weights or resume_path(args.resume, out)
    if args.eval_only and not has_model:
        raise ConfigError("--eval-only needs a model: give --resume CHECKPOINT or --weights FILE.")
    if args.freeze_layers and not has_model:
        raise ConfigError("--freeze-layers trains only the classifier on the features of "
                          "--weights, but no --weights was given; add it or drop the flag.")
    if args.world_size is not None and args.world_size != world_size:
        raise ConfigError(f"--world-size {args.world_size}, but the launcher started "
                          f"{world_size} process(es) (torchrun --nproc_per_node, srun -n).")
    check_strategy(args.strategy, world_size, compile=args.compile, comm_hook=args.comm_hook,
                   model_ema=args.model_ema)
    return args, defaults


def prepare_run(args: argparse.Namespace, info: DistInfo
                ) -> tuple[argparse.Namespace, str, str | None, str | None]:
    """``args`` checked and completed (:func:`check_args`, then :func:`run_flags` asked of rank
    0), the CPU threads set, and the data folder (the demo data made where none is given), the
    checkpoint to continue and the --weights file. A run that trains claims --output-dir, and a
    new one moves an earlier run's files aside first: the paths are given where they are then."""
    args, defaults = check_args(args, info.world_size)
    if info.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpus_per_process())  # N processes x all cores would oversubscribe
    torch.backends.cudnn.benchmark = True  # fixed image size: let cuDNN pick its fastest kernels
    out, weights = Path(args.output_dir), args.weights
    ckpt_path = resume_path(args.resume, out, eval_weights=args.eval_only and args.weights)
    vars(args).update(run_on_main(run_flags, args, ckpt_path or weights, defaults, info.world_size))
    if not args.eval_only:  # else the folder is only read
        run_on_main(claim_output_dir, out)
        ckpt_path, weights = run_on_main(move_earlier_run, out, ckpt_path, weights)
    root = args.data_path or (args.eval_only and args.val_path)  # --eval-only --val-path: alone
    root = root or str(make_demo_data(args.demo_dir or default_demo_root()))
    return args, root, ckpt_path, weights


def check_data(args: argparse.Namespace, root: str, classes: list[str], train_loader: Any,
               world_size: int) -> None:
    """The data against the flags: the class folders decide the classes, and every process needs
    a batch."""
    if args.num_classes not in (None, len(classes)):
        raise ConfigError(f"--num-classes {args.num_classes}, but {root} has {len(classes)} "
                          "classes; drop the flag, or give the data those classes.")
    if args.eval_only:
        return
    if left := len(train_loader.batch_sampler.sampler) % args.batch_size:  # drop_last
        log.info("each epoch leaves out the last %d images of each process's share of its "
                 "shuffled order (others each epoch): they make no full batch of %d", left,
                 args.batch_size)
    if len(train_loader) == 0:
        raise ConfigError(f"{len(train_loader.dataset)} training images make no batch of "
                          f"{args.batch_size} for each of {world_size} process(es); lower "
                          "--batch-size.")


def loader_options(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The DataLoaders' keyword arguments (:func:`my_dataset.loader_kwargs`), with --workers or
    as many as this process's CPUs and batch fit."""
    workers = default_workers(args.batch_size, device) if args.workers is None else args.workers
    return loader_kwargs(workers, device)


def loop_options(args: argparse.Namespace, device: torch.device) -> LoopOptions:
    """The flags as the loops' options: --amp in bf16 where the GPU has it, else fp16 with its
    GradScaler (the checkpointer saves it); NHWC by default on CUDA."""
    amp_dtype = resolve_amp_dtype(args.amp, device)
    channels_last = device.type == "cuda" if args.channels_last is None else args.channels_last
    return LoopOptions(amp_dtype=amp_dtype, channels_last=channels_last,
                       scaler=torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16),
                       **pick(args, "grad_accum_steps", "clip_grad_norm", "label_smoothing",
                              "print_freq"))


def ddp_kwargs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``DistributedDataParallel``'s arguments: the process's GPU, and the flags' buckets (as
    views of the gradients: no copy) and unused parameters (a branch that may go unused)."""
    return dict(device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **pick(args, "bucket_cap_mb", "find_unused_parameters"))


def scaled_lr(flags: dict[str, Any], images_per_step: int) -> float:
    """The optimizer's lr. The template's --lr is one process's and grows with the images per
    step (linear scaling, Goyal et al. 2017, arXiv:1706.02677: N processes average N times as
    many images); torchvision's (--no-scale-lr) is the total."""
    if flags["scale_lr"]:
        return flags["lr"] * images_per_step / flags["batch_size"]
    return flags["lr"]


def optimizer_kwargs(args: argparse.Namespace, images_per_step: int) -> dict[str, Any]:
    """The flags as :func:`make_optimizer`'s arguments, the lr scaled (:func:`scaled_lr`)."""
    return dict(lr=scaled_lr(vars(args), images_per_step), **pick(
        args, "opt", "momentum", "weight_decay", "norm_weight_decay", "bias_weight_decay",
        "transformer_embedding_decay"))


def schedule_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as :func:`lr_schedule`'s arguments."""
    return pick(args, "epochs", "lr_scheduler", "lrf", "lr_min", "lr_step_size", "lr_gamma",
                "lr_warmup_epochs", "lr_warmup_method", "lr_warmup_decay")


def ema_kwargs(args: argparse.Namespace, images_per_step: int) -> dict[str, Any]:
    """The flags as :class:`ModelEma`'s arguments: --model-ema-decay adjusted, as torchvision's,
    to the images per update and the epochs (the average spans the same share of training)."""
    adjust = images_per_step * args.model_ema_steps / args.epochs
    decay = 1.0 - min(1.0, (1.0 - args.model_ema_decay) * adjust)
    return dict(enabled=args.model_ema, decay=decay, every=args.model_ema_steps,
                warmup_epochs=args.lr_warmup_epochs)


def run_flags(args: argparse.Namespace, path: str | None, defaults: dict[str, Any],
              world_size: int) -> dict[str, Any]:
    """The values of ``defaults``' flags for this run: given, else those of the run that made
    ``path`` (a checkpoint, or weights it saved), else ``defaults``; its model checked at those
    sizes and at the batch its BatchNorm sees. ``--eval-only`` refuses a given flag the file
    contradicts (a model scored at another size is misjudged)."""
    try:
        saved = load_file(path).get("args", {}) if path else {}
    except (CheckpointError, AttributeError):  # not there or not ours: said where it is used
        saved = {}
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    if args.eval_only and (differ := [f"--{k.replace('_', '-')} {v} (it has {saved[k]})"
                                      for k, v in given.items() if saved.get(k, v) != v]):
        raise CheckpointError(f"{path} was trained with other flags than {', '.join(differ)}; "
                              "drop them: --eval-only takes them from the file.")
    run = {**defaults, **{k: saved[k] for k in defaults if k in saved}, **given}
    frozen = args.eval_only or args.freeze_layers  # BatchNorm in eval mode
    batch = args.batch_size * (world_size if args.sync_bn else 1)  # SyncBatchNorm's: all ranks
    check_model(run["model"], run["img_size"], args.weights,
                crops={"--val-crop-size": run["val_crop_size"] or run["img_size"]},
                train_batch=0 if frozen else batch)
    return run


def continued_run(state: dict[str, Any], *, path: str, classes: list[str],
                  flags: dict[str, Any] | None = None, model: nn.Module | None = None) -> None:
    """Whether the run that saved ``state`` goes on (every rank asks, before it is loaded): with
    the same classes and, if it trains (``flags``: this run's, as recorded; ``model``: its
    :func:`inert_flags`), no refused flag changed (:func:`flag_changes`); the others are said."""
    saved, part = state.get("args", {}), state.get("in_epoch")
    inert = inert_flags(model) if model is not None else ()
    refused, applied = flag_changes(saved, flags, inert) if flags else ([], [])
    if state.get("classes", classes) != classes:
        refused.append(f"the classes {classes} (the run had {state['classes']})")
    if refused:
        raise CheckpointError(f"{path} cannot be continued with {', '.join(refused)}; give the "
                              "run's values to continue it, or start a new run with --resume "
                              "none or another --output-dir.")
    if flags and saved.get("images_per_step", flags["images_per_step"]) != (
            steps := flags["images_per_step"]):
        applied.append(f"{steps} images per step (the run had {saved['images_per_step']}), "
                       f"lr {scaled_lr(flags, steps):.4g}")
    if applied and get_rank() == 0:
        start = state["epoch"] + (0 if part else 1)
        log.warning("%s: applied from epoch %d%s", ", ".join(applied), start,
                    f", step {part['batches']}" if part else "")


def flag_changes(saved: dict[str, Any], flags: dict[str, Any], inert: Collection[str] = ()
                 ) -> tuple[list[str], list[str]]:
    """(refused, applied): the flags given other values than the run ``saved`` had, as ``--lr
    0.05 (the run had 0.01)`` (a flag it did not record is not compared). ``inert``: flags this
    model does not use, never refused."""
    def flag(key: str, value: Any, bare: bool = False) -> str:
        name = key.replace("_", "-")
        if value is None:
            return f"no --{name}"
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        return str(value) if bare else f"--{name} {value}"

    saved, said = {**BEFORE_RECIPES, **saved}, ([], [])
    if not (saved["ra_sampler"] or flags.get("ra_sampler")):  # no repeats: --ra-reps unused
        inert = {*inert, "ra_reps"}
    for key, value in sorted(flags.items()):
        if key in NOT_COMPARED or key not in saved or saved[key] == value:
            continue
        refused = key in REFUSED or key in ONE_RUN_ONLY and None in (value, saved[key])
        said[0 if refused and key not in inert else 1].append(
            f"{flag(key, value)} (the run had {flag(key, saved[key], bare=True)})")
    return said


# A continued run compares each flag with the run's (docs/resume-and-restarts.md). Refused:
# another value would put validation images into training (the split), or the saved state would
# not fit (the parameters, their training: the optimizer state's kind, the stopped epoch's order).
REFUSED = ("model", "freeze_layers", "seed", "val_rate", "weights", "opt", "ra_sampler", "ra_reps")
# Refused when given to one run only: --val-path moves images between training and validation;
# a weight decay of its own changes the optimizer's groups.
ONE_RUN_ONLY = ("val_path", "norm_weight_decay", "bias_weight_decay",
                "transformer_embedding_decay")
BEFORE_RECIPES = {  # what runs saved before torchvision's recipe flags trained with
    "opt": "sgd", "lr_scheduler": "cosine", "lr_warmup_epochs": 0, "label_smoothing": 0.0,
    "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "auto_augment": None, "random_erase": 0.0,
    "model_ema": False, "ra_sampler": False, "ra_reps": 3, "norm_weight_decay": None,
    "bias_weight_decay": None, "transformer_embedding_decay": None}
NOT_COMPARED = ("output_dir", "resume", "local_rank", "eval_only", "world_size", "images_per_step")
# Not given, these are the run's (run_flags); a new run's defaults:
RUN_DEFAULTS = {"model": "resnet34", "img_size": 224, "val_resize_size": None,
                "val_crop_size": None, "interpolation": "bilinear"}


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Data-parallel image classification: DDP or FSDP.",
                                     add_help=add_help, formatter_class=HelpFormatter)
    count, positive, nonnegative = number(int, 1), number(float, 0, above=True), number(float, 0)
    fraction, seed = number(float, 0, 1), number(int, 0, 2**32 - 1)  # numpy's seed range
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", "--data_path", type=path_flag,
                       help="a folder with a sub-folder of images per class, or a shard index "
                       "(docs/shards.md) (default: demo data)")
    group.add_argument("--demo-dir", type=path_flag, help="where the demo data is generated")
    group.add_argument("--val-rate", type=fraction, default=0.2, help="held out per class")
    group.add_argument("--val-path", type=path_flag, help="a validation folder or shard index")
    group.add_argument("--shard-cache", type=path_flag,
                       help="where http shards are downloaded (default: $TMPDIR/shard-cache)")
    group.add_argument("--img-size", "--train-crop-size", dest="img_size", type=count,
                       help="training crop (default: the run's, or 224)")
    group.add_argument("--val-resize-size", type=count,
                       help="(default: --img-size x 256/224; torchvision's flags: 256)")
    group.add_argument("--val-crop-size", type=count,
                       help="(default: --img-size; torchvision's flags: 224)")
    group.add_argument("--num-classes", "--num_classes", type=count,
                       help="checked: must equal the number of class folders")
    group.add_argument("--workers", "-j", type=number(int, 0),
                       help="per process (GPU: CPUs-1, CPU: <=8)")
    group.add_argument("--decode", default="auto", choices=["auto", "workers", "device"],
                       help="JPEGs decoded by the loader workers or on --device (auto: workers)")
    group.add_argument("--verify-images", action=BoolFlag, default=False,
                       help="read every image's header before training (else the loader skips)")
    group = parser.add_argument_group("model")
    group.add_argument("--model", help="any torchvision model (default: the run's, or resnet34)")
    group.add_argument("--weights", type=path_flag,
                       help="a file, or torchvision's ResNet50_Weights.DEFAULT (what fits loads)")
    group.add_argument("--freeze-layers", "--freeze_layers", action=BoolFlag, default=False,
                       help="train only the classifier (fc, classifier, heads, ...)")
    group.add_argument("--sync-bn", "--syncBN", dest="sync_bn", action=BoolFlag, default=True,
                       help="BatchNorm statistics over the global batch")
    group = parser.add_argument_group("optimisation")
    group.add_argument("--epochs", type=count, default=30, help="in all, resumed ones included")
    group.add_argument("--batch-size", "--batch_size", "-b", type=count, default=16,
                       help="per process")
    group.add_argument("--lr", type=positive, default=0.001,
                       help="for one process's batch (torchvision's flags: the whole batch's)")
    group.add_argument("--scale-lr", action=BoolFlag, help="lr x world size x --grad-accum-steps "
                       "(default: on; off with --opt, --lr-scheduler, --lr-step-size, --lr-gamma)")
    group.add_argument("--lrf", type=nonnegative, default=0.1, help="final lr / initial lr")
    group.add_argument("--momentum", type=nonnegative, default=0.9, help="SGD/RMSprop momentum")
    group.add_argument("--weight-decay", "--wd", type=nonnegative, default=0.005, help="L2 penalty")
    group.add_argument("--grad-accum-steps", type=count, default=1, help="step every K batches")
    group.add_argument("--clip-grad-norm", type=positive, help="max gradient norm")
    group = parser.add_argument_group("torchvision's recipe (docs/recipes.md)")
    group.add_argument("--opt", choices=OPTIMIZERS, help="(default: sgd); given, it and the "
                       "three below mean what they do in torchvision: --lr the total, val 224")
    group.add_argument("--lr-scheduler", choices=SCHEDULES, help="(default: cosine, or steplr "
                       "with --lr-step-size or --lr-gamma); stepped once per epoch")
    group.add_argument("--lr-step-size", type=number(int, 1), help="steplr (default: 30)")
    group.add_argument("--lr-gamma", type=nonnegative, help="steplr/exponentiallr (default: 0.1)")
    group.add_argument("--lr-min", type=nonnegative, default=0.0, help="cosineannealinglr")
    group.add_argument("--lr-warmup-epochs", type=number(int, 0), default=0, help="epochs")
    group.add_argument("--lr-warmup-method", choices=["linear", "constant"], default="constant",
                       help="from lr x decay, or at it")
    group.add_argument("--lr-warmup-decay", type=number(float, 0, 1, above=True), default=0.01,
                       help="first lr factor")
    group.add_argument("--label-smoothing", type=fraction, default=0.0, help="training loss")
    for name in ("mixup", "cutmix"):
        group.add_argument(f"--{name}-alpha", type=nonnegative, default=0.0,
                           help=f"{name} on each batch, lam ~ Beta(alpha, alpha)")
    group.add_argument("--auto-augment", choices=AUTO_AUGMENT, help="policy (default: none)")
    group.add_argument("--ra-magnitude", type=number(int, 0), default=9, help="--auto-augment ra")
    group.add_argument("--augmix-severity", type=number(int, 1, 10), default=3, help="augmix")
    group.add_argument("--random-erase", type=fraction, default=0.0, help="probability")
    group.add_argument("--interpolation", choices=["nearest", "bilinear", "bicubic"],
                       help="(default: the run's, or bilinear)")
    group.add_argument("--model-ema", action=BoolFlag, default=False, help="an EMA of the weights")
    group.add_argument("--model-ema-steps", type=number(int, 1), default=32, help="between updates")
    group.add_argument("--model-ema-decay", type=fraction, default=0.99998,
                       help="adjusted to the images per update and the epochs, as torchvision")
    for name in ("norm", "bias"):
        group.add_argument(f"--{name}-weight-decay", type=nonnegative,
                           help=f"for {name} parameters (default: --weight-decay)")
    group.add_argument("--transformer-embedding-decay", type=nonnegative,
                       help="for class token and position embeddings (default: --weight-decay)")
    group.add_argument("--ra-sampler", action=BoolFlag, default=False, help="repeated augmentation")
    group.add_argument("--ra-reps", type=number(int, 1), default=3, help="--ra-sampler")
    group = parser.add_argument_group("speed")
    group.add_argument("--amp", action=BoolFlag, help="mixed precision (default: on for CUDA)")
    group.add_argument("--channels-last", action=BoolFlag, help="NHWC (default: on for CUDA)")
    group.add_argument("--compile", action=BoolFlag, default=False, help="torch.compile")
    group.add_argument("--bucket-cap-mb", type=positive, default=25.0, help="DDP bucket size")
    group.add_argument("--comm-hook", default="none", choices=COMM_HOOKS, help="16-bit all-reduce")
    group.add_argument("--find-unused-parameters", action=BoolFlag, default=False,
                       help="ddp: a model whose forward skips some parameters (fsdp needs none)")
    group = parser.add_argument_group("distributed")
    group.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="fsdp: each holds 1/N")
    group.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                       help="auto: CUDA if available (NCCL), else CPU (gloo)")
    group.add_argument("--dist-url", "--dist_url", default="env://", help="or tcp://HOST:PORT")
    group.add_argument("--dist-timeout", type=positive, help="seconds a peer is waited for")
    group.add_argument("--world-size", "--world_size", type=count, help="processes to start")
    group.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    group = parser.add_argument_group("run")
    group.add_argument("--output-dir", type=path_flag, default="runs/train", help="the run's files")
    group.add_argument("--resume", type=path_flag, default="auto",
                       help="auto: <output-dir>/checkpoint.pth if there; none; or a checkpoint")
    group.add_argument("--keep-last", type=number(int, 0), default=0, help="weights kept (0: all)")
    group.add_argument("--save-every-steps", type=number(int, 0), default=0, help="mid-epoch too")
    group.add_argument("--eval-only", "--test-only", dest="eval_only", action=BoolFlag,
                       default=False, help="evaluate the --resume/--weights model and exit")
    group.add_argument("--seed", type=seed, default=0, help="split, shuffle, init")
    group.add_argument("--print-freq", type=count, default=50, help="log every N steps")
    group.add_argument("--tensorboard", action=BoolFlag, default=True, help="rank 0 logs curves")
    return parser
