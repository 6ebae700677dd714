"""What users reach for around training: the own-project example (run as the README shows it,
and with ``multi_train_utils/`` copied alone), TensorBoard, and --eval-only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env, clone_run, flags, read_metrics, run, torchrun_cmd

EXAMPLE = "example_own_project.py"
TOP_LEVEL = ("train_multi_gpu_using_launch", "train_multi_gpu_using_spawn", "utils", "model",
             "my_dataset", "predict", "plot_results")


def val_accuracies(stdout: str) -> list[float]:
    """The example's epoch lines, e.g. ``epoch 2: train loss 0.1562  val accuracy 0.9750``."""
    found = re.findall(r"^epoch (\d+):.*?val accuracy ([\d.]+)", stdout, re.M)
    assert [int(e) for e, _ in found] == list(range(len(found))), stdout[-2000:]
    return [float(acc) for _, acc in found]


# ---------------------------------------------------------------- own-project example
def test_example_trains_with_torchrun_two_processes():
    res = run(torchrun_cmd(2, EXAMPLE, "--device", "cpu", "--epochs", "3"), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    accuracies = val_accuracies(res.stdout)
    assert len(accuracies) == 3  # rank 0 alone prints
    assert accuracies[-1] > 0.8, accuracies  # chance is 0.25


def test_readme_shows_the_example_verbatim():
    """The README's own-project code is this tested file, so it cannot drift from working code."""
    example = (ROOT / EXAMPLE).read_text()
    assert "```python\n" + example + "```" in (ROOT / "README.md").read_text()


def test_multi_train_utils_and_example_work_copied_alone(tmp_path):
    """Copy only multi_train_utils/ (and the example): every module imports, the example trains,
    and nothing of the repository's top-level scripts was needed."""
    shutil.copytree(ROOT / "multi_train_utils", tmp_path / "multi_train_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / EXAMPLE, tmp_path / EXAMPLE)
    modules = sorted(p.stem for p in (tmp_path / "multi_train_utils").glob("*.py"))
    assert {"checkpoint", "distributed_utils", "guard", "train_eval_utils"} <= set(modules)
    check = (f"import importlib, importlib.util, runpy, sys\n"
             f"assert importlib.util.find_spec('utils') is None, 'the repo is on sys.path'\n"
             f"for m in {modules!r}: importlib.import_module('multi_train_utils.' + m)\n"
             f"sys.argv = [{EXAMPLE!r}, '--device', 'cpu', '--epochs', '2']\n"
             f"runpy.run_path({EXAMPLE!r}, run_name='__main__')\n"
             f"print('leaked', sorted(set({TOP_LEVEL!r}) & set(sys.modules)))\n")
    env = child_env()
    env.pop("PYTHONPATH", None)
    res = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "leaked []" in res.stdout
    assert val_accuracies(res.stdout)[-1] > 0.6
    assert sorted(p.name for p in tmp_path.iterdir()) == [EXAMPLE, "multi_train_utils"]


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


def test_tensorboard_logs_scalars_images_and_a_confusion_matrix(tb_run):
    logged = tensorboard(tb_run / "tensorboard")
    (record,) = read_metrics(tb_run)
    scalars = logged["scalars"]
    assert any("loss" in tag for tag in scalars), scalars.keys()
    # the accuracy curve holds the number metrics.jsonl recorded for the epoch
    accuracy = [v for tag, v in scalars.items() if "acc" in tag and "5" not in tag]
    assert accuracy and all(v[0][0] == 0 for v in accuracy), scalars
    assert any(v[0][1] == pytest.approx(record["val_acc"], abs=1e-6) for v in accuracy), scalars
    images = logged["images"]
    assert any("confusion" in tag for tag in images), images
    assert any("confusion" not in tag for tag in images), images  # the training images too


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
