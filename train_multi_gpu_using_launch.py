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
import os
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from augment import get_transforms
from demo_data import default_demo_root, make_demo_data
from image_folder import FolderScan, scan_image_folder, split_train_val, write_scan_files
from model import freeze_backbone, get_model, load_weights
from multi_train_utils.checkpoint import (Checkpointer, ModelState, OptimizerState, RNGState,
                                          TrainState, step_saves)
from multi_train_utils.data import ResumableSampler
from multi_train_utils.distributed_utils import (cleanup, cpus_per_process, init_distributed_mode,
                                                 register_comm_hook, run_on_main)
from multi_train_utils.guard import guarded, stop_requests
from multi_train_utils.heartbeat import Heartbeat
from multi_train_utils.recipe import BatchMix, ModelEma, inert_flags, lr_schedule, make_optimizer
from multi_train_utils.run_folder import rerun_hint
from multi_train_utils.strategy import shard_model
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (evaluate, format_report, resolve_amp_dtype,
                                                train_one_epoch)
from my_dataset import MyDataSet, default_workers, loader_kwargs
from run_log import epoch_record, log_epoch, tensorboard_writer, write_json_atomic
from train_flags import (augment_kwargs, check_args, check_data, continued_run, ema_kwargs,
                         get_args_parser, loop_options, optimizer_kwargs, prepare_run, run_args,
                         schedule_kwargs)

log = logging.getLogger("train")


def main(args: argparse.Namespace) -> None:
    # 1. Processes: torchrun/srun/spawn tell each process its rank; NCCL on GPUs, gloo on CPU.
    info = init_distributed_mode(device=args.device, dist_url=args.dist_url,
                                 timeout_s=args.dist_timeout, trace_dir=args.output_dir)
    args, defaults = check_args(args, info.world_size)  # a copy, completed: train_flags.py
    device, out = info.device, Path(args.output_dir)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts anyway)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpus_per_process())  # N processes x all cores would oversubscribe
    torch.backends.cudnn.benchmark = True  # fixed image size: let cuDNN pick its fastest kernels
    ckpt_path, weights = prepare_run(args, defaults)  # to continue; an earlier run moved aside

    # 2. Data. Rank 0 lists the folder, or reuses the run's list; each machine reads it as its own.
    root = args.data_path or (args.eval_only and args.val_path) or str(make_demo_data(
        args.demo_dir or default_demo_root()))  # --eval-only --val-path: that folder alone
    scan = run_on_main(scan_image_folder, root, verify=args.verify_images, reuse=out).rebased(root)
    val_scan = args.val_path and run_on_main(scan_image_folder, args.val_path, min_classes=1,
                                             verify=args.verify_images).rebased(args.val_path)
    # A file's side depends only on its name and --seed: stable as the folder grows.
    train_paths, train_labels, val_paths, val_labels = split_train_val(
        scan, args.val_rate, args.seed, val_scan=val_scan)  # --val-path: all of the rest trains
    transforms = get_transforms(args.img_size, args.decode, **augment_kwargs(args))  # workers'
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
    check_data(args, root, scan.classes, train_loader, info.world_size)  # --num-classes, a batch

    # 3. Model. Only rank 0 reads --weights: DDP copies its weights when it wraps, and under
    # fsdp the others build on the meta device (no memory), their shards filled from rank 0's.
    fsdp = info.world_size > 1 and args.strategy == "fsdp"
    with torch.device("meta" if fsdp and info.rank > 0 else "cpu"):
        model = get_model(args.model, num_classes=len(scan.classes), img_size=args.img_size)
    if weights and ckpt_path is None:
        run_on_main(load_weights, model, weights, args.model, strict=args.eval_only)
    if args.freeze_layers:
        freeze_backbone(model)  # only the classifier trains; BatchNorm statistics as loaded
    if args.sync_bn and info.distributed:
        model = convert_sync_batchnorm(model, device)  # over the global batch; ours on CPU
    amp_dtype = resolve_amp_dtype(args.amp, device)  # bf16 where the GPU has it, else fp16
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    loop = loop_options(args, device, amp_dtype, scaler)  # precision, NHWC, clipping, logging
    if not fsdp:  # fsdp: shard_model puts each rank's shards there
        model.to(device, memory_format=torch.channels_last if loop.channels_last else
                 torch.preserve_format)
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
    check = partial(continued_run, path=ckpt_path, classes=scan.classes)  # + flags, to train
    if args.eval_only:  # the model alone (--weights: loaded above); it needs no optimizer
        if ckpt_path:
            Checkpointer(out, {"model": ModelState(model_without_ddp)}).load(ckpt_path, check)
        log.info(format_report(evaluate(model, val_loader, device, loop), scan.classes))
        return cleanup()

    # 4. Optimizer: SGD by default, or torchvision's recipe (--opt, ...: recipe.py). Its lr is
    # --lr x the images per step / --batch-size (linear scaling: train_flags.optimizer_kwargs).
    images_per_step = info.world_size * args.batch_size * args.grad_accum_steps
    optimizer = make_optimizer(model_without_ddp, **optimizer_kwargs(args, images_per_step))
    ema = ModelEma.create(model_without_ddp, **ema_kwargs(args, images_per_step))  # --model-ema
    mix = BatchMix.create(len(scan.classes), args.mixup_alpha, args.cutmix_alpha, seed=args.seed)

    # 5. Resume: each resumable part registered once; loading and saving are one call each.
    train = TrainState(scan.classes, run_args(args, info, images_per_step), file_list=scan.digest)
    heartbeat = Heartbeat(info)  # in the epochs' block: names a rank that hangs
    checkpointer = Checkpointer(out, {
        "model": ModelState(model_without_ddp),
        "optimizer": OptimizerState(model_without_ddp, optimizer), "scaler": scaler,
        "model_ema": ema, "rng_states": RNGState(), "train": train},
        keep_last=args.keep_last, heartbeat=heartbeat)
    if ckpt_path:
        checkpointer.load(ckpt_path, partial(check, flags=train.flags, lr=optimizer.param_groups[
            0]["lr"], inert=inert_flags(model_without_ddp)))
        scan.resume_epoch(train.progress, train.saved, out, train_paths)  # its own images
    scheduler = lr_schedule(optimizer, **schedule_kwargs(args), start_epoch=train.epoch)
    run_on_main(write_run_files, out, scan, train)  # rank 0 alone writes: the others would race
    if train.epoch >= args.epochs:
        log.info("%s holds epochs 0-%d, so --epochs %d leaves nothing to train.", out,
                 train.epoch - 1, args.epochs)
        return cleanup()
    writer = tensorboard_writer(out, train.epoch, train_set) if args.tensorboard else None
    log.info("%d process(es) on %s, %d images per step, lr %.3g, %d loader workers, amp %s, "
             "epochs %d-%d", info.world_size, device, images_per_step,
             optimizer.param_groups[0]["lr"], workers, amp_dtype, train.epoch, args.epochs - 1)

    # 6. Epochs; the loss and accuracy are already reduced over all ranks. At a stop signal the
    # ranks agree on a step, save there and exit; the same command continues at that batch.
    with stop_requests() as stop, heartbeat:
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


def write_run_files(out: Path, scan: FolderScan, train: TrainState) -> None:
    """The run's files beside its checkpoint: ``metrics.jsonl`` as the checkpoint records it
    (each finished epoch once, though the last attempt died before its line), the image list
    and its plots, and ``args.json``."""
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train.metrics),
                                       encoding="utf-8")
    write_scan_files(out, scan)
    write_json_atomic(out / "args.json", train.flags)


if __name__ == "__main__":
    cli_args = get_args_parser().parse_args()
    guarded(main, cli_args, rerun_hint=lambda: rerun_hint(cli_args.output_dir, cli_args.resume))
