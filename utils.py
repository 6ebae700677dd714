"""Data helpers: scan and split an image folder (``root/<class>/**/<image>``, as for
``ImageFolder`` and the tutorial's ``flower_photos``), transforms, plots, demo data. Files that
cannot be used are skipped and listed with a reason; a mistake in the layout is a
:class:`DataError`, one sentence."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import time_ns
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFilter
from torchvision.transforms import v2

from multi_train_utils.distributed_utils import is_main_process, run_on_main
from multi_train_utils.guard import ConfigError, UserError
from multi_train_utils.train_eval_utils import IMAGENET_MEAN, IMAGENET_STD, EpochProgress
from device_decode import BatchAugment
from my_dataset import MyDataSet, check_image, printable_path

log = logging.getLogger(__name__)

# .jpe and .jfif are JPEG too (Windows and browsers save them); decoders read the content.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".gif", ".tif",
                  ".tiff")
LAYOUT = "one sub-folder of images per class (e.g. flower_photos/daisy/*.jpg)"
SCAN_FILE = "file_list.json"  # a run's FolderScan; moved aside with the run (run_folder.RUN_FILES)
STOPPED_SCAN_FILE = "stopped_epoch_file_list.json"  # the list a stopped epoch began with


class DataError(UserError):
    """A problem with the user's data, said in one sentence (what, where, how to fix)."""


@dataclass
class FolderScan:
    """What :func:`scan_image_folder` found: classes (sorted), their images, what it skipped."""

    root: str
    classes: list[str]
    images: list[list[str]]  # images[i]: sorted paths of the images of classes[i]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # sorted (path, reason)
    # Each folder listed, by its path below the root: [mtime, ctime] in ns, read before listing.
    times: dict[str, list[int]] = field(default_factory=dict)
    verified: bool = False  # every image's header was read
    reused: bool = False  # read from a run folder's SCAN_FILE, not listed again
    digest: str = ""  # of the classes and images below the root: which list an epoch drew from

    def summary(self, examples: int = 10) -> str:
        """A line of counts, then up to ``examples`` skipped files: one of each reason first,
        so 30 sidecar .txt files do not hide the one corrupt image."""
        line = f"{sum(map(len, self.images))} images in {len(self.classes)} classes in {self.root}"
        if not self.skipped:
            return line
        counts = Counter(why.split(" (")[0] for _, why in self.skipped)
        line += f"; skipped {len(self.skipped)} files (" + ", ".join(
            f"{why}: {n}" for why, n in sorted(counts.items())) + ")"
        shown = sorted({w.split(" (")[0]: (p, w) for p, w in reversed(self.skipped)}.values())
        shown += [x for x in self.skipped if x not in shown]
        more = f"\n  ... and {len(self.skipped) - examples} more" * (len(self.skipped) > examples)
        return "\n".join([line] + [f"  skipped {p}: {why}" for p, why in shown[:examples]]) + more

    def resume_epoch(self, progress: EpochProgress, ckpt: dict[str, Any], out: Path,
                     train_paths: list[str]) -> None:
        """The epoch a stop interrupted (``ckpt``) ends over the images it began with, new ones
        join at the next: sets ``progress.file_list`` (that list's digest) and, if it is not this
        one, ``progress.indices`` (its images in ``train_paths``, -1: gone). Every rank calls it;
        rank 0 reads the list, moved to :data:`STOPPED_SCAN_FILE` as this one is stored."""
        digest = progress.file_list = ckpt.get("in_epoch") and ckpt.get("file_list") or self.digest
        kept, epoch, saved = out / STOPPED_SCAN_FILE, ckpt["epoch"], ckpt["args"]

        def indices() -> torch.Tensor | None:
            if digest == self.digest:
                return None
            found = next((p for p in (kept, out / SCAN_FILE) if (old := _read_scan(p))
                          and old.digest == digest), None)  # the first that matches: read once
            if not found:  # deleted, or the checkpoint of another run folder
                log.warning("%s lacks the list epoch %d began with: its rest may repeat or miss "
                            "images", out, epoch)
                return None
            os.replace(found, kept)  # SCAN_FILE gets the new list, the epoch keeps its own
            old = old.rebased(self.root)
            listed = split_train_val(old, saved["val_rate"], saved["seed"],
                                     val_scan=old if saved.get("val_path") else None)[0]
            where = {path: i for i, path in enumerate(train_paths)}
            result = torch.tensor([where.get(path, -1) for path in listed], dtype=torch.int64)
            gone = int((result < 0).sum())
            log.info("%d images added since the stop: they join at epoch %d; %d gone (removed "
                     "or unreadable): epoch %d goes on without them", len(train_paths)
                     - len(listed) + gone, epoch + 1, gone, epoch)
            return result

        progress.indices = run_on_main(indices)

    def rebased(self, root: str) -> FolderScan:
        """The same files below ``root``: each machine reads its own copy of rank 0's scan."""
        if root == self.root:
            return self
        old, new = os.path.join(self.root, ""), os.path.join(root, "")

        def move(path: str) -> str:
            return new + path[len(old):] if path.startswith(old) else path
        images = [[move(p) for p in paths] for paths in self.images]
        return replace(self, root=root, images=images,
                       skipped=[(move(p), w) for p, w in self.skipped])


def _times(folder: str) -> list[int]:
    """A folder's [mtime, ctime] in ns, which a file added, removed or renamed changes (the ctime
    even under a tar or rsync that sets old mtimes); [] for a folder changed in the last 2 s, as
    a change in the same clock tick (up to 2 s on some file systems) would leave them alone."""
    st = os.stat(folder)
    return [] if time_ns() - st.st_ctime_ns < 2e9 else [st.st_mtime_ns, st.st_ctime_ns]


def _class_folders(root: str, times: dict[str, list[int]]
                   ) -> tuple[list[str], list[tuple[str, str]]]:
    """The class folder names in ``root`` (sorted) and its other entries, with a reason."""
    if not os.path.isdir(root):
        what = "is not a folder" if os.path.exists(root) else "does not exist"
        raise DataError(f"data path {root} {what}; expected a folder with {LAYOUT}.")
    try:
        times[""] = _times(root)
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise DataError(f"cannot read data folder {root} ({exc.strerror}); give the training "
                        "user read and execute access to it.") from None
    classes, skipped = [], []
    for entry in entries:
        path = os.path.join(root, entry.name)
        if entry.is_dir() and not entry.name.startswith("."):  # .git, .cache: no classes
            classes.append(entry.name)
        elif entry.is_symlink() and not os.path.exists(path) and "." not in entry.name:
            raise DataError(f"class folder {printable_path(entry.name)} in {root} is a link to "
                            f"{os.readlink(path)}, which does not exist (storage not mounted?); "
                            "mount it, or remove the link to train without that class.")
        else:
            skipped.append((path, "not in a class folder"))
    return classes, skipped


def _walk_class(folder: str, times: dict[str, list[int]], below: int
                ) -> tuple[list[str], list[tuple[str, str]]]:
    """Image-named files below ``folder`` (sorted) and what was left out, with a reason; each
    folder's :func:`_times` go to ``times``, keyed by the path from character ``below`` on.
    Only the names and types ``os.scandir`` reads are asked, as by ``ImageFolder``: no stat or
    open per file but per link. Linked sub-folders are not entered: a link up the tree loops."""
    found, skipped, todo = [], [], [folder]
    while todo:
        top = todo.pop()
        try:
            times[top[below:]] = _times(top)
            with os.scandir(top) as it:
                entries = list(it)
        except OSError as exc:  # os.walk would leave the folder out unsaid
            skipped.append((top, f"unreadable folder ({exc.strerror})"))
            continue
        for entry in entries:
            hidden = entry.name.startswith(".")
            if entry.is_dir():  # a link to a folder too
                if hidden or entry.is_symlink():
                    skipped.append((entry.path, "hidden folder" if hidden
                                    else "linked folder, not followed"))
                else:
                    todo.append(entry.path)
            elif hidden or not entry.name.lower().endswith(IMG_EXTENSIONS):
                skipped.append((entry.path, "hidden file" if hidden else "not an image extension"))
            elif entry.is_file():
                found.append(entry.path)
            else:  # a FIFO would block its reader
                gone = entry.is_symlink() and not os.path.exists(entry.path)
                skipped.append((entry.path, "dangling link or missing file" if gone
                                else "not a regular file"))
    return sorted(found), skipped


def scan_image_folder(root: str | os.PathLike, *, verify: bool = True, min_classes: int = 2,
                      reuse: str | os.PathLike | None = None) -> FolderScan:
    """Find ``root/<class>/**/<image>``; the classes are the sorted sub-folder names. ``verify``
    also reads each image's header (:func:`my_dataset.check_image`), else ``MyDataSet`` lists
    what it cannot decode when it meets it. ``reuse``: a run folder whose stored list
    (:data:`SCAN_FILE`) is reused while no folder it lists has changed."""
    root = os.fspath(root)
    if reuse is not None and (scan := _stored_scan(Path(reuse) / SCAN_FILE, root, verify)):
        return scan
    times: dict[str, list[int]] = {}
    classes, skipped = _class_folders(root, times)
    if not classes:  # --data-path flower_photos/roses: a class folder, holding images itself
        hint = (f"; it holds images itself: did you mean {os.path.dirname(os.path.abspath(root))}?"
                if any(p.lower().endswith(IMG_EXTENSIONS) for p, _ in skipped) else ".")
        if min_classes == 1 and hint != ".":  # --val-path: ILSVRC2012's validation set, as it ships
            hint = "; it holds images itself: sort them into folders named as the training classes."
        raise DataError(f"data path {root} has no class sub-folders; expected {LAYOUT}{hint}")
    if len(classes) < min_classes:
        raise DataError(f"data path {root} has {len(classes)} class folder(s) ("
                        f"{', '.join(classes)}); at least {min_classes} are needed, {LAYOUT}.")
    below = len(os.path.join(root, ""))
    walks = [_walk_class(os.path.join(root, name), times, below) for name in classes]
    images = [found for found, _ in walks]
    skipped += [x for _, left_out in walks for x in left_out]
    bad: dict[str, str] = {}
    if verify:  # header reads wait on storage (PIL releases the GIL): threads help. In chunks,
        # as map() makes all its futures at once: over a GB for ImageNet's 1.28M files.
        paths = [p for found in images for p in found]
        with ThreadPoolExecutor(8) as pool:
            for start in range(0, len(paths), 4096):
                chunk = paths[start:start + 4096]
                bad.update((p, why) for p, why in zip(chunk, pool.map(check_image, chunk)) if why)
        images = [[p for p in found if p not in bad] for found in images]
    skipped = sorted((printable_path(p), why) for p, why in [*skipped, *bad.items()])
    for name, found in zip(classes, images):
        if not found:
            folder = printable_path(os.path.join(root, name))
            inside = [f"{p}: {why}" for p, why in skipped if p.startswith(folder + os.sep)]
            note = f" (skipped {len(inside)} files, e.g. {inside[0]})" if inside else ""
            raise DataError(f"class folder {folder} has no usable image{note}; add images or "
                            "remove the folder.")
    text = json.dumps([classes, [[p[below:] for p in found] for found in images]])  # ASCII
    return FolderScan(root, classes, images, skipped, times, verified=verify,
                      digest=hashlib.sha256(text.encode()).hexdigest())


def _read_scan(path: Path) -> FolderScan | None:
    """The scan stored at ``path`` (None if there is none), below the root it listed."""
    try:
        scan = FolderScan(**json.loads(path.read_text("utf-8")))
    except (OSError, ValueError, TypeError):  # none yet, another version's file
        return None
    folders = [os.path.join(scan.root, name, "") for name in scan.classes]
    images = [[folder + p for p in found] for folder, found in zip(folders, scan.images)]
    return replace(scan, images=images, skipped=[tuple(x) for x in scan.skipped], reused=True)


def _stored_scan(path: Path, root: str, verify: bool) -> FolderScan | None:
    """The scan stored at ``path``, below ``root``, if every folder it lists has the times it
    had then, its headers were read where ``verify`` asks and no image it skipped reads now (a
    file fixed in place, a copy finished); else None (list again). A file changed in place that
    no longer decodes is replaced and listed by the loader."""
    scan = _read_scan(path)
    try:
        if not (scan and scan.digest) or scan.verified < verify or not all(
                then and _times(os.path.join(root, folder)) == then
                for folder, then in scan.times.items()):
            return None
    except OSError:  # a folder gone
        return None
    scan, prefix = scan.rebased(root), os.path.join(root, "")
    fixed = [path for path, _ in scan.skipped
             if (parts := path.removeprefix(prefix).split(os.sep))[0] in scan.classes
             and path.lower().endswith(IMG_EXTENSIONS)
             and not any(part.startswith(".") for part in parts) and not check_image(path)]
    if fixed:
        log.info("%d skipped file(s) read well now (%s): %s is listed again", len(fixed),
                 fixed[0], root)
        return None
    log.info("%s is unchanged since %s listed it: not listed again", root, path)
    return scan


def split_train_val(scan: FolderScan, val_rate: float, seed: int,
                    val_scan: FolderScan | None = None
                    ) -> tuple[list[str], list[int], list[str], list[int]]:
    """``(train_paths, train_labels, val_paths, val_labels)``: a file validates when the hash of
    ``(seed, its path below the root)`` is below ``val_rate`` (as TensorFlow's ``which_set``), so
    adding files or moving the root moves no other file across. A class of two or more keeps one
    on each side; with ``val_scan`` (``--val-path``) all of ``scan`` trains."""
    if val_scan is not None:
        return (*label_by_class_name(scan.classes, scan),  # all of it, unhashed
                *label_by_class_name(scan.classes, val_scan))
    if not 0 <= val_rate <= 1:
        raise DataError(f"--val-rate {val_rate} must be between 0 and 1.")
    prefix = os.path.join(scan.root, "")
    train_p, train_y, val_p, val_y = [], [], [], []
    for label, paths in enumerate(scan.images):
        keys = [f"{seed}\0{p.removeprefix(prefix).replace(os.sep, '/')}" for p in paths]
        hashes = [hashlib.sha256(k.encode("utf-8", "surrogateescape")).digest() for k in keys]
        fractions = [int.from_bytes(h[:8], "big") / 2.0**64 for h in hashes]
        in_val = [f < val_rate for f in fractions]
        if len(paths) >= 2 and 0 < val_rate < 1:
            in_val[fractions.index(min(fractions))] = True
            in_val[fractions.index(max(fractions))] = False
        for path, val in zip(paths, in_val):
            (val_p if val else train_p).append(path)
            (val_y if val else train_y).append(label)
    return train_p, train_y, val_p, val_y


def label_by_class_name(classes: Sequence[str], val_scan: FolderScan
                        ) -> tuple[list[str], list[int]]:
    """The images of a separate validation folder (``--val-path``), labelled by the index of
    their class folder's name in ``classes`` (the training classes)."""
    if unknown := [c for c in val_scan.classes if c not in classes]:
        raise DataError(f"validation folder {val_scan.root} has class folder(s) the training "
                        f"data lacks: {', '.join(unknown[:10])}; the model has no output for "
                        "them, so name them as in the training data or remove them.")
    index = {name: i for i, name in enumerate(classes)}
    paths = [p for found in val_scan.images for p in found]
    labels = [index[name] for name, found in zip(val_scan.classes, val_scan.images) for _ in found]
    if absent := [c for c in classes if c not in val_scan.classes]:
        log.warning("%d class(es) have no image in %s, so their accuracy is not measured: %s",
                    len(absent), val_scan.root, ", ".join(absent[:10]))
    return paths, labels


def read_split_data(root: str, val_rate: float = 0.2, plot_image: bool = False
                    ) -> tuple[list[str], list[int], list[str], list[int]]:
    """The classic tutorial's entry point: scan ``root``, split it (seed 0), write
    ``class_indices.json`` (``{"0": "daisy", ...}``) and, with ``plot_image``,
    ``class_distribution.png`` into the current folder. Returns ``(train_images_path,
    train_images_label, val_images_path, val_images_label)``."""
    scan = scan_image_folder(root)
    # A warning when files were skipped: shown even by a script that set up no logging.
    log.log(logging.WARNING if scan.skipped else logging.INFO, scan.summary())
    train_p, train_y, val_p, val_y = split_train_val(scan, val_rate, seed=0)
    write_json_atomic("class_indices.json", dict(enumerate(scan.classes)))
    if plot_image:
        plot_class_distribution(scan, "class_distribution.png")
    log.info("%d images for training, %d for validation", len(train_p), len(val_p))
    return train_p, train_y, val_p, val_y


AUTO_AUGMENT = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")  # torchvision's


def augment_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of ``args`` that :func:`get_transforms` takes, by the same names."""
    return {k: getattr(args, k) for k in ("auto_augment", "ra_magnitude", "augmix_severity",
                                          "random_erase", "interpolation", "val_resize_size",
                                          "val_crop_size")}


def get_transforms(img_size: int, decode: str = "workers", *, auto_augment: str | None = None,
                   ra_magnitude: int = 9, augmix_severity: int = 3, random_erase: float = 0.0,
                   interpolation: str = "bilinear", val_resize_size: int | None = None,
                   val_crop_size: int | None = None) -> dict[str, Any]:
    """ImageNet-style augmentation, ``uint8 (3, H, W)`` -> ``uint8 (3, img_size, img_size)``,
    validation as torchvision's (centre crop ``val_crop_size``, default ``img_size``, of a
    resize to ``val_resize_size``, default the crop x 256/224); normalisation happens on the
    device, so the workers send a quarter of the bytes. ``--decode device`` decodes and
    augments there too.
    torchvision's recipe adds a policy (``--auto-augment``) and ``--random-erase``, whose fill is
    the mean colour (its 0 after normalisation); ``MyDataSet`` seeds each from (seed, epoch, i)."""
    if decode == "device" and (auto_augment or random_erase or interpolation != "bilinear"):
        raise ConfigError("--auto-augment, --random-erase and --interpolation run in the loader "
                          "workers; drop them (or the run's), or use --decode workers.")
    mode = v2.InterpolationMode(interpolation)
    train = [v2.RandomResizedCrop(img_size, interpolation=mode), v2.RandomHorizontalFlip()]
    warp = mode if interpolation != "bicubic" else v2.InterpolationMode.BILINEAR  # tensors' only
    if auto_augment:
        train.append({"ta_wide": lambda: v2.TrivialAugmentWide(interpolation=warp),
                      "ra": lambda: v2.RandAugment(magnitude=ra_magnitude, interpolation=warp),
                      "augmix": lambda: v2.AugMix(severity=augmix_severity, interpolation=warp)}
                     .get(auto_augment, lambda: v2.AutoAugment(
                         v2.AutoAugmentPolicy(auto_augment), interpolation=warp))())
    if random_erase:
        train.append(v2.RandomErasing(random_erase, value=[round(255 * m) for m in IMAGENET_MEAN]))
    val_resize = val_resize_size or int((val_crop_size or img_size) * 256 / 224)
    pipelines = {"train": v2.Compose(train),
                 "val": v2.Compose([v2.Resize(val_resize, interpolation=mode),
                                    v2.CenterCrop(val_crop_size or img_size)])}
    return {k: BatchAugment(t) for k, t in pipelines.items()} if decode == "device" else pipelines


# ------------------------------------------------------------ plots (files: pyplot only to show)
def tick_label(name: str, width: int = 24) -> str:
    """``name`` cut in the middle to ``width`` characters for an axis: a 200-character class
    name took the whole figure. Both ends stay, so "..._male" and "..._female" differ."""
    name = printable_path(name)  # bytes that are not UTF-8 as \xNN: fonts refuse surrogates
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "\u2026" + name[len(name) - (width - 1 - head):]


def write_scan_files(out: Path, scan: FolderScan) -> None:
    """What a scan found, kept with the run: class_indices.json, skipped_files.txt, a class
    histogram and, last, :data:`SCAN_FILE` for a continued run. A reused scan writes nothing:
    its files are there, skipped_files.txt with what the loader has added since."""
    if scan.reused:
        return
    write_json_atomic(out / "class_indices.json", dict(enumerate(scan.classes)))
    (out / "skipped_files.txt").unlink(missing_ok=True)  # an earlier scan's list would mislead
    if scan.skipped:  # nothing is dropped silently
        (out / "skipped_files.txt").write_text(
            "".join(f"{path}\t{why}\n" for path, why in scan.skipped), encoding="utf-8")
        log.warning("%s; the list is in %s", scan.summary(), out / "skipped_files.txt")
    plot_class_distribution(scan, out / "class_distribution.png")
    below = [len(os.path.join(scan.root, name, "")) for name in scan.classes]
    images = [[p[n:] for p in found] for n, found in zip(below, scan.images)]  # a third the bytes
    write_json_atomic(out / SCAN_FILE, {**vars(scan), "images": images}, compact=True)


def plot_class_distribution(scan: FolderScan, path: str | os.PathLike) -> Path:
    """Bar chart of images per class, saved as PNG; names and counts while they fit."""
    from matplotlib.figure import Figure  # an optional extra, imported for a plot
    counts = [len(x) for x in scan.images]
    # 0.6 inch per class up to 24 inches: 1000 classes would otherwise be 60,000 px wide.
    fig = Figure(figsize=(min(max(4, 0.6 * len(counts) + 2), 24), 4))
    ax = fig.subplots()
    if len(counts) <= 60:  # names on the axis while they fit
        ax.bar_label(ax.bar(range(len(counts)), counts))
        ax.set_xticks(range(len(counts)), map(tick_label, scan.classes), rotation=45, ha="right")
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
    (``uint8``, or normalised with ``IMAGENET_MEAN``/``STD``: undone), named by ``classes``
    (default: ``class_indices.json`` here, as :func:`read_split_data` writes it). Saved to
    ``path``, else shown by pyplot (a window where there is a screen). Returns the figure."""
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


def tensorboard_writer(out: Path, start_epoch: int, train_set: torch.utils.data.Dataset) -> Any:
    """Rank 0's ``SummaryWriter`` in ``out/tensorboard`` (None on the other ranks), with 16
    training images; a resumed run drops what a lost epoch logged, then continues."""
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
    """An epoch's line of ``metrics.jsonl`` (``result``: its ``evaluate()``; ``ema``: the
    weights' average's, as ``ema_val_acc``, ...), logged."""
    def scores(prefix: str, res: Any) -> dict[str, float | None]:
        return {f"{prefix}val_acc": round(res.top1, 6), f"{prefix}val_loss": round(res.loss, 6),
                f"{prefix}val_top5": None if res.top5 is None else round(res.top5, 6)}

    record = {"epoch": epoch, "train_loss": round(train_loss, 6), **scores("", result),
              **(scores("ema_", ema) if ema is not None else {})}
    record.update(lr=lr, epoch_seconds=round(seconds, 3),
                  train_images_per_sec=round(images_per_sec, 2))
    log.info("[epoch {epoch}] train loss {train_loss:.4f}  val acc {val_acc:.4f}  val loss "
             "{val_loss:.4f}  lr {lr:.2e}  {train_images_per_sec:.0f} img/s".format(**record)
             + ("  EMA: val acc {ema_val_acc:.4f}  val loss {ema_val_loss:.4f}".format(**record)
                if ema is not None else ""))
    return record


def log_epoch(writer: Any, record: dict[str, Any]) -> None:
    """An epoch's ``metrics.jsonl`` record as TensorBoard scalars."""
    for tag in ("train_loss", "val_acc", "val_loss", "lr", "train_images_per_sec", "ema_val_acc"):
        if tag in record:
            writer.add_scalar(tag, record[tag], record["epoch"])
    writer.flush()


def write_json_atomic(path: str | os.PathLike, obj: object, compact: bool = False) -> None:
    """Write ``obj`` as JSON; a reader never sees half a file (temporary file + rename).
    ``compact``: one line, non-ASCII as ``\\u`` escapes (names that are not UTF-8 always)."""
    path = Path(path)
    text = json.dumps(obj, indent=None if compact else 4, ensure_ascii=compact)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: ranks may race
    try:
        tmp.write_bytes((text + "\n").encode("utf-8", "backslashreplace"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def path_flag(text: str) -> str:
    """argparse ``type=`` of a path flag: ``~`` expanded (the shell leaves ``--x=~/a`` and
    quoted paths alone), an empty value refused (``--resume "$CKPT"`` with CKPT unset)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a path")
    return os.path.expanduser(text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except ``None`` ones: their help says what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or "" if action.default is None else super()._get_help_string(action)


class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, and ``--x False`` as the classic template's users typed it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs, self.metavar = "?", "BOOL"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string.startswith("--no-") or values is None:
            return super().__call__(parser, namespace, values, option_string)
        if str(values).lower() not in ("true", "false", "1", "0", "yes", "no"):
            parser.error(f"{option_string} takes no value or one of true/false, not {values!r}")
        setattr(namespace, self.dest, str(values).lower() in ("true", "1", "yes"))


def number(kind: type, low: float, high: float = math.inf, *,
           above: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for ``low <= x <= high`` (``above``: ``low < x``), naming the range."""
    def parse(text: str) -> float:
        value = kind(text)
        inside = (value > low if above else value >= low) and value <= high
        if not (math.isfinite(value) and inside):
            bounds = f"{'above' if above else 'at least'} {low}" + (
                f" and at most {high}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


positive_int = number(int, 1)  # predict.py, plot_results.py


# ---------------------------------------------------------------- demo data
DEMO_CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")  # as flower_photos


def _draw_demo_image(cls: str, rng: random.Random, size: int) -> Image.Image:
    """A drawn "flower" of class ``cls`` (petal colour, count, shape and centre differ) with
    jittered hue, size, position and clutter: learnable in a few CPU epochs, not trivially."""
    def jitter(rgb: tuple[int, int, int], amount: int = 25) -> tuple[int, ...]:
        return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)

    sky = rng.random() < 0.4
    img = Image.new("RGB", (size, size), jitter((110, 160, 220) if sky else (50, 110, 45), 40))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randrange(4, 10)):  # leaves and blades of grass
        x, y = rng.uniform(0, size), rng.uniform(0, size)
        draw.line([(x, y), (x + rng.uniform(-12, 12), y - rng.uniform(5, 25))],
                  fill=jitter((40, 120, 40), 35), width=rng.randrange(1, 4))

    def oval(cx, cy, a, b, angle, n=10):  # n points of an ellipse turned by angle
        return [(cx + a * math.cos(t) * math.cos(angle) - b * math.sin(t) * math.sin(angle),
                 cy + a * math.cos(t) * math.sin(angle) + b * math.sin(t) * math.cos(angle))
                for t in (2 * math.pi * k / n for k in range(n))]

    for _ in range(rng.choice((1, 1, 2))):
        r = rng.uniform(0.18, 0.32) * size
        cx, cy = rng.uniform(r * 0.6, size - r * 0.6), rng.uniform(r * 0.6, size - r * 0.6)
        draw.line([(cx, cy), (cx + rng.uniform(-5, 5), size)], fill=jitter((30, 110, 30)), width=2)
        spin = rng.uniform(0, math.pi)
        if cls in ("daisy", "sunflowers", "dandelion"):
            petals = {"daisy": rng.randrange(10, 15), "sunflowers": rng.randrange(14, 20),
                      "dandelion": rng.randrange(24, 34)}[cls]
            width = {"daisy": 0.22, "sunflowers": 0.28, "dandelion": 0.1}[cls] * r
            colour = (240, 240, 235) if cls == "daisy" else (245, 200, 30)
            for k in range(petals):
                angle = spin + 2 * math.pi * k / petals
                px, py = cx + 0.55 * r * math.cos(angle), cy + 0.55 * r * math.sin(angle)
                draw.polygon(oval(px, py, 0.48 * r, width, angle), fill=jitter(colour, 20))
            centre, c = {"daisy": ((235, 190, 30), 0.25), "sunflowers": ((80, 45, 20), 0.45),
                         "dandelion": ((230, 170, 20), 0.3)}[cls]
            draw.ellipse([cx - c * r, cy - c * r, cx + c * r, cy + c * r], fill=jitter(centre, 20))
        elif cls == "roses":
            base = jitter((200, 25, 45), 30)
            for layer in range(4):  # darker layers inwards
                lr_ = r * (1 - 0.22 * layer)
                draw.polygon(oval(cx, cy, lr_, lr_ * 0.9, spin + layer, n=7),
                             fill=tuple(max(0, v - 25 * layer) for v in base))
        else:  # tulips: a cup of three petals
            colour = jitter(rng.choice(((230, 90, 170), (200, 80, 220), (240, 120, 150))), 20)
            for offset in (-0.45, 0.0, 0.45):
                draw.polygon(oval(cx + offset * r, cy, 0.35 * r, 0.8 * r, 0.0), fill=colour)
            draw.rectangle([cx - 0.75 * r, cy + 0.15 * r, cx + 0.75 * r, cy + 0.6 * r], fill=colour)
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.7)))


def make_demo_data(root: str | os.PathLike, per_class: int = 120, size: int = 64) -> Path:
    """Write the demo dataset ``root/<class>/NNNN.jpg`` (5 flower classes, the same every time)
    unless it is there, and return ``root``. Processes may call it at once: each draws into a
    temporary folder and renames it into place; the first rename wins."""
    root = Path(root)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        for cls in DEMO_CLASSES:
            (tmp / cls).mkdir()
            rng = random.Random(f"0-{cls}")
            for i in range(per_class):
                _draw_demo_image(cls, rng, size).save(tmp / cls / f"{i:04d}.jpg", quality=90)
        os.rename(tmp, root)
    except OSError:
        if not root.is_dir():  # not another process's rename that won: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def user_cache_dir(instead: str) -> Path:
    """``$XDG_CACHE_HOME`` or ``~/.cache``; where the user has no home folder (some containers)
    a :class:`DataError` that ends with ``instead``, the flag naming another folder."""
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (RuntimeError, KeyError):  # KeyError: Python < 3.12 without a user database entry
        raise DataError(f"this user has no home folder to keep a cache in; {instead}.") from None


def imagenet_layout(args: argparse.Namespace) -> None:
    """A ``--data-path D`` in torchvision's (ImageNet's) layout, ``D/train/<class>/`` and
    ``D/val/<class>/``, is read as ``--data-path D/train --val-path D/val`` (``--eval-only``:
    ``--val-path D/val`` alone, so the training images are not listed), and said so. Refused:
    no ``val/`` beside such a ``train/`` (``valid/``, ``test/``: D's own folders would be taken
    as classes), a ``val/`` with images outside class folders (ILSVRC2012's ships flat), or
    with other classes than ``train/`` (a copy or sort left half done)."""
    root = Path(args.data_path or "")
    train, val = root / "train", root / "val"
    if not args.data_path or args.val_path or not train.is_dir():
        return
    classes = _class_folders(str(train), {})[0]
    if not classes:  # train/ holds images itself: a class named "train"
        return
    if not val.is_dir():
        raise DataError(f"{train} holds class folders, but {root} has no val/ beside it, so its "
                        f"own folders would be taken as classes; give --data-path {train} (which "
                        "holds out --val-rate of it), and --val-path FOLDER to validate on one.")
    val_classes, loose = _class_folders(str(val), {})
    images = sum(path.lower().endswith(IMG_EXTENSIONS) and not Path(path).name.startswith(".")
                 for path, _ in loose)  # macOS's ._x.JPEG: no image, and never read
    if images or not val_classes:
        what = f"{images} image(s) outside its class folders" if val_classes else "no class folders"
        raise DataError(f"{val} holds {what} (ILSVRC2012's validation images come in one folder, "
                        "their labels in a separate file); sort them into a folder per class as "
                        f"in {train}, or train on --data-path {train} alone, which holds out "
                        "--val-rate of it.")
    if differ := sorted(set(classes) ^ set(val_classes)):
        raise DataError(f"{train} and {val} have different class folders ({', '.join(differ[:5])}"
                        " in one only); give both the same classes (or, to validate on some, "
                        f"--data-path {train} --val-path {val}).")
    args.data_path = None if args.eval_only else str(train)
    args.val_path = str(val)
    log.info("%s holds train/ and val/: training on %s, validating on %s", root,
             args.data_path or "none", args.val_path)


def default_demo_root() -> Path:
    """Where the demo data is cached: ``$DDP_DEMO_DATA`` or the user's cache folder."""
    if os.environ.get("DDP_DEMO_DATA"):
        return Path(os.environ["DDP_DEMO_DATA"])
    return user_cache_dir("pass --demo-dir a folder you can write, or --data-path your own "
                          "images") / "ddp-template" / "demo_flowers_v1"
