"""How an epoch's batches reach the loop: :class:`ResumableSampler` deals the epoch's samples, or
the rest of a stopped one (:class:`EpochProgress` says where it stopped), and
:func:`prefetch_to_device` copies each batch to the device while the step before it runs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DistributedSampler


@dataclass
class EpochProgress:
    """How far an epoch got, kept up to date by ``train_one_epoch`` and saved mid-epoch;
    ``loss`` is this rank's ``(loss sum, sample count)``."""

    batches: int = 0  # trained on each rank, of batches_in_epoch
    samples: int = 0  # trained over all ranks: a prefix of the sampler's order
    batches_in_epoch: int = 0
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    stopped: bool = False  # after_step ended the epoch early
    file_list: str = ""  # a digest of the list the epoch's order is drawn over ("": the dataset)
    indices: torch.Tensor | None = None  # that list's items as dataset indices, where they differ


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose epoch can start part-way: after ``set_epoch(epoch, skip=k)``
    it deals only what follows the first ``k`` samples of the epoch's order (skipped unread). The
    order is the same at any world size (but with ``repeats``), so the rest can go to another
    number of ranks; with the same world size each rank gets the rest of its own.
    ``indices[i]``: the dataset's index of item i of the list the epoch began with (-1: gone).

    ``repeats`` r > 1 (``--ra-sampler``, repeated augmentation, arXiv:1901.09335) deals each
    image r times in a row, copy j as index ``i + j * len(dataset)``, and ends the epoch after
    ``len(dataset) // W`` samples a rank, as torchvision's ``RASampler`` does (without its
    rounding down to 256 images)."""

    def __init__(self, *args: Any, repeats: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.repeats = repeats
        self.set_epoch(self.epoch)  # a loader's length is the epoch's from the start

    def set_epoch(self, epoch: int, skip: int = 0, indices: torch.Tensor | None = None) -> None:
        super().set_epoch(epoch)
        self.skip, self.rest = skip, None  # for this epoch only: the next deals a whole one
        if skip or indices is not None or self.repeats > 1:  # else DistributedSampler deals it
            n, r = len(self.dataset) if indices is None else len(indices), self.repeats
            order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
                     if self.shuffle else torch.arange(n))  # DistributedSampler's order
            order = order if indices is None else indices[order]
            if r > 1:  # the first n // W * W of the repeated order; copy j of i: i + j * len
                keep = n // self.num_replicas * self.num_replicas
                order, copy = order.repeat_interleave(r)[:keep], torch.arange(keep) % r
                order = torch.where(order >= 0, order + copy * len(self.dataset), -1)
            self.rest, self.order = order[skip:][order[skip:] >= 0], order[order >= 0]

    def __iter__(self) -> Iterator[int]:
        if self.rest is None:
            return super().__iter__()
        size = len(self) * self.num_replicas  # padded with the order's start
        rest = torch.cat([self.rest, self.order.repeat(-(-size // max(len(self.order), 1)))])
        return iter(rest[:size][self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        if self.rest is None:
            return super().__len__()
        rest, world = len(self.rest), self.num_replicas
        return rest // world if self.drop_last else -(-rest // world)


def prefetch_to_device(batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """``batches`` in order, the tensors of each (a tuple or list) moved to ``device``; a batch
    with a ``to_device(device)`` method (``device_decode.JpegBatch``) moves itself. On CUDA the
    next batch's copy (asynchronous from a pinned batch) or decode starts on a side stream before
    this one is handed out, so it overlaps this step's compute."""
    if device.type != "cuda":
        yield from (b.to_device(device) if hasattr(b, "to_device") else b for b in batches)
        return
    side, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def start(batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(side):
            if hasattr(batch, "to_device"):
                batch = batch.to_device(device)
            elif isinstance(batch, (tuple, list)):  # else _unpack says what it takes
                moved = [x.to(device, non_blocking=True) if torch.is_tensor(x) else x
                         for x in batch]
                batch = type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
            done = side.record_event()  # the event compute waits for before using it
        for x in batch if isinstance(batch, (tuple, list)) else ():
            if torch.is_tensor(x):  # made on the side stream, used on compute's: the caching
                x.record_stream(compute)  # allocator must not reuse it before compute is done
        return batch, done

    started = map(start, batches)  # lazily: each batch's copy or decode starts a step ahead
    ahead = next(started, None)  # (batch, event) whose copy or decode is under way
    while ahead is not None:
        ready, ahead = ahead, next(started, None)
        compute.wait_event(ready[1])  # queued before the step that uses it: its work alone
        yield ready[0]
