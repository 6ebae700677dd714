"""What the stages share: timing helpers, and the model and batches as the training script sets
them up.

Every spawned rank of the scaling stage imports this module: it imports neither torchvision
nor ``my_dataset``/``augment``/``image_folder`` (which do), as torchvision costs each rank
seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from model import get_model
from multi_train_utils.distributed_utils import register_comm_hook
from multi_train_utils.heartbeat import Heartbeat
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import LoopOptions, resolve_amp_dtype, train_one_epoch


# ---------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_threads(args: argparse.Namespace, device: torch.device
                ) -> contextlib.AbstractContextManager[None]:
    """``--threads`` torch threads on CPU; on CUDA the host threads only launch kernels."""
    return num_threads(args.threads) if device.type == "cpu" else contextlib.nullcontext()


def rate(images: int, fn: Callable[[], Any], device: torch.device) -> float:
    """Images per second of ``fn()``, wall clock, queued CUDA work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return images / (time.perf_counter() - start)


def paired(runs_a: list[float], runs_b: list[float], a: str, b: str) -> dict[str, Any]:
    """Summary of interleaved repeats: median and best img/s of each, ``b / a`` per repeat."""
    ratios = [y / x for x, y in zip(runs_a, runs_b)]
    return {f"{a}_img_per_s": statistics.median(runs_a),
            f"{b}_img_per_s": statistics.median(runs_b),
            f"{a}_best_img_per_s": max(runs_a), f"{b}_best_img_per_s": max(runs_b),
            f"{a}_runs_img_per_s": runs_a, f"{b}_runs_img_per_s": runs_b,
            "paired_ratios": ratios, "median_ratio": statistics.median(ratios)}


# ---------------------------------------------------------------- model set-up
def amp_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype | None:
    return resolve_amp_dtype(args.amp, device)  # as the training script


def channels_last(args: argparse.Namespace, device: torch.device) -> bool:
    return device.type == "cuda" if args.channels_last is None else args.channels_last


def build(args: argparse.Namespace, device: torch.device, world_size: int = 1,
          comm_hook: str | None = None
          ) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """Model, optimizer and scaler as the training script builds them (SyncBN, DDP, compile).

    ``world_size`` 1 builds the single-process model (no SyncBN, no DDP) even inside a group.
    """
    model = get_model(args.model, num_classes=args.num_classes)
    if args.sync_bn and world_size > 1:
        model = convert_sync_batchnorm(model, device)
    memory_format = torch.channels_last if channels_last(args, device) else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    params = [p for p in model.parameters() if p.requires_grad]
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
        register_comm_hook(model, comm_hook or args.comm_hook)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(params, lr=args.lr * world_size, momentum=0.9, weight_decay=0.005)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype(args, device) == torch.float16)
    return model, optimizer, scaler


def synthetic_batches(args: argparse.Namespace, count: int, seed: int, pin: bool
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` pre-loaded batches as our loader yields them.

    Each is ``(uint8 (B, 3, S, S), int64 (B,))``, pinned for a CUDA copy like ``pin_memory=True``.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (args.batch_size, 3, args.img_size, args.img_size)
    batches = []
    for _ in range(count):
        images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=gen)
        batches.append((images.pin_memory(), labels.pin_memory()) if pin else (images, labels))
    return batches


def quiet_train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
                          device: torch.device, args: argparse.Namespace,
                          scaler: torch.amp.GradScaler, grad_accum_steps: int = 1,
                          after_step: Callable[..., bool] | None = None,
                          heartbeat: Heartbeat | None = None) -> float:
    """``train_one_epoch`` with its defaults; its progress log lines go nowhere. ``batches``:
    any iterable of ``(uint8 images, labels)``."""
    progress_log = logging.getLogger("multi_train_utils.train_eval_utils")
    level = progress_log.level
    progress_log.setLevel(logging.WARNING)
    try:
        options = LoopOptions(amp_dtype=amp_dtype(args, device), scaler=scaler,
                              channels_last=channels_last(args, device),
                              grad_accum_steps=grad_accum_steps)
        return train_one_epoch(model, optimizer, batches, device, 0, options,
                               after_step=after_step, heartbeat=heartbeat)
    finally:
        progress_log.setLevel(level)
