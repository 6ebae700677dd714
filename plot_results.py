"""Compare training runs as PNG charts, read from the ``metrics.jsonl`` (one JSON object per
epoch) that training writes into its ``--output-dir``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from multi_train_utils.guard import UserError
from flags import HelpFormatter, path_flag, positive_int

METRICS_FILE = "metrics.jsonl"
REQUIRED_KEYS = ("epoch", "train_loss", "val_acc", "epoch_seconds")


class Run(NamedTuple):
    """A training run: its label and its epoch records, one per epoch, in order."""

    label: str
    records: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(epochs, values)`` of the records with a value under ``key`` (not null)."""
        points = [(r["epoch"], r[key]) for r in self.records if r.get(key) is not None]
        return [e for e, _ in points], [v for _, v in points]


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """A ``metrics.jsonl``'s records, malformed lines skipped with a warning. An epoch recorded
    twice (a run resumed from an older checkpoint trains it again): the last record."""
    try:  # undecodable bytes become a malformed line
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); pass the --output-dir of "
                        "a training run.") from None
    by_epoch: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)  # a line cut short by a crash mid-write raises here
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and all(
                isinstance(record.get(k), (int, float)) for k in REQUIRED_KEYS):
            by_epoch[record["epoch"]] = record
        elif line.strip():
            print(f"warning: {path}:{lineno}: skipping a line that is not an epoch record with "
                  f"{', '.join(REQUIRED_KEYS)}.", file=sys.stderr)
    if not by_epoch:
        raise UserError(f"{path} has no epoch records; has the run finished its first epoch?")
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def load_runs(run_dirs: Sequence[Path], labels: Sequence[str] | None = None) -> list[Run]:
    """The runs in ``run_dirs``, named by ``labels`` (one per run) or their folders."""
    if labels and len(labels) != len(run_dirs):
        raise UserError(f"got {len(labels)} --labels for {len(run_dirs)} runs; "
                        "give one label per run.")
    labels = labels or [Path(d).resolve().name for d in run_dirs]
    return [Run(label, load_metrics(Path(d) / METRICS_FILE)) for d, label in zip(run_dirs, labels)]


def _new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    # Figure() without pyplot draws with the Agg canvas and touches no global GUI state, so this
    # works headless (SSH, CI, cluster nodes) and leaks no figures when called repeatedly.
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    return fig, ax


def plot_accuracy(runs: Sequence[Run]) -> Figure:
    fig, ax = _new_figure("Validation accuracy", "epoch", "top-1 accuracy (%)")
    for i, run in enumerate(runs):
        epochs, acc = run.series("val_acc")
        ax.plot(epochs, [100 * a for a in acc], color=f"C{i}", marker="o", markersize=3,
                label=run.label)
    ax.legend()
    return fig


def plot_loss(runs: Sequence[Run]) -> Figure:
    fig, ax = _new_figure("Loss", "epoch", "cross-entropy loss")
    for i, run in enumerate(runs):
        ax.plot(*run.series("train_loss"), color=f"C{i}", label=f"{run.label} train")
        epochs, loss = run.series("val_loss")
        if epochs:
            ax.plot(epochs, loss, color=f"C{i}", linestyle="--", label=f"{run.label} val")
    ax.legend()
    return fig


def plot_epoch_time(runs: Sequence[Run]) -> Figure:
    fig, ax = _new_figure("Time per epoch", "", "mean seconds per epoch")
    means = [statistics.fmean(r["epoch_seconds"] for r in run.records) for run in runs]
    positions = list(range(len(runs)))
    bars = ax.bar(positions, means, color=[f"C{i}" for i in positions])
    ax.bar_label(bars, labels=[f"{m:.1f} s" for m in means], padding=2)
    ax.set_xticks(positions, [f"{run.label}\n({len(run.records)} epochs)" for run in runs])
    ax.grid(False, axis="x")
    ax.margins(y=0.15)  # room for the value labels above the tallest bar
    return fig


CHARTS = {"accuracy.png": plot_accuracy, "loss.png": plot_loss, "epoch_time.png": plot_epoch_time}


def main(args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    try:
        runs = load_runs(args.run_dirs, args.labels)
        out.mkdir(parents=True, exist_ok=True)
        for name, plot in CHARTS.items():
            plot(runs).savefig(out / name, dpi=args.dpi)
    except (UserError, OSError) as exc:  # OSError: a file in the way, a read-only or full disk
        if isinstance(exc, OSError):
            exc = f"cannot write the plots into --out-dir {out} ({exc.strerror or exc})."
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(str(out / name) for name in CHARTS))


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Plot accuracy, loss and epoch time of training runs.",
        formatter_class=HelpFormatter, add_help=add_help)
    parser.add_argument("run_dirs", nargs="+", type=path_flag, metavar="RUN_DIR",
                        help=f"training --output-dir holding {METRICS_FILE}")
    group = parser.add_argument_group("output")
    group.add_argument("--out-dir", "--output-dir", dest="out_dir", type=path_flag, required=True,
                       metavar="DIR", help="folder for the PNG files")
    group.add_argument("--labels", nargs="+", metavar="LABEL",
                       help="legend label per run (default: the folder names)")
    group.add_argument("--dpi", type=positive_int, default=120, help="resolution of the PNG files")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
