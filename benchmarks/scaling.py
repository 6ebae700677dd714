"""Stages 3 and 4, scaling and peak memory: images/s and time per epoch (of ``--epoch-images``,
by default flower_photos' training split) with 1, 2, 4 ... processes, and each rank's peak memory.

DDP with the training script's defaults (SyncBN, bucket size), gloo with one thread per rank on
CPU, NCCL with one GPU per rank on CUDA, on synthetic pre-loaded batches, so it measures compute
plus communication, not the disk. Efficiency = img/s(N) / (N x img/s(1)). The largest count runs
again without any communication (the machine's ceiling), without SyncBN, and with the other comm
hook, so the table splits what is lost between the machine, the gradient all-reduce and SyncBN.
Peak memory per rank: the rank's peak RSS on CPU (``VmHWM``; ``ru_maxrss`` where there is no
/proc), ``torch.cuda.max_memory_allocated`` on CUDA.

The ranks are spawned: each imports this module (and ``common``), not ``__main__``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import (DistInfo, cleanup, find_free_port,
                                                 init_distributed_mode, usable_cpus)
from multi_train_utils.guard import stop_requests

from .common import build, quiet_train_one_epoch, sync, synthetic_batches

log = logging.getLogger(__name__)

# flower_photos (3,670 images) minus our stratified 20% validation split: the "epoch" of the
# classic tutorial's time-per-epoch chart.
FLOWER_TRAIN_IMAGES = 2935


def process_counts(max_procs: int) -> list[int]:
    """1, the powers of two below ``max_procs``, and ``max_procs``."""
    counts = {1, max_procs}
    n = 2
    while n < max_procs:
        counts.add(n)
        n *= 2
    return sorted(counts)


def rank_environment(local_rank: int, nprocs: int, port: int) -> None:
    """What torchrun sets for one of ``nprocs`` local ranks; one process runs as plain python
    does: no group."""
    if nprocs > 1:
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def barrier(info: DistInfo) -> None:
    sync(info.device)
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
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def scaling_worker(local_rank: int, args: argparse.Namespace, nprocs: int, port: int,
                   result_dir: str, variant: str = "ddp", comm_hook: str = "none") -> None:
    """One rank: the training script's model set-up, then timed ``train_one_epoch`` calls.

    ``variant`` "ddp" is the training script's set-up with ``comm_hook``; "no_sync_bn" the same
    without SyncBN (its all-reduce per BatchNorm layer, forward and backward, apart from DDP's
    gradient all-reduce); "no_comm" trains the single-process model (no DDP, no SyncBN) in every
    process at once, so no gradient crosses between them: the process group only lines up the
    repeats. Its efficiency is the most the hardware allows N processes (shared cores, caches
    and memory bandwidth), whatever DDP does. ``--grad-accum-steps`` applies to every variant.
    """
    rank_environment(local_rank, nprocs, port)
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
        model, optimizer, scaler = build(args, device,
                                         1 if variant == "no_comm" else info.world_size, comm_hook)
        # Each rank its own data, as DistributedSampler gives it; same steps on every rank.
        batches = synthetic_batches(args, args.steps, args.seed + info.rank,
                                    pin=device.type == "cuda")
        quiet_train_one_epoch(model, optimizer, batches[:args.warmup_steps], device, args, scaler)
        seconds = []
        with stop_requests() as stop:  # the training script's poll after every step
            for _ in range(args.repeats):
                barrier(info)
                start = time.perf_counter()
                # Ends with an all-reduce of the loss (a host sync), so every rank is done.
                quiet_train_one_epoch(model, optimizer, batches, device, args, scaler,
                                      args.grad_accum_steps, after_step=lambda p: stop.poll())
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
    """One measurement: ``nprocs`` spawned ranks of ``scaling_worker``; figures of the run."""
    ddp = variant != "no_comm" and nprocs > 1
    log.info("scaling: %d process(es), %s%s", nprocs, variant.replace("_", " "),
             f", --comm-hook {comm_hook}" if ddp else "")
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as result_dir:
        mp.start_processes(scaling_worker,
                           args=(args, nprocs, find_free_port(), result_dir, variant, comm_hook),
                           nprocs=nprocs, join=True, start_method=args.start_method)
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


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"scaling": figures, "peak_memory": each rank's peak, per process count}``."""
    procs = process_counts(args.max_procs)
    log.info("scaling: %s process(es)", ", ".join(map(str, procs)))
    usable = usable_cpus()
    if device.type == "cpu" and args.max_procs * args.threads > usable:
        log.warning("%d processes x %d thread(s) is more than the %s usable CPUs: ranks will share "
                    "cores and scaling efficiency will show it.", args.max_procs, args.threads,
                    usable)
    part = bench_scaling(args, device, procs)
    peak_memory = {"kind": part["memory_kind"], "unit": "MiB",
                   "per_rank": {n: e["peak_memory_mib"] for n, e in part["results"].items()}}
    return {"scaling": part, "peak_memory": peak_memory}


def _table_row(entry: dict[str, Any], label: str = "") -> str:
    memory = ", ".join(f"{m:.0f}" for m in entry["peak_memory_mib"])
    return (f"   {entry['processes']:9d} {entry['img_per_s']:9.1f} {entry['epoch_seconds']:9.1f} "
            f"{entry['efficiency']:12.3f}   {memory}" + (f"   <- {label}" if label else ""))


def table_lines(report: dict[str, Any]) -> list[str]:
    s, repeats = report["scaling"], report["config"]["repeats"]
    backend = s["results"][max(s["results"], key=int)]["backend"]
    per_rank = (f"{s['threads_per_rank']} thread(s) per rank" if s["device"] == "cpu"
                else "1 GPU per rank")
    mem = "peak RSS" if s["memory_kind"] == "peak RSS" else "peak CUDA allocated"
    accum = f", --grad-accum-steps {s['grad_accum_steps']}" if s["grad_accum_steps"] > 1 else ""
    lines = [f"3./4. Scaling (DDP, {backend}, {per_rank}, batch {s['batch_size_per_rank']} per "
             f"rank, SyncBN {'on' if s['sync_bn'] else 'off'}, --comm-hook {s['comm_hook']}"
             f"{accum}; epoch = {s['epoch_images']} images; best of {repeats})",
             f"   processes     img/s   s/epoch   efficiency   {mem} per rank (MiB)"]
    lines += [_table_row(entry) for entry in s["results"].values()]
    ex = s.get("explain") or {}
    lines += [_table_row(ex[key], label) for key, label in (
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
