"""``train_one_epoch`` and ``evaluate``: plain PyTorch loops whose results are already reduced.

Both take batches ``(images, labels)``: ``images`` ``uint8 (N, 3, H, W)`` (normalised here, on
the device: 4x fewer bytes to copy) or normalised float; ``labels`` class indices ``(N,)``, -100
for a sample that could not be read (ignored), or for training class probabilities ``(N, C)``.
Call both on every rank: they end in collectives. Neither syncs the host each step
(``loss.item()`` would stall the GPU pipeline): sums stay on the device until reduced."""

from __future__ import annotations

import functools
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from .data import EpochProgress, prefetch_to_device
from .distributed_utils import (all_gather_object, get_rank, get_world_size, is_main_process,
                                reduce_value)
from .guard import ConfigError
from .heartbeat import Heartbeat, slowest
from .strategy import gradient_sync

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def prepare_images(images: torch.Tensor, device: torch.device, *,
                   channels_last: bool = False) -> torch.Tensor:
    """Move a batch to ``device``; ``uint8 (N, 3, H, W)`` becomes normalised float32, other
    inputs (float images, ``(N, features)``) keep their values."""
    if images.dtype == torch.uint8 and (images.dim() != 4 or images.shape[1] != 3):
        raise ValueError(f"uint8 inputs are taken as images (N, 3, H, W) to normalise, but this "
                         f"batch is {tuple(images.shape)}; convert it to float in the dataset.")
    images = images.to(device, non_blocking=True)
    if channels_last and images.dim() == 4:  # on uint8: a quarter of the bytes; float keeps it
        images = images.contiguous(memory_format=torch.channels_last)
    if images.dtype == torch.uint8:
        mean, std = _norm_constants(device)
        images = (images.float() - mean) / std
    return images


@functools.lru_cache(maxsize=16)
def _norm_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: torch.tensor(..., device="cuda") copies from pageable host memory,
    # which waits for the GPU; two such syncs per step would stop the CPU from running ahead.
    return (torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255,
            torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)


def resolve_amp_dtype(amp: bool | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``--amp`` (None: on for CUDA only), None for full precision: bf16
    (no loss scaling) where the GPU has it natively, else fp16 with a GradScaler; before Ampere
    bf16 is only emulated (cuDNN has no bf16 convolutions below sm_80)."""
    if not (device.type == "cuda" if amp is None else amp):
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def _autocast(device: torch.device, amp_dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(device_type=device.type, dtype=amp_dtype or torch.bfloat16,
                          enabled=amp_dtype is not None)


def _unpack(batch: Any, where: str, device: torch.device, channels_last: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as ``(inputs, labels)`` on ``device`` (inputs by :func:`prepare_images`): indices
    int64 (``CrossEntropyLoss`` refuses numpy's int32), probabilities float (one_hot: int64)."""
    parts = batch if isinstance(batch, (tuple, list)) else [batch]
    if len(parts) != 2 or not all(torch.is_tensor(part) for part in parts):
        got = ", ".join(type(part).__name__ for part in parts)
        raise TypeError(f"{where} takes batches of tensors (inputs, labels), got ({got}); return "
                        "(image tensor, class index) from the dataset, or give the DataLoader a "
                        "collate_fn that returns (inputs, labels).")
    images = prepare_images(batch[0], device, channels_last=channels_last)
    labels = batch[1].to(device, non_blocking=True)
    return images, labels.float() if labels.dim() == 2 else labels.long()


def _logits(output: Any, where: str) -> torch.Tensor:
    """The output as logits ``(N, C)``: with C = 1 cross-entropy is 0 and nothing trains."""
    if not torch.is_tensor(output) or output.dim() != 2 or output.shape[1] < 2:
        got = tuple(output.shape) if torch.is_tensor(output) else type(output).__name__
        raise ValueError(f"{where} needs the model to return logits (N, C) for C >= 2 classes, "
                         f"got {got}; wrap the model so it returns the logits alone, or use "
                         "2 classes for a binary task.")
    return output.float()


def _check_probabilities(labels: torch.Tensor) -> None:
    # Multi-hot rows (a multi-label task) would train softmax cross-entropy on them, silently.
    sums = labels.sum(1)
    if not bool((labels >= 0).all() & ((sums - 1).abs() < 1e-3).all()):
        raise ValueError(f"train_one_epoch takes (N, C) labels as class probabilities (rows >= 0 "
                         f"summing to 1), but row sums range over [{sums.min().item():.4g}, "
                         f"{sums.max().item():.4g}]; a multi-label task needs its own loss, e.g. "
                         "BCEWithLogitsLoss.")


@dataclass(frozen=True)
class LoopOptions:
    """How :func:`train_one_epoch` (all) and :func:`evaluate` (precision, layout) run a batch;
    the defaults are the classic loop's."""

    amp_dtype: torch.dtype | None = None  # autocast's (resolve_amp_dtype); None: fp32
    channels_last: bool = False  # NHWC images
    scaler: torch.amp.GradScaler = field(  # fp16's loss scaling; the default is off: no-ops
        default_factory=lambda: torch.amp.GradScaler(enabled=False))
    grad_accum_steps: int = 1  # K: the optimizer steps every K batches, on their mean gradient
    clip_grad_norm: float | None = None
    label_smoothing: float = 0.0
    print_freq: int = 50

    def __post_init__(self) -> None:
        for name in ("grad_accum_steps", "print_freq"):
            value = getattr(self, name)
            if not (isinstance(value, numbers.Integral) and value >= 1):
                raise ValueError(f"LoopOptions: {name} must be an integer >= 1, got {value!r}.")


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int, options: LoopOptions | None = None, *,
                    progress: EpochProgress | None = None,
                    after_step: Callable[[EpochProgress], bool] | None = None,
                    mix: Callable[..., Any] | None = None, ema: Any = None,
                    heartbeat: Heartbeat | None = None) -> float:
    """One pass over ``data_loader``; returns the mean cross-entropy over every rank's samples
    (a non-finite one raises on every rank). The model maps ``(N, ...)`` to logits ``(N, C)``.
    ``progress`` (updated in place) continues a stopped epoch, whose rest the loader deals; when
    ``after_step(progress)``, called after each optimizer step but the last, returns True, the
    epoch ends there with ``progress.stopped`` set. ``mix`` mixes each batch (``recipe.BatchMix``);
    ``ema.after_step`` follows each step (``recipe.ModelEma``); ``heartbeat`` hears where this
    rank is (:mod:`.heartbeat`)."""
    opts, progress = options or LoopOptions(), progress if progress is not None else EpochProgress()
    first, samples, seen, world = progress.batches, progress.samples, 0, get_world_size()
    heartbeat = heartbeat or Heartbeat()  # none given: one that hears nothing
    shown = _EpochLog(data_loader, device, epoch, first, opts.print_freq)
    accum, steps = opts.grad_accum_steps, shown.steps
    progress.batches_in_epoch = first + steps
    progress.loss = totals = progress.loss.to(device)  # loss sum, sample count
    model.train()
    mean_loss = shown.mean_loss(totals, first)[0] if steps == 0 else float("nan")
    optimizer.zero_grad(set_to_none=True)
    heartbeat.at("loading data", epoch=epoch, step=first + 1, steps=first + steps)
    for step, batch in enumerate(shown.batches):
        images, labels = _unpack(batch, "train_one_epoch", device, opts.channels_last)
        if step == 0 and labels.is_floating_point():
            _check_probabilities(labels)  # once, the loader's: the check syncs the host
        if mix is not None:
            images, labels = mix(images, labels, epoch, first + step)
        seen += labels.shape[0]
        heartbeat.at("forward")  # at the step the last call named
        last_micro = (step + 1) % accum == 0 or step + 1 == steps
        # Mean over the micro-batches of this step; the epoch's last group may be shorter
        # than K, and a fixed / K would shrink its step.
        group = min(accum, steps - (step - step % accum))
        totals += _backward(model, images, labels, opts, group=group, sync=last_micro,
                            beat=heartbeat.at)
        if last_micro:
            _optimizer_step(model, optimizer, opts.scaler, opts.clip_grad_norm)
            progress.batches, progress.samples = first + step + 1, samples + seen * world
            if ema is not None:  # counts optimizer steps: the same after a resume
                ema.after_step(model, epoch, -(-progress.batches // accum))
            if step + 1 < steps and after_step is not None and after_step(progress):
                progress.stopped = True
        if progress.stopped or (step + 1) % opts.print_freq == 0 or step + 1 == steps:
            mean_loss = shown.line(totals, step, seen, optimizer.param_groups[0]["lr"])
        if progress.stopped:
            break
        heartbeat.at("loading data", step=min(first + step + 2, first + steps))
    return mean_loss  # the last step always reduced: no second all-reduce


def _backward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, opts: LoopOptions, *,
              group: int, sync: bool, beat: Callable[..., None]) -> torch.Tensor:
    """Forward and backward of one of ``group`` micro-batches (its loss / group: their mean),
    the gradients reduced across ranks if ``sync``; returns its ``(loss sum, valid count)``."""
    # Class probabilities (N, C) have one sample per row and no "unreadable" marker.
    n_valid = (torch.full((), labels.shape[0], device=labels.device)  # made there: no copy
               if labels.is_floating_point() else (labels != IGNORE_INDEX).sum())
    with gradient_sync(model, enabled=sync):  # DDP's no_sync, or FSDP's equivalent
        with _autocast(labels.device, opts.amp_dtype):
            output = _forward(model, images)
        # Sum / count == mean over valid samples, yet finite for a batch of unreadable ones.
        loss = F.cross_entropy(_logits(output, "train_one_epoch"), labels, reduction="sum",
                               ignore_index=IGNORE_INDEX, label_smoothing=opts.label_smoothing)
        loss = loss / n_valid.clamp(min=1)
        beat("backward" if sync else "accumulating")
        opts.scaler.scale(loss / group).backward()
    return torch.stack([loss.detach().double() * n_valid, n_valid.double()])


class _EpochLog:
    """A log line on rank 0 every ``print_freq`` steps: the mean loss so far over every rank's
    samples, and the rank whose own work (loading its batches) holds the others up, if one does."""

    def __init__(self, data_loader: DataLoader, device: torch.device, epoch: int, first: int,
                 print_freq: int) -> None:
        try:
            self.steps = len(data_loader)  # it sets the last accumulation group
        except TypeError:
            raise TypeError("train_one_epoch needs a data loader with a length; give the "
                            "IterableDataset a __len__ (its batches per rank).") from None
        self.epoch, self.first, self.print_freq = epoch, first, print_freq
        self.start = self.read = time.perf_counter()
        self.waited = 0.0  # seconds this rank waited for its batches since self.read
        self.batches = self._timed(prefetch_to_device(data_loader, device))

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        # Only the wait for the next batch: a step can also wait for the other ranks.
        ready = time.perf_counter()
        for batch in batches:
            self.waited += time.perf_counter() - ready
            yield batch
            ready = time.perf_counter()

    def mean_loss(self, totals: torch.Tensor, step: int) -> tuple[float, str]:
        """The mean loss over every rank's samples so far, and in the same all-reduce each rank's
        own work since the last call: the slowest, named."""
        work = totals.new_zeros(get_world_size())  # float64, beside the totals
        work[get_rank()], seconds = self.waited, time.perf_counter() - self.read
        self.waited, self.read = 0.0, self.read + seconds
        loss_sum, count, *work = reduce_value(torch.cat([totals, work]), average=False).tolist()
        mean_loss = loss_sum / count if count else float("nan")
        if count and not math.isfinite(mean_loss):  # the same reduced value: every rank raises
            raise FloatingPointError(
                f"loss is {mean_loss} at epoch {self.epoch} step {step} (checked every "
                f"{self.print_freq} steps); lower the learning rate (--lr) or check the data.")
        return mean_loss, slowest(work, seconds)

    def line(self, totals: torch.Tensor, step: int, seen: int, lr: float) -> float:
        """Logs the mean loss after ``step`` of this call, ``seen`` samples in, and returns it."""
        epoch, first, steps = self.epoch, self.first, self.steps
        mean_loss, slow = self.mean_loss(totals, first + step)
        if is_main_process():
            elapsed = time.perf_counter() - self.start
            eta = round(elapsed / (step + 1) * (steps - step - 1))
            log.info("[train epoch %d] step %d/%d  loss %.4f  lr %.2e  %.0f img/s per "
                     "process  eta %d:%02d", epoch, first + step + 1, first + steps,
                     mean_loss, lr, seen / elapsed, eta // 60, eta % 60)
            if slow:
                log.info("[train epoch %d] %s", epoch, slow)
        return mean_loss


def _forward(model: nn.Module, images: torch.Tensor) -> Any:
    try:
        return model(images)
    except RuntimeError as exc:  # DDP's, at the step after one where a parameter got no gradient
        if "Expected to have finished reduction" not in str(exc):
            raise
        raise ConfigError("DDP waited for the gradients of parameters the forward did not use (a "
                          "branch it skips, a head left out of the loss); add "
                          "--find-unused-parameters (DistributedDataParallel(find_unused_parameters"
                          "=True)), or set requires_grad=False on them.") from None


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, clip_grad_norm: float | None) -> None:
    if clip_grad_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)  # skipped where fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class EvalResult(int):
    """The number of correct top-1 predictions over all ranks, each val sample counted once: an
    ``int``, so the classic ``evaluate(...) / len(val_set)`` works. The exact figures ride along:
    ``top1``/``top5``/``loss`` over ``num_samples`` (without samples labelled -100),
    ``confusion`` ``(C, C)`` (rows: true class, columns: predicted), ``per_class_acc`` (recall)."""

    def __new__(cls, correct: int, *, top5_correct: int, num_samples: int, loss_sum: float,
                confusion: torch.Tensor) -> EvalResult:
        obj = super().__new__(cls, correct)
        obj.correct, obj.top5_correct, obj.num_samples = int(obj), top5_correct, num_samples
        obj.confusion = confusion
        obj.top1 = obj.correct / num_samples if num_samples else float("nan")
        # None with 5 classes or fewer, where it is always 1.
        obj.top5 = top5_correct / num_samples if num_samples and len(confusion) > 5 else None
        obj.loss = loss_sum / num_samples if num_samples else float("nan")
        obj.per_class_acc = (confusion.diagonal() / confusion.sum(1).clamp(min=1)).tolist()
        return obj

    def __getnewargs_ex__(self) -> tuple[tuple[int], dict[str, Any]]:
        # copy, deepcopy and pickle (broadcast_object, say) rebuild it through __new__.
        return (int(self),), dict(top5_correct=self.top5_correct, num_samples=self.num_samples,
                                  loss_sum=self.loss * self.num_samples, confusion=self.confusion)


def _val_split(data_loader: DataLoader) -> tuple[int, int, float]:
    """The world size, rank and dataset length of the loader's DistributedSampler, once its set-up
    is checked; without one, (1, 0, inf): no sample is a padded repeat."""
    batches = data_loader.batch_sampler
    sampler = getattr(batches, "sampler", data_loader.sampler)
    if is_main_process() and (getattr(sampler, "drop_last", False)
                              or getattr(batches, "drop_last", False)):
        log.warning("evaluate: the val loader or its DistributedSampler has drop_last=True, so "
                    "some val samples are never scored; build both with drop_last=False.")
    if not isinstance(sampler, DistributedSampler):
        if is_main_process() and get_world_size() > 1:  # said once
            log.warning("evaluate: the loader has no DistributedSampler, so every rank scores the "
                        "whole val set and each sample counts %d times; give it "
                        "DistributedSampler(val_set, shuffle=False).", get_world_size())
        return 1, 0, math.inf
    if not getattr(data_loader, "in_order", True):
        raise ValueError("evaluate needs the val loader's batches in the sampler's order, to tell "
                         "its padded repeats by position; build it with in_order=True.")
    return sampler.num_replicas, sampler.rank, len(sampler.dataset)


@torch.no_grad()
def evaluate(model: nn.Module, data_loader: DataLoader, device: torch.device,
             options: LoopOptions | None = None, *, heartbeat: Heartbeat | None = None
             ) -> EvalResult:
    """Exact top-1/top-5/loss/confusion over the whole val set, however it is split across ranks:
    in ``DistributedSampler``'s padded order the sample at position ``p`` (on rank ``p % W``) is a
    repeat iff ``p >= len(dataset)``, so each rank masks its repeats with no extra gather."""
    opts = options or LoopOptions()
    model.eval()
    (heartbeat or Heartbeat()).at("evaluating")
    world, rank, end = _val_split(data_loader)
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # top1, top5, loss sum, count
    confusion, seen = torch.zeros(0, device=device, dtype=torch.int64), 0
    loss_function = nn.CrossEntropyLoss(reduction="none", ignore_index=IGNORE_INDEX)
    for batch in prefetch_to_device(data_loader, device):  # the next batch moves meanwhile
        images, labels = _unpack(batch, "evaluate", device, opts.channels_last)
        if labels.is_floating_point():
            raise ValueError(f"evaluate needs class indices (N,) as labels, got class "
                             f"probabilities of shape {tuple(labels.shape)}.")
        positions = rank + (seen + torch.arange(labels.shape[0], device=device)) * world
        valid = (labels != IGNORE_INDEX) & (positions < end)
        seen += labels.shape[0]
        with _autocast(device, opts.amp_dtype):
            logits = _logits(model(images), "evaluate")
        classes = logits.shape[1]
        topk = logits.topk(min(5, classes), dim=1).indices
        hits = topk == labels[:, None]
        stats += torch.stack([(hits[:, 0] & valid).sum(), (hits.any(1) & valid).sum(),
                              (loss_function(logits, labels) * valid).sum(), valid.sum()])
        if confusion.numel() == 0:
            confusion = torch.zeros(classes * classes, device=device, dtype=torch.int64)
        # Adds 1 to each valid sample's (label, prediction) cell: no boolean indexing and no
        # bincount, both of which wait for the GPU to learn a size.
        cells = labels.clamp(min=0) * classes + topk[:, 0]
        confusion.index_put_((cells,), valid.long(), accumulate=True)
    top1, top5, loss_sum, count = reduce_value(stats, average=False).tolist()
    # A rank that saw no batch does not know the class count: agree on the largest first.
    side = max(all_gather_object(math.isqrt(confusion.numel())))
    if confusion.numel() < side * side:
        confusion = torch.zeros(side * side, device=device, dtype=torch.int64)
    # The ranks' flat (C * C,) counts, summed: (C, C).
    confusion = reduce_value(confusion, average=False).cpu().view(side, side)
    return EvalResult(round(top1), top5_correct=round(top5), num_samples=round(count),
                      loss_sum=loss_sum, confusion=confusion)


def format_report(result: EvalResult, classes: list[str]) -> str:
    """Per-class accuracy lines, then the totals, last where a long class list cannot hide
    them; a tab or line break in a class name is shown as ``\\t``/``\\n``."""
    escape = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})
    lines = ["accuracy per class:"]
    for name, acc, n in zip(classes, result.per_class_acc, result.confusion.sum(1).tolist()):
        shown = str(name).translate(escape)
        lines.append(f"  {shown}: {acc:.4f} ({n} image{'s' * (n != 1)})" if n else
                     f"  {shown}: n/a (no validation images)")
    lines += [f"val images: {result.num_samples}", f"top-1 accuracy: {result.top1:.4f}"]
    if result.top5 is not None:
        lines.append(f"top-5 accuracy: {result.top5:.4f}")
    lines.append(f"val loss: {result.loss:.4f}")
    return "\n".join(lines)


def cosine_schedule(optimizer: torch.optim.Optimizer, epochs: int, lrf: float,
                    last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr from its value to ``lr x lrf`` over ``epochs`` on a half cosine (SGDR,
    arXiv:1608.03983), stepped once per epoch."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: (1 + math.cos(epoch * math.pi / epochs)) / 2 * (1 - lrf) + lrf,
        last_epoch)
