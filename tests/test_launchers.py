"""End to end: both launchers train on tiny data with 2 gloo processes and leave usable files."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS, run, torchrun_cmd
from model import get_model
from multi_train_utils.distributed_utils import DistInfo, find_free_port
from multi_train_utils.sync_batchnorm import SyncBatchNormCPU
from train_common import _build_model, get_args_parser
from utils import make_demo_data


def check_run_dir(out: Path, epochs: int, world_size: int) -> None:
    """Metrics per epoch, loadable weights without 'module.', args and class indices."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(epochs))
    for r in lines:
        assert set(r) >= {"epoch", "train_loss", "val_acc", "lr", "epoch_seconds",
                          "train_images_per_sec"}
        assert 0.0 <= r["val_acc"] <= 1.0 and r["train_loss"] > 0 and r["epoch_seconds"] > 0
    recorded = json.loads((out / "args.json").read_text())
    assert recorded["world_size"] == world_size
    assert recorded["amp_dtype"] == ("bfloat16" if recorded["amp"] else None)
    classes = json.loads((out / "class_indices.json").read_text())
    assert classes == {"0": "daisy", "1": "dandelion", "2": "roses", "3": "sunflowers",
                       "4": "tulips"}
    for epoch in range(epochs):
        state = torch.load(out / "weights" / f"model-{epoch}.pth", map_location="cpu",
                           weights_only=True)
        assert not any(k.startswith("module.") for k in state)
        get_model("resnet18", num_classes=5).load_state_dict(state, strict=True)
    ckpt = torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == epochs - 1 and ckpt["args"]["world_size"] == world_size


def test_torchrun_two_processes(tiny_data, tmp_path):
    out = tmp_path / "run"
    res = run(torchrun_cmd(2, "train_multi_gpu_using_launch.py", "--data-path", str(tiny_data),
                           *TINY_FLAGS, "--epochs", "2", "--output-dir", str(out)))
    assert res.returncode == 0, res.stderr[-3000:]
    check_run_dir(out, epochs=2, world_size=2)
    # Rank 0 alone logs: one summary line per epoch in the combined output.
    assert (res.stderr + res.stdout).count("[epoch 1] train loss") == 1
    # What the launcher and the flags resolved to, said once: device, backend, global batch, lr.
    assert (res.stderr + res.stdout).count(
        "training resnet18 at 32 px, epochs 0-1: 2 process(es) on cpu with gloo; batch 4 per "
        "process, 8 per optimizer step; lr 0.002 (--lr 0.001 x 2 processes)\n") == 1


def test_legacy_launch_use_env(tiny_data, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--use_env", "--nproc_per_node=2",
           f"--master_port={find_free_port()}", "train_multi_gpu_using_launch.py",
           "--data-path", str(tiny_data), *TINY_FLAGS, "--epochs", "1", "--output-dir", str(out),
           "--comm-hook", "bf16", "--world-size", "2"]  # the classic command line's flag
    res = run(cmd)
    assert res.returncode == 0, res.stderr[-3000:]
    check_run_dir(out, epochs=1, world_size=2)
    # Gradient compression reaches DDP (its numerics: test_distributed_correctness).
    assert (res.stderr + res.stdout).count("DDP all-reduces gradients in bf16") == 1


def test_spawn_two_cpu_processes(tiny_data, tmp_path):
    out = tmp_path / "run"
    res = run([sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", "2",
               "--data-path", str(tiny_data), *TINY_FLAGS, "--epochs", "2", "--output-dir", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    check_run_dir(out, epochs=2, world_size=2)
    assert ":12355" not in res.stderr  # the port is picked, not fixed


@pytest.mark.parametrize("case", ["busy-dist-url", "busy-master-port", "bad-dist-url",
                                  "bad-master-port", "node-rank", "cuda-hidden"])
def test_spawn_usage_errors_are_one_line_before_any_process_starts(case, monkeypatch, caplog):
    import train_multi_gpu_using_spawn as spawn

    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(spawn.mp, "start_processes", _must_not_start)
    argv = ["--device", "cpu", "--world-size", "2"]
    busy = socket.socket()  # another job's store listening on the port
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    if case == "busy-dist-url":
        argv += ["--dist-url", f"tcp://127.0.0.1:{port}"]
        message = f"port {port} is not free on this machine (Address already in use)"
    elif case == "busy-master-port":
        monkeypatch.setenv("MASTER_PORT", str(port))
        message = f"port {port} is not free on this machine"
    elif case == "bad-dist-url":
        argv += ["--dist-url", "tcp://127.0.0.1"]
        message = "--dist-url 'tcp://127.0.0.1' is not 'env://' or 'tcp://HOST:PORT'"
    elif case == "bad-master-port":
        monkeypatch.setenv("MASTER_PORT", "auto")
        message = "MASTER_PORT='auto' is not a port number; unset it to use a free one."
    elif case == "node-rank":
        argv += ["--nnodes", "2", "--node-rank", "2", "--dist-url", "tcp://10.0.0.1:29500"]
        message = "--node-rank 2 but --nnodes 2: node ranks run from 0 to 1."
    else:  # no GPU visible (as in CI, or CUDA_VISIBLE_DEVICES="" on a GPU machine)
        monkeypatch.setattr(spawn.torch.cuda, "is_available", lambda: False)
        argv = ["--device", "cuda"]
        message = "--device cuda was asked for, but CUDA is not available here; use --device cpu"
    try:
        with pytest.raises(SystemExit) as exit_info:
            spawn.main(spawn.get_args_parser().parse_args(argv))
    finally:
        busy.close()
    assert exit_info.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors


def _must_not_start(*args, **kwargs):
    raise AssertionError("a process was started despite the usage error")


def test_plain_python_single_process(tmp_path):
    out = tmp_path / "run"
    # 4 images a class, not tiny_data's 12: emulated bf16 trains at ~2 img/s on CI's CPUs.
    data = make_demo_data(tmp_path / "flowers", per_class=4, size=32)
    res = run([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(data),
               *TINY_FLAGS, "--epochs", "1", "--output-dir", str(out), "--comm-hook", "bf16",
               "--amp"])
    assert res.returncode == 0, res.stderr[-3000:]
    check_run_dir(out, epochs=1, world_size=1)
    # A flag that cannot act here says so instead of being silently ignored.
    assert "--comm-hook bf16 does nothing in a single process" in res.stderr
    assert ("training resnet18 at 32 px, epochs 0-0: 1 process(es) on cpu, bfloat16 autocast; "
            "batch 4 per process; lr 0.001\n") in res.stderr
    # args.json records what --amp (default: on for CUDA only) became, for plot_results' labels
    assert json.loads((out / "args.json").read_text())["amp_dtype"] == "bfloat16"
    # Emulated bf16 (an AVX2 CPU, as CI's) trained at 2 img/s against 39 in float32: said once.
    warned = "--amp on this CPU: it has no native bfloat16 (AVX512-BF16 or AMX)"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert res.stderr.count(warned) == (0 if native else 1), res.stderr[-3000:]


@pytest.mark.parametrize("argv, expected", [
    ([], True), (["--syncBN"], True), (["--no-syncBN"], False), (["--no-sync-bn"], False),
    (["--syncBN", "False"], False), (["--syncBN", "True"], True),
])
def test_sync_bn_flag_parses(argv, expected):
    assert get_args_parser().parse_args(argv).sync_bn is expected


def test_sync_bn_flag_rejects_nonsense(capsys):
    with pytest.raises(SystemExit) as exc:
        get_args_parser().parse_args(["--syncBN", "maybe"])
    assert exc.value.code == 2
    assert "true/false" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch_size: must be a whole number of at least 1, not 0"),
    (["--lr", "nan"], "--lr: must be greater than 0, not nan"),
    (["--workers", "-1"], "--workers: must be a whole number of at least 0, not -1"),
    (["--val-rate", "1.5"], "--val-rate: must be above 0 and at most 1 (1 scores every image, "
                            "with --eval-only), not 1.5"),
    (["--val-rate", "0"], "--val-rate: must be above 0 and at most 1"),
    (["--val-rate", "-0.1"], "--val-rate: must be above 0 and at most 1"),
    (["--val-rate", "a"], "--val-rate: invalid float value: 'a'"),
    (["--seed", "-1"], "--seed: must be a whole number from 0 to 2**32 - 1 (numpy's seed range), "
                       "not -1"),
    (["--seed", str(2**32)], "--seed: must be a whole number from 0 to 2**32 - 1"),
])
def test_bad_numbers_are_usage_errors_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        get_args_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_largest_seed_works_on_every_rank():
    # seed + rank would pass numpy's 2**32 - 1 on rank 1; it wraps around to 0 instead.
    import numpy as np
    import train_common

    train_common._seed_everything(2**32 - 1, rank=1)
    drawn = np.random.rand(), torch.rand(1).item()
    train_common._seed_everything(0, rank=0)
    assert drawn == (np.random.rand(), torch.rand(1).item())


@pytest.mark.parametrize("flag, sync_layers", [("--syncBN", 20), ("--no-syncBN", 0)])
def test_sync_bn_really_switches(flag, sync_layers):
    args = get_args_parser().parse_args(["--model", "resnet18", flag])
    model = _build_model(args, DistInfo(world_size=2), [f"c{i}" for i in range(5)])
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(SyncBatchNormCPU) == sync_layers
    assert (torch.nn.BatchNorm2d in kinds) == (sync_layers == 0)


def test_template_aliases_parse():
    args = get_args_parser().parse_args(["--num_classes", "5", "--batch_size", "8",
                                         "--freeze_layers", "True", "--data_path", "x"])
    assert (args.num_classes, args.batch_size, args.freeze_layers, args.data_path) == (5, 8, True, "x")


def test_freeze_layers_trains_only_fc():
    args = get_args_parser().parse_args(["--model", "resnet18", "--freeze-layers"])
    model = _build_model(args, DistInfo(), [f"c{i}" for i in range(5)])
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


AGAIN = "run the same command again: it continues from "
RESUME_AUTO = ("run the same command with --resume auto in place of --resume {flag} to continue "
               "from the last complete checkpoint in {out} (the same command would {would})")


@pytest.mark.parametrize("resume, saved, want", [
    ("auto", "by this run", AGAIN + "the last complete checkpoint in {out}"),
    ("auto", "before it", AGAIN + "the last complete checkpoint in {out}"),
    ("auto", None, AGAIN + "the start"),
    ("{out}/checkpoint.pth", "by this run", AGAIN + "the last complete checkpoint in {out}"),
    ("none", None, "run the same command again: it starts over"),
    # an earlier run's, not yet set aside (the run stopped while scanning its data)
    ("none", "before it", "run the same command again: it starts over"),
    ("none", "by this run", RESUME_AUTO.format(flag="none", out="{out}", would="start over")),
    ("/elsewhere/model_best.pth", None, "run the same command again: it starts from "
                                        "/elsewhere/model_best.pth again"),
    ("/elsewhere/model_best.pth", "by this run", RESUME_AUTO.format(
        flag="/elsewhere/model_best.pth", out="{out}", would="go back to that file")),
])
def test_failure_messages_say_what_a_rerun_does(tmp_path, resume, saved, want):
    """The spawn launcher promised a resume from checkpoint.pth when no epoch had been saved,
    and the ranks promised one under --resume none, whose rerun starts over."""
    import train_multi_gpu_using_spawn as spawn
    from train_common import rerun_hint

    out = tmp_path / "run"
    out.mkdir()
    started = time.time()
    if saved:
        (out / "checkpoint.pth").write_bytes(b"x")
        if saved == "before it":
            os.utime(out / "checkpoint.pth", (started - 60, started - 60))
    args = spawn.get_args_parser().parse_args(["--output-dir", str(out),
                                               "--resume", resume.format(out=out)])
    assert rerun_hint(args, started) == want.format(out=out)
