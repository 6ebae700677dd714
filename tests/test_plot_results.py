"""plot_results.py: three valid PNGs, plotted values read from metrics.jsonl, clear errors.

The metrics below are synthetic (this is a test); the script itself must plot only what it reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import plot_results

ROOT = Path(__file__).resolve().parents[1]
PNGS = ("accuracy.png", "loss.png", "epoch_time.png")


def _record(epoch: int, acc: float, loss: float, seconds: float, **extra: float) -> str:
    return json.dumps({"epoch": epoch, "train_loss": loss, "val_acc": acc, "val_top5": None,
                       "lr": 0.01, "epoch_seconds": seconds, "train_images_per_sec": 100.0,
                       **extra})


def _write_run(run_dir: Path, lines: list[str]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    one = _write_run(tmp_path / "one_proc", [
        _record(0, 0.40, 1.50, 12.0),
        '{"epoch": 1, "train_loss": 1.1, "val_acc"',  # cut short mid-write: skipped
        _record(1, 0.55, 1.10, 11.0),
        _record(2, 0.61, 0.90, 10.0),
    ])
    two = _write_run(tmp_path / "two_procs",
                     [_record(e, 0.3 + 0.1 * e, 1.4 - 0.2 * e, 6.0 + e, val_loss=1.5 - 0.2 * e)
                      for e in range(4)])
    return one, two


def _main(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, list[str], list[str]]:
    """Run plot_results.main in-process: (exit code, stdout lines, stderr lines)."""
    try:
        plot_results.main(plot_results.get_args_parser().parse_args([str(a) for a in argv]))
        code = 0
    except SystemExit as exc:
        code = int(exc.code)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_cli_writes_three_valid_pngs(runs: tuple[Path, Path], tmp_path: Path, plain) -> None:
    # ``python plot_results.py ARGS`` in a process forked from one that imported torch (conftest)
    out = tmp_path / "plots"
    result = plain([*map(str, runs), "--out-dir", str(out), "--labels", "A", "B"], timeout=120,
                   patch=f"import runpy, sys\nsys.argv[0] = {str(ROOT / 'plot_results.py')!r}\n"
                         "runpy.run_path(sys.argv[0], run_name='__main__')\nsys.exit(0)\n")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(out / name) for name in PNGS]
    for name in PNGS:
        assert (out / name).stat().st_size > 10_000  # axes, lines and text, not an empty canvas
        with Image.open(out / name) as img:
            img.verify()
            assert img.format == "PNG" and min(img.size) > 200
    # The truncated line is reported with its file and line number, and nothing else goes wrong.
    assert result.stderr.splitlines() == [
        f"warning: {runs[0] / 'metrics.jsonl'}:2: skipping a line that is not an epoch record with "
        "epoch, train_loss, val_acc, epoch_seconds."]


def test_plotted_values_are_read_from_metrics(runs: tuple[Path, Path],
                                              capsys: pytest.CaptureFixture) -> None:
    loaded = plot_results.load_runs(runs)

    accuracy = plot_results.plot_accuracy(loaded).axes[0]
    one, two = accuracy.get_lines()
    assert list(one.get_xdata()) == [0, 1, 2]  # the malformed line is gone, not plotted as a gap
    assert list(one.get_ydata()) == pytest.approx([40.0, 55.0, 61.0])
    assert list(two.get_ydata()) == pytest.approx([30.0, 40.0, 50.0, 60.0])
    assert [one.get_label(), two.get_label()] == ["one_proc", "two_procs"]  # folder names

    loss = plot_results.plot_loss(loaded).axes[0]
    assert {line.get_label(): line.get_linestyle() for line in loss.get_lines()} == {
        "one_proc train": "-", "two_procs train": "-",
        "two_procs val": "--",  # only the run that recorded val_loss
    }
    assert list(loss.get_lines()[2].get_ydata()) == pytest.approx([1.5, 1.3, 1.1, 0.9])

    bars = plot_results.plot_epoch_time(loaded).axes[0].patches
    assert [bar.get_height() for bar in bars] == pytest.approx([11.0, 7.5])


def test_malformed_lines_are_skipped_with_a_warning(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    run = _write_run(tmp_path / "run", [
        _record(0, 0.5, 1.0, 3.0),
        "[1, 2, 3]",
        json.dumps({"epoch": 1, "train_loss": 0.9}),  # no val_acc / epoch_seconds
        "",
        _record(1, 0.2, 5.0, 3.0),
        _record(1, 0.6, 0.8, 3.0),  # a resumed run re-trained epoch 1: the last one wins
    ])

    records = plot_results.load_metrics(run / "metrics.jsonl")

    assert [(r["epoch"], r["val_acc"]) for r in records] == [(0, 0.5), (1, 0.6)]
    warned = [line.split(":")[2] for line in capsys.readouterr().err.splitlines()]
    assert warned == ["2", "3"]  # the blank line is no warning


@pytest.mark.parametrize("content", [None, "", "not json\n"])
def test_missing_or_empty_metrics_exit_2_with_one_line(tmp_path: Path, content: str | None,
                                                       capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)

    code, out, err = _main(capsys, run, "--out-dir", tmp_path / "plots")

    assert (code, out) == (2, [])
    assert err[-1].startswith("error: ") and str(run) in err[-1]
    assert len([line for line in err if line.startswith("error: ")]) == 1
    assert not (tmp_path / "plots").exists()


def test_labels_must_match_run_count(runs: tuple[Path, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    code, _, err = _main(capsys, *runs, "--out-dir", tmp_path / "plots", "--labels", "a")
    assert code == 2
    assert err[-1] == "error: got 1 --labels for 2 runs; give one label per run."

    assert ([run.label for run in plot_results.load_runs(runs, ["1 GPU", "2 GPUs"])]
            == ["1 GPU", "2 GPUs"])


def test_out_dir_that_is_a_file_exits_2(runs: tuple[Path, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "plots"
    blocker.write_text("a file where the folder should be")

    code, _, err = _main(capsys, *runs, "--out-dir", blocker)

    assert code == 2
    assert err[-1].startswith(f"error: cannot write the plots into --out-dir {blocker} (")
    assert blocker.read_text() == "a file where the folder should be"


@pytest.mark.parametrize("dpi, message", [("0", "must be at least 1, not 0"),
                                          ("-5", "must be at least 1, not -5"),
                                          ("x", "invalid int value: 'x'")])
def test_non_positive_dpi_is_rejected_by_the_parser(tmp_path: Path, dpi: str, message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        plot_results.get_args_parser().parse_args([str(tmp_path), "--out-dir",
                                                   str(tmp_path / "p"), "--dpi", dpi])
    assert exc.value.code == 2
    assert f"--dpi: {message}" in capsys.readouterr().err
