"""One wrapper around a training process: signals, exit codes and one-line errors.

    guarded(main, args, rerun_hint=lambda: "run the same command again")

Each way a run ends has its exit code and one line (docs/errors-and-troubleshooting.md); a stop
signal unwinds like a KeyboardInterrupt, so every ``finally`` runs; a bug keeps its traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.util  # its exit hook first: ours (registered later) runs before it
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger("train")
EXIT_USER_ERROR = 2
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2",
                     "SIGQUIT") if hasattr(signal, name))  # Windows lacks SIGUSR1/2, SIGQUIT
REQUEST_SIGNALS = tuple(s for s in STOP_SIGNALS if s.name != "SIGQUIT")  # Ctrl-\: at once
_received: list[int] = []  # the stop signals this process got, in order: the first is the cause


class UserError(Exception):
    """A mistake the user can fix (flags, data, files): said in one line, exit code 2."""


class ConfigError(UserError):
    """Flags that contradict each other or the data."""


def setup_logging(rank: int) -> None:
    """One gate for chatter: the ranks but 0 log only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True, stream=sys.stderr)


def _env_rank(*names: str) -> int:
    """The first of ``names`` set (torchrun's, then SLURM's), else 0: a broken value is
    init_distributed_mode's to report."""
    value = next((os.environ[n] for n in names if n in os.environ), "0")
    return int(value) if value.isdigit() else 0


def die_with_launcher() -> None:
    """Ask Linux to SIGTERM this process when its parent (torchrun, the spawn launcher) dies: a
    launcher killed with SIGKILL cannot stop its ranks, and orphans would keep the output folder
    busy. Not for a plain ``python`` run, which must outlive its shell under nohup."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "DDP_SPAWNED" in os.environ
    if launched and sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


@contextlib.contextmanager
def stop_signals_to(handler: Callable[[int, Any], Any],
                    signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """``signals`` go to ``handler`` (or ``SIG_DFL``) in the block, but ignored stays ignored
    (``nohup ... &``); after it, they get back the handlers they had."""
    previous = {s: signal.getsignal(s) for s in signals}
    for signum, handler_before in previous.items():
        if handler_before is not signal.SIG_IGN:
            signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Stop signals wait until the block is done (a checkpoint write), then take effect: cut
    half-way, ``torch.save`` leaves a broken temp file and the epoch just trained is lost; a save
    takes a second, and every launcher waits longer than that before SIGKILL."""
    pending: list[int] = []
    with stop_signals_to(lambda signum, frame: pending.append(signum)):
        yield
    for signum in pending:  # now the usual handler takes them (a SIGQUIT after a SIGTERM too)
        signal.raise_signal(signum)


def workers_ignore_stop_signals() -> Callable[[int], None]:
    """A DataLoader ``worker_init_fn`` for this process's loaders: the workers ignore stop
    signals (a terminal's Ctrl-C and SLURM reach every process) and keep delivering the batches
    of the steps before the stop; they end when this process does, as this call makes sure."""
    atexit.unregister(_end_loader_workers)  # once, however many loaders
    atexit.register(_end_loader_workers)
    return _ignore_stop_signals


def _ignore_stop_signals(worker_id: int) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _end_loader_workers() -> None:
    # At exit multiprocessing ends its daemonic children (DataLoader workers) with SIGTERM and
    # waits: workers that ignore it would hold the exit forever. SIGKILL them first; they hold
    # nothing to save. torch's SIGCHLD handler would call their end an error.
    if hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


class StopRequest:
    """Within :func:`stop_requests` a stop signal only sets :attr:`signum`; the ranks stop at the
    step :meth:`poll` agrees on (docs/resume-and-restarts.md), SIGQUIT at once. The flags are
    all-reduced on the CPU (gloo; under NCCL in a group of its own, read a step later): the
    host waits neither for the GPU nor for the network."""

    def __init__(self) -> None:
        self.signum = 0  # the first stop signal this rank got, or 0
        self.agreed = 0  # the signal all ranks agreed to stop on, or 0
        self._group: Any = None
        self._lag = 0  # steps between an all-reduce and reading its answer
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
            _received.append(signum)
            log.warning("%s: stopping after an optimizer step all ranks agree on, once it is "
                        "saved (Ctrl-\\ or kill -QUIT stops at once, without saving)",
                        signal.Signals(signum).name)

    def _answer(self, keep: int) -> int:
        agreed = 0
        while len(self._pending) > keep:
            work, flag = self._pending.pop(0)
            work.wait()
            agreed = max(agreed, int(flag))
        return agreed

    def poll(self, lag: bool = True) -> bool:
        """Call on every rank after every optimizer step: whether to stop now, the same answer
        on every rank at the same call. ``lag=False`` (at an epoch's end): no step's delay."""
        if not (dist.is_available() and dist.is_initialized()):
            self.agreed = self.signum
            return bool(self.agreed)
        if self._group is None:  # the first call, at the same step on every rank
            nccl = dist.get_backend() == "nccl"
            self._group = dist.new_group(backend="gloo") if nccl else dist.group.WORLD
            self._lag = 1 if nccl else 0
        flag = torch.tensor([self.signum], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending.append((work, flag))
        self.agreed = self._answer(keep=self._lag if lag else 0)
        return bool(self.agreed)

    def stop(self) -> NoReturn:
        """End the run as the agreed signal would (exit code 128 + it), once it is saved."""
        _received[:] = _received or [self.agreed]  # another rank's signal: this rank's cause
        raise KeyboardInterrupt(signal.Signals(self.agreed).name)


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """The block (training) takes stop signals as requests: see :class:`StopRequest`."""
    request = StopRequest()
    with stop_signals_to(request._on_signal, REQUEST_SIGNALS):
        yield request
        request._answer(keep=0)  # no collective left in flight when the group goes


def _exit_at_once(signum: int, frame: Any) -> None:
    # Already stopping: a second signal (torchrun signals the whole group) must not turn the
    # clean-up into a traceback.
    os._exit(128 + signum)


def _is_run_failure(exc: BaseException) -> bool:
    """torch's errors for a run that failed outside this process's code: peers, loader, disk."""
    text = str(exc).lower() if isinstance(exc, RuntimeError) else ""  # gloo's name their file
    return isinstance(exc, (OSError, FloatingPointError, dist.DistError)) or any(
        words in text for words in ("dataloader", "gloo", "nccl"))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if "Original Traceback" in str(exc):  # a loader worker's: its own error is the last line
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else type(exc).__name__


def _stop(code: int, message: str, *, say: bool, rank: int) -> NoReturn:
    """The process's last line (no timestamp: it is the answer, not a log), then exit."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _exit_at_once)
    if say:
        print(message if rank == 0 else f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def guarded(main: Callable[[Any], None], args: Any,
            rerun_hint: Callable[[], str] = lambda: "run the same command again") -> None:
    """Run ``main(args)`` as the module docstring says; ``rerun_hint()``, called
    when the run stops, says how to continue (it can look at what was saved by then)."""
    rank, local_rank = _env_rank("RANK", "SLURM_PROCID"), _env_rank("LOCAL_RANK", "SLURM_LOCALID")
    setup_logging(rank)
    die_with_launcher()
    _received.clear()  # the first stop signal: a peer lost after it is its doing

    def on_signal(signum: int, frame: Any) -> None:
        if signum not in REQUEST_SIGNALS:  # SIGQUIT: the cause, whatever came first
            _received.clear()
        _received.append(signum)
        if hasattr(signal, "SIGCHLD"):  # POSIX
            # The DataLoader workers stop too (the launcher signals them all); torch's SIGCHLD
            # handler would raise "worker killed" in the middle of the clean-up.
            signal.signal(signal.SIGCHLD, lambda *_: None)
        raise KeyboardInterrupt(signal.Signals(_received[0]).name)

    with stop_signals_to(on_signal):  # then as before: main may run again in this process
        try:
            main(args)
        except UserError as exc:  # every rank raises it: said once per machine
            _stop(EXIT_USER_ERROR, f"error: {exc}", say=local_rank == 0, rank=rank)
        except (KeyboardInterrupt, Exception) as exc:
            # A stop signal (without our handler: Ctrl-C's); an error after a signal is a peer
            # or loader worker stopped on it first.
            if _received or isinstance(exc, KeyboardInterrupt):
                signum = _received[0] if _received else signal.SIGINT
                _stop(128 + signum, f"interrupted by {signal.Signals(signum).name}; "
                      f"{rerun_hint()}.", say=rank == 0, rank=rank)
            if not _is_run_failure(exc):
                raise
            # A collective that failed: the ranks that did not come, and where they were, asked
            # of the heartbeat.Heartbeat block the error left.
            own = isinstance(exc, (OSError, FloatingPointError)) or "DataLoader" in str(exc)
            missing = None if own else getattr(exc, "missing_ranks", None)
            cause = missing and missing() or f"{_first_line(exc)} ({type(exc).__name__})"
            _stop(1, f"error: {cause}; {rerun_hint()}.", say=True, rank=rank)
        finally:
            # Free main's locals (the DDP model) while the process group lives: left to the
            # exit, DDP's reducer can tear down gloo holding the GIL a gloo thread waits for,
            # and the process never ends (seen with torch 2.8-2.11, gloo).
            exc = sys.exc_info()[1]
            if exc is not None:  # a loader stuck in a worker would wait 10 s for it, then exit
                _end_loader_workers()
            while exc is not None:
                traceback.clear_frames(exc.__traceback__)
                exc = exc.__context__
            gc.collect()
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
