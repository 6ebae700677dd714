"""Data-parallel image classification with DistributedDataParallel: the whole recipe in main().

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path flower_photos
    python -m torch.distributed.launch --use_env --nproc_per_node=4 train_multi_gpu_using_launch.py
    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --device cpu    # gloo, no GPU
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        train_multi_gpu_using_launch.py ...                                    # two machines
    torchrun --nproc_per_node=4 --max-restarts=3 train_multi_gpu_using_launch.py  # resumes all
    srun python train_multi_gpu_using_launch.py ...                           # SLURM, task per GPU
    python train_multi_gpu_using_launch.py ...                                # one process

Every process runs main() on its own share of the data; DDP averages the gradients, so all hold
the same weights after each step (fsdp: 1/N of them each). The spawn launcher runs main() too.
"""

import argparse
import logging
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from model import check_model, freeze_backbone, get_model, load_weights, weights_size
from multi_train_utils.checkpoint import (load_checkpoint, load_model, recorded_defaults,
                                          restore, save_checkpoint, step_saves)
from multi_train_utils.data import EpochProgress, ResumableSampler
from multi_train_utils.distributed_utils import (COMM_HOOKS, DistInfo, cleanup,
                                                 cpus_per_process, get_world_size,
                                                 init_distributed_mode, register_comm_hook,
                                                 run_on_main)
from multi_train_utils.guard import ConfigError, guarded, stop_requests
from multi_train_utils.heartbeat import Heartbeat
from multi_train_utils.run_folder import (claim_output_dir, move_earlier_run, rerun_hint,
                                          resume_path, write_metrics)
from multi_train_utils.recipe import (OPTIMIZERS, SCHEDULES, BatchMix, ModelEma, inert_flags,
                                      lr_schedule, make_optimizer, resolve_recipe)
from multi_train_utils.strategy import STRATEGIES, check_strategy, shard_model
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (LoopOptions, evaluate, format_report,
                                               resolve_amp_dtype, train_one_epoch)
from my_dataset import MyDataSet, default_workers, loader_kwargs
from utils import (AUTO_AUGMENT, BoolFlag, HelpFormatter, augment_flags, default_demo_root,
                   epoch_record, get_transforms, imagenet_layout, log_epoch, make_demo_data,
                   number, path_flag, scan_image_folder, split_train_val, tensorboard_writer,
                   write_json_atomic, write_scan_files)

log = logging.getLogger("train")
RUN_DEFAULTS = {"model": "resnet34", "img_size": 224,  # unless the run resumed had others
                "val_resize_size": None, "val_crop_size": None, "interpolation": "bilinear"}


def main(args: argparse.Namespace) -> None:
    # 1. Processes: torchrun/srun/spawn tell each process its rank; NCCL on GPUs, gloo on CPU.
    info = init_distributed_mode(device=args.device, dist_url=args.dist_url,
                                 timeout_s=args.dist_timeout, trace_dir=args.output_dir)
    args, defaults = check_args(args, info.world_size)  # a copy, completed; the run's defaults
    device, out, weights = info.device, Path(args.output_dir), args.weights
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts anyway)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpus_per_process())  # N processes x all cores would oversubscribe
    torch.backends.cudnn.benchmark = True  # fixed image size: let cuDNN pick its fastest kernels
    ckpt_path = resume_path(args.resume, out, eval_weights=args.eval_only and args.weights)
    vars(args).update(run_on_main(run_flags, args, ckpt_path or weights, defaults))  # checked
    if not args.eval_only:  # then one run per folder: a fresh start moves an earlier run aside
        run_on_main(claim_output_dir, out)
        ckpt_path, weights = run_on_main(move_earlier_run, out, ckpt_path, weights)

    # 2. Data. Rank 0 lists the folder, or reuses the run's list; each machine reads it as its own.
    root = args.data_path or (args.eval_only and args.val_path) or str(make_demo_data(
        args.demo_dir or default_demo_root()))  # --eval-only --val-path: that folder alone
    scan = run_on_main(scan_image_folder, root, verify=args.verify_images, reuse=out).rebased(root)
    classes = scan.classes
    if args.num_classes not in (None, len(classes)):  # the class folders decide; say a mismatch
        raise ConfigError(f"--num-classes {args.num_classes}, but {root} has {len(classes)} class "
                          "folders; drop the flag, or give the folder those classes.")
    val_scan = (run_on_main(scan_image_folder, args.val_path, verify=args.verify_images,
                            min_classes=1).rebased(args.val_path) if args.val_path else None)
    # A file's side depends only on its name and --seed: stable as the folder grows.
    train_paths, train_labels, val_paths, val_labels = split_train_val(
        scan, args.val_rate, args.seed, val_scan=val_scan)  # --val-path: all of the rest trains
    transforms = get_transforms(args.img_size, args.decode, **augment_flags(args))  # workers'
    skip_log = None if args.eval_only else out / "skipped_files.txt"
    train_set = MyDataSet(train_paths, train_labels, transforms["train"], seed=args.seed,
                          skip_log=skip_log, replace_unreadable=True)
    val_set = MyDataSet(val_paths, val_labels, transforms["val"], skip_log=skip_log)
    # Each rank draws its own 1/N of a new permutation each epoch (set_epoch; after a stop, the
    # rest of it); the validation sampler pads to a multiple of N, and evaluate() drops the pad.
    train_sampler = ResumableSampler(train_set, info.world_size, info.rank, seed=args.seed,
                                     repeats=args.ra_reps if args.ra_sampler else 1)
    val_sampler = DistributedSampler(val_set, info.world_size, info.rank, shuffle=False)
    # drop_last: every rank takes the same number of steps, or DDP would wait for a missing one.
    train_batch_sampler = BatchSampler(train_sampler, args.batch_size, drop_last=True)
    workers = default_workers(args.batch_size, device) if args.workers is None else args.workers
    kwargs = loader_kwargs(workers, device)  # workers, pinned memory, timeout: my_dataset.py
    train_loader = DataLoader(train_set, batch_sampler=train_batch_sampler, **kwargs)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, **kwargs)
    if len(train_loader) == 0 and not args.eval_only:
        raise ConfigError(f"{len(train_set)} training images make no batch of {args.batch_size} "
                          f"for each of {info.world_size} process(es); lower --batch-size.")

    # 3. Model. Only rank 0 reads --weights: DDP copies its weights when it wraps, and under
    # fsdp the others build on the meta device (no memory), their shards filled from rank 0's.
    fsdp = info.world_size > 1 and args.strategy == "fsdp"
    with torch.device("meta" if fsdp and info.rank > 0 else "cpu"):
        model = get_model(args.model, num_classes=len(classes), img_size=args.img_size)
    if weights and ckpt_path is None:
        run_on_main(load_weights, model, weights, args.model, strict=args.eval_only)
    if args.freeze_layers:
        freeze_backbone(model)  # only the classifier trains; BatchNorm statistics as loaded
    if args.sync_bn and info.distributed:
        model = convert_sync_batchnorm(model, device)  # over the global batch; ours on CPU
    channels_last = device.type == "cuda" if args.channels_last is None else args.channels_last
    if not fsdp:  # fsdp: shard_model puts each rank's shards there
        model.to(device, memory_format=torch.channels_last) if channels_last else model.to(device)
    amp_dtype = resolve_amp_dtype(args.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    loop = LoopOptions(amp_dtype=amp_dtype, channels_last=channels_last, scaler=scaler,
                       grad_accum_steps=args.grad_accum_steps, clip_grad_norm=args.clip_grad_norm,
                       label_smoothing=args.label_smoothing, print_freq=args.print_freq)
    model_without_ddp = model  # what is saved: no "module." prefix in the files
    if fsdp:  # each keeps 1/N, all-gathers a residual block at a time
        model = shard_model(model, device, mixed_precision=amp_dtype)  # in place, unwrapped
    elif info.distributed:  # each rank keeps all, all-reduces the gradients
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True,
            find_unused_parameters=args.find_unused_parameters)  # a branch that may go unused
        register_comm_hook(model, args.comm_hook)
    if args.compile:
        model = torch.compile(model)
    if args.eval_only:  # the model alone (--weights: loaded above); it needs no optimizer
        if ckpt_path:
            load_model(load_checkpoint(ckpt_path, args, classes), model_without_ddp)
        log.info(format_report(evaluate(model, val_loader, device, loop), classes))
        return cleanup()

    # 4. Optimizer and schedule: SGD on a cosine, or torchvision's recipe (--opt, ...: recipe.py).
    images_per_step = info.world_size * args.batch_size * args.grad_accum_steps
    optimizer = make_optimizer(model_without_ddp, args, images_per_step)  # SGD by default
    scheduler = lr_schedule(optimizer, args)  # a LambdaLR, once per epoch
    ema = ModelEma.create(model_without_ddp, args, images_per_step, device)  # --model-ema
    mix = BatchMix.create(args, len(classes))  # --mixup-alpha, --cutmix-alpha

    # 5. Resume: weights, optimizer, RNG, the schedule's place and the epoch's (its next batch).
    start_epoch, best_acc, best_loss, history, progress = 0, 0.0, math.inf, [], EpochProgress()
    if ckpt_path:
        ckpt = load_checkpoint(ckpt_path, args, classes, inert_flags(model_without_ddp))
        start_epoch, best_acc, best_loss, history, progress = restore(
            ckpt, model_without_ddp, optimizer, scheduler, scaler, images_per_step, ema=ema)
        scan.resume_epoch(progress, ckpt, out, train_paths)  # a stopped epoch: its own images
    run_on_main(write_metrics, out, history)  # each finished epoch once, as the checkpoint says
    if start_epoch >= args.epochs:
        log.info("%s holds epochs 0-%d, so --epochs %d leaves nothing to train.", out,
                 start_epoch - 1, args.epochs)
        return cleanup()
    run_on_main(write_scan_files, out, scan)  # rank 0 alone writes: the others would race
    run_on_main(write_json_atomic, out / "args.json", run_args(args, info, images_per_step))
    writer = tensorboard_writer(out, start_epoch, train_set) if args.tensorboard else None
    log.info("%d process(es) on %s, %d images per step, lr %.3g, %d loader workers, amp %s, "
             "epochs %d-%d", info.world_size, device, images_per_step,
             optimizer.param_groups[0]["lr"], workers, amp_dtype, start_epoch, args.epochs - 1)

    # 6. Epochs; the loss and accuracy are already reduced over all ranks. At a stop signal the
    # ranks agree on a step, save there and exit; the same command continues at that batch.
    with stop_requests() as stop, Heartbeat(info) as heartbeat:  # names a rank that hangs
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch, skip=progress.samples, indices=progress.indices)
            train_set.set_epoch(epoch)  # augmentation drawn from (seed, epoch, image): resumable
            state = {"epoch": epoch, "best_acc": best_acc, "best_loss": best_loss,
                     "classes": classes, "args": run_args(args, info, images_per_step),
                     "metrics": history, "file_list": progress.file_list or scan.digest}
            save = partial(save_checkpoint, out, model_without_ddp, optimizer, scaler, state,
                           ema=ema, heartbeat=heartbeat)
            t0 = time.perf_counter()
            train_loss = train_one_epoch(
                model, optimizer, train_loader, device, epoch, loop, progress=progress,
                after_step=step_saves(stop, save, every=args.save_every_steps), mix=mix, ema=ema,
                heartbeat=heartbeat)
            if progress.stopped:  # saved at the step every rank stopped after
                stop.stop()
            train_seconds, lr = time.perf_counter() - t0, optimizer.param_groups[0]["lr"]
            scheduler.step()
            result, ema_result = (None if m is None else evaluate(
                m, val_loader, device, loop, heartbeat=heartbeat)
                for m in (model, ema))  # --model-ema: the average's figures too
            images = len(train_loader) * args.batch_size * info.world_size
            record = epoch_record(epoch, train_loss, result, lr, time.perf_counter() - t0,
                                  images_per_sec=images / train_seconds, ema=ema_result)
            history.append(record)
            is_best = (result.top1, -result.loss) > (best_acc, -best_loss)  # a tie: lower loss
            if is_best:
                best_acc, best_loss = result.top1, result.loss
            state.update(best_acc=best_acc, best_loss=best_loss)
            last = epoch + 1 == args.epochs  # fsdp: its save also exports the last and best weights
            save(record=record, is_best=is_best, keep_last=args.keep_last, final=last)
            if writer:
                log_epoch(writer, record)
            if not last and stop.poll(lag=False):  # a signal during evaluation or the save
                stop.stop()
            progress = EpochProgress()
    cleanup()


def run_args(args: argparse.Namespace, info: DistInfo, images_per_step: int) -> dict:
    """The flags as recorded in args.json and every checkpoint (a resume compares them)."""
    return {**vars(args), "world_size": info.world_size, "images_per_step": images_per_step}


def check_args(args: argparse.Namespace, world_size: int
               ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Flags that contradict each other: one sentence each, before anything is read. Returns
    ``args`` with the flags that follow from others filled in (logged): torchvision's recipe,
    its data layout; and the defaults for flags a continued run takes from its checkpoint."""
    args = argparse.Namespace(**vars(args))  # main(args) twice: the same run
    imagenet_layout(args)  # D/train and D/val: --data-path D/train --val-path D/val
    defaults = {**RUN_DEFAULTS, **resolve_recipe(args)}
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


def run_flags(args: argparse.Namespace, path: str | None, defaults: dict[str, Any],
              world_size: int | None = None) -> dict[str, Any]:
    """The values of ``defaults``' flags for this run: given, else those of the run that made
    ``path`` (:func:`recorded_defaults`), else ``defaults``; and its model checked at those crops
    and at the batch its BatchNorm sees (SyncBatchNorm's: every process's). ``main`` asks rank 0
    before an earlier run's files move aside, so a refused flag leaves them where they were."""
    args = recorded_defaults(args, path, defaults)
    world_size = world_size or get_world_size()
    frozen = args.eval_only or args.freeze_layers  # BatchNorm in eval mode
    check_model(args.model, args.img_size, args.weights,
                crops={"--val-crop-size": args.val_crop_size or args.img_size},
                train_batch=0 if frozen else args.batch_size * (world_size if args.sync_bn else 1))
    return {k: getattr(args, k) for k in defaults}


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=add_help,
                                     formatter_class=HelpFormatter)
    count, positive, nonnegative = number(int, 1), number(float, 0, above=True), number(float, 0)
    fraction, seed = number(float, 0, 1), number(int, 0, 2**32 - 1)  # numpy's seed range
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", "--data_path", type=path_flag,
                       help="a folder with a sub-folder of images per class (default: demo data)")
    group.add_argument("--demo-dir", type=path_flag, help="where the demo data is generated")
    group.add_argument("--val-rate", type=fraction, default=0.2, help="held out per class")
    group.add_argument("--val-path", type=path_flag, help="a separate validation folder")
    group.add_argument("--img-size", "--train-crop-size", dest="img_size", type=count,
                       help="training crop (default: the run's, or 224)")
    group.add_argument("--val-resize-size", type=count,
                       help="(default: img-size x 256/224; torchvision's flags: 256)")
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
    group.add_argument("--weight-decay", "--wd", type=nonnegative, default=0.005,
                       help="L2 penalty of every parameter trained (groups: --norm-weight-decay)")
    group.add_argument("--grad-accum-steps", type=count, default=1, help="step every K batches")
    group.add_argument("--clip-grad-norm", type=positive, help="max gradient norm")
    recipe_flags(parser.add_argument_group("torchvision's recipe (docs/recipes.md)"))
    group = parser.add_argument_group("speed")
    group.add_argument("--amp", action=BoolFlag, help="mixed precision (default: on for CUDA)")
    group.add_argument("--channels-last", action=BoolFlag, help="NHWC (default: on for CUDA)")
    group.add_argument("--compile", action=BoolFlag, default=False, help="torch.compile")
    group.add_argument("--bucket-cap-mb", type=positive, default=25.0, help="DDP bucket size")
    group.add_argument("--comm-hook", default="none", choices=COMM_HOOKS,
                       help="all-reduce gradients in 16 bits (half the bytes, rounded)")
    group.add_argument("--find-unused-parameters", action=BoolFlag, default=False,
                       help="ddp: a model whose forward skips some parameters (fsdp needs none)")
    group = parser.add_argument_group("distributed")
    group.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="fsdp: each holds 1/N")
    group.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                       help="auto: CUDA if available (NCCL), else CPU (gloo)")
    group.add_argument("--dist-url", "--dist_url", default="env://", help="or tcp://HOST:PORT")
    group.add_argument("--dist-timeout", type=positive, help="seconds a collective waits for a "
                       "peer (default: 600 at start-up, evaluation and saves; 120 a step)")
    group.add_argument("--world-size", "--world_size", type=count,
                       help="processes (spawn launcher; elsewhere the launcher decides)")
    group.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    group = parser.add_argument_group("run")
    group.add_argument("--output-dir", type=path_flag, default="runs/train", help="the run's files")
    group.add_argument("--resume", type=path_flag, default="auto",
                       help="auto: <output-dir>/checkpoint.pth if there; none; or a checkpoint")
    group.add_argument("--keep-last", type=number(int, 0), default=0,
                       help="keep the newest K weights/model-N.pth (0: all)")
    group.add_argument("--save-every-steps", type=number(int, 0), default=0,
                       help="also save mid-epoch every K optimizer steps (0: at signals only)")
    group.add_argument("--eval-only", "--test-only", dest="eval_only", action=BoolFlag,
                       default=False, help="evaluate the --resume/--weights model and exit")
    group.add_argument("--seed", type=seed, default=0, help="split, shuffle, init")
    group.add_argument("--print-freq", type=count, default=50, help="log every N steps")
    group.add_argument("--tensorboard", action=BoolFlag, default=True, help="rank 0 logs curves")
    return parser


def recipe_flags(group: argparse._ArgumentGroup) -> None:
    """torchvision's training-recipe flags, with its names and defaults (all off here)."""
    nonnegative, fraction = number(float, 0), number(float, 0, 1)
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
    group.add_argument("--augmix-severity", type=number(int, 1, 10), default=3,
                       help="--auto-augment augmix")
    group.add_argument("--random-erase", type=fraction, default=0.0, help="probability")
    group.add_argument("--interpolation", choices=["nearest", "bilinear", "bicubic"],
                       help="(default: the run's, or bilinear)")
    group.add_argument("--model-ema", action=BoolFlag, default=False, help="evaluate and save "
                       "an exponential moving average of the weights too")
    group.add_argument("--model-ema-steps", type=number(int, 1), default=32,
                       help="optimizer steps between updates")
    group.add_argument("--model-ema-decay", type=fraction, default=0.99998,
                       help="adjusted to the images per update and the epochs, as torchvision")
    for name in ("norm", "bias"):
        group.add_argument(f"--{name}-weight-decay", type=nonnegative,
                           help=f"for {name} parameters (default: --weight-decay)")
    group.add_argument("--transformer-embedding-decay", type=nonnegative,
                       help="for class token and position embeddings (default: --weight-decay)")
    group.add_argument("--ra-sampler", action=BoolFlag, default=False, help="repeated "
                       "augmentation: each image --ra-reps times in a row, in other crops")
    group.add_argument("--ra-reps", type=number(int, 1), default=3, help="--ra-sampler")

if __name__ == "__main__":
    cli_args = get_args_parser().parse_args()
    guarded(main, cli_args, rerun_hint=lambda: rerun_hint(cli_args.output_dir, cli_args.resume))
