"""Where a process finds its rank, device and CPUs: torchrun's, SLURM's and a broken environment.

Unit level, in this process: the launcher variables are set with monkeypatch, GPUs are faked
where a test needs them, and a process group is only made where the test is about one (a group
of one, on gloo). Launches of real processes are in test_launchers.py and
test_multinode_slurm.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re

import pytest
import torch
import torch.distributed as dist

from multi_train_utils import distributed_utils as du
from multi_train_utils.guard import UserError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def env(monkeypatch):
    """No launcher, SLURM or torchrun-restart variables set, whatever the shell running pytest
    has; monkeypatch restores them afterwards."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))] + list(
            LAUNCH_VARS):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _set(monkeypatch, **values: str) -> None:
    for key, value in values.items():
        monkeypatch.setenv(key, value)


# ---------------------------------------------------------------- ranks from the environment
@pytest.mark.parametrize("nodelist, first", [
    ("node[01-04],gpu7", "node01"),
    ("gpu-a,gpu-b", "gpu-a"),
    ("node[1,3-5],other[2-3]", "node1"),
    ("rack-[07-09]", "rack-07"),
    ("n[1-2]-ib,gpu1", "n1-ib"),  # a suffix after the brackets (an InfiniBand name)
    ("r[3-4]n[01-08]", "r3n01"),
    ("single", "single"),
])
def test_slurm_rank_0_is_on_the_first_node_of_the_list(env, nodelist, first):
    _set(env, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST=nodelist)
    assert du._read_env() == (1, 0, 2)
    assert os.environ["MASTER_ADDR"] == first


def test_slurm_env_gives_ranks_and_rendezvous_address(env):
    _set(env, SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8", SLURM_JOB_NODELIST="gpu[3-6]",
         SLURM_JOB_ID="123456")
    assert du._read_env() == (5, 1, 8)
    # Every task derives the same address and port without talking to the others.
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == \
        ("gpu3", str(20000 + 123456 % 12768))
    ports = set()
    for step in range(4):  # other steps of the allocation (srun ... & srun ... &): other ports
        env.delenv("MASTER_PORT")
        env.setenv("SLURM_STEP_ID", str(step))
        du._read_env()
        ports.add(os.environ["MASTER_PORT"])
    # Below the ephemeral ports (32768 on), which outgoing connections may hold at any time.
    assert len(ports) == 4 and all(20000 <= int(port) < 32768 for port in ports)
    # A step of a sweep (srun -N1 ... &) may run on any node: rank 0 is on the step's first.
    env.delenv("MASTER_ADDR")
    env.setenv("SLURM_STEP_NODELIST", "gpu5")
    du._read_env()
    assert os.environ["MASTER_ADDR"] == "gpu5"
    _set(env, MASTER_ADDR="10.0.0.9", MASTER_PORT="29555")  # an explicit address wins
    du._read_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29555")
    env.setenv("SLURM_NTASKS", "1")  # srun -n1, an interactive allocation: one plain process
    assert du._read_env() is None
    env.setenv("SLURM_NTASKS", "8")  # torchrun inside a SLURM job: torchrun's variables win
    _set(env, RANK="3", WORLD_SIZE="4", LOCAL_RANK="0")
    assert du._read_env() == (3, 0, 4)


def test_no_launcher_is_one_process_without_a_group(env):
    info = du.init_distributed_mode(device="cpu")
    assert info == du.DistInfo() and not info.distributed and info.rank == 0
    assert not dist.is_initialized()
    assert (du.get_rank(), du.get_world_size(), du.is_main_process()) == (0, 1, True)


@pytest.mark.parametrize("values, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"},
     "RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not; start the processes "
     "with torchrun."),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "rank 2 is outside the world size 2 (0 to 1); start the processes with torchrun."),
    ({"RANK": "one", "WORLD_SIZE": "2"},
     "environment variable RANK='one' is not a whole number; unset it or start the processes "
     "with torchrun."),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"},
     "environment variable MASTER_PORT='x' is not a whole number"),
    ({"RANK": "\u00b2", "WORLD_SIZE": "2"}, "environment variable RANK='\u00b2' is not a whole"),
    # A hand-written launch that forgot RANK: each process would train alone, as rank 0.
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "environment variable RANK=None is not a whole"),
])
def test_a_broken_launch_environment_is_one_sentence(env, values, message):
    _set(env, **values)
    with pytest.raises(du.LaunchError, match="^" + re.escape(message)):
        du.init_distributed_mode(device="cpu")
    assert issubclass(du.LaunchError, UserError)  # the guard prints it as one error: line


@pytest.mark.parametrize("url", ["tcp://127.0.0.1", "127.0.0.1:29500", "tcp://host:port"])
def test_a_malformed_dist_url_is_one_sentence(env, url):
    _set(env, RANK="0", WORLD_SIZE="2")
    with pytest.raises(du.LaunchError, match=re.escape(
            f"--dist-url {url!r} is not 'env://' or 'tcp://HOST:PORT'.")):
        du.init_distributed_mode(device="cpu", dist_url=url)


# ---------------------------------------------------------------- keywords, not a namespace
def test_the_arguments_are_keywords_and_the_answer_a_frozen_dataclass(env):
    """The library reads no argparse namespace: the classic ``init_distributed_mode(args)``
    is refused, and what it set on ``args`` (rank, world size, GPU) is the returned DistInfo's."""
    args = argparse.Namespace(device="cpu")
    with pytest.raises(TypeError):
        du.init_distributed_mode(args)
    info = du.init_distributed_mode(device="cpu")
    assert info == du.DistInfo() and vars(args) == {"device": "cpu"}
    assert info.timeouts == du.LIMITS_S
    assert du.init_distributed_mode(device="cpu", timeout_s=30).timeouts == (30, 30)
    for device in (torch.device("cpu"), "CPU"):  # what a classic script may hold in args.device
        assert du.init_distributed_mode(device=device) == info
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1


def test_a_torchrun_group_of_one_is_a_process_group_as_in_the_classic_template(env):
    """`torchrun --nproc_per_node=1 classic_train.py` (a one-GPU debug run) stopped at the
    classic script's DistributedSampler: "Default process group has not been initialized"."""
    _set(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(du.find_free_port()))
    try:
        info = du.init_distributed_mode(device="cpu", dist_url="env://", timeout_s=60)
        sampler = torch.utils.data.distributed.DistributedSampler(list(range(5)))
        assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo")
        assert info.distributed and len(list(sampler)) == 5
        # Again: the group there is.
        assert du.init_distributed_mode(device="cpu", timeout_s=60) == info
    finally:
        du.cleanup()
    assert not dist.is_initialized()


# ---------------------------------------------------------------- devices
def test_device_strings_are_checked(env):
    for bad in ("mps", "gpu", "cuda:x", "cpu:0", "cuda:\u00b2"):
        with pytest.raises(du.LaunchError, match=re.escape(
                f"--device {bad!r} is not one of auto, cpu, cuda or cuda:N.")):
            du.init_distributed_mode(device=bad)
    env.setattr(torch.cuda, "is_available", lambda: False)
    assert du.init_distributed_mode(device="auto").device == torch.device("cpu")
    with pytest.raises(du.LaunchError, match=re.escape(
            "--device cuda, but CUDA is not available here; use --device cpu.")):
        du.init_distributed_mode(device="cuda")


@pytest.fixture
def fake_gpus(env):
    """``torch.cuda`` that reports 2 GPUs; returns the devices set_device was called with."""
    chosen: list[int] = []
    env.setattr(torch.cuda, "is_available", lambda: True)
    env.setattr(torch.cuda, "device_count", lambda: 2)
    env.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_cuda_n_picks_a_gpu_for_one_process_and_the_local_rank_under_a_launcher(env, fake_gpus):
    assert du.init_distributed_mode(device="cuda:1").device == torch.device("cuda", 1)
    assert du.init_distributed_mode(device="auto").device == torch.device("cuda", 0)
    assert fake_gpus == [1, 0]
    with pytest.raises(du.LaunchError, match=re.escape(
            "--device cuda:2 has no GPU: only 2 visible (CUDA_VISIBLE_DEVICES=unset)")):
        du.init_distributed_mode(device="cuda:2")
    # Under a launcher each process takes its local rank's GPU, whatever cuda:N says.
    assert du.pick_device("cuda:0", 1, launched=True) == torch.device("cuda", 1)


def test_more_local_ranks_than_gpus_stop_every_rank(env, fake_gpus):
    """``CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2``: local rank 0 stops too, not only
    local rank 1, which would leave rank 0 waiting for it in the rendezvous."""
    _set(env, CUDA_VISIBLE_DEVICES="0", LOCAL_WORLD_SIZE="2", RANK="0", WORLD_SIZE="2")
    env.setattr(torch.cuda, "device_count", lambda: 1)
    for local_rank in (0, 1):
        with pytest.raises(du.LaunchError, match=re.escape(
                "local rank 1 has no GPU: only 1 visible (CUDA_VISIBLE_DEVICES=0); use one "
                "process per GPU (SLURM: --gpus-per-task=1).")):
            du.pick_device("auto", local_rank, launched=True)
    assert fake_gpus == []
    env.setenv("LOCAL_WORLD_SIZE", "1")
    assert du.pick_device("auto", 0, launched=True) == torch.device("cuda", 0)


def test_the_group_is_bound_to_the_gpu_and_the_device_is_its_index(env, fake_gpus):
    """SLURM --gpus-per-task=1 shows each task one GPU: local rank 3 is on cuda:0, and
    ``DDP(model, device_ids=[info.device.index])`` must get 0, not 3. NCCL gets device_id, so a
    set-up it refuses fails in init_process_group, not at the first collective."""
    calls = []
    env.setattr(torch.cuda, "device_count", lambda: 1)
    env.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    _set(env, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="3",
         MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    info = du.init_distributed_mode(device="cuda")
    assert (info.rank, info.local_rank, info.world_size, info.device, info.backend) == \
        (3, 3, 4, torch.device("cuda", 0), "nccl")
    (backend, kwargs), = calls
    assert (backend, kwargs["device_id"], kwargs["init_method"]) == \
        ("nccl", torch.device("cuda", 0), "env://")
    assert kwargs["timeout"] == datetime.timedelta(seconds=du.LIMITS_S[0])
    du.init_distributed_mode(device="cpu", timeout_s=5)
    assert calls[-1][0] == "gloo" and calls[-1][1]["device_id"] is None
    assert calls[-1][1]["timeout"] == datetime.timedelta(seconds=5)


def test_on_cuda_the_flight_recorder_dumps_into_the_run_folder_unless_set_up(env, fake_gpus,
                                                                            tmp_path):
    """NCCL runs get PyTorch's flight recorder (each rank's last collectives, dumped on a
    timeout) into <output-dir>/flight_recorder/; a user's own TORCH_FR_* settings are kept."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
    for name in names:  # monkeypatch restores what the code sets
        env.setenv(name, "")
        env.delenv(name)
    env.setattr(dist, "init_process_group", lambda backend, **kw: None)
    _set(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
         MASTER_PORT="29500")
    du.init_distributed_mode(device="cuda", trace_dir=str(tmp_path / "run"))
    assert [os.environ[name] for name in names] == [
        "2000", "1", str(tmp_path / "run" / "flight_recorder" / "rank_")]
    assert (tmp_path / "run" / "flight_recorder").is_dir()
    for name in names:
        env.delenv(name)
    env.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # the older name: the user's choice
    du.init_distributed_mode(device="cuda", trace_dir=str(tmp_path / "other"))
    assert not any(name in os.environ for name in names) and not (tmp_path / "other").exists()


# ---------------------------------------------------------------- torchrun restarts
def test_restarted_ranks_meet_in_the_keys_of_their_own_start(env):
    """After ``torchrun --max-restarts`` the agent store still holds the dead start's gloo
    addresses; each start gets its own key prefix. Over 2 machines the agent whose worker died
    counts a restart and the other does not, so the ranks count their own starts instead."""
    port = du.find_free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True,  # torchrun's agent store
                          timeout=datetime.timedelta(seconds=30))
    _set(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
         GROUP_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")

    def store_of(rank: int, restart_count: int) -> dist.Store:
        _set(env, RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(restart_count))
        return du._elastic_store(datetime.timedelta(seconds=5))

    # Start 1: both agents at count 0. Start 2: node 1's worker died, so only its agent counts.
    for start, counts in ((1, (0, 0)), (2, (0, 1))):
        stores = [store_of(rank, count) for rank, count in enumerate(counts)]
        stores[0].set("meet", f"start {start}")
        assert stores[1].get("meet") == f"start {start}".encode()  # one namespace: they meet
    assert [agent.get(f"start{n}-world2/meet") for n in (1, 2)] == [b"start 1", b"start 2"]
    env.setenv("GROUP_WORLD_SIZE", "1")  # one machine: its one agent counts every restart
    store_of(0, 3).set("single", "x")
    assert agent.get("attempt3/single") == b"x"
    env.delenv("TORCHELASTIC_RESTART_COUNT")  # not torchrun: torch's own rendezvous
    assert du._elastic_store(datetime.timedelta(seconds=5)) is None


# ---------------------------------------------------------------- CPUs
@pytest.mark.parametrize("cpu_max, allowed, want", [
    (None, 16, 16),  # no cgroup file: the CPU set
    ("max 100000\n", 16, 16),  # no limit
    ("400000 100000\n", 64, 4),  # docker run --cpus=4 on 64 cores: 4 CPUs' time, not 64
    ("150000 100000\n", 64, 2),  # rounded up
    ("800000 100000\n", 2, 2),  # a quota above the CPU set changes nothing
])
def test_usable_cpus_counts_the_cpu_set_and_the_quota(env, tmp_path, cpu_max, allowed, want):
    env.setattr(os, "sched_getaffinity", lambda pid: set(range(allowed)), raising=False)
    env.setattr(os, "cpu_count", lambda: 128)  # the host's, not ours
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert du.usable_cpus(str(tmp_path)) == want


@pytest.mark.parametrize("values, usable, want", [
    ({}, 16, 16),
    ({"LOCAL_WORLD_SIZE": "8"}, 16, 2),  # torchrun's 8 ranks share the node's set
    ({"LOCAL_WORLD_SIZE": "8"}, 4, 1),  # never 0
    ({"SLURM_CPUS_PER_TASK": "6"}, 64, 6),  # srun tasks on an unbound node
    ({"SLURM_CPUS_PER_TASK": "6", "LOCAL_WORLD_SIZE": "2"}, 16, 8),  # torchrun in salloc
])
def test_cpus_per_process_shares_the_cpus_of_a_machine(env, values, usable, want):
    env.setattr(du, "usable_cpus", lambda: usable)
    _set(env, **values)
    assert du.cpus_per_process() == want


def test_find_free_port_gives_a_port_one_can_listen_on():
    import socket

    port = du.find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536
