"""Stage 5, training with data (one process): ``train_one_epoch`` fed by the training script's
loader (workers decoding the JPEGs of stage 1), beside that loader alone and stage 2's compute
alone, so the table says which of the two limits training.

On a GPU this is the figure to hold against the target (ResNet34, 224 px, bf16, channels-last:
5,000 img/s on an H200). Timed in steady state, as in a long epoch: not the loader's start-up
that every epoch pays.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from my_dataset import MyDataSet, default_workers, loader_kwargs
from augment import get_transforms

from .common import build, cpu_threads, quiet_train_one_epoch, sync
from .photos import photos
from .report import row

log = logging.getLogger(__name__)

# Data included, one H200 GPU: the target for ResNet34 at 224 px, bf16, channels-last.
CUDA_TARGET_IMG_PER_S = 5000
DATA_EFFICIENT = 0.9  # with data / compute alone: above it, the data costs (almost) nothing


def _data_loader(paths: Sequence[str], args: argparse.Namespace, device: torch.device,
                 workers: int, batches: int, decode: str = "workers") -> DataLoader:
    """The training script's train loader over the photos, repeated to ``batches`` full batches.

    As the training script builds it: ``MyDataSet`` with the training transform at
    ``--img-size`` (``--decode``: ``decode``) and ``my_dataset.loader_kwargs``.
    """
    count = batches * args.batch_size
    dataset = MyDataSet([paths[i % len(paths)] for i in range(count)],
                        [i % args.num_classes for i in range(count)],
                        get_transforms(args.img_size, decode)["train"], seed=args.seed)
    torch.manual_seed(args.seed)  # loader_kwargs' generator starts from it: the same shuffle
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                      **loader_kwargs(workers, device))


class SteadyWindow:
    """``loader``, with each pass over it timed from the yield of batch ``skip`` to that of batch
    ``skip + steps`` (the device synchronised at both), into ``seconds``.

    In between exactly ``steps`` batches are both loaded and consumed: the rate of a long epoch.
    Timing a whole pass would add the start-up every epoch pays again (each worker decodes a full
    batch before the first arrives), which over a short pass is much of the time on a GPU. The
    workers deliver in bursts, one batch each (they start together, and batches go to them in
    turn), so ``skip`` and ``steps`` must be multiples of the worker count: a window inside one
    burst would time almost nothing.
    """

    def __init__(self, loader: DataLoader, skip: int, steps: int, device: torch.device) -> None:
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
                sync(self.device)
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
    steady state (:class:`SteadyWindow`): ``--steps`` batches after ``--warmup-steps``, each
    rounded up to a multiple of the worker count.
    """
    workers = default_workers(args.batch_size, device) if args.workers is None else args.workers
    burst = max(1, workers)  # batches that arrive together (see SteadyWindow)
    skip = burst * -(-args.warmup_steps // burst)
    steps = burst * -(-args.steps // burst)
    images = steps * args.batch_size
    with cpu_threads(args, device):
        torch.manual_seed(args.seed)
        model, optimizer, scaler = build(args, device)
        window = SteadyWindow(_data_loader(paths, args, device, workers, skip + steps + 1),
                              skip, steps, device)

        def loader_alone() -> None:
            for batch_images, labels in window:
                batch_images.to(device, non_blocking=True)
                labels.to(device, non_blocking=True)

        def training() -> None:
            quiet_train_one_epoch(model, optimizer, window, device, args, scaler)

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
            "limited_by": data_limit(loader_rate, with_data, compute_img_per_s, workers),
            "target_img_per_s": CUDA_TARGET_IMG_PER_S if device.type == "cuda" else None}


def data_limit(loader: float, with_data: float, compute: float, workers: int) -> str:
    """What holds training with data back, from the three rates of stage 5."""
    if loader < compute:
        return "input pipeline"  # the workers cannot supply what the model consumes
    if with_data < DATA_EFFICIENT * compute:
        if workers == 0:  # loading and training take turns in one process
            return "loading in the training process (--workers 0)"
        return "CPUs shared by the loader workers and training"  # each fast enough alone
    return "compute"


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"with_data": figures}``; needs the loop stage's ``ours_img_per_s``."""
    log.info("training with data (table 5): the training loader over the %d JPEGs, %s at %d px",
             args.pipeline_images, args.model, args.img_size)
    compute = report["loop"]["ours_img_per_s"]
    return {"with_data": bench_with_data(args, device, photos(args), compute)}


def table_lines(report: dict[str, Any]) -> list[str]:
    d, p, repeats = report["with_data"], report["pipeline"], report["config"]["repeats"]
    target = (f"   target >= {d['target_img_per_s']} on an H200 (resnet34, 224 px, bf16, "
              "channels-last)" if d["target_img_per_s"] else "")
    return [f"5. Training with data, img/s (1 process; {d['model']}, {d['img_size']} px, batch "
            f"{d['batch_size']}, {d['workers']} loader worker(s); {d['files']} JPEGs "
            f"{p['image_width']}x{p['image_height']}; {d['timed_images'] // d['batch_size']} "
            f"steps after {d['untimed_batches_first']}; median of {repeats})",
            row(f"loader alone: decode + augment, copy to {d['device'].split(':')[0]}",
                f"{d['loader_img_per_s']:.1f}"),
            row("compute alone: stage 2, pre-loaded batches", f"{d['compute_img_per_s']:.1f}"),
            row("train_one_epoch fed by the loader", f"{d['with_data_img_per_s']:.1f}", target),
            row("with data / compute alone", f"{d['data_efficiency']:.3f}",
                f"   limited by {d['limited_by']}")]
