"""Where each rank is, kept where every rank can read it, and who is missing when one hangs.

The loops say where this rank is (``HEARTBEAT.at(phase, epoch=, step=, steps=)``: no I/O, no
collective); a daemon thread writes that, the host, the pid and the time into the rendezvous
store (torchrun's, or ``init_process_group``'s) once a second. When a collective fails,
:meth:`Heartbeat.missing` reads the others' records and names the ranks that stopped answering
or were somewhere else. The process group's timeout follows the phase: the long limit for
start-up, evaluation and saves (and the step after them, where the others wait for it), the
short one for every other step.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import statistics
import threading
import time
from typing import Any

import torch.distributed as dist

SLOW_PHASES = ("starting", "evaluating", "saving")  # a step: "loading data", forward, backward
OWN_PHASES = ("loading data", "forward")  # no wait for the others in them (but SyncBatchNorm's)
STALE_S = 5.0  # no beat for this long: the process is not running (frozen, or its host is gone)


class Heartbeat:
    def __init__(self) -> None:
        self.store: Any = None
        self.place: dict[str, Any] = {}
        self.limits = (0.0, 0.0)  # seconds a collective waits: after a slow phase, else
        self.own = 0.0  # seconds in OWN_PHASES since work() was read
        self._fast_in = 0  # steps until the short limit applies
        self._read_at = time.monotonic()
        self._stop = threading.Event()

    def start(self, store: Any, rank: int, world_size: int, limits: tuple[float, float]) -> None:
        self.stop()
        self.store, self.rank, self.world_size, self.limits = store, rank, world_size, limits
        self.node = f"{socket.gethostname()} {_pid_namespace()}"  # where a pid means this process
        self._stop = threading.Event()
        self.at("starting", epoch=None, step=0, steps=0)
        threading.Thread(target=self._beat, args=(self._stop,), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.store = None

    def at(self, phase: str, **where: Any) -> None:
        """This rank is now in ``phase`` (of ``SLOW_PHASES``, "loading data", "forward",
        "backward") at ``where`` (epoch, step, steps): a dict made, a clock read."""
        if self.store is None:
            return
        now, before = time.monotonic(), self.place
        if before.get("phase") in OWN_PHASES:
            self.own += now - before["since"]
        self.place = {**before, **where, "phase": phase, "since": now, "wall": time.time()}
        if phase in SLOW_PHASES:  # the others may wait for this rank's work, or it for theirs
            self._fast_in = 2
            dist.set_timeout(datetime.timedelta(seconds=self.limits[0]))
        elif phase == "forward" and self._fast_in:
            self._fast_in -= 1  # the step after the slow phase met every rank: back to short
            if not self._fast_in:
                dist.set_timeout(datetime.timedelta(seconds=self.limits[1]))

    def work(self) -> tuple[float, float]:
        """Seconds this rank spent loading data and in forward passes (its own work, not a wait
        for the others, but with ``--sync-bn``), and seconds in all, since the last call."""
        now, own, self.own = time.monotonic(), self.own, 0.0
        seconds, self._read_at = now - self._read_at, now
        return own, seconds

    def _beat(self, stopped: threading.Event) -> None:
        key, pid = f"ddp-template/heartbeat/{self.rank}", os.getpid()
        while self.store is not None and not stopped.is_set():
            record = {**self.place, "host": socket.gethostname(), "pid": pid, "node": self.node,
                      "beat": time.time()}
            try:
                self.store.set(key, json.dumps(record))
            except Exception:  # the store's host is gone: the run is ending anyway
                return
            stopped.wait(1.0)

    def missing(self) -> str:
        """The ranks that did not arrive, and where each last was, for the error line: one
        that stopped answering (on this machine it is ended, so the launcher need not wait for
        a process that cannot take its SIGTERM) or one busy elsewhere; "" if all look here."""
        store, names, now = self.store, [], time.time()
        if store is None:
            return ""
        try:
            store.set_timeout(datetime.timedelta(seconds=5))  # a dead store host: no long hang
            for rank in (r for r in range(self.world_size) if r != self.rank):
                key = f"ddp-template/heartbeat/{rank}"
                peer = json.loads(store.get(key)) if store.check([key]) else None
                quiet = now - peer["beat"] if peer else 0
                who = f"rank {rank} (host {peer['host']}, pid {peer['pid']})" if peer else ""
                if peer is None:
                    names.append(f"rank {rank} never reported")
                elif quiet > STALE_S:
                    if peer["node"] == self.node and quiet > self.limits[1] / 2:
                        os.kill(peer["pid"], signal.SIGKILL)
                    names.append(f"{who} stopped answering {quiet:.0f} s ago at {_where(peer)}")
                elif _where(peer) != _where(self.place):
                    names.append(f"{who} has been at {_where(peer)} for "
                                 f"{now - peer['wall']:.0f} s")
        except Exception:  # the store is gone too: torch's own message then
            pass
        return "; ".join(names[:8] + [f"{len(names) - 8} more"] * (len(names) > 8))


def _where(place: dict[str, Any]) -> str:
    if place.get("epoch") is None:
        return f"start-up ({place.get('phase')})"
    return f"epoch {place['epoch']}, step {place['step']} of {place['steps']} ({place['phase']})"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def slowest(work: list[float], seconds: float) -> str:
    """``rank R is the slowest: ...`` when one rank's own work (``work``: seconds per rank over
    the last ``seconds``) is clearly longer than the median rank's: every step waits for it."""
    rank = max(range(len(work)), key=work.__getitem__)
    median = statistics.median(work[:rank] + work[rank + 1:] or [work[rank]])  # of the others
    if work[rank] < 1.5 * median or work[rank] - median < 0.02 * seconds:
        return ""
    return (f"rank {rank} is the slowest: {work[rank] / max(median, 1e-9):.1f}x the median "
            "rank's time loading data and in forward passes, which every step waits for")


HEARTBEAT = Heartbeat()
