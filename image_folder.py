"""An image folder, ``root/<class>/**/<image>`` as for ``ImageFolder``: its scan, stored with the
run and reused while no folder changed (docs/resume-and-restarts.md), and its split."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import time_ns
from typing import Any

import torch

from multi_train_utils.distributed_utils import run_on_main
from multi_train_utils.guard import UserError
from multi_train_utils.data import EpochProgress
from my_dataset import check_image, printable_path
from run_log import plot_class_distribution, write_json_atomic

log = logging.getLogger(__name__)

# .jpe and .jfif are JPEG too (Windows and browsers save them); decoders read the content.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".gif", ".tif",
                  ".tiff")
LAYOUT = "one sub-folder of images per class (e.g. flower_photos/daisy/*.jpg)"
SCAN_FILE = "file_list.json"  # a run's FolderScan; moved aside with the run (run_folder.RUN_FILES)
STOPPED_SCAN_FILE = "stopped_epoch_file_list.json"  # the list a stopped epoch began with
# Why files were skipped that may read well later though no folder's times changed (a copy
# finished, storage mounted): a stored list reads them again.
PASSING = ("not a readable image", "empty file", "dangling link")


class DataError(UserError):
    """A problem with the user's data, said in one sentence (what, where, how to fix)."""


@dataclass
class FolderScan:
    """What :func:`scan_image_folder` found: classes (sorted), their images, what it skipped."""

    root: str
    classes: list[str]
    images: list[list[str]]  # images[i]: sorted paths of the images of classes[i]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # sorted (path, reason)
    times: dict[str, list[int]] = field(default_factory=dict)
    verified: bool = False  # every image's header was read
    reused: bool = False  # read from a run folder's SCAN_FILE, not listed again
    digest: str = ""  # of the classes and images below the root: which list an epoch drew from

    def summary(self, examples: int = 10) -> str:
        """A line of counts, skipped files counted by reason, then the first ``examples`` of
        them (all are in skipped_files.txt)."""
        line = f"{sum(map(len, self.images))} images in {len(self.classes)} classes in {self.root}"
        if not self.skipped:
            return line
        reasons = Counter(why.split(" (")[0] for _, why in self.skipped)
        line += f"; skipped {len(self.skipped)} files (" + ", ".join(
            f"{why}: {n}" for why, n in sorted(reasons.items())) + ")"
        shown = [f"  skipped {p}: {why}" for p, why in self.skipped[:examples]]
        if len(self.skipped) > examples:
            shown.append(f"  ... and {len(self.skipped) - examples} more")
        return "\n".join([line, *shown])

    def resume_epoch(self, progress: EpochProgress, ckpt: dict[str, Any], out: Path,
                     train_paths: list[str]) -> None:
        """The epoch a stop interrupted (``ckpt``) ends over the images it began with, new ones
        join at the next: sets ``progress.file_list`` (that list's digest) and, if it is not this
        one, ``progress.indices`` (its images in ``train_paths``, -1: gone)."""
        digest = progress.file_list = ckpt.get("in_epoch") and ckpt.get("file_list") or self.digest
        kept, epoch, saved = out / STOPPED_SCAN_FILE, ckpt["epoch"], ckpt["args"]

        def indices() -> torch.Tensor | None:
            if digest == self.digest:
                return None
            for path in (kept, out / SCAN_FILE):  # kept: a second stop in that epoch
                if (old := _read_scan(path, self.root)) and old.digest == digest:
                    break
            else:  # deleted, or the checkpoint of another run folder
                log.warning("%s lacks the list epoch %d began with: its rest may repeat or miss "
                            "images", out, epoch)
                return None
            os.replace(path, kept)  # SCAN_FILE gets the new list, the epoch keeps its own
            listed = split_train_val(old, saved["val_rate"], saved["seed"],
                                     val_scan=old if saved.get("val_path") else None)[0]
            where = {p: i for i, p in enumerate(train_paths)}
            result = torch.tensor([where.get(p, -1) for p in listed], dtype=torch.int64)
            gone = int((result < 0).sum())
            log.info("%d images added since the stop: they join at epoch %d; %d gone (removed "
                     "or unreadable): epoch %d goes on without them", len(train_paths)
                     - len(listed) + gone, epoch + 1, gone, epoch)
            return result

        progress.indices = run_on_main(indices)

    def write_files(self, out: Path) -> None:
        """Keeps with the run class_indices.json, skipped_files.txt, a class histogram and, last,
        :data:`SCAN_FILE`; a reused scan's are there (and what the loader skipped since)."""
        if self.reused:
            return
        write_json_atomic(out / "class_indices.json", dict(enumerate(self.classes)))
        self.write_skipped(out)
        plot_class_distribution(self.classes, list(map(len, self.images)),
                                out / "class_distribution.png")
        below = [len(os.path.join(self.root, name, "")) for name in self.classes]
        images = [[p[n:] for p in found] for n, found in zip(below, self.images)]  # 1/3 the bytes
        write_json_atomic(out / SCAN_FILE, {**vars(self), "images": images}, compact=True)

    def write_skipped(self, out: Path) -> None:
        """``out/skipped_files.txt``, what was skipped and why, with a warning; none: no file."""
        (out / "skipped_files.txt").unlink(missing_ok=True)  # an earlier scan's would mislead
        if self.skipped:  # nothing is dropped silently
            (out / "skipped_files.txt").write_text(
                "".join(f"{path}\t{why}\n" for path, why in self.skipped), encoding="utf-8")
            log.warning("%s; the list is in %s", self.summary(), out / "skipped_files.txt")

    def rebased(self, root: str) -> FolderScan:
        """The same files below ``root``: each machine reads its own copy of rank 0's scan."""
        if root == self.root:
            return self
        old, new = os.path.join(self.root, ""), os.path.join(root, "")

        def move(path: str) -> str:
            return new + path[len(old):] if path.startswith(old) else path
        return replace(self, root=root, images=[list(map(move, found)) for found in self.images],
                       skipped=[(move(p), why) for p, why in self.skipped])


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
        if entry.is_dir() and not entry.name.startswith("."):  # .git, .cache: no classes
            classes.append(entry.name)
        elif entry.is_symlink() and not os.path.exists(entry.path) and "." not in entry.name:
            raise DataError(f"class folder {printable_path(entry.name)} in {root} is a link to "
                            f"{os.readlink(entry.path)}, which does not exist (storage not "
                            "mounted?); mount it, or remove the link to train without that class.")
        else:
            skipped.append((entry.path, "not in a class folder"))
    return classes, skipped


def _walk_class(folder: str, times: dict[str, list[int]], below: int
                ) -> tuple[list[str], list[tuple[str, str]]]:
    """Image-named files below ``folder`` (sorted) and what was left out, with a reason; each
    folder's :func:`_times` go to ``times``, keyed by the path from character ``below`` on."""
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
            if entry.name.startswith("."):  # .DS_Store, .thumbs/, ._x.jpg: no images
                skipped.append((entry.path, "hidden"))
            elif entry.is_dir() and entry.is_symlink():  # not entered: a link up the tree loops
                skipped.append((entry.path, "linked folder, not followed"))
            elif entry.is_dir():
                todo.append(entry.path)
            elif not entry.name.lower().endswith(IMG_EXTENSIONS):
                skipped.append((entry.path, "not an image extension"))
            elif entry.is_file():
                found.append(entry.path)
            else:  # a FIFO would block its reader
                skipped.append((entry.path, "dangling link or not a regular file"))
    return sorted(found), skipped


def scan_image_folder(root: str | os.PathLike, *, verify: bool = True, min_classes: int = 2,
                      reuse: str | os.PathLike | None = None) -> FolderScan:
    """Find ``root/<class>/**/<image>``, the classes sorted; ``verify`` also reads each image's
    header (:func:`my_dataset.check_image`)."""
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
    if verify:  # header reads wait on storage (PIL releases the GIL): threads help. A class at
        # a time, as map() makes all its futures at once: over a GB for ImageNet's 1.28M files.
        with ThreadPoolExecutor(8) as pool:
            for found in images:
                bad.update((p, why) for p, why in zip(found, pool.map(check_image, found)) if why)
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


def _read_scan(path: Path, root: str) -> FolderScan | None:
    """The scan stored at ``path`` (None if there is none), moved below ``root``."""
    try:
        scan = FolderScan(**json.loads(path.read_text("utf-8")))
    except (OSError, ValueError, TypeError):  # none yet, another version's file
        return None
    folders = [os.path.join(scan.root, name, "") for name in scan.classes]
    images = [[folder + p for p in found] for folder, found in zip(folders, scan.images)]
    return replace(scan, images=images, skipped=[tuple(x) for x in scan.skipped],
                   reused=True).rebased(root)


def _stored_scan(path: Path, root: str, verify: bool) -> FolderScan | None:
    """The scan stored at ``path`` if its folders' times are as then, it read the headers where
    ``verify`` asks and no file it skipped for a :data:`PASSING` reason reads well now."""
    scan = _read_scan(path, root)
    try:
        if not (scan and scan.digest) or scan.verified < verify or not all(
                then and _times(os.path.join(root, folder)) == then
                for folder, then in scan.times.items()):
            return None
    except OSError:  # a folder gone
        return None
    if fixed := [p for p, why in scan.skipped if why.startswith(PASSING) and not check_image(p)]:
        log.info("%d skipped file(s) read well now (%s): %s is listed again", len(fixed),
                 fixed[0], root)
        return None
    log.info("%s is unchanged since %s listed it: not listed again", root, path)
    return scan


def split_train_val(scan: FolderScan, val_rate: float, seed: int,
                    val_scan: FolderScan | None = None
                    ) -> tuple[list[str], list[int], list[str], list[int]]:
    """``(train_paths, train_labels, val_paths, val_labels)``: a file validates when the hash of
    ``(seed, its path below the root)`` is below ``val_rate`` (TensorFlow's ``which_set``), so no
    file changes side as others come and go."""
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
    """The classic tutorial's entry point: :func:`split_train_val` of ``root`` (seed 0), with
    ``class_indices.json`` and (``plot_image``) ``class_distribution.png`` written here."""
    scan = scan_image_folder(root)
    # A warning when files were skipped: shown even by a script that set up no logging.
    log.log(logging.WARNING if scan.skipped else logging.INFO, scan.summary())
    split = split_train_val(scan, val_rate, seed=0)
    write_json_atomic("class_indices.json", dict(enumerate(scan.classes)))
    if plot_image:
        plot_class_distribution(scan.classes, list(map(len, scan.images)),
                                "class_distribution.png")
    log.info("%d images for training, %d for validation", len(split[0]), len(split[2]))
    return split


def imagenet_layout(data_path: str | None, val_path: str | None, *, eval_only: bool = False
                    ) -> tuple[str | None, str | None]:
    """``(data_path, val_path)``, but a ``data_path`` D in torchvision's layout, ``D/train/<class>``
    and ``D/val/<class>``, becomes ``(D/train, D/val)`` (``eval_only``: ``(None, D/val)``)."""
    root = Path(data_path or "")
    train, val = root / "train", root / "val"
    if not data_path or val_path or not train.is_dir():
        return data_path, val_path
    classes = _class_folders(str(train), {})[0]
    if not classes:  # train/ holds images itself: a class named "train"
        return data_path, val_path
    val_classes, loose = _class_folders(str(val), {}) if val.is_dir() else ([], [])
    images = [p for p, _ in loose if p.lower().endswith(IMG_EXTENSIONS)
              and not Path(p).name.startswith(".")]  # macOS's ._x.JPEG: no image, never read
    if images or val_classes != classes:  # ILSVRC2012's val/ ships as one folder of images
        raise DataError(f"{train} holds class folders, so {val} must hold the same ones and no "
                        "image beside them; sort its images so, or give --data-path "
                        f"{train} (which holds out --val-rate of it) and --val-path FOLDER.")
    data_path = None if eval_only else str(train)
    log.info("%s holds train/ and val/: training on %s, validating on %s", root,
             data_path or "none", val)
    return data_path, str(val)
