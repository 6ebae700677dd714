"""A stuck rank is named with where it was, its group restarts from the last save, and a slow
rank is named as the slowest (torchrun, 2 CPU processes, gloo)."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import threading
import time

import pytest
import torch.distributed as dist
from conftest import (LAUNCH, REFERENCE_EPOCHS, assert_same_run, error_lines, flags,
                      make_stopper, proc_env, ranks, torchrun_cmd)

from multi_train_utils.distributed_utils import DistInfo
from multi_train_utils.heartbeat import Heartbeat, slowest


def _rank_pid(tree, rank: int) -> int:
    """The pid of training rank ``rank`` of a torchrun tree (its RANK variable says which)."""
    tree.wait_for(lambda: any(proc_env(p).get("RANK") == str(rank) for p in tree.children()),
                  f"rank {rank}")
    return next(p for p in tree.children() if proc_env(p).get("RANK") == str(rank))


# The first attempt's first two steps take over a second: a beat (once a second) falls in them.
SLOW_START = r"""
import os, time
import multi_train_utils.train_eval_utils as _loop
_step, _done = _loop._optimizer_step, [0]

def _slow_step(*args, **kwargs):
    _step(*args, **kwargs)
    _done[0] += 1
    if _done[0] <= 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        time.sleep(0.6)

_loop._optimizer_step = _slow_step
"""


def test_a_frozen_rank_is_named_and_the_restarted_group_continues_mid_epoch(
        tiny_data, tmp_path, launched, reference_run):
    """Rank 1 frozen (SIGSTOP) after the second step, saved every 2 steps: rank 0 names it with
    its pid, epoch and step after --dist-timeout, in one error line and no traceback, and both
    processes are gone within the timeout and a few seconds (torchrun would wait 30 s more for a
    process that cannot take SIGTERM); torchrun --max-restarts 1 restarts the group, which
    continues from the mid-epoch save and ends exactly where the run never stopped ended."""
    out, timeout = tmp_path / "run", 10  # the ranks must also meet within it at start-up
    argv = flags(tiny_data, out, "--epochs", str(REFERENCE_EPOCHS), "--save-every-steps", "2",
                 "--dist-timeout", str(timeout))
    slow_start = make_stopper(tmp_path, SLOW_START, "slow_start.py")
    tree = launched(torchrun_cmd(2, "--max-restarts=1", slow_start, LAUNCH, *argv))
    frozen = _rank_pid(tree, 1)
    first_group = [p for p in tree.seen if p[0] in tree.children()]
    tree.wait_for(lambda: "[train epoch 0] step 2/" in tree.output(), "step 2")
    os.kill(frozen, signal.SIGSTOP)  # a hung machine: connected, never answering
    stopped = time.monotonic()
    tree.wait_for(lambda: not any(map(tree.alive, first_group)), "the first group's end")
    gone_after = time.monotonic() - stopped
    assert tree.wait_exit(240) == 0, tree.output()[-4000:]
    output = tree.output()
    assert not tree.alive_seen()
    assert "Traceback" not in output, output[-4000:]
    (line,) = error_lines(output)
    # Its place as its last beat wrote it: up to a second, a step or two, before the freeze.
    assert re.search(rf"error: rank 1 \(host [^,]+, pid {frozen}\) stopped answering \d+ s ago "
                     r"at epoch 0, step [1-5] of 5 \([a-z ]+\); run the "
                     "same command again", line), line
    assert re.search(r"resuming from epoch 0, step [2-4] of 5\n", output), output[-4000:]
    assert gone_after < timeout + 10, f"the ranks ended {gone_after:.0f}s after the freeze"
    assert_same_run(out, reference_run.out)


# Rank 1's loader worker takes 60 ms more per image: its data arrives late, every step.
SLOW_LOADER = r"""
import os, time
import my_dataset
_read = my_dataset.MyDataSet.__getitem__

def _slow_read(self, index):
    if os.environ.get("RANK") == "1":
        time.sleep(0.06)
    return _read(self, index)

my_dataset.MyDataSet.__getitem__ = _slow_read
"""


def test_a_rank_with_a_slow_loader_is_named_in_a_batchnorm_model(tiny_data, tmp_path, plain):
    """resnet18: DDP broadcasts its BatchNorm buffers at the start of each forward, where the
    fast rank waits for the slow one (with SyncBatchNorm, at every layer too). Rank 1's loader
    slowed: it is named, with and without SyncBatchNorm, and rank 0 never."""
    slow_loader = make_stopper(tmp_path, SLOW_LOADER, "slow_loader.py")
    for sync_bn in ("--sync-bn", "--no-sync-bn"):
        argv = flags(tiny_data, tmp_path / sync_bn, "--epochs", "1", "--print-freq", "2",
                     sync_bn, workers=1)
        res = ranks(plain, 2, slow_loader, LAUNCH, *argv)
        assert res.returncode == 0, res.stderr[-4000:]
        named = re.findall(r"rank (\d) is the slowest: ([\d.]+)x", res.stdout + res.stderr)
        assert named and {rank for rank, _ in named} == {"1"}, (res.stdout + res.stderr)[-4000:]


class FakeStore(dict):
    timeout = datetime.timedelta(seconds=600)

    def set(self, key: str, value: str) -> None:
        self[key] = value

    def get(self, key: str) -> bytes:
        return self[key].encode()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout


def test_the_ranks_named_the_time_limits_and_the_slowest(monkeypatch):
    """Without processes: who ``missing`` names (stopped answering; elsewhere for a while; not
    one that stands here or moved a moment ago), the limit each phase sets, the slowest rank;
    a failed collective leaving the block carries the names, for the guard to say."""
    limits: list[float] = []
    monkeypatch.setattr(dist, "set_timeout", lambda t: limits.append(t.total_seconds()))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", FakeStore)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    failed = RuntimeError("gloo: timed out")
    with pytest.raises(RuntimeError) as raised, Heartbeat(DistInfo(world_size=5)) as beat:
        for phase in ("loading data", "forward", "backward", "loading data", "forward"):
            beat.at(phase, epoch=0, step=3, steps=10)
        assert limits == [600, 600, 120]  # start-up, its next step, then the short limit
        beat.at("saving")
        for phase in ("loading data", "forward", "accumulating", "loading data", "forward"):
            beat.at(phase, step=4)  # --grad-accum-steps 2: no rank met the others yet
            assert beat.limit == 600, phase
        beat.at("backward")  # the first all-reduce of gradients since the save
        beat.at("loading data")
        assert beat.limit == 600
        beat.at("forward")
        assert limits[-1] == beat.limit == 120
        beat.at("saving")
        assert limits[-1] == 600
        now, here = time.time(), {"epoch": 0, "step": 3, "steps": 10, "phase": "saving"}
        peers = {1: dict(here, phase="forward", beat=now - 21, wall=now - 21),
                 2: dict(here, phase="loading data", beat=now, wall=now - 30),
                 3: dict(here, phase="forward", beat=now, wall=now - 1), 4: dict(here, beat=now)}
        for rank, peer in peers.items():
            beat.store[f"heartbeat/{rank}"] = json.dumps(
                dict(peer, wall=peer.get("wall", now), host=f"node{rank}", pid=40 + rank,
                     node="elsewhere"))
        assert beat.missing() == (
            "rank 1 (host node1, pid 41) stopped answering 21 s ago at epoch 0, step 3 of 10 "
            "(forward); rank 2 (host node2, pid 42) is at epoch 0, step 3 of 10 (loading data) "
            "for 30 s")
        assert beat.store.timeout == datetime.timedelta(seconds=600)  # given back
        raise failed
    assert raised.value is failed and failed.missing_ranks().startswith("rank 1 (host node1, ")
    assert beat._stop.is_set()  # the thread ends with the block
    assert slowest([1.0, 1.1, 3.3, 0.9], 10).startswith("rank 2 is the slowest: 3.3x the median")
    assert slowest([1.0, 1.9], 10) == "" and slowest([0.0], 10) == ""
    assert slowest([0.01, 0.04], 1) == ""  # 4x, but 30 ms of a second: a step's noise


def test_without_a_process_group_the_heartbeat_starts_nothing():
    """One process (no group): the block starts no thread and ``at`` records nothing."""
    threads = threading.active_count()
    with Heartbeat(DistInfo()) as beat:
        beat.at("forward", epoch=0, step=1, steps=2)
        assert beat.store is None and beat.place == {} and threading.active_count() == threads
