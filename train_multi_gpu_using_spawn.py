"""Data-parallel training that starts its own processes: one per visible GPU, or N on CPU.

    python train_multi_gpu_using_spawn.py --data-path flower_photos          # every visible GPU
    CUDA_VISIBLE_DEVICES=0,3 python train_multi_gpu_using_spawn.py ...       # GPUs 0 and 3
    python train_multi_gpu_using_spawn.py --device cpu --world-size 2 ...    # 2 CPU processes
    # two machines, 8 GPUs each (run on both, node-rank 0 and 1):
    python train_multi_gpu_using_spawn.py --nnodes 2 --node-rank 0 --dist-url tcp://HOST:PORT ...

A free port is picked unless --dist-url or MASTER_PORT gives one. Every child runs the same
worker as the torchrun launcher (``train_common.train``). If a child dies the others are stopped
and the launcher exits non-zero; Ctrl-C or SIGTERM stops every child cleanly.
"""

import argparse
import datetime
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import (find_free_port, parse_dist_url, set_launch_env,
                                                 wait_for_count, wait_for_port)
from train_common import die_with_launcher, rerun_hint, train
from train_common import get_args_parser as _common_parser

log = logging.getLogger("spawn")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    return _common_parser(add_help=add_help, launcher="spawn")


def _worker(local_rank: int, args: argparse.Namespace, nprocs: int, addr: str, port: int,
            launcher_pid: int, launcher_hosts_store: bool) -> None:
    extra = [("LOCAL_WORLD_SIZE", str(nprocs))]
    if launcher_hosts_store:  # node 0's launcher serves addr:port (_meet_other_nodes)
        extra.append(("TORCHELASTIC_USE_AGENT_STORE", "True"))
    set_launch_env(rank=args.node_rank * nprocs + local_rank, local_rank=local_rank,
                   world_size=args.nnodes * nprocs, master_addr=addr, master_port=port,
                   extra=extra)
    # A spawned rank inherits "spawn" as its start method, so its DataLoader workers would
    # re-import torch each (about 7 s apiece on 2 cores, billed to epoch 0); start them the
    # platform's default way, as torchrun's ranks do.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    # The pid from the launcher itself: this child spent seconds importing torch before it got
    # here, and a launcher killed meanwhile would go unnoticed by a getppid() read now.
    die_with_launcher(launcher_pid)
    train(args)


def _fail(message: str) -> NoReturn:
    """A usage error found before any process starts: one line, exit code 2."""
    log.error("error: %s", message)
    sys.exit(2)


def _processes_per_node(args: argparse.Namespace) -> int:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        _fail("--device cuda was asked for, but CUDA is not available here; use --device cpu "
              "(or auto).")
    gpus = torch.cuda.device_count() if use_cuda else 0
    nprocs = args.world_size or gpus or 2
    if use_cuda and nprocs > gpus:
        _fail(f"--world-size {nprocs} but only {gpus} GPU(s) are visible "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
              "lower --world-size or use --device cpu.")
    return nprocs


def _rendezvous(args: argparse.Namespace) -> tuple[str, int]:
    """(address, port) of rank 0's store: --dist-url, else MASTER_ADDR/PORT, else a free port."""
    if args.dist_url != "env://":
        try:
            return parse_dist_url(args.dist_url)
        except ValueError as exc:
            _fail(str(exc))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        try:
            return addr, int(os.environ["MASTER_PORT"])
        except ValueError:
            _fail(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number; unset it to "
                  "use a free one.")
    if args.nnodes > 1:
        _fail("with --nnodes > 1 every node needs the same address: pass --dist-url "
              "tcp://HOST:PORT (HOST = node 0).")
    return addr, find_free_port(addr)


def _meet_other_nodes(args: argparse.Namespace, nprocs: int, addr: str,
                      port: int) -> dist.TCPStore:
    """--nnodes > 1: every node's launcher checks in at node 0's store before its processes
    start, and all stop with one line unless every node starts the same number of them.

    Each node counts its own GPUs, and global ranks assume one count: with 8 GPUs on one machine
    and 7 on another (one failed), the ranks would claim overlapping numbers and wait out
    --dist-timeout (30 min) at the rendezvous. Node 0's launcher keeps hosting the store for the
    run, as torchrun's agent does: its processes connect to it as clients
    (TORCHELASTIC_USE_AGENT_STORE), so the port has one owner from start to end.
    """
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    # On failure the store is dropped before exiting: the SystemExit's traceback holds this
    # frame, and a store it kept alive would keep hosting (a thread) in a caller that goes on.
    store = None
    deadline = time.monotonic() + args.dist_timeout
    keys = [f"ddp-template/spawn/node{n}" for n in range(args.nnodes)]
    try:
        log.info("waiting for the other node(s) at %s:%d", addr, port)
        # Waits polled from Python, not inside C++: Ctrl-C stops them at once.
        if args.node_rank != 0:
            wait_for_port(addr, port, args.dist_timeout)
        store = dist.TCPStore(addr, port, is_master=args.node_rank == 0, timeout=timeout,
                              wait_for_workers=False)
        if store.add(f"ddp-template/spawn/claims{args.node_rank}", 1) > 1:
            store = None
            _fail(f"another launcher already checked in as --node-rank {args.node_rank} at "
                  f"{addr}:{port}; give each node its own --node-rank (0 to "
                  f"{args.nnodes - 1}), or use another port for a second run.")
        store.set(keys[args.node_rank], str(nprocs))
        while missing := [n for n, key in enumerate(keys) if not store.check([key])]:
            if time.monotonic() >= deadline:
                raise dist.DistNetworkError(f"node(s) {', '.join(map(str, missing))} never came")
            time.sleep(0.25)
        counts = [int(store.get(key)) for key in keys]
        store.add("ddp-template/spawn/read", 1)
    except (RuntimeError, dist.DistError) as exc:  # unreachable node 0, or a node never came
        store = None
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(". ")
        log.error("error: the %d nodes did not all check in at %s:%d within --dist-timeout %gs "
                  "(%s); start the same command on every node, each with its --node-rank, "
                  "and make the port reachable from all.", args.nnodes, addr, port,
                  args.dist_timeout, reason[:200])
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C while waiting: nothing started yet
        store = None
        log.error("stopped while waiting for the other node(s); no process was started.")
        sys.exit(130)
    if len(set(counts)) > 1:
        if args.node_rank == 0:  # host the store until every node has read the counts
            wait_for_count(store, "ddp-template/spawn/read", args.nnodes)
        store = None
        _fail("the nodes would start different numbers of processes ("
              + ", ".join(f"node {n}: {c}" for n, c in enumerate(counts))
              + "; one per visible GPU unless --world-size is given); every node must start "
              "the same number: pass the same --world-size on each, or even out "
              "CUDA_VISIBLE_DEVICES.")
    return store


def _check_port_free(port: int) -> None:
    """Node 0 hosts the store on ``port``: a busy one would fail only after every child started
    (tens of seconds, a traceback per rank), so it is checked here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own socket
        try:
            sock.bind(("", port))
        except OSError as exc:
            _fail(f"port {port} is not free on this machine ({exc.strerror}), e.g. another run "
                  "uses it; pass another --dist-url tcp://HOST:PORT, or give no port (no "
                  "--dist-url, MASTER_PORT unset) to use a free one.")


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    started = time.time()  # a checkpoint.pth older than this is an earlier run's (rerun_hint)
    if args.node_rank >= args.nnodes:
        _fail(f"--node-rank {args.node_rank} but --nnodes {args.nnodes}: node ranks run from 0 "
              f"to {args.nnodes - 1}.")
    nprocs = _processes_per_node(args)
    addr, port = _rendezvous(args)
    # What the processes get: the count as resolved here (GPUs visible), which the ranks compare
    # across nodes, and env:// (they read MASTER_ADDR/PORT like torchrun's). The user's args stay.
    args = argparse.Namespace(**{**vars(args), "world_size": nprocs, "dist_url": "env://"})
    if args.node_rank == 0:
        _check_port_free(port)
    store = _meet_other_nodes(args, nprocs, addr, port) if args.nnodes > 1 else None
    first = args.node_rank * nprocs
    ranks = f"rank {first}" if nprocs == 1 else f"ranks {first}-{first + nprocs - 1}"
    log.info("starting %d process(es) on node %d/%d (%s of %d), rendezvous at %s:%d", nprocs,
             args.node_rank, args.nnodes, ranks, args.nnodes * nprocs, addr, port)

    context = mp.start_processes(_worker, args=(args, nprocs, addr, port, os.getpid(),
                                                store is not None),
                                 nprocs=nprocs, join=False, start_method="spawn")

    def forward(signum: int, frame: object) -> None:
        # Children get SIGTERM and unwind (checkpoint intact, process group destroyed).
        for proc in context.processes:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        context.interrupted = signum

    context.interrupted = 0
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        while not context.join(timeout=None, grace_period=10):
            pass
    except mp.ProcessExitedException as exc:
        if context.interrupted:
            log.error("stopped by %s; %s.", signal.Signals(context.interrupted).name,
                      rerun_hint(args, started))
            sys.exit(128 + context.interrupted)
        code = exc.exit_code
        if code == 2:  # a user error: the child already said what is wrong
            sys.exit(2)
        others = "; the others on this machine were stopped" if nprocs > 1 else ""
        how = f"signal {exc.signal_name}" if code is not None and code < 0 else f"exit code {code}"
        log.error("process %d (rank %d) failed (%s)%s. Fix the cause, then %s.", exc.error_index,
                  args.node_rank * nprocs + exc.error_index, how, others,
                  rerun_hint(args, started))
        sys.exit(1)
    except mp.ProcessRaisedException as exc:
        others = "; the others on this machine were stopped" if nprocs > 1 else ""
        log.error("a process raised an error%s:\n%s\nFix the cause, then %s.", others, exc,
                  rerun_hint(args, started))
        sys.exit(1)
    if context.interrupted:
        sys.exit(128 + context.interrupted)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
