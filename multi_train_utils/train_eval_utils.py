"""``train_one_epoch`` and ``evaluate``: plain PyTorch loops whose results are already reduced.

Both accept batches ``(images, labels)`` where ``images`` is either ``uint8 (N, 3, H, W)`` (our
fast input pipeline: normalised here, on the device) or already-normalised float; ``labels`` are
class indices ``(N,)`` (any integer dtype) and ``-100`` marks a sample that could not be read
(ignored, as ``nn.CrossEntropyLoss`` ignores it by default). ``train_one_epoch`` also takes class
probabilities ``float (N, C)`` (one-hot, label smoothing, MixUp/CutMix). Both must be called on
every rank: they end in collectives.

Neither loop synchronises the host with the device on every step: ``loss.item()`` or an
all-reduce each step stalls the GPU pipeline, so running sums stay on the device and are reduced
every ``print_freq`` steps and at the end. (torch's own ``nn.SyncBatchNorm`` does sync the host
once per layer in training, to drop empty ranks (pytorch/pytorch#78549): the price of --syncBN.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm import tqdm

from .distributed_utils import get_world_size, is_main_process, reduce_value

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def prepare_images(images: torch.Tensor, device: torch.device, *, channels_last: bool = False,
                   mean: tuple[float, ...] = IMAGENET_MEAN,
                   std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    """Move a batch to ``device``; ``uint8 (N, 3, H, W)`` becomes normalised float32.

    Normalising after the copy moves 4x fewer bytes over PCIe and frees the CPU workers from it.
    """
    if images.dtype == torch.uint8 and (images.dim() != 4 or images.shape[1] != len(mean)):
        raise ValueError(f"uint8 inputs are taken as images (N, {len(mean)}, H, W) to normalise "
                         f"with mean/std, but this batch is {tuple(images.shape)}; convert it to "
                         "float in the dataset (normalised as the model expects).")
    images = images.to(device, non_blocking=True)
    channels_last = channels_last and images.dim() == 4  # the layout exists for 4-D only
    if channels_last:  # on the uint8 batch: a quarter of the bytes; float ops keep the layout
        images = images.contiguous(memory_format=torch.channels_last)
    if images.dtype == torch.uint8:
        mean_t, std_t = _norm_constants(tuple(mean), tuple(std), device)
        images = (images.float() - mean_t) / std_t
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images


@functools.lru_cache(maxsize=16)
def _norm_constants(mean: tuple[float, ...], std: tuple[float, ...],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: torch.tensor(..., device="cuda") copies from pageable host memory,
    # which waits for the GPU - two syncs per step would stop the CPU from running ahead.
    shape = (1, len(mean), 1, 1)
    return (torch.tensor(mean, device=device).view(shape) * 255,
            torch.tensor(std, device=device).view(shape) * 255)


def resolve_amp_dtype(amp: bool | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``--amp`` (None: on for CUDA only); None means full precision.

    bf16 where the hardware has it (no loss scaling needed), else fp16 with a GradScaler.
    """
    enabled = device.type == "cuda" if amp is None else amp
    if not enabled:
        return None
    # Not emulated bf16: before Ampere it "works" without kernels (cuDNN has no bf16
    # convolutions below compute capability 8.0), so those GPUs get fp16 with loss scaling.
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def common_amp_dtype(amp_dtype: torch.dtype | None) -> torch.dtype | None:
    """One autocast dtype for every rank: fp16 for all if any rank resolved fp16.

    GPUs of a job can differ (an Ampere card beside a V100). DDP averages the gradients of all
    ranks, and those of an fp16 rank are multiplied by its GradScaler's scale (2**16 at first),
    so mixing bf16 and fp16 ranks would train on nonsense. Call it on every rank, or on none.
    """
    if amp_dtype is None or get_world_size() < 2:
        return amp_dtype
    fp16_ranks = reduce_value(int(amp_dtype == torch.float16), average=False)
    return torch.float16 if fp16_ranks.item() else amp_dtype


def _autocast(device: torch.device, amp_dtype: torch.dtype | None):
    return torch.autocast(device_type=device.type, dtype=amp_dtype or torch.bfloat16,
                          enabled=amp_dtype is not None)


def _inputs_and_labels(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A loader's batch as ``(inputs, labels)``: class indices as int64 (``CrossEntropyLoss``
    refuses int32, which numpy labels often are), class probabilities ``(N, C)`` as float
    (``F.one_hot`` gives int64)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        what = (f"a dict with keys {', '.join(map(str, batch))}" if isinstance(batch, dict) else
                f"{len(batch)} items" if isinstance(batch, (tuple, list)) else
                f"a {type(batch).__name__}")
        raise TypeError(f"{where} takes batches of (inputs, labels), got {what}; give the "
                        "DataLoader a collate_fn that returns (inputs, labels).")
    images, labels = batch
    if not torch.is_tensor(images) or not torch.is_tensor(labels):
        raise TypeError(f"{where} takes (inputs, labels) as tensors, got "
                        f"({type(images).__name__}, {type(labels).__name__}); return tensors "
                        "from the dataset (class indices as integers), so the default collate "
                        "stacks them.")
    if labels.dim() == 2 and labels.shape[1] == 1 or labels.dim() not in (1, 2):
        raise ValueError(f"{where} takes class indices (N,) or class probabilities (N, C), got "
                         f"labels of shape {tuple(labels.shape)}; for indices, flatten them "
                         "(labels.view(-1)); one value per sample to regress needs a loop with "
                         "your own loss.")
    if labels.is_floating_point() and labels.dim() == 1:  # (N,) floats: indices in the wrong dtype
        raise TypeError(f"{where} takes class indices as integers, got {labels.dtype} labels of "
                        f"shape {tuple(labels.shape)}; convert them with .long() (class "
                        "probabilities are (N, C)).")
    return images, labels.long() if labels.dim() == 1 else labels.float()


def _check_probabilities(labels: torch.Tensor) -> None:
    """Soft labels must be distributions: multi-hot rows (a multi-label task) or negative values
    would train softmax cross-entropy on a target it cannot mean, silently."""
    sums = labels.sum(1)
    if not bool((labels >= 0).all() & ((sums - 1).abs() < 1e-3).all()):
        raise ValueError(f"train_one_epoch takes (N, C) labels as class probabilities (each row "
                         f">= 0, summing to 1), but its row sums range over [{sums.min().item():.4g}, "
                         f"{sums.max().item():.4g}] and its smallest value is "
                         f"{labels.min().item():.4g}; a "
                         "multi-label task (several 1s per row) needs a loop with its own loss, "
                         "e.g. BCEWithLogitsLoss.")


def _logits(output: Any, where: str) -> torch.Tensor:
    """The model's output, which the cross-entropy of both loops needs as logits ``(N, C)``."""
    if not torch.is_tensor(output):
        raise TypeError(f"{where} needs the model to return one logits tensor (N, C), got a "
                        f"{type(output).__name__}; wrap the model in a module that returns the "
                        "logits alone (e.g. its output[0] or output['logits']).")
    if output.dim() != 2 or output.shape[1] < 2:
        raise ValueError(f"{where} trains and scores a classifier with cross-entropy, which "
                         f"needs logits (N, C) for C >= 2 classes, but the model returned "
                         f"{tuple(output.shape)}; for one output per sample (binary, "
                         "regression) use 2 classes or a loop with your own loss.")
    return output.float()


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int, *,
                    scaler: torch.amp.GradScaler | None = None,
                    amp_dtype: torch.dtype | None = None, grad_accum_steps: int = 1,
                    clip_grad_norm: float | None = None, print_freq: int = 50,
                    channels_last: bool = False,
                    log_fn: Callable[[int, float, float], Any] | None = None) -> float:
    """One pass over ``data_loader``; returns the mean loss over every rank's samples.

    The model returns logits ``(N, C)``; the loss is cross-entropy. Class probabilities as labels
    are checked to be ``>= 0`` and sum to 1 in the first batch only (a check syncs the host).
    ``data_loader`` needs a length (a map-style dataset, or an ``IterableDataset`` with
    ``__len__``): it sets the last accumulation group and the progress.
    ``grad_accum_steps`` K: the optimizer steps every K batches (and after the last), and DDP
    skips its gradient all-reduce on the other K-1 (``no_sync``). ``log_fn(step, loss, lr)`` is
    called on every rank every ``print_freq`` steps with the reduced running mean loss.
    Progress: a tqdm bar on rank 0 in a terminal; where stdout is a file (SLURM, nohup), a
    ``logging`` INFO line every ``print_freq`` steps instead, since a bar there is one endless
    ``\r`` line (configure logging to see them, e.g. ``logging.basicConfig(level=logging.INFO)``).
    """
    for name, value in (("grad_accum_steps", grad_accum_steps), ("print_freq", print_freq)):
        if not (isinstance(value, numbers.Integral) and value >= 1):
            raise ValueError(f"train_one_epoch: {name} must be an integer >= 1, got {value!r}.")
    try:
        steps = len(data_loader)
    except TypeError:  # an IterableDataset without __len__
        raise TypeError("train_one_epoch needs a data loader with a length, to know the last "
                        "accumulation group and the progress; give the IterableDataset a "
                        "__len__ (its batches per rank, the same on every rank).") from None
    model.train()
    loss_function = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    mean_loss = float("nan")
    optimizer.zero_grad(set_to_none=True)

    bar = is_main_process() and sys.stdout.isatty()
    lines = is_main_process() and not bar
    progress = tqdm(data_loader, file=sys.stdout, disable=not bar,
                    desc=f"[train epoch {epoch}]", dynamic_ncols=True)
    start, seen = time.perf_counter(), 0
    for step, batch in enumerate(progress):
        images, labels = _inputs_and_labels(batch, "train_one_epoch")
        seen += labels.shape[0]
        images = prepare_images(images, device, channels_last=channels_last)
        labels = labels.to(device, non_blocking=True)
        if step == 0 and labels.is_floating_point():
            _check_probabilities(labels)
        # Class probabilities (N, C) have one sample per row and no "unreadable" marker.
        n_valid = (torch.full((), labels.shape[0], device=device)  # filled there: no copy
                   if labels.is_floating_point() else (labels != IGNORE_INDEX).sum())
        last_micro = (step + 1) % grad_accum_steps == 0 or step + 1 == steps
        sync_context = (model.no_sync() if not last_micro and hasattr(model, "no_sync")
                        else contextlib.nullcontext())
        with sync_context:
            with _autocast(device, amp_dtype):
                output = model(images)
            # Sum over valid samples / their count == mean, but stays finite for a batch whose
            # every image was unreadable.
            loss = (loss_function(_logits(output, "train_one_epoch"), labels)
                    / n_valid.clamp(min=1))
            # Mean over the micro-batches of this optimizer step; the last group of an epoch
            # whose length K does not divide is shorter, and a fixed / K would shrink its step.
            group_start = step - step % grad_accum_steps
            scaled = loss / min(grad_accum_steps, steps - group_start)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach().double() * n_valid
        count += n_valid

        if last_micro:
            if clip_grad_norm is not None:
                if scaler is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if (step + 1) % print_freq == 0 or step + 1 == steps:
            mean_loss = _reduced_mean(loss_sum, count)
            if not math.isfinite(mean_loss):
                # Checked every print_freq steps (no sync per step): it may have begun earlier.
                raise FloatingPointError(f"non-finite training loss ({mean_loss}) at epoch {epoch}, "
                                         f"noticed at step {step} (checked every {print_freq} "
                                         "steps); lower the learning rate or check the data.")
            lr = optimizer.param_groups[0]["lr"]
            progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
            if lines:
                elapsed = time.perf_counter() - start
                log.info("[train epoch %d] step %d/%d  loss %.4f  lr %.2e  %.0f img/s per "
                         "process  eta %s", epoch, step + 1, steps, mean_loss, lr,
                         seen / elapsed, _duration(elapsed / (step + 1) * (steps - step - 1)))
            if log_fn is not None:
                log_fn(epoch * steps + step, mean_loss, lr)
    # The last step always reduced (step + 1 == steps): reuse it, no second all-reduce.
    return mean_loss


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _reduced_mean(total: torch.Tensor, count: torch.Tensor) -> float:
    both = reduce_value(torch.stack([total, count]), average=False).tolist()
    return both[0] / both[1] if both[1] else float("nan")


class EvalResult(int):
    """The number of correct top-1 predictions over all ranks, each val sample counted once.

    It is an ``int`` so the classic ``acc = evaluate(...) / len(val_set)`` keeps working; the
    other exact figures ride along as attributes. (The classic ``/ val_sampler.total_size`` now
    under-reports: ``total_size`` counts the sampler's padding, which is no longer scored; use
    ``.top1``, over ``num_samples``, which leaves out samples labelled -100, or ``len(val_set)``,
    which counts those as wrong.)
    """

    top5_correct: int
    num_samples: int
    loss: float
    confusion: torch.Tensor

    def __new__(cls, correct: int, *, top5_correct: int, num_samples: int, loss_sum: float,
                confusion: torch.Tensor) -> "EvalResult":
        obj = super().__new__(cls, correct)
        obj.top5_correct = top5_correct
        obj.num_samples = num_samples
        obj.loss = loss_sum / num_samples if num_samples else float("nan")
        obj.confusion = confusion
        return obj

    def __getnewargs_ex__(self) -> tuple[tuple[int], dict[str, Any]]:
        # copy, deepcopy and pickle (e.g. all_gather_object) rebuild it through __new__.
        return (int(self),), dict(top5_correct=self.top5_correct, num_samples=self.num_samples,
                                  loss_sum=self.loss * self.num_samples, confusion=self.confusion)

    @property
    def correct(self) -> int:
        return int(self)

    @property
    def top1(self) -> float:
        return int(self) / self.num_samples if self.num_samples else float("nan")

    @property
    def top5(self) -> float | None:
        """Top-5 accuracy, or None with 5 classes or fewer (where it is always 1)."""
        if self.confusion.shape[0] <= 5 or not self.num_samples:
            return None
        return self.top5_correct / self.num_samples

    @property
    def per_class_acc(self) -> list[float]:
        """Recall of each class (rows of the confusion matrix: true class)."""
        per_class = self.confusion.sum(1).clamp(min=1)
        return (self.confusion.diagonal() / per_class).tolist()


def _distributed_sampler(data_loader: DataLoader) -> DistributedSampler | None:
    sampler = data_loader.sampler
    if isinstance(data_loader.batch_sampler, BatchSampler):
        sampler = data_loader.batch_sampler.sampler
    return sampler if isinstance(sampler, DistributedSampler) else None


@torch.no_grad()
def evaluate(model: nn.Module, data_loader: DataLoader, device: torch.device, *,
             amp_dtype: torch.dtype | None = None, channels_last: bool = False) -> EvalResult:
    """Exact top-1/top-5/loss over the whole val set, however it is split across ranks.

    ``DistributedSampler`` pads each rank's share by repeating samples so all ranks take the same
    number of steps. In its padded order the sample at position ``p`` (rank ``p % W`` holds it) is
    a repeat iff ``p >= len(dataset)``, so each rank masks its repeats out by position, with no
    extra gather (as accelerate's ``gather_for_metrics`` drops them).
    """
    model.eval()
    sampler = _distributed_sampler(data_loader)
    if sampler is not None and not getattr(data_loader, "in_order", True):
        raise ValueError("evaluate needs the val loader's batches in the sampler's order, to tell "
                         "its padded repeats by position; build it with in_order=True (the "
                         "default).")
    if is_main_process():  # every rank has the same loader: said once
        if sampler is None and get_world_size() > 1:
            log.warning("evaluate: the loader has no DistributedSampler, so every rank scores the "
                        "whole val set and each sample counts %d times; give it "
                        "DistributedSampler(val_set, shuffle=False).", get_world_size())
        if (sampler is not None and sampler.drop_last) or getattr(
                data_loader.batch_sampler, "drop_last", False):
            log.warning("evaluate: the val loader or its DistributedSampler has drop_last=True, "
                        "so some val samples are never scored; build both with drop_last=False.")
    world, rank = (sampler.num_replicas, sampler.rank) if sampler is not None else (1, 0)
    num_real = len(sampler.dataset) if sampler is not None else None

    stats = torch.zeros(4, device=device, dtype=torch.float64)  # top1, top5, loss_sum, count
    confusion = None
    seen = 0
    loss_function = nn.CrossEntropyLoss(reduction="none", ignore_index=IGNORE_INDEX)
    progress = tqdm(data_loader, file=sys.stdout, desc="[valid]",
                    disable=not (is_main_process() and sys.stdout.isatty()),
                    dynamic_ncols=True)
    for batch in progress:
        images, labels = _inputs_and_labels(batch, "evaluate")
        if labels.is_floating_point():
            raise ValueError(f"evaluate needs class indices (N,) as labels, got class "
                             f"probabilities of shape {tuple(labels.shape)}; give it a val loader "
                             "without one-hot or mixed labels (labels.argmax(1) are the "
                             "indices).")
        size = labels.shape[0]
        images = prepare_images(images, device, channels_last=channels_last)
        labels = labels.to(device, non_blocking=True)
        valid = labels != IGNORE_INDEX
        if num_real is not None:
            positions = rank + (seen + torch.arange(size, device=device)) * world
            valid &= positions < num_real
        seen += size
        with _autocast(device, amp_dtype):
            logits = model(images)
        logits = _logits(logits, "evaluate")
        num_classes = logits.shape[1]
        if confusion is None:
            confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.int64)
        topk = logits.topk(min(5, num_classes), dim=1).indices
        hits = topk == labels[:, None]
        stats[0] += (hits[:, 0] & valid).sum()
        stats[1] += (hits.any(1) & valid).sum()
        stats[2] += (loss_function(logits, labels) * valid).sum()
        stats[3] += valid.sum()
        # Adds 1 to each valid sample's (label, prediction) cell and 0 elsewhere: no boolean
        # indexing and no bincount, both of which wait for the GPU to learn a size.
        cells = labels.clamp(min=0) * num_classes + topk[:, 0]
        confusion.index_put_((cells,), valid.long(), accumulate=True)

    if confusion is None:  # empty loader on this rank; keep collectives matched across ranks
        confusion = torch.zeros(0, device=device, dtype=torch.int64)
    stats = reduce_value(stats, average=False).tolist()
    confusion = _reduce_confusion(confusion)
    return EvalResult(round(stats[0]), top5_correct=round(stats[1]), num_samples=round(stats[3]),
                      loss_sum=stats[2], confusion=confusion)


def _reduce_confusion(confusion: torch.Tensor) -> torch.Tensor:
    # A rank that saw no batch does not know the class count: agree on the largest first.
    size = torch.tensor([confusion.numel()], device=confusion.device)
    if get_world_size() > 1:
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
    if confusion.numel() < size.item():
        confusion = torch.zeros(int(size.item()), device=confusion.device, dtype=torch.int64)
    side = math.isqrt(confusion.numel())
    return reduce_value(confusion, average=False).cpu().view(side, side)


__all__ = ["train_one_epoch", "evaluate", "EvalResult", "prepare_images", "resolve_amp_dtype",
           "common_amp_dtype", "IGNORE_INDEX", "IMAGENET_MEAN", "IMAGENET_STD"]
