"""Stage: how long until the first training step on a large folder (issue 38). Seconds from the
command to the end of the first optimizer step, against the number of files: a few small JPEGs
hard-linked into class folders (1000, as ImageNet, or fewer for a small count), in a temporary
folder deleted after (links cost directory entries, not data), read from the page cache. One
process each, alternating in every repeat:

- ImageFolder: a bare ImageFolder + DistributedSampler + DataLoader script (``BARE``), as
  torchvision's references start;
- fresh: the training script starting a new run with its default flags (it lists the folder and
  stores the list in the run folder);
- continued: the same command again after a stop signal at that first step saved it, as after
  a preemption: it resumes and reuses the stored list.

Both use the benchmark's model, image size, batch, loader workers and device. Also timed: the
listing alone in one process (the names ``os.scandir`` reads, the floor; ``ImageFolder``'s
``make_dataset``; ``scan_image_folder``), the header check of ``--verify-images`` at the
smallest count, and, on 2 gloo processes, rank 0's list of the largest folder handed to the
other rank by ``run_on_main`` (the pickle, the broadcast, the unpickle) and that rank rebasing it
below another root, as a machine with the data elsewhere does. The ranks are spawned: each
imports this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from multi_train_utils.distributed_utils import (cleanup, find_free_port, init_distributed_mode,
                                                 run_on_main)
from my_dataset import default_workers
from image_folder import scan_image_folder

from .report import ROOT, row, spread
from .scaling import barrier, rank_environment

log = logging.getLogger(__name__)

FILES = (10_000, 100_000, 300_000, 1_281_167)  # the last: ImageNet's training set
CLASSES = 1000
TARGETS = {"fresh": 2.0, "continued": 1.2}  # x the ImageFolder script's time, at 300k files on

BARE = r"""
import os, sys, time
import torch, torchvision
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms
root, name, size, batch, workers, device = sys.argv[1:]
device = torch.device(device)
dataset = datasets.ImageFolder(root, transforms.Compose([transforms.RandomResizedCrop(int(size)),
                                                         transforms.ToTensor()]))
sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
loader = DataLoader(dataset, batch_size=int(batch), sampler=sampler, num_workers=int(workers),
                    drop_last=True)
model = torchvision.models.get_model(name, num_classes=len(dataset.classes)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
for images, labels in loader:
    loss = torch.nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    break
if device.type == "cuda":
    torch.cuda.synchronize()
print(repr(time.time()), flush=True)
os._exit(0)
"""

# Runs the training script; after its first optimizer step prints the time, then stops as a
# signal would stop it (argv[1] "stop": the step is saved, exit 143) or exits at once.
FIRST_STEP = r"""
import os, runpy, signal, sys, time
import torch
import multi_train_utils.train_eval_utils as loop
step, then = loop._optimizer_step, sys.argv[1]
def first_step(*args, **kwargs):
    step(*args, **kwargs)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    print(repr(time.time()), flush=True)
    if then != "stop":
        os._exit(0)
    loop._optimizer_step = step
    os.kill(os.getpid(), signal.SIGTERM)
loop._optimizer_step = first_step
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def make_tree(root: Path, start: int, stop: int, classes: int, sources: list[Path]) -> None:
    """Files ``start`` to ``stop - 1`` of ``root/cNNNN/NNNNNNNN.JPEG``, file k in class k %
    ``classes``: hard links to ``sources``."""
    for c in range(classes):
        (root / f"c{c:04d}").mkdir(parents=True, exist_ok=True)
    for k in range(start, stop):
        os.link(sources[k % len(sources)], root / f"c{k % classes:04d}" / f"{k:08d}.JPEG")


def _names(root: Path) -> int:
    """The file names in the class folders of ``root``: what ``os.scandir`` alone reads."""
    count = 0
    with os.scandir(root) as classes:
        for folder in classes:
            with os.scandir(folder.path) as files:
                count += sum(1 for _ in files)
    return count


def time_listing(root: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds to list ``root`` in this process: the names alone (the floor), ``ImageFolder``'s
    ``make_dataset``, and ``scan_image_folder`` without reading headers (the default)."""
    ways = {"scandir": lambda: _names(root),
            "image_folder": lambda: make_dataset(str(root), find_classes(str(root))[1],
                                                 IMG_EXTENSIONS),
            "ours": lambda: scan_image_folder(root, verify=False)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _timed(cmd: list[str], expect: int, what: str) -> tuple[float, str]:
    """Seconds from starting ``cmd`` to the time it prints last, and its output."""
    start = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = done.stdout.split()
    if done.returncode != expect or not lines:
        raise RuntimeError(f"{what} exited {done.returncode}, not {expect}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return float(lines[-1]) - start, done.stderr


def time_count(root: Path, runs: Path, args: argparse.Namespace, device: torch.device,
               workers: int) -> dict[str, list[float]]:
    """Each of the three starts on the folder ``root``, ``--repeats`` times (seconds)."""
    bare = [sys.executable, "-c", BARE, str(root), args.model, str(args.img_size),
            str(args.batch_size), str(workers), device.type]
    train = ["train_multi_gpu_using_launch.py", "--device", device.type, "--model", args.model,
             "--img-size", str(args.img_size), "--batch-size", str(args.batch_size),
             "--data-path", str(root), "--output-dir", str(runs / "run"),
             *(["--workers", str(args.workers)] if args.workers is not None else [])]
    hook = [sys.executable, "-c", FIRST_STEP]
    commands = {"bare": (bare, 0), "fresh": ([*hook, "stop", *train], 143),
                "continued": ([*hook, "go", *train], 0)}
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for repeat in range(args.repeats):  # the continued run after its fresh one
        for name in ("fresh", "continued", "bare") if repeat % 2 else commands:
            took, text = _timed(*commands[name], f"the {name} start on {root}")
            if name == "continued" and "not listed again" not in text:
                raise RuntimeError(f"the continued run listed {root} again:\n{text[-3000:]}")
            seconds[name].append(took)
        shutil.rmtree(runs / "run")
    return seconds


def broadcast_worker(local_rank: int, root: str, port: int, result_dir: str,
                     repeats: int) -> None:
    """One of 2 gloo ranks: rank 0 lists ``root``; then ``repeats`` times every rank gets the
    list as in the training script (``run_on_main``) and rank 1 rebases it."""
    rank_environment(local_rank, 2, port)
    info = init_distributed_mode(device="cpu", timeout_s=1800)
    try:
        held = scan_image_folder(root, verify=False) if info.rank == 0 else None
        seconds, rebase = [], []
        for _ in range(repeats):
            barrier(info)
            start = time.perf_counter()
            scan = run_on_main(lambda: held)
            barrier(info)  # every rank has it
            seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            scan.rebased("/elsewhere" + scan.root)
            rebase.append(time.perf_counter() - start)
        if info.rank == 1:
            with open(Path(result_dir) / "broadcast.json", "w", encoding="utf-8") as f:
                json.dump({"seconds": seconds, "rebase_seconds": rebase,
                           "paths": sum(map(len, scan.images)),
                           "pickled_mb": len(pickle.dumps(scan)) / 1e6}, f)
    finally:
        cleanup()


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"startup": figures}``."""
    counts = sorted(set(args.startup_files))
    classes = min(CLASSES, counts[0] // 10)  # 10 files a class at least: one validates
    workers = args.workers if args.workers is not None else default_workers(args.batch_size,
                                                                            device)
    seconds, listing, made = {}, {}, 0
    with tempfile.TemporaryDirectory(prefix="ddp-startup-") as tmp:
        sources = []
        for i in range(64):  # small JPEGs; ext4 takes 65,000 links to a file
            sources.append(Path(tmp) / f"source{i}.jpg")
            pixels = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(sources[-1], quality=90)
        data = Path(tmp) / "data"
        for count in counts:
            log.info("startup: %d files in %d class folders, %d repeats", count, classes,
                     args.repeats)
            make_tree(data, made, count, classes, sources)
            if not made:  # at the smallest count: the header check of --verify-images
                start = time.perf_counter()
                scan_image_folder(data, verify=True)
                verify = {"files": count, "seconds": time.perf_counter() - start}
            made = count
            listing[str(count)] = time_listing(data, args.repeats)  # warms the page cache too
            seconds[str(count)] = time_count(data, Path(tmp) / "runs", args, device, workers)
        log.info("startup: the list of %d files from rank 0 to rank 1", made)
        mp.start_processes(broadcast_worker, args=(str(data), find_free_port(), tmp,
                                                   args.repeats), nprocs=2, join=True,
                           start_method="spawn")
        broadcast = json.loads((Path(tmp) / "broadcast.json").read_text(encoding="utf-8"))
        log.info("startup: deleting the %d links", made)
    rows = {}
    for count, runs in seconds.items():
        rows[count] = {f"{name}_s": statistics.median(values) for name, values in runs.items()}
        for name in TARGETS:
            ratios = [s / b for s, b in zip(runs[name], runs["bare"])]
            rows[count].update({f"{name}_ratios": ratios,
                                f"{name}_ratio": statistics.median(ratios)})
        rows[count]["runs_s"] = runs
        rows[count]["listing_runs_s"] = listing[count]
        rows[count]["listing_s"] = {name: statistics.median(values)
                                    for name, values in listing[count].items()}
    return {"startup": {"files": rows, "classes": classes, "workers": workers,
                        "model": args.model, "img_size": args.img_size,
                        "batch_size": args.batch_size, "device": device.type,
                        "targets": TARGETS, "broadcast": broadcast, "verify": verify}}


def table_lines(report: dict[str, Any]) -> list[str]:
    s = report["startup"]
    lines = [f"Start-up: seconds from the command to the first optimizer step (1 process, "
             f"{s['model']}, {s['img_size']} px, batch {s['batch_size']}, {s['workers']} loader "
             f"workers, {s['device']}; hard links in {s['classes']} class folders; median of "
             f"{report['config']['repeats']})",
             "       files   ImageFolder     fresh   continued    fresh/IF   continued/IF"]
    for count, r in s["files"].items():
        lines.append(f"   {int(count):>9}   {r['bare_s']:>11.2f}   {r['fresh_s']:>7.2f}   "
                     f"{r['continued_s']:>9.2f}   {r['fresh_ratio']:>8.2f}x   "
                     f"{r['continued_ratio']:>11.2f}x   (pairs {spread(r['fresh_ratios'])}, "
                     f"{spread(r['continued_ratios'])})")
    lines += [f"   targets: fresh <= {s['targets']['fresh']}x, continued <= "
              f"{s['targets']['continued']}x the ImageFolder script's time",
              "   The listing alone, in one process (median s; no header read)",
              "       files   os.scandir names   ImageFolder   scan_image_folder"]
    for count, r in s["files"].items():
        t = r["listing_s"]
        lines.append(f"   {int(count):>9}   {t['scandir']:>16.3f}   {t['image_folder']:>11.3f}   "
                     f"{t['ours']:>17.3f}")
    b, v = s["broadcast"], s["verify"]
    lines += [row(f"header check of {v['files']} files (--verify-images)",
                  f"{v['seconds']:.1f} s", f"   {v['files'] / v['seconds']:.0f} files/s, "
                  "8 threads on rank 0"),
              row(f"rank 0's list of {b['paths']} files to rank 1",
                  f"{statistics.median(b['seconds']):.2f} s",
                  f"   gloo, pickled {b['pickled_mb']:.0f} MB: run_on_main, as in training"),
              row("the list rebased below another root",
                  f"{statistics.median(b['rebase_seconds']):.2f} s", "   (rank 1)")]
    return lines


def write_chart(report: dict[str, Any], path: Path) -> Path:
    """Left: seconds to the first step against the number of files, one line per start
    (median, bars from the fastest to the slowest repeat). Right: each start over the
    ImageFolder script's in the same repeat, with the targets."""
    from matplotlib.figure import Figure

    s = report["startup"]
    files, rows = [int(count) for count in s["files"]], list(s["files"].values())
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for name, label, style in (("bare", "ImageFolder script", "k:o"),
                               ("fresh", "training script, fresh start", "C0-s"),
                               ("continued", "training script, continued run", "C1-^")):
        median = [r[f"{name}_s"] for r in rows]
        spread = [[m - min(r["runs_s"][name]) for m, r in zip(median, rows)],
                  [max(r["runs_s"][name]) - m for m, r in zip(median, rows)]]
        left.errorbar(files, median, spread, fmt=style, capsize=3, label=label)
        if name in TARGETS:
            ratio = [r[f"{name}_ratio"] for r in rows]
            spread = [[m - min(r[f"{name}_ratios"]) for m, r in zip(ratio, rows)],
                      [max(r[f"{name}_ratios"]) - m for m, r in zip(ratio, rows)]]
            right.errorbar(files, ratio, spread, fmt=style, capsize=3, label=label)
            right.axhline(TARGETS[name], color=style[:2], ls="--", lw=1,
                          label=f"target, {name}: {TARGETS[name]}x")
    left.set(ylabel="seconds to the first step", ylim=(0, None))
    right.set(ylabel="x the ImageFolder script (same repeat)", ylim=(0, None))
    for ax in (left, right):
        ax.set(xscale="log", xlabel="files (hard links)")
        ax.set_xticks(files, [f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k"
                              for n in files])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{s['model']}, {s['img_size']} px, 1 process, {s['device']}; median and range "
                 f"of {len(rows[0]['runs_s']['bare'])} repeats; commit "
                 f"{report['versions'].get('git_describe') or 'unknown'}", fontsize=9)
    fig.savefig(path, dpi=90)
    return path
