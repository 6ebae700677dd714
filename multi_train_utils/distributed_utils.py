"""Process-group set-up and the small rank helpers every training loop needs.

Every helper answers sensibly without a process group (rank 0, world size 1, value unchanged), so
``python train.py`` and ``torchrun --nproc_per_node=8 train.py`` run the same lines.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import re
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .guard import UserError, stop_signals_to

# Seconds a collective waits: after a slow phase, and else (docs/errors-and-troubleshooting.md).
LIMITS_S = (600.0, 120.0)
COMM_HOOKS = ("none", "bf16", "fp16")


class LaunchError(UserError):
    """The processes were started in a way that cannot work (one sentence, with the fix)."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job; read this, not attributes of ``args``."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    timeouts: tuple[float, float] = LIMITS_S

    @property
    def distributed(self) -> bool:  # a launcher's group of one counts: DDP needs the group
        return self.world_size > 1 or is_dist_avail_and_initialized()


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name, None if default is None else str(default))
    if text is None or not (text.strip().isdigit() and text.isascii()):
        raise LaunchError(f"environment variable {name}={text!r} is not a whole number; unset it "
                          "or start the processes with torchrun.")
    return int(text)


def _read_env() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) from the launcher's environment, or None if not launched."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:  # torchrun, or by hand
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if not rank < world_size:  # else the rendezvous would wait for its timeout
            raise LaunchError(f"rank {rank} is outside the world size {world_size} (0 to "
                              f"{world_size - 1}); start the processes with torchrun.")
        return rank, _env_int("LOCAL_RANK", 0), world_size
    if "SLURM_PROCID" not in os.environ or _env_int("SLURM_NTASKS", 1) == 1:
        return None
    # srun. What env:// reads: rank 0 runs on the first of the step's nodes (node[01-04],gpu7 ->
    # node01); every task derives the port from the job and step ids without talking, below
    # Linux's ephemeral ports (32768 on), which outgoing connections may hold.
    nodes = (os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
             or os.environ.get("SLURM_NODELIST") or "127.0.0.1")
    first = re.split(r",(?![^\[]*\])", nodes)[0]  # a comma outside brackets ends a name
    os.environ.setdefault("MASTER_ADDR", re.sub(r"\[([^\],\-]+)[^\]]*\]", r"\1", first))
    port = 20000 + (_env_int("SLURM_JOB_ID", 0) + 7919 * _env_int("SLURM_STEP_ID", 0)) % 12768
    os.environ.setdefault("MASTER_PORT", str(port))
    return _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID", 0), _env_int("SLURM_NTASKS")


def pick_device(device: str, local_rank: int = 0, launched: bool = False) -> torch.device:
    """``auto``/``cpu``/``cuda``/``cuda:N`` as a device; launched: the GPU of the local rank."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device, flags=re.ASCII):
        raise LaunchError(f"--device {device!r} is not one of auto, cpu, cuda or cuda:N.")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError(f"--device {device}, but CUDA is not available here; use --device cpu.")
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    gpu = int(device[5:]) if ":" in device and not launched else local_rank
    needed = max(gpu + 1, _env_int("LOCAL_WORLD_SIZE", 0) if launched else 0)
    if launched and "RANK" not in os.environ and count == 1 and visible.isdigit():
        gpu = 0  # SLURM --gpus-per-task=1 shows each task its own GPU, as device 0
    elif needed > count:  # every local rank stops, so none waits for the others alone
        who = f"local rank {needed - 1}" if launched else f"--device {device}"
        raise LaunchError(f"{who} has no GPU: only {count} visible (CUDA_VISIBLE_DEVICES="
                          f"{visible}); use one process per GPU (SLURM: --gpus-per-task=1).")
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _elastic_store(timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's store with keys of this start only (None outside torchrun): restarted workers
    meet in the same store, whose dead start's gloo addresses would time a plain env:// init out
    (torch 2.14). Agents of several machines count restarts differently, so there each rank counts
    its own starts (torchrun restarts every worker of every node together)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world,
                          is_master=not agent_hosts and rank == 0, timeout=timeout)
    if _env_int("GROUP_WORLD_SIZE", 1) == 1:
        return dist.PrefixStore(f"attempt{restart}", store)
    start = store.add(f"ddp-template/starts/world{world}/rank{rank}", 1)
    return dist.PrefixStore(f"start{start}-world{world}", store)


def tcp_address(dist_url: str) -> tuple[str, int] | None:
    """``--dist-url tcp://HOST:PORT`` as (HOST, PORT); None for ``env://`` (the launcher's)."""
    match = re.fullmatch(r"tcp://([^/]+):([0-9]{1,5})", dist_url)
    if dist_url != "env://" and not match:
        raise LaunchError(f"--dist-url {dist_url!r} is not 'env://' or 'tcp://HOST:PORT'.")
    return (match[1].strip("[]"), int(match[2])) if match else None  # [::1]: an IPv6 host


def init_distributed_mode(*, device: str | torch.device = "auto", dist_url: str = "env://",
                          timeout_s: float | None = None, trace_dir: str | None = None
                          ) -> DistInfo:
    """Create the default process group if a launcher started us; return where we are.
    ``device``: see :func:`pick_device`. ``timeout_s`` bounds every collective (a dead peer is an
    error, not a hang; None: :data:`LIMITS_S`, which a :class:`~.heartbeat.Heartbeat` applies by
    phase); NCCL's flight recorder dumps into ``trace_dir`` on a timeout."""
    env = _read_env()
    rank, local_rank, world_size = env or (0, 0, 1)
    # str().lower(): a classic script's args.device may hold torch.device("cpu") or "CPU".
    dev = pick_device(str(device).lower(), local_rank, launched=env is not None)
    limits = (timeout_s, timeout_s) if timeout_s else LIMITS_S
    if is_dist_avail_and_initialized():  # a second call: describe the group there is
        return DistInfo(get_rank(), local_rank, get_world_size(), dev, dist.get_backend(), limits)
    if env is None:
        return DistInfo(device=dev, timeouts=limits)
    if not tcp_address(dist_url) and not (os.environ.get("MASTER_ADDR")
                                          and _env_int("MASTER_PORT", 0)):
        raise LaunchError("RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not; "
                          "start the processes with torchrun.")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=limits[0])
    # PyTorch's flight recorder: each rank's last collectives, dumped on a timeout, unless
    # set up already (TORCH_FR_*, or the older TORCH_NCCL_TRACE_BUFFER_SIZE and kin).
    set_up = any(re.match(r"TORCH_(FR|NCCL_(TRACE|DUMP|DEBUG_INFO))_", k) for k in os.environ)
    if backend == "nccl" and trace_dir and not set_up:
        os.makedirs(trace := os.path.join(trace_dir, "flight_recorder"), exist_ok=True)
        os.environ.update(TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_DUMP_ON_TIMEOUT="1",
                          TORCH_FR_DUMP_TEMP_FILE=os.path.join(trace, "rank_"))
    # The rendezvous waits in C++, where Python's handlers would run only at its timeout,
    # if the peers never come: a stop signal ends it at once (nothing is written yet).
    with stop_signals_to(signal.SIG_DFL):
        store = _elastic_store(timeout) if dist_url == "env://" else None
        # device_id: NCCL connects now, so a set-up it refuses fails here, not later.
        dist.init_process_group(backend, init_method=None if store else dist_url,
                                store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, local_rank, world_size, dev, backend, limits)


def cleanup() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if is_dist_avail_and_initialized():
        dist.destroy_process_group()
        # Garbage cycles from DDP's backward hold gloo work; freed at interpreter shutdown, they
        # abort the process (a gloo thread needs the GIL then: pytorch#179291).
        gc.collect()


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
    """Sum (or mean) of ``value`` (any shape) over all ranks, on every rank, as a new detached
    tensor on its device; a Python float is reduced in float64 (float32 rounds 16777217.0)."""
    if not torch.is_tensor(value):
        value = torch.tensor(value, device=_collective_device(),
                             dtype=torch.float64 if isinstance(value, float) else None)
    out = value.detach().clone()  # a copy: all_reduce works in place
    if get_world_size() > 1:
        out = out.to(_collective_device())
        dist.all_reduce(out)
    out = out / get_world_size() if average else out
    return out.to(value.device)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank (pickled; unchanged in one process)."""
    box = [obj]
    if get_world_size() > 1:
        dist.broadcast_object_list(box, src=src, device=_collective_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    out: list[Any] = [obj] * get_world_size()
    if get_world_size() > 1:
        dist.all_gather_object(out, obj)
    return out


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank only if ``ok`` is true on every rank: around work that may fail on
    one rank, so the others stop too instead of waiting in the next collective."""
    return reduce_value(float(not ok), average=False).item() == 0


def run_on_main(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run by rank 0 alone, for work done once (a folder scan, a file
    written): every rank returns its value (pickled), or raises the error it raised (a
    :class:`UserError`, say), so no rank waits alone in the next collective."""
    outcome: tuple[bool, Any] = (True, None)
    if is_main_process():
        try:
            outcome = (True, fn(*args, **kwargs))
        except Exception as exc:
            outcome = (False, exc)
    ok, value = broadcast_object(outcome)  # rank 0 keeps its own object, traceback and all
    if not ok:
        raise value
    return value


def register_comm_hook(model: torch.nn.Module, name: str) -> None:
    """Compress a ``DistributedDataParallel`` model's gradient all-reduce to ``name`` (torch's
    ``bf16_compress_hook``/``fp16_compress_hook``); ``"none"`` keeps exact fp32, the default."""
    if name not in COMM_HOOKS:
        raise ValueError(f"comm hook {name!r} is not one of {', '.join(COMM_HOOKS)}.")
    if name != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(default_hooks, f"{name}_compress_hook")
        model.register_comm_hook(None, hook)  # None: the default process group


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on (affinity: a SLURM allocation, ``taskset``), fewer where a
    cgroup v2 ``cpu.max`` quota allows less time (``docker run --cpus``, a Kubernetes limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
        with open(os.path.join(cgroup, "cpu.max"), encoding="utf-8") as f:
            quota, period = f.read().split()  # "max 100000": no limit
        cpus = min(cpus or 1, math.ceil(int(quota) / int(period)))
    return max(1, cpus or 1)


def cpus_per_process() -> int:
    """This process's share of :func:`usable_cpus` for its threads and loader workers (>= 1):
    the processes of a machine share them (torchrun), unless SLURM gives each task its own."""
    cpus = usable_cpus()
    if "LOCAL_WORLD_SIZE" in os.environ:
        cpus //= max(1, _env_int("LOCAL_WORLD_SIZE"))
    elif "SLURM_CPUS_PER_TASK" in os.environ:
        cpus = min(cpus, _env_int("SLURM_CPUS_PER_TASK"))
    return max(1, cpus)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it, so two jobs never share one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
