"""Data-parallel training that starts its own processes: one per visible GPU, or N on CPU.

    python train_multi_gpu_using_spawn.py --data-path flower_photos          # every visible GPU
    CUDA_VISIBLE_DEVICES=0,3 python train_multi_gpu_using_spawn.py ...       # GPUs 0 and 3
    python train_multi_gpu_using_spawn.py --device cpu --world-size 2 ...    # 2 CPU processes

This file only starts the processes (a free port, the environment torchrun gives); each runs
the ``main`` of train_multi_gpu_using_launch.py. Ctrl-C or SIGTERM stops them all cleanly; if one
dies, the others are stopped and the launcher says which. For several machines use torchrun.
"""

import argparse
import logging
import multiprocessing
import os
import sys

import torch
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import find_free_port, tcp_address
from multi_train_utils.guard import EXIT_USER_ERROR, ConfigError, guarded, stop_signals_to
from multi_train_utils.run_folder import rerun_hint
from train_multi_gpu_using_launch import get_args_parser, main

log = logging.getLogger("spawn")


def worker(local_rank: int, args: argparse.Namespace, env: dict[str, str]) -> None:
    """One process: the variables torchrun would set, then the launcher's main."""
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    # A spawned process would start its DataLoader workers by spawn too, re-importing torch in
    # each (seconds apiece); start them the platform's default way, as torchrun's processes do.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    guarded(main, args, rerun_hint=lambda: rerun_hint(args.output_dir, args.resume))


def world_size_of(device: str, world_size: int | None) -> int:
    """--world-size, else one process per visible GPU, else 2 CPU processes."""
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    if device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda but no GPU is visible; use --device cpu.")
    if world_size and 0 < gpus < world_size:
        raise ConfigError(f"--world-size {world_size} but only {gpus} GPU(s) are visible; "
                          "lower it, or add --device cpu.")
    return world_size or gpus or 2


def launch(args: argparse.Namespace) -> None:
    world_size = world_size_of(args.device, args.world_size)  # logging: set up by guarded()
    # Where the processes meet: --dist-url tcp://HOST:PORT, else MASTER_ADDR/PORT, else any port.
    addr, port = tcp_address(args.dist_url) or (os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                int(os.environ.get("MASTER_PORT") or 0))
    port = port or find_free_port()
    # Every process reads the rendezvous from the environment, as under torchrun.
    env = dict(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=addr,
               MASTER_PORT=str(port), DDP_SPAWNED="1")
    args = argparse.Namespace(**{**vars(args), "world_size": world_size, "dist_url": "env://"})
    log.info("starting %d process(es), rendezvous at %s:%d", world_size, addr, port)
    context = mp.start_processes(worker, args=(args, env), nprocs=world_size, join=False,
                                 start_method="spawn")

    def forward(signum: int, frame: object) -> None:
        # Each process finishes the step the ranks agree on, saves it and exits (a second
        # signal: at once), as under torchrun, which passes signals on the same way.
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    try:
        with stop_signals_to(forward):  # ignored stays ignored (nohup ... &)
            while not context.join():
                pass
    except mp.ProcessExitedException as exc:
        # A user error (2) or a stop signal (128 + N): the process said what and how to go on.
        if exc.exit_code == EXIT_USER_ERROR or exc.exit_code > 128:
            sys.exit(exc.exit_code)
        how = f"signal {exc.signal_name}" if exc.signal_name else f"exit code {exc.exit_code}"
        log.error("error: process %d failed (%s); the others were stopped; %s.",
                  exc.error_index, how, rerun_hint(args.output_dir, args.resume))
        sys.exit(1)


if __name__ == "__main__":
    # The guard makes a flag mistake one "error: ..." line with exit code 2, as in each process.
    cli_args = get_args_parser().parse_args()
    guarded(launch, cli_args, rerun_hint=lambda: rerun_hint(cli_args.output_dir, cli_args.resume))
