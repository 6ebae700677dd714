"""Jobs that span machines, simulated on localhost: two torchrun nodes, SLURM tasks, spawn nodes.

Each "node" is its own launcher process with its own ``--output-dir``, so "only global rank 0
writes files" is visible: exactly one of the two folders may exist. A small probe (written to
tmp_path, run in place of ``python train_multi_gpu_using_launch.py``) records each rank's place in
the job and a digest of its weights after every evaluation, to show the ranks stay identical.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_FLAGS, child_env, run, torchrun_cmd
from multi_train_utils import distributed_utils
from multi_train_utils.distributed_utils import find_free_port

LAUNCH = "train_multi_gpu_using_launch.py"

PROBE = '''\
"""Run a launcher script, recording rank and a weight digest after every evaluate()."""
import hashlib, json, os, runpy, sys

sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
import train_common

_evaluate = train_common.evaluate
_init = train_common.init_distributed_mode
info = None


{digest_src}

def init_distributed_mode(*args, **kwargs):
    global info
    info = _init(*args, **kwargs)
    return info


def evaluate(model, *args, **kwargs):
    result = _evaluate(model, *args, **kwargs)
    record = dict(rank=info.rank, local_rank=info.local_rank, world_size=info.world_size,
                  group_rank=dist.get_rank(), node=os.environ["PROBE_NODE"], top1=result.top1,
                  digest=state_digest(getattr(model, "module", model).state_dict()))
    with open(os.path.join(os.environ["PROBE_DIR"], "rank%d.jsonl" % info.rank), "a") as f:
        f.write(json.dumps(record) + "\\n")
    return result


train_common.init_distributed_mode = init_distributed_mode
train_common.evaluate = evaluate
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name and bytes: equal only if bit-identical."""
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture
def probe(tmp_path) -> tuple[Path, Path]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(root=str(ROOT), digest_src=inspect.getsource(state_digest)))
    records = tmp_path / "probe"
    records.mkdir()
    return script, records


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(**env), stdout=handle,
                                stderr=subprocess.STDOUT)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:  # never leave a node waiting for its dead peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"node {i} exit {proc.returncode}:\n{log.read_text()[-4000:]}"


def _read_probe(records: Path) -> dict[int, list[dict]]:
    return {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in records.glob("rank*.jsonl")}


def _check_one_writer(outs: list[Path], writer: int, epochs: int) -> dict:
    """Only ``outs[writer]`` exists, holds a finished 2-process run; returns its checkpoint."""
    for i, out in enumerate(outs):
        assert out.exists() == (i == writer), f"node {i} output dir exists: {out.exists()}"
    out = outs[writer]
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == epochs
    assert sorted(p.name for p in (out / "weights").iterdir()) == [
        f"model-{e}.pth" for e in range(epochs)]
    ckpt = torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == epochs - 1 and ckpt["args"]["world_size"] == 2
    assert len(ckpt["rng_states"]) == 2  # gathered from both processes
    return ckpt


def _check_ranks_agree(records: dict[int, list[dict]], ckpt: dict, epochs: int) -> None:
    assert sorted(records) == [0, 1]
    for rank, rows in records.items():  # DistInfo agrees with the process group it created
        assert len(rows) == epochs and all(
            r["rank"] == r["group_rank"] == rank and r["world_size"] == 2 for r in rows)
    for rank0, rank1 in zip(records[0], records[1]):  # after every epoch, bit-identical weights
        assert rank0["digest"] == rank1["digest"] and rank0["top1"] == rank1["top1"]
    assert records[0][-1]["digest"] == state_digest(ckpt["model"])  # and rank 0 saved exactly them


# ---------------------------------------------------------------- torchrun, two nodes
def test_torchrun_two_nodes_c10d_rendezvous(tiny_data, tmp_path, probe):
    script, records = probe
    port = find_free_port()
    outs = [tmp_path / f"node{n}" / "out" for n in range(2)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    procs = [_start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                     "--nproc_per_node=1", f"--node_rank={n}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=join_timeout=120",
                     str(script), LAUNCH, *TINY_FLAGS, "--data-path", str(tiny_data),
                     "--epochs", "2", "--output-dir", str(outs[n])],
                    logs[n], PROBE_DIR=str(records), PROBE_NODE=str(n))
             for n in range(2)]
    _wait_all(procs, logs)

    probed = _read_probe(records)
    # c10d hands out global ranks at rendezvous (--node_rank is ignored), so either node may be
    # rank 0; each node runs local rank 0, and the two nodes got different global ranks.
    assert {(r[0]["local_rank"], r[0]["node"]) for r in probed.values()} == {(0, "0"), (0, "1")}
    writer = int(probed[0][0]["node"])
    ckpt = _check_one_writer(outs, writer, epochs=2)
    _check_ranks_agree(probed, ckpt, epochs=2)
    assert "[epoch 1]" in logs[writer].read_text() and "[epoch" not in logs[1 - writer].read_text()


def _two_slurm_machines(cwds: list[Path], logs: list[Path], argv: list[str]) -> list[int]:
    """Exit codes of two SLURM tasks of the launch script, each local rank 0 of its own
    "machine": its own working folder (so relative paths name each machine's own files)."""
    port = str(find_free_port())
    procs = []
    for n, (cwd, log) in enumerate(zip(cwds, logs)):
        with log.open("w") as handle:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / LAUNCH), *argv], cwd=cwd, stdout=handle,
                stderr=subprocess.STDOUT,
                env=child_env(SLURM_PROCID=str(n), SLURM_LOCALID="0", SLURM_NTASKS="2",
                              SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
    try:
        return [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- SLURM
def test_slurm_two_tasks(tiny_data, tmp_path, probe):
    script, records = probe
    port = str(find_free_port())
    outs = [tmp_path / f"task{n}" / "out" for n in range(2)]
    logs = [tmp_path / f"task{n}.log" for n in range(2)]
    procs = [_start([sys.executable, str(script), LAUNCH, *TINY_FLAGS, "--data-path",
                     str(tiny_data), "--epochs", "1", "--output-dir", str(outs[n])], logs[n],
                    SLURM_PROCID=str(n), SLURM_LOCALID=str(n), SLURM_NTASKS="2",
                    SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    PROBE_DIR=str(records), PROBE_NODE=str(n))
             for n in range(2)]
    _wait_all(procs, logs)

    probed = _read_probe(records)
    # SLURM_PROCID is the global rank, SLURM_LOCALID the local one.
    assert {(rank, r[0]["node"], r[0]["local_rank"]) for rank, r in probed.items()} == {
        (0, "0", 0), (1, "1", 1)}
    ckpt = _check_one_writer(outs, writer=0, epochs=1)
    _check_ranks_agree(probed, ckpt, epochs=1)

    # Resuming with output dirs that are not shared (simulated by a relative --output-dir seen
    # from each task's own folder): rank 1 cannot read rank 0's checkpoint. Every rank must stop
    # with one clear message instead of silently restarting from epoch 0 with other weights.
    for out in outs:
        out.parent.mkdir(exist_ok=True)
    codes = _two_slurm_machines([out.parent for out in outs], logs, [
        *TINY_FLAGS, "--data-path", str(tiny_data), "--epochs", "2", "--output-dir", "out"])
    assert codes == [2, 2], [log.read_text()[-2000:] for log in logs]
    text = logs[0].read_text()
    assert text.count("is not readable on every rank") == 1 and "Traceback" not in text
    other = logs[1].read_text()  # the other machine says it too: rank 0 may be on either one
    assert other.count("is not readable on every rank") == 1 and "Traceback" not in other
    assert len((outs[0] / "metrics.jsonl").read_text().splitlines()) == 1  # nothing trained


@pytest.mark.parametrize("mode", ["train", "eval-only"])
def test_weights_one_machine_cannot_read_stop_every_rank(tiny_data, tmp_path, mode):
    """Each machine has its own copy of --weights, and one copy is damaged: its ranks stopped
    alone, and the others waited in the next collective (until --dist-timeout under NCCL; with
    gloo they blamed a lost peer). Every rank stops with exit code 2 and one line."""
    from model import resnet18

    nodes = [tmp_path / f"node{n}" for n in range(2)]
    for node in nodes:
        node.mkdir()
        torch.save(resnet18(num_classes=5).state_dict(), node / "w.pth")
    data = (nodes[1] / "w.pth").read_bytes()
    (nodes[1] / "w.pth").write_bytes(data[:len(data) // 2])  # a copy cut short
    logs = [node / "log" for node in nodes]
    codes = _two_slurm_machines(nodes, logs, [
        *TINY_FLAGS, "--data-path", str(tiny_data), "--epochs", "1", "--output-dir", "out",
        "--weights", "w.pth", *["--eval-only"] * (mode == "eval-only")])
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2], [text[-2000:] for text in texts]
    assert [text.count("error:") for text in texts] == [1, 1] and "Traceback" not in "".join(texts)
    assert ("error: another process of the run could not load w.pth (its machine's error line "
            "says why); every machine needs a readable copy.") in texts[0]
    assert "error: w.pth is not a readable PyTorch checkpoint" in texts[1], texts[1][-2000:]
    assert not (nodes[0] / "out" / "metrics.jsonl").exists()  # nothing trained


# ---------------------------------------------------------------- SLURM environment parsing
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_USE_AGENT_STORE")


def _clear_env(monkeypatch, keys) -> None:
    for key in keys:
        monkeypatch.setenv(key, "")  # recorded, so monkeypatch restores the original later
        monkeypatch.delenv(key)


@pytest.fixture
def slurm_env(monkeypatch, tmp_path):
    """No launcher variables set, and no scontrol on PATH (as outside a SLURM allocation)."""
    _clear_env(monkeypatch, [k for k in os.environ if k.startswith("SLURM_")] + list(LAUNCH_VARS))
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return monkeypatch


@pytest.mark.parametrize("nodelist, first", [
    ("node[01-04],gpu7", "node01"),
    ("gpu-a,gpu-b", "gpu-a"),
    ("node[1,3-5],other[2-3]", "node1"),
    ("rack-[07-09]", "rack-07"),
    ("n[1-2]-ib,gpu1", "n1-ib"),  # a suffix after the brackets (an InfiniBand name)
    ("r[3-4]n[01-08]", "r3n01"),
    ("single", "single"),
])
def test_slurm_master_addr_without_scontrol(slurm_env, nodelist, first):
    slurm_env.setenv("SLURM_JOB_NODELIST", nodelist)
    assert distributed_utils._slurm_master_addr() == first


def test_slurm_master_addr_fallbacks_and_scontrol(slurm_env, tmp_path):
    assert distributed_utils._slurm_master_addr() == "127.0.0.1"  # no node list at all
    slurm_env.setenv("SLURM_NODELIST", "old[5-6]")  # the older variable name
    assert distributed_utils._slurm_master_addr() == "old5"
    # Where scontrol exists it decides (it knows every node-list syntax).
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf 'expanded-a\\nexpanded-b\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    slurm_env.setenv("PATH", str(fake.parent))
    assert distributed_utils._slurm_master_addr() == "expanded-a"


def _cgroup_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("own, files, want", [
    # cgroup v2 (a Kubernetes pod limited to 4 CPUs): the pod's folder sets it, not the container's
    ("0::/kubepods/pod1/ctr\n", {"kubepods/cpu.max": "max 100000\n",
                                 "kubepods/pod1/cpu.max": "400000 100000\n",
                                 "kubepods/pod1/ctr/cpu.max": "max 100000\n"}, 4.0),
    ("0::/kubepods/pod1/ctr\n", {"kubepods/cpu.max": "150000 100000\n",
                                 "kubepods/pod1/cpu.max": "400000 100000\n"}, 1.5),  # smallest
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # a cgroup namespace without a limit
    # cgroup v1, docker --cpus=2 without a cgroup namespace: /proc/self/cgroup names the host's
    # path, but the container's own folder is mounted as the tree's root
    ("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
     {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     2.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("2:memory:/x\n", {"memory/memory.limit_in_bytes": "1\n"}, None),  # no cpu controller
])
def test_cgroup_cpu_limit_reads_the_quota_of_the_cgroup_and_its_ancestors(own, files, want,
                                                                            tmp_path):
    _cgroup_files(tmp_path / "fs", files)
    (tmp_path / "own").write_text(own)
    assert distributed_utils.cgroup_cpu_limit(str(tmp_path / "fs"), str(tmp_path / "own")) == want


@pytest.mark.parametrize("own, files, want", [
    # cgroup v2: the pod's pids limit was hit twice (its parent's count is other pods'), the
    # container's memory limit killed one (the pod's count includes other containers')
    ("0::/kubepods/pod1/ctr\n", {"kubepods/pids.events": "max 9\n",
                                 "kubepods/pod1/pids.max": "100\n",
                                 "kubepods/pod1/pids.events": "max 2\n",
                                 "kubepods/pod1/ctr/pids.max": "max\n",
                                 "kubepods/pod1/ctr/pids.events": "max 0\n",
                                 "kubepods/pod1/memory.events": "oom_kill 4\n",
                                 "kubepods/pod1/ctr/memory.events": "low 0\nhigh 0\nmax 5\noom 1\n"
                                                                   "oom_kill 1\n"},
     {"pids": 2, "oom_kill": 1}),
    # a shared host without a cgroup namespace: a sibling job's kills are not this job's
    ("0::/system.slice/slurmstepd.scope/job_1\n",
     {"system.slice/slurmstepd.scope/memory.events": "oom_kill 2\n",
      "system.slice/slurmstepd.scope/job_2/memory.events": "oom_kill 2\n",
      "system.slice/slurmstepd.scope/job_1/memory.events": "oom_kill 0\n"},
     {"pids": 0, "oom_kill": 0}),
    # cgroup v1: each controller has its tree; the OOM count is in memory.oom_control
    ("8:pids:/docker/abc\n4:memory:/docker/abc\n",
     {"pids/docker/abc/pids.events": "max 7\n",
      "memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"},
     {"pids": 7, "oom_kill": 3}),
    ("0::/\n", {}, {"pids": 0, "oom_kill": 0}),  # no limits, or off Linux
])
def test_cgroup_limit_hits_counts_refused_processes_and_oom_kills(own, files, want, tmp_path):
    _cgroup_files(tmp_path / "fs", files)
    (tmp_path / "own").write_text(own)
    assert distributed_utils.cgroup_limit_hits(str(tmp_path / "fs"), str(tmp_path / "own")) == want


def test_cgroup_cpu_limit_is_none_off_linux(tmp_path):
    assert distributed_utils.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "no-such-file")) is None


@pytest.mark.parametrize("env, allowed, host, want", [
    ({}, 16, 128, 16),  # a job's CPU set, not the host's 128 cores
    ({"QUOTA": 4.0}, 64, 64, 4),  # docker run --cpus=4 on 64 cores: 4 CPUs' time, not 64
    ({"QUOTA": 1.5, "LOCAL_WORLD_SIZE": "2"}, 64, 64, 1),  # rounded up, shared by 2 ranks
    ({"QUOTA": 8.0}, 2, 64, 2),  # a quota above the CPU set changes nothing
    ({"LOCAL_WORLD_SIZE": "8"}, 16, 128, 2),  # torchrun's 8 ranks share the node's set
    ({"LOCAL_WORLD_SIZE": "8"}, 4, 4, 1),  # never 0: the loader needs a worker
    ({"SLURM_CPUS_PER_TASK": "6"}, 64, 64, 6),  # srun tasks sharing an unbound node
    ({"SLURM_CPUS_PER_TASK": "6", "LOCAL_WORLD_SIZE": "2"}, 16, 64, 8),  # torchrun in salloc
    ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_CPUS_ON_NODE": "16"}, 16,
     64, 4),  # 4 srun tasks share the node's 16 CPUs, unbound
    ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_CPUS_ON_NODE": "16"}, 2,
     64, 2),  # bound: each task's own CPU set is already its share
])
def test_cpus_per_process_counts_the_allowed_cpus_per_local_rank(slurm_env, env, allowed, host,
                                                                  want):
    slurm_env.setattr(os, "sched_getaffinity", lambda pid: set(range(allowed)), raising=False)
    slurm_env.setattr(os, "cpu_count", lambda: host)
    env = dict(env)
    quota = env.pop("QUOTA", None)  # this machine's own cgroup must not count here
    slurm_env.setattr(distributed_utils, "cgroup_cpu_limit", lambda: quota)
    for key, value in env.items():
        slurm_env.setenv(key, value)
    assert distributed_utils.cpus_per_process() == want

    import train_common
    assert train_common.default_workers(32) == min(want, 8)
    assert train_common.default_workers(1) == 0  # the template's rule for batch size 1


@pytest.mark.parametrize("cpus, workers_flag, device, eval_only, batch, want", [
    (16, None, "cuda", False, 256, 15),   # the H200 machine: 15 workers beat the cap's 8
    (64, None, "cuda", False, 32, 32),    # no more workers than samples in a batch
    (9, None, "cuda", False, 256, None),  # 8 spare CPUs: the cap is no limit
    (16, None, "cpu", False, 256, None),  # on CPU the training needs the CPUs
    (16, "8", "cuda", False, 256, None),  # the user chose
    (16, None, "cuda", True, 256, None),  # evaluation only: one pass
    (4, None, "cuda", False, 256, None),  # the CPUs, not the cap, set it
])
def test_a_gpu_process_capped_at_8_workers_is_told_which_workers_to_try(
        monkeypatch, cpus, workers_flag, device, eval_only, batch, want):
    import train_common
    monkeypatch.setattr(train_common, "cpus_per_process", lambda: cpus)
    argv = ["--batch-size", str(batch)] + (["--workers", workers_flag] if workers_flag else []) + (
        ["--eval-only"] if eval_only else [])
    args = train_common.get_args_parser().parse_args(argv)
    hint = train_common.more_workers_hint(args, torch.device(device))
    if want is None:
        assert hint is None
    else:
        assert hint == (f"the default stops at 8 loader workers per process, and this one has "
                        f"{cpus} CPUs: if training waits for data, try --workers {want} "
                        "(README: On an H200).")


_WAIT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d ms: %(message)s")
from multi_train_utils import distributed_utils as du
du.WAIT_NOTICE_S = 1.0
start = time.monotonic()
try:
    info = du.init_distributed_mode(device="cpu", timeout_s=float(sys.argv[1]))
except Exception as exc:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {exc}", flush=True)
else:
    print(f"JOINED a group of {info.world_size}", flush=True)
    time.sleep(3)  # past the notice's time: cancelled, it must stay silent
    du.cleanup()
"""


def test_a_rank_whose_peers_do_not_come_says_so_long_before_the_timeout():
    """An sbatch script that runs the script without srun: one process reads SLURM_NTASKS=2 and
    waits for a second task nobody starts. It says so after WAIT_NOTICE_S (1 s here), not only
    when --dist-timeout ends (30 minutes by default)."""
    port = find_free_port()
    result = run([sys.executable, "-c", _WAIT, "6"], timeout=60, PYTHONPATH=str(ROOT),
                 SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="4242",
                 SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    notices = [line for line in result.stderr.splitlines() if "has waited" in line]
    assert len(notices) == 1, result.stderr[-3000:]
    assert notices[0].endswith(
        f"rank 0 of 2 has waited 1 s for the other processes to join at 127.0.0.1:{port} (it "
        "gives up after --dist-timeout 6 s); under SLURM every task runs the script: start it "
        "with srun (in an sbatch script, a plain python command is one process).")
    assert "RAISED after" in result.stdout and "1/2 clients joined" in result.stdout, \
        result.stdout + result.stderr[-3000:]


def test_a_group_that_meets_in_time_gives_no_waiting_notice():
    result = run([sys.executable, "-c", _WAIT, "6"], timeout=60, PYTHONPATH=str(ROOT),
                 RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(find_free_port()))
    assert "JOINED a group of 1" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "has waited" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_loader_workers_started_by_spawn_train_and_report_a_bad_file(tmp_path, tiny_data, method):
    """macOS and Windows start DataLoader workers by spawn, and Python 3.14 on Linux by
    forkserver, not fork: everything the workers get (dataset, transforms, collate and init
    functions) must pickle, and a worker's report of an unreadable file must still reach
    skipped_files.txt. Python up to 3.13 forks on Linux, so only this test sees it."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    (data / "daisy" / "broken.jpg").write_bytes(b"not a jpeg at all" * 40)
    out = tmp_path / "out"
    argv = [LAUNCH, *TINY_FLAGS, "--data-path", str(data), "--output-dir", str(out), "--epochs",
            "1", "--no-verify-images"]
    argv[argv.index("--workers") + 1] = "1"
    code = ("import multiprocessing, runpy, sys\n"
            f"multiprocessing.set_start_method({method!r})\n"
            f"sys.argv = {argv!r}\n"
            f"runpy.run_path({LAUNCH!r}, run_name='__main__')\n")
    result = run([sys.executable, "-c", code], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [0]
    skipped = (out / "skipped_files.txt").read_text(encoding="utf-8")
    assert str(data / "daisy" / "broken.jpg") in skipped, skipped


def test_slurm_env_gives_ranks_and_rendezvous_address(slurm_env):
    slurm_env.setenv("SLURM_PROCID", "5")
    slurm_env.setenv("SLURM_LOCALID", "1")
    slurm_env.setenv("SLURM_NTASKS", "8")
    slurm_env.setenv("SLURM_JOB_NODELIST", "gpu[3-6]")
    slurm_env.setenv("SLURM_JOB_ID", "123456")
    assert distributed_utils._read_env() == (5, 1, 8)
    # Every task derives the same address and port without talking to the others.
    assert os.environ["MASTER_ADDR"] == "gpu3"
    assert os.environ["MASTER_PORT"] == str(20000 + 123456 % 12768)
    # Another step of the allocation (srun ... & srun ... &) gets another port.
    ports = set()
    for step in range(4):
        slurm_env.delenv("MASTER_PORT")
        slurm_env.setenv("SLURM_STEP_ID", str(step))
        distributed_utils._read_env()
        ports.add(os.environ["MASTER_PORT"])
    # Below the ephemeral ports (32768 on), which outgoing connections may hold at any time.
    assert len(ports) == 4 and all(20000 <= int(port) < 32768 for port in ports)
    # A step of a sweep (srun -N1 ... &) may run on any node of the allocation: its rank 0 is on
    # the first node of the step, not of the job.
    slurm_env.delenv("MASTER_ADDR")
    slurm_env.setenv("SLURM_STEP_NODELIST", "gpu5")
    distributed_utils._read_env()
    assert os.environ["MASTER_ADDR"] == "gpu5"
    # An explicit MASTER_ADDR/MASTER_PORT wins.
    slurm_env.setenv("MASTER_ADDR", "10.0.0.9")
    slurm_env.setenv("MASTER_PORT", "29555")
    distributed_utils._read_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29555")
    # One task (e.g. `srun -n1` or an interactive allocation) is a plain single process.
    slurm_env.setenv("SLURM_NTASKS", "1")
    assert distributed_utils._read_env() is None
    # torchrun inside a SLURM job: torchrun's variables take precedence.
    slurm_env.setenv("SLURM_NTASKS", "8")
    for key, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0")):
        slurm_env.setenv(key, value)
    assert distributed_utils._read_env() == (3, 0, 4)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"},
     "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are not; start the processes "
     "with torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
     "RANK and WORLD_SIZE are set but MASTER_PORT is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "RANK=2 is not a rank of WORLD_SIZE=2 (0 to 1)"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "environment variable RANK='one' is not a whole number"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"},
     "environment variable MASTER_PORT='x' is not a whole number"),
])
def test_broken_launch_environment_is_one_sentence(slurm_env, env, message):
    for key, value in env.items():
        slurm_env.setenv(key, value)
    with pytest.raises(distributed_utils.LaunchError, match=re.escape(message)):
        distributed_utils.init_distributed_mode(device="cpu")


def test_classic_call_sets_the_attributes_classic_scripts_read(slurm_env):
    # The classic template's init_distributed_mode(args) set these; copied scripts read them
    # (device_ids=[args.gpu], args.lr *= args.world_size). The 2-rank case: test_dist_timeout_*.
    args = argparse.Namespace(device="cpu")
    info = distributed_utils.init_distributed_mode(args)
    assert (args.rank, args.world_size, args.gpu, args.distributed, args.dist_backend) == \
        (0, 1, 0, False, None)
    assert info == distributed_utils.DistInfo()
    assert distributed_utils.init_distributed_mode(device="cpu") == info  # new code: no args
    for device in (torch.device("cpu"), "CPU"):  # what classic scripts may hold in args.device
        assert distributed_utils.init_distributed_mode(argparse.Namespace(device=device)) == info


def test_a_torchrun_group_of_one_is_a_process_group_as_in_the_classic_template(tmp_path):
    """`torchrun --nproc_per_node=1 classic_train.py` (a one-GPU debug run) stopped at the
    classic script's DistributedSampler: "Default process group has not been initialized"."""
    script = tmp_path / "classic_one.py"
    script.write_text(
        "import argparse\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "from multi_train_utils.distributed_utils import cleanup, init_distributed_mode\n"
        "args = argparse.Namespace(device='cpu', dist_url='env://')\n"
        "init_distributed_mode(args=args)\n"
        "sampler = torch.utils.data.distributed.DistributedSampler(list(range(5)))\n"
        "dist.barrier()\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "print('classic', args.rank, args.world_size, args.distributed, args.dist_backend,\n"
        "      len(list(sampler)), flush=True)\n"
        "cleanup()\n")
    res = run(torchrun_cmd(1, str(script)), timeout=120, PYTHONPATH=str(ROOT))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "classic 0 1 True gloo 5\n" in res.stdout


@pytest.mark.parametrize("url", ["tcp://127.0.0.1", "127.0.0.1:29500", "tcp://host:99999"])
def test_malformed_dist_url_is_one_sentence(slurm_env, url):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2")):
        slurm_env.setenv(key, value)
    with pytest.raises(distributed_utils.LaunchError,
                       match=re.escape(f"--dist-url {url!r} is not 'env://' or 'tcp://HOST:PORT'")):
        distributed_utils.init_distributed_mode(device="cpu", dist_url=url)


@pytest.mark.parametrize("exc, reason", [
    (RuntimeError("[/src/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                  "[10.0.0.2]:4488: Connection reset by peer. This is typically caused by a "
                  "remote worker hanging or bugs in the application."),
     "Read error [10.0.0.2]:4488: Connection reset by peer"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                  "waiting 1800000ms for recv operation to complete"),
     "Timed out waiting 1800000ms for recv operation to complete"),
    (RuntimeError("Application timeout caused pair closure"),  # gloo, a SIGSTOPped peer
     "Application timeout caused pair closure"),
    (torch.distributed.DistBackendError("NCCL communicator was aborted on rank 3.\nmore"),
     "NCCL communicator was aborted on rank 3"),
    # NCCL refusing the set-up is not a lost peer: a rerun fails the same way (nccl_setup_error).
    (torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3690, invalid usage"
                                        "\nncclInvalidUsage: This usually reflects invalid usage "
                                        "of NCCL library.\nLast error:\nDuplicate GPU detected : "
                                        "rank 1 and rank 0 both on CUDA device 1a000"), None),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x512 and 256x5)"), None),
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed."), None),
])
def test_peer_failures_are_told_from_other_errors(exc, reason):
    # A collective that failed because another rank died gets one line in train(); a bug in the
    # model or the data keeps its traceback.
    assert distributed_utils.peer_failure(exc) == reason


@pytest.mark.parametrize("text, reason", [
    ("NCCL error in: NCCLUtils.cpp:77, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
     "version 2.27.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
     "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
     "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"),
    ("NCCL error in: x.cpp:1, unhandled cuda error\nncclUnhandledCudaError: Call to CUDA function "
     "failed.\nLast error:\nCuda failure 'out of memory'", "Cuda failure 'out of memory'"),
    ("ncclInvalidArgument: Invalid value for an argument.", "ncclInvalidArgument"),
    ("NCCL communicator was aborted on rank 3.", None),  # a peer's failure: peer_failure's
    ("NCCL error: remote process exited or there was a network error, NCCL version 2.27.5\n"
     "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
     "prematurely.", None),
])
def test_nccl_set_up_errors_give_nccls_own_reason(text, reason):
    assert distributed_utils.nccl_setup_error(torch.distributed.DistBackendError(text)) == reason
    if reason is None:
        assert distributed_utils.peer_failure(torch.distributed.DistBackendError(text))


# ---------------------------------------------------------------- spawn launcher, several nodes
def test_spawn_node_rank_sets_global_ranks(monkeypatch):
    """``--nnodes 2 --node-rank 1`` with 2 processes per node: ranks 2 and 3 of 4.

    (In-process, with 2 processes per node; the end-to-end two-node run below has 1 each.)
    """
    import train_multi_gpu_using_spawn as spawn

    _clear_env(monkeypatch, LAUNCH_VARS)
    seen = []
    monkeypatch.setattr(spawn, "train", lambda args: seen.append(
        {**{k: os.environ[k] for k in LAUNCH_VARS}, "start": multiprocessing.get_start_method()}))
    watched = []  # the launcher's pid, passed in: read in the child it could be init's already
    monkeypatch.setattr(spawn, "die_with_launcher", watched.append)
    args = spawn.get_args_parser().parse_args(["--nnodes", "2", "--node-rank", "1"])
    default = multiprocessing.get_all_start_methods()[0]
    try:
        for local_rank in range(2):
            multiprocessing.set_start_method("spawn", force=True)  # as a spawned rank has it
            spawn._worker(local_rank, args, 2, "10.1.2.3", 29400, 4242, True)
    finally:
        multiprocessing.set_start_method(default, force=True)
    # DataLoader workers start the platform's default way (fork on Linux), not by spawn. Node
    # 0's launcher hosts the store: each process connects to it as torchrun's do to their agent.
    common = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3",
              "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True", "start": default}
    assert seen == [{"RANK": "2", "LOCAL_RANK": "0", **common},
                    {"RANK": "3", "LOCAL_RANK": "1", **common}]
    assert watched == [4242, 4242]


def _must_not_start(*args, **kwargs):
    raise AssertionError("a process was started despite the usage error")


def test_spawn_several_nodes_need_a_shared_address(monkeypatch, caplog):
    import train_multi_gpu_using_spawn as spawn

    _clear_env(monkeypatch, LAUNCH_VARS)
    args = spawn.get_args_parser().parse_args(["--device", "cpu", "--world-size", "1",
                                               "--nnodes", "2", "--node-rank", "1"])
    monkeypatch.setattr(spawn.mp, "start_processes", _must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        spawn.main(args)  # exits before starting any process
    assert exit_info.value.code == 2
    assert "--dist-url tcp://HOST:PORT" in caplog.text


def _spawn_nodes(tiny_data: Path, tmp_path: Path, per_node: list[int], *extra: str
                 ) -> tuple[list[int], list[str], list[Path]]:
    """Two spawn launchers on this host as nodes 0 and 1, ``per_node[n]`` CPU processes each:
    (exit codes, logs, output folders)."""
    port = find_free_port()
    outs = [tmp_path / f"node{n}" / "out" for n in range(2)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    procs = [_start([sys.executable, "train_multi_gpu_using_spawn.py", *TINY_FLAGS,
                     "--data-path", str(tiny_data), "--output-dir", str(outs[n]),
                     "--world-size", str(per_node[n]), "--nnodes", "2", "--node-rank", str(n),
                     "--dist-url", f"tcp://127.0.0.1:{port}", *extra], logs[n])
             for n in range(2)]
    try:
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:  # never leave a node waiting for its dead peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes, [log.read_text() for log in logs], outs


def test_spawn_two_nodes_train_as_one_job(tiny_data, tmp_path):
    codes, logs, outs = _spawn_nodes(tiny_data, tmp_path, [1, 1], "--epochs", "1")
    assert codes == [0, 0], "\n".join(logs)[-4000:]
    assert "starting 1 process(es) on node 0/2 (rank 0 of 2)" in logs[0]
    assert "starting 1 process(es) on node 1/2 (rank 1 of 2)" in logs[1]
    _check_one_writer(outs, 0, epochs=1)  # a 2-process run, written by node 0 only


def test_spawn_nodes_with_other_process_counts_stop_before_starting(tiny_data, tmp_path):
    """8 GPUs on one machine and 7 on the other: the ranks would claim overlapping numbers and
    wait out --dist-timeout at the rendezvous. The launchers compare counts first."""
    codes, logs, outs = _spawn_nodes(tiny_data, tmp_path, [2, 1])
    assert codes == [2, 2], "\n".join(logs)[-4000:]
    for log in logs:
        (error,) = [line for line in log.splitlines() if "error" in line]
        assert error.endswith(
            "error: the nodes would start different numbers of processes (node 0: 2, node 1: "
            "1; one per visible GPU unless --world-size is given); every node must start the "
            "same number: pass the same --world-size on each, or even out CUDA_VISIBLE_DEVICES.")
        assert "starting" not in log and "Traceback" not in log
    assert not any(out.exists() for out in outs)


def test_spawn_launchers_claiming_one_node_rank_are_refused(monkeypatch, caplog):
    """Two machines both given --node-rank 1: node 0 would see every node checked in, and the
    duplicated ranks would meet at the rendezvous. The second claim stops with one line."""
    import threading

    import torch.distributed as dist

    import train_multi_gpu_using_spawn as spawn

    port = find_free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # node 0
    argv = ["--device", "cpu", "--world-size", "1", "--nnodes", "2", "--node-rank", "1",
            "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-timeout", "5"]
    first = threading.Thread(target=lambda: _ignore_exit(
        spawn._meet_other_nodes, spawn.get_args_parser().parse_args(argv), 1, "127.0.0.1", port))
    first.start()
    deadline = time.monotonic() + 30
    while not host.check(["ddp-template/spawn/node1"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(SystemExit) as exit_info:
        spawn._meet_other_nodes(spawn.get_args_parser().parse_args(argv), 1, "127.0.0.1", port)
    assert exit_info.value.code == 2
    assert (f"error: another launcher already checked in as --node-rank 1 at 127.0.0.1:{port}; "
            "give each node its own --node-rank (0 to 1), or use another port for a second "
            "run.") in caplog.text
    first.join()
    del host


def _ignore_exit(fn, *args) -> None:
    try:
        fn(*args)
    except SystemExit:  # node 0 never checks in here: the first claimant times out
        pass


@pytest.mark.parametrize("node_rank", [0, 1])
def test_spawn_node_waiting_for_the_others_stops_on_ctrl_c(tmp_path, node_rank):
    """Node 0 waits for node 1 to check in, node 1 for node 0's store to answer: both waited
    inside C++, where Ctrl-C went unseen until --dist-timeout, then ended in a traceback."""
    import signal
    import time

    log = tmp_path / "node.log"
    proc = _start([sys.executable, "train_multi_gpu_using_spawn.py", "--device", "cpu",
                   "--world-size", "1", "--nnodes", "2", "--node-rank", str(node_rank),
                   "--dist-url", f"tcp://127.0.0.1:{find_free_port()}", "--dist-timeout", "120"],
                  log)
    try:
        deadline = time.monotonic() + 60
        while "waiting for the other node(s)" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(1)  # into the wait
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.rstrip().endswith(
        "stopped while waiting for the other node(s); no process was started."), text
    assert "Traceback" not in text and "frame #" not in text, text


def test_spawn_node_whose_peers_never_come_stops_after_the_timeout(monkeypatch, caplog):
    import train_multi_gpu_using_spawn as spawn

    _clear_env(monkeypatch, LAUNCH_VARS)
    port = find_free_port()
    args = spawn.get_args_parser().parse_args([
        "--device", "cpu", "--world-size", "1", "--nnodes", "2", "--node-rank", "0",
        "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-timeout", "1"])
    monkeypatch.setattr(spawn.mp, "start_processes", _must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        spawn.main(args)
    assert exit_info.value.code == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith(f"error: the 2 nodes did not all check in at 127.0.0.1:{port} "
                            "within --dist-timeout 1s (")
    assert error.endswith("); start the same command on every node, each with its "
                          "--node-rank, and make the port reachable from all.")


# ---------------------------------------------------------------- machines that disagree
def _flags_worker(rank: int, world: int, argv_by_rank: list[list[str]]) -> str | None:
    import train_common
    from multi_train_utils.distributed_utils import DistInfo

    args = train_common.get_args_parser().parse_args(argv_by_rank[rank])
    try:
        train_common._check_same_flags(args, DistInfo(rank=rank, world_size=world))
    except train_common.ConfigError as exc:
        return str(exc)
    return None


def test_ranks_started_with_other_training_flags_stop_with_one_line(tmp_path):
    """Another --lr or --img-size on one node trained silently wrong (rank 0 recorded its own);
    another --batch-size hung until --dist-timeout, then blamed a dead peer."""
    from dist_helpers import run_ranks

    base = ["--device", "cpu", "--output-dir", "runs/a", "--data-path", "/data"]
    other = ["--device", "cpu", "--output-dir", "/mnt/node1/runs/a", "--data-path", "/local/data",
             "--workers", "3", "--img-size", "64", "--lr", "0.01"]
    got = run_ranks(_flags_worker, 2, tmp_path / "differ", [base, other])
    want = ("the processes of this run were started with different flags (--img-size 224 on "
            "rank 0 but 64 on rank 1; --lr 0.001 on rank 0 but 0.01 on rank 1); start every "
            "process with the same training flags.")
    assert got == [want, want]  # on every rank: none is left waiting in a collective
    # Where things are on each machine may differ; the training flags agree: no error.
    same = run_ranks(_flags_worker, 2, tmp_path / "same", [base, other[:8]])
    assert same == [None, None]
    # --resume decides which collectives a rank makes (none skips the checkpoint search).
    got = run_ranks(_flags_worker, 2, tmp_path / "resume", [base, [*base, "--resume", "none"]])
    assert "(--resume auto on rank 0 but none on rank 1)" in got[0] and got[0] == got[1]
    # A --val-path on one machine only: rank 0 waited in a scan rank 1 never made, 30 minutes.
    got = run_ranks(_flags_worker, 2, tmp_path / "val", [[*base, "--val-path", "/v"], base])
    assert "(--val-path given on rank 0 but not given on rank 1)" in got[0] and got[0] == got[1]
    got = run_ranks(_flags_worker, 2, tmp_path / "vals", [[*base, "--val-path", "/v"],
                                                           [*base, "--val-path", "/mnt/v"]])
    assert got == [None, None]


def _scan_worker(rank: int, world: int, roots: list[str]) -> list[list[str]]:
    import train_common
    from multi_train_utils.distributed_utils import DistInfo

    scan = train_common._scan_on_rank0(roots[rank], False, DistInfo(rank=rank, world_size=world),
                                       2)
    return [scan.root, *scan.images]


def test_each_machine_reads_the_images_below_its_own_data_path(tmp_path, tiny_data):
    """Rank 0 scans and hands every rank the list: by the paths below its own --data-path, so
    a data set mounted elsewhere on a machine is read there (it read rank 0's paths, failed on
    every file, and that machine trained on placeholders, saying only skip-log lines)."""
    import shutil

    from dist_helpers import run_ranks

    copy = tmp_path / "mnt" / "flowers"
    shutil.copytree(tiny_data, copy)
    got = run_ranks(_scan_worker, 2, tmp_path / "ranks", [str(tiny_data), f"{copy}/"])
    assert got[0][0] == str(tiny_data) and got[1][0] == f"{copy}/"
    mine, theirs = got[0][1:], got[1][1:]
    assert [len(c) for c in mine] == [len(c) for c in theirs] == [12] * 5
    for a, b in zip(sum(mine, []), sum(theirs, [])):
        assert Path(a).relative_to(tiny_data) == Path(b).relative_to(copy) and Path(b).is_file()


def _backend_worker(rank: int, world: int, backends: list[str], prefix: str) -> str | None:
    import socket
    import time

    import torch.distributed as dist

    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    time.sleep(0.5 * rank)  # check in by rank, so the message names ranks 0 and 1
    try:
        distributed_utils.agree_on_backend(store, rank, world, backends[rank])
    except distributed_utils.LaunchError as exc:
        return str(exc).replace(socket.gethostname(), "HOST")
    return None


def test_ranks_on_other_backends_stop_with_one_line_at_once(tmp_path):
    """--device auto on a machine whose GPUs failed picks gloo, beside NCCL elsewhere: the two
    backends never meet, and both sides waited out --dist-timeout (30 min), then blamed the
    network. Every rank now stops at the rendezvous with what differs."""
    from dist_helpers import run_ranks

    start = time.monotonic()
    got = run_ranks(_backend_worker, 3, tmp_path / "differ", ["nccl", "gloo", "gloo"], "a")
    assert time.monotonic() - start < 30  # not the collective timeout (90 s) run out
    assert got == 3 * [
        "the processes disagree on the backend: rank 0 on HOST uses nccl (--device auto), but "
        "rank 1 on HOST uses gloo (--device auto). Under --device auto a machine without a "
        "working GPU falls back to CPU (gloo): fix its GPUs (nvidia-smi), or pass the same "
        "--device cuda or cpu on every machine."]  # on every rank: none is left waiting
    assert run_ranks(_backend_worker, 3, tmp_path / "same", ["gloo"] * 3, "b") == [None] * 3


def _resume_worker(rank: int, world: int, outs: list[str]) -> str | None:
    import train_common
    from multi_train_utils.checkpoint import CheckpointError

    args = train_common.get_args_parser().parse_args(["--output-dir", outs[rank]])
    try:
        return train_common._resolve_resume(args, Path(outs[rank]))
    except CheckpointError as exc:
        return f"error: {exc}"


def test_a_checkpoint_only_another_machine_sees_is_not_silently_started_over(tmp_path):
    """Node-local output folders under c10d rendezvous: rank 0 landed on the machine without
    the checkpoint and trained a second run from epoch 0 beside the first."""
    from dist_helpers import run_ranks

    outs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for out in outs:
        out.mkdir(parents=True)
    torch.save({"epoch": 0}, outs[1] / "checkpoint.pth")
    got = run_ranks(_resume_worker, 2, tmp_path / "r", [str(o) for o in outs])
    want = [f"error: {out / 'checkpoint.pth'} exists on some machines of this run but not on "
            "the one of rank 0; put --output-dir on storage all machines share, or copy the "
            "run's folder to each of them." for out in outs]  # each rank names its own path
    assert got == want
    (outs[1] / "checkpoint.pth").unlink()  # a new run everywhere: nothing to resume
    assert run_ranks(_resume_worker, 2, tmp_path / "n", [str(o) for o in outs]) == [None, None]


def test_restarted_ranks_on_several_machines_agree_on_the_attempt(slurm_env):
    """torchrun --max-restarts over 2 machines: the agent whose worker died counts a restart,
    the other restarts its workers as a new round without counting. Keys prefixed with each
    agent's TORCHELASTIC_RESTART_COUNT then never met ("wait timeout ... /attempt1/..."), and
    the restarts were spent; every rank counting its own starts in the store agrees."""
    import datetime

    import torch.distributed as dist

    port = find_free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True,  # torchrun's agent store
                          timeout=datetime.timedelta(seconds=30))
    slurm_env.setenv("MASTER_ADDR", "127.0.0.1")
    slurm_env.setenv("MASTER_PORT", str(port))
    slurm_env.setenv("WORLD_SIZE", "2")
    slurm_env.setenv("GROUP_WORLD_SIZE", "2")
    slurm_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    timeout = datetime.timedelta(seconds=5)  # a rank that waits in another namespace fails

    def store_of(rank: int, restart_count: int):
        slurm_env.setenv("RANK", str(rank))
        slurm_env.setenv("TORCHELASTIC_RESTART_COUNT", str(restart_count))
        return distributed_utils._elastic_store(timeout)

    # Start 1: both agents at count 0. Start 2: node 1's worker died, so only its agent counts.
    for start, counts in ((1, (0, 0)), (2, (0, 1))):
        stores = [store_of(rank, count) for rank, count in enumerate(counts)]
        stores[0].set("meet", f"start {start}")
        assert stores[1].get("meet") == f"start {start}".encode()  # one namespace: they meet
    assert [agent.get(f"start{n}-world2/meet") for n in (1, 2)] == [b"start 1", b"start 2"]
    # One machine: its one agent counts every restart; its count is used as before.
    slurm_env.setenv("GROUP_WORLD_SIZE", "1")
    store_of(0, 3).set("single", "x")
    assert agent.get("attempt3/single") == b"x"


@pytest.fixture
def fake_gpus(slurm_env):
    """``torch.cuda`` that reports GPUs; returns the devices set_device was called with."""
    chosen: list[int] = []
    slurm_env.setattr(torch.cuda, "is_available", lambda: True)
    slurm_env.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_gpu_of_a_local_rank_under_slurm_gpu_binding(slurm_env, fake_gpus):
    """--gpus-per-task=1 shows each task one GPU (device 0, whatever its SLURM_LOCALID); a task
    given two GPUs is told to start one process per GPU."""
    slurm_env.setattr(torch.cuda, "device_count", lambda: 1)
    slurm_env.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert distributed_utils._pick_device("auto", 3, slurm_task=True) == torch.device("cuda", 0)
    assert fake_gpus == [0]
    slurm_env.setattr(torch.cuda, "device_count", lambda: 2)
    slurm_env.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert distributed_utils._pick_device("cuda", 1, slurm_task=True) == torch.device("cuda", 1)
    with pytest.raises(distributed_utils.LaunchError) as error:
        distributed_utils._pick_device("cuda", 3, slurm_task=True)
    assert str(error.value) == (
        "local rank 3 has no GPU: only 2 visible (CUDA_VISIBLE_DEVICES=2,3); start one process "
        "per GPU (with SLURM: --gpus-per-task=1, or --ntasks-per-node equal to the GPUs per node).")
    # srun --ntasks-per-node=4 on nodes with 2 GPUs: local ranks 0-1 stop too, not only 2-3,
    # which would leave them waiting in the rendezvous (srun does not stop the other tasks).
    slurm_env.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    for local_rank in (0, 3):
        with pytest.raises(distributed_utils.LaunchError, match=re.escape(
                "local rank 3 has no GPU: only 2 visible")):
            distributed_utils._pick_device("cuda", local_rank, slurm_task=True)
    slurm_env.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1")  # not even: each rank by itself
    assert distributed_utils._pick_device("cuda", 0, slurm_task=True) == torch.device("cuda", 0)
    slurm_env.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    assert distributed_utils._pick_device("cuda", 1, slurm_task=True) == torch.device("cuda", 1)
    slurm_env.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task=1: its own GPU
    slurm_env.setenv("CUDA_VISIBLE_DEVICES", "6")
    slurm_env.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    assert distributed_utils._pick_device("cuda", 2, slurm_task=True) == torch.device("cuda", 0)


def test_a_device_string_is_checked_and_its_gpu_index_used_by_one_process(slurm_env, fake_gpus,
                                                                          caplog):
    """cuda:1 in one process is GPU 1 (it was GPU 0, silently); under a launcher each process
    takes its local rank's GPU, and the index is said to be unused; "mps" is one sentence."""
    init = distributed_utils.init_distributed_mode
    slurm_env.setattr(torch.cuda, "device_count", lambda: 2)
    assert init(device="cuda:1").device == torch.device("cuda", 1)
    assert fake_gpus == [1]
    with pytest.raises(distributed_utils.LaunchError, match=re.escape(
            "--device cuda:2 was asked for, but only 2 GPU(s) are visible")):
        init(device="cuda:2")
    for bad in ("mps", "gpu", "cuda:x", "cpu:0", "cuda:\u00b2"):
        with pytest.raises(ValueError, match=re.escape(f"device '{bad}' is not one of auto, cpu, "
                                                       "cuda or cuda:N")):
            init(device=bad)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        slurm_env.setenv(key, value)  # torchrun --nproc_per_node=1 without a rendezvous address
    assert init(device="cuda:1").device == torch.device("cuda", 0)
    assert ("--device cuda:1: under a launcher each process uses the GPU of its local rank, so "
            "the index is not used") in caplog.text


def test_half_a_launch_environment_is_said_not_ignored(slurm_env, caplog):
    """WORLD_SIZE=2 LOCAL_RANK=1 without RANK (a hand-written launch) ran as a lone rank 0."""
    slurm_env.setenv("WORLD_SIZE", "2")
    slurm_env.setenv("LOCAL_RANK", "1")
    info = distributed_utils.init_distributed_mode(device="cpu")
    assert (info.rank, info.world_size) == (0, 1)
    assert ("WORLD_SIZE and LOCAL_RANK are set but RANK is not: this process runs alone, in no "
            "process group; start the processes with torchrun, or unset them.") in caplog.messages


def test_torchrun_with_more_processes_than_gpus_stops_every_rank(slurm_env, fake_gpus):
    """``CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2``: torchrun's workers share one view,
    so the SLURM remap must not put both on GPU 0 (NCCL would refuse at the first collective).
    Every local rank stops, local rank 0 too, with the launch sentence."""
    slurm_env.setattr(torch.cuda, "device_count", lambda: 1)
    slurm_env.setenv("CUDA_VISIBLE_DEVICES", "0")
    slurm_env.setenv("LOCAL_WORLD_SIZE", "2")
    for local_rank in (0, 1):
        with pytest.raises(distributed_utils.LaunchError, match=re.escape(
                "local rank 1 has no GPU: only 1 visible (CUDA_VISIBLE_DEVICES=0); start one "
                "process per GPU")):
            distributed_utils._pick_device("auto", local_rank)
    assert fake_gpus == []
    slurm_env.setenv("LOCAL_WORLD_SIZE", "1")
    assert distributed_utils._pick_device("auto", 0) == torch.device("cuda", 0)


def test_the_group_is_bound_to_the_gpu_and_args_gpu_is_its_index(slurm_env, fake_gpus):
    """NCCL gets device_id (it connects in init_process_group, so a refused set-up fails there);
    under SLURM --gpus-per-task=1 local rank 3 is on cuda:0, and the classic
    ``DDP(model, device_ids=[args.gpu])`` must get 0, not 3."""
    calls = []
    slurm_env.setattr(torch.cuda, "device_count", lambda: 1)
    slurm_env.setattr(distributed_utils.dist, "init_process_group",
                      lambda backend, **kwargs: calls.append((backend, kwargs)))
    # No rank 0 to meet: the rendezvous yields a store of this process, the check passes.
    slurm_env.setattr(distributed_utils.dist, "rendezvous",
                      lambda url, rank, world, **kwargs: iter([(torch.distributed.HashStore(),
                                                                rank, world)]))
    slurm_env.setattr(distributed_utils, "agree_on_backend", lambda *args, **kwargs: None)
    slurm_env.setattr(distributed_utils, "wait_for_port", lambda *args: None)
    for key, value in dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="3",
                           CUDA_VISIBLE_DEVICES="3", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        slurm_env.setenv(key, value)
    args = argparse.Namespace(device="cuda")
    info = distributed_utils.init_distributed_mode(args)
    assert (info.rank, info.local_rank, info.world_size, info.device) == \
        (3, 3, 4, torch.device("cuda", 0))
    assert (args.gpu, args.rank, args.dist_backend) == (0, 3, "nccl")
    assert [(backend, kwargs["device_id"]) for backend, kwargs in calls] == \
        [("nccl", torch.device("cuda", 0))]
    distributed_utils.init_distributed_mode(device="cpu")
    assert calls[-1][0] == "gloo" and calls[-1][1]["device_id"] is None
