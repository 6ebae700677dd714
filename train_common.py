"""The parser and training worker shared by both launchers.

``train_multi_gpu_using_launch.py`` and ``train_multi_gpu_using_spawn.py`` differ only in how the
processes start; each process then runs :func:`train` with the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import gc
import hashlib
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_sharer
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from model import MODELS, get_model
from multi_train_utils.checkpoint import (CheckpointError, capture_rng_state, extract_state_dict,
                                          load_file, load_matching_weights, not_a_file,
                                          prune_weights, restore_rng_state, save_atomic, to_cpu,
                                          write_atomic)
from multi_train_utils.distributed_utils import (COMM_HOOKS, DEFAULT_TIMEOUT_S, DistInfo,
                                                 LaunchError, all_gather_object, all_ranks_ok,
                                                 broadcast_object, cgroup_limit_hits, cleanup,
                                                 cpus_per_process,
                                                 init_distributed_mode, nccl_setup_error,
                                                 peer_failure, processes_on_node,
                                                 register_comm_hook)
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (EvalResult, common_amp_dtype, evaluate,
                                               resolve_amp_dtype, train_one_epoch)
from my_dataset import MyDataSet, printable_path
from utils import (STARTED_FROM, DataError, FolderScan, default_demo_root, find_run_file,
                   get_transforms, make_demo_data, missing_glyphs_ignored, path_flag,
                   label_by_class_name, plot_class_distribution, run_args_near, same_bytes,
                   scan_image_folder, short_list, split_key, split_train_val, tick_label,
                   write_json_atomic)

log = logging.getLogger("train")
SIGCHLD = getattr(signal, "SIGCHLD", None)  # POSIX only: Windows has none (nor fork)


class ConfigError(ValueError):
    """Flags that contradict each other or the data (one sentence, with the fix)."""


class RunError(RuntimeError):
    """The run cannot go on for a reason outside the code (disk full, diverged); says the fix."""


USER_ERRORS = (DataError, CheckpointError, ConfigError, LaunchError, RunError)
EXIT_USER_ERROR = 2


# ---------------------------------------------------------------- arguments
class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, and also ``--x False`` as the classic template's users typed it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"
        self.metavar = "BOOL"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string.startswith("--no-") or values is None:
            return super().__call__(parser, namespace, values, option_string)
        text = str(values).lower()
        if text not in ("true", "false", "1", "0", "yes", "no"):
            parser.error(f"{option_string} takes no value or one of true/false, not {values!r}")
        setattr(namespace, self.dest, text in ("true", "1", "yes"))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones (their help text says what happens instead)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolFlag):  # "--x [BOOL], --no-x": the negative takes no value
            return ", ".join(o if o.startswith("--no-") else f"{o} [BOOL]"
                             for o in action.option_strings)
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _number(kind: type, minimum: float, what: str, below: float = math.inf,
            at_most: float = math.inf) -> Callable[[str], float]:
    """An argparse ``type`` for ``minimum <= value < below`` and ``value <= at_most``; else a
    one-line usage error."""
    def parse(text: str) -> float:
        value = kind(text)
        if not (minimum <= value < below and value <= at_most and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" errors
    return parse


POSITIVE_INT = _number(int, 1, "a whole number of at least 1")
COUNT = _number(int, 0, "a whole number of at least 0")
POSITIVE = _number(float, math.ulp(0.0), "greater than 0")
NON_NEGATIVE = _number(float, 0.0, "at least 0")
SEED = _number(int, 0, "a whole number from 0 to 2**32 - 1 (numpy's seed range)", below=2**32)
FRACTION = _number(float, math.ulp(0.0), "above 0 and at most 1 (1 scores every image, with "
                   "--eval-only)", at_most=1.0)


WORKER_CAP = 8  # the template's


def default_workers(batch_size: int) -> int:
    # The template's rule: one worker per sample of the batch, at most 8 and the CPU count, but
    # counting the CPUs this process may use and shares with the other ranks on its node (8 GPU
    # ranks on a 16-CPU allocation of a 128-core host get 2 workers each, not 8).
    return min(cpus_per_process(), batch_size if batch_size > 1 else 0, WORKER_CAP)


def more_workers_hint(args: argparse.Namespace, device: torch.device) -> str | None:
    """Where the template's cap, not the CPUs, sets a GPU process's default workers: the
    ``--workers`` to try. On an H200 with 16 CPUs, 8 CPU workers supplied 3,800 img/s of ResNet34
    at 224 px and 15 supplied 5,700, of the 8,500 the GPU trains (README, "On an H200"). On CPU
    the training needs those CPUs itself."""
    if args.workers is not None or args.eval_only or device.type != "cuda":
        return None
    cpus = cpus_per_process()
    more = min(cpus - 1, args.batch_size)  # one CPU for the training process
    if more <= default_workers(args.batch_size):  # the CPUs or the batch set it, not the cap
        return None
    return (f"the default stops at {WORKER_CAP} loader workers per process, and this one has "
            f"{cpus} CPUs: if training waits for data, try --workers {more} (README: On an H200).")


def get_args_parser(add_help: bool = True, launcher: str = "launch") -> argparse.ArgumentParser:
    """Flags of both launchers (``launcher="spawn"`` adds how many processes to start)."""
    parser = argparse.ArgumentParser(
        description="Data-parallel image classification (ResNet) with DistributedDataParallel.",
        formatter_class=HelpFormatter, add_help=add_help)

    data = parser.add_argument_group("data")
    data.add_argument("--data-path", "--data_path", type=path_flag, default=None,
                      help="folder with one sub-folder of images per class (e.g. flower_photos); "
                           "default: the generated demo dataset")
    data.add_argument("--demo-dir", type=path_flag, default=None,
                      help="where the demo dataset is generated and cached "
                           "(default: $DDP_DEMO_DATA or ~/.cache/ddp-template/demo_flowers_v1)")
    data.add_argument("--val-rate", type=FRACTION, default=0.2,
                      help="fraction of each class held out for validation (with --eval-only, 1 "
                           "scores every image of --data-path, e.g. a separate test folder)")
    data.add_argument("--val-path", type=path_flag, default=None,
                      help="a separate validation folder, its class folders named as in "
                           "--data-path (an already split data set's val/): all of --data-path "
                           "trains and --val-rate is not used; with --eval-only, the folder "
                           "scored")
    data.add_argument("--img-size", type=POSITIVE_INT, default=224, help="training/validation crop size")
    data.add_argument("--num-classes", "--num_classes", type=POSITIVE_INT, default=None,
                      help="number of classes (default: the number of class folders)")
    data.add_argument("--workers", type=COUNT, default=None,
                      help="DataLoader workers per process (default: min(cpus per process, batch "
                           "size, 8))")
    data.add_argument("--verify-images", action=BoolFlag, default=True,
                      help="check every image's header (and end marker) before training; "
                           "unreadable files are skipped and listed")

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet34", choices=sorted(MODELS), help="architecture")
    model.add_argument("--weights", type=path_flag, default=None,
                       help="initial weights (state dict or checkpoint); tensors whose shape "
                            "does not fit, e.g. a 1000-class head, are skipped and listed")
    model.add_argument("--freeze-layers", "--freeze_layers", action=BoolFlag, default=False,
                       help="train only the classifier (fc); BatchNorm statistics stay fixed too")
    model.add_argument("--sync-bn", "--syncBN", dest="sync_bn", action=BoolFlag, default=True,
                       help="synchronise BatchNorm statistics across processes "
                            "(torch's SyncBatchNorm on CUDA, ours on CPU)")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=POSITIVE_INT, default=30, help="total, resumed epochs included")
    optim.add_argument("--batch-size", "--batch_size", type=POSITIVE_INT, default=16,
                       help="per process; the global batch is this x world size")
    optim.add_argument("--lr", type=POSITIVE, default=0.001,
                       help="learning rate for one process's batch; times the world size (and "
                            "--grad-accum-steps) with --scale-lr")
    optim.add_argument("--scale-lr", action=BoolFlag, default=True,
                       help="linear scaling: lr x world size x --grad-accum-steps; a resume that "
                            "changes the images per optimizer step (processes x batch x "
                            "accumulation) rescales it to match (Goyal et al. 2017, "
                            "arXiv:1706.02677)")
    optim.add_argument("--lrf", type=NON_NEGATIVE, default=0.1,
                       help="final lr as a fraction of the initial (cosine schedule)")
    optim.add_argument("--momentum", type=NON_NEGATIVE, default=0.9, help="SGD momentum")
    optim.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.005, help="SGD weight decay")
    optim.add_argument("--grad-accum-steps", type=POSITIVE_INT, default=1,
                       help="optimizer step every K batches; DDP syncs only on the K-th")
    optim.add_argument("--clip-grad-norm", type=POSITIVE, default=None, help="max gradient norm")

    speed = parser.add_argument_group("speed")
    speed.add_argument("--amp", action=BoolFlag, default=None,
                       help="mixed precision: bf16 where supported, else fp16 with GradScaler "
                            "(default: on for CUDA, off for CPU)")
    speed.add_argument("--channels-last", action=BoolFlag, default=None,
                       help="NHWC memory format (default: on for CUDA)")
    speed.add_argument("--compile", action=BoolFlag, default=False, help="torch.compile the model")
    speed.add_argument("--bucket-cap-mb", type=POSITIVE, default=25.0, help="DDP gradient bucket size")
    speed.add_argument("--comm-hook", default="none", choices=COMM_HOOKS,
                       help="compress DDP's gradient all-reduce to 16 bits (halves the bytes; "
                            "gradients are rounded, so off by default)")

    dist = parser.add_argument_group("distributed")
    dist.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                      help="auto: CUDA if available (NCCL), else CPU (gloo)")
    dist.add_argument("--dist-url", "--dist_url", default="env://",
                      help="env:// (torchrun/SLURM/spawn set the variables) or tcp://HOST:PORT")
    dist.add_argument("--dist-timeout", type=POSITIVE, default=DEFAULT_TIMEOUT_S,
                      help="seconds a collective may wait for a peer before failing")
    # torch.distributed.launch without --use_env passes --local-rank; LOCAL_RANK is read instead.
    dist.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    if launcher == "spawn":
        dist.add_argument("--world-size", "--world_size", type=POSITIVE_INT, default=None,
                          help="processes on this node (default: visible GPUs, or 2 on CPU)")
        dist.add_argument("--nnodes", type=POSITIVE_INT, default=1, help="number of machines")
        dist.add_argument("--node-rank", type=COUNT, default=0, help="this machine's index")
    else:  # the classic launch script took it: accepted, but the launcher decides (_run checks)
        dist.add_argument("--world-size", "--world_size", type=POSITIVE_INT, default=None,
                          help=argparse.SUPPRESS)

    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", type=path_flag, default="runs/train",
                     help="checkpoints, weights/, metrics.jsonl, TensorBoard, class_indices.json")
    run.add_argument("--resume", type=path_flag, default="auto",
                     help="'auto': continue from <output-dir>/checkpoint.pth if it exists; "
                          "a path; or 'none' to start fresh")
    run.add_argument("--keep-last", type=COUNT, default=0,
                     help="keep only the newest K weights/model-{epoch}.pth (0: keep all)")
    run.add_argument("--eval-only", action=BoolFlag, default=False,
                     help="evaluate the resumed/--weights model and exit")
    run.add_argument("--seed", type=SEED, default=0, help="data split, shuffling and init")
    run.add_argument("--print-freq", type=POSITIVE_INT, default=50,
                     help="reduce and show the running loss every N steps")
    run.add_argument("--tensorboard", action=BoolFlag, default=True,
                     help="write TensorBoard logs to <output-dir>/tensorboard")
    return parser


# ---------------------------------------------------------------- worker
def setup_logging(rank: int) -> None:
    # One gate for chatter: rank 0 logs INFO, the others only warnings and errors.
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True, stream=sys.stderr)
    logging.getLogger("matplotlib").setLevel(logging.ERROR)  # its lines would pass as ours


# Signals that arrived while a checkpoint was being written (None: not writing one).
_held_signals: list[int] | None = None


# The first SIGINT/SIGTERM this process got, held or not: a peer that stops on it drops out of
# the collectives, and the error that leaves on this rank is that signal's doing.
_signal_received: str | None = None


_forking = False  # inside os.fork's at-fork callbacks (see _guard_forks)
_deferred: list[int] = []
_forks_guarded = False


def _guard_forks() -> None:
    """Keep SIGINT/SIGTERM out of os.fork's at-fork callbacks (each loader forks its persistent
    workers once, at its first batch). A KeyboardInterrupt raised there (in logging's lock release)
    is printed as "Exception ignored" and lost: the run went on after its stop signal. The
    signal is noted instead and raised again just after fork() has returned. Registered last,
    these callbacks run first before a fork and last after it."""
    global _forks_guarded
    if _forks_guarded or not hasattr(os, "register_at_fork"):
        return

    def before() -> None:
        global _forking
        _forking = True

    def after() -> None:
        global _forking
        _forking = False
        if _deferred:  # from another thread, so it reaches this one outside the callbacks
            threading.Timer(0.05, signal.raise_signal, (_deferred.pop(),)).start()

    def after_in_child() -> None:  # a DataLoader worker stops on SIGTERM as before
        global _forking
        _forking = False
        _deferred.clear()

    os.register_at_fork(before=before, after_in_parent=after, after_in_child=after_in_child)
    _forks_guarded = True


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    if _forking:  # raised now, it would be lost (see _guard_forks)
        _deferred[:] = [signum]
        return
    global _signal_received
    _signal_received = _signal_received or signal.Signals(signum).name
    _expect_worker_deaths()
    # An exception raised inside torch.save leaves its zip writer half done; its clean-up then
    # fails with "unexpected pos" and the epoch just trained is lost. So while checkpoints are
    # written the signal waits; a second Ctrl-C does not (e.g. a save hung on a dead NFS mount).
    if _held_signals is not None and not (signum == signal.SIGINT and signal.SIGINT in _held_signals):
        _held_signals.append(signum)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _drop_swallowed_interrupt(previous: Callable[[Any], None], unraisable: Any) -> None:
    """``sys.unraisablehook`` during training. A signal that lands while Python runs a weakref or
    garbage-collector callback raises our KeyboardInterrupt where it cannot propagate; Python
    would print it as "Exception ignored in: ..." with a traceback. The handler recorded the
    signal, and the next step stops the run on it (_step_logger): the print is only noise."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and _signal_received:
        return
    previous(unraisable)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Finish the block before a SIGINT/SIGTERM takes effect, then raise it as usual.

    A DataLoader worker that dies meanwhile (torchrun's SIGTERM reaches the workers a moment
    before their rank) would make torch's SIGCHLD handler raise inside torch.save, even inside
    our SIGTERM handler while it swaps that handler out: torch's is left out for the block, so
    the death is noticed after the save (by torch's next fetch, or as the stop it is part of).
    """
    global _held_signals
    _held_signals = []
    sigchld = signal.signal(SIGCHLD, _ignore_signal) if SIGCHLD else None
    try:
        yield
    finally:
        held, _held_signals = _held_signals, None
        if _signal_received is None and sigchld is not None:  # a stop keeps workers' deaths quiet
            signal.signal(SIGCHLD, sigchld)
    if held:  # INFO: only rank 0, which wrote it, says so
        log.info("%s arrived while the checkpoint was written; it is complete, now stopping.",
                 signal.Signals(held[0]).name)
        raise KeyboardInterrupt(signal.Signals(held[0]).name)


@contextlib.contextmanager
def _signals_default() -> Iterator[None]:
    """SIGINT/SIGTERM end the process at once inside the block, then handlers are restored.

    The rendezvous waits inside C++ (TCPStore, gloo), where a Python handler runs only when the
    call returns: a rank whose peers never come would ignore Ctrl-C and kill for up to
    --dist-timeout. Nothing is written before the group exists, so dying there loses nothing.
    """
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum, handler in saved.items():
        if handler is not signal.SIG_IGN:  # ignored stays ignored (nohup &)
            signal.signal(signum, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _expect_worker_deaths() -> None:
    # DataLoader workers stop with us (torchrun signals the whole process group; multiprocessing
    # terminates daemon children at exit). Their SIGCHLD would otherwise raise "DataLoader worker
    # is killed by signal" in the middle of the clean-up and replace the interrupt. A no-op
    # handler, not SIG_DFL: Python raises OSError for a pending signal whose handler went away.
    if SIGCHLD:
        signal.signal(SIGCHLD, _ignore_signal)


def _ignore_signal(signum: int, frame: Any) -> None:
    """A handler that does nothing (see _expect_worker_deaths)."""


def die_with_launcher(launcher_pid: int | None = None) -> None:
    """Under a launcher (torchrun, our spawn launcher), SIGTERM this rank when the launcher dies.

    A launcher killed with SIGKILL cannot stop its ranks: they would train on as orphans, and a
    rerun of the same command would share the output folder with them. ``launcher_pid`` is the
    parent's pid read before this process spent seconds importing torch: a launcher that died
    meanwhile has already handed this rank to init (or a subreaper), so the request would come
    too late and only the pid shows it. Linux only (prctl); not for a plain ``python`` run,
    which must outlive its shell under nohup.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid() if launcher_pid is None else launcher_pid
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_at_once(signum: int, frame: Any) -> None:
    # The run is already stopping (or done): a second signal, e.g. torchrun's SIGTERM to the
    # whole group or the launcher's death signal, must not turn the clean-up into a traceback.
    os._exit(128 + signum)


def train(args: argparse.Namespace, launcher_pid: int | None = None) -> None:
    """Run one training process to the end; exits with 2 on a user error, 130/143 on a signal,
    1 when another process of the run died or hung.

    Every rank raises the same user error (data is checked on rank 0 and the verdict broadcast),
    so no rank is left waiting in a collective. ``launcher_pid``: torchrun's pid as read when
    the script started (see :func:`die_with_launcher`).
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun / torch.distributed.launch
        die_with_launcher(launcher_pid)  # before the handlers: an orphan just dies, silently
    saved_handlers = {signum: signal.getsignal(signum)
                      for signum in (signal.SIGINT, signal.SIGTERM)}
    # SIGTERM (torchrun, SLURM, the spawn launcher, `kill`) unwinds like Ctrl-C: finally-blocks
    # run, the process group is destroyed and DataLoader workers are shut down.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    _guard_forks()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored (nohup &)
        signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    setup_logging(int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))))
    saved_unraisablehook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_drop_swallowed_interrupt, saved_unraisablehook)
    global _signal_received, _waiting_for, _set_up, _limit_hits, _started_at
    _signal_received = _waiting_for = None
    _limit_hits = cgroup_limit_hits()  # to tell, if a loader worker dies, which limit it met
    _started_at = time.time()  # a checkpoint.pth older than this is an earlier run's
    _set_up = False
    info = None
    try:
        with _signals_default():
            info = init_distributed_mode(device=args.device, dist_url=args.dist_url,
                                         timeout_s=args.dist_timeout)
        setup_logging(info.rank)
        _run(args, info)
    except USER_ERRORS as exc:
        # Every rank raises it: said once per machine (rank 0 may be on either machine).
        if (info.local_rank if info is not None else _launched_local_rank()) == 0:
            log.error("error: %s", exc)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt as exc:
        _stop_interrupted(str(exc) or "SIGINT", args, info)
    except RuntimeError as exc:
        if _signal_received and (peer_failure(exc) or _WORKER_DIED.search(str(exc))):
            # A peer stopped on the same signal first: the run was interrupted, nothing failed.
            _stop_interrupted(_signal_received, args, info)
        worker = _WORKER_DIED.search(str(exc))
        if "Too many open files" in str(exc):  # torch's words, or its shared memory's (errno 24)
            _stop_failed("error: %s %s", _open_files_message(), _rerun_sentence(args))
        unusable = _shm_unusable(str(exc))
        if unusable:  # it was fine at the start (see _shm_unusable_here)
            _stop_failed("error: %s %s", _shm_unusable_message(unusable), _rerun_sentence(args))
        if _SHM_FULL.search(str(exc)) or worker and "Bus error" in worker.group(0):
            report, need = _shm_report(args, info)
            _stop_failed("error: out of shared memory%s; %s. %s", report, _shm_advice(need),
                         _rerun_sentence(args))
        if worker:  # raised by torch's SIGCHLD handler wherever the rank was: not a traceback
            # torch names the signal only when its SIGCHLD handler saw the death first.
            _stop_failed("error: %s - %s. %s", worker.group(0), _worker_death_cause(),
                         _rerun_sentence(args))
        if _LOADER_TIMED_OUT.search(str(exc)):
            for worker_process in multiprocessing.active_children():  # stuck: joined in vain
                worker_process.terminate()
            _stop_failed("error: the DataLoader workers sent no batch in %d s: one was lost (its "
                         "worker's own error is above: often a process, thread or open-file "
                         "limit, or shared memory, met while sending it), or reading one batch "
                         "takes that long (a hung network file system). %s", LOADER_TIMEOUT_S,
                         _rerun_sentence(args))
        if _NO_THREAD in str(exc):  # raised here, or in a worker and raised again here
            _stop_failed("error: could not start a thread (%s): %s. %s", _NO_THREAD,
                         _start_refused_cause(), _rerun_sentence(args))
        nccl_refused = nccl_setup_error(exc)
        if nccl_refused and not _set_up:
            log.error("error: NCCL refused to set up the run (%s); give every process a GPU of "
                      "its own (one process per GPU; with SLURM --gpus-per-task=1) and check the "
                      "NCCL_* variables - NCCL_DEBUG=INFO says more.", nccl_refused)
            sys.exit(EXIT_USER_ERROR)
        if nccl_refused:  # the set-up worked: not a mistake in the command
            _quiet_second_signal()
            log.error("error: NCCL failed during the run (%s): most often a GPU fault or GPU "
                      "memory running out (see dmesg, nvidia-smi; NCCL_DEBUG=INFO says more). "
                      "%s", nccl_refused, _rerun_sentence(args))
            sys.exit(1)
        reason = peer_failure(exc) if info is None or info.distributed else None
        if reason is None:
            raise
        _quiet_second_signal()
        if info is None:  # the rendezvous: some rank never came, or cannot reach rank 0
            log.error("error: the processes of the run did not all meet (%s); start every rank "
                      "with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, reachable from all "
                      "(inside a SLURM allocation: start them with srun).", reason)
            sys.exit(1)
        if _waiting_for and re.search(r"(closed|reset) by peer", reason):  # rank 0 is gone
            log.error("error: lost contact with the other processes of the run while waiting "
                      "for %s (%s): it stopped - its own output says why.", _waiting_for[0],
                      reason)
            sys.exit(1)
        if _waiting_for:  # rank 0 may be busy, not dead: a slow scan ends here too
            log.error("error: lost contact with the other processes of the run while waiting "
                      "for %s (%s); %s.", _waiting_for[0], reason, _waiting_for[1])
            sys.exit(1)
        why = (_OOM_KILLED if _counted_since_start("oom_kill") else
               "usually one of them died or hung - its own output says why")
        log.error("error: lost contact with the other processes of the run (%s); %s. %s", reason,
                  why, _rerun_sentence(args))
        sys.exit(1)
    except OSError as exc:
        if exc.errno == errno.EAGAIN:  # fork(): a loader starting its workers
            _stop_failed("error: could not start a process (%s): %s. %s", exc.strerror,
                         _start_refused_cause(), _rerun_sentence(args))
        # (raised again from a loader worker, it keeps torch's words but not its errno)
        if exc.errno in (errno.EMFILE, errno.ENFILE) or "Too many open files" in str(exc):
            _stop_failed("error: %s %s", _open_files_message(), _rerun_sentence(args))
        raise
    finally:
        _quiet_second_signal()
        cleanup()
        _release_output_dir()
        gc.unfreeze()  # train() may be called again in this process
        for signum, handler in saved_handlers.items():  # train() may be called again
            signal.signal(signum, handler)
        sys.unraisablehook = saved_unraisablehook


_limit_hits: dict[str, int] = {}  # cgroup_limit_hits() when train() began
_started_at = 0.0  # time.time() when train() began
_LOADER_TIMED_OUT = re.compile(r"DataLoader timed out after \d+ seconds")
_NO_THREAD = "can't start new thread"  # Python's words when the thread limit is reached
_PIDS_LIMITS = ("a container's pids limit: docker run --pids-limit, Kubernetes' pod pids limit; "
                "or ulimit -u")
_FEWER_PROCESSES = ("lower --workers (each DataLoader worker is a process with threads of its own) "
                    "or raise the limit")
_PROCESS_LIMIT = (f"this machine's limit on processes and threads was reached ({_PIDS_LIMITS}): "
                  f"{_FEWER_PROCESSES}")


def _stop_failed(fmt: str, *fmt_args: Any) -> NoReturn:
    """End this rank with one error line (exit code 1): no traceback, no worker's death noise."""
    _quiet_second_signal()
    _expect_worker_deaths()
    log.error(fmt, *fmt_args)
    sys.exit(1)


def _start_refused_cause() -> str:
    """Why a new process or thread was refused: the cgroup's process limit where it counted a
    refusal since the start; else the usual suspects (a limit the cgroup does not count, such
    as ulimit -u, or no memory for a new thread's stack)."""
    if _counted_since_start("pids"):
        return _PROCESS_LIMIT
    return (f"most often a limit on processes and threads ({_PIDS_LIMITS}), or memory for a new "
            f"thread's stack: {_FEWER_PROCESSES}")


def _counted_since_start(counter: str) -> bool:
    """Whether the cgroup's ``counter`` (see :func:`cgroup_limit_hits`) rose since train() began."""
    now = cgroup_limit_hits()[counter]
    return now > _limit_hits.get(counter, now)


def _open_files_message() -> str:
    return (f"too many open files (this process may open {_open_file_limit()}: ulimit -n); "
            "raise the limit (ulimit -n 65536; docker run --ulimit nofile=65536) or lower "
            "--workers.")


_OOM_KILLED = ("meanwhile the out-of-memory killer stopped a process at this container's memory "
               "limit, most often why: lower --workers or --batch-size, or give the job more "
               "memory")


def _worker_death_cause() -> str:
    """Why a DataLoader worker most likely died, from the cgroup's counters where they say."""
    if _counted_since_start("pids"):  # it could not start a thread it needs: it exits with 1
        return _PROCESS_LIMIT
    if _counted_since_start("oom_kill"):
        return ("the out-of-memory killer stopped a process at this container's memory limit: "
                "lower --workers or --batch-size, or give the job more memory")
    return ("most often the out-of-memory killer (see dmesg): lower --workers or --batch-size, "
            "or give the job more memory (a crash in native code shows its own error with "
            "--workers 0)")


def _open_file_limit() -> str:
    try:
        import resource
        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "a limited number"


def _launched_local_rank() -> int:
    """The local rank a launcher gave this process (0 without one, or if it cannot be read)."""
    name = ("LOCAL_RANK" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else
            "SLURM_LOCALID" if "SLURM_PROCID" in os.environ else None)
    try:
        return int(os.environ.get(name, 0)) if name else 0
    except ValueError:
        return 0


# torch's words for a DataLoader worker that died (its SIGCHLD handler raises them in the rank).
_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (is killed by signal: "
                          r"[^.\n]*|exited unexpectedly[^.\n]*)")


# torch's words for a tensor it could not put into shared memory (/dev/shm full): a worker's
# batch, which the loader raises in the rank (MyDataSet.collate_fn builds batches there, in the
# worker), or the dataset's shared counters.
_SHM_FULL = re.compile(r"unable to (?:allocate shared memory\(shm\) for file|open shared memory "
                       r"object|write to file) <")


# The reason torch gives after a shared-memory file's name: "...: Read-only file system (30)".
_SHM_REASON = re.compile(_SHM_FULL.pattern + r"[^>\n]*>[^:\n]*: ([^\n]*?) \((\d+)\)")


def _shm_unusable(text: str) -> str | None:
    """The reason, when torch could not use /dev/shm at all (read-only, absent, no permission)
    rather than for lack of space."""
    found = _SHM_REASON.search(text)
    if found and int(found.group(2)) in (errno.EROFS, errno.ENOENT, errno.EACCES, errno.EPERM,
                                         errno.ENOTDIR):
        return found.group(1)
    return None


def _shm_unusable_here() -> str | None:
    """Why DataLoader workers could not use /dev/shm on this machine (read-only, absent, no
    permission: their queues' semaphores and batches live there), or None."""
    try:
        multiprocessing.Lock()
        torch.zeros(1).share_memory_()
    except OSError as exc:
        return exc.strerror or str(exc)
    except RuntimeError as exc:  # torch's own words; a full /dev/shm is said elsewhere
        return _shm_unusable(str(exc))
    return None


def _shm_unusable_message(reason: str) -> str:
    return (f"DataLoader workers cannot use shared memory ({SHM_DIR}: {reason}), which they pass "
            f"every batch through; make it a writable tmpfs (docker: no read-only mount, "
            f"--shm-size=1g or --ipc=host; Kubernetes: an emptyDir volume with medium Memory at "
            f"{SHM_DIR}), or train with --workers 0 (slower: images are then loaded by the "
            f"training process).")


def _shm_report(args: argparse.Namespace, info: DistInfo | None) -> tuple[str, int]:
    """`` (/dev/shm: 64 MiB, 0 KiB free; ...)`` for messages, and the bytes the loaders need."""
    workers = default_workers(args.batch_size) if args.workers is None else args.workers
    need, how = shm_use(args.batch_size, args.img_size, workers,
                        info.device if info is not None else torch.device("cpu"))
    space = shm_space()
    have = "" if space is None else f"{SHM_DIR}: {_mib(space[0])}, {_mib(space[1])} free; "
    return (f" ({have}this machine's DataLoader workers may keep up to {_mib(need)} of batches "
            f"there: {how})", need)


def rerun_hint(args: argparse.Namespace, started: float | None = None) -> str:
    """What to run to continue the run, for messages: ``run the same command again: it continues
    from ...``, or, when the command's --resume would not continue the run's own checkpoint
    (``none`` starts over, a PATH starts from that file again), the flag to change.

    ``started``: when the run began (``time.time()``; default: when :func:`train` began here).
    An older checkpoint.pth is an earlier run's, which a ``--resume none`` run replaces once it
    is about to train: continuing it is not what that command asked for.
    """
    out = Path(args.output_dir)
    checkpoint = out / "checkpoint.pth"
    fresh = args.resume in (None, "", "none")
    if args.resume == "auto" or not fresh and Path(args.resume).resolve() == checkpoint.resolve():
        done = f"the last complete checkpoint in {out}" if checkpoint.is_file() else "the start"
        return f"run the same command again: it continues from {done}"
    try:
        ours = checkpoint.stat().st_mtime >= (_started_at if started is None else started)
    except OSError:
        ours = False
    if not ours:
        again = "over" if fresh else f"from {args.resume} again"
        return f"run the same command again: it starts {again}"
    return (f"run the same command with --resume auto in place of --resume "
            f"{args.resume or 'none'} to continue from the last complete checkpoint in {out} (the "
            f"same command would {'start over' if fresh else 'go back to that file'})")


def _rerun_sentence(args: argparse.Namespace) -> str:
    hint = rerun_hint(args)
    return hint[0].upper() + hint[1:] + "."


def _stop_interrupted(signame: str, args: argparse.Namespace, info: DistInfo | None) -> NoReturn:
    _quiet_second_signal()
    _expect_worker_deaths()
    # torchrun stops the others when a rank dies: the kill is the news, not the signal, and
    # every rank says it (rank 0 may be the one killed).
    oom = signame == "SIGTERM" and _counted_since_start("oom_kill")
    if oom:
        signame += f" ({_OOM_KILLED})"
    says = info is None or info.is_main or oom
    if says and args.eval_only:
        log.error("interrupted by %s.", signame)
    elif says:
        out = Path(args.output_dir)
        if (out / "checkpoint.pth").is_file():
            log.error("interrupted by %s; %s.", signame, rerun_hint(args))
        else:
            log.error("interrupted by %s before the first epoch was saved; run the same "
                      "command again to start.%s", signame, _previous_run_hint(out))
    sys.exit(143 if signame.startswith("SIGTERM") else 130)


def _quiet_second_signal() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _exit_at_once)


def _seed_everything(seed: int, rank: int) -> None:
    # seed + rank: ranks must not draw identical random numbers (e.g. dropout masks).
    seed = (seed + rank) % 2**32  # numpy takes no larger seed: the top ranks wrap around
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# What this rank waits for in a long collective, for the "lost contact" message.
_waiting_for: tuple[str, str] | None = None  # (what, and what to do if it is only slow)
# The process group, model and DDP are set up: a failure now is not the set-up's (train()).
_set_up = False


def _scan_on_rank0(root: str, verify: bool, info: DistInfo, min_classes: int) -> FolderScan:
    """Scan once (rank 0) and hand every rank the same result or the same error."""
    result: Any = None
    if info.is_main:
        # Silent seconds on a big folder look like a hang (about 5 s per 30,000 files here).
        log.info("scanning %s%s", root, " and checking each image's header" if verify else "")
        try:
            result = scan_image_folder(root, verify=verify, min_classes=min_classes)
        except (DataError, OSError) as exc:  # OSError: the machine's (an open-file limit)
            result = exc
    global _waiting_for
    if not info.is_main:
        _waiting_for = (f"rank 0 to scan {root}", "if it was still scanning, the scan takes "
                        "longer than --dist-timeout: raise it, or pass --no-verify-images for a "
                        "faster scan")
    result = broadcast_object(result)  # if it raises, train() says what this rank waited for
    _waiting_for = None
    if isinstance(result, (DataError, OSError)):
        raise result
    return _rebased(result, root)


def _rebased(scan: FolderScan, root: str) -> FolderScan:
    """``scan`` (rank 0's) with its images' paths below this machine's ``root``: the data set
    may sit elsewhere on each machine (rank 1 read rank 0's paths, which fail where the mount
    points differ, so that machine trained on nothing)."""
    old, new = os.path.join(scan.root, ""), os.path.join(root, "")
    if old == new:
        return scan
    return dataclasses.replace(scan, root=root, images=[
        [new + path[len(old):] if path.startswith(old) else path for path in paths]
        for paths in scan.images])


PREFETCH_FACTOR = 4  # batches each DataLoader worker keeps in flight
# No batch from the workers for this long: one was lost, not slow. A worker's queue sends each
# batch from a thread that only prints its errors (a thread or file limit met while passing the
# batch's shared memory): the loader would wait forever, and under NCCL the other ranks too.
LOADER_TIMEOUT_S = 600
SHM_DIR = "/dev/shm"  # where DataLoader workers hand their batches over (POSIX shared memory)


def loader_kwargs(workers: int, device: torch.device) -> dict[str, Any]:
    """``DataLoader`` arguments of both loaders (the benchmark's too): ``MyDataSet`` batches.

    Workers stay alive between epochs and keep 4 batches each in flight, so a new epoch does not
    wait for ``workers`` processes to start and fill; batches are pinned for the CUDA copy.
    """
    kwargs: dict[str, Any] = dict(num_workers=workers, collate_fn=MyDataSet.collate_fn,
                                  pin_memory=device.type == "cuda")
    if workers > 0:  # refused by DataLoader without workers
        kwargs.update(persistent_workers=True, prefetch_factor=PREFETCH_FACTOR,
                      timeout=LOADER_TIMEOUT_S, worker_init_fn=_start_fd_sharing)
    return kwargs


def _start_fd_sharing(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: start the thread that passes each batch's shared memory to
    the training process (multiprocessing's resource sharer) now, where a refusal is raised.

    Started at the first batch, from the worker queue's feeder thread, a refusal (a process or
    thread limit: "can't start new thread") was only printed, and left the sharer with an
    address but no thread to answer it: the training process waited forever, inside the
    queue's get (so past the loader's timeout), for the memory of the next batch.
    """
    sharer = getattr(resource_sharer, "_resource_sharer", None)
    if sharer is None or getattr(sharer, "_address", "") is not None:
        return  # another Python, or already started
    with sharer._lock:
        if sharer._address is None:
            try:
                sharer._start()
            except RuntimeError:
                sharer._listener.close()  # whole again: no address that nobody answers
                sharer._listener = sharer._address = None
                raise


def shm_use(batch_size: int, img_size: int, workers: int, device: torch.device) -> tuple[int, str]:
    """The most bytes of batches this machine's loaders may hold in shared memory at once, and
    how that is counted.

    A worker's finished batch (uint8 images) waits there until its process takes it: on CPU up
    to ``PREFETCH_FACTOR`` per worker when training is the slower side; on CUDA the pin-memory
    thread copies each out as it arrives, so about one per worker.
    """
    batch = batch_size * 3 * img_size ** 2
    per_worker = 1 if device.type == "cuda" else PREFETCH_FACTOR
    processes = processes_on_node()
    return (processes * workers * per_worker * batch,
            f"{processes} process(es) x {workers} worker(s) x {per_worker} batch(es) of "
            f"{_mib(batch)}")


def _mib(size: int) -> str:
    if size < 2**20:
        return f"{size / 2**10:.0f} KiB"
    return f"{size / 2**20:.{0 if size >= 10 * 2**20 else 1}f} MiB"


def shm_space(path: str = SHM_DIR) -> tuple[int, int] | None:
    """``(size, free)`` bytes of the shared-memory file system; None where there is none."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # no /dev/shm on macOS (nor its limit); no statvfs on Windows
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _shm_advice(need: int) -> str:
    size = max(1, math.ceil(need * 1.5 / 2**30))  # room for the other tensors workers pass
    return (f"in a container give it more (docker run --shm-size={size}g, or --ipc=host; "
            "Kubernetes: an emptyDir volume with medium Memory at /dev/shm), or lower --workers "
            "or --batch-size")


def _warn_if_shm_small(args: argparse.Namespace, workers: int, device: torch.device) -> None:
    space = shm_space()
    need, how = shm_use(args.batch_size, args.img_size, workers, device)
    if space is not None and space[1] < need:
        log.warning("%s has %s free, but this machine's DataLoader workers may keep up to %s of "
                    "batches there (%s); if it fills, the run stops with 'out of shared "
                    "memory': %s.", SHM_DIR, _mib(space[1]), _mib(need), how, _shm_advice(need))


def _build_data(args: argparse.Namespace, info: DistInfo, out: Path
                ) -> tuple[FolderScan, FolderScan | None, MyDataSet, MyDataSet,
                           DistributedSampler, DataLoader, DataLoader]:
    """Scan, split and load. The second scan is that of a separate --val-path folder when
    training (None without one); an evaluation scans only the folder it scores."""
    root = args.val_path if args.eval_only and args.val_path else args.data_path
    if args.eval_only and args.val_path and args.data_path and info.is_main:
        log.warning("--eval-only scores the --val-path folder %s; --data-path %s is not read.",
                    args.val_path, args.data_path)
    if root is None:
        demo = args.demo_dir or default_demo_root()
        try:
            root = str(make_demo_data(demo))
        except OSError as err:  # e.g. a container user whose HOME cannot be written
            raise DataError(f"could not write the demo dataset to {demo} "
                            f"({err.strerror or err}); pass --demo-dir (or set DDP_DEMO_DATA to) "
                            "a folder you can write, or --data-path your own images.") from None
        log.info("no --data-path given: training on the generated demo dataset in %s", root)
    # One class is enough to score against a model that knows more (checked once it is read).
    scan = _scan_on_rank0(root, args.verify_images, info, 1 if args.eval_only else 2)
    if info.is_main:
        log.info(scan.summary())
    val_scan = None
    if args.val_path and not args.eval_only:
        val_scan = _scan_on_rank0(args.val_path, args.verify_images, info, 1)
        if info.is_main:
            log.info(val_scan.summary())

    num_classes = len(scan.classes)
    # Evaluation may score a folder holding some of the model's classes (checked once known).
    subset = args.eval_only and args.num_classes is not None and args.num_classes > num_classes
    if args.num_classes is not None and args.num_classes != num_classes and not subset:
        raise ConfigError(f"--num-classes {args.num_classes} disagrees with the {num_classes} class "
                          f"folders found in {root} ({', '.join(scan.classes)}); drop the flag "
                          "or fix the folders.")
    if val_scan is not None:  # an already split data set: all of --data-path trains
        train_p = [path for paths in scan.images for path in paths]
        train_y = [label for label, paths in enumerate(scan.images) for _ in paths]
        val_p, val_y, warnings = label_by_class_name(scan.classes, val_scan, scan.root)
    else:
        val_rate = 1.0 if args.eval_only and args.val_path else args.val_rate
        train_p, train_y, val_p, val_y, warnings = split_train_val(
            scan.images, val_rate, args.seed, scan.classes, root=scan.root)
    for warning in warnings if info.is_main else ():  # same split on every rank: say it once
        log.warning(warning)
    if not val_p:
        raise DataError(f"the validation split of {root} is empty (val rate {args.val_rate}); "
                        "raise --val-rate or add images.")
    needed = info.world_size * args.batch_size
    if len(train_p) < needed and not args.eval_only:  # evaluation forms no training batch
        raise DataError(f"{len(train_p)} training images are fewer than world size "
                        f"{info.world_size} x batch size {args.batch_size} = {needed}, so no full "
                        "batch could be formed; lower --batch-size or add images.")

    transforms = get_transforms(args.img_size)
    # Files that pass the scan but fail to decode are met by one rank's loader only: every rank
    # reports its own, and appends them to the run's list (rank 0 rewrites it before training).
    skip_log = None if args.eval_only else out / "skipped_files.txt"
    train_set = MyDataSet(train_p, train_y, transforms["train"], decoder="tensor", seed=args.seed,
                          report_errors=True, skip_log=skip_log, replace_unreadable=True)
    val_set = MyDataSet(val_p, val_y, transforms["val"], decoder="tensor", report_errors=True,
                        skip_log=skip_log)
    train_sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
                                       shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=info.world_size, rank=info.rank,
                                     shuffle=False)
    workers = default_workers(args.batch_size) if args.workers is None else args.workers
    # Every rank: the worker count may differ between machines (their CPUs), the collective not.
    unusable = _shm_unusable_here() if workers else None
    if not all_ranks_ok(unusable is None):
        raise ConfigError(_shm_unusable_message(unusable) if unusable else
                          f"another machine's {SHM_DIR} cannot be used by DataLoader workers (its "
                          "error line says why); fix it there, or train with --workers 0.")
    train_loader = DataLoader(train_set, batch_sampler=BatchSampler(
        train_sampler, args.batch_size, drop_last=True), **loader_kwargs(workers, info.device))
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            **loader_kwargs(workers, info.device))
    if workers and info.local_rank == 0:  # one warning per machine: its ranks share /dev/shm
        _warn_if_shm_small(args, workers, info.device)
    # Both loaders keep their workers between epochs (persistent_workers): say both counts.
    log.info("%s%d validation images, %d classes, %s loader worker(s) per process",
             "" if args.eval_only else f"{len(train_set)} training / ", len(val_set), num_classes,
             "no" if not workers else workers if args.eval_only
             else f"{workers} training + {workers} validation")
    hint = more_workers_hint(args, info.device)
    if hint and info.is_main:
        log.info(hint)
    return scan, val_scan, train_set, val_set, train_sampler, train_loader, val_loader


@contextlib.contextmanager
def _writing_in(out: Path) -> Iterator[None]:
    """Rank 0's run files (not the epoch saves): an OSError becomes one line with the fix."""
    try:
        yield
    except OSError as exc:  # read-only mount, permissions, quota, full disk
        raise RunError(f"could not write {exc.filename or out}: {exc.strerror or exc}; fix "
                       f"--output-dir {out} (permissions, space), then run the same command "
                       "again.") from None


def _cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU natively (AVX512-BF16, AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 either
        return False


def _write_run_files(out: Path, scan: FolderScan, val_scan: FolderScan | None, fresh: bool,
                     weights: str | None) -> None:
    """Rank 0, once the run is known to be valid: what the data scans found, kept with the run.
    ``fresh``: no checkpoint is continued; an earlier run's record of itself is copied into
    ``.previous-run`` first, so that putting it back restores it whole (:func:`_write_start_files`)
    and a ``--weights`` file this run would save over is kept (:func:`_keep_start_weights`)."""
    with _writing_in(out):
        if fresh and (out / "checkpoint.pth").is_file():
            for name in ("class_indices.json", "args.json", "metrics.jsonl"):
                dest = out / PREVIOUS_RUN / name
                if (out / name).is_file() and not dest.exists():  # not an earlier attempt's
                    dest.parent.mkdir(exist_ok=True)
                    shutil.copy2(out / name, dest)
        if fresh:
            _keep_start_weights(out, weights)
        skipped = out / "skipped_files.txt"
        listed = scan.skipped + (val_scan.skipped if val_scan else [])
        if listed:  # nothing is lost silently: the full list stays with the run
            skipped.write_text("".join(f"{p}\t{why}\n" for p, why in listed), encoding="utf-8")
        else:
            skipped.unlink(missing_ok=True)  # a list from an earlier scan would mislead
        write_json_atomic(out / "class_indices.json",
                          {str(i): c for i, c in enumerate(scan.classes)})
        plot_class_distribution(scan, out / "class_distribution.png")


def _write_start_files(out: Path, run_args: dict[str, Any], history: list[dict[str, Any]],
                       fresh: bool, weights: str | None) -> None:
    """Rank 0, before the first epoch of this attempt: args.json and the metrics so far.

    ``fresh``: no checkpoint is continued (``--resume none``, or nothing to resume), so what an
    earlier run left here must not mix with this one: its later epochs' weights would sit
    beside this run's, its best model would compete with them, and its TensorBoard curves would
    be drawn into this run's. They are moved to ``<out>/.previous-run`` now, when this run is
    known to start, and deleted once its first epoch is saved (:func:`_save_epoch`): a run
    stopped before that loses nothing. The ``--weights`` file this run started from stays in
    place, even when it is one of them (``--resume none --weights <out>/weights/model-N.pth``),
    and was kept in ``started_from/`` before (:func:`_keep_start_weights`).
    """
    with _writing_in(out):
        if fresh:
            kept = Path(weights).resolve() if weights else None
            stale = [p for p in _saved_files(out) if p.resolve() != kept]
            events = sorted((out / "tensorboard").rglob("events.out.tfevents.*"))
            for path in stale + events:
                dest = out / PREVIOUS_RUN / path.relative_to(out)
                if dest.exists():  # an aside from an earlier attempt holds the older files
                    path.unlink()
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    path.replace(dest)
            if stale or events:
                log.info("starting afresh in %s: the earlier run's %d checkpoint/weight file(s) "
                         "and %d TensorBoard log(s) are moved to %s, and deleted once this run "
                         "saves its first epoch", out, len(stale), len(events), PREVIOUS_RUN)
        write_json_atomic(out / "args.json", run_args)
        # metrics.jsonl is rebuilt from the checkpoint: each finished epoch exactly once, even
        # if the previous attempt died between appending a line and saving the checkpoint.
        _write_metrics(out / "metrics.jsonl", history)


def _saved_files(out: Path) -> list[Path]:
    """The checkpoint and weight files a run saves in ``out`` that are there now."""
    return [p for p in (out / "checkpoint.pth", out / "model_best.pth",
                        *(out / "weights").glob("model-*.pth")) if p.is_file()]


def _keep_start_weights(out: Path, weights: str | None) -> None:
    """``--resume none --weights <out>/weights/model-N.pth`` (or ``model_best.pth``,
    ``checkpoint.pth``): this run saves its own file under that name at epoch N or sooner, and
    its class_indices.json and args.json over those of the weights' run now. Before they are,
    the originals are kept in ``<out>/started_from/``, in the run's layout, where
    :func:`find_run_file` looks first: a rerun stopped before epoch N still reads the weights'
    own class names. The weights are a hard link (no copy: a save replaces the name, not the
    file) where the file system allows."""
    if not weights:
        return
    path = next((p for p in _saved_files(out) if p.resolve() == Path(weights).resolve()
                 and not p.is_symlink()), None)  # a link's target is not saved over
    if path is None:
        return
    folder = out / STARTED_FROM
    kept = folder / path.relative_to(out)
    if kept.is_file() and same_bytes(kept, path):  # kept by an earlier start of this command
        return
    if folder.exists():  # an older start's, whose weights the run after it saved over
        n = 2
        while (out / f"{STARTED_FROM}.{n}").exists():
            n += 1
        folder.rename(out / f"{STARTED_FROM}.{n}")
    kept.parent.mkdir(parents=True)
    try:
        os.link(path, kept)
    except OSError:  # a file system without hard links: a copy, whole or none
        partial = kept.with_name(f".{kept.name}.tmp")
        shutil.copy2(path, partial)
        partial.replace(kept)
    for name in ("class_indices.json", "args.json"):
        if (out / name).is_file():
            shutil.copy2(out / name, folder / name)
    log.info("--weights %s is a file this run saves its own over: the original is kept as %s, "
             "with its run's class_indices.json and args.json", path, kept)


def _build_model(args: argparse.Namespace, info: DistInfo, classes: list[str], *,
                 load_weights: bool = True, val_split: str | None = None) -> nn.Module:
    model = get_model(args.model, num_classes=len(classes))
    if args.weights and load_weights:
        _load_weights(model, args, info, classes, val_split)
    if args.freeze_layers:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("fc."))
    if args.sync_bn and info.distributed:
        model = convert_sync_batchnorm(model, info.device)
    if args.freeze_layers:
        _hold_frozen_norms(model)
    return model


def _load_weights(model: nn.Module, args: argparse.Namespace, info: DistInfo,
                  classes: list[str], val_split: str | None) -> None:
    """Start ``model`` from ``--weights``: every tensor that fits by name and shape, and says
    what did not (rank 0). A head trained on other class names starts new, as for another
    class count: kept, it would map the old class i to the new class i. Backbone tensors whose
    names fit but shapes do not are another architecture's (a resnet50's Bottleneck blocks in a
    resnet34): refused, as loading the rest would start from a meaningless mix."""
    source = load_file(args.weights)
    _check_weights_model(args, source)  # another model's weights would fit only here and there
    state, own_state = extract_state_dict(source, args.weights), model.state_dict()
    reshaped = [k for k in state if k in own_state and state[k].shape != own_state[k].shape]
    if any(not k.startswith("fc.") for k in reshaped):
        key = next(k for k in reshaped if not k.startswith("fc."))
        raise CheckpointError(
            f"{args.weights} is not weights for --model {args.model}: "
            f"{sum(not k.startswith('fc.') for k in reshaped)} of its tensors have the names of "
            f"{args.model}'s but other shapes (e.g. {key}: {list(state[key].shape)} there, "
            f"{list(own_state[key].shape)} here); pass the --model it was made for.")
    trained_on = _weights_classes(args.weights, source, warn=info.is_main)
    if args.eval_only and _is_checkpoint(source):
        # The checks --resume makes: another model, other classes (which would score every
        # image against the wrong label), another split.
        _check_checkpoint(source, args.weights, args, classes, warn=info.is_main,
                          val_split=val_split)
    elif args.eval_only:  # bare weights: their run's files, where found, say what they are
        _check_bare_weights(args, trained_on, classes, warn=info.is_main)
    other_classes = trained_on not in (None, classes)
    reordered = (other_classes and not args.eval_only and not reshaped
                 and {"fc.weight", "fc.bias"} <= state.keys()
                 and sorted(trained_on) == sorted(classes))
    if reordered:  # the same classes in another order: each keeps its row of the head
        rows = torch.tensor([trained_on.index(name) for name in classes])
        state = {k: v[rows] if k in ("fc.weight", "fc.bias") else v for k, v in state.items()}
        other_classes = False
    # The head as a unit: a bias that fits beside a weight that does not (or is missing) is no
    # head.
    partial_head = {k for k in own_state if k.startswith("fc.")} - state.keys()
    new_head = (other_classes or bool(reshaped) or bool(partial_head)) and not args.eval_only
    if trained_on is not None and not other_classes and not args.eval_only and info.is_main:
        _warn_if_split_differs(source, args)
    skipped, missing = load_matching_weights(model, args.weights, source=state,
                                             leave_out=("fc.",) if new_head else ())
    own = model.state_dict().keys()
    if args.eval_only and (skipped or missing):
        unfit = sorted(set(skipped) | set(missing))
        if trained_on is None and all(k.startswith("fc.") for k in unfit) and any(
                k.startswith("fc.") for k in skipped):  # it has a head, for other classes
            raise ConfigError(f"--eval-only: the classifier of {args.weights} does not fit the "
                              f"{len(classes)} classes of the data, and its class names are "
                              "unknown (no usable class_indices.json beside it or one folder "
                              "up), so the data's classes cannot be matched to its outputs; put "
                              "its run's class_indices.json beside it, or evaluate on the "
                              "classes it was trained on.")
        gaps, left = [k for k in unfit if k in own], [k for k in unfit if k not in own]
        why = ([f"{len(gaps)} of the model's tensors are missing from it or have other shapes, "
                f"e.g. {gaps[0]}"] if gaps else []) + (
            [f"{len(left)} of its tensors are not in the model, e.g. {left[0]}"] if left else [])
        raise ConfigError(f"--eval-only: {args.weights} does not fit --model {args.model} with "
                          f"{len(classes)} classes ({'; '.join(why)}), so the accuracy would be "
                          "meaningless; pass the --model and data it was trained with.")
    if not info.is_main:  # every rank loads the same: said once
        return
    if reordered:
        log.info("%s was trained on the classes of the data in another order (%s): its "
                 "classifier's outputs are reordered to the data's (%s).", args.weights,
                 short_list(trained_on, 5), short_list(classes, 5))
    head = [k for k in missing if k.startswith("fc.")]
    log.info("loaded %s into --model %s: %d of the model's %d tensors%s", args.weights, args.model,
             len(own) - len(missing), len(own),
             "" if not head else f"; the classifier ({short_list(head, 3)}) starts new for "
             f"{len(classes)} classes" + (f" (it was trained on {short_list(trained_on, 5)})"
                                          if other_classes and new_head else ""))
    extra = [k for k in skipped if k not in own]
    if extra:
        log.warning("%s holds %d tensor(s) that --model %s does not have (%s), left out; were "
                    "the weights made for a deeper --model?", args.weights, len(extra),
                    args.model, short_list(extra, 3))
    backbone = [k for k in missing if not k.startswith("fc.")]
    if backbone:  # a new head is expected, a backbone left as initialised is not
        log.warning("%d backbone tensor(s) of --model %s were not loaded from %s (%s): that "
                    "part trains from scratch; were the weights made for another --model?",
                    len(backbone), args.model, args.weights, short_list(backbone, 3))


def _check_weights_model(args: argparse.Namespace, source: Any) -> None:
    """Refuse ``--weights`` that record another model: a checkpoint's own args, bare weights'
    run's args.json. (Weights from elsewhere, torchvision's, record none: their tensors tell.)"""
    own = _is_checkpoint(source)
    saved = source.get("args", {}) if own else run_args_near(args.weights)[0]
    trained_with = saved.get("model") if isinstance(saved, dict) else None
    if trained_with and trained_with != args.model:
        said_by = "" if own else " (its run's args.json)"
        raise CheckpointError(f"{args.weights} was trained with --model {trained_with}{said_by} "
                              f"but this run has --model {args.model}; use --model "
                              f"{trained_with}.")


def _check_bare_weights(args: argparse.Namespace, trained_on: list[str] | None,
                        classes: list[str], *, warn: bool) -> None:
    """Eval-only of bare weights: refuse other classes, as named by the class_indices.json of
    their run; say when there is nothing to check by. (Their model: _check_weights_model.)"""
    if trained_on is None and warn:
        log.warning("%s beside %s (or one folder up): its class names cannot be checked against "
                    "the data's; if they differ, the accuracy is meaningless.",
                    "no usable class_indices.json" if find_run_file(
                        args.weights, "class_indices.json") else "no class_indices.json",
                    args.weights)
    elif trained_on is not None and trained_on != classes:
        raise CheckpointError(_class_mismatch(args.weights, trained_on, classes,
                                              "evaluate it on the data it was trained on",
                                              evaluating=True))


def _weights_classes(path: str, source: Any, *, warn: bool = False) -> list[str] | None:
    """The class names ``path`` was trained on, in NFC: a checkpoint's own list, else the run's
    class_indices.json beside bare weights (or one folder up, as training writes them).

    A class_indices.json that is not training's ``{"0": "daisy", ...}`` (ImageFolder's
    ``{"daisy": 0}``, a damaged file) or lists another count of classes than the weights'
    classifier has outputs is not their run's: ignored, and said when ``warn``."""
    names = source.get("classes") if _is_checkpoint(source) else None
    found = find_run_file(path, "class_indices.json") if names is None else None
    if found is None:
        return _nfc(names)
    problem = None
    try:
        indices = json.loads(found.read_text(encoding="utf-8"))
        names = [indices[str(i)] for i in range(len(indices))]
        if not names or len(set(names)) < len(names) or not all(isinstance(n, str) for n in names):
            raise TypeError  # no classes, or one named twice: not a list training writes
    except (OSError, ValueError, KeyError, TypeError) as exc:
        names = None
        problem = (f"cannot be read ({exc.strerror or exc})" if isinstance(exc, OSError) else
                   'is not a map of the indices 0..N-1 to distinct class names ({"0": "daisy", '
                   '...}) as training writes it')
    head = _classifier_outputs(source)
    if names is not None and head is not None and len(names) != head:
        problem = (f"lists {len(names)} classes but the classifier of {path} has {head} outputs, "
                   "so it is not the file of the run that trained it")
        names = None
    if problem and warn:
        log.warning("ignoring %s, which %s; the class names of %s are unknown.", found, problem,
                    path)
    return _nfc(names)


def _classifier_outputs(source: Any) -> int | None:
    """Rows of the ``fc.weight`` in loaded weights or a checkpoint, or None (no such tensor)."""
    try:
        weight = extract_state_dict(source, "").get("fc.weight")
    except CheckpointError:
        return None
    return weight.shape[0] if weight is not None and weight.dim() == 2 else None


def _warn_if_split_differs(source: Any, args: argparse.Namespace) -> None:
    """Weights trained on these classes with another split have seen some of this run's
    validation images: its accuracy would be optimistic. Bare weights are judged by their run's
    args.json."""
    if args.val_path:  # validation on a folder of its own: no split to overlap
        return
    if _is_checkpoint(source):
        saved, old = source.get("args", {}), _old_split(source)
    else:
        saved, old = run_args_near(args.weights)[0], False
    redrawn = _redrawn(saved, args)
    if redrawn:
        log.warning("%s was trained on these classes with %s: this run's validation split may "
                    "include images those weights trained on, so its accuracy is optimistic; "
                    "use the values it was trained with to keep them apart.", args.weights,
                    ", ".join(redrawn))
    elif old:
        log.warning("%s was trained on these classes by an earlier version of this template, "
                    "which drew its split another way, so this run's validation split includes "
                    "images those weights trained on and no flag keeps them apart; treat val "
                    "accuracy as optimistic, or score a separate test folder with --eval-only "
                    "--val-rate 1.", args.weights)


def _score_against_trained_classes(path: str, classes: list[str], val_set: MyDataSet,
                                   info: DistInfo) -> list[str]:
    """The classes to score ``val_set`` against: all those ``path`` was trained on when the data
    holds only some of them (a test set often lacks one), its labels renumbered by class name,
    so each image keeps its class; the missing classes show "n/a". Anything else (the same
    classes, new ones, nothing recorded) is ``classes``, for the checks that follow."""
    trained = _weights_classes(path, load_file(path))
    if trained is None or trained == classes or not set(classes) <= set(trained):
        return classes
    new_label = np.asarray([trained.index(name) for name in classes], dtype=np.int64)
    val_set.images_class = new_label[val_set.images_class]
    if info.is_main and set(classes) == set(trained):
        log.info("the data's classes are those %s was trained on, in another order: each image "
                 "is scored against its class by name.", path)
    elif info.is_main:
        log.info("the data holds %d of the %d classes %s was trained on (missing: %s): its "
                 "images are scored against all %d.", len(classes), len(trained), path,
                 short_list([c for c in trained if c not in classes], 5), len(trained))
    return trained


def _class_mismatch(path: str, trained_on: list[str], classes: list[str], redo: str, *,
                    evaluating: bool = False) -> str:
    """Why ``classes`` cannot go with weights trained on ``trained_on``; ``redo`` says what to do
    instead. An evaluation may score some of the trained classes: only new ones count there."""
    gone = [c for c in trained_on if c not in classes]
    new = [c for c in classes if c not in trained_on]
    if evaluating and new:
        return (f"{path} was trained on the classes {short_list(trained_on)}, but the data has "
                f"class folder(s) it has no output for: {short_list(new, 5)}; score a folder "
                "whose class folders are among those it was trained on (some may be missing).")
    diff = "; ".join([f"not in the data: {short_list(gone, 5)}"] * bool(gone)
                     + [f"new: {short_list(new, 5)}"] * bool(new)) or "same names, other order"
    return (f"{path} was trained on the classes {short_list(trained_on)} but the data has "
            f"{short_list(classes)} ({diff}), so its labels would be wrong; {redo}.")


def _check_norm_batch(args: argparse.Namespace, info: DistInfo, model: nn.Module) -> None:
    """Training BatchNorm needs more than one value per channel; ResNet's last stage is
    ceil(img_size / 32) pixels square, so batch 1 at 32 px or less would fail mid-step."""
    if args.eval_only or args.freeze_layers:  # eval mode: running statistics, any batch works
        return
    per_norm = args.batch_size * (info.world_size if args.sync_bn and info.distributed else 1)
    has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    values = per_norm * math.ceil(args.img_size / 32) ** 2
    if has_norm and values == 1:
        raise ConfigError(f"--batch-size {args.batch_size} at --img-size {args.img_size}: the last "
                          "BatchNorm layers would see one value per channel, which training "
                          "cannot normalise; use --batch-size 4 or more, or --img-size above "
                          "32.")
    if has_norm and values < 4 and info.is_main:
        # Normalised over 2-3 values, training's outputs barely depend on the input, and the
        # running statistics evaluation uses are far from them: val loss 0 or 1e9 in drills.
        log.warning("--batch-size %d at --img-size %d: the last BatchNorm layers see only %d "
                    "values per channel, too few for usable statistics, so validation numbers "
                    "will be meaningless; use --batch-size %d or more%s, or a larger "
                    "--img-size.", args.batch_size, args.img_size, values,
                    math.ceil(4 * args.batch_size / values),
                    "" if args.sync_bn and info.distributed else
                    ", --sync-bn with several processes")


def _hold_frozen_norms(model: nn.Module) -> None:
    """BatchNorm layers with frozen weights also keep their running statistics (eval mode even
    while training), as in linear probing; in train mode every batch would still move them."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and not any(p.requires_grad for p in m.parameters(recurse=False))]

    def to_eval(module: nn.Module, inputs: Any) -> None:  # after model.train() set them back
        for norm in norms:
            norm.eval()
    model.register_forward_pre_hook(to_eval)


def _launcher_restarts() -> int:
    """How often the launcher has restarted this process's run (torchrun --max-restarts, an
    elastic change of members, a requeued SLURM job); 0 on its first start."""
    counts = [os.environ.get(name, "0") for name in ("TORCHELASTIC_RESTART_COUNT",
                                                     "SLURM_RESTART_COUNT")]
    return max(int(count) if count.isdigit() else 0 for count in counts)


def launch_id() -> str | None:
    """What names one launch across its restarts, and only it (None: nothing does): the SLURM
    job (a requeue keeps it; torchrun inside it draws a new id each time), else torchrun's run
    id, or, for its id "none", this machine's torchrun process, which restarts the workers."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun {run_id}"
    if run_id:
        try:
            stat_fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return f"torchrun pid {os.getppid()} started {stat_fields[19]} on {platform.node()}"
    return None


def _resolve_resume(args: argparse.Namespace, out: Path) -> str | None:
    """The checkpoint every rank resumes from, decided by rank 0 (None: start fresh).

    Only rank 0 writes checkpoints, so on several machines without a shared --output-dir the
    other ranks would not find it and would silently start from epoch 0 with other weights.
    """
    if args.resume in (None, "", "none"):
        restarts = 0 if args.eval_only else max(all_gather_object(_launcher_restarts()))
        # A restart runs the same command again: "start anew" meant the launch, and starting
        # anew at each restart would throw its epochs away. The folder is the launch's own once
        # its args.json names the launch (written as the earlier run's files were set aside).
        launch = launch_id() if restarts else None
        own = launch is not None and \
            run_args_near(out / "checkpoint.pth")[0].get("launch") == launch
        path = str(out / "checkpoint.pth") if own and (out / "checkpoint.pth").is_file() \
            else None
        path = broadcast_object(path)  # rank 0 decides, for every rank
        if path is None:
            return None
        log.info("restart %d of this launch: continuing its own %s (--resume none started "
                 "the launch anew, not each restart).", restarts, path)
    elif args.eval_only and args.weights:
        if args.resume != "auto":
            raise ConfigError(f"--eval-only got both --resume {args.resume} and --weights "
                              f"{args.weights}; give one of them.")
        return None  # score the file asked for, not an earlier run's checkpoint.pth
    else:
        path = _resume_path(args, out)
    if path is not None and not all_ranks_ok(os.path.isfile(path)):
        raise CheckpointError(f"checkpoint {path} is not readable on every rank; put --output-dir "
                              "on storage all machines share, or copy the file to each of them.")
    return path


def _resume_path(args: argparse.Namespace, out: Path) -> str | None:
    """``--resume auto`` or PATH, as rank 0 sees it (broadcast)."""
    path, error = args.resume, None
    if args.resume == "auto":
        path = str(out / "checkpoint.pth") if (out / "checkpoint.pth").is_file() else None
        if path is None and _first_save_interrupted(out) and (out / "model_best.pth").is_file():
            path = str(out / "model_best.pth")  # epoch 0, complete: the same state
            log.info("the first epoch's save was interrupted before checkpoint.pth; its "
                     "model_best.pth is complete, so the run continues from it.")
    elif os.path.isdir(path) or not os.path.exists(path):
        error = not_a_file(path, "--resume")
    path, error = broadcast_object((path, error))  # rank 0 decides, for every rank
    if error:
        raise CheckpointError(error)
    if path is None and args.resume == "auto" and not all_ranks_ok(
            not (out / "checkpoint.pth").is_file()):
        # Rank 0 (with c10d rendezvous, whichever machine joined first) sees no checkpoint
        # where another sees one: node-local output folders. Starting over would fork the run.
        raise CheckpointError(f"{out / 'checkpoint.pth'} exists on some machines of this run "
                              "but not on the one of rank 0; put --output-dir on storage all "
                              "machines share, or copy the run's folder to each of them.")
    return path


def _load_checkpoint(path: str, args: argparse.Namespace, classes: list[str], *,
                     warn: bool = True, val_split: str | None = None) -> dict[str, Any]:
    """The checkpoint at ``path``, checked against this run; ``warn``: say what differs (rank 0
    only, since every rank finds the same); ``val_split``: this run's :func:`_split_digest`."""
    try:
        ckpt = load_file(path)
    except CheckpointError as exc:
        folder, options = Path(path).parent, []
        if (folder / "model_best.pth").is_file() and Path(path).name != "model_best.pth":
            options.append(f"--resume {folder / 'model_best.pth'}")
        newest = sorted((folder / "weights").glob("model-*.pth"), key=os.path.getmtime)
        if newest:
            options.append(f"--resume none --weights {newest[-1]} (weights only; the schedule "
                           "starts over)")
        options.append("--resume none to start over")
        raise CheckpointError(f"{exc} Continue with {', or '.join(options)}.") from exc
    if not _is_checkpoint(ckpt):
        raise CheckpointError(f"{path} is not a training checkpoint (no 'model'/'epoch'); to start "
                              "from bare weights use --weights instead of --resume.")
    _check_checkpoint(ckpt, path, args, classes, warn=warn, val_split=val_split)
    return ckpt


def _plan(args: argparse.Namespace, info: DistInfo, start_epoch: int,
          amp_dtype: torch.dtype | None, channels_last: bool, lr: float) -> str:
    """E.g. "training resnet34 at 224 px, epochs 0-29: 2 process(es) on cuda with nccl, bfloat16
    autocast, channels-last; batch 32 per process, 64 per optimizer step; lr 0.01 (--lr 0.005 x 2
    processes)"."""
    how = [f"{info.world_size} process(es) on {info.device.type}"
           + (f" with {info.backend}" if info.backend else "")]
    if amp_dtype is not None:
        how.append(f"{str(amp_dtype).removeprefix('torch.')} autocast")
    if channels_last:
        how.append("channels-last")
    batch = f"batch {args.batch_size} per process"
    if args.grad_accum_steps > 1 or info.world_size > 1:
        batch += (f", {args.batch_size * args.grad_accum_steps * info.world_size} per optimizer "
                  "step")
    scaled = [f"{info.world_size} processes"] * (info.world_size > 1) + [
        f"{args.grad_accum_steps} accumulated batches"] * (args.grad_accum_steps > 1)
    return (f"training {args.model} at {args.img_size} px, epochs {start_epoch}-{args.epochs - 1}: "
            f"{', '.join(how)}; {batch}; lr {lr:.3g}"
            + (f" (--lr {args.lr:g} x {' x '.join(scaled)})"
               if args.scale_lr and scaled and start_epoch == 0 else ""))


def _same_file(a: str | None, b: str | None) -> bool:
    """``a`` and ``b`` name one file (either may be relative, to another folder, or gone)."""
    if a is None or b is None:
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _is_checkpoint(obj: Any) -> bool:
    return isinstance(obj, dict) and "model" in obj and "epoch" in obj


def _nfc(names: list[str] | None) -> list[str] | None:
    """Class names in NFC, as the scan names them (a macOS copy writes NFD); None for anything
    that is not a list of names (a class_indices.json not written by training)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return None
    return [unicodedata.normalize("NFC", n) for n in names]


def _redrawn(saved: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """``--seed``/``--val-rate``/``--val-path`` that differ from ``saved`` (a run's args): each
    draws another split, so validation would include images that run trained on. A separate
    --val-path folder draws none (which files it holds, the split digest compares); leaving it
    out validates on a split of what that run trained on, all of --data-path."""
    if args.val_path:
        return []
    if saved.get("val_path"):
        return [f"--val-path {saved['val_path']}"]
    return [f"--{k.replace('_', '-')} {saved[k]} (not {getattr(args, k)})"
            for k in ("seed", "val_rate") if k in saved and saved[k] != getattr(args, k)]


def _old_split(ckpt: dict[str, Any]) -> bool:
    """True for our checkpoints from before the per-file split (their fingerprint has no scheme
    prefix, or there is none); a hand-made checkpoint without our args is not judged."""
    return "args" in ckpt and not str(ckpt.get("val_split")).startswith(SPLIT_SCHEME)


def _check_split(ckpt: dict[str, Any], path: str, args: argparse.Namespace, *, warn: bool,
                 val_split: str | None) -> None:
    """Refuse to resume on another train/validation split; say what an evaluation scores."""
    saved = ckpt.get("args", {})
    if args.val_path and saved and not saved.get("val_path") and not args.eval_only:
        raise CheckpointError(f"{path} was trained without --val-path, validating on a "
                              f"--val-rate {saved.get('val_rate')} split of its data: with "
                              "--val-path it would train on those validation images and pick "
                              "model_best across two validation sets; resume without --val-path, "
                              "or start over with --resume none or another --output-dir.")
    redrawn = _redrawn(saved, args)
    if redrawn and not args.eval_only:
        raise CheckpointError(f"{path} was trained with {', '.join(redrawn)}: another value "
                              "draws another train/validation split, so validation would include "
                              "images it trained on; resume with the values it was trained with, "
                              "or start over with --resume none or another --output-dir.")
    data = args.data_path or "the demo data"
    if redrawn and warn and args.val_rate >= 1:
        log.info("--val-rate 1: scoring every image of %s (should it hold images %s trained on, "
                 "the accuracy is optimistic).", data, path)
    elif redrawn and warn:
        log.warning("%s was trained with %s: this evaluation draws another validation split, "
                    "which may include images it trained on; pass the values it was trained "
                    "with to score it on its own validation images.", path, ", ".join(redrawn))
    elif redrawn or val_split is None or ckpt.get("val_split") == val_split:
        return
    elif args.val_path:
        if warn and args.eval_only:
            log.info("scoring every image of %s (should it hold images %s trained on, the "
                     "accuracy is optimistic).", args.val_path, path)
        elif warn:
            log.warning("the validation images differ from those %s was validated on (another "
                        "or a changed --val-path folder): val accuracy is not comparable with "
                        "earlier epochs.", path)
    elif _old_split(ckpt):
        old = (f"{path} was made by an earlier version of this template, which drew the "
               "validation split another way, so validation would include images it trained on")
        if not args.eval_only:
            raise CheckpointError(f"{old}; finish it with the version that started it, or start "
                                  "over with --resume none or another --output-dir.")
        if warn:
            log.warning("%s; this evaluation's accuracy is optimistic.", old)
    elif "val_split" not in ckpt:  # hand-made, without our args: its split is unknown
        return
    elif warn and args.eval_only:
        log.warning("the validation images differ from those %s was validated on (other or "
                    "changed data): this scores the --val-rate %g split of %s; to score every "
                    "image of a separate test folder, add --val-rate 1.", path, args.val_rate,
                    data)
    elif warn:
        log.warning("the validation images differ from those %s was validated on: val accuracy "
                    "is not comparable with earlier epochs. Added or removed images move no "
                    "other file across the split (a file's side depends only on its path and "
                    "--seed), but a renamed or moved file is new to it and may have been "
                    "trained on under its old name.", path)


def _check_checkpoint(ckpt: dict[str, Any], path: str, args: argparse.Namespace,
                      classes: list[str], *, warn: bool, val_split: str | None = None) -> None:
    """Refuse what cannot go on from ``ckpt`` (another model, other classes, ...); warn of the
    rest."""
    saved = ckpt.get("args", {})
    redo = ("evaluate it on the data it was trained on" if args.eval_only else
            "resume with the data it was trained on, or use another --output-dir")
    if "model" in saved and saved["model"] != args.model:
        raise CheckpointError(f"{path} was trained with --model {saved['model']} but this run has "
                              f"--model {args.model}; use --model {saved['model']}"
                              f"{'' if args.eval_only else ' or another --output-dir'}.")
    # Labels are folder indices: the same count in another order would train on wrong labels.
    trained_on = _nfc(ckpt.get("classes"))
    if trained_on is not None and trained_on != list(classes):
        raise CheckpointError(_class_mismatch(path, trained_on, classes, redo,
                                              evaluating=args.eval_only))
    if trained_on is None and saved.get("num_classes", len(classes)) != len(classes):
        raise CheckpointError(f"{path} was trained on {saved['num_classes']} classes but the data "
                              f"has {len(classes)}; {redo}.")
    _check_split(ckpt, path, args, warn=warn, val_split=val_split)
    frozen = saved.get("freeze_layers", args.freeze_layers)
    if frozen != args.freeze_layers and not args.eval_only:
        # The optimizer state holds one entry per trainable tensor: it cannot be carried over.
        raise CheckpointError(f"{path} was trained with --{'' if frozen else 'no-'}freeze-layers; "
                              "resume with the same flag, or keep its weights and start a new "
                              f"schedule with --resume none --weights {path}.")
    # optimizer.load_state_dict restores these from the checkpoint, whatever the flags say.
    kept = [f"--{k.replace('_', '-')} {saved[k]} (not {getattr(args, k)})"
            for k in ("lr", "momentum", "weight_decay")
            if k in saved and saved[k] != getattr(args, k)]
    if saved.get("scale_lr", args.scale_lr) != args.scale_lr:  # the lr it holds follows its rule
        kept.append(f"--{'' if saved['scale_lr'] else 'no-'}scale-lr (not "
                    f"--{'' if args.scale_lr else 'no-'}scale-lr)")
    if kept and warn and not args.eval_only:
        log.warning("resuming keeps the optimizer of %s: %s; to train with the new value(s), "
                    "start over with --resume none or another --output-dir.", path,
                    ", ".join(kept))
    if saved.get("img_size", args.img_size) != args.img_size and warn:
        log.warning("%s was trained at --img-size %s; this run uses %d%s.", path,
                    saved["img_size"], args.img_size,
                    " (pass --img-size to evaluate as trained)" if args.eval_only else "")


_RUN_LOCK: int | None = None  # rank 0's lock on --output-dir, held until the process exits


def _claim_output_dir(args: argparse.Namespace, out: Path) -> None:
    """Rank 0, before anything is written: ``out`` is a writable folder that no other run is
    using, and training in it cannot overwrite an earlier run's results.

    The lock (``lockf`` on ``<out>/.lock``) stops a second job, e.g. a rerun while orphaned ranks
    of a killed launcher still train, from interleaving two runs' checkpoints; the kernel drops
    it when the process dies, however it dies. A POSIX record lock, not ``flock``: forked
    DataLoader workers would share a ``flock`` and keep the folder locked after a kill -9 of
    their rank until they notice and exit.
    """
    global _RUN_LOCK
    lock = out / ".lock"
    try:
        out.mkdir(parents=True, exist_ok=True)
        # In a shared folder a link could point the run's pid at someone's file.
        if os.path.lexists(lock) and not stat.S_ISREG(os.lstat(lock).st_mode):
            what = ("a symbolic link" if lock.is_symlink() else
                    "a folder" if lock.is_dir() else "not a regular file")
            raise ConfigError(f"{lock} is {what}, not the lock file a run writes; remove it.")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        link = next((p for p in (out, *out.parents) if p.is_symlink() and not p.exists()), None)
        if link is not None:  # e.g. runs -> /scratch/me, and /scratch is not mounted
            raise ConfigError(f"--output-dir {out}: {link} is a symbolic link to "
                              f"{os.readlink(link)}, which leads nowhere (missing, not mounted, "
                              "or a loop); fix the link or choose another folder.") from None
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            raise ConfigError(f"--output-dir {out} is (under) a file, not a folder; choose a "
                              "folder.") from None
        raise ConfigError(f"cannot write to --output-dir {out}: {exc.strerror}; choose a folder "
                          "you can write to.") from None
    try:
        import fcntl  # POSIX; elsewhere the run goes unlocked

        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # held (lockf may say either)
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"another training run (pid {holder}) is using --output-dir {out}; "
                              "wait for it to finish or stop it, or use another --output-dir.")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    except (ImportError, OSError) as exc:  # no locking (e.g. some network file systems)
        log.warning("could not lock --output-dir %s (%s); make sure no other run uses it.", out,
                    exc)
    _RUN_LOCK = fd
    try:  # e.g. a read-only folder whose .lock a writable earlier run left: found now, not later
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        raise ConfigError(f"cannot write to --output-dir {out}: {exc.strerror}; choose a folder "
                          "you can write to.") from None

    # Temp files of saves a kill -9 interrupted (write_atomic; metrics.jsonl.tmp of older
    # versions): never read.
    stale = [*out.glob(".*.tmp"), *(out / "weights").glob(".*.tmp"), out / "metrics.jsonl.tmp"]
    removed = sum(1 for path in stale if path.is_file() and not path.unlink())
    if removed:
        log.info("removed %d temp file(s) of interrupted saves from %s", removed, out)
    checkpoint = out / "checkpoint.pth"
    if checkpoint.exists() and not checkpoint.is_file():
        raise ConfigError(f"{checkpoint} is not a file; move it away or use another --output-dir.")
    aside = out / PREVIOUS_RUN
    if args.resume == "auto" and not checkpoint.exists() and (aside / "checkpoint.pth").is_file():
        # A --resume none stopped before its first save: the run it replaced is still whole.
        raise CheckpointError(
            f"{out} holds no checkpoint.pth, but the run that an interrupted --resume none "
            f"moved aside is in {aside}: continue it with `cp -r {aside}/. {out}/ && rm -r "
            f"{aside}` and the same command, or start over with --resume none.")
    if args.resume == "auto" and _first_save_interrupted(out):
        # Killed while epoch 0 was saved (checkpoint.pth is written last): not an earlier run.
        # A complete model_best.pth is that epoch (see _resolve_resume); else it starts over.
        if not (out / "model_best.pth").is_file():
            started = out / "weights" / "model-0.pth"
            if started.is_file():
                started.unlink()
                log.info("%s: the first epoch's save was interrupted; starting that epoch again.",
                         out)
            else:
                log.info("%s: no epoch was completed here yet; starting from epoch 0.", out)
    earlier = [name for name in ("metrics.jsonl", "model_best.pth")
               if (out / name).is_file() and (out / name).stat().st_size > 0]
    if any((out / "weights").glob("model-*.pth")):
        earlier.append("weights/")
    if (args.resume == "auto" and not checkpoint.exists() and earlier
            and not _first_save_interrupted(out)):
        best = (f" continue from its best epoch with --resume {out / 'model_best.pth'},"
                if (out / "model_best.pth").is_file() else "")
        raise CheckpointError(
            f"{out} holds an earlier run ({', '.join(earlier)}) but no checkpoint.pth to "
            f"continue from; use another --output-dir,{best} or start over in it with "
            "--resume none (its checkpoints, weights and TensorBoard logs are replaced).")
    if (args.resume not in ("auto", "none", "", None) and (earlier or checkpoint.exists())
            and Path(args.resume).resolve().parent != out.resolve()):
        # Its checkpoint, metrics and best model would be replaced by the other run's, and
        # weights/ would hold epochs of both.
        raise CheckpointError(
            f"{out} holds another run ({', '.join(earlier or ['checkpoint.pth'])}); resuming "
            f"{args.resume} there would mix the two runs' files. Use another --output-dir, or "
            f"continue the run that is there with --resume auto.")
    weights = out / "weights"
    if weights.exists() and not weights.is_dir():
        raise ConfigError(f"{weights} is not a folder; move it away or use another --output-dir.")


def _first_save_interrupted(out: Path) -> bool:
    """Whether ``out`` holds only what a run leaves when killed while saving its first epoch.

    A run starts by writing an empty metrics.jsonl; an epoch's save writes weights/model-N.pth,
    model_best.pth, checkpoint.pth and then the metrics line. So no checkpoint, an empty
    metrics.jsonl and no weights but model-0.pth mean that no epoch was ever completed here.
    """
    metrics = out / "metrics.jsonl"
    weights = {p.name for p in (out / "weights").glob("model-*.pth")}
    return (not (out / "checkpoint.pth").exists() and metrics.is_file()
            and metrics.stat().st_size == 0 and weights <= {"model-0.pth"})


def _release_output_dir() -> None:
    """Drop the lock early (process exit drops it anyway): ``train`` may be called again."""
    global _RUN_LOCK
    if _RUN_LOCK is not None:
        os.close(_RUN_LOCK)
        _RUN_LOCK = None


def _check_on_rank0(check: Callable[..., None], *check_args: Any, info: DistInfo) -> None:
    """Run ``check`` on rank 0 and raise its user error on every rank, so none waits alone."""
    error = None
    if info.is_main:
        try:
            check(*check_args)
        except USER_ERRORS as exc:
            error = exc
    error = broadcast_object(error)
    if error is not None:
        raise error


def _jsonable(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v))
            for k, v in {**vars(args), **extra}.items()}


# Flags that may differ between machines: where the data and the run's folder are, and what
# only rank 0 does. (--resume and --weights decide which collectives a rank makes: not these.)
PER_MACHINE_FLAGS = frozenset({"data_path", "val_path", "demo_dir", "output_dir", "workers", "local_rank",
                               "node_rank", "dist_url", "dist_timeout", "device",
                               "verify_images", "tensorboard", "keep_last"})


def _check_same_flags(args: argparse.Namespace, info: DistInfo) -> None:
    """Every rank must train with the same flags. Another --lr or --img-size on one machine
    trains silently wrong (rank 0 records its own); another --batch-size or --seed gives the
    ranks other step counts, and they wait on each other until --dist-timeout."""
    if not info.distributed:
        return
    # Where --val-path is may differ; whether there is one decides the collectives (a scan).
    flags = all_gather_object({**{key: value for key, value in _jsonable(args).items()
                                  if key not in PER_MACHINE_FLAGS},
                               "val_path": "given" if args.val_path else "not given"})
    differ = []
    for key in sorted(flags[0]):
        values = [rank_flags.get(key) for rank_flags in flags]
        other = next((rank for rank, value in enumerate(values) if value != values[0]), None)
        if other is not None:
            differ.append(f"--{key.replace('_', '-')} {values[0]} on rank 0 but "
                          f"{values[other]} on rank {other}")
    if differ:
        raise ConfigError(f"the processes of this run were started with different flags "
                          f"({'; '.join(differ)}); start every process with the same "
                          "training flags.")


def _inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """``path`` is ``folder`` or below it, links resolved."""
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError):  # a symbolic link loop: named by the checks that follow
        return False


def _run(args: argparse.Namespace, info: DistInfo) -> None:
    global _set_up
    _check_same_flags(args, info)
    asked = getattr(args, "world_size", None)  # the spawn launcher's: per machine
    if asked is not None and asked * getattr(args, "nnodes", 1) != info.world_size:
        raise ConfigError(f"--world-size {asked} but this run has {info.world_size} "
                          "process(es); drop --world-size: the launcher's own flags (torchrun "
                          "--nproc_per_node x --nnodes, srun -n) decide, and plain python runs "
                          "one.")
    out = Path(args.output_dir)
    data_root = Path(args.data_path or args.demo_dir or default_demo_root())
    if not args.eval_only:
        for folder in filter(None, (data_root, args.val_path)):
            if _inside(out, folder):  # the next scan would read the run's PNGs as a class
                raise ConfigError(f"--output-dir {out} is inside the data folder {folder}, where "
                                  "its files would be read as images of a class; choose an "
                                  "output folder outside it.")
        if args.val_path and (_inside(args.val_path, data_root)
                              or _inside(data_root, args.val_path)):
            raise ConfigError(f"--val-path {args.val_path} and --data-path {data_root} overlap, "
                              "so the model would train on images it is validated on; give "
                              "two separate folders (e.g. DATA/train and DATA/val).")
    if args.val_rate >= 1 and not args.eval_only and not args.val_path:
        raise ConfigError("--val-rate 1 leaves no image for training; it is for --eval-only "
                          "(score every image of a test folder), else use a fraction below 1.")
    if not args.eval_only:  # evaluation writes nothing
        _check_on_rank0(_claim_output_dir, args, out, info=info)
        if args.tensorboard:  # found now, not as a traceback after the data scan
            _check_on_rank0(_require_tensorboard, info=info)
    resume_path = _resolve_resume(args, out)
    if args.weights and (resume_path is None or args.eval_only):  # read: found before the scan
        problem = not_a_file(args.weights, "--weights")
        if not all_ranks_ok(problem is None):
            raise CheckpointError(problem or f"--weights {args.weights} is missing on some "
                                  "machines of this run; put it on storage all machines share, "
                                  "or copy it to each of them.")
    if args.eval_only and resume_path is None and not args.weights:
        raise ConfigError("--eval-only needs a model: give --resume CHECKPOINT or --weights FILE.")
    if args.freeze_layers and not args.weights and resume_path is None and not args.eval_only:
        raise ConfigError("--freeze-layers trains only the classifier (fc) on the features of "
                          "--weights, but no --weights was given, so the frozen layers would stay "
                          "random; give pretrained --weights or drop --freeze-layers.")
    _seed_everything(args.seed, info.rank)
    device = info.device
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N processes x all-cores threads oversubscribe the CPU (2-5x slower here); share them.
        torch.set_num_threads(cpus_per_process())
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input size: let cuDNN pick the fastest
    scan, val_scan, train_set, val_set, train_sampler, train_loader, val_loader = _build_data(
        args, info, out)
    # Every rank reads the model files itself: one machine's copy may be damaged or unreadable,
    # and its ranks stopping alone would leave the others waiting in the next collective.
    problem = None
    try:
        classes = scan.classes
        if args.eval_only:  # a test folder may hold only some of the classes the model knows
            model_path = resume_path or args.weights
            classes = _score_against_trained_classes(model_path, classes, val_set, info)
            if args.num_classes is not None and args.num_classes != len(classes):
                raise ConfigError(
                    f"--num-classes {args.num_classes} disagrees with the {len(classes)} classes "
                    f"{model_path} was trained on (the data holds {len(scan.classes)} of them); "
                    "drop the flag." if classes is not scan.classes else
                    f"--num-classes {args.num_classes} disagrees with the {len(classes)} class "
                    f"folders found in {scan.root} ({', '.join(classes)}); drop the flag or fix "
                    "the folders.")
        num_classes = len(classes)
        val_split = _split_digest((val_scan or scan).root, val_set.images_path)
        # A resumed run's weights come from its checkpoint: --weights only started it, and may
        # be gone by now (a scratch file, a relative path from another folder) without
        # stopping a rerun.
        model = _build_model(args, info, classes, load_weights=resume_path is None,
                             val_split=val_split)
        _check_norm_batch(args, info, model)
        ckpt = (_load_checkpoint(resume_path, args, classes, warn=info.is_main,
                                 val_split=val_split) if resume_path else None)
    except USER_ERRORS as exc:
        problem = exc
    if not all_ranks_ok(problem is None):
        raise problem or CheckpointError(
            f"another process of the run could not load {resume_path or args.weights} (its "
            "machine's error line says why); every machine needs a readable copy.")
    if ckpt is not None:
        state, own = extract_state_dict(ckpt, resume_path), model.state_dict()
        # Checkpoints without recorded args (or from edited code) are checked by shape.
        unfit = sorted(k for k in state.keys() | own.keys()
                       if k not in state or k not in own or state[k].shape != own[k].shape)
        if unfit:
            raise CheckpointError(f"{resume_path} does not fit --model {args.model} with "
                                  f"{num_classes} classes ({len(unfit)} tensor(s) differ, e.g. "
                                  f"{unfit[0]}); resume with the model and data it was trained "
                                  "on, or use another --output-dir.")
        model.load_state_dict(state)
    if not args.eval_only:
        _check_on_rank0(_write_run_files, out, scan, val_scan, ckpt is None, args.weights,
                        info=info)
    channels_last = device.type == "cuda" if args.channels_last is None else args.channels_last
    model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    model_without_ddp = model
    if info.distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
        register_comm_hook(model, args.comm_hook)
        if args.comm_hook != "none":
            log.info("DDP all-reduces gradients in %s (--comm-hook %s)", args.comm_hook,
                     args.comm_hook)
    elif args.comm_hook != "none":
        log.warning("--comm-hook %s does nothing in a single process: there is no all-reduce.",
                    args.comm_hook)
    _set_up = True  # DDP has broadcast the weights: NCCL works between these processes
    if args.compile:
        model = torch.compile(model)

    amp_dtype = resolve_amp_dtype(args.amp, device)
    if common_amp_dtype(amp_dtype) != amp_dtype:
        log.warning("--amp: some GPUs of the run lack bf16 (before Ampere), so this process too "
                    "uses fp16 with loss scaling.")
        amp_dtype = torch.float16
    if (amp_dtype is not None and device.type == "cpu" and info.local_rank == 0  # per machine
            and not _cpu_has_native_bf16()):
        # Measured on an AVX2 CPU (ResNet18, 32 px): 2 img/s with --amp against 39 without.
        log.warning("--amp on this CPU: it has no native bfloat16 (AVX512-BF16 or AMX), so "
                    "autocast emulates it, often 10x slower than float32; drop --amp on CPU.")
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    # Linear scaling with the images per optimizer step: K accumulated batches stand in for K
    # times the processes, and train with their learning rate (a resume follows the same rule).
    lr = args.lr * info.world_size * args.grad_accum_steps if args.scale_lr else args.lr
    params = [p for p in model_without_ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    def lr_lambda(epoch: int) -> float:
        """Cosine from lr to lr * lrf over the run (as the template; SGDR, arXiv:1608.03983)."""
        return ((1 + math.cos(epoch * math.pi / args.epochs)) / 2) * (1 - args.lrf) + args.lrf
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_lambda)

    start_epoch, best_acc, best_loss, history = 0, 0.0, math.inf, []
    in_effect: dict[str, Any] = {}  # the flags a resume keeps from the checkpoint, as recorded
    if ckpt is not None:
        if not args.eval_only:
            try:
                optimizer.load_state_dict(ckpt["optimizer"])
            except (ValueError, KeyError) as exc:  # other trainable parameters, e.g. frozen now
                raise CheckpointError(
                    f"the optimizer state in {resume_path} does not fit this run's trainable "
                    f"parameters ({exc}); resume with the flags it was trained with, or keep its "
                    f"weights and start a new schedule with --resume none --weights "
                    f"{resume_path}.") from None
            if "scaler" in ckpt and scaler.is_enabled():
                scaler.load_state_dict(ckpt["scaler"])
            rng = ckpt.get("rng_states") or []
            if len(rng) == info.world_size:
                restore_rng_state(rng[info.rank], info.device)
            was = ckpt.get("args", {})
            # The optimizer holds these (the lr, by the run's own --scale-lr rule): recorded as
            # given, they would be taken for the run's own at the next resume.
            in_effect = {k: was[k] for k in ("lr", "momentum", "weight_decay", "scale_lr")
                         if k in was}
            scale_lr = was.get("scale_lr", args.scale_lr)  # the run's own rule
            # Processes x batch x accumulated batches: the images of one optimizer step.
            before = (was.get("world_size", info.world_size),
                      was.get("batch_size", args.batch_size),
                      was.get("grad_accum_steps", args.grad_accum_steps))
            now = (info.world_size, args.batch_size, args.grad_accum_steps)
            factor = math.prod(now) / math.prod(before) if scale_lr else 1.0
            # The schedule is rebuilt, not loaded: another --epochs lays the cosine out anew,
            # another step size rescales the lr it starts from.
            scheduler = _resumed_schedule(optimizer, lr_lambda, ckpt["epoch"] + 1, factor)
            planned = ckpt.get("args", {}).get("epochs", args.epochs)
            if planned != args.epochs and ckpt["epoch"] + 1 < args.epochs and info.is_main:
                log.warning("%s was planned for --epochs %d, this run has %d: the cosine "
                            "schedule is laid out anew over %d epochs (lr %.3g at epoch %d).",
                            resume_path, planned, args.epochs, args.epochs,
                            optimizer.param_groups[0]["lr"], ckpt["epoch"] + 1)
            if before != now and ckpt["epoch"] + 1 < args.epochs and info.is_main:  # said once
                log.warning(_step_change(resume_path, before, now, factor, scale_lr))
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt.get("best_acc", 0.0)
        history = [m for m in ckpt.get("metrics", []) if m["epoch"] < start_epoch]
        # Checkpoints from before best_loss: their best was the first epoch at best_acc.
        best_loss = ckpt.get("best_loss", next((m["val_loss"] for m in history
                                                if m["val_acc"] == round(best_acc, 6)), math.inf))
        if args.eval_only:
            best = Path(resume_path).with_name("model_best.pth")
            log.info("evaluating %s: epoch %d%s", resume_path, ckpt["epoch"],
                     f" (the last saved; the best, val acc {best_acc:.4f}, is {best})"
                     if Path(resume_path).name == "checkpoint.pth" and best.is_file() else "")
        else:
            started_from = ckpt.get("args", {}).get("weights", args.weights)
            log.info("resumed from %s: epoch %d done, best val acc %.4f%s", resume_path,
                     ckpt["epoch"], best_acc, f" (--weights {args.weights} only started the run "
                     "and is not read again)" if args.weights and _same_file(
                         started_from, args.weights) else "")
            if args.weights and not _same_file(started_from, args.weights) and info.is_main:
                # E.g. pretrained weights added to a command whose --output-dir holds a run.
                log.warning("--weights %s is not read: this run resumes from %s, which started "
                            "from %s; to start from %s, use another --output-dir (or --resume "
                            "none here).", args.weights, resume_path, started_from or
                            "random weights", args.weights)

    if args.eval_only:
        result = evaluate(model, val_loader, device, amp_dtype=amp_dtype, channels_last=channels_last)
        _report_eval(result, classes)
        return

    if start_epoch >= args.epochs:  # a finished run's files stay as trained
        log.info("%s holds epochs 0-%d, so --epochs %d leaves nothing to train.", out,
                 start_epoch - 1, args.epochs)
        _check_on_rank0(_restore_metrics, out, history, info=info)
        return
    resolved = {"world_size": info.world_size, "backend": info.backend, "device": str(device),
                "launch": launch_id(),
                "amp_dtype": str(amp_dtype).removeprefix("torch.") if amp_dtype else None}
    _check_on_rank0(_write_start_files, out, _jsonable(args, **in_effect, **resolved), history,
                    ckpt is None, args.weights, info=info)
    writer, step_writer = _tensorboard(args, info, out, start_epoch, len(train_loader), train_set,
                                       classes)
    if info.is_main:  # what the flags and the launcher resolved to, in one line
        log.info(_plan(args, info, start_epoch, amp_dtype, channels_last,
                       optimizer.param_groups[0]["lr"]))

    # The loaders fork their workers in the first epoch. Frozen objects are left alone by the
    # workers' garbage collector, which would otherwise touch (so copy) every list and tuple
    # this process holds (measured with 64k images, with MyDataSet's packed paths: 130 -> 48 MB
    # private memory per worker after one epoch). train() unfreezes them at the end.
    gc.collect()
    gc.freeze()
    for epoch in range(start_epoch, args.epochs):
        if _signal_received:  # its interrupt was lost during evaluation or the save (_step_logger)
            raise KeyboardInterrupt(_signal_received)
        train_sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        t0 = time.perf_counter()
        try:
            train_loss = train_one_epoch(
                model, optimizer, train_loader, device, epoch, scaler=scaler, amp_dtype=amp_dtype,
                grad_accum_steps=args.grad_accum_steps, clip_grad_norm=args.clip_grad_norm,
                print_freq=args.print_freq, channels_last=channels_last,
                log_fn=_step_logger(step_writer))
        except FloatingPointError as exc:  # raised on every rank: the loss is reduced first
            raise RunError(f"{exc} {_START_OVER}") from None
        train_seconds = time.perf_counter() - t0
        lr_used = optimizer.param_groups[0]["lr"]
        scheduler.step()
        result = evaluate(model, val_loader, device, amp_dtype=amp_dtype, channels_last=channels_last)
        if result.num_samples and not math.isfinite(result.loss):  # the same on every rank
            raise RunError(f"validation loss {result.loss} after epoch {epoch}: the weights "
                           f"diverged, so this epoch is not saved; lower --lr. {_START_OVER}")
        epoch_seconds = time.perf_counter() - t0
        val_acc = result.top1
        epoch_images = len(train_loader) * args.batch_size * info.world_size
        record = {"epoch": epoch, "train_loss": round(train_loss, 6), "val_acc": round(val_acc, 6),
                  "val_loss": round(result.loss, 6),
                  "val_top5": None if result.top5 is None else round(result.top5, 6),
                  "lr": lr_used,  # exact: a schedule can be checked against it
                  "epoch_seconds": round(epoch_seconds, 3),
                  "train_images_per_sec": round(epoch_images / train_seconds, 2)}
        history.append(record)
        # The first epoch here is the best so far even at 0 accuracy (model_best.pth always
        # exists), also when resumed into a new folder: best_acc is then this file's, not the
        # other folder's, or a later epoch between the two would never replace it.
        # A tie in accuracy, usual on a small val set, goes to the lower val loss: else the
        # least trained of the tied epochs would stay the best.
        no_best_yet = not (out / "model_best.pth").is_file()
        is_best = no_best_yet or val_acc > best_acc or (val_acc == best_acc
                                                        and result.loss < best_loss)
        if is_best:
            best_acc, best_loss = val_acc, result.loss
        rng_states = all_gather_object(capture_rng_state(info.device))
        epoch_state = None
        if info.is_main:
            # On the CPU: the files load anywhere (a laptop, predict.py, torchvision).
            # "lr_scheduler" is a record for scripts that load it; a resume rebuilds the schedule.
            epoch_state = {
                "model": to_cpu(model_without_ddp.state_dict()),
                "optimizer": to_cpu(optimizer.state_dict()),
                "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                "best_loss": best_loss,
                "args": _jsonable(args, **in_effect, num_classes=num_classes,
                                  world_size=info.world_size),
                "classes": classes, "metrics": history, "rng_states": rng_states,
                "val_split": val_split}
            if scaler.is_enabled():
                epoch_state["scaler"] = scaler.state_dict()
            # Said before the save: a stop held during the save would skip it.
            log.info("[epoch %d] train loss %.4f  val acc %.4f%s  val loss %.4f  lr %.2e  %.1fs  "
                     "%.0f img/s", epoch, train_loss, val_acc,
                     f"  top5 {result.top5:.4f}" if result.top5 is not None else "", result.loss,
                     lr_used, epoch_seconds, record["train_images_per_sec"])
            if writer:
                for tag, value in (("loss", train_loss), ("accuracy", val_acc),
                                   ("learning_rate", lr_used), ("val_loss", result.loss),
                                   ("top5", result.top5),
                                   ("images_per_sec", record["train_images_per_sec"])):
                    if value is not None:
                        writer.add_scalar(tag, value, epoch)
                writer.flush()
        with _signals_held():  # on every rank: a stop now waits until the epoch is on disk
            _check_on_rank0(_save_epoch, out, epoch_state, record, is_best, args,
                            info=info)
        if writer and epoch == args.epochs - 1:  # after the save: the epoch is kept first
            with missing_glyphs_ignored():
                writer.add_figure("confusion_matrix", _confusion_figure(result, classes), epoch)
            writer.flush()
    if writer:
        writer.close()
        step_writer.close()


_START_OVER = ("A resumed run keeps the checkpoint's learning rate: start over with --resume none "
               "or another --output-dir.")


PREVIOUS_RUN = ".previous-run"  # where --resume none keeps the earlier run until its first save


def _previous_run_hint(out: Path) -> str:
    aside = out / PREVIOUS_RUN
    if not (aside / "checkpoint.pth").is_file():
        return ""
    return (f" The earlier run that --resume none replaces is still in {aside}; move its files "
            f"back into {out} to keep it.")


def _save_epoch(out: Path, state: dict[str, Any], record: dict[str, Any], is_best: bool,
                args: argparse.Namespace) -> None:
    """Rank 0: the epoch's weights, best model, checkpoint and metrics line, all or nothing."""
    epoch = state["epoch"]
    written: list[Path] = []
    try:
        written.append(out / "weights" / f"model-{epoch}.pth")
        save_atomic(state["model"], written[-1])
        prune_weights(out / "weights", args.keep_last, newest=epoch)
        if is_best:
            written.append(out / "model_best.pth")
            save_atomic(state, written[-1])
        save_atomic(state, out / "checkpoint.pth")  # last: it marks the epoch as done
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        shutil.rmtree(out / PREVIOUS_RUN, ignore_errors=True)  # replaced now (--resume none)
    except OSError as exc:  # disk full, quota, file-size limit, storage gone
        if not out.is_dir():
            raise RunError(f"could not save epoch {epoch}: the folder {out} is gone (moved or "
                           "deleted during the run); to continue, run the command again with "
                           "--output-dir set to where the folder is now.") from None
        if not (out / "checkpoint.pth").is_file():
            # No epoch is done: what this one wrote would pass for an earlier run on the rerun.
            for path in written:
                path.unlink(missing_ok=True)
        raise RunError(f"could not save epoch {epoch} in {out}: {exc.strerror or exc}; free space "
                       f"or fix the folder, then {rerun_hint(args)}.") from None


# Prefix of _split_digest for the per-file hash split; fingerprints without it (earlier versions
# drew k images per class) cannot be resumed without a leak.
SPLIT_SCHEME = "hash1:"


def _split_digest(root: str | os.PathLike, paths: Sequence[str]) -> str:
    """A short fingerprint of which files are validation images (relative to the data root, so
    a moved data set keeps it), prefixed by the split scheme."""
    names = sorted(split_key(p, str(root)) for p in paths)
    digest = hashlib.sha256("\n".join(names).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return SPLIT_SCHEME + digest


def _step_change(path: str, before: tuple[int, int, int], now: tuple[int, int, int],
                 factor: float, scale_lr: bool) -> str:
    """The resume warning for another process count, --batch-size or --grad-accum-steps
    (``before``/``now``: processes, batch, accumulation), and what it does to the lr."""
    def per_step(procs: int, batch: int, accum: int) -> str:
        return (f"{procs} process(es) x batch {batch}" + (f" x {accum} accumulated" if accum > 1
                                                          else "")
                + f" = {procs * batch * accum} images per optimizer step")

    if not scale_lr:
        lr = "the learning rate is kept (--no-scale-lr)"
    elif factor == 1:
        lr = "the learning rate is kept: the images per optimizer step are unchanged (--scale-lr)"
    else:
        lr = (f"the learning rate is scaled by {factor:.4g} to match (--scale-lr: linear scaling "
              "with the images per step)")
    # The shuffle and each image's augmentation depend on (seed, epoch, index) alone, and the
    # sampler deals one permutation out: only another step size regroups the images.
    order = ("; other images share an optimizer step than in an uninterrupted run"
             if math.prod(before) != math.prod(now) else "")
    return (f"{path} was trained with {per_step(*before)}, this run has {per_step(*now)}: "
            f"{lr}{order}.")


def _resumed_schedule(optimizer: torch.optim.Optimizer, lr_lambda: Callable[[int], float],
                      start_epoch: int, factor: float) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule at ``start_epoch``, its lr multiplied by ``factor``.

    The checkpoint's optimizer groups hold the ``initial_lr`` its schedule started from; the
    linear scaling rule (arXiv:1706.02677) multiplies it by the change in images per optimizer
    step (processes x batch x accumulated batches), so each image weighs as much as before.
    ``last_epoch=start_epoch - 1`` makes the scheduler set the lr of ``start_epoch`` itself.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] *= factor
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch=start_epoch - 1)


def _step_logger(writer: Any) -> Callable[[int, float, float], None]:
    """``log_fn`` for train_one_epoch: running loss and lr every --print-freq steps; and a stop
    signal whose KeyboardInterrupt was lost takes effect there."""
    def log_step(step: int, loss: float, lr: float) -> None:
        if _signal_received:
            # Raised inside a garbage-collector callback (a weakref's), Python only prints it
            # ("Exception ignored in ...") and goes on: training would continue past the stop.
            raise KeyboardInterrupt(_signal_received)
        if writer is not None:
            writer.add_scalar("step/loss", loss, step)
            writer.add_scalar("step/lr", lr, step)
    return log_step


def _restore_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    """Rank 0: metrics.jsonl as the checkpoint records it, if it says otherwise (emptied by a
    --resume none stopped before its first save, or edited); else it is left untouched."""
    path = out / "metrics.jsonl"
    if not path.is_file() or path.read_text(encoding="utf-8") != _metrics_text(history):
        with _writing_in(out):
            _write_metrics(path, history)


def _metrics_text(history: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in history)


def _write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    write_atomic(path, lambda f: f.write(_metrics_text(history).encode("utf-8")))


def _require_tensorboard() -> None:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--tensorboard needs the tensorboard package ({exc}); pip install "
                          "tensorboard, or pass --no-tensorboard.") from None


def _tensorboard(args: argparse.Namespace, info: DistInfo, out: Path, start_epoch: int,
                 steps_per_epoch: int, train_set: MyDataSet, classes: list[str]
                 ) -> tuple[Any, Any]:
    """(per-epoch writer, per-step writer) on rank 0 with --tensorboard, else (None, None).

    Two writers, because TensorBoard purges every tag of a log from its ``purge_step`` on: one
    counted in epochs would delete the step curves of every earlier epoch on resume.
    """
    if not (args.tensorboard and info.is_main):
        return None, None
    from torch.utils.tensorboard import SummaryWriter  # optional extra: imported lazily
    from torchvision.utils import make_grid

    # A resumed run drops what an interrupted epoch logged, then continues the same curves.
    writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_epoch or None)
    step_writer = SummaryWriter(log_dir=str(out / "tensorboard" / "steps"),
                                purge_step=start_epoch * steps_per_epoch or None)
    if start_epoch == 0:
        images = torch.stack([train_set[i][0] for i in range(min(16, len(train_set)))])
        writer.add_image("train_images_augmented", make_grid(images, nrow=8), 0)
        writer.add_text("args", json.dumps(_jsonable(args), indent=2), 0)
    return writer, step_writer


CONFUSION_NAMES, CONFUSION_COUNTS = 60, 22  # class names on the axes, counts in the cells


def _confusion_figure(result: EvalResult, classes: list[str]) -> Any:
    """The confusion matrix (counts; rows: true class) as a matplotlib figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm, n = result.confusion.numpy(), len(classes)
    names = [tick_label(c) for c in classes]
    # Half an inch per class, plus room for the names (0.1 inch a character), up to 12 inches
    # (1200 px), then the cells shrink: the figure of 1000 classes would otherwise be 50,000 px
    # square and take tens of GB to draw.
    side = min(1 + 0.5 * n + 0.1 * max(map(len, names)) * (n <= CONFUSION_NAMES), 12)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(cm, cmap="Blues", interpolation="nearest")
    if n <= CONFUSION_NAMES:
        ax.set_xticks(range(n), names, rotation=90)
        ax.set_yticks(range(n), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= CONFUSION_COUNTS:  # a count per cell while it still fits
        for (i, j), v in np.ndenumerate(cm):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7)
    fig.tight_layout()
    return fig


def _report_eval(result: EvalResult, classes: list[str]) -> None:
    seen = result.confusion.sum(1).tolist()  # images per true class in the validation split
    lines = ["accuracy per class:"]
    # printable_path: a tab or line break in a class name would break the column of names
    lines += [f"  {printable_path(name)}: {acc:.4f} ({n} image{'s' * (n != 1)})" if n else
              f"  {printable_path(name)}: n/a (no validation images)"
              for name, acc, n in zip(classes, result.per_class_acc, seen)]
    # The summary comes last, so a long class list does not scroll it away.
    lines += [f"val images: {result.num_samples}", f"top-1 accuracy: {result.top1:.4f}"]
    if result.top5 is not None:
        lines.append(f"top-5 accuracy: {result.top5:.4f}")
    lines.append(f"val loss: {result.loss:.4f}")
    log.info("\n".join(lines))

