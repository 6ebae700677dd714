"""What users reach for around training: the own-project example (it saves, continues and stops
cleanly; it runs with ``multi_train_utils/`` copied alone), the files docs/own-project.md says to
copy, TensorBoard, and --eval-only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import (ROOT, assert_same_tensors, child_env, clone_run, flags, load_ckpt,
                      make_stopper, ranks, read_metrics, run, torchrun)

EXAMPLE, LAUNCH_PY = "example_own_project.py", "train_multi_gpu_using_launch.py"
EXAMPLE_EPOCHS = ["--device", "cpu", "--epochs", "3"]
STEPS_PER_EPOCH = 32  # 4096 samples, 2 ranks, batch 64
TOP_LEVEL = ("train_multi_gpu_using_launch", "train_multi_gpu_using_spawn", "image_folder",
             "augment", "demo_data", "flags", "run_log", "model", "my_dataset", "predict",
             "plot_results", "device_decode")


def epoch_lines(stdout: str) -> dict[int, float]:
    """The example's epoch lines, e.g. ``epoch 2: train loss 0.1562  val accuracy 0.9750``."""
    return {int(e): float(acc) for e, acc in
            re.findall(r"^epoch (\d+):.*?val accuracy ([\d.]+)", stdout, re.M)}


# ---------------------------------------------------------------- own-project example
@pytest.fixture(scope="module")
def example_run(tmp_path_factory, plain) -> SimpleNamespace:
    """The example under torchrun, 2 processes, 3 epochs, never stopped."""
    out = tmp_path_factory.mktemp("example") / "run"
    res = torchrun(plain, 2, EXAMPLE, *EXAMPLE_EPOCHS, "--output-dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return SimpleNamespace(out=out, stdout=res.stdout)


def test_example_trains_with_torchrun_two_processes_and_saves(example_run):
    accuracies = epoch_lines(example_run.stdout)
    assert list(accuracies) == [0, 1, 2]  # rank 0 alone prints
    assert accuracies[2] > 0.8, accuracies  # chance is 0.25
    ckpt = load_ckpt(example_run.out / "checkpoint.pth")
    assert ckpt["epoch"] == 2 and "in_epoch" not in ckpt
    assert ckpt["model"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}  # no "module."


def test_example_run_again_continues_without_repeating_an_epoch(example_run, tmp_path):
    out = shutil.copytree(example_run.out, tmp_path / "run")
    argv = [sys.executable, EXAMPLE, "--device", "cpu", "--output-dir", str(out)]
    res = run([*argv, "--epochs", "4"])  # one process now: it continues all the same
    assert res.returncode == 0, res.stderr[-3000:]
    assert "continuing at epoch 3, step 0" in res.stdout
    assert list(epoch_lines(res.stdout)) == [3]
    assert load_ckpt(out / "checkpoint.pth")["epoch"] == 3


def test_example_stops_on_sigterm_saves_and_the_rerun_ends_as_if_never_stopped(example_run,
                                                                                tmp_path, plain):
    """SIGTERM to torchrun in epoch 1 (it passes it on to both ranks): the ranks save the step
    they agree on and exit; the same command continues there and ends with the weights and
    momentum of the run that was never stopped, bit for bit."""
    out = tmp_path / "run"
    argv = [EXAMPLE, *EXAMPLE_EPOCHS, "--output-dir", str(out)]
    res = torchrun(plain, 2, make_stopper(tmp_path), *argv, STOP_TARGET="parent",
                   STOP_AFTER=str(STEPS_PER_EPOCH + 8))
    assert res.returncode != 0 and "interrupted by SIGTERM" in res.stderr, res.stderr[-3000:]
    assert list(epoch_lines(res.stdout)) == [0]
    ckpt = load_ckpt(out / "checkpoint.pth")
    step = ckpt["in_epoch"]["batches"]
    assert ckpt["epoch"] == 1 and 8 <= step < STEPS_PER_EPOCH, ckpt["in_epoch"]
    assert re.search(rf"stopping after step {step} of {STEPS_PER_EPOCH}", res.stderr)
    res = ranks(plain, 2, *argv)  # the same command, its ranks forked
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"continuing at epoch 1, step {step}" in res.stdout
    assert list(epoch_lines(res.stdout)) == [1, 2]
    done = load_ckpt(out / "checkpoint.pth")
    reference = load_ckpt(example_run.out / "checkpoint.pth")
    assert done["epoch"] == 2 and "in_epoch" not in done
    assert_same_tensors(done["model"], reference["model"])
    momentum = [[s["momentum_buffer"] for s in c["optimizer"]["state"].values()]
                for c in (done, reference)]
    assert all(torch.equal(a, b) for a, b in zip(*momentum)) and momentum[0]


@pytest.mark.full
def test_multi_train_utils_and_example_work_copied_alone(tmp_path):
    """Copy only multi_train_utils/ (and the example): every module imports, the example trains,
    and nothing of the repository's top-level scripts was needed."""
    shutil.copytree(ROOT / "multi_train_utils", tmp_path / "multi_train_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / EXAMPLE, tmp_path / EXAMPLE)
    modules = sorted(p.stem for p in (tmp_path / "multi_train_utils").glob("*.py"))
    assert {"checkpoint", "distributed_utils", "guard", "train_eval_utils"} <= set(modules)
    out = tmp_path.parent / f"{tmp_path.name}-out"
    check = (f"import importlib, importlib.util, runpy, sys\n"
             f"assert importlib.util.find_spec('image_folder') is None, 'the repo is on sys.path'\n"
             f"for m in {modules!r}: importlib.import_module('multi_train_utils.' + m)\n"
             f"sys.argv = [{EXAMPLE!r}, '--device', 'cpu', '--epochs', '2', "
             f"'--output-dir', {str(out)!r}]\n"
             f"runpy.run_path({EXAMPLE!r}, run_name='__main__')\n"
             f"print('leaked', sorted(set({TOP_LEVEL!r}) & set(sys.modules)))\n")
    res = copied_run(tmp_path, [sys.executable, "-c", check])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "leaked []" in res.stdout
    assert epoch_lines(res.stdout)[1] > 0.6
    assert (out / "checkpoint.pth").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [EXAMPLE, "multi_train_utils"]


def copied_run(folder: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd`` in ``folder``, with this repository on no path."""
    env = child_env()
    env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=180)


def files_to_copy(heading: str) -> list[str]:
    """The code spans of the list item of docs/own-project.md that starts with ``heading``."""
    text = (ROOT / "docs" / "own-project.md").read_text(encoding="utf-8")
    (item,) = re.findall(rf"^- \*\*{re.escape(heading)}.*?(?=^- |^#|\Z)", text, re.M | re.S)
    return [n for n in re.findall(r"`([^`]+)`", item) if n.endswith(("/", ".py"))]


@pytest.mark.full
def test_own_project_names_the_files_to_copy_and_they_suffice(tiny_data, tmp_path):
    """The files docs/own-project.md lists for image classification, copied alone, train a run
    and import the other tools; for any model and data it lists multi_train_utils/ alone."""
    assert files_to_copy("Any model and data") == ["multi_train_utils/"]
    listed = files_to_copy("Image classification")
    assert {"multi_train_utils/", "train_multi_gpu_using_launch.py"} <= set(listed), listed
    for name in listed:
        if name.endswith("/"):
            shutil.copytree(ROOT / name, tmp_path / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, tmp_path / name)
    tools = [n[:-3] for n in listed if n.endswith(".py") and n != LAUNCH_PY]
    out = tmp_path.parent / f"{tmp_path.name}-out"
    argv = [LAUNCH_PY, *flags(tiny_data, out, "--epochs", "1")]
    check = (f"import runpy, sys\n"
             f"for m in {tools!r}: __import__(m)\n"
             f"sys.argv = {argv!r}\n"
             f"runpy.run_path({LAUNCH_PY!r}, run_name='__main__')\n")
    res = copied_run(tmp_path, [sys.executable, "-c", check])
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(read_metrics(out)) == 1


# ---------------------------------------------------------------- TensorBoard
def tensorboard(logdir: Path) -> dict[str, dict]:
    """{"scalars": {tag: [(step, value)]}, "images": {tag: count}} over every event folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {"scalars": {}, "images": {}}
    for folder in sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found["scalars"][f"{folder.name}/{tag}"] = [(e.step, e.value)
                                                       for e in acc.Scalars(tag)]
        for tag in acc.Tags()["images"]:
            found["images"][f"{folder.name}/{tag}"] = len(acc.Images(tag))
    return found


@pytest.fixture(scope="module")
def tb_run(tiny_data, tmp_path_factory, plain) -> Path:
    out = tmp_path_factory.mktemp("tb") / "run"
    res = plain(flags(tiny_data, out, "--epochs", "1", "--tensorboard"))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_tensorboard_logs_scalars_and_images(tb_run):
    logged = tensorboard(tb_run / "tensorboard")
    (record,) = read_metrics(tb_run)
    scalars = logged["scalars"]
    assert any("loss" in tag for tag in scalars), scalars.keys()
    # the accuracy curve holds the number metrics.jsonl recorded for the epoch
    accuracy = [v for tag, v in scalars.items() if "acc" in tag and "5" not in tag]
    assert accuracy and all(v[0][0] == 0 for v in accuracy), scalars
    assert any(v[0][1] == pytest.approx(record["val_acc"], abs=1e-6) for v in accuracy), scalars
    images = logged["images"]
    assert any("train_images" in tag for tag in images), images


def test_a_resumed_run_continues_every_tensorboard_curve(tb_run, tiny_data, tmp_path, plain):
    out = clone_run(tb_run, tmp_path / "run", full=True)
    before = tensorboard(out / "tensorboard")["scalars"]
    res = plain(flags(tiny_data, out, "--epochs", "2", "--tensorboard"))
    assert res.returncode == 0, res.stderr[-3000:]
    after = tensorboard(out / "tensorboard")["scalars"]
    assert before and before.keys() <= after.keys()
    for tag, points in before.items():
        steps = [s for s, _ in after[tag]]
        assert after[tag][:len(points)] == points, tag  # epoch 0's points kept as they were
        assert len(steps) > len(points) and steps == sorted(set(steps)), (tag, steps)


# ---------------------------------------------------------------- --eval-only
def test_eval_only_reports_accuracy_and_writes_nothing(reference_run, tiny_data, tmp_path, plain):
    source = reference_run.out
    files = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in source.rglob("*")}
    res = plain(flags(tiny_data, tmp_path / "eval", "--eval-only", "--resume",
                      str(source / "checkpoint.pth")))
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    (top1,) = re.findall(r"top-1 accuracy: ([\d.]+)(%?)", text)
    value = float(top1[0]) / (100 if top1[1] else 1)
    # the checkpoint's weights on the same validation split: the number its last epoch recorded
    assert value == pytest.approx(read_metrics(source)[-1]["val_acc"], abs=1e-4)
    for name in json.loads((source / "class_indices.json").read_text()).values():
        assert re.search(rf"^.*\b{name}\b.*\d", text, re.M), f"no accuracy line for {name}"
    assert "[epoch" not in text  # nothing trained
    assert not (tmp_path / "eval").exists()
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in source.rglob("*")} == files
