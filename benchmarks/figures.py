"""Rebuild docs/how-it-works.md's figures from the code and real CPU training runs (minutes):
``make figures`` or ``python -m benchmarks.figures``. Into docs/figures/: split.png (the samplers'
indices per rank), speed.png (time and images/s here, beside docs/performance.md's H200 numbers),
curves.png (1 process with batch 2B against 2 with batch B, with and without SyncBatchNorm) and
figures.json, every number shown; the doc's ``<!-- figures:NAME -->`` sentences are rendered
from it, so text and runs cannot drift apart."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch.utils.data import BatchSampler, DistributedSampler

from plot_results import load_metrics
from demo_data import make_demo_data
from image_folder import scan_image_folder, split_train_val
from run_log import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent

SEED = 0  # at seed 0, 480 of the demo's 600 images train: 15 steps of 32, none padded
COMMON = ["--device", "cpu", "--model", "resnet18", "--img-size", "64", "--seed", str(SEED),
          "--workers", "0", "--no-tensorboard", "--resume", "none", "--keep-last", "1"]
# name: (processes, threads each, flags, label, line). --lr is per process's batch, times the
# processes (--scale-lr): 0.01 x 1 and 0.005 x 2 both step at 0.01. 1 thread: rounding alone.
ONE, TWO = ["--batch-size", "32", "--lr", "0.01"], ["--batch-size", "16", "--lr", "0.005"]
RUNS = {"1x32": (1, None, ONE, "1 process, batch 32", dict(linewidth=5, alpha=0.4)),
        "1x32_1thread": (1, 1, ONE, "1 process, batch 32, 1 thread", dict(ls="-.")),
        "2x16_syncbn": (2, 1, TWO, "2 processes x 16, SyncBatchNorm", dict(ls="--", marker="o")),
        "2x16_no_syncbn": (2, 1, [*TWO, "--no-sync-bn"], "2 processes x 16, no SyncBatchNorm",
                           dict(ls=":", marker="s"))}
LABELS = {name: run[3] for name, run in RUNS.items()}
H200 = {"source": "H200, 1 GPU, from docs/performance.md\n(measured 2026-12-04, commit 5125a24;"
                  "\nresnet34, 224 px, batch 256, bf16, torch 2.11.0)",
        "images_per_sec": {"compute alone": 8503.9, "with data,\n15 workers": 5720.4,
                           "with data,\n8 workers": 3819.0}}


def split_table(n: int, world: int, batch_size: int, seed: int = 0, epoch: int = 0) -> dict:
    """For ``n`` samples on ``world`` ranks: ``ranks[r]``, DistributedSampler's indices;
    ``padded[r]``, which repeat; ``batches[r]``, BatchSampler's (drop_last, as in training)."""
    table: dict[str, list] = {"ranks": [], "padded": [], "batches": []}
    for rank in range(world):
        sampler = DistributedSampler(range(n), world, rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        table["ranks"].append(list(sampler))
        # Rank r holds positions r, r + world, ... of the padded order; n and beyond repeat.
        table["padded"].append([rank + i * world >= n for i in range(len(sampler))])
        table["batches"].append(list(BatchSampler(sampler, batch_size, drop_last=True)))
    return table


def plot_split(n: int, worlds: tuple[int, ...], batch_size: int, path: Path) -> None:
    """Each rank's indices as a row of cells coloured by rank, padding hatched, batches boxed."""
    fig = Figure(figsize=(9, 1.3 + 1.1 * sum(w + 1 for w in worlds)), layout="constrained")
    for ax, world in zip(fig.subplots(len(worlds), 1, squeeze=False)[:, 0], worlds):
        table = split_table(n, world, batch_size, SEED)
        order = [i for row in zip(*table["ranks"]) for i in row]  # the padded permutation
        rows = [("padded order", order, range(len(order)))] + [
            (f"rank {r}", idx, range(r, len(order), world)) for r, idx in enumerate(table["ranks"])]
        for y, (_, values, positions) in enumerate(rows):
            for x, (value, pos) in enumerate(zip(values, positions)):
                ax.add_patch(Rectangle((x, -y - 0.65), 0.9, 0.55, facecolor=f"C{pos % world}",
                                       alpha=0.35, hatch="///" if pos >= n else None))
                ax.text(x + 0.45, -y - 0.375, str(value), ha="center", va="center",
                        bbox=dict(facecolor="white", edgecolor="none", pad=1) if pos >= n else None)
        for r, batches in enumerate(table["batches"]):
            for k in range(len(batches)):
                ax.add_patch(Rectangle((k * batch_size - 0.05, -r - 1.95), batch_size, 0.9,
                                       fill=False, linewidth=1.2))
                ax.text((k + 0.5) * batch_size - 0.05, -r - 1.8, f"batch {k}", ha="center",
                        va="center", fontsize=8)
        ax.set(xlim=(-0.2, len(order) + 0.1), ylim=(-len(rows) - 0.15, 0.1), xticks=[],
               xlabel="position in the padded order (top row) or in the rank's share",
               title=f"{n} samples on {world} ranks, epoch 0: DistributedSampler(shuffle=True, "
                     f"seed={SEED}),\nthen BatchSampler(batch_size={batch_size}, drop_last=True)")
        ax.set_yticks([-y - 0.375 for y in range(len(rows))], [r[0] for r in rows])
        handles = [Patch(facecolor=f"C{r}", alpha=0.35, label=f"rank {r}") for r in range(world)]
        ax.legend(handles=handles + [Patch(facecolor="white", edgecolor="black", hatch="///",
                                           label="padding: the order's first samples again")],
                  loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.savefig(path, dpi=100)


def train(procs: int, threads: int | None, flags: list[str], out: Path, data: Path) -> list:
    """A real run's epoch records; ``threads`` None: the launcher's (1 process: every CPU)."""
    launcher = ([] if procs == 1 else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"])
    cmd = [sys.executable, *launcher, "train_multi_gpu_using_launch.py", *COMMON, *flags,
           "--data-path", str(data), "--output-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
           "OMP_NUM_THREADS")} | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    print(" ".join(cmd[1:]), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: the run above failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return load_metrics(out / "metrics.jsonl")


def summarise(histories: dict[str, list[dict]], val_images: int, epochs: int) -> dict:
    """Speeds (medians over epochs 1 on: epoch 0 warms up) and each run's largest gap to 1x32."""
    speed = {name: {k: statistics.median(r[k] for r in h[1:]) for k in ("epoch_seconds",
                    "train_images_per_sec")} for name, h in histories.items()}
    gaps = {name: {k: max(abs(a[k] - b[k]) for a, b in zip(histories["1x32"], h)) for k in
                   ("val_acc", "train_loss")} for name, h in histories.items() if name != "1x32"}
    # -dirty: the code that ran was not all committed (rev-parse would name HEAD alone).
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    info = Path("/proc/cpuinfo")  # Linux; elsewhere the CPU count alone
    cpu = re.findall(r"^model name\s*:\s*(.+)$", info.read_text() if info.exists() else "", re.M)
    return {"made": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{(cpu or ['CPU'])[0]}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "commit": commit, "epochs": epochs, "val_images": val_images, "labels": LABELS,
            "speed": speed, "max_diff": gaps, "h200": H200, "histories": histories, "speedup":
            speed["2x16_syncbn"]["train_images_per_sec"] / speed["1x32"]["train_images_per_sec"]}


def plot_speed(summary: dict, path: Path) -> None:
    """Epoch time and images/s of the runs here, and the H200's, as labelled bars."""
    fig = Figure(figsize=(14, 4.8), layout="constrained")
    here = f"this machine: {summary['machine']},\nmade {summary['made']}"
    h200 = summary["h200"]["images_per_sec"]
    names = [summary["labels"][n].replace(", ", ",\n") for n in summary["speed"]]
    panels = [(names, "epoch_seconds", "seconds per epoch", "{:.2f} s", here),
              (names, "train_images_per_sec", "training images/s", "{:.1f}", here),
              (list(h200), None, "training images/s", "{:,.0f}", summary["h200"]["source"])]
    for ax, (labels, key, unit, fmt, title) in zip(fig.subplots(1, 3), panels):
        values = [v[key] for v in summary["speed"].values()] if key else list(h200.values())
        bars = ax.bar(labels, values, color=[f"C{i}" if key else "C7" for i in range(len(values))])
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=2, fontsize=8)
        ax.tick_params(axis="x", labelsize=7.5)
        ax.set(ylabel=unit, xlabel="run (resnet18, 64 px, 32 images per step)" if key else
               "train_one_epoch, 1 process")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.15)  # room for the values above the bars
    fig.savefig(path, dpi=100)


def plot_curves(summary: dict, path: Path) -> None:
    """Validation accuracy, training loss, and that loss's gap to 1 process, per epoch."""
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    axes, labels, gaps = fig.subplots(1, 3), summary["labels"], summary["max_diff"]
    base = summary["histories"]["1x32"]
    for i, (name, h) in enumerate(summary["histories"].items()):
        epochs, style = [r["epoch"] for r in h], dict(color=f"C{i}", **RUNS[name][4])
        axes[0].plot(epochs, [100 * r["val_acc"] for r in h], label=labels[name], **style)
        axes[1].plot(epochs, [r["train_loss"] for r in h], label=labels[name], **style)
        if name in gaps:
            axes[2].plot(epochs, [abs(r["train_loss"] - b["train_loss"]) for r, b in zip(h, base)],
                         label=f"{labels[name]}: largest {gaps[name]['train_loss']:.3f}", **style)
    for ax, unit in zip(axes, ("validation top-1 accuracy (%)", "training loss (cross-entropy)",
                               "|training loss - that of 1 process, batch 32|")):
        ax.set(xlabel="epoch", ylabel=unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    acc = ", ".join(f"{labels[n]}: {100 * d['val_acc']:.1f}" for n, d in gaps.items())
    fig.suptitle(f"Demo data, resnet18, 64 px, 32 images per step, seed 0, made {summary['made']}."
                 f"\nLargest gap to 1 process, batch 32, in validation accuracy (points): {acc}",
                 fontsize=9)
    fig.savefig(path, dpi=100)


def render_blocks(s: dict) -> dict[str, str]:
    """The doc's generated sentences, each formatted from figures.json alone."""
    ips = {n: f"{v['train_images_per_sec']:.1f} images/s ({v['epoch_seconds']:.2f} s per epoch)"
           for n, v in s["speed"].items()}
    gaps = "; ".join(f"{s['labels'][n]}: {d['val_acc']:.4f} and {d['train_loss']:.4f}"
                     for n, d in s["max_diff"].items())
    acc = ", ".join(f"{h[-1]['val_acc']:.4f} ({s['labels'][n]})" for n, h in s["histories"].items())
    # The label tests/test_docs.py looks for before measured numbers.
    label = f"Measured {s['made']} on {s['machine']}, commit {s['commit']}, torch {s['torch']}"
    return {"made": f"Made {s['made']} by `make figures` in {s['elapsed_s']:.0f} s on "
                    f"{s['machine']} (torch {s['torch']}, commit {s['commit']}).",
            "speed": f"{label}: one process (2 threads) trained {ips['1x32']}, with 1 thread "
                     f"{ips['1x32_1thread']}; two processes with SyncBatchNorm "
                     f"{ips['2x16_syncbn']}, **{s['speedup']:.2f}x** the speed of one; two "
                     f"without SyncBatchNorm {ips['2x16_no_syncbn']}.",
            "curves": f"Largest gap to one process with batch 32 over {s['epochs']} epochs, in "
                      f"validation accuracy and training loss: {gaps}. Final validation accuracy "
                      f"on the {s['val_images']} images: {acc}."}


def main(args: argparse.Namespace) -> None:
    start, out = time.perf_counter(), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_split(11, (2, 3), 2, out / "split.png")
    with tempfile.TemporaryDirectory(prefix="ddp-figures-") as tmp:
        data = make_demo_data(Path(tmp) / "demo")
        val_images = len(split_train_val(scan_image_folder(data), 0.2, SEED)[2])
        histories = {name: train(run[0], run[1], [*run[2], "--epochs", str(args.epochs)],
                                 Path(tmp) / name, data) for name, run in RUNS.items()}
    summary = summarise(histories, val_images, args.epochs)
    plot_speed(summary, out / "speed.png")
    plot_curves(summary, out / "curves.png")
    summary["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json_atomic(out / "figures.json", summary)
    text = Path(args.doc).read_text(encoding="utf-8")
    for name, body in render_blocks(summary).items():  # each block's text, markers kept
        text = re.sub(rf"(<!-- figures:{name} -->\n).*?(\n<!-- /figures -->)",
                      lambda m, body=body: m[1] + body + m[2], text, flags=re.S)
    Path(args.doc).write_text(text, encoding="utf-8")


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=str(ROOT / "docs" / "figures"), help="PNGs, JSON")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "how-it-works.md"), help="its text")
    parser.add_argument("--epochs", type=int, default=10, help="of each training run")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
