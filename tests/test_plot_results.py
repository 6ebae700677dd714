"""plot_results.py: three valid PNGs, plotted values read from metrics.jsonl, clear errors.

The metrics below are synthetic (this is a test); the script itself must plot only what it reads.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from PIL import Image

import plot_results

ROOT = Path(__file__).resolve().parents[1]
PNGS = ("accuracy.png", "loss.png", "epoch_time.png")


def _record(epoch: int, acc: float, loss: float, seconds: float, **extra: float) -> dict:
    return {"epoch": epoch, "train_loss": loss, "val_acc": acc, "lr": 0.01, "epoch_seconds": seconds,
            "train_images_per_sec": 100.0, **extra}


def _write_run(run_dir: Path, lines: list[str], run_args: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if run_args is not None:
        (run_dir / "args.json").write_text(json.dumps(run_args))
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    one = _write_run(
        tmp_path / "one_proc",
        [
            json.dumps(_record(0, 0.40, 1.50, 12.0)),
            '{"epoch": 1, "train_loss": 1.1, "val_acc"',  # cut short mid-write: skipped
            json.dumps(_record(1, 0.55, 1.10, 11.0)),
            json.dumps(_record(2, 0.61, 0.90, 10.0)),
        ],
    )
    two = _write_run(
        tmp_path / "two_procs",
        [json.dumps(_record(e, 0.3 + 0.1 * e, 1.4 - 0.2 * e, 6.0 + e, val_loss=1.5 - 0.2 * e)) for e in range(4)],
        {"model": "resnet34", "world_size": 2, "syncBN": True},
    )
    return one, two


def test_cli_writes_three_valid_pngs(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "plots"
    result = subprocess.run(
        [sys.executable, str(ROOT / "plot_results.py"), *map(str, runs), "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(out / name) for name in PNGS]
    for name in PNGS:
        path = out / name
        assert path.stat().st_size > 10_000  # a chart with axes, lines and text, not an empty canvas
        with Image.open(path) as img:
            img.verify()
            assert img.format == "PNG"
            assert min(img.size) > 200
    # The truncated line is reported with its file and line number, and nothing else goes wrong.
    (warning,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert "WARNING" in warning and "metrics.jsonl:2" in warning


def test_plotted_values_are_read_from_metrics(runs: tuple[Path, Path]) -> None:
    loaded = plot_results.load_runs(runs)

    accuracy = plot_results.plot_accuracy(loaded).axes[0]
    one, two = accuracy.get_lines()
    assert list(one.get_xdata()) == [0, 1, 2]  # the malformed line is gone, not plotted as a gap
    assert list(one.get_ydata()) == pytest.approx([40.0, 55.0, 61.0])
    assert list(two.get_ydata()) == pytest.approx([30.0, 40.0, 50.0, 60.0])

    loss = plot_results.plot_loss(loaded).axes[0]
    styles = {line.get_label(): line.get_linestyle() for line in loss.get_lines()}
    assert styles == {
        "one_proc train": "-",
        "two_procs (resnet34, 2 procs, syncBN) train": "-",
        "two_procs (resnet34, 2 procs, syncBN) val": "--",  # only the run that recorded val_loss
    }

    bars = plot_results.plot_epoch_time(loaded).axes[0].patches
    assert [bar.get_height() for bar in bars] == pytest.approx([11.0, 7.5])


def test_malformed_lines_are_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _write_run(
        tmp_path / "run",
        [
            json.dumps(_record(0, 0.5, 1.0, 3.0)),
            "[1, 2, 3]",
            json.dumps({"epoch": 1, "train_loss": 0.9}),  # no val_acc / epoch_seconds
            json.dumps(_record(1, 0.2, 5.0, 3.0)),
            json.dumps(_record(1, 0.6, 0.8, 3.0)),  # resumed run re-trained epoch 1: last one wins
        ],
    )

    with caplog.at_level(logging.WARNING):
        records = plot_results.load_metrics(run / "metrics.jsonl")

    assert [(r["epoch"], r["val_acc"]) for r in records] == [(0, 0.5), (1, 0.6)]
    warned_lines = sorted(r.getMessage().split(":")[1] for r in caplog.records if r.levelno == logging.WARNING)
    assert warned_lines == ["2", "3"]


@pytest.mark.parametrize("content", [None, "", "not json\n"])
def test_missing_or_empty_metrics_exit_2(
    tmp_path: Path, content: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    args = plot_results.get_args_parser().parse_args([str(run), "--out-dir", str(tmp_path / "plots")])

    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as exc:
        plot_results.main(args)

    assert exc.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(run) in errors[0]
    assert not (tmp_path / "plots").exists()


def test_labels_must_match_run_count(runs: tuple[Path, Path], tmp_path: Path) -> None:
    args = plot_results.get_args_parser().parse_args([*map(str, runs), "--out-dir", str(tmp_path), "--labels", "a"])
    with pytest.raises(SystemExit) as exc:
        plot_results.main(args)
    assert exc.value.code == 2

    loaded = plot_results.load_runs(runs, ["1 GPU", "2 GPUs"])
    assert [run.label for run in loaded] == ["1 GPU", "2 GPUs"]


def _main_exit_code(*argv: str | Path) -> int:
    """Run plot_results.main in-process; the exit code (0 when it returns normally)."""
    try:
        plot_results.main(plot_results.get_args_parser().parse_args([str(a) for a in argv]))
    except SystemExit as exc:
        return int(exc.code)
    return 0


@pytest.mark.parametrize("where", ["existing file", "below a file"])
def test_unusable_out_dir_exits_2_with_one_line(
    runs: tuple[Path, Path], tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "plots"
    blocker.write_text("a file where the folder should be")
    out = blocker if where == "existing file" else blocker / "sub"

    with caplog.at_level(logging.WARNING):
        code = _main_exit_code(*runs, "--out-dir", out)

    assert code == 2
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(out) in message
    assert ("existing file" if where == "existing file" else "Not a directory") in message
    assert blocker.read_text() == "a file where the folder should be"


def test_read_only_out_dir_exits_2_with_one_line(
    runs: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A folder the user may not write into. Injected as the kernel answers a chmod 555 folder:
    this suite may run as root, who writes into read-only folders."""
    out = tmp_path / "plots"
    out.mkdir()
    real_open = builtins.open

    def read_only_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).parent == out and "r" not in mode:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_open)
    with caplog.at_level(logging.WARNING):
        code = _main_exit_code(*runs, "--out-dir", out)
    monkeypatch.undo()

    assert code == 2
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(out) in message and "Permission denied" in message
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("dpi", ["0", "-5"])
def test_non_positive_dpi_is_rejected_by_the_parser(
    runs: tuple[Path, Path], tmp_path: Path, dpi: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        plot_results.get_args_parser().parse_args([str(runs[0]), "--out-dir", str(tmp_path / "p"), "--dpi", dpi])

    assert exc.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "--dpi" in line and f"expected a positive integer, got '{dpi}'" in line


def test_metrics_file_is_accepted_as_the_run(runs: tuple[Path, Path], tmp_path: Path) -> None:
    one, two = runs

    loaded = plot_results.load_runs([one / "metrics.jsonl", two / "metrics.jsonl"])

    assert [run.label for run in loaded] == ["one_proc", "two_procs (resnet34, 2 procs, syncBN)"]
    assert [[r["epoch"] for r in run.records] for run in loaded] == [[0, 1, 2], [0, 1, 2, 3]]
    assert _main_exit_code(one / "metrics.jsonl", "--out-dir", tmp_path / "plots") == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(PNGS)


def test_missing_glyph_warnings_are_silenced_only_while_plotting(runs: tuple[Path, Path], tmp_path: Path) -> None:
    labels = ["向日葵", "玫瑰"]  # sunflower, rose: not in matplotlib's default DejaVu Sans
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_results.plot_accuracy(plot_results.load_runs(runs, labels)).savefig(tmp_path / "probe.png")
    if not any("missing from font" in str(w.message) for w in caught):
        pytest.skip("the default font has CJK glyphs here, so matplotlib has nothing to warn about")

    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _main_exit_code(*runs, "--out-dir", tmp_path / "plots", "--labels", *labels)
        warnings.warn("Glyph 1 (X) missing from font(s) Test.", UserWarning)  # after main: not silenced

    assert code == 0
    assert [str(w.message) for w in caught if "missing from font" in str(w.message)] == [
        "Glyph 1 (X) missing from font(s) Test."
    ]
    assert warnings.filters == filters_before


@pytest.mark.parametrize("run_args, label", [
    ({"model": "resnet18", "world_size": 2, "sync_bn": True, "amp": True},
     "r (resnet18, 2 procs, syncBN, AMP)"),
    ({"model": "resnet18", "world_size": 1, "sync_bn": True}, "r (resnet18, 1 proc)"),
    # --amp's default is on for CUDA: args.json records what it became, older runs the device
    ({"world_size": 4, "amp": None, "device": "cuda:0", "amp_dtype": "bfloat16"}, "r (4 procs, AMP)"),
    ({"world_size": 4, "amp": False, "device": "cuda:0", "amp_dtype": None}, "r (4 procs)"),
    ({"world_size": 4, "amp": None, "device": "cuda:0"}, "r (4 procs, AMP)"),
    ({"world_size": 2, "amp": None, "device": "cpu"}, "r (2 procs)"),
])
def test_default_label_names_only_what_took_effect(run_args, label, tmp_path: Path) -> None:
    # --syncBN is on by default, but one process has no one to synchronise with.
    run = tmp_path / "r"
    run.mkdir()
    (run / "args.json").write_text(json.dumps(run_args))
    assert plot_results.default_label(run) == label


@pytest.mark.parametrize("given", ["nothere", "nothere/metrics.jsonl"])
def test_run_dir_that_does_not_exist_is_named_so(
    tmp_path: Path, given: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        code = _main_exit_code(tmp_path / given, "--out-dir", tmp_path / "plots")

    assert code == 2
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert message == f"{tmp_path / 'nothere'} does not exist; pass the --output-dir of a training run."
