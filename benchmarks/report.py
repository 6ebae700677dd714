"""What every report carries beside the stages' figures (host, versions, the commit), the table's
row helpers, its header, and the chart."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
import torchvision

from multi_train_utils.distributed_utils import usable_cpus

ROOT = Path(__file__).resolve().parent.parent  # the repository


def git_describe() -> str | None:
    """``git describe --always --dirty`` of the repository: the commit every number was measured
    on, ``-dirty`` when tracked files had uncommitted changes. None without git or a checkout."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def versions() -> dict[str, Any]:
    return {"git_describe": git_describe(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "pillow": PIL.__version__,
            "numpy": np.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def host_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    info = {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "cpus_usable": usable_cpus(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_avg_start": load_average()}
    if device.type == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# ---------------------------------------------------------------- the table
def spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def row(label: str, value: str, note: str = "") -> str:
    return f"   {label:<46}{value:>9}{note}"


def header_lines(report: dict[str, Any]) -> list[str]:
    host, versions = report["host"], report["versions"]
    load = lambda v: " ".join(f"{x:.2f}" for x in v) if v else "n/a"  # noqa: E731
    return [f"command: {report['command']}",
            f"commit: {versions.get('git_describe') or 'unknown (no git checkout)'}",
            f"host: {host['cpu']}, {host['cpus_usable'] or host['cpu_count']} CPUs"
            + (f", GPUs: {', '.join(host['gpus'])}" if host.get("gpus") else "")
            + f"; torch {versions['torch']}, torchvision {versions['torchvision']}",
            f"load average (1/5/15 min): {load(host['load_avg_start'])} at start, "
            f"{load(host['load_avg_end'])} at end"]


# ---------------------------------------------------------------- the chart
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
    commit = report["versions"].get("git_describe") or "no git"
    fig.suptitle(f"{loop['model']}, {loop['img_size']} px, batch {loop['batch_size']} per "
                 f"process - {where} - commit {commit}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
