"""What users reach for around training: the own-project example, plots, TensorBoard, eval-only, --help.

The example must train any model with ``multi_train_utils/`` alone, so it is also run from a
folder holding nothing but a copy of that package.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from conftest import ROOT, TINY_FLAGS, child_env, run, torchrun_cmd
from utils import plot_data_loader_image, read_split_data

EXAMPLE = "example_own_project.py"
EPOCH_LINE = re.compile(r"epoch (\d+): train loss ([\d.]+)  val accuracy ([\d.]+) \((\d+)/(\d+)\)")
TOP_LEVEL = ("train_common", "train_multi_gpu_using_launch", "train_multi_gpu_using_spawn",
             "utils", "model", "my_dataset", "predict", "plot_results")


def _epoch_lines(stdout: str) -> list[tuple[int, float, float, int, int]]:
    return [(int(e), float(loss), float(acc), int(c), int(n))
            for e, loss, acc, c, n in EPOCH_LINE.findall(stdout)]


def _check_learned(lines: list[tuple[int, float, float, int, int]], epochs: int) -> None:
    # One line per epoch (printed by rank 0 only), exact val count, far above chance (0.25).
    assert [line[0] for line in lines] == list(range(epochs))
    assert all(n == 1000 and c / n == pytest.approx(acc, abs=1e-4) for _, _, acc, c, n in lines)
    assert lines[-1][1] < lines[0][1], "training loss did not fall"
    assert lines[-1][2] > 0.8, f"final val accuracy {lines[-1][2]} barely above chance"


# ---------------------------------------------------------------- own-project example
def test_example_trains_with_torchrun_two_processes():
    res = run(torchrun_cmd(2, EXAMPLE, "--device", "cpu", "--epochs", "3"), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_learned(_epoch_lines(res.stdout), epochs=3)
    # stdout is a pipe here, as under SLURM: progress comes as log lines, rank 0's only
    # (4096 samples / 2 ranks / batch 64 = 32 steps, a line every 50 and at the last).
    assert re.findall(r"\[train epoch (\d)\] step 32/32 ", res.stderr) == ["0", "1", "2"]


def test_multi_train_utils_and_example_work_copied_alone(tmp_path):
    """Copy only multi_train_utils/ (+ the example): every module imports, the example trains."""
    shutil.copytree(ROOT / "multi_train_utils", tmp_path / "multi_train_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / EXAMPLE, tmp_path / EXAMPLE)
    modules = sorted(p.stem for p in (tmp_path / "multi_train_utils").glob("*.py"))
    assert len(modules) >= 5  # __init__, checkpoint, distributed_utils, sync_batchnorm, ...
    # One interpreter (each costs seconds here): import every module, then run the example as
    # `python example_own_project.py` would, then list what got imported.
    check = (f"import importlib, importlib.util, runpy, sys\n"
             f"assert importlib.util.find_spec('train_common') is None, 'the repo is on sys.path'\n"
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
    _check_learned(_epoch_lines(res.stdout), epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [EXAMPLE, "multi_train_utils"]


# ---------------------------------------------------------------- utils plots
def test_plot_data_loader_image_saves_same_picture_for_uint8_and_normalised(tmp_path, monkeypatch):
    import matplotlib

    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "class_indices.json").write_text(json.dumps({"0": "red", "1": "blue"}))
    images = torch.zeros(4, 3, 16, 16, dtype=torch.uint8)
    images[0::2, 0] = 230  # red
    images[1::2, 2] = 200  # blue
    labels = torch.tensor([0, 1, 0, 1])
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    normalised = (images.float() / 255 - mean) / std

    raw = plot_data_loader_image(DataLoader(TensorDataset(images, labels), batch_size=4),
                                 save_path=tmp_path / "raw.png")
    norm = plot_data_loader_image(DataLoader(TensorDataset(normalised, labels), batch_size=4),
                                  save_path=tmp_path / "norm.png")
    default = plot_data_loader_image(DataLoader(TensorDataset(images, labels), batch_size=4))
    assert Path(raw) == tmp_path / "raw.png" and Path(norm) == tmp_path / "norm.png"
    assert Path(default).resolve() == (tmp_path / "data_loader_batch.png").resolve()
    # A desktop (DISPLAY set) with MPLBACKEND=Agg: plt.show() could only warn; it saves too.
    monkeypatch.setenv("DISPLAY", ":99")
    matplotlib.use("Agg")
    (tmp_path / "data_loader_batch.png").unlink()
    assert plot_data_loader_image(DataLoader(TensorDataset(images, labels), batch_size=4)) \
        == Path("data_loader_batch.png") and (tmp_path / "data_loader_batch.png").is_file()
    a = np.asarray(Image.open(raw).convert("RGB"), dtype=np.float64)
    b = np.asarray(Image.open(norm).convert("RGB"), dtype=np.float64)
    assert a.shape == b.shape
    # De-normalised for display: the two pictures match (up to float rounding).
    assert np.abs(a - b).mean() < 1.0
    # ... and show the colours: plenty of strongly red and strongly blue pixels.
    red = (a[..., 0] > 180) & (a[..., 2] < 60)
    blue = (a[..., 2] > 150) & (a[..., 0] < 60)
    assert red.sum() > 100 and blue.sum() > 100


def test_class_names_in_any_script_plot_without_glyph_warnings(tmp_path):
    from utils import FolderScan, plot_class_distribution

    scan = FolderScan(root=str(tmp_path), classes=["玫瑰", "daisy"], images=[["a"], ["b", "c"]],
                      skipped=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DejaVu Sans has no CJK: one warning per glyph
        plot_class_distribution(scan, tmp_path / "classes.png")
    with Image.open(tmp_path / "classes.png") as img:
        assert img.format == "PNG"


def test_a_class_name_of_200_characters_is_shortened_on_the_plots(tmp_path):
    """It took the whole figure: tight_layout gave up with a warning, the plot was clipped."""
    from multi_train_utils.train_eval_utils import EvalResult
    from train_common import _confusion_figure
    from utils import FolderScan, plot_class_distribution

    long = "x" * 190 + "_female"  # another "x" * 190 + "_male" would be told apart
    scan = FolderScan(root=str(tmp_path), classes=[long, "daisy"], images=[["a"], ["b", "c"]])
    result = EvalResult(2, top5_correct=2, num_samples=2, loss_sum=0.0,
                        confusion=torch.eye(2, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied"
        plot_class_distribution(scan, tmp_path / "classes.png")
        fig = _confusion_figure(result, [long, "daisy"])
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["x" * 11 + "\u2026" + "x" * 5 + "_female", "daisy"]


def test_per_class_accuracy_lines_escape_a_tab_in_a_class_name(caplog):
    from multi_train_utils.train_eval_utils import EvalResult
    from train_common import _report_eval

    result = EvalResult(2, top5_correct=2, num_samples=2, loss_sum=0.0,
                        confusion=torch.eye(2, dtype=torch.int64))
    with caplog.at_level(logging.INFO):
        _report_eval(result, ["red\trose", "daisy"])
    assert "\n  red\\trose: 1.0000 (1 image)\n  daisy: 1.0000 (1 image)\n" in caplog.text


def test_class_distribution_of_many_classes_stays_a_readable_size(tmp_path):
    from utils import FolderScan, plot_class_distribution

    scan = FolderScan(root=str(tmp_path), classes=[f"c{i}" for i in range(1200)],
                      images=[["x"] * (i % 7 + 1) for i in range(1200)])
    plot_class_distribution(scan, tmp_path / "classes.png")
    with Image.open(tmp_path / "classes.png") as img:
        assert img.width <= 2400  # 1200 classes at 0.6 inch each would be 72,000 px


def test_read_split_data_writes_class_indices_and_distribution(tiny_data, tmp_path):
    train_p, train_y, val_p, val_y = read_split_data(str(tiny_data), plot_image=True,
                                                     output_dir=str(tmp_path))
    classes = sorted(p.name for p in tiny_data.iterdir() if p.is_dir())
    indices = json.loads((tmp_path / "class_indices.json").read_text())
    assert indices == {str(i): c for i, c in enumerate(classes)}
    with Image.open(tmp_path / "class_distribution.png") as img:
        assert img.format == "PNG" and img.size[0] > 100
    assert len(train_p) + len(val_p) == 60 and not set(train_p) & set(val_p)
    assert set(train_y) == set(val_y) == set(range(len(classes)))
    # Every path sits in the folder of its label.
    assert all(Path(p).parent.name == classes[y] for p, y in zip(train_p + val_p, train_y + val_y))


# ---------------------------------------------------------------- TensorBoard and eval-only
@pytest.fixture(scope="module")
def tb_run(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tb") / "run"
    res = run([sys.executable, "train_multi_gpu_using_launch.py", *TINY_FLAGS, "--tensorboard",
               "--data-path", str(tiny_data), "--epochs", "1", "--output-dir", str(out)],
              timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_tensorboard_logs_scalars_images_and_confusion_matrix(tb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tb_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tb_run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("loss", "accuracy", "learning_rate", "val_loss", "images_per_sec"):
        assert tag in tags["scalars"], f"scalar {tag!r} missing; have {tags['scalars']}"
    assert {"train_images_augmented", "confusion_matrix"} <= set(tags["images"])
    # The scalars are the numbers metrics.jsonl recorded for the same epoch.
    (record,) = [json.loads(line) for line in (tb_run / "metrics.jsonl").read_text().splitlines()]
    for tag, key in (("loss", "train_loss"), ("accuracy", "val_acc"), ("val_loss", "val_loss"),
                     ("learning_rate", "lr")):
        (event,) = acc.Scalars(tag)
        assert event.step == 0 and event.value == pytest.approx(record[key], rel=1e-4, abs=1e-6)
    step_losses = _scalars(tb_run / "tensorboard" / "steps", "step/loss")
    assert len(step_losses) >= 2 and all(e.value > 0 for e in step_losses)
    (image,) = acc.Images("confusion_matrix")
    assert image.width > 50 and image.height > 50


def _scalars(logdir: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)


@pytest.mark.parametrize("n, names, counts", [(5, True, True), (40, True, False),
                                              (400, False, False)])
def test_confusion_matrix_figure_stays_small_with_many_classes(n, names, counts):
    from multi_train_utils.train_eval_utils import EvalResult
    from train_common import _confusion_figure

    confusion = torch.eye(n, dtype=torch.int64) * 3
    result = EvalResult(3 * n, top5_correct=3 * n, num_samples=3 * n, loss_sum=0.0,
                        confusion=confusion)
    fig = _confusion_figure(result, [f"class{i}" for i in range(n)])
    (ax,) = fig.axes
    assert max(fig.get_size_inches() * fig.dpi) <= 1200  # 400 classes: not 20,000 px square
    assert (len(ax.get_xticklabels()) == n) == names
    assert len(ax.texts) == (n * n if counts else 0)


def test_resumed_run_continues_every_tensorboard_curve(tb_run, tiny_data, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tb_run, out)
    first = [e.step for e in _scalars(out / "tensorboard" / "steps", "step/loss")]
    res = run([sys.executable, "train_multi_gpu_using_launch.py", *TINY_FLAGS, "--tensorboard",
               "--data-path", str(tiny_data), "--epochs", "2", "--output-dir", str(out)],
              timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [e.step for e in _scalars(out / "tensorboard", "loss")] == [0, 1]
    # The steps of epoch 0 survive the resume (an epoch-counted purge used to delete them).
    steps = [e.step for e in _scalars(out / "tensorboard" / "steps", "step/loss")]
    assert steps[:len(first)] == first and len(steps) == 2 * len(first), (first, steps)
    assert steps == sorted(set(steps))


def test_eval_only_reports_accuracy_without_training(tb_run, tiny_data, tmp_path):
    out = tmp_path / "eval"
    res = run([sys.executable, "train_multi_gpu_using_launch.py", *TINY_FLAGS,
               "--data-path", str(tiny_data), "--eval-only", "--resume",
               str(tb_run / "checkpoint.pth"), "--output-dir", str(out)], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    (record,) = [json.loads(line) for line in (tb_run / "metrics.jsonl").read_text().splitlines()]
    top1 = float(re.search(r"top-1 accuracy: ([\d.]+)", text).group(1))
    assert top1 == pytest.approx(record["val_acc"], abs=1e-4)  # same weights, same val split
    # The accuracy of a few images is near chance either way: the loss tells the checkpoint's
    # weights from a freshly initialised model's.
    val_loss = float(re.search(r"val loss: ([\d.]+)", text).group(1))
    assert val_loss == pytest.approx(record["val_loss"], abs=1e-4)
    classes = json.loads((tb_run / "class_indices.json").read_text()).values()
    per_class = {m[0]: (float(m[1]), int(m[2]))
                 for m in re.findall(r"^\s+(\w+): ([\d.]+) \((\d+) images?\)$", text, re.M)}
    assert set(per_class) == set(classes) and all(0 <= v <= 1 for v, _ in per_class.values())
    # Every validation image in exactly one class, and the accuracies add up to the top-1.
    total = int(re.search(r"val images: (\d+)", text).group(1))
    assert sum(n for _, n in per_class.values()) == total
    assert sum(v * n for v, n in per_class.values()) / total == pytest.approx(top1, abs=1e-3)
    # No training: no progress bars, no epoch lines; evaluation writes nothing at all.
    assert "[train epoch" not in text and "[epoch" not in text
    assert not out.exists()
    assert len((tb_run / "metrics.jsonl").read_text().splitlines()) == 1


# ---------------------------------------------------------------- --help
HELP_EXPECT = {
    "train_multi_gpu_using_launch": ["data:", "model:", "optimisation:", "distributed:", "run:",
                                     "(default: 30)", "(default: resnet34)", "(default: env://)",
                                     "--sync-bn [BOOL], --no-sync-bn, --syncBN [BOOL], --no-syncBN"],
    "train_multi_gpu_using_spawn": ["distributed:", "--world-size", "--nnodes", "--node-rank",
                                    "(default: 30)", "(default: 1)"],
    "predict": ["model:", "inference:", "--weights", "(default: 5)"],
    "plot_results": ["output:", "--out-dir", "(default: 120)"],
}


@pytest.mark.parametrize("script", sorted(HELP_EXPECT))
def test_help_shows_groups_and_defaults(script, capsys, monkeypatch):
    # In-process (each script's own parser, as its __main__ block builds it): four fresh
    # interpreters importing torch cost a minute on a loaded 2-core machine.
    monkeypatch.setenv("COLUMNS", "100")
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        module.get_args_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines by terminal width
    assert text.startswith("usage: ")
    for expected in HELP_EXPECT[script]:
        assert expected in text, f"{script}.py --help lacks {expected!r}"
    if script == "train_multi_gpu_using_launch":  # torchrun, not a flag, sets the process count
        assert "--world-size" not in text
    assert "--no-sync-bn [BOOL]" not in text  # the negative form takes no value


def test_readme_shows_the_example_verbatim():
    """The README's "own project" code is this tested file, so it cannot drift from working code."""
    example = (ROOT / "example_own_project.py").read_text()
    assert "```python\n" + example + "```" in (ROOT / "README.md").read_text()
