"""Stage 6, where the JPEGs are decoded (issue 37): ``--decode workers`` against ``--decode
device``, side by side in one process, beside the decoders alone and the compute alone.

1. Decode only, per worker (1 thread, bytes already in memory): ``torchvision.io``, PIL, and
   TorchCodec where installed: the decoders of the workers path, each on its own.
2. Decode only, in the main process on the training device, a batch per call: what
   ``--decode device`` does first (nvJPEG on CUDA, through ``torchvision.io`` and through
   TorchCodec where installed; on the CPU the CPU decoder).
3. Decode and augment: ``JpegBatch.to_device`` on batches the workers would send.
4. Training with data: ``train_one_epoch`` fed by the training loader under each ``--decode``,
   in steady state (``with_data.SteadyWindow``); ``device`` with at most ``--decode-workers``.
5. Compute alone: ``train_one_epoch`` on pre-loaded batches, in the same repeats.

The target (one H100/H200; ResNet34, 224 px, bf16, channels-last): ``--decode device`` with
data at least 0.9 of the compute alone, with 4 or fewer workers. ``make bench-gpu`` measures it.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

import my_dataset
from my_dataset import MyDataSet, default_workers
from augment import get_transforms

from .common import (build, cpu_threads, num_threads, quiet_train_one_epoch, rate,
                     synthetic_batches, sync)
from .photos import photos
from .report import row
from .with_data import SteadyWindow, _data_loader

log = logging.getLogger(__name__)

DEVICE_TARGET = 0.9  # --decode device with data / compute alone, on one H100/H200
TARGET_WORKERS = 4  # ... with at most this many loader workers

Decoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def decoders(device: torch.device) -> dict[str, Decoder | None]:
    """The JPEG decoders to compare (None: not installed), each a batch per call."""
    found: dict[str, Decoder | None] = {"torchvision.io": None, "torchcodec": None}
    if my_dataset.decode_jpeg is not None:
        found["torchvision.io"] = lambda data, dev: my_dataset.decode_jpeg(
            data, mode=my_dataset.ImageReadMode.RGB, device=dev)
    if my_dataset.codec_decode_jpeg is not None:
        found["torchcodec"] = lambda data, dev: my_dataset.codec_decode_jpeg(data, device=dev)
    if device.type == "cpu":  # PIL decodes on the CPU only
        found["PIL"] = lambda data, dev: [TF.pil_to_tensor(Image.open(io.BytesIO(
            x.numpy())).convert("RGB")) for x in data]
    return found


def _median_rate(count: int, fn: Callable[[], Any], device: torch.device, repeats: int
                 ) -> float:
    fn()  # warm-up: the decoder's handles, the kernels
    return statistics.median(rate(count, fn, device) for _ in range(repeats))


def bench_decoders(raw: Sequence[torch.Tensor], device: torch.device, batch_size: int,
                   repeats: int) -> dict[str, Any]:
    """Img/s of each decoder: per CPU worker (one image a call), and in the main process on
    ``device`` (a batch a call); None where a decoder is not installed."""
    cpu = torch.device("cpu")
    per_worker, batched = {}, {}
    with num_threads(1):  # a DataLoader worker runs with one torch thread
        for name, decode in decoders(cpu).items():
            per_worker[name] = decode and _median_rate(
                len(raw), lambda d=decode: [d([x], cpu) for x in raw], cpu, repeats)
    chunks = [list(raw[i:i + batch_size]) for i in range(0, len(raw), batch_size)]
    for name, decode in decoders(device).items():
        batched[name] = decode and _median_rate(
            len(raw), lambda d=decode: [d(chunk, device) for chunk in chunks], device, repeats)
    return {"per_worker_img_per_s": per_worker, "main_process_img_per_s": batched}


def bench_augment(paths: Sequence[str], args: argparse.Namespace, device: torch.device
                  ) -> float:
    """Img/s of ``JpegBatch.to_device``: one decode call and the augmentation, a batch at a
    time, on batches collated as the workers collate them (pinned on CUDA)."""
    dataset = MyDataSet(paths, [0] * len(paths), get_transforms(args.img_size, "device")["train"],
                        seed=args.seed)
    dataset.set_epoch(0)
    batches = [MyDataSet.collate_fn([dataset[i] for i in range(k, min(k + args.batch_size,
                                                                       len(paths)))])
               for k in range(0, len(paths), args.batch_size)]
    if device.type == "cuda":  # as DataLoader(pin_memory=True) hands them over
        batches = [b._replace(data=b.data.pin_memory(), labels=b.labels.pin_memory())
                   for b in batches]
    return _median_rate(len(paths), lambda: [b.to_device(device) for b in batches], device,
                        args.repeats)


def bench_training(paths: Sequence[str], args: argparse.Namespace, device: torch.device
                   ) -> dict[str, Any]:
    """Img/s of ``train_one_epoch`` fed by the training loader under each ``--decode``, in
    steady state, and on pre-loaded batches (the compute alone), in interleaved repeats."""
    workers = default_workers(args.batch_size, device) if args.workers is None else args.workers
    counts = {"workers": workers, "device": min(workers, args.decode_workers)}
    runs: dict[str, list[float]] = {"workers": [], "device": [], "compute": []}
    with cpu_threads(args, device):
        torch.manual_seed(args.seed)
        model, optimizer, scaler = build(args, device)
        passes: dict[str, Callable[[], float]] = {}
        for decode, count in counts.items():
            burst = max(1, count)  # batches that arrive together (see SteadyWindow)
            skip, steps = burst * -(-args.warmup_steps // burst), burst * -(-args.steps // burst)
            loader = _data_loader(paths, args, device, count, skip + steps + 1, decode=decode)
            passes[decode] = _timed(SteadyWindow(loader, skip, steps, device),
                                    lambda w: quiet_train_one_epoch(model, optimizer, w, device,
                                                                    args, scaler))
        batches = synthetic_batches(args, args.steps, args.seed, pin=device.type == "cuda")
        passes["compute"] = lambda: rate(
            args.steps * args.batch_size,
            lambda: quiet_train_one_epoch(model, optimizer, batches, device, args, scaler), device)
        for name in passes:
            passes[name]()  # warm-up: the persistent workers start, cuDNN picks its kernels
        order = list(passes)
        for r in range(args.repeats):
            for name in order[r % len(order):] + order[:r % len(order)]:  # each goes first
                runs[name].append(passes[name]())
    sync(device)
    median = {name: statistics.median(values) for name, values in runs.items()}
    return {"workers": counts, "runs_img_per_s": runs,
            "with_data_img_per_s": {k: median[k] for k in ("workers", "device")},
            "compute_img_per_s": median["compute"],
            "efficiency": {k: median[k] / median["compute"] for k in ("workers", "device")}}


def _timed(window: SteadyWindow, train: Callable[[SteadyWindow], Any]) -> Callable[[], float]:
    """A pass of ``train`` over ``window``, returning the img/s of its timed window."""
    def one_pass() -> float:
        train(window)
        return window.steps * window.loader.batch_size / window.seconds
    return one_pass


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"decode": figures}``."""
    paths = photos(args)
    log.info("decoding (table 6): %d JPEGs, --decode workers against device, %s at %d px",
             len(paths), args.model, args.img_size)
    raw = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    part = {"images": len(paths), "batch_size": args.batch_size, "model": args.model,
            "img_size": args.img_size, "device": str(device),
            **bench_decoders(raw, device, args.batch_size, args.repeats),
            "decode_augment_img_per_s": bench_augment(paths, args, device),
            **bench_training(paths, args, device),
            "target_efficiency": DEVICE_TARGET if device.type == "cuda" else None,
            "target_workers": TARGET_WORKERS}
    return {"decode": part}


def _rate(value: float | None) -> str:
    return "not installed" if value is None else f"{value:.1f}"


def table_lines(report: dict[str, Any]) -> list[str]:
    d, repeats = report["decode"], report["config"]["repeats"]
    where = d["device"].split(":")[0]
    lines = [f"6. Decoding, img/s (1 process; {d['images']} JPEGs; {d['model']}, {d['img_size']} "
             f"px, batch {d['batch_size']}; median of {repeats})"]
    lines += [row(f"decode only, per worker: {name}", _rate(value))
              for name, value in d["per_worker_img_per_s"].items()]
    lines += [row(f"decode only, batches on {where}: {name}", _rate(value))
              for name, value in d["main_process_img_per_s"].items() if name != "PIL"]
    target = (f"; target >= {d['target_efficiency']} with <= {d['target_workers']} workers on "
              "one H100/H200" if d["target_efficiency"] else "")
    return lines + [
        row(f"decode + augment, batches on {where}", f"{d['decode_augment_img_per_s']:.1f}"),
        row(f"training, --decode workers ({d['workers']['workers']} workers)",
            f"{d['with_data_img_per_s']['workers']:.1f}",
            f"   {d['efficiency']['workers']:.3f} of compute"),
        row(f"training, --decode device ({d['workers']['device']} workers)",
            f"{d['with_data_img_per_s']['device']:.1f}",
            f"   {d['efficiency']['device']:.3f} of compute{target}"),
        row("compute alone: pre-loaded batches", f"{d['compute_img_per_s']:.1f}")]
