"""Jobs that span machines, simulated on localhost: two torchrun nodes, and two SLURM tasks.

The probe (conftest) records each rank's place in the job, its share of the data and a digest of
its weights after every evaluation, so "one job" is visible: global ranks 0 and 1 of a world of
2, disjoint shares, bit-identical weights, and one writer.
"""

from __future__ import annotations

import json
import sys

from conftest import LAUNCH, flags, free_port, load_ckpt, read_metrics


def check_one_job(records: dict[int, list[dict]], epochs: int) -> None:
    assert sorted(records) == [0, 1]
    evals = {rank: [r for r in rows if r["kind"] == "eval"] for rank, rows in records.items()}
    assert len(evals[0]) == len(evals[1]) == epochs
    for e0, e1 in zip(evals[0], evals[1]):
        assert e0["world_size"] == e1["world_size"] == 2
        assert e0["digest"] == e1["digest"] and e0["correct"] == e1["correct"]
    shares = {rank: [r for r in rows if r["kind"] == "sampler" and r["shuffle"]]
              for rank, rows in records.items()}
    for s0, s1 in zip(shares[0], shares[1]):  # each rank trains on its own half
        assert s0["epoch"] == s1["epoch"] and not set(s0["indices"]) & set(s1["indices"])
        assert sorted(s0["indices"] + s1["indices"]) == list(range(s0["size"]))


def check_written_once(out, epochs: int) -> None:
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    assert [m["epoch"] for m in read_metrics(out)] == list(range(epochs))
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == epochs - 1 and len(ckpt["rng_states"]) == 2  # from both ranks


def test_torchrun_two_nodes_c10d_rendezvous(tiny_data, tmp_path, probe, launched):
    """Two torchrun processes (one per "machine", one rank each, each with its own output
    folder) meet at a c10d rendezvous and train as one job; only global rank 0 writes."""
    port = free_port()
    outs = [tmp_path / f"node{n}" / "out" for n in range(2)]
    nodes = [launched([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                       "--nproc_per_node=1", f"--node_rank={n}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
                       probe.script, LAUNCH, *flags(tiny_data, outs[n], "--epochs", "1")],
                      PROBE_NODE=str(n), **probe.env)
             for n in range(2)]
    codes = [node.wait_exit(240) for node in nodes]
    assert codes == [0, 0], [node.output()[-3000:] for node in nodes]
    records = probe.records()
    check_one_job(records, epochs=1)
    # c10d hands out the global ranks (either machine may get rank 0): rank 0's folder is written.
    writer = int(records[0][-1]["node"])
    assert {records[0][-1]["node"], records[1][-1]["node"]} == {"0", "1"}
    check_written_once(outs[writer], epochs=1)
    assert not (outs[1 - writer] / "checkpoint.pth").exists()


def test_slurm_tasks_train_as_one_job(tiny_data, tmp_path, probe, launched):
    """Two ``srun python train_multi_gpu_using_launch.py`` tasks: ranks, world size and the
    rendezvous address come from SLURM's variables alone (MASTER_ADDR from the node list)."""
    out = tmp_path / "out"  # a shared file system: both tasks are given the same folder
    slurm = dict(SLURM_NTASKS="2", SLURM_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
                 SLURM_JOB_ID="4242", MASTER_PORT=str(free_port()))
    tasks = [launched([sys.executable, probe.script, LAUNCH,
                       *flags(tiny_data, out, "--epochs", "1")],
                      SLURM_PROCID=str(n), SLURM_LOCALID=str(n), PROBE_NODE=str(n),
                      **slurm, **probe.env)
             for n in range(2)]
    codes = [task.wait_exit(240) for task in tasks]
    assert codes == [0, 0], [task.output()[-3000:] for task in tasks]
    records = probe.records()
    check_one_job(records, epochs=1)
    assert [records[r][-1]["node"] for r in (0, 1)] == ["0", "1"]  # SLURM_PROCID is the rank
    check_written_once(out, epochs=1)
