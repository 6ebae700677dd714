"""Compare training runs: accuracy, loss and time per epoch, as PNG charts.

Every number plotted is read from the runs' own ``metrics.jsonl`` (one JSON object per epoch,
written by the training script into its ``--output-dir``)::

    python plot_results.py output/1proc output/2proc_syncbn --out-dir plots
    python plot_results.py runs/a runs/b --out-dir plots --labels "1 GPU" "2 GPUs, SyncBN"

writes ``plots/accuracy.png`` (validation top-1 per epoch, one line per run), ``plots/loss.png``
(training loss solid, validation loss dashed where recorded) and ``plots/epoch_time.png`` (mean
seconds per epoch, one bar per run), and prints their paths. A run's label defaults to its folder
name plus what its ``args.json`` says about the setup, e.g. ``2proc_syncbn (resnet34, 2 procs, syncBN)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
ARGS_FILE = "args.json"
# Keys every epoch record must have to be plotted; the training script always writes them.
REQUIRED_KEYS = ("epoch", "train_loss", "val_acc", "epoch_seconds")


def _path(text: str) -> Path:
    """``type=`` of a path argument: an empty one (an unset shell variable) is refused, not read
    as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a path")
    return Path(text)


class UsageError(Exception):
    """A mistake in the inputs the user gave; the message says what and how to fix it."""


@dataclass
class Run:
    """One training run: its label and its epoch records, sorted by epoch, one per epoch."""

    label: str
    records: list[dict[str, Any]] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(epochs, values)`` for the records that have ``key``."""
        points = [(r["epoch"], float(r[key])) for r in self.records if _is_number(r.get(key))]
        return [e for e, _ in points], [v for _, v in points]


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but a true/false in a metrics file is a bug, not a number.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl``; malformed lines are skipped with a warning.

    When an epoch appears more than once (a run resumed from an older checkpoint re-trains those
    epochs), the last record wins, because it describes the weights the run continued from.
    """
    path = Path(path)
    if not path.parent.exists():  # a typo in the run folder: "No metrics.jsonl in" would hide it
        raise UsageError(f"{path.parent} does not exist; pass the --output-dir of a training run.")
    if not path.is_file():
        raise UsageError(
            f"No {METRICS_FILE} in {path.parent}; pass the --output-dir of a training run."
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"Cannot read {path} ({exc}).") from None

    by_epoch: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            log.warning("%s:%d: skipping a line that is not JSON (%s).", path, lineno, exc.msg)
            continue
        if not isinstance(record, dict):
            log.warning("%s:%d: skipping a line that is not a JSON object.", path, lineno)
            continue
        missing = [key for key in REQUIRED_KEYS if not _is_number(record.get(key))]
        if missing or not float(record["epoch"]).is_integer():
            log.warning(
                "%s:%d: skipping a record without numeric %s.", path, lineno, ", ".join(missing or ["integer epoch"])
            )
            continue
        record["epoch"] = int(record["epoch"])
        by_epoch[record["epoch"]] = record

    if not by_epoch:
        raise UsageError(f"{path} has no epoch records; has the run finished its first epoch?")
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def default_label(run_dir: str | Path) -> str:
    """The folder name, plus model, process count and SyncBN/AMP from ``args.json`` when present."""
    run_dir = Path(run_dir)
    name = run_dir.resolve().name or str(run_dir)
    args_path = run_dir / ARGS_FILE
    if not args_path.is_file():
        return name
    try:
        run_args = json.loads(args_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("Ignoring %s, which cannot be read as JSON (%s).", args_path, exc)
        return name
    if not isinstance(run_args, dict):
        return name

    parts = []
    if isinstance(run_args.get("model"), str):
        parts.append(run_args["model"])
    world_size = run_args.get("world_size")
    if _is_number(world_size):
        parts.append(f"{int(world_size)} proc" + ("s" if world_size != 1 else ""))
    # Training accepts both spellings of the flag, so args.json may hold either. One process
    # has nothing to synchronise with: the flag does nothing there.
    one_process = _is_number(world_size) and world_size == 1
    if (run_args.get("sync_bn") is True or run_args.get("syncBN") is True) and not one_process:
        parts.append("syncBN")
    # --amp's default (None) means on for CUDA; args.json records what it resolved to as
    # amp_dtype (runs from before that: the flag and the device).
    amp = run_args.get("amp")
    if run_args.get("amp_dtype") if "amp_dtype" in run_args else (
            amp is True or amp is None and str(run_args.get("device", "")).startswith("cuda")):
        parts.append("AMP")
    return f"{name} ({', '.join(parts)})" if parts else name


def load_runs(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[Run]:
    """Read every run directory; ``labels`` (one per run) override :func:`default_label`.

    A run may also be given as its metrics file itself (``runs/a/metrics.jsonl``, as shell
    completion tends to produce); its folder is then the run directory.
    """
    if labels and len(labels) != len(run_dirs):
        raise UsageError(f"Got {len(labels)} --labels for {len(run_dirs)} run directories; give one label per run.")
    runs = []
    for i, run_dir in enumerate(run_dirs):
        run_dir = Path(run_dir)
        if run_dir.name == METRICS_FILE and not run_dir.is_dir():
            run_dir = run_dir.parent
        records = load_metrics(run_dir / METRICS_FILE)
        runs.append(Run(labels[i] if labels else default_label(run_dir), records))
    return runs


def _new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    # Figure() without pyplot draws with the Agg canvas and touches no global GUI state, so this
    # works headless (SSH, CI, cluster nodes) and leaks no figures when called repeatedly.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _use_integer_epochs(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_accuracy(runs: Sequence[Run]) -> Any:
    """Validation top-1 accuracy (in %) against epoch, one line per run."""
    fig, ax = _new_figure("Validation accuracy", "epoch", "top-1 accuracy (%)")
    for i, run in enumerate(runs):
        epochs, acc = run.series("val_acc")
        ax.plot(epochs, [100 * a for a in acc], color=f"C{i}", marker="o", markersize=3, label=run.label)
    _use_integer_epochs(ax)
    ax.legend()
    return fig


def plot_loss(runs: Sequence[Run]) -> Any:
    """Training loss (solid) and, where recorded, validation loss (dashed, same colour) per run."""
    fig, ax = _new_figure("Loss", "epoch", "cross-entropy loss")
    for i, run in enumerate(runs):
        epochs, loss = run.series("train_loss")
        ax.plot(epochs, loss, color=f"C{i}", label=f"{run.label} train")
        epochs, loss = run.series("val_loss")
        if epochs:
            ax.plot(epochs, loss, color=f"C{i}", linestyle="--", label=f"{run.label} val")
    _use_integer_epochs(ax)
    ax.legend()
    return fig


def plot_epoch_time(runs: Sequence[Run]) -> Any:
    """Mean wall-clock seconds per epoch, one bar per run, with the value written on the bar."""
    fig, ax = _new_figure("Time per epoch", "", "mean seconds per epoch")
    means = []
    for run in runs:
        _, seconds = run.series("epoch_seconds")
        means.append(math.fsum(seconds) / len(seconds))
    positions = list(range(len(runs)))
    bars = ax.bar(positions, means, color=[f"C{i}" for i in positions])
    ax.bar_label(bars, labels=[f"{m:.1f} s" for m in means], padding=2)
    ax.set_xticks(positions, [f"{run.label}\n({len(run.records)} epochs)" for run in runs])
    ax.grid(False, axis="x")
    ax.margins(y=0.15)  # room for the value labels above the tallest bar
    return fig


def main(args: argparse.Namespace) -> list[Path]:
    # WARNING, not INFO: matplotlib logs chatter such as font-cache rebuilds at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        runs = load_runs(args.run_dirs, args.labels)
        written = _save_plots(runs, args.out_dir, args.dpi)
    except UsageError as exc:
        log.error("%s", exc)
        sys.exit(2)
    return written


def _save_plots(runs: Sequence[Run], out_dir: Path, dpi: int) -> list[Path]:
    """Write the three charts into ``out_dir`` (created if needed) and print each path."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out-dir {out_dir} is an existing file, not a folder; pass a folder for the PNG files.")
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # Labels are run folder names, which may be CJK; the default font lacks those glyphs and
            # matplotlib warns once per character per figure, burying real warnings. Only this
            # message is silenced, and only while our charts are drawn.
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font", category=UserWarning)
            charts = (("accuracy.png", plot_accuracy), ("loss.png", plot_loss), ("epoch_time.png", plot_epoch_time))
            for name, plot in charts:
                path = out_dir / name
                plot(runs).savefig(path, dpi=dpi)
                print(path)
                written.append(path)
    except OSError as exc:  # read-only folder, a path below a file, disk full, ...
        raise UsageError(
            f"Cannot write the plots into --out-dir {out_dir} ({exc.strerror or exc}); pass a writable folder."
        ) from None
    return written


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except "(default: None)": those flags explain their fallback in the help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Plot accuracy, loss and epoch time of training runs from their metrics.jsonl.",
        formatter_class=_HelpFormatter,
        add_help=add_help,
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=_path,
        metavar="RUN_DIR",
        help=f"training --output-dir holding {METRICS_FILE} (or that {METRICS_FILE} itself)",
    )
    group = parser.add_argument_group("output")
    group.add_argument(
        "--out-dir", "--output-dir", dest="out_dir", type=_path, required=True, metavar="DIR", help="folder for the PNG files"
    )
    group.add_argument(
        "--labels", nargs="+", default=None, metavar="LABEL", help="legend label per run; default: folder name plus args.json summary"
    )
    group.add_argument("--dpi", type=_positive_int, default=120, help="resolution of the PNG files")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
