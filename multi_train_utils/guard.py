"""One wrapper around a training process: signals, exit codes and one-line errors.

    guarded(main, args, rerun_hint=lambda: "run the same command again")

- A user's mistake (``UserError``: flags, data, files) is one ``error: ...`` line, exit code 2.
- Ctrl-C and SIGTERM (torchrun, SLURM, ``kill``) unwind like a KeyboardInterrupt, so every
  ``finally`` runs, the DataLoader workers stop and the process group is destroyed: nothing is
  left behind. Exit code 130 / 143, and one line saying how to continue.
- torch's own run failures (a lost peer, a collective past ``--dist-timeout``, a DataLoader
  worker that died or sent nothing for its timeout, a full disk) are torch's first line plus how
  to continue, exit code 1. Anything else is a bug and keeps its traceback.
- A rank started by a launcher dies with it (Linux), so a ``kill -9`` of torchrun leaves no
  orphan training on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch.distributed as dist

log = logging.getLogger("train")
EXIT_USER_ERROR = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class UserError(Exception):
    """A mistake the user can fix (flags, data, files): said in one line, exit code 2."""


class ConfigError(UserError):
    """Flags that contradict each other or the data."""


def setup_logging(rank: int) -> None:
    """One gate for chatter: rank 0 logs INFO, the other ranks only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True, stream=sys.stderr)


def _env_int(*names: str) -> int:
    """The first of ``names`` set in the environment (torchrun's, then SLURM's), else 0."""
    value = next((os.environ[n] for n in names if n in os.environ), "0")
    return int(value) if value.isdigit() else 0


def die_with_launcher() -> None:
    """Ask Linux to SIGTERM this process when its parent (torchrun, the spawn launcher) dies.

    A launcher killed with SIGKILL cannot stop its ranks: they would train on as orphans and a
    rerun would find its output folder busy. Not for a plain ``python`` run, which must outlive
    its shell under nohup.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM wait until the block is done (a checkpoint write), then take effect.

    Interrupted half-way, ``torch.save`` leaves a broken temp file and the epoch just trained is
    lost; a save takes a second, and every launcher waits longer than that before SIGKILL.
    """
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum))
                for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if pending:
        signal.raise_signal(pending[0])  # now the usual handler takes it


def _exit_at_once(signum: int, frame: Any) -> None:
    # Already stopping: a second signal (torchrun signals the whole group) must not turn the
    # clean-up into a traceback.
    os._exit(128 + signum)


def _is_run_failure(exc: BaseException) -> bool:
    """torch's errors for a run that failed outside this process's code: peers, loader, disk."""
    if isinstance(exc, (OSError, FloatingPointError, dist.DistError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("DataLoader worker", "DataLoader timed out", "gloo", "NCCL",
                                    "Connection closed by peer", "Connection reset by peer",
                                    "pair closure", "timed out", "Timed out"))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _stop(code: int, message: str, *, say: bool, rank: int) -> NoReturn:
    """The process's last line (no timestamp: it is the answer, not a log), then exit."""
    signal.signal(signal.SIGTERM, _exit_at_once)
    signal.signal(signal.SIGINT, _exit_at_once)
    if say:
        print(message if rank == 0 else f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def guarded(main: Callable[[Any], None], args: Any,
            rerun_hint: Callable[[], str] = lambda: "run the same command again") -> None:
    """Run ``main(args)`` in this process with the behaviour in the module docstring.

    ``rerun_hint()`` says how to continue (it is called when the run stops, so it can look at
    what was saved by then).
    """
    rank, local_rank = _env_int("RANK", "SLURM_PROCID"), _env_int("LOCAL_RANK", "SLURM_LOCALID")
    setup_logging(rank)
    if "TORCHELASTIC_RUN_ID" in os.environ or "DDP_SPAWNED" in os.environ:
        die_with_launcher()
    received: list[str] = []  # the first stop signal: a peer lost after it is its doing

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        if hasattr(signal, "SIGCHLD"):  # POSIX
            # The DataLoader workers stop too (the launcher signals them all); torch's SIGCHLD
            # handler would raise "worker killed" in the middle of the clean-up.
            signal.signal(signal.SIGCHLD, lambda *_: None)
        raise KeyboardInterrupt(received[0])

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:  # ignored stays ignored (nohup ... &)
            signal.signal(signum, on_signal)
    try:
        main(args)
    except UserError as exc:  # every rank raises it: said once per machine
        _stop(EXIT_USER_ERROR, f"error: {exc}", say=local_rank == 0, rank=rank)
    except KeyboardInterrupt as exc:
        name = received[0] if received else str(exc) or "SIGINT"
        _stop(143 if name == "SIGTERM" else 130, f"interrupted by {name}; {rerun_hint()}.",
              say=rank == 0, rank=rank)
    except Exception as exc:
        if received:  # a peer, or a loader worker, stopped on the same signal first
            _stop(143 if received[0] == "SIGTERM" else 130,
                  f"interrupted by {received[0]}; {rerun_hint()}.", say=rank == 0, rank=rank)
        if not _is_run_failure(exc):
            raise
        _stop(1, f"error: {_first_line(exc)} ({type(exc).__name__}); {rerun_hint()}.",
              say=True, rank=rank)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for signum, handler in previous.items():  # main may run again in this process
            signal.signal(signum, handler)
