"""Never lose a run: full checkpoints, exact resume, elastic restarts and clean shutdown.

Every test starts the launchers as a user would (torchrun or the spawn launcher, 2 CPU processes
on gloo) and checks what is left on disk and in the process table afterwards. Killed runs are
started in their own session and every process ever seen below them is killed in teardown, so a
failing test leaves nothing behind.

Budget: one uninterrupted 3-epoch torchrun run (``run_a``) is the reference; the interrupted
runs are compared with it tensor for tensor.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import ROOT, TINY_FLAGS, child_env, run, torchrun_cmd
from model import get_model
from multi_train_utils.checkpoint import (CheckpointError, load_file, load_matching_weights,
                                          prune_weights, save_atomic, to_cpu, unwrap)
from multi_train_utils.distributed_utils import DistInfo, find_free_port
from train_common import _build_data, get_args_parser
from utils import find_run_file

LAUNCH = "train_multi_gpu_using_launch.py"
SPAWN = "train_multi_gpu_using_spawn.py"
EPOCHS = 3
COMPARED = ("epoch", "train_loss", "val_acc", "val_loss", "val_top5", "lr")

# In-process runs (train_here) decode with torchvision.io, which warns about its own future.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


# ---------------------------------------------------------------- helpers
def flags(data: Path, out: Path, *extra: str, workers: int = 0) -> list[str]:
    """TINY_FLAGS with another worker count, plus data, output dir and ``extra``."""
    base = list(TINY_FLAGS)
    base[base.index("--workers") + 1] = str(workers)
    return [*base, "--seed", "0", "--data-path", str(data), "--output-dir", str(out), *extra]


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (SO_REUSEADDR, as TCPStore itself does:
    connections in TIME_WAIT do not block a new listener, a live one does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
    return True


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ..., starttime at 19]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


class ProcessTree:
    """A launcher started in its own session, plus every process ever seen below it.

    Processes are identified by (pid, start time) so a recycled pid is never mistaken for ours.
    torchrun puts each worker in a session of its own, so killing the launcher's process group
    is not enough: ``kill_all`` kills every process recorded here.
    """

    def __init__(self, cmd: list[str], log_path: Path, **env: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # a file, not a pipe: a full pipe would stall the run
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(**env), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.root = (self.proc.pid, _stat(self.proc.pid)[19])
        self.seen: dict[tuple[int, str], int] = {}  # (pid, start) -> parent pid

    def refresh(self) -> list[tuple[int, str]]:
        """Record the current descendants; returns them."""
        children: dict[int, list[tuple[int, str]]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
        found, todo = [], [self.proc.pid]
        while todo:
            parent = todo.pop()
            for child in children.get(parent, []):
                self.seen.setdefault(child, parent)
                found.append(child)
                todo.append(child[0])
        return found

    def children(self, pid: int | None = None) -> list[int]:
        """Live direct children of ``pid`` (default: the launcher), oldest first."""
        pid = pid or self.proc.pid
        live = [p for p in self.refresh() if self.seen[p] == pid]
        return [p for p, _ in sorted(live, key=lambda p: (int(p[1]), p[0]))]

    @staticmethod
    def alive(ident: tuple[int, str]) -> bool:
        fields = _stat(ident[0])
        return fields is not None and fields[19] == ident[1] and fields[0] not in "ZX"

    def alive_seen(self) -> list[int]:
        return [pid for pid, start in self.seen if self.alive((pid, start))]

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def fail(self, what: str) -> None:
        pytest.fail(f"{what}\n--- launcher output (tail) ---\n{self.output()[-4000:]}")

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.refresh()
            if self.proc.poll() is not None:
                self.fail(f"the run exited with {self.proc.returncode} before {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)

    def wait_all_gone(self, timeout: float) -> float:
        """Seconds until the launcher and every recorded descendant have exited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is None:
                self.refresh()
            elif not self.alive_seen():
                return time.monotonic() - start
            time.sleep(0.2)
        self.fail(f"still running {timeout:.0f}s after the signal: launcher "
                  f"{'exited' if self.proc.poll() is not None else 'alive'}, "
                  f"descendants alive: {self.alive_seen()}")

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.refresh()
        for pid, start in list(self.seen) + [self.root]:
            if self.alive((pid, start)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=30)
        finally:
            self._log.close()


@pytest.fixture
def launched(tmp_path):
    """``launched(cmd, **env)`` starts a ProcessTree; everything in it is killed at teardown."""
    trees: list[ProcessTree] = []

    def start(cmd: list[str], **env: str) -> ProcessTree:
        tree = ProcessTree(cmd, tmp_path / f"launcher-{len(trees)}.log", **env)
        trees.append(tree)
        return tree

    yield start
    for tree in trees:
        tree.kill_all()


def epochs_done(out: Path, n: int) -> Callable[[], bool]:
    return lambda: len(read_metrics(out)) >= n


# ---------------------------------------------------------------- reference run
@pytest.fixture(scope="module")
def run_a(tiny_data, tmp_path_factory) -> Path:
    """An uninterrupted 3-epoch torchrun run (2 processes, --workers 0): the reference."""
    out = tmp_path_factory.mktemp("run_a")
    result = run(torchrun_cmd(2, LAUNCH, *flags(tiny_data, out, "--epochs", str(EPOCHS))))
    assert result.returncode == 0, result.stderr[-4000:]
    return out


# ---------------------------------------------------------------- 1. checkpoint contents
def test_checkpoint_holds_everything_needed_to_resume(run_a):
    ckpt = load_ckpt(run_a / "checkpoint.pth")
    assert {"model", "optimizer", "lr_scheduler", "epoch", "best_acc", "args", "rng_states",
            "metrics"} <= ckpt.keys()
    assert ckpt["epoch"] == EPOCHS - 1

    # The bare model (no DDP "module." prefix), loadable strictly into a fresh resnet18.
    assert not [k for k in ckpt["model"] if k.startswith(("module.", "_orig_mod."))]
    get_model("resnet18", num_classes=5).load_state_dict(ckpt["model"])

    # SGD with momentum: one buffer per parameter after training; the schedule stepped per epoch.
    n_params = len(list(get_model("resnet18", num_classes=5).parameters()))
    assert len(ckpt["optimizer"]["state"]) == n_params
    assert all("momentum_buffer" in s for s in ckpt["optimizer"]["state"].values())
    assert ckpt["lr_scheduler"]["last_epoch"] == EPOCHS

    assert ckpt["args"]["model"] == "resnet18" and ckpt["args"]["num_classes"] == 5
    assert ckpt["args"]["world_size"] == 2

    # One RNG state per rank, and the ranks' streams differ (seed + rank).
    assert len(ckpt["rng_states"]) == 2
    assert all({"torch", "python", "numpy"} <= s.keys() for s in ckpt["rng_states"])
    assert ckpt["rng_states"][0]["torch"] != ckpt["rng_states"][1]["torch"]

    # The history in the checkpoint is exactly metrics.jsonl, one line per epoch.
    lines = read_metrics(run_a)
    assert [m["epoch"] for m in lines] == list(range(EPOCHS))
    assert ckpt["metrics"] == lines
    assert ckpt["best_acc"] == pytest.approx(max(m["val_acc"] for m in lines))

    # model_best.pth: of the epochs that reached best_acc, the one with the lowest val loss (the
    # first of equals); per-epoch bare weights all kept.
    best = load_ckpt(run_a / "model_best.pth")
    top = [m for m in lines if m["val_acc"] == max(x["val_acc"] for x in lines)]
    assert best["epoch"] == min(top, key=lambda m: m["val_loss"])["epoch"]
    assert best["best_loss"] == pytest.approx(min(m["val_loss"] for m in top), abs=1e-6)
    weights = sorted(p.name for p in (run_a / "weights").iterdir())
    assert weights == [f"model-{e}.pth" for e in range(EPOCHS)]
    last = load_ckpt(run_a / "weights" / f"model-{EPOCHS - 1}.pth")
    assert_same_tensors(last, ckpt["model"])
    first = load_ckpt(run_a / "weights" / "model-0.pth")
    assert not torch.equal(first["fc.weight"], last["fc.weight"])  # it did train


def test_a_cpu_run_on_a_gpu_machine_leaves_the_gpu_alone(monkeypatch, tmp_path):
    """RNG states of a --device cpu run: no CUDA generator (reading it would create a CUDA
    context on GPU 0, which fails on an exclusive or busy GPU), and the round trip through a
    checkpoint file is exact for torch's, Python's and NumPy's generators."""
    import random

    import numpy as np

    from multi_train_utils.checkpoint import capture_rng_state, restore_rng_state

    def no_gpu(*args, **kwargs):
        raise AssertionError("a CPU run touched the GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_gpu)
    state = capture_rng_state(torch.device("cpu"))
    assert "cuda" not in state
    save_atomic({"rng_states": [state]}, tmp_path / "checkpoint.pth")
    drawn = (torch.rand(3), random.random(), np.random.rand(3))
    (state,) = load_ckpt(tmp_path / "checkpoint.pth")["rng_states"]  # weights_only: lists
    restore_rng_state({**state, "cuda": b"from a GPU run"}, torch.device("cpu"))
    again = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(again[0], drawn[0]) and again[1] == drawn[1]
    assert np.array_equal(again[2], drawn[2])


# ---------------------------------------------------------------- 2. atomic save
@pytest.mark.parametrize("crash", [OSError("No space left on device"),
                                   KeyboardInterrupt("SIGTERM")], ids=["disk-full", "signal"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash):
    path = tmp_path / "checkpoint.pth"
    save_atomic({"epoch": 0, "w": torch.arange(4.0)}, path)
    real_save = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)  # half the bytes are on disk when the process dies
        raise crash

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(type(crash)):
        save_atomic({"epoch": 1, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()

    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]  # no temp file left
    ckpt = load_file(path)
    assert ckpt["epoch"] == 0 and torch.equal(ckpt["w"], torch.arange(4.0))

    save_atomic({"epoch": 1}, path)  # and the next save still replaces it
    assert load_file(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_saved_state_is_detached_cpu_tensors_of_the_same_shape():
    """to_cpu is what train_common saves: no tensor keeps its GPU (a laptop could not load it)."""
    weight = torch.ones(2, 3, requires_grad=True)
    state = {"model": {"fc.weight": weight * 2},
             "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(3), "step": 4}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "pair": (torch.arange(2), "x")}
    out = to_cpu(state)
    assert out["model"]["fc.weight"].device == torch.device("cpu")
    assert not out["model"]["fc.weight"].requires_grad  # detached: no autograd graph pickled
    assert torch.equal(out["model"]["fc.weight"], torch.full((2, 3), 2.0))
    assert out["optimizer"]["state"][0]["step"] == 4 and out["optimizer"]["param_groups"] == \
        [{"lr": 0.1, "params": [0]}]
    assert isinstance(out["pair"], tuple) and out["pair"][1] == "x"
    # A module's state dict keeps its type and the versions _load_from_state_dict reads.
    bn_state = nn.BatchNorm2d(3).state_dict()
    copied = to_cpu(bn_state)
    assert type(copied) is type(bn_state) and copied._metadata == bn_state._metadata
    # A state dict may sit on a meta device (or a GPU): to_cpu must move it, not pass it on.
    with pytest.raises(NotImplementedError, match="meta"):
        to_cpu({"w": torch.empty(2, device="meta")})


def test_unwrap_removes_wrappers_not_a_models_own_module():
    class Holder(nn.Module):  # a user's model whose submodule happens to be called "module"
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = Holder()
    assert unwrap(holder) is holder  # its state dict keeps the "module." keys it owns
    assert unwrap(nn.DataParallel(holder)) is holder
    assert unwrap(torch.compile(holder)) is holder


def test_weights_load_by_the_bare_models_names_whatever_wraps_either_side(tmp_path):
    """Only a prefix every key shares is a wrapper's: a model's own submodule called "module"
    loads into itself; and a wrapped model takes the bare names a file holds."""
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module, self.head = nn.Linear(4, 2), nn.Linear(2, 2)

    saved = Holder()
    save_atomic(saved.state_dict(), tmp_path / "w.pth")
    save_atomic({f"_orig_mod.module.{k}": v for k, v in saved.state_dict().items()},
                tmp_path / "wrapped.pth")  # as torch.compile(DDP(model)).state_dict() names them
    for file, into in (("w.pth", Holder()), ("wrapped.pth", Holder()),
                       ("w.pth", torch.compile(Holder()))):
        assert load_matching_weights(into, tmp_path / file) == ([], []), file
        assert torch.equal(unwrap(into).module.weight, saved.module.weight), file
    # EMA weights: AveragedModel keeps its update count beside the "module." tensors
    ema = torch.optim.swa_utils.AveragedModel(saved)
    save_atomic(ema.state_dict(), tmp_path / "ema.pth")
    into = Holder()
    assert load_matching_weights(into, tmp_path / "ema.pth") == (["n_averaged"], [])
    assert torch.equal(into.head.weight, saved.head.weight)
    lone = nn.Sequential()
    lone.module = nn.Linear(4, 2)  # its only child is called "module": every key has it
    save_atomic(lone.state_dict(), tmp_path / "lone.pth")
    again = nn.Sequential()
    again.module = nn.Linear(4, 2)
    assert load_matching_weights(again, tmp_path / "lone.pth") == ([], [])
    assert torch.equal(again.module.weight, lone.module.weight)


def test_a_checkpoint_that_cannot_be_read_says_why(tmp_path, monkeypatch):
    """Not "not a complete zip archive": zipfile.is_zipfile hides the OSError, torch.load not."""
    path = tmp_path / "checkpoint.pth"
    save_atomic({"epoch": 0}, path)

    def unreadable(*args, **kwargs):  # what a permission problem or a failing disk gives
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr("zipfile.is_zipfile", lambda _: False)  # it swallows the same OSError
    monkeypatch.setattr(torch, "load", unreadable)
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    assert str(info.value) == f"{path} cannot be read (Input/output error)."


def test_damaged_bytes_and_foreign_files_are_clear_errors(tmp_path):
    """torch.load does not check the zip CRCs: damaged bytes would load as wrong weights."""
    path = tmp_path / "checkpoint.pth"
    save_atomic({"epoch": 0, "w": torch.arange(100_000.0)}, path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 1000] = bytes(1000)
    path.write_bytes(data)
    torch.load(path, weights_only=True)  # what torch alone does: no error
    with pytest.raises(CheckpointError, match=r"is corrupt \(.* fails its CRC check\)"):
        load_file(path)
    path.write_bytes(os.urandom(4000))
    with pytest.raises(CheckpointError, match="not a complete zip archive") as info:
        load_file(path)
    assert "weights_only" not in str(info.value)  # torch's hint to load unsafely: not for this


@pytest.mark.parametrize("cut", [300, -100, -10])
def test_truncated_checkpoint_is_a_clear_error(tmp_path, cut):
    """Cut near its end, torch.load raised OSError(EINVAL) ("cannot be read (Invalid
    argument)", which sounds like a disk or permission problem)."""
    path = tmp_path / "checkpoint.pth"
    torch.save({"epoch": 0, "w": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    assert str(info.value) == (f"{path} is not a readable PyTorch checkpoint (not a complete zip "
                               "archive: truncated, corrupt or another format).")


# ---------------------------------------------------------------- 3 + 7a. SIGTERM, then resume
@pytest.fixture(scope="module")
def sigterm_run(tiny_data, tmp_path_factory):
    """torchrun (fixed rendezvous port, --workers 2, --keep-last 1) stopped by SIGTERM in epoch 1.

    Returns what the shutdown left: timings, exit code, output, the snapshot of processes and
    the command, which ``test_resume_*`` runs again.
    """
    out = tmp_path_factory.mktemp("run_b")
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=resume-test",
           LAUNCH, *flags(tiny_data, out, "--epochs", str(EPOCHS), "--keep-last", "1", workers=2)]
    tree = ProcessTree(cmd, out.parent / f"{out.name}-leg1.log")
    try:
        tree.wait_for(epochs_done(out, 1), "epoch 0's checkpoint")
        # 2 trainers, each with 2 persistent train + 2 persistent val DataLoader workers.
        tree.wait_for(lambda: len(tree.refresh()) >= 10, "the DataLoader workers", timeout=60)
        time.sleep(1.0)  # into epoch 1
        snapshot = [p for p in tree.refresh() if tree.alive(p)]
        tree.proc.send_signal(signal.SIGTERM)
        seconds = tree.wait_all_gone(timeout=90)
        free = port_is_free(port)
        yield dict(out=out, cmd=cmd, port=port, seconds=seconds, snapshot=snapshot,
                   returncode=tree.proc.returncode, free=free, output=tree.output())
    finally:
        tree.kill_all()


def test_sigterm_to_torchrun_stops_every_process_cleanly(sigterm_run):
    r = sigterm_run
    assert len(r["snapshot"]) >= 10, "DataLoader workers were running when the signal came"
    assert r["seconds"] < 60, f"shutdown took {r['seconds']:.0f}s"
    assert r["returncode"] != 0
    # Rank 0 unwound through its SIGTERM handler (not torchrun's SIGKILL after 30 s).
    assert "interrupted by SIGTERM" in r["output"], r["output"][-3000:]
    # The loader workers got torchrun's SIGTERM too; their deaths are expected, not an error.
    assert "DataLoader worker" not in r["output"], r["output"][-3000:]
    assert "OSError" not in r["output"], r["output"][-3000:]
    assert r["free"], f"rendezvous port {r['port']} still in use after the run ended"
    ckpt = load_ckpt(r["out"] / "checkpoint.pth")  # intact: the last save was atomic
    assert ckpt["epoch"] in (0, 1)
    assert [m["epoch"] for m in ckpt["metrics"]] == list(range(ckpt["epoch"] + 1))


def test_resume_after_sigterm_matches_uninterrupted_run(sigterm_run, run_a):
    """Same command again (same port, --workers 2): the result equals run A (--workers 0)
    tensor for tensor, and each epoch is in metrics.jsonl exactly once with A's numbers."""
    out = sigterm_run["out"]
    result = run(sigterm_run["cmd"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stderr

    ours, reference = read_metrics(out), read_metrics(run_a)
    assert [m["epoch"] for m in ours] == list(range(EPOCHS))
    assert [{k: m[k] for k in COMPARED} for m in ours] == \
           [{k: m[k] for k in COMPARED} for m in reference]

    final, ref = load_ckpt(out / "checkpoint.pth"), load_ckpt(run_a / "checkpoint.pth")
    assert final["epoch"] == EPOCHS - 1
    assert_same_tensors(final["model"], ref["model"])
    for a, b in zip(final["optimizer"]["state"].values(), ref["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    # --keep-last 1: only the newest per-epoch weights remain.
    assert sorted(p.name for p in (out / "weights").iterdir()) == [f"model-{EPOCHS - 1}.pth"]


# ---------------------------------------------------------------- 4. wrong --resume files
def test_resume_from_text_file_is_one_error_line(tiny_data, tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not a checkpoint\n")
    argv = flags(tiny_data, tmp_path / "out", "--resume", str(bogus))
    result = run([sys.executable, LAUNCH, *argv], timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(bogus) in errors[0], result.stderr[-3000:]
    assert "not a readable PyTorch checkpoint" in errors[0]


@pytest.fixture
def train_here(monkeypatch, capfd):
    """Run ``train_common.train`` in this process as one process (no launcher): returns
    (exit code, stderr). Logging, signal handlers and thread count are restored afterwards."""
    import train_common

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT",
                "SLURM_RESTART_COUNT", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, signal.getsignal(signal.SIGTERM),
             signal.getsignal(signal.SIGINT))

    def call(argv: list[str]) -> tuple[int, str]:
        capfd.readouterr()
        args = train_common.get_args_parser().parse_args(argv)
        code = 0
        try:
            train_common.train(args)
        except SystemExit as exc:  # anything else would be a traceback for the user
            code = exc.code
        return code, capfd.readouterr().err

    yield call
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    signal.signal(signal.SIGTERM, saved[2])
    signal.signal(signal.SIGINT, saved[3])


def _three_class_copy(data: Path, dest: Path) -> Path:
    for folder in sorted(p for p in data.iterdir() if p.is_dir())[:3]:
        shutil.copytree(folder, dest / folder.name)
    return dest


@pytest.mark.parametrize("case", ["bare-state-dict", "other-model-args", "other-classes-args",
                                  "renamed-class", "other-model-no-args", "other-classes-no-args"])
def test_resume_from_unusable_checkpoint_exits_2(case, run_a, tiny_data, tmp_path, train_here):
    data, extra = tiny_data, []
    path = tmp_path / "given.pth"
    if case == "bare-state-dict":
        shutil.copy(run_a / "weights" / "model-0.pth", path)
        expect = "--weights"
    elif case == "other-model-args":  # our own checkpoint, another --model
        shutil.copy(run_a / "checkpoint.pth", path)
        extra, expect = ["--model", "resnet34"], "--model resnet18"
    elif case == "other-classes-args":  # our own checkpoint (5 classes), a 3-class dataset
        shutil.copy(run_a / "checkpoint.pth", path)
        data = _three_class_copy(tiny_data, tmp_path / "three")
        expect = "classes daisy, dandelion, roses, sunflowers, tulips but the data has daisy, "
    elif case == "renamed-class":  # 5 classes again, but the labels would shift by one
        shutil.copy(run_a / "checkpoint.pth", path)
        data = tmp_path / "renamed"
        shutil.copytree(tiny_data, data)
        (data / "tulips").rename(data / "a_tulips")
        expect = ("the data has a_tulips, daisy, dandelion, roses, sunflowers (not in the data: "
                  "tulips; new: a_tulips)")
    elif case == "other-model-no-args":  # a checkpoint without recorded args: shapes decide
        torch.save({"model": get_model("resnet34", num_classes=5).state_dict(), "epoch": 0}, path)
        expect = "resnet18"
    else:
        torch.save({"model": get_model("resnet18", num_classes=3).state_dict(), "epoch": 0}, path)
        expect = "fc."
    argv = flags(data, tmp_path / "out", "--resume", str(path), *extra)
    code, err = train_here(argv)
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(path) in errors[0] and expect in errors[0], err[-3000:]
    # Refused before anything was written: no half-started run beside the checkpoint.
    assert not any(p.is_file() and p.name != ".lock" for p in (tmp_path / "out").rglob("*"))


def test_a_platform_without_sigchld_statvfs_or_fcntl_trains_and_resumes(tmp_path, tiny_data,
                                                                        train_here, monkeypatch):
    """Windows has no SIGCHLD, os.statvfs or fcntl: a plain single-process run must still train,
    save (its saves swap the SIGCHLD handler) and resume, the output folder merely unlocked.
    (Loader workers stay off: torch's own DataLoader needs SIGCHLD on Linux.)"""
    import train_common
    monkeypatch.delattr(signal, "SIGCHLD")
    monkeypatch.setattr(train_common, "SIGCHLD", None)  # as read at import there
    monkeypatch.delattr(os, "statvfs")
    monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl raises ImportError
    assert train_common.shm_space() is None
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "1"))
    assert code == 0, err[-3000:]
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 0, err[-3000:]
    assert "resumed from" in err and "Traceback" not in err, err[-3000:]
    assert f"could not lock --output-dir {out} (" in err
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]


def test_resume_none_starts_fresh(run_a, tmp_path, tiny_data, train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)  # a finished 3-epoch run is there
    old_events = out / "tensorboard" / "steps" / "events.out.tfevents.1.host.1.0"
    old_events.parent.mkdir(parents=True)
    old_events.write_bytes(b"curves of the earlier run")
    code, err = train_here(flags(tiny_data, out, "--resume", "none", "--epochs", "1",
                                 "--batch-size", "16"))
    assert code == 0, err[-3000:]
    assert "resumed from" not in err
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == 0 and [m["epoch"] for m in ckpt["metrics"]] == [0]
    assert ckpt["args"]["batch_size"] == 16
    # Nothing of the earlier run is left to mix with this one (its epochs 1 and 2, its best
    # model, its TensorBoard curves): set aside at the start, gone once epoch 0 was saved.
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["model-0.pth"]
    assert load_ckpt(out / "model_best.pth")["epoch"] == 0
    assert not old_events.exists() and not (out / ".previous-run").exists()
    assert (f"starting afresh in {out}: the earlier run's 5 checkpoint/weight file(s) and 1 "
            "TensorBoard log(s) are moved to .previous-run, and deleted once this run saves its "
            "first epoch") in err


def test_resume_none_stopped_before_its_first_save_loses_nothing(run_a, tmp_path, tiny_data,
                                                                 train_here, monkeypatch):
    """A --resume none (a typo, the wrong folder) stopped before it saved anything: the run it
    would replace is still whole, the original command says how to get it back, and then
    continues it."""
    import train_common

    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    monkeypatch.setattr(train_common, "train_one_epoch", lambda *a, **k: os.kill(
        os.getpid(), signal.SIGINT) or time.sleep(5))
    code, err = train_here(flags(tiny_data, out, "--resume", "none"))
    monkeypatch.undo()
    assert code == 130, err[-3000:]
    aside = out / ".previous-run"
    assert (f"The earlier run that --resume none replaces is still in {aside}; move its files "
            f"back into {out} to keep it.") in err
    assert not (out / "checkpoint.pth").exists()

    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS)))  # the original command
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and (f"the run that an interrupted --resume none moved aside is in "
                                 f"{aside}: continue it with `cp -r {aside}/. {out}/ && rm -r "
                                 f"{aside}`") in errors[0], err[-3000:]
    subprocess.run(f"cp -r {aside}/. {out}/ && rm -r {aside}", shell=True, check=True)
    for name in ("class_indices.json", "args.json", "metrics.jsonl"):  # its record, too
        assert (out / name).read_bytes() == (run_a / name).read_bytes(), name
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS)))
    assert code == 0, err[-3000:]
    assert f"holds epochs 0-{EPOCHS - 1}, so --epochs {EPOCHS} leaves nothing to train" in err
    assert [m["epoch"] for m in read_metrics(out)] == list(range(EPOCHS))
    assert_same_tensors(load_ckpt(out / "checkpoint.pth")["model"],
                        load_ckpt(run_a / "checkpoint.pth")["model"])


def test_resume_none_keeps_the_weights_file_it_starts_from(run_a, tmp_path, tiny_data,
                                                           train_here):
    """The way out the corrupt-checkpoint error names: --resume none --weights
    DIR/weights/model-N.pth in that same folder. That file must not go with the earlier run."""
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    start = out / "weights" / "model-2.pth"
    code, err = train_here(flags(tiny_data, out, "--resume", "none", "--weights", str(start),
                                 "--epochs", "1"))
    assert code == 0, err[-3000:]
    assert f"loaded {start} into --model resnet18: 122 of the model's 122 tensors" in err
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["model-0.pth", "model-2.pth"]
    original = (run_a / "weights" / "model-2.pth").read_bytes()
    assert start.read_bytes() == original
    assert load_ckpt(out / "checkpoint.pth")["epoch"] == 0
    # This run saves its own model-2.pth at epoch 2: the original is kept, with its run's files.
    kept = out / "started_from" / "weights" / "model-2.pth"
    assert (f"--weights {start} is a file this run saves its own over: the original is kept as "
            f"{kept}, with its run's class_indices.json and args.json") in err
    assert kept.samefile(start)  # a hard link: no copy of the bytes
    for name in ("class_indices.json", "args.json"):
        assert (kept.parent.parent / name).read_bytes() == (run_a / name).read_bytes()
    # Until then a rerun (one stopped before its first save) reads the kept run's files for
    # it, not those this run wrote beside it.
    assert find_run_file(start, "args.json") == kept.parent.parent / "args.json"
    assert json.loads((out / "args.json").read_text())["resume"] == "none"
    code, err = train_here(flags(tiny_data, out, "--weights", str(start), "--epochs", "3"))
    assert code == 0 and load_ckpt(out / "checkpoint.pth")["epoch"] == 2, err[-3000:]
    assert start.read_bytes() != original and kept.read_bytes() == original
    assert find_run_file(start, "args.json") == out / "args.json"  # now this run's own


class _SignalsMidWrite:
    """A file that sends this process ``signum`` once its first bytes are written (what a kill
    in the middle of ``torch.save`` looks like to the writer)."""

    def __init__(self, f, signum: int) -> None:
        self.f, self.signum, self.sent = f, signum, False

    def write(self, data) -> int:
        n = self.f.write(data)
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)
        return n

    def flush(self) -> None:
        self.f.flush()


def test_signal_during_checkpoint_write_lets_the_epoch_finish_saving(tmp_path, tiny_data,
                                                                     train_here, monkeypatch):
    """SIGTERM in the middle of writing epoch 0's checkpoint: the files are completed, then the
    run stops with 143 and says so; the rerun resumes from epoch 0 as if nothing happened.
    (Raised inside torch.save the interrupt would break its zip writer: "unexpected pos".)"""
    out = tmp_path / "out"
    real_save = torch.save
    hit = []

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj and not hit:  # the first full checkpoint
            hit.append(obj["epoch"])
            f = _SignalsMidWrite(f, signal.SIGTERM)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    monkeypatch.setattr(torch, "save", real_save)
    assert hit == [0]
    assert code == 143, err[-3000:]
    assert "SIGTERM arrived while the checkpoint was written" in err, err[-3000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    ckpt = load_file(out / "checkpoint.pth")
    assert ckpt["epoch"] == 0
    assert_same_tensors(load_file(out / "weights" / "model-0.pth"), ckpt["model"])
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    assert not list(out.rglob(".*.tmp"))

    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 0, err[-3000:]
    assert "resumed from" in err and "epoch 0 done" in err, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]


class _SignalsTwiceMidWrite(_SignalsMidWrite):
    """Ctrl-C, then Ctrl-C again, while torch.save writes (a terminal sends both to every rank
    of the spawn launcher, which share its process group)."""

    def write(self, data) -> int:
        n = self.f.write(data)
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)  # held until the save is done ...
            os.kill(os.getpid(), self.signum)  # ... the second one is not: it breaks the writer
        return n


def test_a_second_ctrl_c_inside_torch_save_is_an_interrupt_not_a_traceback(tmp_path, tiny_data,
                                                                           train_here,
                                                                           monkeypatch):
    """torch's zip writer turns the KeyboardInterrupt into "RuntimeError: unexpected pos"; the
    run must still stop as interrupted (130, one line) with epoch 0's checkpoint intact."""
    out = tmp_path / "out"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("epoch") == 1 and "optimizer" in obj:
            f = _SignalsTwiceMidWrite(f, signal.SIGINT)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    monkeypatch.setattr(torch, "save", real_save)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "unexpected pos" not in err, err[-3000:]
    assert (f"interrupted by SIGINT; run the same command again: it continues from the last "
            f"complete checkpoint in {out}.") in err
    assert "[epoch 1]" in err  # the epoch is reported before its save, even if that is stopped
    assert load_file(out / "checkpoint.pth")["epoch"] == 0
    assert not list(out.rglob(".*.tmp"))


def test_a_peer_lost_after_a_signal_is_reported_as_the_interrupt(tmp_path, tiny_data,
                                                                  train_here, monkeypatch):
    """SIGTERM to the whole group while a save holds it here: the other rank stops at once and
    this rank's next collective fails. The cause is the signal, not a lost machine."""
    import train_common

    def run(args, info):
        with train_common._signals_held():
            os.kill(os.getpid(), signal.SIGTERM)  # held: this rank finishes its save
            raise RuntimeError("[/src/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                               "[127.0.0.1]:4242")  # the peer already stopped
    monkeypatch.setattr(train_common, "_run", run)
    code, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert code == 143, err[-3000:]
    assert "interrupted by SIGTERM before the first epoch was saved" in err, err[-3000:]
    assert "lost contact" not in err and "Traceback" not in err


def one_error_line(script: str, data: Path, out: Path) -> tuple[str, str]:
    """Run ``script`` on training flags with one loader worker, in a process of its own (a
    worker's death is signalled to that process, as in a real run): it must exit 1 with one
    error line and no traceback. Returns that line and the whole stderr."""
    result = run([sys.executable, "-c", script, *flags(data, out, workers=1)], timeout=120,
                 PYTHONPATH=str(ROOT))
    assert result.returncode == 1, result.stderr[-3000:] + result.stdout[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0], result.stderr


def test_a_killed_loader_worker_is_one_line_with_the_likely_cause(tmp_path, tiny_data):
    """The OOM killer takes a DataLoader worker: torch raises "DataLoader worker (pid N) is
    killed by signal: Killed." wherever the rank happens to be (from its SIGCHLD handler, e.g.
    inside a collective): one line with the likely cause, not a traceback wall. (In a process of
    its own: the death is signalled to that process, as in a real run.)"""
    script = textwrap.dedent("""
        import os, signal, sys, time
        import train_common
        from train_multi_gpu_using_launch import get_args_parser
        def killing(model, optimizer, data_loader, *args, **kwargs):
            batches = iter(data_loader)
            next(batches)
            os.kill(batches._workers[0].pid, signal.SIGKILL)
            for _ in range(600):  # the next batches, or a sleep, meet the death
                next(batches, None)
                time.sleep(0.1)
            print("THE DEATH WAS NEVER NOTICED", flush=True)
        train_common.train_one_epoch = killing
        train_common.train(get_args_parser().parse_args(sys.argv[1:]))
    """)
    error, stderr = one_error_line(script, tiny_data, tmp_path / "out")
    # Which words torch uses depends on which of its checks sees the death first.
    assert re.search(r"error: DataLoader worker \(pid(\(s\))? \d+\) (is killed by signal: Killed|"
                     r"exited unexpectedly) - most often the out-of-memory killer \(see dmesg\): "
                     r"lower --workers or --batch-size, or give the job more memory \(a crash in "
                     r"native code shows its own error with --workers 0\)\. Run the same command "
                     r"again: it continues from the start\.", error), error


SHM_FAILING = textwrap.dedent("""
    import os, sys, torch
    import train_common
    from train_multi_gpu_using_launch import get_args_parser
    from torch.utils.data import get_worker_info
    def failing(share):  # torch's words (SHM_ERROR) as it shares a tensor
        def share_here(*args, **kwargs):
            if os.environ["SHM_FAILS"] == "in workers" and get_worker_info() is None:
                return share(*args, **kwargs)  # e.g. the dataset's counters, made before training
            raise RuntimeError(os.environ["SHM_ERROR"])
        return share_here
    storage = torch.UntypedStorage
    storage._share_fd_cpu_ = failing(storage._share_fd_cpu_)
    storage._new_using_fd_cpu = classmethod(failing(storage._new_using_fd_cpu))
    if "SHM_FREE" in os.environ:
        train_common.shm_space = lambda path=None: (64 * 2**20, int(os.environ["SHM_FREE"]))
    train_common.train(get_args_parser().parse_args(sys.argv[1:]))
""")
SHM_READ_ONLY = ("unable to open shared memory object </torch_1_2_3> in read-write mode: "
                 "Read-only file system (30)")


def test_a_full_dev_shm_stops_the_run_with_one_line_instead_of_hanging(tmp_path, tiny_data,
                                                                        monkeypatch):
    """Docker's 64 MB /dev/shm fills: a worker cannot put its batch into shared memory. Built
    in private memory, the batch was moved there by the worker queue's feeder thread, which only
    printed the error: training waited for the batch forever (seen: 2 processes at 224 px,
    batch 32). Every tensor a worker shares fails here, as when /dev/shm is full."""
    monkeypatch.setenv("SHM_FAILS", "in workers")
    monkeypatch.setenv("SHM_FREE", "0")
    monkeypatch.setenv("SHM_ERROR", "unable to allocate shared memory(shm) for file "
                                    "</torch_1_2_3>: No space left on device (28)")
    error, stderr = one_error_line(SHM_FAILING, tiny_data, tmp_path / "out")
    batch = 4 * 3 * 32 * 32  # TINY_FLAGS: batch 4 at 32 px, uint8
    how = f"1 process(es) x 1 worker(s) x 4 batch(es) of {batch // 1024} KiB"
    assert error.endswith(
        f"error: out of shared memory (/dev/shm: 64 MiB, 0 KiB free; this machine's DataLoader "
        f"workers may keep up to {4 * batch // 1024} KiB of batches there: {how}); in a "
        "container give it more (docker run --shm-size=1g, or --ipc=host; Kubernetes: an emptyDir "
        "volume with medium Memory at /dev/shm), or lower --workers or --batch-size. Run the same "
        "command again: it continues from the start."), error
    # Said before training too, with the same count, once /dev/shm has less free than that.
    assert f"/dev/shm has 0 KiB free, but this machine's DataLoader workers may keep up to " \
           f"{4 * batch // 1024} KiB of batches there ({how})" in stderr


def test_a_batch_the_workers_never_send_stops_the_run_instead_of_hanging(tmp_path, tiny_data):
    """A worker's queue sends each batch from a thread that only prints its errors (at a pids
    limit of 24: "can't start new thread" while passing the batch's shared memory), and the
    loader waited forever. A worker stuck on one batch stands in for the lost one."""
    script = textwrap.dedent("""
        import sys, time
        import train_common
        from my_dataset import MyDataSet
        from train_multi_gpu_using_launch import get_args_parser
        from torch.utils.data import get_worker_info
        train_common.LOADER_TIMEOUT_S = 2
        real = MyDataSet.__getitem__
        def stuck(self, item):
            if get_worker_info() is not None:
                time.sleep(3600)
            return real(self, item)
        MyDataSet.__getitem__ = stuck
        train_common.train(get_args_parser().parse_args(sys.argv[1:]))
    """)
    error, _ = one_error_line(script, tiny_data, tmp_path / "out")
    assert error.endswith(
        "error: the DataLoader workers sent no batch in 2 s: one was lost (its worker's own error "
        "is above: often a process, thread or open-file limit, or shared memory, met while "
        "sending it), or reading one batch takes that long (a hung network file system). Run the "
        "same command again: it continues from the start."), error


def test_a_worker_that_cannot_start_its_fd_sharing_thread_stops_the_run(tmp_path, tiny_data):
    """At a pids limit of 24 the worker's resource sharer (which passes each batch's shared
    memory) got an address but no thread: the training process connected and waited for an
    answer forever, inside the queue's get, where the loader's timeout does not reach."""
    script = textwrap.dedent("""
        import sys, threading
        import train_common
        from multiprocessing import resource_sharer
        from train_multi_gpu_using_launch import get_args_parser
        from torch.utils.data import get_worker_info
        real, serve = threading.Thread.start, resource_sharer._ResourceSharer._serve
        def start(self):
            if get_worker_info() is not None and getattr(self, "_target", None) is not None \\
                    and getattr(self._target, "__func__", None) is serve:
                raise RuntimeError("can't start new thread")  # the process limit, there only
            return real(self)
        threading.Thread.start = start
        train_common.train(get_args_parser().parse_args(sys.argv[1:]))
    """)
    error, _ = one_error_line(script, tiny_data, tmp_path / "out")
    # (no cgroup counted a refusal here: the usual suspects are named)
    assert "error: could not start a thread (can't start new thread): most often a limit on " \
           "processes and threads" in error, error


SHM_UNUSABLE = ("error: DataLoader workers cannot use shared memory (/dev/shm: Read-only file "
                "system), which they pass every batch through; make it a writable tmpfs (docker: "
                "no read-only mount, --shm-size=1g or --ipc=host; Kubernetes: an emptyDir volume "
                "with medium Memory at /dev/shm), or train with --workers 0 (slower: images are "
                "then loaded by the training process).")


def test_a_read_only_dev_shm_is_said_so_and_training_without_workers_needs_none(
        tmp_path, tiny_data, train_here, monkeypatch):
    """A read-only (or absent) /dev/shm was called "out of shared memory" with all of it free
    (or, as multiprocessing met it first, an OSError traceback), and --workers 0 did not help:
    the dataset put its counters there even without workers. Now it is found before training,
    before any worker starts (so this runs in-process)."""
    def read_only(*args, **kwargs):
        raise RuntimeError(SHM_READ_ONLY)
    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", read_only)
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", read_only)
    code, err = train_here(flags(tiny_data, tmp_path / "w", workers=1))
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert errors[0].endswith(SHM_UNUSABLE) and "Traceback" not in err, errors
    out = tmp_path / "no-workers"
    code, err = train_here(flags(tiny_data, out, "--epochs", "1"))
    assert code == 0, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0]


def test_dev_shm_turning_read_only_during_training_is_not_called_full(tmp_path, tiny_data,
                                                                       monkeypatch):
    monkeypatch.setenv("SHM_FAILS", "in workers")
    monkeypatch.setenv("SHM_ERROR", SHM_READ_ONLY)
    error, _ = one_error_line(SHM_FAILING, tiny_data, tmp_path / "out")
    assert error.endswith(f"{SHM_UNUSABLE} Run the same command again: it continues from the "
                          "start."), error


PROCESS_LIMIT = ("this machine's limit on processes and threads was reached (a container's pids "
                 "limit: docker run --pids-limit, Kubernetes' pod pids limit; or ulimit -u): lower "
                 "--workers (each DataLoader worker is a process with threads of its own) or raise "
                 "the limit. Run the same command again: it continues from the start.")
OPEN_FILES = ("error: too many open files (this process may open {nofile}: ulimit -n); raise the "
              "limit (ulimit -n 65536; docker run --ulimit nofile=65536) or lower --workers. Run "
              "the same command again: it continues from the start.")
WORKER_EXITED = ("DataLoader worker (pid 4242) exited unexpectedly with exit code 1. Details are "
                 "lost due to multiprocessing. Rerunning with num_workers=0 may give better error "
                 "trace.")


@pytest.mark.parametrize("raised, hit, want", [
    # A worker that cannot start a thread it needs exits with code 1: the pids counter says why.
    (RuntimeError(WORKER_EXITED), "pids", "error: DataLoader worker (pid 4242) exited "
     "unexpectedly with exit code 1 - " + PROCESS_LIMIT),
    (RuntimeError(WORKER_EXITED), "oom_kill", "error: DataLoader worker (pid 4242) exited "
     "unexpectedly with exit code 1 - the out-of-memory killer stopped a process at this "
     "container's memory limit: lower --workers or --batch-size, or give the job more memory. "
     "Run the same command again: it continues from the start."),
    (RuntimeError(WORKER_EXITED), None, "error: DataLoader worker (pid 4242) exited unexpectedly "
     "with exit code 1 - most often the out-of-memory killer (see dmesg)"),
    (RuntimeError("can't start new thread"), "pids",
     "error: could not start a thread (can't start new thread): " + PROCESS_LIMIT),
    (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), "pids",
     "error: could not start a process (Resource temporarily unavailable): " + PROCESS_LIMIT),
    # no refusal counted: ulimit -u, or no memory for the thread's stack
    (RuntimeError("can't start new thread"), None, "error: could not start a thread (can't "
     "start new thread): most often a limit on processes and threads (a container's pids limit"),
    (OSError(errno.EMFILE, "Too many open files"), None, OPEN_FILES),
    # torch's words for EMFILE met by the loader, and its shared memory's: not "out of shared
    # memory"
    (RuntimeError("Too many open files. Communication with the workers is no longer possible. "
                  "Please increase the limit using `ulimit -n` in the shell or change the sharing "
                  "strategy by calling `torch.multiprocessing.set_sharing_strategy('file_system')`"
                  " at the beginning of your code"), None, OPEN_FILES),
    (RuntimeError("unable to open shared memory object </torch_1_2_3> in read-write mode: Too "
                  "many open files (24)"), None, OPEN_FILES),
])
def test_a_process_or_file_limit_met_by_the_loaders_is_one_line_with_its_cause(
        raised, hit, want, tmp_path, tiny_data, train_here, monkeypatch):
    """A container's pids limit (or ulimit -u/-n) met as the loaders start their workers: a
    traceback, or a worker that "exited unexpectedly" blamed on the out-of-memory killer."""
    import resource

    import train_common

    hits = {"pids": 3, "oom_kill": 1}

    def fails(args, info):
        if hit:
            hits[hit] += 1  # the cgroup counted the refusal (or the kill)
        raise raised
    monkeypatch.setattr(train_common, "cgroup_limit_hits", lambda: dict(hits))
    monkeypatch.setattr(train_common, "_run", fails)
    code, err = train_here(flags(tiny_data, tmp_path / "out", workers=2))
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    want = want.format(nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    assert want in errors[0], errors[0]
    assert hit == "oom_kill" or "out-of-memory killer stopped a process" not in err


OOM_KILLED = ("meanwhile the out-of-memory killer stopped a process at this container's memory "
              "limit, most often why: lower --workers or --batch-size, or give the job more memory")


@pytest.mark.parametrize("raised, rank, code, want", [
    # torchrun stops the others with SIGTERM; rank 0 said only "interrupted by SIGTERM"
    (KeyboardInterrupt("SIGTERM"), 0, 143, f"interrupted by SIGTERM ({OOM_KILLED}) before the "
                                           "first epoch was saved"),
    # rank 0 was the one killed: the others, silent on a stop signal, say it
    (KeyboardInterrupt("SIGTERM"), 1, 143, f"[rank 1] interrupted by SIGTERM ({OOM_KILLED})"),
    # or gloo sees the peer's socket close first (measured: a 1400M memory cgroup, 2 ranks)
    (RuntimeError("Read error [127.0.0.1]:28566: Connection reset by peer"), 0, 1,
     "error: lost contact with the other processes of the run (Read error [127.0.0.1]:28566: "
     f"Connection reset by peer); {OOM_KILLED}. Run the same command again"),
])
def test_a_rank_killed_for_memory_is_named_by_the_ranks_it_leaves(raised, rank, code, want,
                                                                  tmp_path, tiny_data,
                                                                  train_here, monkeypatch):
    import train_common
    from multi_train_utils.distributed_utils import DistInfo

    hits = {"pids": 0, "oom_kill": 2}
    # A rank of 2, as the group left it (the process group itself is not needed here).
    monkeypatch.setattr(train_common, "init_distributed_mode",
                        lambda **kwargs: DistInfo(rank=rank, local_rank=rank, world_size=2,
                                                  backend="gloo"))

    def fails(args, info):
        hits["oom_kill"] += 1  # a process of this container was killed
        raise raised
    monkeypatch.setattr(train_common, "cgroup_limit_hits", lambda: dict(hits))
    monkeypatch.setattr(train_common, "_run", fails)
    got, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert got == code and want in err, err[-3000:]


@pytest.mark.parametrize("reason, want", [
    # rank 0 died while scanning (at a pids limit of 20: its scan threads were refused)
    ("Connection closed by peer [127.0.0.1]:4242", "[rank 1] error: lost contact with the other "
     "processes of the run while waiting for rank 0 to scan {root} (Connection closed by peer "
     "[127.0.0.1]:4242): it stopped - its own output says why."),
    # rank 0 may be scanning still: a big folder and a short --dist-timeout
    ("Socket Timeout", "[rank 1] error: lost contact with the other processes of the run while "
     "waiting for rank 0 to scan {root} (Socket Timeout); if it was still scanning, the scan "
     "takes longer than --dist-timeout: raise it, or pass --no-verify-images for a faster scan."),
])
def test_a_rank_that_loses_rank_0_during_the_scan_says_whether_it_died(
        reason, want, tmp_path, tiny_data, train_here, monkeypatch):
    """Rank 0 that died in its scan was said to be, perhaps, still scanning."""
    import train_common
    from multi_train_utils.distributed_utils import DistInfo

    monkeypatch.setattr(train_common, "init_distributed_mode",
                        lambda **kwargs: DistInfo(rank=1, local_rank=1, world_size=2,
                                                  backend="gloo"))

    def broadcast(obj):  # gloo's words when rank 0 is gone, or silent
        raise torch.distributed.DistNetworkError(reason)
    monkeypatch.setattr(train_common, "broadcast_object", broadcast)
    monkeypatch.setattr(train_common, "_run", lambda args, info: train_common._scan_on_rank0(
        str(tiny_data), True, info, 2))
    code, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert code == 1 and want.format(root=tiny_data) in err, err[-3000:]


def test_the_scan_of_rank_0_hands_an_open_file_limit_to_every_rank(tmp_path, train_here,
                                                                   tiny_data, monkeypatch):
    """Out of file descriptors, the header check called good images unreadable and left them
    out (at ulimit -n 32). The error is the machine's: every rank stops with the limit named."""
    def no_descriptors(path, *args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr("my_dataset.Image.open", no_descriptors)
    code, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: too many open files (this process may open" in errors[0]
    assert "not a readable image" not in err and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_worker_killed_by_sigbus_is_said_to_lack_shared_memory(tmp_path, tiny_data, train_here,
                                                                 monkeypatch):
    """torch's words when /dev/shm runs out as a worker writes its batch (SIGBUS): the fix is
    more shared memory, not the out-of-memory killer's advice."""
    import train_common

    def run(args, info):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. It is "
                           "possible that dataloader's workers are out of shared memory. Please "
                           "try to raise your shared memory limit.")
    monkeypatch.setattr(train_common, "_run", run)
    monkeypatch.setattr(train_common, "shm_space", lambda path=None: (64 * 2**20, 3 * 2**20))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks on this machine share /dev/shm
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--img-size", "224",
                                 "--batch-size", "64", workers=8))
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "out-of-memory killer" not in err, err[-3000:]
    # 8 x 8 x 4 batches of 64 x 3 x 224 x 224 bytes = 2352 MiB: 4 GiB asked for, with room
    assert ("error: out of shared memory (/dev/shm: 64 MiB, 3.0 MiB free; this machine's "
            "DataLoader workers may keep up to 2352 MiB of batches there: 8 process(es) x 8 "
            "worker(s) x 4 batch(es) of 9.2 MiB); in a container give it more (docker run "
            "--shm-size=4g, or --ipc=host;") in errors[0], errors[0]


def test_shared_memory_need_counts_every_rank_and_the_batches_each_worker_keeps(monkeypatch):
    """On CPU a worker's finished batches wait in /dev/shm until training takes them (up to the
    prefetch factor, 4); on CUDA the pin-memory thread copies each out as it comes. The ranks of
    one machine share it: torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks per node."""
    from train_common import shm_use

    for key in ("LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    batch = 16 * 3 * 64 * 64
    assert shm_use(16, 64, 2, torch.device("cpu")) == (
        2 * 4 * batch, "1 process(es) x 2 worker(s) x 4 batch(es) of 192 KiB")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    assert shm_use(16, 64, 2, torch.device("cuda", 1))[0] == 4 * 2 * 1 * batch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert shm_use(16, 64, 2, torch.device("cpu"))[0] == 3 * 2 * 4 * batch


def test_a_worker_dying_during_a_save_does_not_break_the_save():
    """torchrun's SIGTERM reaches the DataLoader workers a moment before their rank: torch's
    SIGCHLD handler raised inside torch.save ("unexpected pos", the epoch's file lost, a traceback
    instead of "interrupted by SIGTERM"; seen once in a full-suite run). During a save it is left
    out; after it, torch's handler is back and the death is still noticed."""
    script = textwrap.dedent("""
        import os, signal, time
        from torch.utils.data import DataLoader
        import train_common
        batches = iter(DataLoader(list(range(100)), batch_size=1, num_workers=1))
        next(batches)  # torch's SIGCHLD handler is installed with the first worker
        torch_handler = signal.getsignal(signal.SIGCHLD)
        with train_common._signals_held():
            os.kill(batches._workers[0].pid, signal.SIGKILL)
            time.sleep(1.0)  # many bytecode boundaries: a pending handler would run here
            print("SAVE FINISHED", flush=True)
        print("TORCH HANDLER BACK:", signal.getsignal(signal.SIGCHLD) is torch_handler, flush=True)
        try:
            for _ in range(100):
                next(batches)
                time.sleep(0.05)
        except RuntimeError as exc:
            print("NOTICED:", exc, flush=True)
    """)
    result = run([sys.executable, "-c", script], timeout=120, PYTHONPATH=str(ROOT))
    assert "SAVE FINISHED" in result.stdout, result.stderr[-3000:]
    assert "TORCH HANDLER BACK: True" in result.stdout
    assert "NOTICED: DataLoader worker (pid" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("rank, local_rank, said", [("2", "0", True), ("3", "1", False)])
def test_a_launch_error_before_the_group_exists_is_said_once_per_machine(
        rank, local_rank, said, tmp_path, tiny_data, train_here, monkeypatch):
    """torchrun --nproc_per_node=8 on a machine showing 4 GPUs: every local rank refuses before
    any process group exists; the machine's local rank 0 says it, the other 7 do not repeat it."""
    import train_common

    def refuse(**kwargs):
        raise train_common.LaunchError("local rank 7 has no GPU: only 4 visible")
    monkeypatch.setattr(train_common, "init_distributed_mode", refuse)
    for key, value in dict(RANK=rank, WORLD_SIZE="16", LOCAL_RANK=local_rank).items():
        monkeypatch.setenv(key, value)
    code, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert code == 2, err[-3000:]
    assert err.count("error: local rank 7 has no GPU: only 4 visible") == int(said), err[-3000:]


def test_a_set_up_nccl_refuses_is_one_line_not_a_lost_peer(tmp_path, tiny_data, train_here,
                                                           monkeypatch):
    """Two ranks on one GPU: NCCL refuses at start-up, on every start. "Lost contact ... run the
    same command again" would send the user round in circles."""
    import train_common

    def run(args, info):  # NCCL's message (torch 2.x), as the group is set up
        raise torch.distributed.DistBackendError(
            "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, invalid usage "
            "(run with NCCL_DEBUG=WARN for details), NCCL version 2.27.5\nncclInvalidUsage: This "
            "usually reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU "
            "detected : rank 1 and rank 0 both on CUDA device 1a000")
    monkeypatch.setattr(train_common, "_run", run)
    code, err = train_here(flags(tiny_data, tmp_path / "out"))
    assert code == 2, err[-3000:]
    assert ("error: NCCL refused to set up the run (Duplicate GPU detected : rank 1 and rank 0 "
            "both on CUDA device 1a000); give every process a GPU of its own") in err, err[-3000:]
    assert "lost contact" not in err and "Traceback" not in err


def test_nccl_failing_mid_training_is_not_called_a_set_up_mistake(tmp_path, tiny_data,
                                                                   train_here, monkeypatch):
    """An NCCL error in epoch 1 (a GPU fault, NCCL out of memory) was reported as "NCCL refused
    to set up the run ... give every process a GPU of its own", exit code 2: the run can be
    continued, and the launchers take exit code 2 as a usage error."""
    import train_common

    real, calls = train_common.train_one_epoch, []

    def fails_in_epoch_1(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.distributed.DistBackendError(
                "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
                "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version "
                "2.27.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
                "Cuda failure 'an illegal memory access was encountered'")
        return real(*args, **kwargs)
    monkeypatch.setattr(train_common, "train_one_epoch", fails_in_epoch_1)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 1, err[-3000:]
    assert ("error: NCCL failed during the run (Cuda failure 'an illegal memory access was "
            "encountered'): most often a GPU fault or GPU memory running out") in err, err[-3000:]
    assert ("Run the same command again: it continues from the last complete checkpoint in "
            f"{out}") in err
    assert "refused to set up" not in err and "Traceback" not in err


def sigterm_recorded_in_epoch_1(monkeypatch) -> None:
    """SIGTERM arrives in epoch 1 and only its record stays (as when Python swallowed the
    interrupt our handler raised)."""
    import train_common

    real = train_common.train_one_epoch

    def signalled_in_epoch_1(model, optimizer, loader, device, epoch, **kwargs):
        if epoch == 1:
            monkeypatch.setattr(train_common, "_signal_received", "SIGTERM")  # as the handler
        return real(model, optimizer, loader, device, epoch, **kwargs)
    monkeypatch.setattr(train_common, "train_one_epoch", signalled_in_epoch_1)


def test_a_stop_signal_whose_interrupt_python_swallowed_still_stops_the_run(
        tmp_path, tiny_data, train_here, monkeypatch):
    """SIGTERM handled while a weakref callback ran: the KeyboardInterrupt our handler raised was
    only printed ("Exception ignored in: WeakKeyDictionary ...") and training went on. The
    handler had recorded the signal: the next --print-freq step stops the run."""
    sigterm_recorded_in_epoch_1(monkeypatch)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "3"))
    assert code == 143, err[-3000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0]


def test_a_stopped_resume_none_run_says_to_continue_with_resume_auto(tmp_path, tiny_data,
                                                                      train_here, monkeypatch):
    """Run again, a --resume none command starts over: the stop message said "run the same
    command again to resume", which threw the saved epochs away."""
    sigterm_recorded_in_epoch_1(monkeypatch)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", "--resume", "none"))
    assert code == 143, err[-3000:]
    assert ("interrupted by SIGTERM; run the same command with --resume auto in place of "
            f"--resume none to continue from the last complete checkpoint in {out} (the same "
            "command would start over).") in err, err[-3000:]
    monkeypatch.undo()
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", "--resume", "auto"))
    assert code == 0 and "resumed from" in err, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]


def test_ctrl_c_before_the_first_save_says_there_is_nothing_to_resume(tmp_path, tiny_data,
                                                                     train_here, monkeypatch):
    import train_common

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(train_common, "train_one_epoch", interrupted)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out))
    assert code == 130, err[-3000:]
    assert "interrupted by SIGINT before the first epoch was saved; run the same command again " \
           "to start." in err
    assert "last complete checkpoint" not in err
    monkeypatch.undo()
    code, err = train_here(flags(tiny_data, out, "--epochs", "1"))  # the same command again
    assert code == 0, err[-3000:]
    assert f"{out}: no epoch was completed here yet; starting from epoch 0." in err
    assert "save was interrupted" not in err  # no save was running when it stopped


@pytest.mark.parametrize("killed_after", ["model_best.pth", "weights/model-0.pth"])
def test_a_kill_during_the_first_save_does_not_block_the_rerun(killed_after, tmp_path, tiny_data,
                                                               train_here):
    """kill -9 while epoch 0 is saved: weights/model-0.pth (and model_best.pth) are written,
    checkpoint.pth is not, metrics.jsonl is still empty. That is no earlier run to protect."""
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "1"))
    assert code == 0, err[-3000:]
    epoch0 = load_ckpt(out / "checkpoint.pth")["model"]
    (out / "checkpoint.pth").rename(out / ".checkpoint.pth.k1ll3d.tmp")  # the write in flight
    (out / "metrics.jsonl").write_text("")
    if killed_after == "weights/model-0.pth":
        (out / "model_best.pth").unlink()
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))  # the same command again
    assert code == 0, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    assert not list(out.glob(".*.tmp"))
    if killed_after == "model_best.pth":  # complete: epoch 0 is not trained again
        assert f"resumed from {out / 'model_best.pth'}: epoch 0 done" in err
        assert err.count("[epoch ") == 1
        assert torch.equal(load_ckpt(out / "weights" / "model-0.pth")["conv1.weight"],
                           epoch0["conv1.weight"])
    else:
        assert "the first epoch's save was interrupted; starting that epoch again." in err
        assert err.count("[epoch ") == 2


def test_second_ctrl_c_does_not_wait_for_the_save(train_here):
    """While a checkpoint is written one Ctrl-C (or SIGTERM) waits for it; a second Ctrl-C stops
    at once, e.g. when the save hangs on a dead network mount."""
    import train_common

    signal.signal(signal.SIGINT, train_common._raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, train_common._raise_keyboard_interrupt)
    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with train_common._signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in a terminal after torchrun's SIGTERM
            done.append("saved")
    assert done == ["saved"]
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        with train_common._signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            done.append("never")
    assert done == ["saved"]
    with train_common._signals_held():  # no signal: nothing raised
        done.append("quiet")
    assert done == ["saved", "quiet"]


@pytest.mark.parametrize("epoch", [0, 1])
def test_full_disk_during_save_is_one_line_and_the_rerun_continues(epoch, tmp_path, tiny_data,
                                                                  train_here, monkeypatch):
    """ENOSPC while epoch ``epoch``'s checkpoint is written (through torch's zip writer, which
    would report "unexpected pos"): one error line, the earlier checkpoint intact, nothing that
    would block the rerun, and the same command then finishes the run."""
    out = tmp_path / "out"
    real_save = torch.save

    class FullDisk:
        def __init__(self, f) -> None:
            self.f, self.left = f, 20_000

        def write(self, data) -> int:
            if self.left < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)

        def flush(self) -> None:
            self.f.flush()

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("epoch") == epoch and "optimizer" in obj:
            f = FullDisk(f)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    monkeypatch.setattr(torch, "save", real_save)
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    done = f"the last complete checkpoint in {out}" if epoch else "the start"
    assert len(errors) == 1 and f"could not save epoch {epoch} in {out}: No space left on " \
        f"device; free space or fix the folder, then run the same command again: it continues " \
        f"from {done}." in errors[0], err[-3000:]
    assert "Traceback" not in err and "unexpected pos" not in err
    assert not list(out.rglob(".*.tmp"))
    if epoch:
        assert load_file(out / "checkpoint.pth")["epoch"] == 0
    else:
        assert sorted(p.name for p in out.rglob("*.pth")) == []

    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 0, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]


def test_output_folder_moved_during_the_run_says_where_to_continue(tmp_path, tiny_data,
                                                                   train_here, monkeypatch):
    out, moved = tmp_path / "out", tmp_path / "moved"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # the user moves the folder while epoch 1 is saved
        if isinstance(obj, dict) and obj.get("epoch") == 1 and out.is_dir():
            out.rename(moved)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, err = train_here(flags(tiny_data, out, "--epochs", "3"))
    monkeypatch.setattr(torch, "save", real_save)
    assert code == 2, err[-3000:]
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.endswith(f"error: could not save epoch 1: the folder {out} is gone (moved or "
                         "deleted during the run); to continue, run the command again with "
                         "--output-dir set to where the folder is now.")
    code, err = train_here(flags(tiny_data, moved, "--epochs", "3"))
    assert code == 0, err[-3000:]
    assert [m["epoch"] for m in read_metrics(moved)] == [0, 1, 2]


@pytest.mark.parametrize("older_checkpoint", [False, True])
def test_model_best_goes_to_the_lower_val_loss_when_accuracies_tie(tmp_path, tiny_data,
                                                                  train_here, monkeypatch,
                                                                  older_checkpoint):
    import train_common
    from multi_train_utils.train_eval_utils import EvalResult

    real_evaluate = train_common.evaluate
    # val acc and loss per epoch: 0.5 twice (the second with a lower loss), then 0.5 with a
    # higher loss, then resumed: 0.5 with a higher loss than the best's (and the first's).
    scores = iter([(2, 0.9), (2, 0.4), (2, 0.6), (2, 0.95)])

    def evaluate(*args, **kwargs):
        real = real_evaluate(*args, **kwargs)
        correct, loss = next(scores)
        return EvalResult(correct, top5_correct=4, num_samples=4, loss_sum=loss * 4,
                          confusion=real.confusion)

    monkeypatch.setattr(train_common, "evaluate", evaluate)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "3"))
    assert code == 0, err[-3000:]
    best = load_ckpt(out / "model_best.pth")
    assert (best["epoch"], best["best_acc"], best["best_loss"]) == (1, 0.5, pytest.approx(0.4))
    if older_checkpoint:  # saved before best_loss: its best was the first at best_acc (0.9)
        ckpt = load_ckpt(out / "checkpoint.pth")
        del ckpt["best_loss"]
        save_atomic(ckpt, out / "checkpoint.pth")
    code, err = train_here(flags(tiny_data, out, "--epochs", "4"))  # best_loss comes back
    assert code == 0, err[-3000:]
    assert load_ckpt(out / "model_best.pth")["epoch"] == 1
    assert [(m["val_acc"], m["val_loss"]) for m in read_metrics(out)] == [
        (0.5, 0.9), (0.5, 0.4), (0.5, 0.6), (0.5, 0.95)]


@pytest.mark.parametrize("where", ["train-loss", "val-loss"])
def test_diverged_run_is_one_line_and_no_diverged_epoch_is_saved(where, tmp_path, tiny_data,
                                                                 train_here, monkeypatch):
    import train_common

    out, extra = tmp_path / "out", []
    if where == "train-loss":
        extra = ["--lr", "1e12"]
        expect = "non-finite training loss (nan) at epoch 0"
    else:  # weights that went non-finite in the last step: only validation can tell
        real_evaluate = train_common.evaluate

        def evaluate(*args, **kwargs):
            result = real_evaluate(*args, **kwargs)
            result.loss = float("nan")
            return result

        monkeypatch.setattr(train_common, "evaluate", evaluate)
        expect = "validation loss nan after epoch 0: the weights diverged, so this epoch is " \
                 "not saved; lower --lr."
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", *extra))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and expect in errors[0], err[-3000:]
    assert "start over with --resume none or another --output-dir" in errors[0]
    assert "Traceback" not in err
    assert sorted(p.name for p in out.rglob("*.pth")) == [] and read_metrics(out) == []


def test_resume_warns_that_the_optimizer_keeps_its_lr(run_a, tmp_path, tiny_data, train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    saved = load_ckpt(out / "checkpoint.pth")["args"]
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1), "--lr", "0.5",
                                 "--momentum", str(saved["momentum"]), "--batch-size", "8",
                                 "--no-scale-lr"))
    assert code == 0, err[-3000:]
    assert (f"resuming keeps the optimizer of {out / 'checkpoint.pth'}: --lr {saved['lr']} "
            "(not 0.5), --scale-lr (not --no-scale-lr); to train with the new value(s), start "
            "over with --resume none") in err
    # Kept means kept: trained by 2 processes x 4 with --scale-lr (lr x 2), continued by 1 x 8,
    # the lr follows the run's own rule, not the --no-scale-lr of this command: the same 8
    # images per optimizer step, so the same lr (linear scaling with the images per step).
    cosine = (1 + math.cos(EPOCHS * math.pi / (EPOCHS + 1))) / 2 * (1 - saved["lrf"]) + saved["lrf"]
    assert read_metrics(out)[-1]["lr"] == pytest.approx(saved["lr"] * 2 * cosine, rel=1e-9)
    assert (f"{out / 'checkpoint.pth'} was trained with 2 process(es) x batch 4 = 8 images per "
            "optimizer step, this run has 1 process(es) x batch 8 = 8 images per optimizer step: "
            "the learning rate is kept: the images per optimizer step are unchanged "
            "(--scale-lr).\n") in err
    assert "--momentum" not in err.split("resuming keeps")[1].splitlines()[0]


def test_resume_with_other_freeze_layers_is_one_error_line(run_a, tmp_path, tiny_data,
                                                          train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1), "--freeze-layers"))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert (f"{out / 'checkpoint.pth'} was trained with --no-freeze-layers; resume with the same "
            f"flag, or keep its weights and start a new schedule with --resume none --weights "
            f"{out / 'checkpoint.pth'}.") in errors[0]
    # As suggested: the fc-only run starts from the checkpoint's weights.
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--freeze-layers",
                                 "--resume", "none", "--weights", str(run_a / "checkpoint.pth")))
    assert code == 0, err[-3000:]
    trained = load_ckpt(run_a / "checkpoint.pth")["model"]
    now = load_ckpt(out / "checkpoint.pth")["model"]
    assert torch.equal(now["conv1.weight"], trained["conv1.weight"])  # frozen, from the file
    for key in ("bn1.running_mean", "layer4.1.bn2.running_var"):  # BatchNorm statistics too
        assert torch.equal(now[key], trained[key]), key
    assert not torch.equal(now["fc.weight"], trained["fc.weight"])  # trained on


def test_eval_only_scores_the_weights_given_not_the_runs_checkpoint(run_a, tmp_path, tiny_data,
                                                                   train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)  # checkpoint.pth holds epoch 2; --weights asks for epoch 0
    weights = out / "weights" / "model-0.pth"
    # --batch-size 64 > the training images: evaluation needs no full training batch.
    code, err = train_here(flags(tiny_data, out, "--eval-only", "--weights", str(weights),
                                 "--batch-size", "64"))
    assert code == 0, err[-3000:]
    assert "evaluating" not in err
    assert f"loaded {weights} into --model resnet18: 122 of the model's 122 tensors\n" in err
    top1 = float(re.search(r"top-1 accuracy: ([\d.]+)", err).group(1))
    val_loss = float(re.search(r"val loss: ([\d.]+)", err).group(1))
    first, last = read_metrics(out)[0], read_metrics(out)[-1]
    assert (top1, val_loss) == (pytest.approx(first["val_acc"], abs=1e-4),
                                pytest.approx(first["val_loss"], abs=1e-4))
    assert val_loss != pytest.approx(last["val_loss"], abs=1e-3)  # epoch 0's, not the last's


def test_a_resumed_run_needs_its_weights_file_no_more(run_a, tmp_path, tiny_data, train_here):
    """--weights only starts a run: a rerun of the same command (a torchrun restart, a SLURM
    requeue) continues from the checkpoint even when that file is gone."""
    pretrained, out = tmp_path / "scratch" / "pretrained.pth", tmp_path / "out"
    pretrained.parent.mkdir()
    shutil.copy(run_a / "weights" / "model-0.pth", pretrained)
    argv = flags(tiny_data, out, "--weights", str(pretrained), "--freeze-layers")
    code, err = train_here([*argv, "--epochs", "1"])
    assert code == 0, err[-3000:]
    shutil.rmtree(pretrained.parent)
    code, err = train_here([*argv, "--epochs", "2"])
    assert code == 0, err[-3000:]
    assert (f"resumed from {out / 'checkpoint.pth'}: epoch 0 done") in err
    assert f"(--weights {pretrained} only started the run and is not read again)" in err
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    # Other weights added to the command of an existing run are not read: it says so.
    other = Path(shutil.copy(run_a / "weights" / "model-1.pth", tmp_path / "other.pth"))
    code, err = train_here(flags(tiny_data, out, "--weights", str(other), "--freeze-layers",
                                 "--epochs", "2"))
    assert code == 0, err[-3000:]
    assert (f"--weights {other} is not read: this run resumes from {out / 'checkpoint.pth'}, "
            f"which started from {pretrained}; to start from {other}, use another --output-dir"
            ) in err, err[-3000:]
    assert "only started the run" not in err


def test_bare_weights_are_checked_against_their_runs_class_names(run_a, tmp_path, tiny_data,
                                                                 train_here):
    """Bare weights carry no class names, but their run's class_indices.json (one folder up)
    does: renamed classes would shift every label."""
    data = tmp_path / "renamed"
    shutil.copytree(tiny_data, data)
    (data / "tulips").rename(data / "a_tulips")
    weights = run_a / "weights" / f"model-{EPOCHS - 1}.pth"
    code, err = train_here(flags(data, tmp_path / "eval", "--eval-only", "--weights",
                                 str(weights)))
    assert code == 2 and (f"error: {weights} was trained on the classes daisy, dandelion, roses, "
                          "sunflowers, tulips, but the data has class folder(s) it has no output "
                          "for: a_tulips;") in err, err[-3000:]
    # Another --model is named from the run's args.json; weights alone are scored with a warning.
    code, err = train_here(flags(tiny_data, tmp_path / "eval", "--eval-only", "--weights",
                                 str(weights), "--model", "resnet34"))
    assert code == 2 and (f"error: {weights} was trained with --model resnet18 (its run's "
                          "args.json) but this run has --model resnet34; use --model resnet18."
                          ) in err, err[-3000:]
    alone = tmp_path / "alone.pth"
    shutil.copy(weights, alone)
    code, err = train_here(flags(tiny_data, tmp_path / "eval", "--eval-only", "--weights",
                                 str(alone)))
    assert code == 0 and (f"no class_indices.json beside {alone} (or one folder up): its class "
                          "names cannot be checked") in err, err[-3000:]
    lacking = tmp_path / "lacking"  # a test folder lacking a class: nothing to match them by
    shutil.copytree(tiny_data, lacking, ignore=lambda d, names: ["daisy"] * ("daisy" in names))
    code, err = train_here(flags(lacking, tmp_path / "eval", "--eval-only", "--weights",
                                 str(alone)))
    assert code == 2 and (f"error: --eval-only: the classifier of {alone} does not fit the 4 "
                          "classes of the data, and its class names are unknown (no usable "
                          "class_indices.json beside it or one folder up)") in err, err[-3000:]
    out = tmp_path / "fine-tune"  # training from them: the head starts new
    code, err = train_here(flags(data, out, "--epochs", "1", "--weights", str(weights)))
    assert code == 0, err[-3000:]
    assert ("the classifier (fc.bias, fc.weight) starts new for 5 classes (it was trained on "
            "daisy, dandelion, roses, sunflowers, tulips)") in err


def test_weights_of_another_resnet_are_refused_not_mixed_in(tmp_path, tiny_data, train_here):
    """A resnet50's Bottleneck blocks share names with a resnet18's BasicBlocks: loading the
    tensors whose shapes happen to fit would start from a meaningless mix."""
    path = tmp_path / "elsewhere" / "resnet50_5_classes.pth"
    path.parent.mkdir()
    torch.save(get_model("resnet50", num_classes=5).state_dict(), path)
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--epochs", "1", "--weights",
                                 str(path)))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and (
        f"error: {path} is not weights for --model resnet18: 23 of its tensors have the names of "
        "resnet18's but other shapes (e.g. layer1.0.conv1.weight: [64, 64, 1, 1] there, "
        "[64, 64, 3, 3] here); pass the --model it was made for.") in errors[0], err[-3000:]
    assert not (tmp_path / "out" / "checkpoint.pth").exists()


def test_weights_of_these_classes_in_another_order_keep_their_head(run_a, tmp_path, tiny_data,
                                                                  train_here):
    """Weights whose class_indices.json lists the data's classes in another order (an old
    run's, a renamed class sorting elsewhere): each class keeps its row of the head."""
    trained = load_ckpt(run_a / "weights" / f"model-{EPOCHS - 1}.pth")
    order = ["tulips", "daisy", "sunflowers", "dandelion", "roses"]
    data_order = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    rows = [data_order.index(name) for name in order]  # row i of the file is class order[i]
    state = {k: v[rows] if k in ("fc.weight", "fc.bias") else v for k, v in trained.items()}
    folder = tmp_path / "shuffled"
    folder.mkdir()
    torch.save(state, folder / "model.pth")
    (folder / "class_indices.json").write_text(json.dumps(dict(enumerate(order))))
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--lr", "1e-12", "--weights",
                                 str(folder / "model.pth")))
    assert code == 0, err[-3000:]
    assert (f"{folder / 'model.pth'} was trained on the classes of the data in another order "
            "(tulips, daisy, sunflowers, dandelion, roses): its classifier's outputs are "
            "reordered to the data's (daisy, dandelion, roses, sunflowers, tulips).") in err
    assert "122 of the model's 122 tensors" in err and "starts new" not in err
    # An lr of 1e-12 leaves the weights as loaded: the head is the trained one, rows in order.
    head = load_ckpt(out / "weights" / "model-0.pth")["fc.weight"]
    assert torch.allclose(head, trained["fc.weight"], atol=1e-6)
    # Evaluated as they are, each image is scored against its class by name.
    code, err = train_here(flags(tiny_data, tmp_path / "eval", "--eval-only", "--weights",
                                 str(folder / "model.pth")))
    assert code == 0 and "(missing: )" not in err, err[-3000:]
    assert (f"the data's classes are those {folder / 'model.pth'} was trained on, in another "
            "order: each image is scored against its class by name.") in err


@pytest.mark.parametrize("indices, why", [
    ({"daisy": 0, "dandelion": 1, "roses": 2, "sunflowers": 3, "tulips": 4},
     'is not a map of the indices 0..N-1 to distinct class names ({"0": "daisy", ...})'),
    ({"0": "cat", "1": "dog"}, "lists 2 classes but the classifier of {weights} has 5 outputs"),
    ({str(i): "daisy" for i in range(5)}, "is not a map of the indices 0..N-1 to distinct class"),
])
def test_a_class_indices_json_not_of_the_weights_run_is_ignored_and_said(
        run_a, tmp_path, tiny_data, train_here, indices, why):
    """ImageFolder's class_to_idx, or an old tutorial's file for other weights, beside the
    weights: it does not name their classes, and saying 'no class_indices.json' would be false."""
    folder = tmp_path / "old"
    folder.mkdir()
    weights = folder / "model.pth"
    shutil.copy(run_a / "weights" / f"model-{EPOCHS - 1}.pth", weights)
    found = folder / "class_indices.json"
    found.write_text(json.dumps(indices))
    code, err = train_here(flags(tiny_data, tmp_path / "eval", "--eval-only", "--weights",
                                 str(weights)))
    assert code == 0, err[-3000:]
    why = why.replace("{weights}", str(weights))
    assert f"ignoring {found}, which {why}" in err, err[-3000:]
    assert f"no usable class_indices.json beside {weights} (or one folder up)" in err
    assert "no class_indices.json" not in err and "cat, dog" not in err


def test_weights_of_these_classes_from_another_split_warn(run_a, tmp_path, tiny_data,
                                                         train_here):
    argv = flags(tiny_data, tmp_path / "out", "--epochs", "1", "--weights",
                 str(run_a / "checkpoint.pth"))
    code, err = train_here(argv)
    assert code == 0 and "validation split may include" not in err, err[-3000:]
    argv[argv.index("--seed") + 1] = "5"
    code, err = train_here([*argv, "--output-dir", str(tmp_path / "other")])
    assert code == 0, err[-3000:]
    assert (f"{run_a / 'checkpoint.pth'} was trained on these classes with --seed 0 (not 5): this "
            "run's validation split may include images those weights trained on") in err


def test_freeze_layers_without_weights_is_one_error_line(tmp_path, tiny_data, train_here):
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--epochs", "1", "--freeze-layers"))
    assert code == 2, err[-3000:]
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.endswith(
        "error: --freeze-layers trains only the classifier (fc) on the features of --weights, "
        "but no --weights was given, so the frozen layers would stay random; give pretrained "
        "--weights or drop --freeze-layers.")


def test_a_world_size_the_launcher_did_not_start_is_one_error_line(tmp_path, tiny_data,
                                                                    train_here):
    """The classic launch script took --world-size; copied commands still pass it. The
    launcher decides the number of processes: another number would be a wrong lr and plan."""
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--world-size", "4"))
    assert code == 2, err[-3000:]
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.endswith("error: --world-size 4 but this run has 1 process(es); drop "
                         "--world-size: the launcher's own flags (torchrun --nproc_per_node x "
                         "--nnodes, srun -n) decide, and plain python runs one.")
    assert not (tmp_path / "out").exists()


def test_eval_only_val_rate_one_scores_every_image_of_a_test_folder(run_a, tmp_path, tiny_data,
                                                                     train_here):
    code, err = train_here(flags(tiny_data, tmp_path / "eval", "--eval-only", "--val-rate", "1",
                                 "--resume", str(run_a / "checkpoint.pth")))
    assert code == 0, err[-3000:]
    assert (f"evaluating {run_a / 'checkpoint.pth'}: epoch {EPOCHS - 1} (the last saved; the "
            f"best, val acc") in err and f"is {run_a / 'model_best.pth'})" in err
    assert f"--val-rate 1: scoring every image of {tiny_data}" in err
    assert "got no training image" not in err and "draws another validation split" not in err
    assert "val images: 60\n" in err  # 5 classes x 12, every one
    assert err.index("accuracy per class:") < err.index("top-1 accuracy")  # summary last
    code, err = train_here(flags(tiny_data, tmp_path / "train", "--val-rate", "1"))
    assert code == 2 and "error: --val-rate 1 leaves no image for training; it is for " \
        "--eval-only" in err, err[-3000:]


@pytest.mark.parametrize("given", ["--resume", "--weights", "bare weights"])
def test_eval_only_on_a_test_folder_lacking_classes_scores_each_image_as_its_class(
        run_a, tmp_path, tiny_data, train_here, given):
    """A test set often lacks a class. Without "daisy" (label 0) every other folder's index
    shifts by one; scored by name, each class gets exactly its numbers in the full folder."""
    flag, path = (("--weights", run_a / "weights" / f"model-{EPOCHS - 1}.pth")
                  if given == "bare weights" else (given, run_a / "checkpoint.pth"))

    def per_class(data: Path) -> tuple[dict[str, str], str]:
        code, err = train_here(flags(data, tmp_path / "eval", "--eval-only", "--val-rate", "1",
                                     flag, str(path), "--num_classes", "5"))  # the model's
        assert code == 0, err[-3000:]
        lines = err[err.index("accuracy per class:"):].splitlines()
        return dict(line.strip().split(": ", 1) for line in lines[1:6]), err

    full, _ = per_class(tiny_data)
    data = tmp_path / "roses-only"  # one class is enough to score (training needs two)
    (data / "roses").parent.mkdir()
    shutil.copytree(tiny_data / "roses", data / "roses")
    part, err = per_class(data)
    assert part == {name: ("n/a (no validation images)" if name != "roses" else value)
                    for name, value in full.items()}
    assert "val images: 12\n" in err
    data = tmp_path / "test-set"
    shutil.copytree(tiny_data, data)
    shutil.rmtree(data / "daisy")
    part, err = per_class(data)
    assert (f"the data holds 4 of the 5 classes {path} was trained on (missing: daisy): its "
            "images are scored against all 5.") in err
    assert part == {**full, "daisy": "n/a (no validation images)"}
    assert "val images: 48\n" in err
    correct = sum(round(float(v.split()[0]) * 12) for k, v in full.items() if k != "daisy")
    assert f"top-1 accuracy: {correct / 48:.4f}\n" in err
    code, err = train_here(flags(data, tmp_path / "eval", "--eval-only", "--val-rate", "1",
                                 flag, str(path), "--num-classes", "6"))
    assert code == 2 and (f"error: --num-classes 6 disagrees with the 5 classes {path} was "
                          "trained on (the data holds 4 of them); drop the flag.") in err, err[-3000:]


def test_eval_only_weights_from_a_checkpoint_of_other_classes_is_refused(run_a, tmp_path,
                                                                         tiny_data, train_here):
    """Same number of classes, one renamed: every label shifts, and the tensors still fit, so
    only the checkpoint's class list can tell. --weights gets the check --resume makes."""
    data = tmp_path / "renamed"
    shutil.copytree(tiny_data, data)
    (data / "tulips").rename(data / "a_tulips")
    weights = run_a / "model_best.pth"
    code, err = train_here(flags(data, tmp_path / "out", "--eval-only", "--weights", str(weights)))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    # A test folder may lack classes: only the one it has no output for is named.
    assert (f"{weights} was trained on the classes daisy, dandelion, roses, sunflowers, tulips, "
            "but the data has class folder(s) it has no output for: a_tulips; score a folder "
            "whose class folders are among those it was trained on (some may be missing)."
            ) in errors[0]
    assert "top-1 accuracy" not in err


def test_raising_epochs_on_resume_continues_on_the_new_cosine(tmp_path, tiny_data, train_here):
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", "--lrf", "0.1"))
    assert code == 0, err[-3000:]
    code, err = train_here(flags(tiny_data, out, "--epochs", "4", "--lrf", "0.1"))
    assert code == 0, err[-3000:]
    assert "was planned for --epochs 2, this run has 4: the cosine schedule is laid out anew" in err
    lr0 = load_ckpt(out / "checkpoint.pth")["args"]["lr"]
    planned = [lr0 * ((1 + math.cos(e * math.pi / 4)) / 2 * 0.9 + 0.1) for e in range(4)]
    got = [m["lr"] for m in read_metrics(out)]
    # Epochs 0-1 ran on the 2-epoch plan; from epoch 2 on, the 4-epoch curve (not the old
    # plan's final lr * lrf for one epoch and then a jump back up).
    assert got[2:] == [pytest.approx(v, rel=1e-9) for v in planned[2:]]


@pytest.mark.parametrize("counter", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restart_continues_a_launch_started_with_resume_none(counter, tmp_path, tiny_data,
                                                                train_here, monkeypatch):
    """torchrun --max-restarts and a requeued SLURM job run the same command again. With
    --resume none each restart set the epochs trained so far aside and began at epoch 0. Only
    the launch's own epochs are continued: not another launch's, nor, after an attempt that died
    before setting it aside, the run that --resume none replaces."""
    out = tmp_path / "out"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # names the launch (torchrun's: test below)
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--resume", "none"))
    assert code == 0, err[-3000:]
    first = read_metrics(out)
    assert json.loads((out / "args.json").read_text())["launch"] == "slurm job 4242"
    monkeypatch.setenv(counter, "1")  # the launcher's restart of the same command
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", "--resume", "none"))
    assert code == 0, err[-3000:]
    assert (f"restart 1 of this launch: continuing its own {out / 'checkpoint.pth'} (--resume "
            "none started the launch anew, not each restart).") in err
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1] and read_metrics(out)[:1] == first
    assert not (out / ".previous-run").exists()
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["model-0.pth", "model-1.pth"]
    monkeypatch.setenv("SLURM_JOB_ID", "5151")  # another launch's restart: its folder is not
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--resume", "none"))
    assert code == 0 and "restart 1 of this launch" not in err, err[-3000:]
    assert "starting afresh in" in err and [m["epoch"] for m in read_metrics(out)] == [0]


def test_a_launch_is_named_by_slurm_or_torchrun(monkeypatch):
    import train_common

    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert train_common.launch_id() is None  # plain python: nothing names a launch
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5c0ffee")  # --standalone, or --rdzv-id
    assert train_common.launch_id() == "torchrun 5c0ffee"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # without rendezvous flags: its process
    named = train_common.launch_id()
    assert named.startswith(f"torchrun pid {os.getppid()} started ")
    assert named == train_common.launch_id()  # the same for every restart it makes
    # A requeued SLURM job keeps its id, while torchrun --standalone inside it draws a new one.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert train_common.launch_id() == "slurm job 77"


def test_rerunning_a_finished_run_trains_nothing_and_keeps_its_files(run_a, tmp_path, tiny_data,
                                                                    train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    for epochs in (EPOCHS, EPOCHS - 1):  # e.g. with another --img-size: args.json stays as trained
        code, err = train_here(flags(tiny_data, out, "--epochs", str(epochs), "--img-size", "48"))
        assert code == 0, err[-3000:]
        assert (f"{out} holds epochs 0-{EPOCHS - 1}, so --epochs {epochs} leaves nothing to "
                "train.") in err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_resume_with_another_seed_or_val_rate_is_refused(run_a, tmp_path, tiny_data, train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    argv = flags(tiny_data, out, "--epochs", str(EPOCHS + 1))
    argv[argv.index("--seed") + 1] = "7"
    code, err = train_here([*argv, "--val-rate", "0.3"])
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err[-3000:]
    assert (f"{out / 'checkpoint.pth'} was trained with --seed 0 (not 7), --val-rate 0.2 (not "
            "0.3): another value draws another train/validation split") in errors[0]
    # Evaluation may use other values, but is told what it scores.
    code, err = train_here([*argv, "--eval-only", "--resume", str(out / "checkpoint.pth")])
    assert code == 0, err[-3000:]
    assert "was trained with --seed 0 (not 7): this evaluation draws another validation split" in err


def test_resume_on_changed_data_warns_that_validation_moved(run_a, tmp_path, tiny_data,
                                                            train_here):
    out, data = tmp_path / "out", tmp_path / "data"
    shutil.copytree(run_a, out)
    shutil.copytree(tiny_data, data)  # moved: the same files elsewhere keep their split
    code, err = train_here(flags(data, out, "--epochs", str(EPOCHS + 1)))
    assert code == 0, err[-3000:]
    assert "the validation images differ" not in err
    before = _build_data(get_args_parser().parse_args(flags(data, out)), DistInfo(), out)
    for i, image in enumerate(sorted((data / "daisy").iterdir())):  # 12 more daisies
        shutil.copy(image, data / "daisy" / f"added{i}.jpg")
    code, err = train_here(flags(data, out, "--epochs", str(EPOCHS + 2)))
    assert code == 0, err[-3000:]
    assert (f"the validation images differ from those {out / 'checkpoint.pth'} was validated on: "
            "val accuracy is not comparable with earlier epochs. Added or removed images move no "
            "other file across the split") in err
    after = _build_data(get_args_parser().parse_args(flags(data, out)), DistInfo(), out)
    trained, validated = (set(before[i].images_path) for i in (2, 3))
    new_val = set(after[3].images_path)
    # Only added files joined validation (seed 0's hash puts some of the 12 in it).
    assert new_val > validated and not new_val & trained


def test_an_already_split_data_set_trains_and_is_scored_with_val_path(tmp_path, tiny_data,
                                                                      train_here):
    """--val-path: two ranks train on every --data-path image and validate on the folder,
    labelled by class name (it holds 2 of the 5 classes); its junk is listed with the run's. A
    resume must keep it: without it, validation would be a split of images the run trained
    on. --eval-only --val-path scores the folder against all the model's classes."""
    val, out = tmp_path / "val", tmp_path / "out"
    for name, n in (("tulips", 3), ("daisy", 2)):  # daisy is class 0, tulips class 4
        (val / name).mkdir(parents=True)
        for image in sorted((tiny_data / name).iterdir())[:n]:
            shutil.copy(image, val / name / image.name)
    (val / "daisy" / "notes.txt").write_text("junk")
    res = run(torchrun_cmd(2, LAUNCH, *flags(tiny_data, out, "--val-path", str(val),
                                             "--epochs", "1")))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    assert text.count("60 training / 5 validation images, 5 classes") == 1, text[-4000:]
    assert text.count(f"3 class(es) have no image in the validation folder {val}") == 1
    assert (out / "skipped_files.txt").read_text(encoding="utf-8") == (
        f"{val / 'daisy' / 'notes.txt'}\tnot an image extension\n")
    assert load_ckpt(out / "checkpoint.pth")["args"]["val_path"] == str(val)

    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 2 and (f"error: {out / 'checkpoint.pth'} was trained with --val-path {val}: "
                          "another value draws another train/validation split") in err, err[-3000:]
    code, err = train_here(flags(tiny_data, tmp_path / "split", "--epochs", "1"))
    assert code == 0, err[-3000:]
    code, err = train_here(flags(tiny_data, tmp_path / "split", "--epochs", "2",
                                 "--val-path", str(val)))  # and the other way round
    assert code == 2 and ("was trained without --val-path, validating on a --val-rate 0.2 split "
                          "of its data: with --val-path it would train on those validation "
                          "images and pick model_best across two validation sets") in err, err
    code, err = train_here(flags(tiny_data, out, "--eval-only", "--resume",
                                 str(out / "checkpoint.pth"), "--val-path", str(val)))
    assert code == 0, err[-3000:]
    assert (f"--eval-only scores the --val-path folder {val}; --data-path {tiny_data} is not "
            "read.") in err
    assert "val images: 5" in err and re.search(r"  daisy: \d\.\d{4} \(2 images\)\n", err)
    assert re.search(r"  tulips: \d\.\d{4} \(3 images\)\n", err), err[-2000:]
    assert "  roses: n/a (no validation images)" in err
    inner = tiny_data / "daisy"
    code, err = train_here(flags(tiny_data, tmp_path / "o2", "--val-path", str(inner)))
    assert code == 2 and (f"error: --val-path {inner} and --data-path {tiny_data} overlap, so "
                          "the model would train on images it is validated on") in err, err[-2000:]


@pytest.mark.parametrize("made", ["unprefixed", "unrecorded"])
def test_resume_of_a_checkpoint_with_the_old_split_is_refused(made, run_a, tmp_path, tiny_data,
                                                              train_here):
    """Versions before the per-file hash split drew k images per class: that split differs,
    so resuming with today's would validate on training images."""
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    ckpt = load_ckpt(out / "checkpoint.pth")
    if made == "unprefixed":  # the fingerprint of the old split had no scheme
        ckpt["val_split"] = ckpt["val_split"].split(":")[-1]
    else:  # older still: no fingerprint at all
        del ckpt["val_split"]
    save_atomic(ckpt, out / "checkpoint.pth")
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1)))
    assert code == 2, err[-3000:]
    assert (f"error: {out / 'checkpoint.pth'} was made by an earlier version of this template, "
            "which drew the validation split another way, so validation would include images "
            "it trained on; finish it with the version that started it, or start over with "
            "--resume none or another --output-dir.") in err


def test_model_best_exists_even_when_accuracy_stays_zero(tmp_path, tiny_data, train_here,
                                                          monkeypatch):
    import train_common
    from multi_train_utils.train_eval_utils import EvalResult

    real_evaluate = train_common.evaluate

    def nothing_right(*args, **kwargs):  # a hard task's first epochs
        r = real_evaluate(*args, **kwargs)
        return EvalResult(0, top5_correct=0, num_samples=r.num_samples,
                          loss_sum=r.loss * r.num_samples, confusion=r.confusion)

    monkeypatch.setattr(train_common, "evaluate", nothing_right)
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "2"))
    assert code == 0, err[-3000:]
    metrics = read_metrics(out)
    assert [m["val_acc"] for m in metrics] == [0.0, 0.0]
    lowest = min(metrics, key=lambda m: m["val_loss"])["epoch"]  # the first of equals
    assert load_ckpt(out / "model_best.pth")["epoch"] == lowest  # a tie: the lower val loss


def test_resumed_into_a_new_folder_its_best_model_holds_its_own_accuracy(run_a, tmp_path,
                                                                          tiny_data, train_here):
    """The new folder has no model_best.pth, so the first epoch saved there is its best; the
    best accuracy it records must be that epoch's, not the other folder's best."""
    given = tmp_path / "given.pth"
    ckpt = load_ckpt(run_a / "checkpoint.pth")
    ckpt["best_acc"] = 1.0  # the other folder's best, out of reach for any epoch here
    torch.save(ckpt, given)
    out = tmp_path / "new"
    code, err = train_here(flags(tiny_data, out, "--resume", str(given), "--epochs",
                                 str(EPOCHS + 1)))
    assert code == 0, err[-3000:]
    best, last = load_ckpt(out / "model_best.pth"), read_metrics(out)[-1]
    assert best["epoch"] == last["epoch"] == EPOCHS
    assert best["best_acc"] == pytest.approx(last["val_acc"], abs=1e-6)
    assert load_ckpt(out / "checkpoint.pth")["best_acc"] == best["best_acc"]


def test_corrupt_checkpoint_names_the_files_to_continue_from(run_a, tmp_path, tiny_data,
                                                              train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    data = bytearray((out / "checkpoint.pth").read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    (out / "checkpoint.pth").write_bytes(data)
    argv = flags(tiny_data, out, "--epochs", str(EPOCHS + 1))
    code, err = train_here(argv)
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "fails its CRC check" in errors[0], err[-3000:]
    newest = out / "weights" / f"model-{EPOCHS - 1}.pth"
    assert (f"Continue with --resume {out / 'model_best.pth'}, or --resume none --weights "
            f"{newest} (weights only; the schedule starts over), or --resume none to start "
            "over.") in errors[0]
    code, err = train_here([*argv, "--resume", str(out / "model_best.pth")])  # as suggested
    assert code == 0, err[-3000:]
    assert load_file(out / "checkpoint.pth")["epoch"] == EPOCHS


# ---------------------------------------------------------------- 5. elastic restart
def _local_rank(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[len(b"LOCAL_RANK="):].decode() for v in env if v.startswith(b"LOCAL_RANK=")),
                None)


def test_torchrun_restarts_after_a_worker_is_killed(run_a, tiny_data, tmp_path, launched):
    """kill -9 local rank 1 in epoch 1: torchrun --max-restarts=1 restarts the group, which
    resumes from the last checkpoint and ends exactly where the uninterrupted run ended."""
    out = tmp_path / "out"
    tree = launched(torchrun_cmd(2, "--max-restarts=1", LAUNCH,
                                 *flags(tiny_data, out, "--epochs", str(EPOCHS))))
    tree.wait_for(epochs_done(out, 1), "epoch 0's checkpoint")
    time.sleep(1.0)  # into epoch 1
    victims = [p for p in tree.children() if _local_rank(p) == "1"]
    assert len(victims) == 1, f"workers: {[(p, _local_rank(p)) for p in tree.children()]}"
    os.kill(victims[0], signal.SIGKILL)

    try:
        tree.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        tree.fail("torchrun did not finish within 300 s after the restart")
    output = tree.output()
    assert tree.proc.returncode == 0, output[-4000:]
    assert "resumed from" in output, output[-4000:]  # the restarted group continued
    assert not tree.alive_seen()

    ours = read_metrics(out)
    assert [m["epoch"] for m in ours] == list(range(EPOCHS))
    assert [{k: m[k] for k in COMPARED} for m in ours] == \
           [{k: m[k] for k in COMPARED} for m in read_metrics(run_a)]
    assert_same_tensors(load_ckpt(out / "checkpoint.pth")["model"],
                        load_ckpt(run_a / "checkpoint.pth")["model"])


# ---------------------------------------------------------------- 6. spawn: a child dies
def _spawn_children(tree: ProcessTree) -> list[int]:
    """The training processes of the spawn launcher (not multiprocessing's resource tracker)."""
    kids = []
    for pid in tree.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            kids.append(pid)
    return kids


def test_spawn_launcher_stops_all_when_a_child_dies(tiny_data, tmp_path, launched):
    out = tmp_path / "out"
    tree = launched([sys.executable, SPAWN, "--world-size", "2",
                     *flags(tiny_data, out, "--epochs", str(EPOCHS))],
                    MASTER_PORT=str(find_free_port()))
    tree.wait_for(lambda: (out / "args.json").is_file() and len(_spawn_children(tree)) == 2,
                  "training to start")
    time.sleep(1.0)
    rank1 = _spawn_children(tree)[1]  # started second: local rank 1
    os.kill(rank1, signal.SIGKILL)

    seconds = tree.wait_all_gone(timeout=90)
    output = tree.output()
    assert seconds < 60, f"took {seconds:.0f}s"
    assert tree.proc.returncode not in (0, None), output[-3000:]
    failed = [line for line in output.splitlines() if "failed" in line and "rank 1" in line]
    assert failed, output[-3000:]
    assert "SIGKILL" in failed[0] and "run the same command again" in failed[0]


# ---------------------------------------------------------------- 7b. spawn: Ctrl-C
def test_sigint_to_spawn_launcher_stops_every_process_cleanly(run_a, tiny_data, tmp_path,
                                                              launched):
    """Resume A's finished 3 epochs to a 4th, Ctrl-C in it: all processes (DataLoader workers
    too) are gone, the port is free, and A's checkpoint is still there, intact."""
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    port = find_free_port()
    tree = launched([sys.executable, SPAWN, "--world-size", "2",
                     *flags(tiny_data, out, "--epochs", str(EPOCHS + 1), workers=2)],
                    MASTER_PORT=str(port))
    # Wait until each trainer has its 2 train-loader workers (children of its own).
    tree.wait_for(lambda: len(kids := _spawn_children(tree)) == 2
                  and all(len(tree.children(k)) >= 2 for k in kids), "the DataLoader workers")
    time.sleep(1.0)
    snapshot = [p for p in tree.refresh() if tree.alive(p)]
    tree.proc.send_signal(signal.SIGINT)

    seconds = tree.wait_all_gone(timeout=90)
    output = tree.output()
    assert len(snapshot) >= 6, snapshot  # 2 trainers + 4 loader workers (+ resource tracker)
    assert seconds < 60, f"shutdown took {seconds:.0f}s"
    assert tree.proc.returncode == 130, output[-3000:]
    assert "stopped by SIGINT" in output and "resumed from" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert port_is_free(port)
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] in (EPOCHS - 1, EPOCHS)


# ---------------------------------------------------------------- 8. --dist-timeout
_PEER = textwrap.dedent("""
    import argparse, os, sys, time
    import torch
    import torch.distributed as dist
    from multi_train_utils.distributed_utils import init_distributed_mode
    args = argparse.Namespace(device="cpu", dist_url="env://", dist_timeout=float(sys.argv[1]))
    info = init_distributed_mode(args)  # the classic call: it also sets what classic code reads
    assert (args.rank, args.world_size, args.gpu, args.distributed, args.dist_backend) == \
        (info.rank, 2, info.local_rank, True, "gloo"), vars(args)
    if info.rank == 1:
        time.sleep(120)  # stuck: never joins the collective
        sys.exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("NO ERROR", flush=True)
    except Exception as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    os._exit(0)
""")


def test_dist_timeout_turns_a_stuck_peer_into_an_error(tmp_path, launched):
    port = str(find_free_port())
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=str(ROOT))
    rank0 = launched([sys.executable, "-c", _PEER, "3"], RANK="0", LOCAL_RANK="0", **env)
    rank1 = launched([sys.executable, "-c", _PEER, "3"], RANK="1", LOCAL_RANK="1", **env)
    try:
        rank0.proc.wait(timeout=90)  # the peer sleeps 120 s: only the timeout ends this early
    except subprocess.TimeoutExpired:
        rank0.fail("rank 0 still waiting for its stuck peer after 90 s (timeout was 3 s)")
    output = rank0.output()
    assert "RAISED after" in output, output[-3000:]
    assert float(output.split("RAISED after ")[1].split("s:")[0]) < 60
    assert "timed out" in output.lower() or "timeout" in output.lower(), output[-3000:]
    assert rank1.proc.poll() is None  # the peer really was still there, just not participating



@pytest.mark.parametrize("rank", [0, 1])
def test_peers_that_never_come_are_one_line_after_the_timeout(tmp_path, tiny_data, rank):
    """E.g. a SLURM batch script without srun: rank 0 of 2 waits --dist-timeout, then says what
    to check instead of printing the store's traceback. Rank 1 without a rank 0 to reach: one
    line too, without the C++ stack dump each of the store's connect retries printed."""
    port = find_free_port()
    result = run([sys.executable, LAUNCH, *flags(tiny_data, tmp_path / "out"), "--dist-timeout",
                  "3"], timeout=120, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "frame #" not in result.stderr, \
        result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "the processes of the run did not all meet (" + (
        "Timed out after" if rank == 0 else
        f"nothing answered at 127.0.0.1:{port} within 3s (Connection refused))") in errors[0]
    assert (f"{'1/2 clients joined)' if rank == 0 else ''}; start every rank with the same "
            "MASTER_ADDR/MASTER_PORT" in errors[0])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_rank_waiting_for_its_peers_stops_on_a_signal(signum, tmp_path, tiny_data, launched):
    """Rank 0 of 2, whose peer never comes: the rendezvous blocks in C++, where a Python signal
    handler would wait for --dist-timeout; the signal must end it at once."""
    port = find_free_port()
    rank0 = launched([sys.executable, LAUNCH, *flags(tiny_data, tmp_path / "out"),
                      "--dist-timeout", "600"], RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank0.wait_for(lambda: not port_is_free(port), "rank 0 to host the rendezvous", timeout=120)
    time.sleep(1)  # into the wait for rank 1
    rank0.proc.send_signal(signum)
    try:
        rank0.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        rank0.fail(f"still waiting for its peer 20 s after {signum.name}")
    assert rank0.proc.returncode == -signum, rank0.output()[-3000:]
    assert not (tmp_path / "out").exists()  # nothing was started, so nothing is lost


@pytest.mark.parametrize("peer", ["killed", "stopped"])
def test_a_lost_peer_is_one_line_and_the_rerun_continues(peer, tmp_path, tiny_data, launched):
    """Two ranks started by hand (as on two machines, where no launcher stops the survivor): rank
    1 is killed, or stopped (SIGSTOP: a hung machine), after epoch 0. Rank 0 must say in one
    line what happened and how to go on, not print gloo's C++ traceback."""
    out, port = tmp_path / "out", str(find_free_port())
    argv = [sys.executable, LAUNCH, *flags(tiny_data, out, "--epochs", "50", "--dist-timeout",
                                           "10")]
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rank0 = launched(argv, RANK="0", LOCAL_RANK="0", **env)
    rank1 = launched(argv, RANK="1", LOCAL_RANK="1", **env)
    rank0.wait_for(epochs_done(out, 1), "epoch 0")
    time.sleep(0.5)  # into epoch 1
    rank1.proc.send_signal(signal.SIGKILL if peer == "killed" else signal.SIGSTOP)
    try:
        rank0.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rank0.fail(f"rank 0 still running 90 s after its peer was {peer}")
    output = rank0.output()
    assert rank0.proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output[-3000:]
    reason = {"killed": "Connection (closed|reset) by peer",
              "stopped": "Timed out waiting 10000ms|Application timeout caused pair closure"
              }[peer]  # gloo words a timeout either way, depending on where it waits
    assert re.search(rf"lost contact with the other processes of the run \([^)]*({reason})",
                     errors[0]), errors[0]
    assert f"it continues from the last complete checkpoint in {out}." in errors[0]
    saved = read_metrics(out)  # the checkpoint is whole and is the last epoch recorded
    assert saved and load_ckpt(out / "checkpoint.pth")["epoch"] == saved[-1]["epoch"]


def test_an_interrupt_python_could_only_print_is_no_traceback(tmp_path):
    """A signal that lands inside a weakref callback (the garbage collector runs them at any
    moment): the KeyboardInterrupt raised there cannot propagate and Python printed it as
    "Exception ignored in: ... Traceback ..." (seen on Ctrl-C as training started)."""
    script = textwrap.dedent("""
        import os, signal, sys, time, weakref
        import train_common
        from train_multi_gpu_using_launch import get_args_parser
        class Thing:
            pass
        def run(args, info):
            thing = Thing()
            def callback(ref):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler's KeyboardInterrupt is raised in here
            ref = weakref.ref(thing, callback)
            del thing  # runs the callback; Python can only print what it raises
            print("TRAINING GOES ON", flush=True)
            raise KeyboardInterrupt(train_common._signal_received)  # as the next step does
        train_common._run = run
        train_common.train(get_args_parser().parse_args(sys.argv[1:]))
    """)
    result = run([sys.executable, "-c", script, "--device", "cpu", "--output-dir",
                  str(tmp_path / "out"), "--eval-only"], timeout=120, PYTHONPATH=str(ROOT))
    assert result.returncode == 143, result.stderr[-3000:]
    assert "TRAINING GOES ON" in result.stdout and "interrupted by SIGTERM" in result.stderr
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, \
        result.stderr[-3000:]


def test_a_second_signal_during_the_clean_up_is_no_traceback(tmp_path):
    """torchrun signals a stopping rank again (its group, then the launcher's death signal): a
    signal that arrives while the rank is already stopping ends it quietly."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        import train_common
        from train_multi_gpu_using_launch import get_args_parser
        def run(args, info):
            raise KeyboardInterrupt("SIGTERM")  # the first signal, inside training
        def cleanup():
            os.kill(os.getpid(), signal.SIGTERM)  # the second one, in the clean-up
            time.sleep(0.5)
            print("CLEANUP GOES ON", flush=True)
        train_common._run, train_common.cleanup = run, cleanup
        train_common.train(get_args_parser().parse_args(sys.argv[1:]))
    """)
    result = run([sys.executable, "-c", script, "--device", "cpu", "--output-dir",
                  str(tmp_path / "out"), "--eval-only"], timeout=120, PYTHONPATH=str(ROOT))
    assert result.returncode == 143, result.stderr[-3000:]
    assert "interrupted by SIGTERM." in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "CLEANUP GOES ON" not in result.stdout  # ended at once, not raised into the clean-up


# ---------------------------------------------------------------- 6. the output folder is guarded
def test_earlier_run_without_checkpoint_is_never_overwritten(run_a, tmp_path, tiny_data,
                                                             train_here):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    (out / "checkpoint.pth").unlink()  # e.g. deleted to save space, or a copy without it
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1)))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err[-3000:]
    assert (f"{out} holds an earlier run (metrics.jsonl, model_best.pth, weights/) but no "
            "checkpoint.pth") in errors[0]
    assert "--resume none" in errors[0]
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before  # not one byte of the earlier run changed

    (out / "checkpoint.pth").mkdir()  # not a file: refused too, before anything is written
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1)))
    assert code == 2 and f"{out / 'checkpoint.pth'} is not a file" in err, err[-3000:]

    # Explicitly starting over is allowed.
    (out / "checkpoint.pth").rmdir()
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--resume", "none"))
    assert code == 0, err[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0]


def test_resuming_another_runs_checkpoint_into_a_run_folder_is_refused(run_a, tmp_path,
                                                                      tiny_data, train_here):
    out, other = tmp_path / "out", tmp_path / "other"
    shutil.copytree(run_a, out)
    shutil.copytree(run_a, other)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1), "--resume",
                                 str(other / "model_best.pth")))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err[-3000:]
    assert (f"{out} holds another run (metrics.jsonl, model_best.pth, weights/); resuming "
            f"{other / 'model_best.pth'} there would mix the two runs' files.") in errors[0]
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # The folder's own files may be resumed from (e.g. its best epoch).
    code, err = train_here(flags(tiny_data, out, "--epochs", str(EPOCHS + 1), "--keep-last", "1",
                                 "--resume", str(out / "model_best.pth")))
    assert code == 0, err[-3000:]


def test_keep_last_keeps_the_weights_just_saved_not_a_later_epochs(tmp_path):
    for epoch in range(6):  # a run that reached epoch 5, resumed from its epoch 2
        (tmp_path / f"model-{epoch}.pth").write_bytes(b"w")
    (tmp_path / "model-x.pth").write_bytes(b"not ours")
    removed = prune_weights(tmp_path, keep_last=2, newest=3)  # epoch 3 was just saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-2.pth", "model-3.pth",
                                                          "model-x.pth"]
    assert sorted(p.name for p in removed) == ["model-0.pth", "model-1.pth", "model-4.pth",
                                               "model-5.pth"]
    assert prune_weights(tmp_path, keep_last=0, newest=1) == []  # 0 keeps everything
    prune_weights(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-3.pth", "model-x.pth"]


_HOLD_LOCK = textwrap.dedent("""
    import fcntl, sys, time
    f = open(sys.argv[1], "w")
    f.write("4242\\n")
    f.flush()
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live run holds it
    print("locked", flush=True)
    time.sleep(120)
""")


def _lock_is_free(path: Path) -> bool:
    """Whether another process could take the run lock on ``path`` now."""
    probe = ("import fcntl, sys\ntry:\n    fcntl.lockf(open(sys.argv[1], 'a'), "
             "fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(1)")
    return subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 0


def test_second_run_on_a_busy_output_dir_is_refused(tmp_path, tiny_data, train_here):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err = train_here(flags(tiny_data, out, "--epochs", "1"))
    finally:
        holder.kill()
        holder.wait()
    assert code == 2, err[-3000:]
    assert f"another training run (pid 4242) is using --output-dir {out}" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    code, err = train_here(flags(tiny_data, out, "--epochs", "1"))  # the lock died with it
    assert code == 0, err[-3000:]
    assert (out / ".lock").read_text() == f"{os.getpid()}\n"


def test_the_run_lock_dies_with_the_run_not_with_its_forked_children(tmp_path):
    """DataLoader workers are forked from the rank: after a kill -9 of the rank they may live on
    for seconds, and a lock they inherited would refuse the immediate rerun."""
    import train_common

    out = tmp_path / "out"
    args = train_common.get_args_parser().parse_args(["--output-dir", str(out)])
    train_common._claim_output_dir(args, out)
    try:
        assert not _lock_is_free(out / ".lock")
        child = os.fork()
        if child == 0:  # a DataLoader worker, still alive when its rank is gone
            time.sleep(30)
            os._exit(0)
        try:
            train_common._release_output_dir()  # the rank dies (its descriptors close)
            assert _lock_is_free(out / ".lock")
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    finally:
        train_common._release_output_dir()


def test_batchnorm_over_two_values_per_channel_warns(tmp_path, tiny_data, train_here):
    """Batch 2 at 32 px: the last BatchNorm normalises 2 values per channel (drills saw val loss
    0.0000 and 2.7e9); 4 (the suite's batch 4) is the least that passes without a word."""
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--epochs", "1", "--batch-size", "2"))
    assert code == 0, err[-3000:]
    assert ("--batch-size 2 at --img-size 32: the last BatchNorm layers see only 2 values per "
            "channel, too few for usable statistics, so validation numbers will be meaningless; "
            "use --batch-size 4 or more, --sync-bn with several processes, or a larger "
            "--img-size.") in err
    code, err = train_here(flags(tiny_data, tmp_path / "four", "--epochs", "1"))
    assert code == 0 and "too few for usable statistics" not in err, err[-3000:]


@pytest.mark.parametrize("case", ["under-a-file", "missing-resume", "resume-folder",
                                  "eval-only-unfit-weights", "weights-is-a-file",
                                  "eval-only-resume-and-weights", "inside-the-data",
                                  "batch-1-at-32px", "missing-weights", "weights-folder",
                                  "weights-of-another-model", "lock-is-a-link", "lock-is-a-fifo",
                                  "lock-is-a-folder", "link-to-nowhere", "link-loop",
                                  "link-loop-above"])
def test_unusable_paths_are_one_error_line(case, run_a, tmp_path, tiny_data, train_here):
    out, extra = tmp_path / "out", []
    if case == "lock-is-a-link":  # in a shared folder: the run would overwrite someone's file
        victim = tmp_path / "notes.txt"
        victim.write_text("someone's notes")
        out.mkdir()
        (out / ".lock").symlink_to(victim)
        expect = f"{out / '.lock'} is a symbolic link, not the lock file a run writes; remove it."
    elif case in ("lock-is-a-fifo", "lock-is-a-folder"):
        out.mkdir()
        if case == "lock-is-a-fifo":
            os.mkfifo(out / ".lock")
        else:
            (out / ".lock").mkdir()
        what = "not a regular file" if case == "lock-is-a-fifo" else "a folder"
        expect = f"{out / '.lock'} is {what}, not the lock file a run writes; remove it."
    elif case == "link-to-nowhere":  # runs -> /scratch/me, /scratch not mounted
        (tmp_path / "runs").symlink_to(tmp_path / "scratch" / "me")
        out = tmp_path / "runs" / "a"
        expect = (f"--output-dir {out}: {tmp_path / 'runs'} is a symbolic link to "
                  f"{tmp_path / 'scratch' / 'me'}, which leads nowhere")
    elif case == "link-loop":
        out.symlink_to(out)
        expect = f"--output-dir {out}: {out} is a symbolic link to {out}, which leads nowhere"
    elif case == "link-loop-above":
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        out = tmp_path / "loop" / "a"
        expect = (f"--output-dir {out}: {tmp_path / 'loop'} is a symbolic link to "
                  f"{tmp_path / 'loop'}, which leads nowhere")
    elif case == "inside-the-data":  # the rerun would find the run's folder as a class
        tiny_data = shutil.copytree(tiny_data, tmp_path / "data")
        out, expect = tiny_data / "run", f"--output-dir {tiny_data / 'run'} is inside the data"
    elif case == "batch-1-at-32px":  # would fail in the first step's BatchNorm, as a traceback
        extra, expect = ["--batch-size", "1"], "--batch-size 1 at --img-size 32: the last BatchNorm"
    elif case == "under-a-file":
        (tmp_path / "file").write_text("x")
        out, expect = tmp_path / "file" / "run", "is (under) a file, not a folder"
    elif case == "missing-resume":
        extra, expect = ["--resume", str(tmp_path / "nope.pth")], "nope.pth does not exist"
    elif case == "resume-folder":
        extra = ["--resume", str(run_a)]
        expect = f"is a folder; give a file, e.g. {run_a / 'checkpoint.pth'}"
    elif case == "weights-is-a-file":  # found before an epoch is trained, not when saving it
        out.mkdir()
        (out / "weights").write_text("x")
        expect = f"{out / 'weights'} is not a folder"
    elif case == "missing-weights":  # found before the data scan, which may take minutes
        extra, expect = ["--weights", str(tmp_path / "nope.pth")], "nope.pth does not exist"
    elif case == "weights-folder":  # a run's folder where its file was meant
        extra = ["--weights", str(run_a / "weights")]
        expect = f"--weights {run_a / 'weights'} is a folder; give a file, e.g. {run_a / 'weights'}"
    elif case == "weights-of-another-model":  # fine-tuning too: only some tensors would fit
        extra = ["--weights", str(run_a / "checkpoint.pth"), "--model", "resnet34"]
        expect = (f"{run_a / 'checkpoint.pth'} was trained with --model resnet18 but this run "
                  "has --model resnet34; use --model resnet18.")
    elif case == "eval-only-resume-and-weights":  # which one to score would be a guess
        extra = ["--eval-only", "--resume", str(run_a / "checkpoint.pth"), "--weights",
                 str(run_a / "weights" / "model-0.pth")]
        expect = "--eval-only got both --resume"
    else:  # resnet18 weights evaluated as resnet34 would print a meaningless accuracy
        alone = Path(shutil.copy(run_a / "weights" / "model-0.pth", tmp_path / "w.pth"))
        extra = ["--eval-only", "--weights", str(alone), "--model", "resnet34"]
        expect = (f"--eval-only: {alone} does not fit --model resnet34 with 5 classes (96 of "
                  "the model's tensors are missing from it or have other shapes, e.g. "
                  "layer1.2.bn1.bias), so the accuracy would be meaningless")  # the tensors tell
    code, err = train_here(flags(tiny_data, out, *extra))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and expect in errors[0], err[-3000:]
    assert "Traceback" not in err
    if case in ("missing-weights", "weights-folder"):
        assert " images in " not in err, err[-3000:]  # before the scan's summary
    if case == "lock-is-a-link":
        assert victim.read_text() == "someone's notes"


@pytest.mark.parametrize("script, argv, name", [
    ("train", ["--resume", ""], "--resume"), ("train", ["--output-dir", ""], "--output-dir"),
    ("train", ["--data-path", ""], "--data-path/--data_path"),
    ("train", ["--weights", ""], "--weights"), ("train", ["--demo-dir", ""], "--demo-dir"),
    ("predict", ["--weights", "w.pth", ""], "IMAGE"), ("predict", ["--weights", "", "a.jpg"],
                                                       "--weights"),
    ("plot_results", ["", "--out-dir", "plots"], "RUN_DIR"),
    ("plot_results", ["runs/a", "--out-dir", ""], "--out-dir/--output-dir"),
    ("benchmark", ["--output-dir", ""], "--output-dir"),
])
def test_an_empty_path_is_refused_not_read_as_none(script, argv, name, capsys):
    """--resume "$CKPT" with CKPT unset would mean --resume none: the earlier run set aside and
    trained again; --output-dir "" would write the run into the current folder, and predict.py
    "" would classify everything under it."""
    import importlib

    module = importlib.import_module("train_common" if script == "train" else script)
    with pytest.raises(SystemExit) as info:
        module.get_args_parser().parse_args(argv)
    assert info.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.endswith(f"error: argument {name}: an empty path (an unset shell variable?); "
                         "give a path"), line


def test_a_demo_dataset_that_cannot_be_written_is_one_line(tmp_path, train_here):
    """A container user whose HOME cannot be written (OpenShift's random uid, HOME=/) runs the
    demo: its default cache folder cannot be made. (A file in the way stands in for the
    permissions: this suite may run as root.)"""
    (tmp_path / "home").write_text("not a folder")
    code, err = train_here([*TINY_FLAGS, "--output-dir", str(tmp_path / "out"),
                            "--demo-dir", str(tmp_path / "home" / "cache" / "demo")])
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].endswith(
        f"error: could not write the demo dataset to {tmp_path / 'home' / 'cache' / 'demo'} (Not "
        "a directory); pass --demo-dir (or set DDP_DEMO_DATA to) a folder you can write, or "
        "--data-path your own images."), errors[0]


def test_a_demo_run_without_a_home_folder_is_one_line(tmp_path, train_here, monkeypatch):
    """A container started with a user id the image does not know, and no HOME: Path.home()
    raised "RuntimeError: Could not determine home directory" (a traceback). (Path.home is
    stubbed: this suite may run as a user the database knows.)"""
    import benchmark

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    for name in ("HOME", "XDG_CACHE_HOME", "DDP_DEMO_DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    code, err = train_here([*TINY_FLAGS, "--output-dir", str(tmp_path / "out")])
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].endswith(
        "error: this user has no home folder to keep a cache in (HOME is not set, and the user "
        "database has no entry for this user); pass --demo-dir (or set DDP_DEMO_DATA to) a "
        "folder you can write, or --data-path your own images."), errors[0]
    with pytest.raises(ValueError, match=r"home folder .*; pass --image-dir a folder you can "
                                         r"write\.$"):
        benchmark.default_image_dir()


@pytest.mark.parametrize("where", ["folder", "run-files", "args"])
def test_an_unwritable_output_dir_is_one_line(where, tmp_path, tiny_data, train_here,
                                              monkeypatch):
    """A read-only mount (or another owner's folder) fails in the up-front probe; a file that
    cannot be written later (quota, permissions of one file) is one line too, not a traceback.
    (Injected: this suite may run as root, who writes into read-only folders.)"""
    import train_common

    out = tmp_path / "out"
    if where == "folder":
        def probe(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(train_common.tempfile, "TemporaryFile", probe)
        expect = f"cannot write to --output-dir {out}: Read-only file system"
    else:
        target = "plot_class_distribution" if where == "run-files" else "write_json_atomic"
        name = "class_distribution.png" if where == "run-files" else "args.json"

        def refuse(*args):
            path = next(a for a in args if isinstance(a, (str, os.PathLike)))
            if Path(path).name == name:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(*args)
        real = getattr(train_common, target)
        monkeypatch.setattr(train_common, target, refuse)
        expect = (f"could not write {out / name}: Permission denied; fix --output-dir {out} "
                  "(permissions, space), then run the same command again.")
    code, err = train_here(flags(tiny_data, out))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and expect in errors[0], err[-3000:]
    assert "Traceback" not in err
    assert not (out / "checkpoint.pth").exists() and not list(out.glob("weights/*"))


def test_missing_tensorboard_is_one_line_before_the_data_is_read(tmp_path, tiny_data, train_here,
                                                               monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--tensorboard"))
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "--tensorboard needs the tensorboard package" in errors[0]
    assert "pip install tensorboard, or pass --no-tensorboard." in errors[0]
    assert "training / " not in err  # refused before the data scan
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_resume_records_the_flags_it_kept_so_the_next_one_keeps_them_too(tmp_path, tiny_data,
                                                                          train_here):
    """A run started with --no-scale-lr --lr 0.01, resumed without those flags and with batch 8:
    the optimizer keeps 0.01 and the run's rule, and so must the checkpoint's and args.json's
    record, or the next resume (batch 4 again) would take --scale-lr as the run's rule and
    halve the lr."""
    out = tmp_path / "out"
    code, err = train_here(flags(tiny_data, out, "--epochs", "1", "--lr", "0.01",
                                 "--no-scale-lr"))
    assert code == 0, err[-3000:]
    code, err = train_here(flags(tiny_data, out, "--epochs", "2", "--batch-size", "8"))
    assert code == 0, err[-3000:]
    assert "the learning rate is kept (--no-scale-lr)" in err
    for record in (load_ckpt(out / "checkpoint.pth")["args"],
                   json.loads((out / "args.json").read_text())):
        assert (record["lr"], record["scale_lr"], record["batch_size"]) == (0.01, False, 8)
    code, err = train_here(flags(tiny_data, out, "--epochs", "3"))  # batch 4 again
    assert code == 0, err[-3000:]
    assert "the learning rate is kept (--no-scale-lr)" in err and "resuming keeps" in err
    lam = (1 + math.cos(2 * math.pi / 3)) / 2 * 0.9 + 0.1  # --lrf 0.1, epoch 2 of 3
    assert read_metrics(out)[-1]["lr"] == pytest.approx(0.01 * lam, rel=1e-9)
    # Nothing left to train: no word on a learning rate that will not be used.
    code, err = train_here(flags(tiny_data, out, "--epochs", "3", "--batch-size", "8"))
    assert code == 0 and "leaves nothing to train" in err, err[-3000:]
    assert "images per optimizer step" not in err


def test_accumulated_batches_scale_the_lr_like_processes(tmp_path, tiny_data, train_here,
                                                        monkeypatch):
    """1 process accumulating 2 batches takes the optimizer steps of 2 processes, so it trains
    with their learning rate: the rule a resume between the two follows too."""
    import train_common
    from multi_train_utils import train_eval_utils

    calls = []  # the real loop runs; its numerics are tested in test_distributed_correctness

    def recorded(*args, **kwargs):
        calls.append({k: kwargs[k] for k in ("grad_accum_steps", "clip_grad_norm")})
        return train_eval_utils.train_one_epoch(*args, **kwargs)

    monkeypatch.setattr(train_common, "train_one_epoch", recorded)
    code, err = train_here(flags(tiny_data, tmp_path / "a", "--epochs", "1",
                                 "--grad-accum-steps", "2", "--clip-grad-norm", "0.5"))
    assert code == 0, err[-3000:]
    assert calls == [{"grad_accum_steps": 2, "clip_grad_norm": 0.5}]  # the flags reach the loop
    assert ("batch 4 per process, 8 per optimizer step; lr 0.002 (--lr 0.001 x 2 accumulated "
            "batches)\n") in err
    assert read_metrics(tmp_path / "a")[0]["lr"] == pytest.approx(0.002, rel=1e-12)
    code, err = train_here(flags(tiny_data, tmp_path / "b", "--epochs", "1",
                                 "--grad-accum-steps", "2", "--no-scale-lr"))
    assert code == 0 and "; lr 0.001\n" in err, err[-3000:]
    assert read_metrics(tmp_path / "b")[0]["lr"] == pytest.approx(0.001, rel=1e-12)


def test_each_epoch_reshuffles_and_augments_anew(tmp_path, tiny_data, train_here, monkeypatch):
    """The training loop moves the sampler and the augmentations on each epoch: without
    set_epoch, DistributedSampler repeats epoch 0's order and every epoch sees the same crops."""
    import train_common
    from multi_train_utils import train_eval_utils

    seen = []  # what each epoch's loader yields, read as the loop is handed it

    def recorded(model, optimizer, data_loader, *args, **kwargs):
        seen.append(([i for batch in data_loader.batch_sampler for i in batch],
                     data_loader.dataset[0][0]))
        return train_eval_utils.train_one_epoch(model, optimizer, data_loader, *args, **kwargs)

    monkeypatch.setattr(train_common, "train_one_epoch", recorded)
    code, err = train_here(flags(tiny_data, tmp_path / "out", "--epochs", "2"))
    assert code == 0, err[-3000:]
    (order0, image0), (order1, image1) = seen
    assert sorted(order0) == sorted(order1) and order0 != order1
    assert not torch.equal(image0, image1)  # the same file, cropped and flipped anew


def test_each_rank_trains_on_its_own_share(tmp_path, tiny_data, monkeypatch):
    """Two ranks' training batches split the training set between them (no image trained
    twice per epoch) and follow one shuffled order, drawn from the seed, not from the rank."""
    import train_common

    args = get_args_parser().parse_args(flags(tiny_data, tmp_path / "out"))
    rank0 = _build_data(args, DistInfo(rank=0, world_size=2), tmp_path / "out")
    # Rank 1 is handed rank 0's scan, as the broadcast of a real process group would.
    monkeypatch.setattr(train_common, "_scan_on_rank0", lambda *a: rank0[0])
    rank1 = _build_data(args, DistInfo(rank=1, world_size=2), tmp_path / "out")
    train_set = rank0[2]
    assert list(rank1[2].images_path) == list(train_set.images_path)  # one split for both
    for epoch in (0, 1):
        shares = []
        for *_, sampler, loader, _ in (rank0, rank1):
            sampler.set_epoch(epoch)
            shares.append([i for batch in loader.batch_sampler for i in batch])
        assert len(shares[0]) == len(shares[1]) == len(train_set) // 8 * 4  # full batches of 4
        assert not set(shares[0]) & set(shares[1])
        # Interleaved, the two shares are one permutation of the training set.
        order = [i for pair in zip(*shares) for i in pair]
        assert order == torch.randperm(len(train_set), generator=torch.Generator().manual_seed(
            args.seed + epoch)).tolist()[:len(order)]


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_on_another_world_size_rescales_the_lr(run_a, tmp_path, tiny_data, train_here,
                                                      accum):
    out = tmp_path / "out"
    shutil.copytree(run_a, out)
    stale = [out / ".checkpoint.pth.k1ll3d.tmp", out / "weights" / ".model-3.pth.k1ll3d.tmp",
             out / "metrics.jsonl.tmp"]
    for path in stale:  # left by saves a kill -9 interrupted
        path.write_bytes(b"partial")
    epochs = EPOCHS + 1
    code, err = train_here(flags(tiny_data, out, "--epochs", str(epochs),  # 1 process, was 2
                                 "--grad-accum-steps", str(accum)))
    assert code == 0, err[-3000:]
    now = ("1 process(es) x batch 4 = 4 images per optimizer step: the learning rate is scaled "
           "by 0.5 to match (--scale-lr: linear scaling with the images per step); other images "
           "share an optimizer step than in an uninterrupted run." if accum == 1
           else "1 process(es) x batch 4 x 2 accumulated = 8 images per optimizer step: the "
           "learning rate is kept: the images per optimizer step are unchanged (--scale-lr).")
    assert (f"{out / 'checkpoint.pth'} was trained with 2 process(es) x batch 4 = 8 images per "
            f"optimizer step, this run has {now}\n") in err
    assert not any(path.exists() for path in stale)

    saved = load_ckpt(run_a / "checkpoint.pth")["args"]
    lam = lambda e: (1 + math.cos(e * math.pi / epochs)) / 2 * (1 - saved["lrf"]) + saved["lrf"]  # noqa: E731
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == list(range(epochs))
    # Linear scaling with the images per optimizer step: 1 process trains at half the 2-process
    # learning rate, on the new schedule, unless it accumulates 2 batches per step.
    assert metrics[-1]["lr"] == pytest.approx(saved["lr"] * accum * lam(EPOCHS), rel=1e-9)
    ckpt = out / "checkpoint.pth"
    assert load_ckpt(ckpt)["lr_scheduler"]["base_lrs"] == [pytest.approx(saved["lr"] * accum)]
    umask = os.umask(0)
    os.umask(umask)
    assert ckpt.stat().st_mode & 0o777 == 0o666 & ~umask  # readable by the team, as open() makes


@pytest.mark.parametrize("when", ["start-up", "training"])
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_ranks_stop_when_their_launcher_is_killed(launcher, when, tmp_path, tiny_data, launched):
    """kill -9 of the launcher: its ranks must not train on as orphans, whether they were
    training or still importing torch (seconds, before they can ask to die with it)."""
    out = tmp_path / "out"
    argv = flags(tiny_data, out, "--epochs", "50")
    cmd = (torchrun_cmd(2, LAUNCH, *argv) if launcher == "torchrun" else
           [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", "2", *argv])
    tree = launched(cmd)
    if when == "training":
        tree.wait_for(epochs_done(out, 1), "the first epoch")
        ranks = tree.children()
    else:  # the moment both ranks exist: they are still importing torch
        starting = tree.children if launcher == "torchrun" else lambda: _spawn_children(tree)
        tree.wait_for(lambda: len(starting()) >= 2, "two ranks")
        ranks = starting()
    assert ranks, tree.output()[-2000:]
    os.kill(tree.proc.pid, signal.SIGKILL)  # no chance to stop its ranks itself
    tree.wait_all_gone(60)  # no orphan trains on (fails with the survivors' pids)


FORK_PROBE = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import train_common
signal.signal(signal.SIGTERM, train_common._raise_keyboard_interrupt)
os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGTERM))  # arrives mid-fork
if {guard}:
    train_common._guard_forks()
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(2)
    print("the signal was lost")
except KeyboardInterrupt as exc:
    print("stopped by", exc)
"""


@pytest.mark.parametrize("guard", [True, False])
def test_a_stop_signal_during_a_fork_is_not_lost(tmp_path, guard):
    """A SIGTERM that arrived while a DataLoader forked its workers raised inside os.fork's
    at-fork callbacks, was printed as "Exception ignored" and lost: the run trained on (seen in
    the spawn Ctrl-C test). train() guards forks; the unguarded case shows what it prevents."""
    script = tmp_path / "fork_probe.py"
    script.write_text(FORK_PROBE.format(root=str(ROOT), guard=guard))
    proc = run([sys.executable, str(script)], timeout=60)
    if guard:
        assert proc.stdout.strip() == "stopped by SIGTERM", proc.stdout + proc.stderr
        assert "Exception ignored" not in proc.stderr
    else:
        assert proc.stdout.strip() == "the signal was lost" and "Exception ignored" in proc.stderr
