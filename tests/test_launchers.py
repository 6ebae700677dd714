"""Both launchers run the same recipe: torchrun, the legacy ``torch.distributed.launch --use_env``,
the spawn launcher and plain python. What each leaves on disk, what DDP trained with (SyncBN,
each rank's share, exact evaluation), how flags parse, and how a user's mistake is said.
"""

from __future__ import annotations

import json
import math
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from conftest import (LAUNCH, LEGACY, ROOT, SPAWN, SPAWNED, TORCHRUN, assert_user_error,
                      error_lines, flags, free_port, load_ckpt, make_probe, read_metrics)
from my_dataset import default_workers
from demo_data import make_demo_data

CLASSES = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]


def cosine(epoch: int, epochs: int, lrf: float = 0.1) -> float:
    return (1 + math.cos(epoch * math.pi / epochs)) / 2 * (1 - lrf) + lrf


def check_run_folder(out: Path, epochs: int, world_size: int) -> None:
    """A metrics line per epoch, the flags and classes, the checkpoint of the last epoch."""
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == list(range(epochs))
    for m in metrics:
        assert {"epoch", "train_loss", "val_acc", "val_loss", "lr", "epoch_seconds",
                "train_images_per_sec"} <= m.keys()
        assert 0 <= m["val_acc"] <= 1 and m["train_loss"] > 0 and m["epoch_seconds"] > 0
    assert json.loads((out / "args.json").read_text())["world_size"] == world_size
    assert json.loads((out / "class_indices.json").read_text()) == {
        str(i): c for i, c in enumerate(CLASSES)}
    ckpt = load_ckpt(out / "checkpoint.pth")
    assert ckpt["epoch"] == epochs - 1 and ckpt["args"]["world_size"] == world_size
    assert sorted(p.name for p in (out / "weights").iterdir()) == [
        f"model-{e}.pth" for e in range(epochs)]


# ---------------------------------------------------------------- the four ways to start
@pytest.mark.fast
def test_torchrun_two_processes(reference_run):
    check_run_folder(reference_run.out, reference_run.epochs, world_size=2)
    # lr = --lr x 2 processes (linear scaling), on a cosine over the 3 epochs.
    lrs = [m["lr"] for m in read_metrics(reference_run.out)]
    assert lrs == pytest.approx([0.002 * cosine(e, 3) for e in range(3)], rel=1e-9)


@pytest.mark.fast
def test_weights_are_bare_and_load_strictly_into_torchvision_resnet18(reference_run):
    out = reference_run.out
    final = load_ckpt(out / "checkpoint.pth")["model"]
    for epoch in range(reference_run.epochs):
        state = load_ckpt(out / "weights" / f"model-{epoch}.pth")
        assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
        torchvision.models.resnet18(num_classes=5).load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], final[k]) for k in final)  # the last one is the final model
    first = load_ckpt(out / "weights" / "model-0.pth")
    assert not torch.equal(first["fc.weight"], final["fc.weight"])  # it trained


@pytest.fixture(scope="module")
def legacy_run(tiny_data, tmp_path_factory, plain):
    """``python -m torch.distributed.launch --use_env``, the classic command line's flags
    (``--syncBN False``, ``--world-size 2``), recorded by the probe."""
    tmp = tmp_path_factory.mktemp("legacy")
    probe, out = make_probe(tmp), tmp / "run"
    res = plain(["--use_env", "--nproc_per_node=2", f"--master_port={free_port()}", probe.script,
                 LAUNCH, *flags(tiny_data, out, "--epochs", "1", "--syncBN", "False",
                                "--world-size", "2", "--find-unused-parameters")],
                patch=LEGACY, **probe.env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return out, probe.records()


def test_legacy_launch_use_env(legacy_run):
    out, _ = legacy_run
    check_run_folder(out, epochs=1, world_size=2)


def test_syncBN_False_trains_with_plain_batchnorm(legacy_run):
    _, records = legacy_run
    ddp = [r for rank in (0, 1) for r in records[rank] if r["kind"] == "ddp"]
    assert [(r["rank"], r["norms"]) for r in ddp] == [(0, ["BatchNorm2d"]), (1, ["BatchNorm2d"])]
    assert [r["find_unused"] for r in ddp] == [True, True]  # --find-unused-parameters reached DDP


def test_spawn_launcher_two_cpu_processes(tiny_data, tmp_path, plain):
    out = tmp_path / "run"
    res = plain(["--world-size", "2", *flags(tiny_data, out, "--epochs", "1", "--num_classes",
                                              "5")], patch=SPAWNED)  # as the folders
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    check_run_folder(out, epochs=1, world_size=2)


def test_plain_python_one_process(tiny_data, tmp_path, plain):
    out = tmp_path / "run"
    args = flags(tiny_data, out, "--epochs", "1")
    del args[args.index("--workers"):args.index("--workers") + 2]  # the default
    res = plain(args)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    check_run_folder(out, epochs=1, world_size=1)
    assert read_metrics(out)[0]["lr"] == pytest.approx(0.001)  # one process: --lr as given
    # The start-up line says the worker count the default resolved to (TINY_FLAGS' batch 4).
    assert f"{default_workers(4, torch.device('cpu'))} loader workers" in res.stdout + res.stderr


# ---------------------------------------------------------------- what DDP trained with
@pytest.fixture(scope="module")
def messy(tiny_data, tmp_path_factory) -> Path:
    """tiny_data plus files a real folder has: a corrupt and an empty JPEG, a text file, a hidden
    file and a file beside the class folders."""
    root = tmp_path_factory.mktemp("messy") / "flowers"
    shutil.copytree(tiny_data, root)
    (root / "daisy" / "corrupt.jpg").write_bytes(bytes(range(256)) * 8)
    (root / "roses" / "empty.jpg").write_bytes(b"")
    (root / "tulips" / "notes.txt").write_text("picked in May\n")
    (root / "tulips" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "README.txt").write_text("flowers\n")
    return root


MESSY = {"corrupt.jpg", "empty.jpg", "notes.txt", ".DS_Store", "README.txt"}
VAL_IMAGES = 15  # odd: 2 ranks pad it to 16, and the padded duplicate must not be scored


@pytest.fixture(scope="module")
def probed_run(messy, tmp_path_factory, plain):
    """torchrun, 2 processes, 2 epochs on the messy folder, validated on a separate folder of 15
    images, recorded by the probe."""
    tmp = tmp_path_factory.mktemp("probed")
    probe, out = make_probe(tmp), tmp / "run"
    val = make_demo_data(tmp / "val", per_class=VAL_IMAGES // 5, size=32)
    res = plain(["--standalone", "--nproc_per_node=2", probe.script, LAUNCH,
                 *flags(messy, out, "--epochs", "2", "--val-path", str(val))],
                patch=TORCHRUN, **probe.env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return out, val, probe.records()


@pytest.mark.fast
def test_torchrun_trains_through_a_messy_folder_and_lists_what_it_skipped(probed_run):
    out, _, _ = probed_run
    check_run_folder(out, epochs=2, world_size=2)
    listed = (out / "skipped_files.txt").read_text(encoding="utf-8").splitlines()
    assert all("\t" in line for line in listed)  # path<TAB>reason
    assert sorted(Path(line.split("\t")[0]).name for line in listed) == sorted(MESSY)


@pytest.mark.fast
def test_cpu_syncbatchnorm_is_on_in_a_two_process_run(probed_run):
    _, _, records = probed_run
    for rank in (0, 1):
        (ddp,) = [r for r in records[rank] if r["kind"] == "ddp"]
        assert ddp["world_size"] == 2 and ddp["norms"], ddp
        assert all("Sync" in name for name in ddp["norms"]), ddp["norms"]


@pytest.mark.fast
def test_each_rank_trains_on_its_own_share(probed_run):
    _, _, records = probed_run
    shares = {}
    for rank in (0, 1):
        for r in records[rank]:
            if r["kind"] == "sampler" and r["shuffle"]:
                assert (rank, r["epoch"]) not in shares, "the training sampler ran twice"
                assert r["sampler_rank"] == rank
                shares[rank, r["epoch"]] = r
    assert sorted(shares) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for epoch in (0, 1):
        a, b = shares[0, epoch], shares[1, epoch]
        size = a["size"]
        # 60 images and the 2 unreadable JPEGs, left to the loader (it replaces them)
        assert size == 62 and len(a["indices"]) == len(b["indices"]) == size // 2
        assert sorted(a["indices"] + b["indices"]) == list(range(size))  # disjoint, complete
    # set_epoch: each epoch is another permutation
    assert shares[0, 0]["indices"] != shares[0, 1]["indices"]


@pytest.mark.fast
def test_evaluation_scores_each_val_image_exactly_once(probed_run):
    out, _, records = probed_run
    evals = {rank: [r for r in records[rank] if r["kind"] == "eval"] for rank in (0, 1)}
    assert len(evals[0]) == len(evals[1]) == 2
    for e0, e1 in zip(evals[0], evals[1]):
        for e in (e0, e1):
            assert e["num_samples"] == e["counted"] == VAL_IMAGES, e  # not 16
            assert e["top1"] == pytest.approx(e["correct"] / VAL_IMAGES)
        assert (e0["correct"], e0["top1"]) == (e1["correct"], e1["top1"])  # reduced: same
        assert e0["digest"] == e1["digest"]  # DDP kept the replicas identical
    assert [m["val_acc"] for m in read_metrics(out)] == pytest.approx(
        [e["correct"] / VAL_IMAGES for e in evals[0]], abs=1e-6)


@pytest.mark.fast
def test_two_process_evaluation_equals_one_process(probed_run, messy, plain, tmp_path):
    out, val, _ = probed_run
    res = plain(flags(messy, tmp_path / "eval", "--eval-only", "--val-path", str(val),
                      "--weights", str(out / "weights" / "model-1.pth")))
    assert res.returncode == 0, res.stderr[-3000:]
    (top1,) = re.findall(r"top-1 accuracy: ([\d.]+)(%?)", res.stdout + res.stderr)
    value = float(top1[0]) / (100 if top1[1] else 1)
    assert value == pytest.approx(read_metrics(out)[-1]["val_acc"], abs=1e-4)
    assert not (tmp_path / "eval").exists()


# ---------------------------------------------------------------- flags
def parser():
    import train_multi_gpu_using_launch

    return train_multi_gpu_using_launch.get_args_parser()


@pytest.mark.parametrize("argv, expected", [
    ([], True), (["--syncBN"], True), (["--no-syncBN"], False), (["--no-sync-bn"], False),
    (["--syncBN", "False"], False), (["--syncBN", "True"], True),
])
def test_syncBN_flag_parses(argv, expected):
    assert parser().parse_args(argv).sync_bn is expected


def test_template_aliases_parse():
    args = parser().parse_args(["--num_classes", "5", "--batch_size", "8", "--freeze_layers",
                                "True", "--data_path", "x", "--dist_url", "env://",
                                "--world_size", "2", "--local_rank", "1"])
    assert (args.num_classes, args.batch_size, args.freeze_layers, args.data_path,
            args.dist_url, args.world_size) == (5, 8, True, "x", "env://", 2)


@pytest.mark.parametrize("argv, flag", [
    (["--batch-size", "0"], "--batch-size"), (["--lr", "nan"], "--lr"),
    (["--workers", "-1"], "--workers"), (["--epochs", "two"], "--epochs"),
    (["--val-rate", "-0.1"], "--val-rate"), (["--seed", "-1"], "--seed"),
    (["--syncBN", "maybe"], "--syncBN"),
])
def test_bad_numbers_are_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and flag in err.splitlines()[-1], err


@pytest.mark.parametrize("script, expected, absent", [
    (LAUNCH, ["--syncBN", "--freeze-layers", "--resume"], []),
    (SPAWN, ["--world-size"], ["--nnodes", "--node-rank"]),  # several machines: torchrun
])
def test_help_shows_groups_and_defaults(script, expected, absent, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps by terminal width
    assert text.startswith("usage: ")
    for item in ["data:", "model:", "optimisation:", "distributed:", "run:", "(default: 30)",
                 "(default: the run's, or resnet34)", "(default: env://)", *expected]:
        assert item in text, f"{script} --help lacks {item!r}"
    for item in absent:
        assert item not in text


# ---------------------------------------------------------------- a user's mistakes
def _text_file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("not a checkpoint\n")
    return tmp / "notes.txt"


def _a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("")
    return tmp / "file"


USER_ERRORS = {  # case: (extra flags, what the line must name)
    "missing data path": (lambda t: ["--data-path", str(t / "nope")], lambda t: str(t / "nope")),
    "output dir under a file": (lambda t: ["--output-dir", str(_a_file(t) / "out")],
                                lambda t: str(t / "file")),
    "freeze-layers without weights": (lambda t: ["--freeze-layers"], lambda t: "--weights"),
    "eval-only without a model": (lambda t: ["--eval-only"], lambda t: "--weights"),
    "resume from a text file": (lambda t: ["--resume", str(_text_file(t))],
                                lambda t: str(t / "notes.txt")),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_a_user_error_is_one_line_and_exit_2(case, tiny_data, tmp_path, plain):
    extra, needle = USER_ERRORS[case]
    out = tmp_path / "out"
    res = plain([*flags(tiny_data, out, "--epochs", "1"), *extra(tmp_path)])
    assert_user_error(res, needle(tmp_path))
    assert not (out / "checkpoint.pth").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--device", "cuda"], "--device cuda"),
    (["--dist-url", "tcp://host"], "tcp://HOST:PORT"),
])
def test_the_spawn_launchers_own_checks_are_one_line_and_exit_2(extra, needle, tiny_data,
                                                                 tmp_path, plain):
    # No GPU visible, on a GPU machine too: there --device cuda is the mistake tested.
    res = plain([*flags(tiny_data, tmp_path / "out", "--epochs", "1"), *extra], patch=SPAWNED,
                timeout=120, CUDA_VISIBLE_DEVICES="")
    assert_user_error(res, needle)
    assert not (tmp_path / "out").exists()  # stopped before it started any process


@pytest.mark.parametrize("mistake", ["missing data path", "--num_classes 7 for 5 folders"])
def test_a_user_error_under_torchrun_stops_every_rank(mistake, tiny_data, tmp_path, plain):
    data, extra, needle = tiny_data, ["--num_classes", "7"], "--num-classes 7, but"
    if mistake == "missing data path":
        data, extra, needle = tmp_path / "nope", [], str(tmp_path / "nope")
    res = plain(["--standalone", "--nproc_per_node=2", LAUNCH,
                 *flags(data, tmp_path / "out", "--epochs", "1", *extra)], patch=TORCHRUN,
                timeout=120)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    lines = error_lines(text)
    assert len(lines) == 1 and needle in lines[0], text[-3000:]  # said once, by rank 0
    assert "exitcode  : 2" in text, text[-3000:]  # torchrun reports the ranks' own exit code
    assert f'{LAUNCH}", line' not in text, text[-3000:]  # no rank's traceback
    assert not (tmp_path / "out" / "checkpoint.pth").exists()


def test_num_classes_that_disagree_with_the_folders_stop_the_spawn_launcher(tiny_data, tmp_path,
                                                                           plain):
    res = plain(["--world-size", "2",
                 *flags(tiny_data, tmp_path / "out", "--epochs", "1", "--num-classes", "7")],
                patch=SPAWNED, timeout=120)
    line = assert_user_error(res, "--num-classes 7, but", str(tiny_data), "5 classes")
    assert line.startswith("error: ")  # rank 0's line only; the launcher adds none
    assert not (tmp_path / "out" / "checkpoint.pth").exists()
