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
import json
import logging
import time
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from augment import get_transforms
from image_folder import FolderScan, scan_image_folder, split_train_val
from model import freeze_backbone, get_model, load_weights
from multi_train_utils.checkpoint import (Checkpointer, ModelState, OptimizerState, RNGState,
                                          TrainState, step_saves)
from multi_train_utils.data import ResumableSampler
from multi_train_utils.distributed_utils import (DistInfo, cleanup, init_distributed_mode,
                                                 register_comm_hook, run_on_main)
from multi_train_utils.guard import guarded, stop_requests
from multi_train_utils.heartbeat import Heartbeat
from multi_train_utils.recipe import BatchMix, ModelEma, lr_schedule, make_optimizer
from multi_train_utils.run_folder import rerun_hint
from multi_train_utils.strategy import shard_model
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (LoopOptions, evaluate, format_report,
                                                train_one_epoch)
from my_dataset import MyDataSet
from run_log import epoch_record, log_epoch, tensorboard_writer, write_json_atomic
from shards import ShardIndex, is_shard_index, open_shards
from train_flags import (augment_kwargs, check_data, continued_run, ddp_kwargs, ema_kwargs,
                         get_args_parser, loader_options, loop_options, optimizer_kwargs,
                         prepare_run, run_args, schedule_kwargs)

log = logging.getLogger("train")


def main(args: argparse.Namespace) -> None:
    # 1. Processes: torchrun/srun/spawn tell each process its rank; NCCL on GPUs, gloo on CPU.
    info = init_distributed_mode(device=args.device, dist_url=args.dist_url,
                                 timeout_s=args.dist_timeout, trace_dir=args.output_dir)
    args, root, ckpt_path, weights = prepare_run(args, info)  # check_args: flags, val sizes
    device, out = info.device, Path(args.output_dir)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts anyway)

    # 2. Data. Rank 0 lists the folder, or reuses the run's list; each machine reads it as its own.
    transforms = get_transforms(args.img_size, args.decode, **augment_kwargs(args))  # workers'
    skip_log = None if args.eval_only else out / "skipped_files.txt"
    if is_shard_index(root):  # tar shards, local or over http (shards.py): sample i is [i]
        scan, train_set, val_set = open_shards(
            root, args.val_path, transforms, seed=args.seed, skip_log=skip_log,
            cache_dir=args.shard_cache, num_classes=args.num_classes)
    else:
        scan = run_on_main(scan_image_folder, root, verify=args.verify_images,
                           reuse=out).rebased(root)
        val_scan = args.val_path and run_on_main(scan_image_folder, args.val_path, min_classes=1,
                                                 verify=args.verify_images).rebased(args.val_path)
        train_paths, train_labels, val_paths, val_labels = split_train_val(  # by name, --seed:
            scan, args.val_rate, args.seed, val_scan=val_scan)  # stable as the folder grows
        train_set = MyDataSet(train_paths, train_labels, transforms["train"], seed=args.seed,
                              skip_log=skip_log, replace_unreadable=True)
        val_set = MyDataSet(val_paths, val_labels, transforms["val"], skip_log=skip_log)
    # Each rank draws its 1/N of each epoch's order; validation pads to N, evaluate() drops it.
    train_sampler = ResumableSampler(train_set, info.world_size, info.rank, seed=args.seed,
                                     repeats=args.ra_reps if args.ra_sampler else 1)
    val_sampler = DistributedSampler(val_set, info.world_size, info.rank, shuffle=False)
    # drop_last: every rank takes the same number of steps, or DDP would wait for a missing one.
    train_batch_sampler = BatchSampler(train_sampler, args.batch_size, drop_last=True)
    kwargs = loader_options(args, device)  # workers, pinned memory, timeout: my_dataset.py
    train_loader = DataLoader(train_set, batch_sampler=train_batch_sampler, **kwargs)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, **kwargs)
    check_data(args, root, scan.classes, train_loader, info.world_size)  # --num-classes, a batch

    # 3. Model on its device (rank 0 reads --weights), SyncBN, then DDP or FSDP wraps it.
    loop = loop_options(args, device)  # precision (bf16, else fp16 scaled), NHWC, clipping, ...
    fsdp = info.world_size > 1 and args.strategy == "fsdp"
    model = build_model(args, info, len(scan.classes), None if ckpt_path else weights, fsdp=fsdp,
                        channels_last=loop.channels_last)
    if args.sync_bn and info.distributed:
        model = convert_sync_batchnorm(model, device)  # over the global batch; ours on CPU
    model_without_ddp = model  # what is saved: no "module." prefix in the files
    if fsdp:  # each keeps 1/N, all-gathers a residual block at a time
        model = shard_model(model, device, mixed_precision=loop.amp_dtype)  # in place, unwrapped
    elif info.distributed:  # each rank keeps all, all-reduces the gradients
        model = DistributedDataParallel(model, **ddp_kwargs(args, device))  # its device, buckets
        register_comm_hook(model, args.comm_hook)
    model = torch.compile(model) if args.compile else model
    if args.eval_only:  # the model alone (--weights: loaded above); it needs no optimizer
        return evaluate_only(model, val_loader, device, loop, scan.classes, ckpt_path,
                             Checkpointer(out, {"model": ModelState(model_without_ddp)}))

    # 4. Optimizer (--opt: recipe.py); lr: --lr x images per step / --batch-size (scaled_lr).
    images_per_step = info.world_size * args.batch_size * args.grad_accum_steps
    optimizer = make_optimizer(model_without_ddp, **optimizer_kwargs(args, images_per_step))
    ema = ModelEma.create(model_without_ddp, **ema_kwargs(args, images_per_step))  # --model-ema
    mix = BatchMix.create(len(scan.classes), args.mixup_alpha, args.cutmix_alpha, seed=args.seed)

    # 5. Resume: each resumable part registered once; loading and saving are one call each.
    train = TrainState(scan.classes, run_args(args, info, images_per_step), file_list=scan.digest)
    checkpointer = Checkpointer(out, {
        "model": ModelState(model_without_ddp),
        "optimizer": OptimizerState(model_without_ddp, optimizer), "scaler": loop.scaler,
        "model_ema": ema, "rng_states": RNGState(), "train": train},
        keep_last=args.keep_last, heartbeat=Heartbeat(info))  # it names a rank that hangs
    if ckpt_path:  # refused flags stop it here (train_flags.continued_run); the others apply
        checkpointer.load(ckpt_path, partial(continued_run, path=ckpt_path, classes=scan.classes,
                                             flags=train.flags, model=model_without_ddp))
        scan.resume_epoch(train.progress, train.saved, out, train_set.images_path)
    scheduler = lr_schedule(optimizer, **schedule_kwargs(args), start_epoch=train.epoch)
    if not run_on_main(start_run, out, scan, train, device, optimizer, kwargs, loop):
        return cleanup()  # the run holds --epochs epochs already
    writer = tensorboard_writer(out, train.epoch, train_set) if args.tensorboard else None

    # 6. Epochs; the loss and accuracy are already reduced over all ranks. At a stop signal the
    # ranks agree on a step, save there and exit; the same command continues at that batch.
    with stop_requests() as stop, checkpointer.heartbeat as heartbeat:
        for epoch in range(train.epoch, args.epochs):
            train.epoch, t0 = epoch, time.perf_counter()
            train_sampler.set_epoch(epoch, skip=train.progress.samples,
                                    indices=train.progress.indices)
            train_set.set_epoch(epoch)  # augmentation drawn from (seed, epoch, image): resumable
            train_loss = train_one_epoch(
                model, optimizer, train_loader, device, epoch, loop, progress=train.progress,
                after_step=step_saves(stop, checkpointer.save, every=args.save_every_steps),
                mix=mix, ema=ema, heartbeat=heartbeat)
            if train.progress.stopped:  # saved at the step every rank stopped after
                stop.stop()
            train_seconds, lr = time.perf_counter() - t0, optimizer.param_groups[0]["lr"]
            scheduler.step()
            result, ema_result = (None if m is None else evaluate(
                m, val_loader, device, loop, heartbeat=heartbeat) for m in (model, ema))
            images = len(train_loader) * args.batch_size * info.world_size
            record = epoch_record(epoch, train_loss, result, lr, time.perf_counter() - t0,
                                  images_per_sec=images / train_seconds, ema=ema_result)
            is_best = train.end_epoch(record, result.top1, result.loss)  # no place left in it
            last = epoch + 1 == args.epochs  # fsdp: its save also exports the last and best weights
            checkpointer.save(record=record, is_best=is_best, final=last)
            if writer:
                log_epoch(writer, record)
            if not last and stop.poll(lag=False):  # a signal during evaluation or the save
                stop.stop()
    cleanup()


def build_model(args: argparse.Namespace, info: DistInfo, num_classes: int, weights: str | None,
                *, fsdp: bool, channels_last: bool) -> torch.nn.Module:
    """``--model`` with ``weights`` (read by rank 0 alone: DDP copies them when it wraps) and
    ``--freeze-layers``, on the device. Under ``fsdp`` the other ranks build it on the meta
    device (no memory), and ``shard_model`` fills their shards from rank 0's."""
    with torch.device("meta" if fsdp and info.rank > 0 else "cpu"):
        model = get_model(args.model, num_classes=num_classes, img_size=args.img_size)
    if weights:
        run_on_main(load_weights, model, weights, args.model, strict=args.eval_only)
    if args.freeze_layers:
        freeze_backbone(model)  # only the classifier trains; BatchNorm statistics as loaded
    if fsdp:
        return model
    return model.to(info.device, memory_format=torch.channels_last if channels_last else
                    torch.preserve_format)


def evaluate_only(model: torch.nn.Module, val_loader: DataLoader, device: torch.device,
                  loop: LoopOptions, classes: list[str], ckpt_path: str | None,
                  checkpointer: Checkpointer) -> None:
    """``--eval-only``: the checkpoint's model (else the --weights loaded) scored once."""
    if ckpt_path:
        checkpointer.load(ckpt_path, partial(continued_run, path=ckpt_path, classes=classes))
    log.info(format_report(evaluate(model, val_loader, device, loop), classes))
    cleanup()


def start_run(out: Path, scan: FolderScan | ShardIndex, train: TrainState, device: torch.device,
              optimizer: torch.optim.Optimizer, loader_kwargs: dict, loop: LoopOptions) -> bool:
    """Rank 0's (the others would race): the run's files beside its checkpoint (``metrics.jsonl``
    as the checkpoint records it, each finished epoch once though the last attempt died before
    its line; the image list and its plots; ``args.json``) and the start-up line. False where
    the run holds its ``--epochs`` epochs already."""
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train.metrics),
                                       encoding="utf-8")
    scan.write_files(out)
    write_json_atomic(out / "args.json", train.flags)
    flags, start = train.flags, train.epoch
    if start >= flags["epochs"]:
        log.info("%s holds epochs 0-%d, so --epochs %d leaves nothing to train.", out, start - 1,
                 flags["epochs"])
        return False
    log.info("%d process(es) on %s, %d images per step, lr %.3g, %d loader workers, amp %s, "
             "epochs %d-%d", flags["world_size"], device, flags["images_per_step"],
             optimizer.param_groups[0]["lr"], loader_kwargs["num_workers"], loop.amp_dtype, start,
             flags["epochs"] - 1)
    return True


if __name__ == "__main__":
    cli_args = get_args_parser().parse_args()
    guarded(main, cli_args, rerun_hint=lambda: rerun_hint(cli_args.output_dir, cli_args.resume))
