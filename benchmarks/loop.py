"""Stage 2, training-loop efficiency: ``train_one_epoch`` against a bare forward/backward/step
loop on the same pre-loaded batches, same model, batch size and threads, so only loop overhead
shows; and that overhead measured directly, around a one-layer model (on a busy machine the
ratio's noise can exceed the overhead it measures).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import torch
import torch.nn as nn

from multi_train_utils.train_eval_utils import prepare_images

from .common import (amp_dtype, build, channels_last, cpu_threads, paired, quiet_train_one_epoch,
                     rate, synthetic_batches)
from .report import row, spread

log = logging.getLogger(__name__)

LOOP_TARGET = 0.95  # train_one_epoch / bare loop images per second
OVERHEAD_STEPS = 200  # steps of the near-free model that measure the loop's own cost


def _race_loops(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                batches: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
                device: torch.device, cycles: int = 1) -> dict[str, list[float]]:
    """Img/s of a bare loop and of ``train_one_epoch`` over ``cycles`` passes of ``batches``.

    The two share model and optimizer and alternate, which goes first switching every repeat.
    The bare loop gets the batches already normalised (and on the device) before the clock
    starts, so ours also pays for its per-step normalisation, loss bookkeeping and progress
    bar: the efficiency is a lower bound. Each variant runs ``--repeats`` times.
    """
    dtype = amp_dtype(args, device)
    ready = [(prepare_images(x, device, channels_last=channels_last(args, device)), y.to(device))
             for x, y in batches]
    criterion = nn.CrossEntropyLoss()

    def bare(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        model.train()
        for images, labels in data:
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16,
                                enabled=dtype is not None):
                output = model(images)
            loss = criterion(output.float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

    def ours(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        quiet_train_one_epoch(model, optimizer, data, device, args, scaler)

    warm = args.warmup_steps
    bare(ready[:warm])
    ours(batches[:warm])
    loops = {"bare": lambda: bare(ready * cycles), "ours": lambda: ours(batches * cycles)}
    images = len(batches) * cycles * args.batch_size
    runs: dict[str, list[float]] = {"bare": [], "ours": []}
    for r in range(args.repeats):
        for name in ("bare", "ours") if r % 2 == 0 else ("ours", "bare"):
            runs[name].append(rate(images, loops[name], device))
    return runs


def bench_loop(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Images/s of ``train_one_epoch`` and of a bare loop, same model, batches and threads.

    On a shared machine the run-to-run noise (several %) can exceed the overhead being measured,
    so the overhead is also measured directly: the same two loops around a model that costs
    almost nothing (one linear layer) for ``OVERHEAD_STEPS`` steps. The time per step they
    differ by is what ``train_one_epoch`` adds to any model; the efficiency it implies for the
    real model is ``bare step / (bare step + overhead)``.
    """
    with cpu_threads(args, device):
        torch.manual_seed(args.seed)
        model, optimizer, scaler = build(args, device)
        batches = synthetic_batches(args, args.steps, args.seed, pin=device.type == "cuda")
        runs = _race_loops(model, optimizer, scaler, batches, args, device)

        tiny = nn.Sequential(nn.Flatten(), nn.Linear(3 * args.img_size**2, args.num_classes))
        tiny.to(device)
        cycles = -(-OVERHEAD_STEPS // len(batches))  # ceil
        tiny_runs = _race_loops(tiny, torch.optim.SGD(tiny.parameters(), lr=args.lr, momentum=0.9),
                                torch.amp.GradScaler(device.type, enabled=scaler.is_enabled()),
                                batches, args, device, cycles)
    summary = paired(runs["bare"], runs["ours"], "bare", "ours")
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


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"loop": figures}``."""
    log.info("training loop: %s at %d px on %s", args.model, args.img_size, device)
    part = bench_loop(args, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave GPU 0 to the rank that uses it next
    return {"loop": part}


def table_lines(report: dict[str, Any]) -> list[str]:
    loop, repeats = report["loop"], report["config"]["repeats"]
    over = loop["overhead"]
    return [f"2. Training loop, img/s ({loop['model']}, {loop['img_size']} px, batch "
            f"{loop['batch_size']}, {loop['steps']} steps, {loop['device']}"
            + (f", {loop['threads']} thread(s)" if loop["device"] == "cpu" else "")
            + f"; median of {repeats})",
            row("bare forward/backward/step loop", f"{loop['bare_img_per_s']:.1f}"),
            row("ours: train_one_epoch", f"{loop['ours_img_per_s']:.1f}"),
            row("efficiency (median of paired repeats)", f"{loop['efficiency']:.3f}",
                f"   target >= {loop['target_efficiency']}; repeats "
                f"{spread(loop['paired_ratios'])}"),
            row(f"overhead per step (1-layer model, {over['steps']} steps)",
                f"{over['per_step_ms']:.3f}", f" ms of a {over['bare_step_ms']:.0f} ms step"),
            row("efficiency implied by that overhead", f"{over['implied_efficiency']:.4f}")]
