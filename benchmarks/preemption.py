"""Stage: what losing no work, and naming a stuck rank, cost. On ``--max-procs`` ranks (2 on CPU):

- the stop poll: ``train_one_epoch`` with the training script's ``after_step`` (every rank
  all-reduces its stop flag after each optimizer step, ``StopRequest.poll``) against without
  it, alternating on the same model and batches; the cost is the ratio of their img/s;
- one mid-epoch save (``Checkpointer.save`` mid-epoch, as at a signal or every
  ``--save-every-steps``): seconds from every rank entering it to every rank leaving it, and
  the size of ``checkpoint.pth``. A stopped run exits at most one step plus this after the
  signal (one step more under NCCL, where the poll's answer is a step old);
- the heartbeat (``multi_train_utils.heartbeat``: three ``heartbeat.at`` calls a step, a
  thread writing to the store once a second) against without it, in the same alternation; and,
  as this ratio drowns in the noise of a shared machine, its two parts timed alone: the ``at``
  calls (microseconds a step) and one write of the thread (microseconds a second).

The ranks are spawned: each imports this module (and ``common``), not ``__main__``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from multi_train_utils.checkpoint import (Checkpointer, ModelState, OptimizerState, RNGState,
                                          TrainState)
from multi_train_utils.data import EpochProgress
from multi_train_utils.distributed_utils import cleanup, find_free_port, init_distributed_mode
from multi_train_utils.guard import stop_requests
from multi_train_utils.heartbeat import Heartbeat

from .common import build, quiet_train_one_epoch, synthetic_batches
from .report import row, spread
from .scaling import barrier, rank_environment

log = logging.getLogger(__name__)


def preemption_worker(local_rank: int, args: argparse.Namespace, nprocs: int, port: int,
                      result_dir: str) -> None:
    """One rank: warm-up, then alternating timed passes with and without the stop poll, then
    one mid-epoch save; its figures go to ``result_dir/rank<N>.json``."""
    rank_environment(local_rank, nprocs, port)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    info = init_distributed_mode(device=args.device, timeout_s=600)
    try:
        device = info.device
        torch.manual_seed(args.seed)
        model, optimizer, scaler = build(args, device, info.world_size)
        batches = synthetic_batches(args, args.steps, args.seed + info.rank,
                                    pin=device.type == "cuda")
        quiet_train_one_epoch(model, optimizer, batches[:args.warmup_steps], device, args, scaler)
        seconds: dict[str, list[float]] = {"without": [], "with": [], "heartbeat": []}
        with stop_requests() as stop:
            for repeat in range(args.repeats):
                order = ("without", "with", "heartbeat")
                for name in order if repeat % 2 == 0 else order[::-1]:
                    beat = Heartbeat(info) if name == "heartbeat" else contextlib.nullcontext()
                    with beat as heartbeat:
                        barrier(info)
                        start = time.perf_counter()
                        quiet_train_one_epoch(
                            model, optimizer, batches, device, args, scaler, heartbeat=heartbeat,
                            after_step=(lambda p: stop.poll()) if name == "with" else None)
                        seconds[name].append(time.perf_counter() - start)
        calls = 10_000  # the loop's part alone: three calls a step
        with Heartbeat(info) as heartbeat:
            start = time.perf_counter()
            for step in range(calls):
                heartbeat.at("forward", step=step)
            at_us = 1e6 * (time.perf_counter() - start) / calls
            store, record = heartbeat.store, json.dumps({**heartbeat.place, "beat": time.time()})
            start = time.perf_counter()
            for _ in range(100):  # what the thread does once a second
                store.set(f"heartbeat/{info.rank}", json.dumps(json.loads(record)))
            write_us = 1e6 * (time.perf_counter() - start) / 100
        out = Path(result_dir)
        progress = EpochProgress(batches=args.steps, samples=args.steps * args.batch_size,
                                 batches_in_epoch=2 * args.steps)
        barrier(info)
        start = time.perf_counter()
        parts = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
                 "scaler": scaler, "rng_states": RNGState(), "train": TrainState(progress=progress)}
        Checkpointer(out, parts).save()
        barrier(info)
        save_seconds = time.perf_counter() - start
        result = {"seconds": seconds, "save_seconds": save_seconds, "backend": info.backend,
                  "at_us": at_us, "write_us": write_us}
        with open(out / f"rank{info.rank}.json", "w", encoding="utf-8") as f:
            json.dump(result, f)
    finally:
        cleanup()


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"preemption": figures}``."""
    nprocs = args.max_procs
    log.info("preemption: %d process(es), the stop poll and one mid-epoch save", nprocs)
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as result_dir:
        mp.start_processes(preemption_worker, args=(args, nprocs, find_free_port(), result_dir),
                           nprocs=nprocs, join=True, start_method=args.start_method)
        ranks = [json.loads((Path(result_dir) / f"rank{r}.json").read_text())
                 for r in range(nprocs)]
        size_mb = (Path(result_dir) / "checkpoint.pth").stat().st_size / 1e6
    images = nprocs * args.batch_size * args.steps
    rates = {name: [images / max(rank["seconds"][name][i] for rank in ranks)
                    for i in range(args.repeats)] for name in ("without", "with", "heartbeat")}
    ratios = [w / wo for w, wo in zip(rates["with"], rates["without"])]
    beats = [h / wo for h, wo in zip(rates["heartbeat"], rates["without"])]
    step_ms = 1e3 * args.batch_size * nprocs / statistics.median(rates["without"])
    return {"preemption": {
        "processes": nprocs, "backend": ranks[0]["backend"], "steps": args.steps,
        "img_per_s_without_poll": rates["without"], "img_per_s_with_poll": rates["with"],
        "ratio_with_to_without": ratios, "median_ratio": statistics.median(ratios),
        "step_ms": 1e3 * args.batch_size * nprocs / statistics.median(rates["with"]),
        "img_per_s_with_heartbeat": rates["heartbeat"], "heartbeat_ratio_to_without": beats,
        "heartbeat_median_ratio": statistics.median(beats),
        "heartbeat_us_per_step": 3 * max(rank["at_us"] for rank in ranks),
        "heartbeat_share_of_step": 3 * max(rank["at_us"] for rank in ranks) / 1e3 / step_ms,
        "heartbeat_write_us_per_s": max(rank["write_us"] for rank in ranks),
        "save_seconds": max(rank["save_seconds"] for rank in ranks),
        "checkpoint_mb": size_mb, "model": args.model}}


def table_lines(report: dict[str, Any]) -> list[str]:
    p = report["preemption"]
    cost = 1 - p["median_ratio"]
    return [f"Preemption ({p['processes']} processes, {p['backend']}, {p['model']}; "
            f"{report['config']['repeats']} alternating pairs)",
            row("with / without the per-step stop poll", f"{p['median_ratio']:.3f}",
                f"   cost {cost:.1%} of a step (pairs {spread(p['ratio_with_to_without'])})"),
            row("with / without the heartbeat", f"{p['heartbeat_median_ratio']:.3f}",
                f"   cost {1 - p['heartbeat_median_ratio']:.1%} of a step (pairs "
                f"{spread(p['heartbeat_ratio_to_without'])})"),
            row("the heartbeat's calls alone", f"{p['heartbeat_us_per_step']:.1f} us a step",
                f"   {100 * p['heartbeat_share_of_step']:.2g}% of a step"),
            row("its thread's write to the store", f"{p['heartbeat_write_us_per_s']:.0f} us",
                f"   once a second: {p['heartbeat_write_us_per_s'] / 1e4:.2g}% of the time"),
            row("one step", f"{p['step_ms']:.0f} ms"),
            row("one mid-epoch save", f"{p['save_seconds']:.2f} s",
                f"   checkpoint.pth {p['checkpoint_mb']:.0f} MB; signal to exit: a step + this")]
