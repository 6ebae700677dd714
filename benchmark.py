"""Is the template fast by default? One run measures it side by side and prints a table.

1. Input pipeline, images/s per DataLoader worker (one process, one thread): the classic
   template's PIL path (``Image.open().convert("RGB")``, ``transforms`` v1 RandomResizedCrop,
   flip, ``ToTensor``, ``Normalize``) against ours (``MyDataSet``:
   ``torchvision.io`` decoding, ``transforms.v2`` on uint8, normalisation left to the device), on
   the same photo-sized JPEGs (500x375, quality 90, generated once and cached).
2. Training-loop efficiency: ``train_one_epoch`` against a bare forward/backward/step loop on the
   same pre-loaded batches, same model, batch size and threads, so only loop overhead shows;
   and that overhead measured directly, around a one-layer model (on a busy machine the ratio's
   noise can exceed the overhead it measures).
3. Scaling: images/s and time per epoch (of ``--epoch-images``, by default flower_photos'
   training split) with 1, 2, 4 ... processes: DDP with the training script's defaults (SyncBN,
   bucket size), gloo with one thread per rank on CPU, NCCL with one GPU per rank on CUDA, on
   synthetic pre-loaded batches, so it measures compute plus communication, not the disk.
   Efficiency = img/s(N) / (N x img/s(1)). The largest count runs again without any
   communication (the machine's ceiling), without SyncBN, and with the other comm hook, so the
   table splits what is lost between the machine, the gradient all-reduce and SyncBN.
4. Peak memory per rank: each rank process's peak RSS on CPU (``VmHWM``; ``ru_maxrss`` where
   there is no /proc), ``torch.cuda.max_memory_allocated`` on CUDA.
5. Training with data (one process): ``train_one_epoch`` fed by the training script's loader
   (workers decoding the JPEGs of stage 1), beside that loader alone and stage 2's compute
   alone, so the table says which of the two limits training. On a GPU this is the figure to
   hold against the target (ResNet34, 224 px, bf16, channels-last: 5,000 img/s on an H200).
   Timed in steady state, as in a long epoch: not the loader's start-up that every epoch pays.

    python benchmark.py                     # CPU: ResNet34 at 64 px, 1 and 2 processes
    python benchmark.py --device cuda       # every visible GPU: NCCL, AMP, channels-last
    python benchmark.py --device cuda --max-procs 4 --img-size 224 --batch-size 64
    python benchmark.py --model resnet18 --img-size 32 --pipeline-images 16 --steps 3  # smoke

Every timing is taken after warm-up steps and repeated ``--repeats`` times. The two variants of
a comparison run back to back in each repeat (alternating which goes first), so a burst of load
from another program hits both; a comparison reports the median img/s of each and the median of
the per-repeat ratios, scaling the best repeat of each process count. Every repeat is kept in
``<output-dir>/benchmark.json`` next to the chart ``benchmark.png``. Numbers from a shared or busy
machine are noisy: the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import Dataset

from model import MODELS, get_model
from multi_train_utils.distributed_utils import (COMM_HOOKS, DistInfo, cleanup, find_free_port,
                                                 init_distributed_mode, register_comm_hook,
                                                 usable_cpus)
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (IMAGENET_MEAN, IMAGENET_STD, prepare_images,
                                                resolve_amp_dtype, train_one_epoch)

# torchvision (and my_dataset/utils, which use it) is imported inside the pipeline functions:
# every spawned rank re-imports this module, and torchvision costs each of them seconds.

log = logging.getLogger("benchmark")

# flower_photos (3,670 images) minus our stratified 20% validation split: the "epoch" of the
# classic tutorial's time-per-epoch chart.
FLOWER_TRAIN_IMAGES = 2935
PIPELINE_TARGET = 1.6  # ours / template images per second per worker
LOOP_TARGET = 0.95  # train_one_epoch / bare loop images per second
# Data included, one H200 GPU: the target for ResNet34 at 224 px, bf16, channels-last.
CUDA_TARGET_IMG_PER_S = 5000
DATA_EFFICIENT = 0.9  # with data / compute alone: above it, the data costs (almost) nothing
OVERHEAD_STEPS = 200  # steps of the near-free model that measure the loop's own cost


# ---------------------------------------------------------------- test images
def _photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like RGB image: smooth colour gradients, blurred shapes and sensor noise.

    Flat synthetic images compress to a few KB and decode unrealistically fast; this lands near
    a real 500x375 quality-90 photo (about 40-50 KB), so decoding costs what it costs in training.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / height, xx / width
    planes = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0, 3)
        planes.append(120 + 80 * np.sin(fx * np.pi * xx + 6 * phase) * np.cos(fy * np.pi * yy)
                      + rng.uniform(-40, 40))
    img = Image.fromarray(np.clip(np.stack(planes, -1), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(5, 15))):
        x, y, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, 120)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x - r, y - r * rng.uniform(0.5, 1.5), x + r, y + r], fill=colour)
        else:
            draw.polygon([(x + rng.uniform(-r, r), y + rng.uniform(-r, r))
                          for _ in range(int(rng.integers(3, 7)))], fill=colour)
    pixels = np.asarray(img.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)
    pixels += rng.normal(0, 6, pixels.shape).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_photos(folder: str | os.PathLike, count: int, *, width: int = 500, height: int = 375,
                seed: int = 0) -> list[str]:
    """Paths of ``count`` photo-like JPEGs (quality 90) in ``folder``; missing ones are written.

    Image ``i`` depends only on ``(seed, i)``, so the cache grows without changing what exists.
    Each file is written under a temporary name and renamed, so concurrent runs can share it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"{seed}_{i:05d}_{width}x{height}.jpg"
        if not path.is_file():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".jpg")
            os.close(fd)
            _photo(np.random.default_rng([seed, i]), width, height).save(tmp, quality=90)
            os.replace(tmp, path)
        paths.append(str(path))
    return paths


def default_image_dir() -> Path:
    from utils import user_cache_dir

    return user_cache_dir("pass --image-dir a folder you can write") / "ddp-template" / \
        "bench_photos_v1"


# ---------------------------------------------------------------- 1. input pipeline
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collate(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(image (3, H, W), label), ...]`` -> ``(images (N, 3, H, W), labels (N,))``.

    The collate of both datasets (the template's, and ``MyDataSet.collate_fn`` outside a
    DataLoader worker, are this stack; in a worker it stacks into shared memory).
    """
    images, labels = tuple(zip(*batch))
    return torch.stack(images, dim=0), torch.as_tensor(labels, dtype=torch.int64)


class TemplateDataSet(Dataset):
    """The classic template's dataset: PIL decode, then ``transforms`` v1 to a normalised float."""

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.images_path, self.images_class, self.transform = images_path, images_class, transform

    def __len__(self) -> int:
        return len(self.images_path)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, int]:
        img = Image.open(self.images_path[item]).convert("RGB")
        return self.transform(img), self.images_class[item]


def template_transform(img_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """The classic template's training transform: ``PIL -> float (3, S, S)``, normalised."""
    from torchvision import transforms as transforms_v1

    return transforms_v1.Compose([transforms_v1.RandomResizedCrop(img_size),
                                  transforms_v1.RandomHorizontalFlip(),
                                  transforms_v1.ToTensor(),
                                  transforms_v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


@contextlib.contextmanager
def _num_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rate(images: int, fn: Callable[[], Any], device: torch.device) -> float:
    """Images per second of ``fn()``, wall clock, queued CUDA work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return images / (time.perf_counter() - start)


def _paired(runs_a: list[float], runs_b: list[float], a: str, b: str) -> dict[str, Any]:
    """Summary of interleaved repeats: median and best img/s of each, ``b / a`` per repeat."""
    ratios = [y / x for x, y in zip(runs_a, runs_b)]
    return {f"{a}_img_per_s": statistics.median(runs_a),
            f"{b}_img_per_s": statistics.median(runs_b),
            f"{a}_best_img_per_s": max(runs_a), f"{b}_best_img_per_s": max(runs_b),
            f"{a}_runs_img_per_s": runs_a, f"{b}_runs_img_per_s": runs_b,
            "paired_ratios": ratios, "median_ratio": statistics.median(ratios)}


def _loader_pass(dataset: Dataset, batch_size: int, limit: int | None = None) -> None:
    """What one DataLoader worker does: ``__getitem__`` for each batch, then collate."""
    count = len(dataset) if limit is None else min(limit, len(dataset))
    for first in range(0, count, batch_size):
        _collate([dataset[i] for i in range(first, min(first + batch_size, count))])


def bench_pipeline(paths: Sequence[str], img_size: int, batch_size: int,
                   repeats: int) -> dict[str, Any]:
    """Per-worker images/s of the template's PIL path and ours on the same files."""
    from my_dataset import MyDataSet
    from utils import get_transforms

    labels = [0] * len(paths)
    template = TemplateDataSet(paths, labels, template_transform(img_size))
    ours = MyDataSet(paths, labels, get_transforms(img_size)["train"])
    for path in paths:  # both read from the page cache, never one from the disk
        Path(path).read_bytes()
    datasets = {"template": template, "ours": ours}
    runs: dict[str, list[float]] = {"template": [], "ours": []}
    with _num_threads(1):  # a DataLoader worker runs with one torch thread
        for dataset in datasets.values():
            _loader_pass(dataset, batch_size, limit=2 * batch_size)  # warm-up
        for r in range(repeats):
            for name in ("template", "ours") if r % 2 == 0 else ("ours", "template"):
                one_pass = lambda: _loader_pass(datasets[name], batch_size)  # noqa: E731
                runs[name].append(_rate(len(paths), one_pass, torch.device("cpu")))
    summary = _paired(runs["template"], runs["ours"], "template", "ours")
    sizes = [os.path.getsize(p) for p in paths]
    with Image.open(paths[0]) as first:
        width, height = first.size
    return {"images": len(paths), "image_width": width, "image_height": height,
            "mean_file_kb": round(sum(sizes) / len(sizes) / 1024, 1), "jpeg_quality": 90,
            "crop": img_size, "batch_size": batch_size, "threads": 1,
            **summary, "ratio": summary["median_ratio"], "target_ratio": PIPELINE_TARGET}


def bench_gpu_decode(paths: Sequence[str], img_size: int, batch_size: int, repeats: int,
                     device: torch.device) -> dict[str, Any]:
    """Images/s when the main process decodes JPEG batches with nvJPEG and augments on the GPU.

    Not per worker: one process, files read on the CPU, ``decode_jpeg(device="cuda")`` on lists
    of ``batch_size`` files, then the same ``transforms.v2`` per image on the GPU. An optional
    extra: if this torchvision build cannot decode on the GPU, the error is recorded instead.
    """
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    from utils import get_transforms

    transform = get_transforms(img_size)["train"]

    def one_pass(count: int) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for first in range(0, count, batch_size):
            data = [read_file(p) for p in paths[first:min(first + batch_size, count)]]
            images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            torch.stack([transform(img) for img in images])
        torch.cuda.synchronize(device)
        return count / (time.perf_counter() - start)

    try:
        one_pass(min(len(paths), 2 * batch_size))  # warm-up: nvJPEG handles, kernels
        runs = [one_pass(len(paths)) for _ in range(repeats)]
    except RuntimeError as exc:
        log.warning("GPU JPEG decoding is not available here (%s); skipping it.", exc)
        return {"error": str(exc).splitlines()[0], "device": str(device)}
    return {"img_per_s": statistics.median(runs), "best_img_per_s": max(runs),
            "runs_img_per_s": runs, "device": str(device)}


# ---------------------------------------------------------------- model set-up (shared)
def _amp_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype | None:
    return resolve_amp_dtype(args.amp, device)  # as the training script


def _channels_last(args: argparse.Namespace, device: torch.device) -> bool:
    return device.type == "cuda" if args.channels_last is None else args.channels_last


def _build(args: argparse.Namespace, device: torch.device, world_size: int = 1,
           comm_hook: str | None = None
           ) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """Model, optimizer and scaler as the training script builds them (SyncBN, DDP, compile).

    ``world_size`` 1 builds the single-process model (no SyncBN, no DDP) even inside a group.
    """
    model = get_model(args.model, num_classes=args.num_classes)
    if args.sync_bn and world_size > 1:
        model = convert_sync_batchnorm(model, device)
    memory_format = torch.channels_last if _channels_last(args, device) else torch.contiguous_format
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
    scaler = torch.amp.GradScaler(device.type, enabled=_amp_dtype(args, device) == torch.float16)
    return model, optimizer, scaler


def _synthetic_batches(args: argparse.Namespace, count: int, seed: int, pin: bool
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


def _quiet_train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer,
                           batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                           args: argparse.Namespace, scaler: torch.amp.GradScaler,
                           grad_accum_steps: int = 1) -> float:
    """``train_one_epoch`` with its defaults; its progress (a bar in a terminal, log lines
    elsewhere) goes nowhere."""
    progress_log = logging.getLogger("multi_train_utils.train_eval_utils")
    level = progress_log.level
    progress_log.setLevel(logging.WARNING)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return train_one_epoch(model, optimizer, batches, device, 0,
                                   scaler=scaler if scaler.is_enabled() else None,
                                   amp_dtype=_amp_dtype(args, device),
                                   channels_last=_channels_last(args, device),
                                   grad_accum_steps=grad_accum_steps)
    finally:
        progress_log.setLevel(level)


# ---------------------------------------------------------------- 2. training loop
def _race_loops(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                batches: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
                device: torch.device, cycles: int = 1) -> dict[str, list[float]]:
    """Img/s of a bare loop and of ``train_one_epoch`` over ``cycles`` passes of ``batches``.

    The two share model and optimizer and alternate, which goes first switching every repeat.
    The bare loop gets the batches already normalised (and on the device) before the clock
    starts, so ours also pays for its per-step normalisation, loss bookkeeping and progress
    bar: the efficiency is a lower bound. Each variant runs ``--repeats`` times.
    """
    amp_dtype = _amp_dtype(args, device)
    channels_last = _channels_last(args, device)
    ready = [(prepare_images(x, device, channels_last=channels_last), y.to(device))
             for x, y in batches]
    criterion = nn.CrossEntropyLoss()

    def bare(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        model.train()
        for images, labels in data:
            with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16,
                                enabled=amp_dtype is not None):
                output = model(images)
            loss = criterion(output.float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

    def ours(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        _quiet_train_one_epoch(model, optimizer, data, device, args, scaler)

    warm = args.warmup_steps
    bare(ready[:warm])
    ours(batches[:warm])
    loops = {"bare": lambda: bare(ready * cycles), "ours": lambda: ours(batches * cycles)}
    images = len(batches) * cycles * args.batch_size
    runs: dict[str, list[float]] = {"bare": [], "ours": []}
    for r in range(args.repeats):
        for name in ("bare", "ours") if r % 2 == 0 else ("ours", "bare"):
            runs[name].append(_rate(images, loops[name], device))
    return runs


def bench_loop(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Images/s of ``train_one_epoch`` and of a bare loop, same model, batches and threads.

    On a shared machine the run-to-run noise (several %) can exceed the overhead being measured,
    so the overhead is also measured directly: the same two loops around a model that costs
    almost nothing (one linear layer) for ``OVERHEAD_STEPS`` steps. The time per step they
    differ by is what ``train_one_epoch`` adds to any model; the efficiency it implies for the
    real model is ``bare step / (bare step + overhead)``.
    """
    # On CPU both loops get --threads; on CUDA the host threads only launch kernels.
    with _num_threads(args.threads) if device.type == "cpu" else contextlib.nullcontext():
        torch.manual_seed(args.seed)
        model, optimizer, scaler = _build(args, device)
        batches = _synthetic_batches(args, args.steps, args.seed, pin=device.type == "cuda")
        runs = _race_loops(model, optimizer, scaler, batches, args, device)

        tiny = nn.Sequential(nn.Flatten(), nn.Linear(3 * args.img_size**2, args.num_classes))
        tiny.to(device)
        cycles = -(-OVERHEAD_STEPS // len(batches))  # ceil
        tiny_runs = _race_loops(tiny, torch.optim.SGD(tiny.parameters(), lr=args.lr, momentum=0.9),
                                torch.amp.GradScaler(device.type, enabled=scaler.is_enabled()),
                                batches, args, device, cycles)
    summary = _paired(runs["bare"], runs["ours"], "bare", "ours")
    # Seconds per step ours adds, per repeat: B / ours_rate - B / bare_rate.
    extra = [args.batch_size * (1 / o - 1 / b)
             for o, b in zip(tiny_runs["ours"], tiny_runs["bare"])]
    overhead_s = statistics.median(extra)
    bare_step_s = args.batch_size / summary["bare_img_per_s"]
    overhead = {"model": "Flatten + Linear", "steps": len(batches) * cycles,
                "per_step_ms": overhead_s * 1e3, "per_step_ms_runs": [x * 1e3 for x in extra],
                "bare_step_ms": bare_step_s * 1e3,
                "implied_efficiency": bare_step_s / (bare_step_s + overhead_s),
                "bare_runs_img_per_s": tiny_runs["bare"], "ours_runs_img_per_s": tiny_runs["ours"]}
    return {"model": args.model, "img_size": args.img_size, "batch_size": args.batch_size,
            "steps": args.steps, "threads": args.threads, "device": str(device),
            **summary, "efficiency": summary["median_ratio"], "target_efficiency": LOOP_TARGET,
            "overhead": overhead}


# ---------------------------------------------------------------- 5. training with data
def _data_loader(paths: Sequence[str], args: argparse.Namespace, device: torch.device,
                 workers: int, batches: int) -> torch.utils.data.DataLoader:
    """The training script's train loader over the photos, repeated to ``batches`` full batches.

    As the training script builds it: ``MyDataSet`` with the training transform at
    ``--img-size`` and ``my_dataset.loader_kwargs``.
    """
    from torch.utils.data import DataLoader

    from my_dataset import MyDataSet, loader_kwargs
    from utils import get_transforms

    count = batches * args.batch_size
    dataset = MyDataSet([paths[i % len(paths)] for i in range(count)],
                        [i % args.num_classes for i in range(count)],
                        get_transforms(args.img_size)["train"], seed=args.seed)
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(args.seed),
                      **loader_kwargs(workers, device))


class _SteadyWindow:
    """``loader``, with each pass over it timed from the yield of batch ``skip`` to that of batch
    ``skip + steps`` (the device synchronised at both), into ``seconds``.

    In between exactly ``steps`` batches are both loaded and consumed: the rate of a long epoch.
    Timing a whole pass would add the start-up every epoch pays again (each worker decodes a full
    batch before the first arrives), which over a short pass is much of the time on a GPU. The
    workers deliver in bursts, one batch each (they start together, and batches go to them in
    turn), so ``skip`` and ``steps`` must be multiples of the worker count: a window inside one
    burst would time almost nothing.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, skip: int, steps: int,
                 device: torch.device) -> None:
        if len(loader) <= skip + steps:
            raise ValueError(f"the window ends at batch {skip + steps}: the loader has "
                             f"{len(loader)} batches")
        self.loader, self.skip, self.steps, self.device = loader, skip, steps, device
        self.seconds = float("nan")

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        start, self.seconds = 0.0, float("nan")  # a pass that stops early has no time
        for i, batch in enumerate(self.loader):
            if i == self.skip or i == self.skip + self.steps:
                _sync(self.device)
                if i == self.skip:
                    start = time.perf_counter()
                else:
                    self.seconds = time.perf_counter() - start
            yield batch


def bench_with_data(args: argparse.Namespace, device: torch.device, paths: Sequence[str],
                    compute_img_per_s: float) -> dict[str, Any]:
    """Images/s of ``train_one_epoch`` fed by the training script's loader: JPEGs to weights.

    One process, the model of stage 2. Beside it, the same loader alone (workers decode, augment
    and collate; the main process copies each batch to the device): what the workers can supply.
    Stage 2's ``train_one_epoch`` on pre-loaded batches is what the model can consume. The
    smaller of the two limits training; ``data_efficiency`` is what reading the data costs.
    On a GPU this is the figure that counts, and the pipeline's nvJPEG rate (stage 1) says what
    decoding on the GPU instead of in the CPU workers could supply. Both passes are timed in
    steady state (:class:`_SteadyWindow`): ``--steps`` batches after ``--warmup-steps``, each
    rounded up to a multiple of the worker count.
    """
    from my_dataset import default_workers

    workers = default_workers(args.batch_size, device) if args.workers is None else args.workers
    burst = max(1, workers)  # batches that arrive together (see _SteadyWindow)
    skip = burst * -(-args.warmup_steps // burst)
    steps = burst * -(-args.steps // burst)
    images = steps * args.batch_size
    with _num_threads(args.threads) if device.type == "cpu" else contextlib.nullcontext():
        torch.manual_seed(args.seed)
        model, optimizer, scaler = _build(args, device)
        window = _SteadyWindow(_data_loader(paths, args, device, workers, skip + steps + 1),
                               skip, steps, device)

        def loader_alone() -> None:
            for batch_images, labels in window:
                batch_images.to(device, non_blocking=True)
                labels.to(device, non_blocking=True)

        def training() -> None:
            _quiet_train_one_epoch(model, optimizer, window, device, args, scaler)

        training()  # warm-up: starts the persistent workers; cuDNN picks its kernels
        runs: dict[str, list[float]] = {"loader": [], "training": []}
        passes = {"loader": loader_alone, "training": training}
        for r in range(args.repeats):
            for name in ("loader", "training") if r % 2 == 0 else ("training", "loader"):
                passes[name]()
                runs[name].append(images / window.seconds)
    loader_rate = statistics.median(runs["loader"])
    with_data = statistics.median(runs["training"])
    return {"model": args.model, "img_size": args.img_size, "batch_size": args.batch_size,
            "workers": workers, "timed_images": images, "untimed_batches_first": skip,
            "files": len(paths),
            "device": str(device), "threads": args.threads,
            "loader_img_per_s": loader_rate, "loader_runs_img_per_s": runs["loader"],
            "with_data_img_per_s": with_data, "with_data_runs_img_per_s": runs["training"],
            "with_data_best_img_per_s": max(runs["training"]),
            "compute_img_per_s": compute_img_per_s,
            "data_efficiency": with_data / compute_img_per_s,
            "limited_by": _data_limit(loader_rate, with_data, compute_img_per_s, workers),
            "target_img_per_s": CUDA_TARGET_IMG_PER_S if device.type == "cuda" else None}


def _data_limit(loader: float, with_data: float, compute: float, workers: int) -> str:
    """What holds training with data back, from the three rates of stage 5."""
    if loader < compute:
        return "input pipeline"  # the workers cannot supply what the model consumes
    if with_data < DATA_EFFICIENT * compute:
        if workers == 0:  # loading and training take turns in one process
            return "loading in the training process (--workers 0)"
        return "CPUs shared by the loader workers and training"  # each fast enough alone
    return "compute"


# ---------------------------------------------------------------- 3./4. scaling and memory
def _barrier(info: DistInfo) -> None:
    _sync(info.device)
    if info.distributed:
        dist.barrier(device_ids=[info.device.index] if info.device.type == "cuda" else None)


def _peak_host_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB.

    Read from ``VmHWM`` on Linux: ``ru_maxrss`` survives fork + exec, so a rank spawned by a big
    parent reports at least the parent's size (seen here: 809 MiB for a fresh rank whose own
    peak was 508 MiB).
    """
    with contextlib.suppress(OSError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    import resource  # Unix only, like multi-process gloo/NCCL training here

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _time_all_reduce(numel: int, dtype: torch.dtype, device: torch.device, repeats: int = 5
                     ) -> float:
    """Median milliseconds of one all-reduce of ``numel`` elements, with nothing else running."""
    tensor = torch.ones(numel, dtype=dtype, device=device)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _scaling_worker(local_rank: int, args: argparse.Namespace, nprocs: int, port: int,
                    result_dir: str, variant: str = "ddp", comm_hook: str = "none") -> None:
    """One rank: the training script's model set-up, then timed ``train_one_epoch`` calls.

    ``variant`` "ddp" is the training script's set-up with ``comm_hook``; "no_sync_bn" the same
    without SyncBN (its all-reduce per BatchNorm layer, forward and backward, apart from DDP's
    gradient all-reduce); "no_comm" trains the single-process model (no DDP, no SyncBN) in every
    process at once, so no gradient crosses between them: the process group only lines up the
    repeats. Its efficiency is the most the hardware allows N processes (shared cores, caches
    and memory bandwidth), whatever DDP does. ``--grad-accum-steps`` applies to every variant.
    """
    if nprocs > 1:  # what torchrun sets; the baseline runs as plain python does: no group
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rss_at_start = _peak_host_rss_mib()  # Python + torch libraries, before any model or data
    info = init_distributed_mode(device=args.device, timeout_s=600)
    try:
        device = info.device
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(args.seed)
        if variant == "no_sync_bn":
            args = argparse.Namespace(**{**vars(args), "sync_bn": False})
        model, optimizer, scaler = _build(args, device,
                                          1 if variant == "no_comm" else info.world_size, comm_hook)
        # Each rank its own data, as DistributedSampler gives it; same steps on every rank.
        batches = _synthetic_batches(args, args.steps, args.seed + info.rank,
                                     pin=device.type == "cuda")
        _quiet_train_one_epoch(model, optimizer, batches[:args.warmup_steps], device,
                               args, scaler)
        seconds = []
        for _ in range(args.repeats):
            _barrier(info)
            start = time.perf_counter()
            # Ends with an all-reduce of the loss (a host sync), so every rank is done.
            _quiet_train_one_epoch(model, optimizer, batches, device, args, scaler,
                                   args.grad_accum_steps)
            seconds.append(time.perf_counter() - start)
        result = {"rank": info.rank, "seconds": seconds, "backend": info.backend,
                  "device": str(device), "peak_host_rss_mib": _peak_host_rss_mib(),
                  "rss_at_start_mib": rss_at_start}
        if device.type == "cuda":
            result["peak_cuda_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            result["peak_cuda_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
        if variant == "ddp" and info.distributed and comm_hook == "none":
            # What the gradient all-reduce costs on its own: the floor under DDP's overhead.
            numel = sum(p.numel() for p in optimizer.param_groups[0]["params"])
            result["all_reduce_ms"] = {
                "numel": numel, "fp32": _time_all_reduce(numel, torch.float32, device),
                "bf16": _time_all_reduce(numel, torch.bfloat16, device)}
        with open(Path(result_dir) / f"rank{info.rank}.json", "w", encoding="utf-8") as f:
            json.dump(result, f)
    finally:
        cleanup()


def _run_scaling(args: argparse.Namespace, device: torch.device, nprocs: int, variant: str,
                 comm_hook: str) -> dict[str, Any]:
    """One measurement: ``nprocs`` spawned ranks of ``_scaling_worker``; figures of the run."""
    ddp = variant != "no_comm" and nprocs > 1
    log.info("scaling: %d process(es), %s%s", nprocs, variant.replace("_", " "),
             f", --comm-hook {comm_hook}" if ddp else "")
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as result_dir:
        mp.start_processes(_scaling_worker,
                           args=(args, nprocs, find_free_port(), result_dir, variant, comm_hook),
                           nprocs=nprocs, join=True, start_method="spawn")
        ranks = [json.loads((Path(result_dir) / f"rank{r}.json").read_text())
                 for r in range(nprocs)]
    per_repeat = [max(rank["seconds"][i] for rank in ranks) for i in range(args.repeats)]
    images = nprocs * args.batch_size * args.steps
    best = min(per_repeat)
    img_per_s = images / best
    cuda = device.type == "cuda"
    entry = {
        "processes": nprocs, "variant": variant, "comm_hook": comm_hook if ddp else None,
        "sync_bn": args.sync_bn and variant == "ddp" and nprocs > 1,
        "backend": ranks[0]["backend"] or "none (1 process)",
        "img_per_s": img_per_s, "median_img_per_s": images / statistics.median(per_repeat),
        "measured_seconds": best, "measured_seconds_runs": per_repeat,
        "epoch_seconds": args.epoch_images / img_per_s,
        "peak_memory_mib": [rank["peak_cuda_allocated_mib" if cuda else "peak_host_rss_mib"]
                            for rank in ranks],
        "peak_host_rss_mib": [rank["peak_host_rss_mib"] for rank in ranks],
        "rss_at_start_mib": [rank["rss_at_start_mib"] for rank in ranks],
        **({"peak_cuda_reserved_mib": [rank["peak_cuda_reserved_mib"] for rank in ranks]}
           if cuda else {}),
    }
    if "all_reduce_ms" in ranks[0]:
        entry["all_reduce_ms"] = ranks[0]["all_reduce_ms"]
    return entry


def bench_scaling(args: argparse.Namespace, device: torch.device, procs: Sequence[int]
                  ) -> dict[str, Any]:
    """Images/s, epoch time, efficiency and peak memory per rank for each process count.

    Each rank trains ``--batch-size`` images per step (the global batch grows with N, as with
    the launchers); a repeat lasts as long as its slowest rank, and the best repeat is reported.
    ``epoch_seconds`` is the time ``--epoch-images`` images take at that rate, the classic
    tutorial's "time per epoch" on a fixed dataset.

    With ``--explain-scaling`` (default), the largest process count is also run (a) without
    any communication, the hardware's ceiling, (b) with DDP but without SyncBN (where
    ``--sync-bn``), and (c) with bf16 gradient compression (without, if ``--comm-hook`` asked
    for it); the uncompressed run also times the gradient all-reduce alone. Together they split
    the efficiency lost into what the machine loses by running N processes at once, what the
    gradient all-reduce costs on top, and what SyncBN costs on top of that.
    """
    results = {str(n): _run_scaling(args, device, n, "ddp", args.comm_hook) for n in procs}
    base = results[str(procs[0])]["img_per_s"] / procs[0]
    largest = max(procs)
    explain: dict[str, Any] = {}
    if args.explain_scaling and largest > 1:
        explain["no_comm"] = _run_scaling(args, device, largest, "no_comm", "none")
        if args.sync_bn:
            explain["no_sync_bn"] = _run_scaling(args, device, largest, "no_sync_bn",
                                                 args.comm_hook)
        # bf16 and fp16 move the same bytes: one of them tells what halving them is worth.
        other = "bf16" if args.comm_hook == "none" else "none"
        explain[f"comm_hook_{other}"] = _run_scaling(args, device, largest, "ddp", other)
    for entry in [*results.values(), *explain.values()]:
        entry["efficiency"] = entry["img_per_s"] / (entry["processes"] * base)
    if explain:
        step_ms = args.batch_size / base * 1e3  # one process, one step
        ceiling = explain["no_comm"]["efficiency"]
        top = results[str(largest)]
        no_sync_bn = explain.get("no_sync_bn", top)["efficiency"]
        explain["summary"] = {
            "processes": largest, "step_ms_1_process": step_ms,
            "ceiling_efficiency": ceiling, "ddp_efficiency": top["efficiency"],
            "no_sync_bn_efficiency": no_sync_bn if "no_sync_bn" in explain else None,
            # Shares of the ceiling's throughput lost: all communication, the gradient
            # all-reduce alone (DDP without SyncBN), and SyncBN on top of it.
            "communication_loss": 1 - top["efficiency"] / ceiling,
            "gradient_loss": 1 - no_sync_bn / ceiling,
            "sync_bn_loss": (no_sync_bn - top["efficiency"]) / ceiling,
            "all_reduce_ms": next((e["all_reduce_ms"] for e in [top, *explain.values()]
                                   if "all_reduce_ms" in e), None),
        }
    return {"device": device.type,
            "threads_per_rank": args.threads if device.type == "cpu" else None,
            "batch_size_per_rank": args.batch_size, "steps": args.steps,
            "epoch_images": args.epoch_images, "sync_bn": args.sync_bn,
            "bucket_cap_mb": args.bucket_cap_mb, "comm_hook": args.comm_hook,
            "grad_accum_steps": args.grad_accum_steps,
            "memory_kind": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                            else "peak RSS"),
            "results": results, "explain": explain}


# ---------------------------------------------------------------- report
def _host_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    info = {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "cpus_usable": usable_cpus(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_avg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _versions() -> dict[str, Any]:
    import PIL
    import torchvision

    return {"python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "pillow": PIL.__version__,
            "numpy": np.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _row(label: str, value: str, note: str = "") -> str:
    return f"   {label:<46}{value:>9}{note}"


def _header_lines(report: dict[str, Any]) -> list[str]:
    host = report["host"]
    load = lambda v: " ".join(f"{x:.2f}" for x in v) if v else "n/a"  # noqa: E731
    return [f"command: {report['command']}",
            f"host: {host['cpu']}, {host['cpus_usable'] or host['cpu_count']} CPUs"
            + (f", GPUs: {', '.join(host['gpus'])}" if host.get("gpus") else "")
            + f"; torch {report['versions']['torch']}, torchvision "
              f"{report['versions']['torchvision']}",
            f"load average (1/5/15 min): {load(host['load_avg_start'])} at start, "
            f"{load(host['load_avg_end'])} at end"]


def _pipeline_lines(p: dict[str, Any], repeats: int) -> list[str]:
    lines = [f"1. Input pipeline, img/s per worker (1 process, 1 thread; {p['images']} JPEGs "
             f"{p['image_width']}x{p['image_height']} q{p['jpeg_quality']}, "
             f"~{p['mean_file_kb']:.0f} KB; crop {p['crop']}; median of {repeats})",
             _row("template: PIL + transforms v1 -> float", f"{p['template_img_per_s']:.1f}"),
             _row("ours: torchvision.io + transforms v2 -> uint8", f"{p['ours_img_per_s']:.1f}"),
             _row("speed-up (median of paired repeats)", f"{p['ratio']:.2f}x",
                  f"   target >= {p['target_ratio']}x; repeats {_spread(p['paired_ratios'])}")]
    if p.get("gpu_decode", {}).get("img_per_s"):
        lines.append(_row(f"ours, nvJPEG on {p['gpu_decode']['device']} (main process)",
                          f"{p['gpu_decode']['img_per_s']:.1f}"))
    return lines


def _loop_lines(loop: dict[str, Any], repeats: int) -> list[str]:
    over = loop["overhead"]
    return [f"2. Training loop, img/s ({loop['model']}, {loop['img_size']} px, batch "
            f"{loop['batch_size']}, {loop['steps']} steps, {loop['device']}"
            + (f", {loop['threads']} thread(s)" if loop["device"] == "cpu" else "")
            + f"; median of {repeats})",
            _row("bare forward/backward/step loop", f"{loop['bare_img_per_s']:.1f}"),
            _row("ours: train_one_epoch", f"{loop['ours_img_per_s']:.1f}"),
            _row("efficiency (median of paired repeats)", f"{loop['efficiency']:.3f}",
                 f"   target >= {loop['target_efficiency']}; repeats "
                 f"{_spread(loop['paired_ratios'])}"),
            _row(f"overhead per step (1-layer model, {over['steps']} steps)",
                 f"{over['per_step_ms']:.3f}", f" ms of a {over['bare_step_ms']:.0f} ms step"),
            _row("efficiency implied by that overhead", f"{over['implied_efficiency']:.4f}")]


def _scaling_row(entry: dict[str, Any], label: str = "") -> str:
    memory = ", ".join(f"{m:.0f}" for m in entry["peak_memory_mib"])
    return (f"   {entry['processes']:9d} {entry['img_per_s']:9.1f} {entry['epoch_seconds']:9.1f} "
            f"{entry['efficiency']:12.3f}   {memory}" + (f"   <- {label}" if label else ""))


def _scaling_lines(s: dict[str, Any], repeats: int) -> list[str]:
    backend = s["results"][max(s["results"], key=int)]["backend"]
    per_rank = (f"{s['threads_per_rank']} thread(s) per rank" if s["device"] == "cpu"
                else "1 GPU per rank")
    mem = "peak RSS" if s["memory_kind"] == "peak RSS" else "peak CUDA allocated"
    accum = f", --grad-accum-steps {s['grad_accum_steps']}" if s["grad_accum_steps"] > 1 else ""
    lines = [f"3./4. Scaling (DDP, {backend}, {per_rank}, batch {s['batch_size_per_rank']} per "
             f"rank, SyncBN {'on' if s['sync_bn'] else 'off'}, --comm-hook {s['comm_hook']}"
             f"{accum}; epoch = {s['epoch_images']} images; best of {repeats})",
             f"   processes     img/s   s/epoch   efficiency   {mem} per rank (MiB)"]
    lines += [_scaling_row(entry) for entry in s["results"].values()]
    ex = s.get("explain") or {}
    lines += [_scaling_row(ex[key], label) for key, label in (
        ("no_comm", "no communication: no DDP, no SyncBN (ceiling)"),
        ("no_sync_bn", "DDP without SyncBN (--no-sync-bn)"),
        ("comm_hook_bf16", "--comm-hook bf16"),
        ("comm_hook_none", "--comm-hook none")) if key in ex]
    if "summary" in ex:
        sm = ex["summary"]
        lines.append(f"   ceiling {sm['ceiling_efficiency']:.2f}: what {sm['processes']} processes "
                     "sharing this machine reach; communication costs "
                     f"{sm['communication_loss']:.0%} of it")
        if sm["no_sync_bn_efficiency"] is not None:
            lines.append(f"   of which the gradient all-reduce {sm['gradient_loss']:.0%}, SyncBN's "
                         f"all-reduce per BatchNorm layer {sm['sync_bn_loss']:.0%}")
        if sm["all_reduce_ms"]:
            ar = sm["all_reduce_ms"]
            lines.append(f"   all-reduce of the {ar['numel'] / 1e6:.1f}M-value gradient alone: "
                         f"{ar['fp32']:.1f} ms fp32, {ar['bf16']:.1f} ms bf16; one 1-process "
                         f"step: {sm['step_ms_1_process']:.1f} ms")
    if s["memory_kind"] == "peak RSS":
        first = next(iter(s["results"].values()))
        lines.append(f"   (peak RSS includes ~{first['rss_at_start_mib'][0]:.0f} MiB a rank holds "
                     "after importing torch, before any model or data)")
    return lines


def _data_lines(d: dict[str, Any], p: dict[str, Any], repeats: int) -> list[str]:
    target = (f"   target >= {d['target_img_per_s']} on an H200 (resnet34, 224 px, bf16, "
              "channels-last)" if d["target_img_per_s"] else "")
    return [f"5. Training with data, img/s (1 process; {d['model']}, {d['img_size']} px, batch "
            f"{d['batch_size']}, {d['workers']} loader worker(s); {d['files']} JPEGs "
            f"{p['image_width']}x{p['image_height']}; {d['timed_images'] // d['batch_size']} "
            f"steps after {d['untimed_batches_first']}; median of {repeats})",
            _row(f"loader alone: decode + augment, copy to {d['device'].split(':')[0]}",
                 f"{d['loader_img_per_s']:.1f}"),
            _row("compute alone: stage 2, pre-loaded batches", f"{d['compute_img_per_s']:.1f}"),
            _row("train_one_epoch fed by the loader", f"{d['with_data_img_per_s']:.1f}", target),
            _row("with data / compute alone", f"{d['data_efficiency']:.3f}",
                 f"   limited by {d['limited_by']}")]


def format_table(report: dict[str, Any]) -> str:
    """The human-readable summary printed at the end (also what goes into the README)."""
    repeats = report["config"]["repeats"]
    sections = [_header_lines(report), _pipeline_lines(report["pipeline"], repeats),
                _loop_lines(report["loop"], repeats), _scaling_lines(report["scaling"], repeats),
                _data_lines(report["with_data"], report["pipeline"], repeats)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def write_chart(report: dict[str, Any], path: Path) -> Path:
    """Three bar charts: pipeline img/s, loop img/s, time per epoch vs number of processes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, loop, s = report["pipeline"], report["loop"], report["scaling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))

    names = ["template\n(PIL + v1)", "ours\n(torchvision.io + v2)"]
    values = [p["template_img_per_s"], p["ours_img_per_s"]]
    if p.get("gpu_decode", {}).get("img_per_s"):
        names.append("ours\n(nvJPEG, main process)")
        values.append(p["gpu_decode"]["img_per_s"])
    bars = axes[0].bar(names, values, color=["#999999", "#1f77b4", "#2ca02c"][:len(values)])
    axes[0].bar_label(bars, fmt="%.0f")
    axes[0].set_ylabel("images / s per worker")
    axes[0].set_title(f"input pipeline (crop {p['crop']}): {p['ratio']:.2f}x")

    d = report["with_data"]
    bars = axes[1].bar(["bare loop", "train_one_epoch", f"with data\n({d['workers']} workers)"],
                       [loop["bare_img_per_s"], loop["ours_img_per_s"], d["with_data_img_per_s"]],
                       color=["#999999", "#1f77b4", "#2ca02c"])
    axes[1].bar_label(bars, fmt="%.1f")
    axes[1].set_ylabel("images / s")
    axes[1].set_title(f"training loop: efficiency {loop['efficiency']:.3f}\n(overhead "
                      f"{loop['overhead']['per_step_ms']:.2f} ms/step -> "
                      f"{loop['overhead']['implied_efficiency']:.4f})")

    entries = list(s["results"].values())
    names = [str(e["processes"]) for e in entries]
    colors = ["#1f77b4"] * len(entries)
    ex = s.get("explain") or {}
    for key, label, color in (("no_sync_bn", "no\nSyncBN", "#6baed6"),
                              ("comm_hook_bf16", "bf16\ncomm", "#9ecae1"),
                              ("comm_hook_none", "fp32\ncomm", "#9ecae1"),
                              ("no_comm", "no comm\n(ceiling)", "#cccccc")):
        if key in ex:
            entries.append(ex[key])
            names.append(f"{ex[key]['processes']}\n{label}")
            colors.append(color)
    unit = "GPUs" if s["device"] == "cuda" else "processes"
    positions = range(len(entries))  # evenly spaced bars for 1, 2, 4, 8 ...
    bars = axes[2].bar(positions, [e["epoch_seconds"] for e in entries], color=colors)
    axes[2].set_xticks(positions, names)
    axes[2].bar_label(bars, labels=[f"{e['epoch_seconds']:.1f}s\n{e['efficiency']:.0%} efficiency"
                                    for e in entries])
    axes[2].set_xlabel(f"number of {unit}")
    axes[2].set_ylabel(f"seconds per epoch ({s['epoch_images']} images)")
    axes[2].set_title("time per epoch vs number of processes")
    axes[2].margins(y=0.2)

    where = ", ".join(report["host"].get("gpus") or [report["host"]["cpu"]])
    fig.suptitle(f"{loop['model']}, {loop['img_size']} px, batch {loop['batch_size']} per "
                 f"process - {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main
def _process_counts(max_procs: int) -> list[int]:
    counts = {1, max_procs}
    n = 2
    while n < max_procs:
        counts.add(n)
        n *= 2
    return sorted(counts)


def main(args: argparse.Namespace) -> dict[str, Any]:
    from utils import DataError, write_json_atomic

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    command = "python " + shlex.join([os.path.basename(sys.argv[0]) or "benchmark.py",
                                      *sys.argv[1:]])
    log.info("command: %s", command)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda was asked for, but CUDA is not available here; "
                 "use --device cpu (or auto).")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    max_procs = args.max_procs or (torch.cuda.device_count() if use_cuda else 2)
    # Resolved copy for every stage and rank ("auto" decided once; ranks pick their own GPU).
    args = argparse.Namespace(**{**vars(args), "device": device.type, "max_procs": max_procs})
    if use_cuda and max_procs > torch.cuda.device_count():
        sys.exit(f"error: --max-procs {max_procs} but only {torch.cuda.device_count()} GPU(s) "
                 "are visible; lower --max-procs.")
    for flag, value in (("batch-size", args.batch_size), ("steps", args.steps),
                        ("repeats", args.repeats), ("pipeline-images", args.pipeline_images),
                        ("threads", args.threads), ("max-procs", max_procs),
                        ("warmup-steps", args.warmup_steps),
                        ("grad-accum-steps", args.grad_accum_steps),
                        ("img-size", args.img_size), ("pipeline-size", args.pipeline_size),
                        ("epoch-images", args.epoch_images), ("num-classes", args.num_classes)):
        if value < 1:
            sys.exit(f"error: --{flag} must be at least 1, not {value}.")
    if args.workers is not None and args.workers < 0:
        sys.exit(f"error: --workers must be 0 or more, not {args.workers}.")
    procs = _process_counts(max_procs)
    usable = usable_cpus()
    if not use_cuda and max_procs * args.threads > usable:
        log.warning("%d processes x %d thread(s) is more than the %s usable CPUs: ranks will share "
                    "cores and scaling efficiency will show it.", max_procs, args.threads, usable)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu_decode = use_cuda if args.gpu_decode is None else args.gpu_decode and use_cuda

    report: dict[str, Any] = {"command": command, "argv": sys.argv,
                              "config": {**vars(args), "procs": procs},
                              "versions": _versions(), "host": _host_info(device)}
    try:
        image_dir = Path(args.image_dir) if args.image_dir else default_image_dir()
    except DataError as exc:  # no home folder
        sys.exit(f"error: {exc}")
    log.info("1/4 input pipeline: %d JPEGs in %s", args.pipeline_images, image_dir)
    paths = make_photos(image_dir, args.pipeline_images, seed=args.seed)
    report["pipeline"] = bench_pipeline(paths, args.pipeline_size, args.batch_size, args.repeats)
    if gpu_decode:
        report["pipeline"]["gpu_decode"] = bench_gpu_decode(paths, args.pipeline_size,
                                                            args.batch_size, args.repeats, device)
    log.info("2/4 training loop: %s at %d px on %s", args.model, args.img_size, device)
    if use_cuda:
        torch.backends.cudnn.benchmark = True  # as the training script: fixed input size
    report["loop"] = bench_loop(args, device)
    if use_cuda:
        torch.cuda.empty_cache()  # leave GPU 0 to the rank that uses it next
    log.info("3/4 scaling: %s process(es)", ", ".join(map(str, procs)))
    report["scaling"] = bench_scaling(args, device, procs)
    report["peak_memory"] = {
        "kind": report["scaling"]["memory_kind"], "unit": "MiB",
        "per_rank": {n: e["peak_memory_mib"] for n, e in report["scaling"]["results"].items()}}
    log.info("4/4 training with data (table 5): the training loader over the %d JPEGs, %s at "
             "%d px",
             args.pipeline_images, args.model, args.img_size)
    report["with_data"] = bench_with_data(args, device, paths, report["loop"]["ours_img_per_s"])
    report["host"]["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    write_json_atomic(out / "benchmark.json", report)
    write_chart(report, out / "benchmark.png")
    print("\n" + format_table(report), flush=True)
    print(f"\nwrote {out / 'benchmark.json'} and {out / 'benchmark.png'}", flush=True)
    return report


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except "(default: None)": those flags say their fallback in the help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _path_flag(text: str) -> str:
    from utils import path_flag  # torchvision: imported when parsing, not by every rank

    return path_flag(text)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Benchmark the input pipeline, training loop, DDP scaling and memory.",
        formatter_class=_HelpFormatter, add_help=add_help)
    parser.add_argument("--model", default="resnet34", choices=sorted(MODELS), help="architecture")
    parser.add_argument("--img-size", type=int, default=64,
                        help="training crop for the loop and scaling runs")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=16,
                        help="per process (and the batch a pipeline worker collates)")
    parser.add_argument("--num-classes", type=int, default=5,
                        help="classifier outputs (the labels are synthetic)")
    parser.add_argument("--lr", type=float, default=0.001, help="x world size, as in training")
    parser.add_argument("--pipeline-images", type=int, default=200,
                        help="JPEGs decoded per pipeline pass")
    parser.add_argument("--pipeline-size", type=int, default=224,
                        help="crop of the pipeline comparison (the template's 224)")
    parser.add_argument("--image-dir", default=None, type=_path_flag,
                        help="where the test JPEGs are generated and cached "
                             "(default: ddp-template/bench_photos_v1 in $XDG_CACHE_HOME or ~/.cache)")
    parser.add_argument("--gpu-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="also time decode_jpeg(device='cuda') (default: on with CUDA)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers of the with-data stage "
                             "(default: the training script's: CPUs per process - 1 on CUDA, "
                             "at most 8 on CPU, at most the batch size)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps first (at least 1: they start the loader workers "
                             "and let cuDNN pick its kernels)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed repeats of each measurement (medians and best are reported)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process on CPU (loop and every rank)")
    parser.add_argument("--max-procs", type=int, default=None,
                        help="largest process count for scaling "
                             "(default: visible GPUs, or 2 on CPU)")
    parser.add_argument("--epoch-images", type=int, default=FLOWER_TRAIN_IMAGES,
                        help="images in one epoch for the time-per-epoch chart "
                             "(default: %(default)s, flower_photos' training split)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: CUDA if available, else the CPU")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="mixed precision (default: on for CUDA, off for CPU)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="NHWC memory format (default: on for CUDA)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model (warm-up steps absorb the compile)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=True,
                        help="SyncBatchNorm when distributed, as the training default")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP gradient bucket size")
    parser.add_argument("--comm-hook", default="none", choices=COMM_HOOKS,
                        help="DDP gradient compression, as the training flag")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="batches per gradient all-reduce in the scaling runs, as the "
                             "training flag")
    parser.add_argument("--explain-scaling", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the largest process count without communication "
                             "(the hardware's ceiling), without SyncBN and with the other "
                             "comm hooks, and time the all-reduce alone")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the generated photos and the synthetic batches")
    parser.add_argument("--output-dir", default="benchmark_results", type=_path_flag,
                        help="benchmark.json and benchmark.png go here")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
