"""Shared fixtures: tiny generated data, and the ways the suite starts training as users do.

- ``run``/``torchrun_cmd``: a command as a subprocess.
- ``plain``: ``python train_multi_gpu_using_launch.py ARGS`` in a process forked from one that
  has imported torch already, so each of the many runs does not pay the import again (4 s of
  CPU on 2 cores). The script still runs as ``__main__`` in a fresh process of its own;
  ``torchrun(plain, ...)`` and ``launcher(...)`` run a launcher or another script so (the ranks
  a launcher starts are fresh processes, as always).
- ``launched``: a launcher in its own process group, with every process ever seen below it
  recorded (from /proc) so a test can check that none is left, and teardown kills any that is.
- ``probe``: a wrapper run in place of the script that records, per rank, what DDP wrapped, what
  each DistributedSampler handed out and what each evaluate() returned.
- ``reference_run``: one uninterrupted 3-epoch torchrun run; resumed runs must end equal to it.
- ``STOPPER``/``make_stopper``: a signal sent at an exact optimizer step, or in an evaluation.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from demo_data import make_demo_data  # noqa: E402

# A shell without job control starts a command in the background with SIGINT and SIGQUIT ignored
# (POSIX), and a process keeps an ignored signal ignored (nohup ... &): so would every process a
# test starts. Tests signal them as from a terminal: give them a terminal's dispositions (a
# handler here becomes the default in a child after exec).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)

LAUNCH = "train_multi_gpu_using_launch.py"
SPAWN = "train_multi_gpu_using_spawn.py"
REFERENCE_EPOCHS = 3

# Small enough for 2 CPU cores: 32 px, resnet18, a couple of steps per epoch.
TINY_FLAGS = ["--device", "cpu", "--model", "resnet18", "--img-size", "32", "--batch-size", "4",
              "--workers", "0", "--print-freq", "2", "--no-tensorboard"]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a launched training process: one thread each, no stray rank variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "LOCAL_WORLD_SIZE") and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning", **extra)
    return env


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *extra]


def run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo root; output captured as text."""
    return subprocess.run(cmd, cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous the test starts itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flags(data: Path, out: Path, *extra: str, workers: int = 0) -> list[str]:
    """TINY_FLAGS (with ``workers`` loader workers), seed 0, data, output dir, then ``extra``."""
    base = list(TINY_FLAGS)
    base[base.index("--workers") + 1] = str(workers)
    return [*base, "--seed", "0", "--data-path", str(data), "--output-dir", str(out), *extra]


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


# A line the guard printed for the user: "error: ..." (logging may put "HH:MM:SS " in front).
_ERROR_LINE = re.compile(r"^(\d\d:\d\d:\d\d )?(\[rank \d+\] )?error: ")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if _ERROR_LINE.match(line)]


def assert_user_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, exactly one ``error:`` line holding every needle, no traceback."""
    text = res.stdout + res.stderr
    assert res.returncode == 2, f"exit {res.returncode}\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1, text[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_same_run(out, reference_out) -> None:
    """Each epoch once with the reference's numbers; its final weights and momentum exactly."""
    ours, ref = read_metrics(out), read_metrics(reference_out)
    keys = ("epoch", "train_loss", "val_acc", "val_loss", "lr")
    assert [{k: m[k] for k in keys} for m in ours] == [{k: m[k] for k in keys} for m in ref]
    final, expected = load_ckpt(out / "checkpoint.pth"), load_ckpt(reference_out / "checkpoint.pth")
    assert "in_epoch" not in final and final["epoch"] == expected["epoch"]
    assert_same_tensors(final["model"], expected["model"])
    momentum = [{k: s["momentum_buffer"] for k, s in c["optimizer"]["state"].items()}
                for c in (final, expected)]
    assert_same_tensors(*momentum)


def clone_run(src: Path, dst: Path, *, full: bool = False) -> Path:
    """A resumable copy of a run folder: its checkpoint and small files, or everything."""
    if full:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
        return dst
    dst.mkdir(parents=True)
    for name in ("checkpoint.pth", "args.json", "class_indices.json", "metrics.jsonl"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if (src / "shards").is_dir():  # an fsdp run's checkpoint.pth names its shards there
        shutil.copytree(src / "shards", dst / "shards")
    return dst


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """5 classes x 12 generated 32 px JPEGs (the demo generator, smaller)."""
    return make_demo_data(tmp_path_factory.mktemp("data") / "flowers", per_class=12, size=32)


@pytest.fixture(scope="session")
def reference_run(tiny_data, tmp_path_factory, plain) -> SimpleNamespace:
    """An uninterrupted 3-epoch run of 2 processes (--workers 0): the reference."""
    out = tmp_path_factory.mktemp("reference") / "run"
    # The stored file list trusts no folder changed in the last 2 s (image_folder._times): let
    # the data just made age as real data has, so later runs may reuse the list this run stores.
    newest = max(p.stat().st_ctime for p in [tiny_data, *tiny_data.iterdir()])
    time.sleep(max(0.0, newest + 2.1 - time.time()))
    res = ranks(plain, 2, LAUNCH, *flags(tiny_data, out, "--epochs", str(REFERENCE_EPOCHS)))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return SimpleNamespace(out=out, result=res, epochs=REFERENCE_EPOCHS)


# ---------------------------------------------------------------- tiers
# `make test` runs `pytest -m "not full"`: every test that runs in pytest's own process (the gloo
# ranks tests/dist_helpers.py forks included) and the training runs marked `fast`: 2 processes
# against 1, a stop and its exact continuation, the recipe. A `fast` test also pays for the shared
# runs it uses (reference_run: 3 epochs), so `fast` goes on tests of the runs already paid for.
# `make test-all` runs every test.
STARTS_TRAINING = {"plain", "sbatch"}  # fixtures that start training processes (sbatch: SLURM)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``full`` each test that starts training processes, unless it is marked ``fast``: one
    that uses ``plain`` (so ``ranks``, ``torchrun``, ``launched`` and ``reference_run`` too) or a
    SLURM job. A test that starts a run otherwise is marked ``full`` where it is defined."""
    for item in items:
        if STARTS_TRAINING & set(item.fixturenames) and not item.get_closest_marker("fast"):
            item.add_marker(pytest.mark.full)


# ---------------------------------------------------------------- plain python, forked
_DRIVER = r"""
import atexit, importlib, json, os, runpy, select, sys, traceback
root, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
try:  # what every run imports (torch, torchvision, the repo's modules): once, here
    importlib.import_module(os.path.splitext(script)[0])
except BaseException:
    pass  # the forked run imports it again and reports what is wrong
try:  # and what rank 0 of every fresh run draws, its class histogram: matplotlib and its fonts
    import io
    from matplotlib.figure import Figure
    Figure().subplots().set_title("warm").figure.savefig(io.BytesIO(), format="png")
except BaseException:
    pass


def run(case):
    code = 1
    try:
        os.setpgid(0, 0)  # a signal a test sends to the run reaches it alone
        os.chdir(case["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        out = os.open(case["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = out if case["stderr"] == case["stdout"] else os.open(
            case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.update(case["env"])
        sys.argv = [script, *case["argv"]]
        exec(compile(case["patch"], "<test patch>", "exec"), {"__name__": "test_patch"})
        runpy.run_path(os.path.join(root, script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# One case a line; several may run at once. Replies: {"pid"} for each case as it starts (in
# order), {"pid", "returncode"} as each ends.
running, eof = set(), False
while running or not eof:
    if select.select([] if eof else [sys.stdin], [], [], 0.05 if running else None)[0]:
        line = sys.stdin.readline()  # the next case is sent after this one's pid: one line
        eof = not line
        if line:
            pid = os.fork()
            if pid == 0:
                run(json.loads(line))
            running.add(pid)
            print(json.dumps({"pid": pid}), flush=True)
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            break
        running.discard(pid)
        print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}),
              flush=True)
"""


class Forked:
    """A process :class:`PlainPython` forked, with what ProcessTree uses of ``Popen``."""

    def __init__(self, pid: int, ended: queue.Queue) -> None:
        self.pid, self._ended, self.returncode = pid, ended, None

    def poll(self) -> int | None:
        if self.returncode is None and not self._ended.empty():
            self.returncode = self._ended.get()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._ended.get(timeout=timeout)
            except queue.Empty:
                raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


class PlainPython:
    """``python train_multi_gpu_using_launch.py ARGV`` without paying torch's import each time.

    ``patch`` is Python run in the fresh process before the script (e.g. a monkeypatch of
    ``torch.save``); ``env`` adds environment variables. Returns a CompletedProcess.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER, str(ROOT), LAUNCH],
                                     cwd=ROOT, env=child_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.started: queue.Queue = queue.Queue()
        self.ended: dict[int, queue.Queue] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            if "returncode" in reply:
                self._ended(reply["pid"]).put(reply["returncode"])
            else:
                self.started.put(reply["pid"])
        self.started.put(None)

    def _ended(self, pid: int) -> queue.Queue:
        with self.lock:
            return self.ended.setdefault(pid, queue.Queue())

    def start(self, argv: list[str], *, patch: str = "", cwd: Path | None = None,
              stdout: Path, stderr: Path, **env: str) -> Forked:
        """Fork a run (output to files) and return at once."""
        case = dict(argv=[str(a) for a in argv], patch=patch, env=env, cwd=str(cwd or ROOT),
                    stdout=str(stdout), stderr=str(stderr))
        with self.lock:  # one case, then its pid
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            try:
                pid = self.started.get(timeout=60)
            except queue.Empty:
                pid = None
        if pid is None:
            raise RuntimeError("the forking driver is gone")
        return Forked(pid, self._ended(pid))

    def __call__(self, argv: list[str], *, patch: str = "", timeout: float = 240,
                 cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
        self.count += 1
        stdout, stderr = (self.workdir / f"run{self.count}.{n}" for n in ("stdout", "stderr"))
        proc = self.start(argv, patch=patch, cwd=cwd, stdout=stdout, stderr=stderr, **env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(60)
            pytest.fail(f"python {LAUNCH} {' '.join(map(str, argv))} still running after "
                        f"{timeout:.0f}s:\n{stderr.read_text(errors='replace')[-3000:]}")
        return subprocess.CompletedProcess(
            [LAUNCH, *map(str, argv)], code, stdout.read_text(errors="replace"),
            stderr.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def plain(tmp_path_factory):
    driver = PlainPython(tmp_path_factory.mktemp("plain"))
    yield driver
    driver.close()


def launcher(name: str) -> str:
    """A ``plain`` patch: the forked process runs a launcher (or another script) in place of the
    training script, as ``python -m torch.distributed.run ARGV`` (``name`` a module) or ``python
    SPAWN ARGV`` would, and exits with its status. Only the launcher's own import of torch is
    saved: the ranks it starts are fresh processes, as always."""
    if name.endswith(".py"):
        start = (f"sys.argv[0] = {str(ROOT / name)!r}\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
    else:
        start = f"from {name} import main\nsys.argv[0] = {name!r}\nmain()"
    return f"import runpy, sys\n{start}\nsys.exit(0)\n"


TORCHRUN, LEGACY, SPAWNED = (launcher(name) for name in ("torch.distributed.run",
                                                         "torch.distributed.launch", SPAWN))


def torchrun(plain: PlainPython, nproc: int, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=NPROC ARGV``, by ``plain``
    (``kwargs``: its timeout and environment)."""
    return plain(["--standalone", f"--nproc_per_node={nproc}", *argv], patch=TORCHRUN, **kwargs)


def ranks(plain: PlainPython, nproc: int, script: str, *argv: str, timeout: float = 240,
          **env: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV`` as ``nproc`` ranks forked by ``plain``, with the variables torchrun
    sets: a job of several processes without torchrun, whose ranks import nothing (4 s each),
    for the runs that are not about torchrun. A rank that fails has the others killed after
    30 s (no launcher does it here). Output: every rank's, rank 0's first; ``codes``: each
    rank's exit status."""
    plain.count += 1
    env = dict(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), **env)
    files = [[plain.workdir / f"run{plain.count}.rank{r}.{n}" for n in ("stdout", "stderr")]
             for r in range(nproc)]
    procs = [plain.start(list(argv), patch=launcher(script), stdout=out, stderr=err,
                         RANK=str(r), LOCAL_RANK=str(r), **env)
             for r, (out, err) in enumerate(files)]
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 30):
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait(60)
            break
        time.sleep(0.1)
    res = subprocess.CompletedProcess([script, *argv], next((p.returncode for p in procs
                                                             if p.returncode), 0),
                                      *("".join(f.read_text(errors="replace") for f in kind)
                                        for kind in zip(*files)))
    res.codes = [p.returncode for p in procs]
    return res


# ---------------------------------------------------------------- process trees
def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ..., starttime at 19]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def proc_env(pid: int) -> dict[str, str]:
    """The environment a process was started with (empty if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class ProcessTree:
    """A launcher started in its own session (or process group), plus every process ever seen
    below it. ``python -m MODULE ARGV`` and ``python SCRIPT.py ARGV`` are forked by ``plain``,
    when given (the launcher's import of torch is saved); another command is started as is.

    Processes are identified by (pid, start time), so a recycled pid is never taken for ours.
    torchrun puts each worker in a session of its own, so killing the launcher's process group is
    not enough: ``kill_all`` kills every process recorded here.
    """

    def __init__(self, cmd: list[str], log_path: Path, plain: PlainPython | None = None,
                 **env: str) -> None:
        self.log_path, self._log = log_path, None  # a file, not a pipe: a full pipe would stall
        if plain and cmd[0] == sys.executable and (cmd[1] == "-m" or cmd[1].endswith(".py")):
            name, argv = (cmd[2], cmd[3:]) if cmd[1] == "-m" else (cmd[1], cmd[2:])
            log_path.touch()  # to read before the process opens it
            self.proc = plain.start(argv, patch=launcher(name), stdout=log_path,
                                    stderr=log_path, **env)
        else:
            self._log = open(log_path, "w")
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(**env), stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.root = (self.proc.pid, (_stat(self.proc.pid) or [None] * 20)[19])
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
        live = [p for p in self.refresh() if self.seen[p] == pid and self.alive(p)]
        return [p for p, _ in sorted(live, key=lambda p: (int(p[1]), p[0]))]

    @staticmethod
    def alive(ident: tuple[int, str]) -> bool:
        fields = _stat(ident[0])
        return fields is not None and fields[19] == ident[1] and fields[0] not in "ZX"

    def alive_seen(self) -> list[int]:
        return [pid for pid, start in self.seen if self.alive((pid, start))]

    def output(self) -> str:
        if self._log:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def fail(self, what: str) -> None:
        pytest.fail(f"{what}\n--- launcher output (tail) ---\n{self.output()[-4000:]}")

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.refresh()
            if self.proc.poll() is not None:
                self.fail(f"the run exited with {self.proc.returncode} before {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.1)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still running after {timeout:.0f}s")

    def wait_all_gone(self, timeout: float) -> float:
        """Seconds until the launcher and every recorded descendant have exited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is None:
                self.refresh()
            elif not self.alive_seen():
                return time.monotonic() - start
            time.sleep(0.1)
        self.fail(f"still running {timeout:.0f}s later: launcher "
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
            if self._log:
                self._log.close()


@pytest.fixture
def launched(tmp_path, plain):
    """``launched(cmd, **env)`` starts a ProcessTree; everything in it is killed at teardown."""
    trees: list[ProcessTree] = []

    def start(cmd: list[str], **env: str) -> ProcessTree:
        tree = ProcessTree(cmd, tmp_path / f"launcher-{len(trees)}.log", plain, **env)
        trees.append(tree)
        return tree

    yield start
    for tree in trees:
        tree.kill_all()


def epochs_done(out: Path, n: int) -> Callable[[], bool]:
    return lambda: len(read_metrics(out)) >= n


# ---------------------------------------------------------------- probe
_PROBE = r'''
"""Run argv[1:] as __main__, recording per rank what DDP wrapped, what each DistributedSampler
handed out and what each evaluate() returned (one JSON line each, in $PROBE_DIR/rankN.jsonl)."""
import hashlib, json, os, runpy, sys
sys.path.insert(0, __ROOT__)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
import multi_train_utils.train_eval_utils as train_eval_utils


def rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def record(kind, **fields):
    with open(os.path.join(os.environ["PROBE_DIR"], "rank%d.jsonl" % rank()), "a") as f:
        f.write(json.dumps(dict(kind=kind, rank=rank(), **fields)) + "\n")


def digest(model):
    h = hashlib.sha256()
    for name, t in getattr(model, "module", model).state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


ddp_init = DistributedDataParallel.__init__
def wrapped_ddp_init(self, module, *args, **kwargs):
    norms = {type(m).__name__ for m in module.modules() if "Norm" in type(m).__name__}
    record("ddp", norms=sorted(norms), world_size=dist.get_world_size(),
           find_unused=kwargs.get("find_unused_parameters", False))
    ddp_init(self, module, *args, **kwargs)
DistributedDataParallel.__init__ = wrapped_ddp_init

sampler_iter = DistributedSampler.__iter__
def wrapped_sampler_iter(self):
    indices = list(sampler_iter(self))
    record("sampler", shuffle=self.shuffle, epoch=self.epoch, size=len(self.dataset),
           sampler_rank=self.rank, indices=indices)
    return iter(indices)
DistributedSampler.__iter__ = wrapped_sampler_iter

evaluate = train_eval_utils.evaluate
def wrapped_evaluate(model, *args, **kwargs):
    result = evaluate(model, *args, **kwargs)
    record("eval", correct=int(result), num_samples=result.num_samples, top1=result.top1,
           counted=int(result.confusion.sum()), digest=digest(model),
           world_size=dist.get_world_size() if dist.is_initialized() else 1,
           node=os.environ.get("PROBE_NODE"))
    return result
train_eval_utils.evaluate = wrapped_evaluate

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def make_probe(folder: Path) -> SimpleNamespace:
    """``probe.script`` runs the script given after it with ``probe.env`` set;
    ``probe.records()`` -> {rank: [record, ...]}."""
    script = folder / "probe.py"
    script.write_text(_PROBE.replace("__ROOT__", repr(str(ROOT))))
    folder = folder / "records"
    folder.mkdir()

    def records() -> dict[int, list[dict]]:
        return {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
                for p in sorted(folder.glob("rank*.jsonl"))}

    return SimpleNamespace(script=str(script), env={"PROBE_DIR": str(folder)}, records=records)


@pytest.fixture
def probe(tmp_path) -> SimpleNamespace:
    return make_probe(tmp_path)


# ---------------------------------------------------------------- a signal at an exact step
STOPPER = r"""
# After this process's $STOP_AFTER-th optimizer step (or in its $STOP_AFTER-th evaluate(), with
# STOP_IN=eval), on rank $STOP_RANK (default 0) and only in a run's first attempt, sends
# $STOP_SIGNAL (default SIGTERM; "A,B": each in turn) to $STOP_TARGET: "self", "parent" (torchrun,
# which passes it on to every rank), "late" (self, then SIGTERM again during a C call of over a
# second, as in a long backward(): its handler runs after it) or "kill" (SIGKILL to self).
import os, signal, sys, threading, time
import torch
import multi_train_utils.train_eval_utils as _loop

_armed = [os.environ.get("RANK", "0") == os.environ.get("STOP_RANK", "0")
          and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"]
_steps, _evals, _in_eval = [0], [0], os.environ.get("STOP_IN") == "eval"

def _fire():
    _armed[0] = False
    target = os.environ.get("STOP_TARGET", "self")
    if target == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    for name in os.environ.get("STOP_SIGNAL", "SIGTERM").split(","):  # each handled in turn
        os.kill(os.getppid() if target == "parent" else os.getpid(), getattr(signal, name))
    if target == "late":
        eye = torch.eye(1000)
        started = time.perf_counter()
        torch.mm(eye, eye)
        calls = int(1.2 / (time.perf_counter() - started)) + 2  # a C call of ~1.2 s
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.perf_counter()
        torch.linalg.multi_dot([eye] * calls)
        print(f"stopper: a C call of {time.perf_counter() - started:.2f}s", file=sys.stderr)

_step, _evaluate = _loop._optimizer_step, _loop.evaluate

def _counted_step(*args, **kwargs):
    _step(*args, **kwargs)
    _steps[0] += 1
    if _armed[0] and not _in_eval and _steps[0] == int(os.environ["STOP_AFTER"]):
        _fire()

def _evaluate_then_stop(*args, **kwargs):
    _evals[0] += 1
    if _armed[0] and _in_eval and _evals[0] == int(os.environ["STOP_AFTER"]):
        _fire()
    return _evaluate(*args, **kwargs)

_loop._optimizer_step, _loop.evaluate = _counted_step, _evaluate_then_stop
"""


def make_stopper(folder: Path, patch: str = STOPPER, name: str = "stopper.py") -> str:
    """A script that runs the script after it with ``patch`` (:data:`STOPPER`) in place (for
    torchrun, which starts each rank from a script)."""
    script = folder / name
    script.write_text(f"import runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n{patch}\n"
                      "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    return str(script)
