"""Stage 1, the input pipeline: images/s per DataLoader worker (one process, one thread).

The classic template's PIL path (``Image.open().convert("RGB")``, ``transforms`` v1
RandomResizedCrop, flip, ``ToTensor``, ``Normalize``) against ours (``MyDataSet``:
``torchvision.io`` decoding, ``transforms.v2`` on uint8, normalisation left to the device), on the
same photo-sized JPEGs (500x375, quality 90, generated once and cached). On CUDA, also the rate
of decoding with nvJPEG in the main process (``--gpu-decode``).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms as transforms_v1
from torchvision.io import ImageReadMode, decode_jpeg, read_file

from multi_train_utils.train_eval_utils import IMAGENET_MEAN, IMAGENET_STD
from my_dataset import MyDataSet
from augment import get_transforms

from .common import num_threads, paired, rate
from .photos import photos
from .report import row, spread

log = logging.getLogger(__name__)

PIPELINE_TARGET = 1.6  # ours / template images per second per worker


def collate(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
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
    return transforms_v1.Compose([transforms_v1.RandomResizedCrop(img_size),
                                  transforms_v1.RandomHorizontalFlip(),
                                  transforms_v1.ToTensor(),
                                  transforms_v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def _loader_pass(dataset: Dataset, batch_size: int, limit: int | None = None) -> None:
    """What one DataLoader worker does: ``__getitem__`` for each batch, then collate."""
    count = len(dataset) if limit is None else min(limit, len(dataset))
    for first in range(0, count, batch_size):
        collate([dataset[i] for i in range(first, min(first + batch_size, count))])


def bench_pipeline(paths: Sequence[str], img_size: int, batch_size: int,
                   repeats: int) -> dict[str, Any]:
    """Per-worker images/s of the template's PIL path and ours on the same files."""
    labels = [0] * len(paths)
    template = TemplateDataSet(paths, labels, template_transform(img_size))
    ours = MyDataSet(paths, labels, get_transforms(img_size)["train"])
    for path in paths:  # both read from the page cache, never one from the disk
        Path(path).read_bytes()
    datasets = {"template": template, "ours": ours}
    runs: dict[str, list[float]] = {"template": [], "ours": []}
    with num_threads(1):  # a DataLoader worker runs with one torch thread
        for dataset in datasets.values():
            _loader_pass(dataset, batch_size, limit=2 * batch_size)  # warm-up
        for r in range(repeats):
            for name in ("template", "ours") if r % 2 == 0 else ("ours", "template"):
                one_pass = partial(_loader_pass, datasets[name], batch_size)
                runs[name].append(rate(len(paths), one_pass, torch.device("cpu")))
    summary = paired(runs["template"], runs["ours"], "template", "ours")
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


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"pipeline": figures}``, nvJPEG's under ``"gpu_decode"`` on CUDA."""
    log.info("input pipeline: %d JPEGs in %s", args.pipeline_images, args.image_dir)
    paths = photos(args)
    part = bench_pipeline(paths, args.pipeline_size, args.batch_size, args.repeats)
    if device.type == "cuda" and args.gpu_decode is not False:  # None: on with CUDA
        part["gpu_decode"] = bench_gpu_decode(paths, args.pipeline_size, args.batch_size,
                                              args.repeats, device)
    return {"pipeline": part}


def table_lines(report: dict[str, Any]) -> list[str]:
    p, repeats = report["pipeline"], report["config"]["repeats"]
    lines = [f"1. Input pipeline, img/s per worker (1 process, 1 thread; {p['images']} JPEGs "
             f"{p['image_width']}x{p['image_height']} q{p['jpeg_quality']}, "
             f"~{p['mean_file_kb']:.0f} KB; crop {p['crop']}; median of {repeats})",
             row("template: PIL + transforms v1 -> float", f"{p['template_img_per_s']:.1f}"),
             row("ours: torchvision.io + transforms v2 -> uint8", f"{p['ours_img_per_s']:.1f}"),
             row("speed-up (median of paired repeats)", f"{p['ratio']:.2f}x",
                 f"   target >= {p['target_ratio']}x; repeats {spread(p['paired_ratios'])}")]
    if p.get("gpu_decode", {}).get("img_per_s"):
        lines.append(row(f"ours, nvJPEG on {p['gpu_decode']['device']} (main process)",
                         f"{p['gpu_decode']['img_per_s']:.1f}"))
    return lines
