"""Each rank's place (epoch, step, phase) in the rendezvous store, to name the ranks that hang.

    with Heartbeat(info) as heartbeat:  # info: init_distributed_mode's
        train_one_epoch(..., heartbeat=heartbeat)

The loops and the save call ``heartbeat.at(phase, ...)`` (no I/O, no collective); a thread writes
the place to the store once a second. The group's timeout follows the phase
(docs/errors-and-troubleshooting.md)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from .distributed_utils import DistInfo

SLOW_PHASES = ("starting", "evaluating", "saving")  # a step: "loading data", forward, backward
STALE_S = 5.0  # no beat for this long: the process does not run (frozen, or its host is gone)


class Heartbeat:
    """A context manager: an error that leaves the block carries ``missing_ranks`` (this
    heartbeat's :meth:`missing`), which :func:`guard.guarded` calls for a failed collective.
    Outside a block (or without ``info``: the loops' default) it hears nothing and costs nothing."""

    def __init__(self, info: DistInfo | None = None) -> None:
        info = info or DistInfo()
        self.rank, self.world_size, self.limits = info.rank, info.world_size, info.timeouts
        self.store, self.place = None, {}

    def __enter__(self) -> Heartbeat:
        self._stop = threading.Event()
        if not (dist.is_available() and dist.is_initialized()):
            return self  # one process: nobody to name, at() returns at once
        self.store = dist.distributed_c10d._get_default_store()  # torchrun's, or the group's
        self.node, self._long_until = socket.gethostname(), None
        self.nccl = dist.get_backend() == "nccl"
        with contextlib.suppress(OSError):  # a pid names this process in its namespace only
            self.node += os.readlink("/proc/self/ns/pid")
        self.at("starting", epoch=None, step=0, steps=0)
        threading.Thread(target=self._beat, args=(self.store, self._stop), daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: Any) -> None:
        self._stop.set()
        if isinstance(exc, Exception):
            exc.missing_ranks = self.missing

    def at(self, phase: str, **where: Any) -> None:
        """This rank is in ``phase`` now, at ``where`` (epoch, step, steps)."""
        if self.store is None:
            return
        self.place = {**self.place, **where, "phase": phase, "since": time.monotonic(),
                      "wall": time.time()}
        # The long limit from a slow phase until the forward after the first gradient all-reduce
        # ("backward"; a micro-batch of --grad-accum-steps reduces nothing): all ranks met there.
        if phase in SLOW_PHASES or phase == self._long_until:
            self._long_until = ("backward" if phase in SLOW_PHASES
                                else "forward" if phase == "backward" else None)
            self.limit = self.limits[self._long_until is None]
            dist.set_timeout(datetime.timedelta(seconds=self.limit))

    def _beat(self, store: Any, stopped: threading.Event) -> None:
        mine, seen = {"host": socket.gethostname(), "pid": os.getpid(), "node": self.node}, None
        with contextlib.suppress(Exception):  # the store's host is gone: the run is ending
            while not stopped.is_set():
                store.set(f"heartbeat/{self.rank}", json.dumps({**self.place, **mine,
                                                                 "beat": time.time()}))
                # NCCL's watchdog ends the process at the timeout, with no error for Python to
                # name the missing ranks in: name them just before.
                stuck = time.monotonic() - self.place["since"] > self.limit - 3
                if self.nccl and stuck and seen is not self.place:  # once in each place
                    seen, names = self.place, self.missing()
                    if names:
                        print(f"error: {names}; NCCL ends this rank now.", file=sys.stderr)
                stopped.wait(1.0)

    def missing(self) -> str:
        """The ranks that did not come and where each was: stopped answering (on this machine
        it is ended, as a frozen process cannot take the launcher's SIGTERM) or elsewhere."""
        names, now = [], time.time()
        with contextlib.suppress(Exception):  # no store any more: torch's own message then
            store, timeout = self.store, self.store.timeout
            store.set_timeout(datetime.timedelta(seconds=5))  # the store's host may be frozen
            for rank in (r for r in range(self.world_size) if r != self.rank):
                peer = json.loads(store.get(f"heartbeat/{rank}"))
                quiet = now - peer["beat"]
                who = f"rank {rank} (host {peer['host']}, pid {peer['pid']})"
                if quiet > STALE_S:
                    if peer["node"] == self.node and quiet > self.limits[1] / 2:
                        os.kill(peer["pid"], signal.SIGKILL)
                    names.append(f"{who} stopped answering {quiet:.0f} s ago at {_where(peer)}")
                elif _where(peer) != _where(self.place) and now - peer["wall"] > STALE_S:
                    names.append(f"{who} is at {_where(peer)} for {now - peer['wall']:.0f} s")
            store.set_timeout(timeout)
        return "; ".join(names[:8] + [f"{len(names) - 8} more"] * (len(names) > 8))


def _where(place: dict[str, Any]) -> str:
    if place["epoch"] is None:
        return f"start-up ({place['phase']})"
    return f"epoch {place['epoch']}, step {place['step']} of {place['steps']} ({place['phase']})"


def slowest(work: list[float], seconds: float) -> str:
    """``rank R is the slowest: ...`` when one rank's own work (seconds per rank, over the same
    ``seconds`` of steps) is over twice the others' median, by a tenth of ``seconds`` or more
    (less is a step's own noise)."""
    rank = max(range(len(work)), key=work.__getitem__)
    median = statistics.median(work[:rank] + work[rank + 1:] or [work[rank]])
    if work[rank] <= 2 * median or work[rank] - median < seconds / 10:  # noise reaches 1.6x
        return ""
    return (f"rank {rank} is the slowest: {work[rank] / max(median, 1e-9):.1f}x the median "
            "rank's own work (loading its batches), which every step waits for")

