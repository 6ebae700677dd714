"""slurm/train.sbatch on a real SLURM cluster: the one node slurm/local-cluster.sh starts here.

SLURM's warning to the batch script (``--signal=B:USR1@120``, sent here at once with ``scancel
--batch --signal=USR1``, as SLURM sends it) stops both ranks mid-epoch with a save; the job
requeues itself, and the requeued job continues at that step and trains each epoch once. A bad
flag ends the job without a requeue.

Skipped where no cluster answers (``.ci/run`` starts one and sets REQUIRE_SLURM=1, which makes
that a failure instead).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, child_env, flags, read_metrics
from demo_data import make_demo_data

SCRIPT = "slurm/train.sbatch"
CPU = ["--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1", "--time=10"]
PER_CLASS = 30  # 5 classes: 14 steps of 2 x 4 an epoch (what the 4/5 split leaves)


def cluster_or_skip() -> None:
    why = None
    if not shutil.which("sbatch"):
        why = "SLURM is not installed"
    elif not re.search(r"^(idle|mix|alloc|comp)", node_state(), re.M):
        why = "no SLURM node answers"
    if why and os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"{why}, but REQUIRE_SLURM=1: run slurm/local-cluster.sh first")
    if why:
        pytest.skip(f"{why} here (sudo slurm/local-cluster.sh installs and starts one node)")


def job(job_id: str) -> dict[str, str]:
    res = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout))


def node_state() -> str:
    res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return res.stdout.strip()


def wait_for(condition, what: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log.exists() else "(no output yet)"
            pytest.fail(f"no {what} after {timeout:.0f}s:\n{text[-3000:]}")
        time.sleep(0.2)


@pytest.fixture
def sbatch(tmp_path):
    """``sbatch(*options, *training_flags)`` -> (job id, its output file); every job it
    submitted is cancelled at teardown."""
    cluster_or_skip()
    jobs = []
    # The job runs the first ``python`` on PATH: this one (sbatch passes the environment on).
    env = child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def submit(*args: str) -> tuple[str, Path]:
        log = tmp_path / f"slurm-{len(jobs)}.out"
        res = subprocess.run(["sbatch", "--parsable", f"--output={log}", *CPU, SCRIPT, *args],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        jobs.append(res.stdout.strip().split(";")[0])
        return jobs[-1], log

    yield submit
    for job_id in jobs:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_the_warning_signal_saves_mid_epoch_and_the_requeued_job_continues(sbatch, tmp_path):
    data = make_demo_data(tmp_path / "flowers", per_class=PER_CLASS, size=32)
    out = tmp_path / "out"
    # A bad flag: submitted first, this job fails before the training job can start.
    bad, bad_log = sbatch(*flags(data, tmp_path / "bad", "--epochs", "0"))
    job_id, log = sbatch(*flags(data, out, "--epochs", "1", "--print-freq", "1"))

    wait_for(lambda: "[train epoch 0] step 2/" in log.read_text() if log.exists() else False,
             "second step", log)
    # What SLURM sends 120 s before the time limit.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
    wait_for(lambda: job(job_id)["JobState"] == "PENDING" and job(job_id)["Restarts"] == "1",
             "requeued job", log)
    # SLURM holds a requeued job for about two minutes: let it start now, once the node is done
    # with its first run, and in a later second (slurmd refuses a job whose credential is dated
    # no later than the second it revoked the first run's).
    wait_for(lambda: node_state() == "idle", "idle node", log)
    time.sleep(1.1)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    wait_for(lambda: job(job_id)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING",
                                                     "COMPLETING", "REQUEUED"),
             "end of the requeued job", log)

    text = log.read_text(errors="replace")
    final = job(job_id)
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        text[-3000:]
    # Both ranks stopped at one step inside the epoch and saved; the job requeued itself.
    stops = re.findall(r"^\S+ (\[rank 1\] )?stopping after step (\d+) of (\d+) of the epoch, "
                       r"saved$", text, re.M)
    assert sorted(rank for rank, _, _ in stops) == ["", "[rank 1] "], text[-3000:]
    (step, steps), = {(int(s), int(n)) for _, s, n in stops}
    assert 0 < step < steps == 14, text[-3000:]
    assert f"requeueing job {job_id}" in text
    # The requeued job continued at that step, and trained the epoch's first steps only once.
    assert re.search(rf"resuming from epoch 0, step {step} of {steps}\b", text), text[-3000:]
    assert text.count("[train epoch 0] step 1/") == 1
    assert [m["epoch"] for m in read_metrics(out)] == [0]

    # A failure that is not a stop (a bad flag: exit 2, and srun ends the other rank) ends the
    # job: no requeue.
    bad_job, bad_text = job(bad), bad_log.read_text(errors="replace")
    assert (bad_job["JobState"], bad_job["Restarts"]) == ("FAILED", "0"), bad_text[-2000:]
    assert "error: argument --epochs" in bad_text and "requeueing" not in bad_text


STUB = {"srun": 'kill -USR1 $PPID; sleep 0.5; exit "$TRAIN_EXIT"',  # the warning, mid-run
        "scancel": 'echo "scancel $*" >> "$CALLS"', "scontrol": 'echo "scontrol $*" >> "$CALLS"'}


@pytest.mark.parametrize("code, requeued", [(0, False), (143, True)], ids=["done", "stopped"])
def test_the_script_requeues_only_a_job_the_warning_stopped(code, requeued, tmp_path):
    """No cluster: srun, scancel and scontrol stubbed. The warning (SIGUSR1) comes while srun
    runs; training that then ends with exit 0 finished, and its job is not requeued."""
    for name, body in STUB.items():
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**child_env(), "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "CALLS": str(calls), "TRAIN_EXIT": str(code)}
    res = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == code, res.stdout + res.stderr
    assert calls.read_text().splitlines() == ["scancel --signal=TERM 7",
                                              *["scontrol requeue 7"] * requeued]
