"""Stage: DDP against FSDP on 2 ranks, what docs/strategies.md tabulates. For each model of
``--fsdp-models`` (default resnet50 and resnext101_32x8d, 1000 classes as published) and each
set-up (ddp; fsdp with a unit per residual block, the template's; fsdp with a unit per stage,
the template's before, for the first model only), every rank, as the training script does it:

- builds the model (fsdp: ranks but 0 on the meta device) and wraps or shards it: the growth of
  its peak resident memory (``VmHWM``) over the build;
- takes ``--steps`` momentum-SGD steps on synthetic ``--batch-size`` batches of ``--img-size``:
  the peak over training, the step time, and the bytes of parameters, gradients and optimizer
  state it holds (``local_bytes``);
- saves one checkpoint (``Checkpointer.save``: gathered to rank 0 under ddp, each rank's shards
  under fsdp): seconds and bytes written.

CPU (gloo) only: the peaks are host memory. The ranks are spawned and import this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn

from model import get_model
from multi_train_utils.checkpoint import (Checkpointer, ModelState, OptimizerState, RNGState,
                                          TrainState)
from multi_train_utils.distributed_utils import cleanup, find_free_port, init_distributed_mode
from multi_train_utils.strategy import shard_model

from .common import quiet_train_one_epoch, synthetic_batches
from .scaling import barrier, rank_environment


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer state
    (for FSDP the local shards of each ``DTensor``): what docs/strategies.md tabulates."""
    def size(tensors: Iterable[torch.Tensor]) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensor
        return sum(t.numel() * t.element_size() for t in local)

    params = list(model.parameters())
    state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]  # not SGD's/Adam's scalar step counts
    return {"parameters": size(params),
            "gradients": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(state)}

log = logging.getLogger(__name__)
MIB = 2**20


def _high_water(reset: bool = False) -> int:
    """This process's peak resident memory (bytes); ``reset`` starts it again from now."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def fsdp_worker(local_rank: int, args: argparse.Namespace, name: str, setup: str, port: int,
                result_dir: str) -> None:
    rank_environment(local_rank, 2, port)
    torch.set_num_threads(args.threads)
    info = init_distributed_mode(device="cpu", timeout_s=600)
    try:
        # fsdp: torch.distributed.fsdp, DTensor and the mesh, imported and made before the
        # measurement, which is then the model's alone.
        units = {"fsdp": ("BasicBlock", "Bottleneck"), "fsdp_stages": (nn.Sequential,)}
        warm = nn.Sequential(nn.Linear(2, 2))
        nn.parallel.DistributedDataParallel(warm) if setup == "ddp" else shard_model(warm)
        torch.manual_seed(args.seed)
        base = _high_water(reset=True)
        start = time.perf_counter()
        with torch.device("meta" if setup != "ddp" and info.rank > 0 else "cpu"):
            model = get_model(name)  # 1000 classes, as the published sizes
        # fsdp_stages: a unit per nn.Sequential, ResNet's stages (and downsample paths).
        wrapped = (nn.parallel.DistributedDataParallel(model) if setup == "ddp" else
                   shard_model(model, torch.device("cpu"), units=units[setup]))
        build = {"build_peak": _high_water() - base, "build_seconds": time.perf_counter() - start}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batches = synthetic_batches(args, args.steps + 1, args.seed + info.rank, pin=False)
        quiet_train_one_epoch(wrapped, optimizer, batches[:1], info.device, args, scaler)
        barrier(info)
        start = time.perf_counter()
        quiet_train_one_epoch(wrapped, optimizer, batches[1:], info.device, args, scaler)
        step_seconds = (time.perf_counter() - start) / args.steps
        train_peak = _high_water() - base
        held = local_bytes(model, optimizer)
        out = Path(result_dir) / "run"
        barrier(info)
        start = time.perf_counter()
        parts = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
                 "scaler": scaler, "rng_states": RNGState(), "train": TrainState()}
        Checkpointer(out, parts).save()
        barrier(info)
        save_seconds = time.perf_counter() - start
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        result = {**build, "train_peak": train_peak, "step_seconds": step_seconds, **held,
                  "save_seconds": save_seconds, "save_bytes": written, "rss_at_start": base}
        with open(Path(result_dir) / f"rank{info.rank}.json", "w", encoding="utf-8") as f:
            json.dump(result, f)
    finally:
        cleanup()


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"fsdp": {"<model> <set-up>": {"rank0": ..., "rank1": ...}}}``."""
    rows: dict[str, Any] = {}
    for i, name in enumerate(args.fsdp_models):
        for setup in ("ddp", "fsdp", "fsdp_stages")[:3 if i == 0 else 2]:
            log.info("fsdp: %s, %s, 2 processes", name, setup)
            with tempfile.TemporaryDirectory(prefix="ddp-bench-") as result_dir:
                mp.start_processes(fsdp_worker, nprocs=2, join=True, start_method="spawn",
                                   args=(args, name, setup, find_free_port(), result_dir))
                rows[f"{name} {setup}"] = {
                    f"rank{r}": json.loads((Path(result_dir) / f"rank{r}.json").read_text())
                    for r in (0, 1)}
    return {"fsdp": {"steps": args.steps, "batch_size": args.batch_size,
                     "img_size": args.img_size, "rows": rows}}


def table_lines(report: dict[str, Any]) -> list[str]:
    f = report["fsdp"]
    lines = [f"DDP against FSDP (2 CPU processes, gloo; {f['steps']} steps of {f['batch_size']} "
             f"images of {f['img_size']} px per rank; MiB, rank 0 / rank 1)",
             "   model             set-up        params+momentum      build peak    train peak"
             "   step s   save s   save MiB"]
    for key, r in f["rows"].items():
        name, setup = key.split()
        held = [sum(r[k][x] for x in ("parameters", "gradients", "optimizer")) / MIB
                for k in ("rank0", "rank1")]
        build, train = (f"{r['rank0'][x] / MIB:.0f} / {r['rank1'][x] / MIB:.0f}"
                        for x in ("build_peak", "train_peak"))
        lines.append(f"   {name:<17} {setup:<13} {held[0]:>8.0f} / {held[1]:<8.0f}"
                     f"{build:>14} {train:>13} "
                     f"{r['rank0']['step_seconds']:>8.2f} {r['rank0']['save_seconds']:>8.2f} "
                     f"{r['rank0']['save_bytes'] / MIB:>10.0f}")  # the folder: every rank's
    return lines
