"""Lose no work: a stop signal saves the exact step, and the same command continues from it.

- the sampler deals the rest of a stopped epoch, as indices, to the same or another world size;
- ``StopRequest``: a signal only asks, all ranks agree on the step (also one step late, as under
  NCCL); copies of it are the same stop, however late handled; SIGQUIT stops at once;
- end to end (torchrun, 2 gloo ranks; signals sent by ``STOPPER`` at an exact optimizer step):
  SIGTERM to one rank, to torchrun (loader workers, gradient accumulation), in an evaluation, a
  copy handled after a long C call, to every process group during long steps; then the same
  command ends with the weights and momentum of an uninterrupted run, tensor for tensor. A run
  stopped on 2 processes continues on 1. SIGQUIT ends a run at once, its last save untouched."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from conftest import (LAUNCH, REFERENCE_EPOCHS, STOPPER, assert_same_run, clone_run, flags,
                      load_ckpt, make_stopper, ranks, read_metrics, torchrun_cmd)
from dist_helpers import run_ranks
from multi_train_utils.guard import stop_requests
from multi_train_utils.data import ResumableSampler

STEPS_PER_EPOCH = 5  # tiny_data on 2 ranks: 40 training images in batches of 4 per rank


# ---------------------------------------------------------------- the sampler
@pytest.mark.parametrize("n, world, shuffle, drop_last", [
    (11, 2, True, False), (11, 3, True, True), (10, 1, False, False), (13, 3, False, False)])
def test_the_sampler_deals_what_distributed_sampler_deals_then_only_the_rest(n, world, shuffle,
                                                                            drop_last):
    for rank in range(world):
        ours = ResumableSampler(range(n), world, rank, shuffle=shuffle, seed=3,
                                drop_last=drop_last)
        torchs = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=3,
                                    drop_last=drop_last)
        for epoch in (0, 4):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            whole = list(torchs)
            assert list(ours) == whole and len(ours) == len(whole)
            for done in range(1, len(whole)):  # the samples every rank trained, then the rest
                ours.set_epoch(epoch, skip=done * world)
                assert list(ours) == whole[done:] and len(ours) == len(whole) - done


class _Spy(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.read = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.read.append(index)
        return index


def test_a_continued_epoch_skips_its_first_batches_as_indices_in_that_epoch_only():
    data, world, batch = _Spy(50), 2, 4
    sampler = ResumableSampler(data, world, 1, seed=0)
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, batch, drop_last=True))
    sampler.set_epoch(2)
    whole = [b.tolist() for b in loader]
    data.read.clear()
    sampler.set_epoch(2, skip=3 * batch * world)  # 3 batches of every rank were trained
    assert len(loader) == len(whole) - 3
    rest = [b.tolist() for b in loader]
    assert rest == whole[3:]
    assert sorted(data.read) == sorted(i for b in whole[3:] for i in b)  # none read twice
    sampler.set_epoch(3)  # the next epoch is whole again
    assert len(loader) == len(whole) and len(list(loader)) == len(whole)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3)])
def test_the_rest_of_an_epoch_goes_to_another_world_size_each_sample_once(before, after):
    n, batch, done = 23, 2, 2  # 2 batches of every rank trained before the stop
    whole = [list(DistributedSampler(range(n), before, r, seed=5)) for r in range(before)]
    trained = {i for share in whole for i in share[:done * batch]}
    dealt = []
    for rank in range(after):
        sampler = ResumableSampler(range(n), after, rank, seed=5)
        sampler.set_epoch(0, skip=done * batch * before)
        dealt.append(list(sampler))
    assert len({len(share) for share in dealt}) == 1  # equal shares: equal steps
    flat = [i for share in dealt for i in share]
    assert set(flat) - trained == set(range(n)) - trained  # every remaining sample ...
    assert len(flat) - len(set(range(n)) - trained) < after  # ... once, but a few for padding


# ---------------------------------------------------------------- StopRequest
def _stop_worker(rank: int, world: int, lag: bool) -> list[bool]:
    import multi_train_utils.guard as guard

    if lag:  # as under NCCL: the flag goes through a gloo group of its own, read a step late
        guard.dist.get_backend = lambda *args: "nccl"
    answers = []
    with stop_requests() as stop:
        for step in range(5):
            if rank == 1 and step == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # this rank alone
            answers.append(stop.poll())
        assert stop.signum == (signal.SIGUSR1 if rank == 1 else 0)
        assert stop.agreed == signal.SIGUSR1
    return answers


@pytest.mark.parametrize("lag", [False, True], ids=["gloo", "nccl-like"])
def test_every_rank_agrees_to_stop_at_the_same_step(lag, tmp_path):
    got = run_ranks(_stop_worker, 2, tmp_path, lag)
    first = 2 if lag else 1
    assert got == [[False] * first + [True] * (5 - first)] * 2


def test_copies_of_a_stop_are_one_stop_and_sigquit_stops_at_once():
    def previous(signum, frame):  # as the guard's, but an error pytest reports as a failure
        raise RuntimeError(f"previous handler: {signal.Signals(signum).name}")

    old = {signum: signal.signal(signum, previous) for signum in (signal.SIGTERM, signal.SIGQUIT)}
    try:
        with stop_requests() as stop:
            signal.raise_signal(signal.SIGTERM)  # asks
            time.sleep(0.6)  # a copy's handler can run late (after a long C call)
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGUSR1)
            assert stop.signum == signal.SIGTERM and stop.poll()
            with pytest.raises(RuntimeError, match="previous handler: SIGQUIT"):
                signal.raise_signal(signal.SIGQUIT)
        assert signal.getsignal(signal.SIGTERM) is previous  # outside training: as before
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def stopped_by_rank1(tiny_data, tmp_path_factory, plain):
    """2 ranks, 3 epochs: rank 1 alone gets SIGTERM after epoch 1's third step."""
    tmp = tmp_path_factory.mktemp("stopped")
    argv = flags(tiny_data, tmp / "run", "--epochs", str(REFERENCE_EPOCHS))
    res = ranks(plain, 2, make_stopper(tmp), LAUNCH, *argv, STOP_RANK="1",
                STOP_AFTER=str(STEPS_PER_EPOCH + 3))
    return SimpleNamespace(out=tmp / "run", argv=argv, result=res)


@pytest.mark.fast
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_and_saves_it(stopped_by_rank1):
    res, out = stopped_by_rank1.result, stopped_by_rank1.out
    text = res.stdout + res.stderr
    assert res.codes == [143, 143], text[-3000:]  # each ended with 128 + SIGTERM
    # Both ranks stopped after the step rank 1 was signalled in, and said so.
    lines = re.findall(r"^.*stopping after step (\d+) of (\d+).*$", text, flags=re.M)
    assert sorted(lines) == [("3", str(STEPS_PER_EPOCH))] * 2, text[-3000:]
    assert "interrupted by SIGTERM" in text and f'{LAUNCH}", line' not in text  # no traceback
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == 1 and ckpt["in_epoch"]["batches"] == 3
    assert ckpt["in_epoch"]["batches_in_epoch"] == STEPS_PER_EPOCH
    assert ckpt["in_epoch"]["samples"] == 3 * 4 * 2  # 3 batches of 4 on each of 2 ranks
    assert ckpt["args"]["world_size"] == 2 and ckpt["args"]["batch_size"] == 4
    assert len(ckpt["rng_states"]) == 2 and ckpt["in_epoch"]["count"] > 0
    # The epoch is not finished: no weights file, no metrics line, no best model of it.
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["model-0.pth"]
    assert load_ckpt(out / "model_best.pth")["epoch"] == 0


@pytest.mark.fast
def test_the_same_command_continues_at_that_batch_to_the_uninterrupted_weights(
        stopped_by_rank1, reference_run, tmp_path, plain):
    out = clone_run(stopped_by_rank1.out, tmp_path / "run", full=True)
    res = ranks(plain, 2, LAUNCH, *flags_for(stopped_by_rank1.argv, out))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert f"resuming from epoch 1, step 3 of {STEPS_PER_EPOCH}\n" in res.stderr
    assert "listed it: not listed again" in res.stderr  # the stored file list, not a new scan
    assert_same_run(out, reference_run.out)


RECORD_SAMPLER = """
import json, os
from multi_train_utils.data import ResumableSampler
_iter = ResumableSampler.__iter__
def _recorded(self):
    indices = list(_iter(self))
    if self.shuffle:
        with open(os.environ["SAMPLER_LOG"], "a") as f:
            f.write(json.dumps(dict(epoch=self.epoch, skip=self.skip, n=len(self.dataset),
                                    indices=indices)) + "\\n")
    return iter(indices)
ResumableSampler.__iter__ = _recorded
"""


def test_a_run_stopped_on_two_processes_continues_on_one(stopped_by_rank1, tmp_path, plain):
    """The rest of the epoch's order goes to the one process: each sample the two ranks did
    not train, once, and nothing they did."""
    out = clone_run(stopped_by_rank1.out, tmp_path / "run", full=True)
    log = tmp_path / "sampler.jsonl"
    res = plain(flags_for(stopped_by_rank1.argv, out), patch=RECORD_SAMPLER, SAMPLER_LOG=str(log))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from epoch 1, step 3 of 5 of 2 processes; the rest of its samples go to " \
        "these 1" in res.stderr
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1, 2]
    first = json.loads(log.read_text().splitlines()[0])
    order = torch.randperm(first["n"], generator=torch.Generator().manual_seed(0 + 1)).tolist()
    assert (first["epoch"], first["skip"]) == (1, 24)
    assert first["indices"] == order[24:]  # the two ranks trained exactly order[:24]


def test_eval_only_on_a_stopped_run_changes_none_of_its_files(stopped_by_rank1, tiny_data,
                                                             tmp_path, plain):
    """--eval-only --val-path (that folder alone) with the stopped run's weights: the file list
    the stopped epoch goes on over stays as it is, as every other file of the run."""
    out = clone_run(stopped_by_rank1.out, tmp_path / "run", full=True)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    test_set = shutil.copytree(tiny_data, tmp_path / "test")
    next((test_set / "roses").iterdir()).unlink()
    argv = flags_for(stopped_by_rank1.argv, out)
    del argv[argv.index("--data-path"):argv.index("--data-path") + 2]
    res = plain([*argv, "--eval-only", "--val-path", str(test_set)])
    assert res.returncode == 0 and "top-1 accuracy" in res.stderr, res.stderr[-3000:]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def flags_for(argv: list[str], out) -> list[str]:
    """``argv`` with another --output-dir."""
    argv = list(argv)
    argv[argv.index("--output-dir") + 1] = str(out)
    return argv


@pytest.fixture(scope="module")
def accumulation_reference(tiny_data, tmp_path_factory, plain):
    out = tmp_path_factory.mktemp("accum") / "reference"
    res = ranks(plain, 2, LAUNCH, *flags(tiny_data, out, "--epochs", "2",
                                         "--grad-accum-steps", "2"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return out


def test_sigterm_to_torchrun_stops_every_process_between_groups_and_continues_exactly(
        accumulation_reference, tiny_data, tmp_path, launched, plain):
    """torchrun passes the signal on to every rank; the stop waits for the group's last
    micro-batch (5 batches, groups 2 + 2 + 1: optimizer steps after batch 2 and 4). The loader
    workers ignore it and deliver those batches; then every process is gone, quietly. The same
    command ends where the run never stopped (--workers 0) ended, --keep-last 1 kept the last."""
    out = tmp_path / "run"
    argv = flags(tiny_data, out, "--epochs", "2", "--grad-accum-steps", "2", "--keep-last", "1",
                 workers=2)
    tree = launched(torchrun_cmd(2, make_stopper(tmp_path), LAUNCH, *argv),
                    STOP_TARGET="parent", STOP_AFTER="4")  # epoch 1's first optimizer step
    tree.wait_for(lambda: len(tree.refresh()) >= 6, "2 ranks and their loader workers")
    snapshot = [p for p in tree.refresh() if tree.alive(p)]
    tree.wait_all_gone(timeout=120)
    output = tree.output()
    assert len(snapshot) >= 6 and tree.proc.returncode != 0, snapshot
    assert "interrupted by SIGTERM" in output, output[-3000:]
    for noise in ("Exception ignored", "DataLoader worker", f'{LAUNCH}", line'):
        assert noise not in output, output[-3000:]
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == 1 and ckpt["in_epoch"]["batches"] in (2, 4), ckpt["in_epoch"]
    assert ckpt["in_epoch"]["batches_in_epoch"] == 5 and len(read_metrics(out)) == 1
    res = ranks(plain, 2, LAUNCH, *argv)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "resuming from epoch 1, step " in res.stderr
    assert_same_run(out, accumulation_reference)
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["model-1.pth"]


LONG_STEPS = r"""
import os, runpy, sys, time
import torch
sys.path.insert(0, os.getcwd())
import multi_train_utils.train_eval_utils as _loop

_eye, _step = torch.eye(1000), _loop._optimizer_step
started = time.perf_counter()
torch.mm(_eye, _eye)
_calls = int(0.8 / (time.perf_counter() - started)) + 2

def _long_step(*args, **kwargs):  # a C call of ~0.8 s in every step, as a long CPU backward()
    _step(*args, **kwargs)
    torch.linalg.multi_dot([_eye] * _calls)

_loop._optimizer_step = _long_step
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    print(f"exit code {exc.code}", file=sys.stderr, flush=True)
    raise
"""


def test_sigterm_to_every_process_group_during_long_steps_is_one_stop(tiny_data, tmp_path,
                                                                       launched, plain):
    """As slurmstepd signals every process of a step, and torchrun passes the signal on again:
    each rank gets two copies, and its Python handler runs after a step's long C call."""
    (tmp_path / "long_steps.py").write_text(LONG_STEPS)
    argv = flags(tiny_data, tmp_path / "run", "--epochs", "1", "--print-freq", "1")
    tree = launched(torchrun_cmd(2, str(tmp_path / "long_steps.py"), LAUNCH, *argv))
    tree.wait_for(lambda: "[train epoch 0] step 1/5" in tree.output(), "step 1")
    for group in {os.getpgid(pid) for pid, _ in tree.refresh()} | {tree.proc.pid}:
        os.killpg(group, signal.SIGTERM)  # kill -TERM -PGID: torchrun's, and each rank's
    tree.wait_exit(120)
    text = tree.output()
    assert re.findall(r"^exit code (\d+)$", text, flags=re.M) == ["143"] * 2, text[-3000:]
    (step,) = set(re.findall(r"stopping after step (\d) of 5 of the epoch, saved", text))
    assert text.count(f"stopping after step {step} of 5") == 2, text[-3000:]  # each rank
    assert load_ckpt(tmp_path / "run" / "checkpoint.pth")["in_epoch"]["batches"] == int(step)
    res = plain(argv)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming from epoch 0, step {step} of 5 of 2 processes" in res.stderr, res.stderr


def test_a_signal_during_evaluation_ends_with_the_epoch_saved(tiny_data, tmp_path, plain):
    out = tmp_path / "run"
    argv = flags(tiny_data, out, "--epochs", "3")
    res = plain(argv, patch=STOPPER, STOP_IN="eval", STOP_AFTER="2")  # epoch 1's evaluation
    assert res.returncode == 143, res.stderr[-3000:]
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == 1 and "in_epoch" not in ckpt  # evaluated and saved as usual
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    assert (out / "weights" / "model-1.pth").is_file()
    res = plain(argv)
    assert res.returncode == 0 and [m["epoch"] for m in read_metrics(out)] == [0, 1, 2]


def test_a_copy_of_the_stop_handled_a_second_late_still_saves(tiny_data, tmp_path, plain):
    """The first SIGTERM is handled between two steps; a copy (torchrun's, the terminal's) lands
    in a C call of over a second, as in a long CPU backward(), and is handled after it."""
    out = tmp_path / "run"
    argv = flags(tiny_data, out, "--epochs", "1")
    res = plain(argv, patch=STOPPER, STOP_TARGET="late", STOP_AFTER="3")
    assert res.returncode == 143, res.stderr[-3000:]
    assert "stopping after step 3 of" in res.stderr, res.stderr[-3000:]
    assert float(re.search(r"a C call of ([\d.]+)s", res.stderr)[1]) > 0.6, res.stderr[-3000:]
    assert load_ckpt(out / "checkpoint.pth")["in_epoch"]["batches"] == 3
    res = plain(argv)
    assert res.returncode == 0 and "resuming from epoch 0, step 3 of" in res.stderr, res.stderr


def test_sigquit_stops_at_once_without_the_save_even_after_a_stop_began(tiny_data, tmp_path,
                                                                         plain):
    out = tmp_path / "run"
    res = plain(flags(tiny_data, out, "--epochs", "1", "--save-every-steps", "2"),
                patch=STOPPER, STOP_SIGNAL="SIGTERM,SIGQUIT", STOP_AFTER="3")
    assert res.returncode == 128 + signal.SIGQUIT, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "stopping after step" not in res.stderr
    last = res.stderr.splitlines()[-1]
    assert last.startswith("interrupted by SIGQUIT; run the same command again"), last
    assert load_ckpt(out / "checkpoint.pth")["in_epoch"]["batches"] == 2  # the last save, as it was
