"""What a run records: ``metrics.jsonl`` lines, TensorBoard, JSON files written whole, plots."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from multi_train_utils.distributed_utils import is_main_process
from multi_train_utils.train_eval_utils import IMAGENET_MEAN, IMAGENET_STD
from my_dataset import MyDataSet, printable_path

log = logging.getLogger(__name__)


def write_json_atomic(path: str | os.PathLike, obj: object, compact: bool = False) -> None:
    """Write ``obj`` as JSON; a reader never sees half a file (temporary file + rename)."""
    path = Path(path)
    text = json.dumps(obj, indent=None if compact else 4, ensure_ascii=compact)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: ranks may race
    try:
        tmp.write_bytes((text + "\n").encode("utf-8", "backslashreplace"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tensorboard_writer(out: Path, start_epoch: int, train_set: torch.utils.data.Dataset) -> Any:
    """Rank 0's ``SummaryWriter`` in ``out/tensorboard`` (None elsewhere), with 16 training
    images; a resumed run drops what a lost epoch logged."""
    if not is_main_process():
        return None
    from torch.utils.tensorboard import SummaryWriter  # an optional extra: imported when used
    from torchvision.utils import make_grid

    writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_epoch or None)
    with torch.random.fork_rng(devices=[]):  # the crops leave the RNG as a resume restored it
        batch = MyDataSet.collate_fn([train_set[i] for i in range(min(16, len(train_set)))])
    images = batch.to_device(torch.device("cpu"))[0] if hasattr(batch, "to_device") else batch[0]
    writer.add_image("train_images", make_grid(images, nrow=8), start_epoch)
    return writer


def epoch_record(epoch: int, train_loss: float, result: Any, lr: float, seconds: float,
                 images_per_sec: float, ema: Any = None) -> dict[str, Any]:
    """An epoch's line of ``metrics.jsonl``, logged: ``result`` is its ``evaluate()``, ``ema``
    the averaged weights' (as ``ema_val_acc``, ...)."""
    record = {"epoch": epoch, "train_loss": round(train_loss, 6)}
    for prefix, res in (("", result), ("ema_", ema)):
        if res is not None:
            top5 = None if res.top5 is None else round(res.top5, 6)
            record |= {f"{prefix}val_acc": round(res.top1, 6),
                       f"{prefix}val_loss": round(res.loss, 6), f"{prefix}val_top5": top5}
    record |= dict(lr=lr, epoch_seconds=round(seconds, 3),
                   train_images_per_sec=round(images_per_sec, 2))
    ema_text = f"  EMA: val acc {ema.top1:.4f}  val loss {ema.loss:.4f}" if ema is not None else ""
    log.info(f"[epoch {epoch}] train loss {train_loss:.4f}  val acc {result.top1:.4f}  val loss "
             f"{result.loss:.4f}  lr {lr:.2e}  {images_per_sec:.0f} img/s{ema_text}")
    return record


def log_epoch(writer: Any, record: dict[str, Any]) -> None:
    """An epoch's ``metrics.jsonl`` record as TensorBoard scalars."""
    for tag in ("train_loss", "val_acc", "val_loss", "lr", "train_images_per_sec", "ema_val_acc"):
        if tag in record:
            writer.add_scalar(tag, record[tag], record["epoch"])
    writer.flush()


def tick_label(name: str) -> str:
    """``name`` as an axis label: cut in the middle to 24 characters, so "..._male" and
    "..._female" still differ."""
    name = printable_path(name)  # bytes that are not UTF-8 as \xNN: fonts refuse surrogates
    return name if len(name) <= 24 else f"{name[:11]}\u2026{name[-12:]}"


def plot_class_distribution(classes: Sequence[str], counts: Sequence[int],
                            path: str | os.PathLike) -> Path:
    """Bar chart of ``counts[i]`` images of ``classes[i]``, saved as PNG."""
    from matplotlib.figure import Figure  # an optional extra, imported for a plot
    # 0.6 inch per class up to 24 inches: 1000 classes would otherwise be 60,000 px wide.
    fig = Figure(figsize=(min(max(4, 0.6 * len(counts) + 2), 24), 4))
    ax = fig.subplots()
    if len(counts) <= 60:  # names on the axis while they fit
        ax.bar_label(ax.bar(range(len(counts)), counts))
        ax.set_xticks(range(len(counts)), map(tick_label, classes), rotation=45, ha="right")
    else:  # one artist: 1000 bars take a second or two to draw, at every fresh start
        ax.stairs(counts, [i - 0.5 for i in range(len(counts) + 1)], fill=True)
    ax.set(xlabel="image class", ylabel="number of images", title="class distribution")
    with warnings.catch_warnings():
        # CJK or emoji class names: the default font lacks them and warns once per glyph.
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        fig.tight_layout()
        fig.savefig(path)
    return Path(path)


def plot_data_loader_image(data_loader: Iterable, classes: Sequence[str] | None = None,
                           path: str | os.PathLike | None = None, count: int = 4) -> Any:
    """The classic tutorial's look at a loader: the first ``count`` images of its first batch
    (normalised or not), named by ``classes`` (default: ``class_indices.json`` here)."""
    import matplotlib.pyplot as plt  # an optional extra, imported for a plot
    if classes is None and os.path.isfile("class_indices.json"):
        classes = list(json.loads(Path("class_indices.json").read_text("utf-8")).values())
    batch = next(iter(data_loader))  # --decode device: decoded here, on the CPU
    images, labels = batch.to_device(torch.device("cpu")) if hasattr(batch, "to_device") else batch
    if images.is_floating_point():
        mean, std = (torch.tensor(v).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        images = (images[:count] * std + mean).mul(255).round().clamp(0, 255).to(torch.uint8)
    fig, axes = plt.subplots(1, min(count, len(images)), squeeze=False, figsize=(2.5 * count, 3))
    for ax, image, label in zip(axes.flat, images, labels.tolist()):
        ax.imshow(image.permute(1, 2, 0).numpy())  # -100: an unreadable file (IGNORE_INDEX)
        name = classes[label] if classes and 0 <= label < len(classes) else str(label)
        ax.set(xticks=[], yticks=[], xlabel=tick_label(name))
    if path is None:
        plt.show()
    else:
        fig.savefig(path)
        plt.close(fig)  # pyplot keeps each figure until closed
    return fig

