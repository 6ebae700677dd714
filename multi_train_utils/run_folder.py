"""The run folder: one run per ``--output-dir``, locked while it lives; where a run continues
from; an earlier run moved aside, never overwritten; the line that says how to continue."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .checkpoint_io import CheckpointError

log = logging.getLogger("train")
RUN_FILES = ("checkpoint.pth", "model_best.pth", "weights", "metrics.jsonl", "tensorboard",
             "args.json", "class_indices.json", "skipped_files.txt", "class_distribution.png",
             "file_list.json", "stopped_epoch_file_list.json", "shards")


def claim_output_dir(out: Path) -> None:
    """Rank 0: make ``out`` and lock it for this run (``<out>/.lock``), so a second run there (a
    rerun while a killed job's orphans still train) cannot interleave checkpoints. The kernel
    drops the lock when the process dies, however it dies; ``lockf``, not ``flock``, which forked
    DataLoader workers would inherit."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot write to --output-dir {out} ({exc.strerror}); choose a "
                              "folder you can write to.") from None
    if not hasattr(os, "lockf"):  # POSIX; elsewhere (Windows) the run goes unlocked
        return
    try:
        os.lockf(fd, os.F_TLOCK, 0)  # the whole file (from offset 0), or OSError if held
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise CheckpointError(f"another training run (pid {holder}) is using --output-dir {out}; "
                              "wait for it or stop it, or use another --output-dir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def resume_path(resume: str, out: Path, eval_weights: bool = False) -> str | None:
    """The checkpoint a run continues from: ``auto`` is ``<out>/checkpoint.pth`` if it exists.
    ``eval_weights``: ``--eval-only --weights FILE`` scores that file, not the folder's run."""
    if eval_weights and resume == "auto":
        return None
    # A restart by torchrun (--max-restarts) continues what this launch began and saved, whatever
    # --resume says: going back to --resume PATH would train its epochs again.
    own = (out / "checkpoint.pth").is_file()
    if resume == "auto" or own and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return str(out / "checkpoint.pth") if own else None
    return None if resume == "none" else resume


def rerun_hint(output_dir: str | os.PathLike, resume: str) -> str:
    """How to continue after a stop, for the last line a stopped run says."""
    out = Path(output_dir)
    if not (out / "checkpoint.pth").is_file():
        return "run the same command again to start"
    last = f"the last complete checkpoint in {out}"
    if resume == "auto":
        return f"run the same command again: it continues from {last}"
    return f"run it again with --resume auto to continue from {last}"


def move_earlier_run(out: Path, resume_from: str | None = None, weights: str | None = None
                     ) -> tuple[str | None, str | None]:
    """Rank 0, unless continuing ``<out>/checkpoint.pth``: an earlier run's files in ``out`` go
    to ``<out>/previous-runs/<time>/``, so nothing saved is overwritten or mixed with this run.
    Returns the ``--resume`` checkpoint and the ``--weights`` file where they are now: one that
    was among the files moved (``--resume <out>/model_best.pth``) is read from its new place."""
    # Paths compared resolved, through links too: runs/latest -> runs/b, best.pth -> ...
    if resume_from and Path(resume_from).resolve() == (out / "checkpoint.pth").resolve():
        return resume_from, weights  # this run goes on: nothing moves
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not {"checkpoint.pth", "model_best.pth", "weights", "metrics.jsonl"} & set(found):
        return resume_from, weights
    aside = out / "previous-runs" / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for name in found:
        (out / name).rename(aside / name)
    log.info("the earlier run's files in %s were moved to %s", out, aside)
    # A path that resolved to one of the files moved is now the same place in aside.
    root, now = out.resolve(), []
    for path in (resume_from, weights):
        full = Path(path).resolve() if path else root
        inside = full.relative_to(root).parts if full.is_relative_to(root) else ()
        now.append(str(aside.joinpath(*inside)) if inside and inside[0] in found else path)
    return now[0], now[1]
