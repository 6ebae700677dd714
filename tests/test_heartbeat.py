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

import torch.distributed as dist
from conftest import (LAUNCH, REFERENCE_EPOCHS, assert_same_run, error_lines, flags,
                      make_stopper, proc_env, torchrun_cmd)

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


def test_a_rank_slowed_down_is_named_as_the_slowest(tiny_data, tmp_path, launched):
    """Rank 1 stopped 3/4 of every 80 ms: rank 0's log lines name it, never rank 0 (without
    SyncBatchNorm, whose forward waits for the other ranks)."""
    out = tmp_path / "run"
    tree = launched(torchrun_cmd(2, LAUNCH, *flags(tiny_data, out, "--epochs", "1",
                                                   "--print-freq", "1", "--no-sync-bn")))
    slow = _rank_pid(tree, 1)
    tree.wait_for(lambda: "[train epoch 0] step 1/" in tree.output(), "the first step")
    done = threading.Event()

    def duty_cycle() -> None:
        try:
            while not done.is_set():
                os.kill(slow, signal.SIGSTOP)
                time.sleep(0.06)
                os.kill(slow, signal.SIGCONT)
                time.sleep(0.02)
        except ProcessLookupError:  # it has finished
            pass

    thread = threading.Thread(target=duty_cycle, daemon=True)
    thread.start()
    try:
        code = tree.wait_exit(240)
    finally:
        done.set()
        thread.join()
    output = tree.output()
    assert code == 0, output[-4000:]
    named = re.findall(r"rank (\d) is the slowest: ([\d.]+)x", output)
    assert named and {rank for rank, _ in named} == {"1"}, output[-4000:]


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
    one that stands here or moved a moment ago), the limit each phase sets, the slowest rank."""
    limits: list[float] = []
    monkeypatch.setattr(dist, "set_timeout", lambda t: limits.append(t.total_seconds()))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", FakeStore)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    beat = Heartbeat()
    beat.start(0, 5, (600.0, 120.0))
    try:
        for phase in ("loading data", "forward", "backward", "loading data", "forward"):
            beat.at(phase, epoch=0, step=3, steps=10)
        assert limits == [600, 600, 120]  # start-up, its next step, then the short limit
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
    finally:
        beat.stop()
    assert slowest([1.0, 1.1, 3.3, 0.9]).startswith("rank 2 is the slowest: 3.3x the median")
    assert slowest([1.0, 1.9]) == "" and slowest([0.0]) == ""
