"""Process-group set-up and the small rank helpers every training loop needs.

One code path serves one process and many: every helper answers sensibly (rank 0, world size 1,
value unchanged) when no process group exists, so ``python train.py`` and
``torchrun --nproc_per_node=8 train.py`` run the same lines.

Where the ranks come from, in order:

1. torchrun / ``torch.distributed.launch --use_env`` / our spawn launcher: ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
2. SLURM (``srun python train.py``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the
   master address is the first host of the step's nodes (``SLURM_STEP_NODELIST``) unless
   ``MASTER_ADDR`` is set.
3. Neither: a single process, no process group.

This package imports nothing from the training scripts beside it, so it can be copied alone.
"""

from __future__ import annotations

import datetime
import gc
import logging
import math
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0
WAIT_NOTICE_S = 60.0  # a rank still waiting for the others to join after this says so, and why


class LaunchError(RuntimeError):
    """The processes were started in a way that cannot work (one sentence, with the fix)."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (our code reads this, not attributes of ``args``)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_master_addr() -> str:
    """First host of the step's SLURM node list (``node[01-04],gpu7`` -> ``node01``).

    The step's, where rank 0 runs: a step of a sweep (``srun -N1 ... &``) may start on any node
    of the job's allocation, not on its first.
    """
    nodelist = (os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
                or os.environ.get("SLURM_NODELIST", ""))
    try:  # scontrol knows every node-list syntax; it exists wherever srun does
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0] if nodelist else "127.0.0.1"
    # Each bracket by its first entry: node[01-04] -> node01, n[1-2]-ib -> n1-ib.
    return re.sub(r"\[([^\],\-]+)[^\]]*\]", r"\1", first)


def _slurm_tasks_per_node() -> int:
    """The tasks of this SLURM step on each node when every node has as many (``4(x2)`` -> 4),
    else 0 (``2,1``: which entry is this node's is not said)."""
    counts = {re.sub(r"\(x\d+\)$", "", part)
              for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(",")}
    return int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else 0


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise LaunchError(f"environment variable {name}={text!r} is not a whole number; unset it "
                          "or start the processes with torchrun.") from None


def _read_env() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) from the launcher's environment, or None if not launched."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = _env_int("RANK"), _env_int("LOCAL_RANK", 0), _env_int("WORLD_SIZE")
        names = "RANK", "WORLD_SIZE"
    elif "SLURM_PROCID" in os.environ and _env_int("SLURM_NTASKS", 1) > 1:
        env = _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID", 0), _env_int("SLURM_NTASKS")
        names = "SLURM_PROCID", "SLURM_NTASKS"
        # Export what env:// rendezvous reads; the port is derived from the job and step ids so
        # every task of one step agrees without talking, while two jobs on one node, or two
        # steps of one allocation (a sweep of `srun ... &`), rarely collide.
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        step = _env_int("SLURM_STEP_ID", 0)
        # 20000-32767: below Linux's ephemeral ports (32768 on), which outgoing connections take.
        os.environ.setdefault("MASTER_PORT",
                              str(20000 + (_env_int("SLURM_JOB_ID", 0) + 7919 * step) % 12768))
    else:
        partial = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name in os.environ]
        if partial:  # two such processes would each train alone, as rank 0, on one output
            unset = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]

            def are(names: list[str]) -> str:
                return " and ".join(names) + (" is" if len(names) == 1 else " are")

            log.warning("%s set but %s not: this process runs alone, in no process group; start "
                        "the processes with torchrun, or unset %s.", are(partial), are(unset),
                        "it" if len(partial) == 1 else "them")
        return None
    rank, _, world_size = env
    if not 0 <= rank < world_size:
        raise LaunchError(f"{names[0]}={rank} is not a rank of {names[1]}={world_size} (0 to "
                          f"{world_size - 1}); start the processes with torchrun, or fix the "
                          "variables.")
    return env


def _check_rendezvous(dist_url: str) -> None:
    """Fail with one sentence where init_process_group would raise a traceback or hang."""
    if dist_url != "env://":
        try:
            parse_dist_url(dist_url)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise LaunchError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not; start the processes with "
                          "torchrun, export the address of rank 0, or pass --dist-url "
                          "tcp://HOST:PORT.")
    _env_int("MASTER_PORT")


def _pick_device(requested: str, local_rank: int, *, slurm_task: bool = False) -> torch.device:
    """The device of local rank ``local_rank``; on CUDA it becomes the current device.

    ``slurm_task``: srun started this process, and SLURM may have shown it only its own GPU.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError(f"--device {requested} was asked for, but CUDA is not available here; "
                           "use --device cpu (or auto).")
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    # Every local rank checks the whole machine, so all of them stop with the message, not only
    # those past the last GPU, who would leave the others waiting for them (torchrun sets
    # LOCAL_WORLD_SIZE; SLURM says the tasks per node of the step).
    needed = max(local_rank + 1,
                 _slurm_tasks_per_node() if slurm_task else _env_int("LOCAL_WORLD_SIZE", 0))
    if slurm_task and count == 1 and visible and "," not in visible:
        # Each task was given its own GPU (SLURM --gpus-per-task=1): it is device 0 here. Were
        # two tasks shown one shared GPU instead, NCCL refuses ("Duplicate GPU detected"), and
        # nccl_setup_error says so.
        local_rank = 0
    elif needed > count:
        raise LaunchError(f"local rank {needed - 1} has no GPU: only {count} visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                           "start one process per GPU (with SLURM: --gpus-per-task=1, or "
                           "--ntasks-per-node equal to the GPUs per node).")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _elastic_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A store namespaced by torchrun's restart attempt, or None outside torchrun.

    After ``torchrun --max-restarts`` restarts a failed group, the new workers reach the same
    agent store, which still holds the previous attempt's gloo addresses; a plain env:// init then
    fails in gloo's connectFullMesh with "Connection refused" to ports of the dead attempt (seen
    with torch 2.14.1). Prefixing every key with the attempt number keeps the attempts apart;
    every rank of the attempt must derive the same number.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]),
                          is_master=not agent_hosts and int(os.environ["RANK"]) == 0,
                          timeout=timeout)
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1:  # one node: one agent's count
        return dist.PrefixStore(f"attempt{restart}", store)  # adds the "/"
    # Several nodes: each agent counts restarts its own way (one whose workers did not fail
    # counts the round as no restart), so the counts disagree. But torchrun restarts every
    # worker of every node together, so every rank starts once per round: each counts its
    # own starts in the store.
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    start = store.add(f"ddp-template/starts/world{world}/rank{rank}", 1)
    return dist.PrefixStore(f"start{start}-world{world}", store)


def wait_for_port(addr: str, port: int, timeout_s: float) -> None:
    """Return once something listens at ``addr:port``; raise DistNetworkError after ``timeout_s``.

    TCPStore's own client connect retries inside C++: a Ctrl-C waits for it, and each failed try
    prints a C++ stack dump (about 40 lines for one timeout). Polled here, the wait is
    interruptible and quiet, and the store connects at once afterwards.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(2.0, timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise dist.DistNetworkError(
                    f"nothing answered at {addr}:{port} within {timeout_s:g}s "
                    f"({exc.strerror or type(exc).__name__})") from None
            time.sleep(0.25)


def wait_for_count(store: dist.Store, key: str, count: int, timeout_s: float = 10.0) -> None:
    """Poll until the counter ``key`` in ``store`` reaches ``count`` or ``timeout_s`` passes.

    The process hosting a store calls it before it exits with an error the others must read
    too: its exit takes the store down (a reader would get "connection reset" instead).
    """
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def agree_on_backend(store: dist.Store, rank: int, world_size: int, backend: str,
                     requested: str = "auto") -> None:
    """Return once every rank has checked in with the same backend; else raise LaunchError on
    every rank (within seconds).

    Each process picks its own backend from its own device: under ``--device auto`` a machine
    whose GPUs are missing or whose driver failed falls back to CPU and gloo, while the others
    use NCCL. The two backends never meet: both sides would wait out the whole timeout (30 min
    by default) at the rendezvous and then blame the network. Compared in ``store`` first (a
    few round trips per rank, whatever the world size), the mismatch is one sentence.
    """
    me = f"rank {rank} on {socket.gethostname()} uses {backend} (--device {requested})"
    first = store.compare_set("ddp-template/backend", "", f"{backend}|{me}").decode()
    if first.split("|", 1)[0] != backend:
        store.compare_set("ddp-template/backend-differs", "", me)  # the first to differ
    if store.add("ddp-template/backend-checked", 1) == world_size:
        store.set("ddp-template/backend-all-checked", "1")
    store.wait(["ddp-template/backend-all-checked"])  # a rank that never comes: the timeout
    if store.check(["ddp-template/backend-differs"]):
        other = store.get("ddp-template/backend-differs").decode()
        store.add("ddp-template/backend-read", 1)
        if rank == 0:  # it may host the store: it stays until every rank has read why
            wait_for_count(store, "ddp-template/backend-read", world_size)
        raise LaunchError(f"the processes disagree on the backend: {first.split('|', 1)[1]}, "
                          f"but {other}. Under --device auto a machine without a working GPU "
                          "falls back to CPU (gloo): fix its GPUs (nvidia-smi), or pass the same "
                          "--device cuda or cpu on every machine.")


def init_distributed_mode(args: Any = None, *, device: str | None = None,
                          dist_url: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Create the default process group if a launcher started us; return where we are.

    ``args`` (optional, as in the classic template) supplies ``device``, ``dist_url`` and
    ``dist_timeout`` when the keywords are not given. ``device``: ``auto``, ``cpu``, ``cuda`` or
    ``cuda:N`` (GPU N for one process; under a launcher each process takes the GPU of its local
    rank). Backend follows the device: NCCL for CUDA, gloo for CPU. ``timeout_s`` bounds every collective, so a dead peer ends in an error instead
    of a silent hang.

    Scripts written for the classic template call ``init_distributed_mode(args)`` and then read
    ``args.rank``, ``args.world_size``, ``args.gpu``, ``args.distributed`` and
    ``args.dist_backend``: given ``args``, those are set as it did (``args.gpu`` is the GPU
    index, for ``device_ids=[args.gpu]``; the local rank without CUDA; ``args.distributed``:
    a process group exists, also torchrun's group of one). New code reads the returned
    :class:`DistInfo` instead and passes no ``args``.
    """
    # Classic scripts may hold a torch.device or "CPU" there.
    device = str(device or getattr(args, "device", None) or "auto").lower()
    dist_url = dist_url or getattr(args, "dist_url", None) or "env://"
    timeout_s = timeout_s or getattr(args, "dist_timeout", None) or DEFAULT_TIMEOUT_S
    info = _init(device, dist_url, timeout_s)
    if args is not None:
        gpu = info.device.index if info.device.type == "cuda" else info.local_rank
        for name, value in (("rank", info.rank), ("world_size", info.world_size), ("gpu", gpu),
                            ("distributed", is_dist_avail_and_initialized()),
                            ("dist_backend", info.backend)):
            setattr(args, name, value)
    return info


def _parse_device(device: str) -> tuple[str, int | None]:
    """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as (kind, index or None)."""
    if device in ("auto", "cpu", "cuda"):
        return device, None
    if match := re.fullmatch(r"cuda:([0-9]+)", device):
        return "cuda", int(match.group(1))
    raise ValueError(f"device {device!r} is not one of auto, cpu, cuda or cuda:N (the backend "
                     "follows it: NCCL on CUDA, gloo on CPU).")


def _init(device: str, dist_url: str, timeout_s: float) -> DistInfo:
    device, index = _parse_device(device)
    env = _read_env()
    if is_dist_avail_and_initialized():  # called again (by a helper, say): the group there is
        local_rank = env[1] if env else 0
        return DistInfo(rank=dist.get_rank(), local_rank=local_rank,
                        world_size=dist.get_world_size(),
                        device=_pick_device(device, index if env is None and index is not None
                                            else local_rank),
                        backend=dist.get_backend())
    if env is None:  # one process: cuda:N is GPU N
        if index is not None and torch.cuda.is_available() and index >= torch.cuda.device_count():
            raise LaunchError(f"--device cuda:{index} was asked for, but only "
                              f"{torch.cuda.device_count()} GPU(s) are visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}).")
        return DistInfo(device=_pick_device(device, index or 0))
    rank, local_rank, world_size = env
    if index is not None and local_rank == 0:
        log.warning("--device cuda:%d: under a launcher each process uses the GPU of its local "
                    "rank, so the index is not used; choose the GPUs with CUDA_VISIBLE_DEVICES.",
                    index)
    dev = _pick_device(device, local_rank, slurm_task="RANK" not in os.environ)
    if world_size == 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return DistInfo(rank=rank, local_rank=local_rank, device=dev)
    # A launcher's group of one (torchrun --nproc_per_node=1) is a group too, as in the classic
    # template: scripts written for it create a DistributedSampler, a barrier or DDP regardless.

    _check_rendezvous(dist_url)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    notice = _waiting_notice(rank, world_size, dist_url, timeout_s)
    try:
        store = _elastic_store(timeout) if dist_url == "env://" else None
        if store is None:  # the rendezvous init_process_group would do, with its key prefix
            if rank != 0 and dist_url == "env://":  # rank 0 hosts the store: wait for it quietly
                wait_for_port(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              timeout_s)
            rendezvoused, _, _ = next(dist.rendezvous(dist_url, rank, world_size,
                                                      timeout=timeout))
            rendezvoused.set_timeout(timeout)
            store = dist.PrefixStore("default_pg", rendezvoused)
        agree_on_backend(store, rank, world_size, backend, requested=device)
        # device_id binds the group to this GPU: NCCL connects here, so a set-up it refuses
        # fails now, not at the first collective, and barrier() knows its device.
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=dev if dev.type == "cuda" else None, store=store)
    finally:
        notice.cancel()
    log.debug("rank %d/%d (local %d) on %s with %s", rank, world_size, local_rank, dev, backend)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev,
                    backend=backend)


def _waiting_notice(rank: int, world_size: int, dist_url: str,
                    timeout_s: float) -> threading.Timer:
    """A started timer that says, after ``WAIT_NOTICE_S``, that this rank still waits for the
    others and what commonly keeps them away; cancel it once the group exists.

    Without it a rank whose peers never come is silent for --dist-timeout (30 minutes): the
    commonest case, a SLURM batch script that runs the script without srun, is one process
    that reads SLURM_NTASKS=N and waits for N - 1 that nobody starts.
    """
    at = (f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
          if dist_url == "env://" else dist_url)
    cause = ("under SLURM every task runs the script: start it with srun (in an sbatch script, a "
             "plain python command is one process)" if "RANK" not in os.environ else
             "start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, reachable "
             "from all")
    timer = threading.Timer(WAIT_NOTICE_S, log.warning, args=(
        "rank %d of %d has waited %.0f s for the other processes to join at %s (it gives up after "
        "--dist-timeout %.0f s); %s.", rank, world_size, WAIT_NOTICE_S, at, timeout_s, cause))
    timer.daemon = True  # never keeps the process alive
    timer.start()
    return timer


def cleanup() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if is_dist_avail_and_initialized():
        dist.destroy_process_group()
        # Garbage cycles left by DDP's backward still hold gloo work objects that carry Python
        # state; freed during interpreter shutdown, one of gloo's threads then needs the GIL and
        # aborts the process ("terminate called without an active exception", exit -6, in about
        # 1 of 3 torchrun runs of example_own_project.py on a busy 2-core machine; the crash of
        # pytorch/pytorch#179291). Collected here, while Python is fully alive, they go quietly.
        gc.collect()


# What gloo and NCCL say when a peer is gone or stuck (they raise plain RuntimeErrors).
_PEER_FAILURE = re.compile(r"gloo/|ProcessGroup|NCCL|Connection (closed|reset) by peer|"
                           r"Timed out waiting .* for (send|recv)|caused pair closure|"
                           r"Socket Timeout", re.IGNORECASE)


def peer_failure(exc: BaseException) -> str | None:
    """The short reason if ``exc`` is a collective that failed because another rank died or hung
    (e.g. ``"Connection reset by peer"``), else None.

    The raw message starts with a C++ source path and ends with advice that sends the user to
    "the logs of the remote worker"; the middle is what matters.
    """
    text = str(exc)
    if nccl_setup_error(exc) or (not isinstance(exc, getattr(dist, "DistError", ()))
                                 and not _PEER_FAILURE.search(text)):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", first)
    return first.split(" This is typically")[0].rstrip(". ")[:240]


# NCCL's results for a set-up it refuses; they come from every start, unlike a dead peer's.
_NCCL_SETUP = re.compile(r"ncclInvalidUsage|ncclInvalidArgument|ncclUnhandledCudaError|"
                         r"Duplicate GPU detected")


def nccl_setup_error(exc: BaseException) -> str | None:
    """NCCL's own reason if ``exc`` says the run is set up wrong, else None.

    E.g. two ranks on one GPU: ``"Duplicate GPU detected : rank 1 and rank 0 both on CUDA device
    1a000"``, the line after "Last error:" in the message. Running again would fail the same way,
    so this is not :func:`peer_failure`.
    """
    text = str(exc)
    if not _NCCL_SETUP.search(text):
        return None
    last = re.search(r"Last error:\s*(\S.*)", text)
    reason = last.group(1) if last else _NCCL_SETUP.search(text).group(0)
    return reason.strip().rstrip(".")[:240]


def is_dist_avail_and_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def _collective_device() -> torch.device:
    # NCCL only moves CUDA tensors, gloo only CPU ones; never assume "cuda".
    if is_dist_avail_and_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_value(value: torch.Tensor | float, average: bool = True) -> torch.Tensor:
    """Sum (or mean, with ``average``) of ``value`` over all ranks, returned on every rank.

    A new detached tensor on the input's device, whatever device the backend reduces on (NCCL
    refuses a CPU tensor, such as a count built with ``torch.tensor(n)``), of the same type in
    one process as in many: a mean of integers is float. The input is not modified. A Python
    float is reduced in float64 (float32 would round 16777217.0).
    """
    if not torch.is_tensor(value):
        value = torch.tensor(value, device=_collective_device(),
                             dtype=torch.float64 if isinstance(value, float) else None)
    with torch.no_grad():
        out = value.detach().clone()
        if get_world_size() > 1:
            out = out.to(_collective_device())
            dist.all_reduce(out)
        if average:  # true division: a mean of integer counts is fractional
            out = out / get_world_size()
    return out.to(value.device)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """``obj`` as held by rank ``src``, on every rank (unchanged in one process)."""
    if get_world_size() < 2:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_collective_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if get_world_size() < 2:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank only if ``ok`` is true on every rank.

    Use it around work that may fail on one rank (loading a file, checking data) so the others
    raise too instead of waiting forever in the next collective.
    """
    if get_world_size() < 2:
        return ok
    flag = torch.tensor([0 if ok else 1], device=_collective_device())
    dist.all_reduce(flag)
    return flag.item() == 0


# Gradient compression for DDP's all-reduce, from torch's own hooks. Off by default: it
# rounds every gradient to 16 bits, so results differ (slightly) from a single process on the
# union of the batches. Worth it where the all-reduce, not the compute, bounds the step (gloo over
# TCP; GPUs without NVLink). On 2 CPU ranks here it halved the bytes and raised the scaling
# efficiency from ~0.63 to ~0.71 (README, "Speed").
COMM_HOOKS = ("none", "bf16", "fp16")


def register_comm_hook(model: torch.nn.Module, name: str) -> None:
    """Compress ``model``'s (a ``DistributedDataParallel``) gradient all-reduce to ``name``.

    ``"bf16"``/``"fp16"`` cast each bucket to 16 bits, all-reduce the mean and cast back
    (``default_hooks.bf16_compress_hook``/``fp16_compress_hook``); ``"none"`` keeps DDP's exact
    fp32 all-reduce.
    """
    if name not in COMM_HOOKS:
        raise ValueError(f"comm hook {name!r} is not one of {', '.join(COMM_HOOKS)}.")
    if name == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    model.register_comm_hook(None, hook[name])  # None: the default process group


def processes_on_node() -> int:
    """The run's processes on this machine, as the launcher says (torchrun and the spawn launcher
    ``LOCAL_WORLD_SIZE``, SLURM the step's tasks per node); 1 when it does not say."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return max(1, _env_int("LOCAL_WORLD_SIZE"))
    if "SLURM_PROCID" in os.environ:
        return max(1, _slurm_tasks_per_node())
    return 1


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup"
                     ) -> float | None:
    """The CPU time per second this process's cgroup may use (``docker run --cpus``, a
    Kubernetes CPU limit), or None without a limit (or off Linux).

    A quota does not shrink the CPU set: a pod limited to 4 CPUs on a 64-core node sees 64, and
    64 threads share 4 CPUs' time, throttled together (2 threads under a 1-CPU quota trained at
    0.6x of 1 thread here). Reads cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` of the process's cgroup and its ancestors: the smallest wins. Inside a
    container the cgroup folder may be mounted as the root while ``own`` names the host's path:
    then the root's is read.
    """
    limits = [limit for folder in cgroup_folders("cpu", root, own)
              if (limit := _read_cpu_max(folder) or _read_cfs(folder))]
    return min(limits) if limits else None


def cgroup_folders(controller: str, root: str = "/sys/fs/cgroup",
                   own: str = "/proc/self/cgroup") -> list[str]:
    """The folders of this process's cgroup that may hold ``controller``'s files, then those of
    its ancestors up to the tree's root (cgroup v2's one tree, or v1's tree of ``controller``);
    some may not exist. Empty off Linux."""
    try:
        with open(own, encoding="utf-8") as f:
            entries = [line.split(":", 2) for line in f.read().splitlines() if line.count(":") >= 2]
    except OSError:
        return []
    folders: dict[str, None] = {}
    for _, controllers, path in entries:
        if not controllers:  # cgroup v2: one tree
            bases = [root]
        elif controller in controllers.split(","):  # v1: the controller's tree ("cpu,cpuacct")
            bases = [os.path.join(root, controllers), os.path.join(root, controller)]
        else:
            continue
        for base in dict.fromkeys(bases):
            folder = os.path.normpath(os.path.join(base, path.lstrip("/")))
            while True:  # the cgroup, then each ancestor up to the tree's root
                folders[folder] = None
                if len(folder) <= len(base):
                    break
                folder = os.path.dirname(folder)
    return list(folders)


def cgroup_limit_hits(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup"
                      ) -> dict[str, int]:
    """How often, so far, a process limit refused this process's cgroup a new process or thread
    (``pids``: ``docker run --pids-limit``, Kubernetes' pod pids limit, counted by the cgroup
    that sets it: this one or the nearest ancestor with a limit), and how many processes of this
    cgroup the out-of-memory killer stopped (``oom_kill``: its own count, so another job's kills
    on a shared host are not). Counters only: compare two readings to tell why a process died.
    """
    def count(folder: str, name: str, key: str) -> int:  # "max 3" in pids.events
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) == 2 and fields[0] == key:
                        return int(fields[1])
        except (OSError, ValueError):
            pass
        return 0

    refused = 0
    for folder in (f for f in cgroup_folders("pids", root, own) if os.path.isdir(f)):
        refused += count(folder, "pids.events", "max")
        try:
            with open(os.path.join(folder, "pids.max"), encoding="utf-8") as f:
                if f.read().strip() != "max":
                    break  # the limit that applies: the ancestors' counts are other jobs'
        except OSError:
            pass
    mine = next((f for f in cgroup_folders("memory", root, own) if os.path.isdir(f)), None)
    killed = 0 if mine is None else (count(mine, "memory.events", "oom_kill") or
                                     count(mine, "memory.oom_control", "oom_kill"))
    return {"pids": refused, "oom_kill": killed}


def _read_cpu_max(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max"), encoding="utf-8") as f:
            quota, period = f.read().split()  # "max 100000": no limit
        return int(quota) / int(period) if quota != "max" else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_cfs(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us"), encoding="utf-8") as f:
            quota = int(f.read())  # -1: no limit
        with open(os.path.join(folder, "cpu.cfs_period_us"), encoding="utf-8") as f:
            period = int(f.read())
        return quota / period if quota > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """The CPU set this process may run on (at least 1), or fewer where a CPU quota
    (:func:`cgroup_cpu_limit`, rounded up) allows less time than that set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_limit()
    return min(cpus or 1, math.ceil(quota)) if quota is not None else cpus or 1


def cpus_per_process() -> int:
    """The CPUs this process may use for its threads and DataLoader workers (at least 1).

    Counts the CPU set the process may run on (a SLURM allocation or container limit, not the
    whole host as ``os.cpu_count()`` does), or fewer where a CPU quota allows less time than
    that set (:func:`cgroup_cpu_limit`, rounded up). torchrun and the spawn launcher start
    ``LOCAL_WORLD_SIZE`` processes on a node that share that set; SLURM gives each task its own
    ``SLURM_CPUS_PER_TASK``, or else the node's ``SLURM_CPUS_ON_NODE`` shared by its tasks.
    """
    cpus = usable_cpus()
    if "LOCAL_WORLD_SIZE" in os.environ:
        cpus //= max(1, _env_int("LOCAL_WORLD_SIZE"))
    elif "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, _env_int("SLURM_CPUS_PER_TASK"))
    elif "SLURM_LOCALID" in os.environ:  # srun tasks that may share the node's CPUs unbound
        tasks = re.match(r"\d+", os.environ.get("SLURM_TASKS_PER_NODE", "1"))  # e.g. "4(x2)"
        on_node = _env_int("SLURM_CPUS_ON_NODE", cpus)
        cpus = min(cpus, on_node // max(1, int(tasks.group()) if tasks else 1))
    return max(1, cpus)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it, so two jobs never share one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def parse_dist_url(url: str) -> tuple[str, int] | None:
    """``tcp://HOST:PORT`` -> (HOST, PORT); None for ``env://``."""
    if url == "env://":
        return None
    match = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", url)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"--dist-url {url!r} is not 'env://' or 'tcp://HOST:PORT' (PORT 1 to "
                         "65535).")
    return match.group(1), int(match.group(2))


def set_launch_env(rank: int, local_rank: int, world_size: int, master_addr: str,
                   master_port: int, extra: Sequence[tuple[str, str]] = ()) -> None:
    """Export what torchrun would, so a spawned process takes the same env:// path."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
                       "MASTER_PORT": str(master_port)})
    os.environ.update(dict(extra))
