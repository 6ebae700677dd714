"""Run a function on N gloo ranks on CPU and collect what each rank returns.

Workers are *forked*: a spawned child re-imports torch (several seconds each on a busy 2-core
machine), while a forked one starts at once and inherits the models and tensors the test built,
so nothing has to be pickled. Each worker sets one intra-op thread before touching torch, which
keeps a forked OpenMP runtime out of trouble and two ranks from fighting over two cores.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import find_free_port

# A rank that never reaches a collective makes its peers fail after this long, not hang pytest.
COLLECTIVE_TIMEOUT_S = 90


def run_ranks(fn: Callable[..., Any], world_size: int, out_dir: Path, *args: Any) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``.

    Each call runs in its own process, inside a gloo process group of ``world_size`` ranks on a
    free localhost port. A rank that raises makes this raise (with the rank's traceback).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = find_free_port()
    mp.start_processes(_worker, args=(fn, world_size, port, str(out_dir), args),
                       nprocs=world_size, join=True, start_method="fork")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
            for rank in range(world_size)]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str,
            args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # every rank finished its collectives before any group is torn down
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def flat_state(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter and buffer of ``module`` (state-dict order) as one float64 vector."""
    return torch.cat([t.detach().double().reshape(-1) for t in module.state_dict().values()])


__all__ = ["run_ranks", "flat_state", "COLLECTIVE_TIMEOUT_S"]
