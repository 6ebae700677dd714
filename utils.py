"""Data helpers: find and split an image folder, write class indices, plot, make demo data."""

from __future__ import annotations

import argparse
import contextlib
import errno
import filecmp
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import stat
import sys
import tempfile
import unicodedata
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFilter
from torchvision.transforms import v2

from multi_train_utils.checkpoint import write_atomic
from multi_train_utils.distributed_utils import is_main_process
from multi_train_utils.train_eval_utils import IMAGENET_MEAN, IMAGENET_STD
from my_dataset import check_image, printable_path

log = logging.getLogger(__name__)

# .jpe and .jfif are JPEG too (Windows and browsers save them); decoders read the content.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".gif", ".tif",
                  ".tiff", ".avif")
# Folder names that mean "already split" (train/val/class/img), not classes.
SPLIT_NAMES = {"train", "training", "val", "valid", "validation", "test", "testing"}


class DataError(ValueError):
    """A problem with the user's data, said in one sentence (what, where, how to fix)."""


# Words that make up the subject of a skip reason ("dangling link or missing file", "file name
# is ..."): the nouns counted and the adjectives before them.
_COUNTED_NOUNS = {"file", "folder", "link", "duplicate", "image", "name"}
_SUBJECT_WORDS = _COUNTED_NOUNS | {"hidden", "empty", "dangling", "missing", "unreadable", "or"}


def _counted(count: int, reason: str) -> str:
    """``reason`` counted: ``"1 hidden file"``, ``"2 hidden files"``, ``"35 images in the data
    root, not in a class folder"``, ``"2 file names are not valid UTF-8; rename them"``, ``"3 not
    readable images"``; a reason without a noun to count is a label: ``"2 permission denied"``,
    ``"30 not an image extension"`` (a file is not an extension)."""
    words = reason.split(" ")
    if count == 1:
        return f"1 {reason}"
    if words[:2] in (["not", "a"], ["not", "an"]) and words[-1] in {"file", "image"}:
        return f"{count} not {' '.join(words[2:])}s"
    # The subject is the leading run of nouns and adjectives; the last noun before the end of
    # the subject or an "or" is what is counted ("file name": names), then its verb agrees.
    end = next((i for i, w in enumerate(words) if w not in _SUBJECT_WORDS), len(words))
    heads = [i for i in range(end) if words[i] in _COUNTED_NOUNS
             and (i + 1 == end or words[i + 1] == "or")]
    for i in heads:
        words[i] += "s"
    if heads and end < len(words):
        words[end] = {"is": "are", "has": "have"}.get(words[end], words[end])
    text = " ".join(words)
    return f"{count} {text.replace('; rename it', '; rename them') if heads else text}"


@dataclass
class FolderScan:
    """What was found under a dataset root: classes (sorted), their images, what was skipped."""

    root: str
    classes: list[str]
    images: list[list[str]]  # images[i]: sorted image paths of classes[i]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    dropped_classes: list[str] = field(default_factory=list)

    def skipped_note(self, examples: int = 3) -> str:
        """``"; skipped 2 file(s): 1 empty file, 1 not a readable image (e.g. a/x.jpg: empty
        file; ...)"`` for an error message: why the images it did not find are missing, with one
        file per reason for the first ``examples`` reasons ("" if nothing was skipped)."""
        if not self.skipped:
            return ""
        by_reason = self._by_reason()
        first = sorted(f"{p}: {why}" for (p, why), *_ in by_reason.values())
        return (f"; skipped {len(self.skipped)} file(s): "
                + ", ".join(_counted(len(v), why) for why, v in sorted(by_reason.items()))
                + f" (e.g. {'; '.join(first[:examples])})")

    def _by_reason(self) -> dict[str, list[tuple[str, str]]]:
        """Skipped ``(path, reason)`` pairs grouped by the reason's short form (before " (")."""
        by_reason: dict[str, list[tuple[str, str]]] = {}
        for path, why in self.skipped:
            by_reason.setdefault(why.split(" (")[0], []).append((path, why))
        return by_reason

    def summary(self) -> str:
        """One paragraph for the log: counts, then what was skipped and why."""
        total = sum(len(x) for x in self.images)
        lines = [f"{total} images in {len(self.classes)} classes under {self.root}"]
        if self.dropped_classes:
            lines.append(f"dropped {len(self.dropped_classes)} class folder(s) with no usable "
                         f"image: {', '.join(self.dropped_classes)}")
        if self.skipped:
            by_reason = self._by_reason()
            lines.append(f"skipped {len(self.skipped)} file(s): "
                         + ", ".join(_counted(len(v), why) for why, v in sorted(by_reason.items())))
            if "not an image extension" in by_reason:
                lines[-1] += f" (read: {' '.join(IMG_EXTENSIONS)})"
            # Up to 20 examples, shared among the reasons: 30 sidecar .txt files must not hide
            # the one corrupt image.
            each = max(1, 20 // len(by_reason))
            shown = sorted(x for items in by_reason.values() for x in items[:each])
            lines += [f"  skipped {p}: {why}" for p, why in shown]
            if len(self.skipped) > len(shown):
                lines.append(f"  ... and {len(self.skipped) - len(shown)} more (see "
                             "skipped_files.txt)")
        return "\n".join(lines)


def _walk_files(folder: str, loops_back: Callable[[str], str | None]
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every file below ``folder`` as ``(path, real path of its folder)``, sorted, and the folders
    left out, as ``(path, reason)``.

    Symlinked folders are followed once (no loops), unless ``loops_back`` gives a reason not to
    for their real path. Hidden and unreadable folders are not entered but reported, so nothing
    below them is lost without a word.
    """
    found: list[str] = []
    skipped: list[tuple[str, str]] = []
    seen: dict[str, str] = {}  # real path -> first path it was walked under

    def unreadable(exc: OSError) -> None:
        # os.walk drops folders it cannot list unless told; the class would vanish unexplained.
        why = "permission denied" if isinstance(exc, PermissionError) else (
            f"unreadable folder ({exc.strerror or type(exc).__name__})")
        skipped.append((exc.filename or folder, why))

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable, followlinks=True):
        real = os.path.realpath(dirpath)  # once per folder, not per file
        why = loops_back(real) or (f"duplicate (same folder as {printable_path(seen[real])})"
                                   if real in seen else None)
        if why:
            skipped.append((dirpath, why))
            dirnames[:] = []
            continue
        seen[real] = dirpath
        skipped += [(os.path.join(dirpath, d), "hidden folder")
                    for d in dirnames if d.startswith(".")]
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [(os.path.join(dirpath, f), real) for f in filenames]
    return sorted(found), skipped


def _real_file(path: str, real_dir: str, loops_back: Callable[[str], str | None]
               ) -> tuple[str | None, str | None]:
    """``(os.path.realpath(path), None)``, or ``(None, why)`` for a dangling link, a link that
    ``loops_back`` refuses, a FIFO or device (reading one blocks forever) or an empty file; for
    the price of one ``lstat``: the folder's real path is known from the walk, so only symlinked
    files need resolving (realpath on every file costs a syscall per path component, seconds on
    ImageNet). These checks hold without ``--verify-images`` too: they cost nothing more than
    the walk."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            st = os.stat(path)
            real = os.path.realpath(path)
            if why := loops_back(real):
                return None, why
        else:
            real = os.path.join(real_dir, os.path.basename(path))
    except PermissionError:  # a folder that may be listed but not entered (no x bit)
        return None, "permission denied"
    except OSError:  # a dangling link, or gone since it was listed
        return None, "dangling link"
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file"
    return (None, "empty file") if st.st_size == 0 else (real, None)


def _dead_class_link(root: str, name: str, exc: OSError) -> str:
    """The error for a link in the data folder that leads nowhere: most likely a class folder on
    storage that is not mounted, whose class would otherwise vanish from the run unsaid."""
    path = os.path.join(root, name)
    try:
        target = os.path.normpath(os.path.join(root, os.readlink(path)))
    except OSError:  # replaced since it was listed
        target = "?"
    where = (f"class folder {printable_path(name)} in {printable_path(root)} is a link to "
             f"{printable_path(target)}")
    fix = "or remove the link to train without that class."
    if isinstance(exc, FileNotFoundError):
        return f"{where}, which does not exist (storage not mounted?); mount it, {fix}"
    if isinstance(exc, PermissionError):
        return (f"{where}, which this user may not open (permission denied); give it read and "
                f"execute access, {fix}")
    why = "it loops back to itself" if exc.errno == errno.ELOOP else exc.strerror or exc
    return f"{where}, which cannot be reached ({why}); point it at the class's images, {fix}"


def _is_utf8(name: str) -> bool:
    """False for names that were not valid UTF-8 on disk (Python keeps those bytes as lone
    surrogates, which fail later when written to skipped_files.txt or class_indices.json)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_utf8(name: str) -> str:
    """Why :func:`_is_utf8` refused ``name``, and the fix: its bytes are not UTF-8 (rename it),
    or they are but this Python decodes file names otherwise (a C or POSIX locale with
    PYTHONUTF8=0: every non-ASCII name fails)."""
    try:
        os.fsencode(name).decode("utf-8")
    except UnicodeDecodeError:
        return "is not valid UTF-8; rename it"
    return (f"is UTF-8, but this Python reads file names as {sys.getfilesystemencoding()}; run "
            "it with PYTHONUTF8=1 (or in a UTF-8 locale, LC_ALL=C.UTF-8)")


def scan_image_folder(root: str, *, verify: bool = True, threads: int = 8,
                      min_classes: int = 2) -> FolderScan:
    """Find ``root/<class>/**/<image>``; classes are the sorted sub-folder names.

    Hidden files and folders, other extensions, names that are not valid UTF-8, unreadable
    folders, dangling links, second paths to an already found file (symlinks; the first in
    sorted order is kept, so one image cannot land in both train and val), links (class
    folders, sub-folders, files) back to the data folder or into another class's real folder
    (its images keep their own class) and (with ``verify``) files that are not readable images
    are skipped and listed; class folders left empty are dropped. Raises :class:`DataError` when
    the root cannot be read, a class folder is a link to nothing (storage not mounted), a class
    folder name is not valid UTF-8, two class folder names look the same, or fewer than
    ``min_classes`` classes with images remain (a test folder scored against a trained model
    may hold one).
    """
    if not os.path.isdir(root):
        what = "is not a folder" if os.path.exists(root) else "does not exist"
        raise DataError(f"data path {root} {what}; expected a folder with one sub-folder of "
                        "images per class (e.g. flower_photos/daisy/*.jpg).")
    try:
        with os.scandir(root) as entries:
            # is_symlink() comes with the listing, without a syscall: only links need a closer look.
            listing = [(entry.name, entry.is_symlink()) for entry in entries]
    except OSError as exc:
        why = "permission denied" if isinstance(exc, PermissionError) else exc.strerror or exc
        raise DataError(f"cannot read data folder {root}: {why}; check its permissions "
                        "(the training user needs read and execute access).") from None
    names = [name for name, _ in listing]
    links = {name for name, is_link in listing if is_link and not name.startswith(".")}
    folders = [d for d in names if not d.startswith(".") and os.path.isdir(os.path.join(root, d))]
    skipped: list[tuple[str, str]] = []
    for name in sorted(links.difference(folders)):
        path = os.path.join(root, name)
        try:
            os.stat(path)  # a link to a file is no class; one to nothing may have been a class
        except OSError as exc:
            # A loose image or another file's name (labels.csv): no class either way.
            if name.lower().endswith(IMG_EXTENSIONS) or re.fullmatch(
                    r".+\.[A-Za-z][A-Za-z0-9]{0,4}", name):
                skipped.append((path, "dangling link"))
                continue
            raise DataError(_dead_class_link(root, name, exc)) from None

    # A link that leads back into the data set would give the images it reaches a second,
    # wrong label: a class folder "Rose" -> roses, sorting first, took all of roses' images (the
    # real ones were then dropped as duplicates); a sub-folder b/up -> .. took every class's.
    # Only the real folder labels its images. Real paths of plain class folders come free from
    # the root's; only links are resolved (once per link, never once per file).
    real_root = os.path.realpath(root)
    plain_classes = {d for d in folders if d not in links}

    def loops_back(real: str, own: str | None = None) -> str | None:
        """Why a link to ``real`` found in class folder ``own`` is not followed, or None."""
        if real == real_root:
            return "link to the data folder"
        if real.startswith(os.path.join(real_root, "")):
            top = real[len(os.path.join(real_root, "")):].split(os.sep, 1)[0]
            if top in plain_classes and top != own:
                return f"link into class {unicodedata.normalize('NFC', top)}"
        return None

    class_names = []
    for name in folders:
        why = name in links and loops_back(os.path.realpath(os.path.join(root, name)))
        if why:
            skipped.append((os.path.join(root, name), why))
        else:
            class_names.append(name)
    # Sorted by the NFC form, as they are named below: a copy whose folder names are NFD
    # (macOS) gets the same class indices.
    class_names.sort(key=lambda d: unicodedata.normalize("NFC", d))
    loose = sum(1 for n in names if n.lower().endswith(IMG_EXTENSIONS) and not n.startswith("."))
    # A class folder given as the data path holds its images itself: name the folder above.
    parent_hint = (f"; it holds {loose} image(s) itself, like one class's folder: did you mean "
                   f"{os.path.dirname(os.path.abspath(root))}?" if loose else ".")
    if not class_names:
        raise DataError(f"data path {root} has no class sub-folders; expected one sub-folder of "
                        f"images per class (e.g. flower_photos/daisy/*.jpg){parent_hint}"
                        + (" Otherwise sort its images into one sub-folder per class." if loose
                           else ""))
    for name in class_names:
        if not _is_utf8(name):
            raise DataError(f"class folder {printable_path(name)} in {printable_path(root)}: "
                            f"its name {_not_utf8(name)} (class names are written to "
                            "class_indices.json and checkpoints).")
    _check_class_names(root, class_names)
    # Images next to the class folders belong to no class: listed, not silently left out.
    skipped += [
        (os.path.join(root, n), "image in the data root, not in a class folder")
        for n in sorted(names) if n.lower().endswith(IMG_EXTENSIONS) and not n.startswith(".")
        and os.path.isfile(os.path.join(root, n))]
    candidates: list[list[str]] = []
    first_of: dict[str, str] = {}  # real path -> first path found for it
    for name in class_names:
        kept = []
        class_dir = os.path.join(root, name)
        in_class = functools.partial(loops_back, own=name)
        files, skipped_dirs = _walk_files(class_dir, in_class)
        skipped += skipped_dirs
        for path, real_dir in files:
            base = os.path.basename(path)
            if base.startswith("."):
                skipped.append((path, "hidden file"))
            elif not _is_utf8(os.path.relpath(path, class_dir)):
                what = "file" if not _is_utf8(base) else "folder"
                skipped.append((path, f"{what} name {_not_utf8(path)}"))
            elif not base.lower().endswith(IMG_EXTENSIONS):
                # os.walk lists a dangling link to a folder as a file; only files that failed
                # the extension test pay for this check.
                dangling = os.path.islink(path) and not os.path.exists(path)
                skipped.append((path, "dangling link" if dangling else "not an image extension"))
            elif (found := _real_file(path, real_dir, in_class))[0] is None:
                skipped.append((path, found[1]))
            elif (real := found[0]) in first_of:
                skipped.append((path, f"duplicate (same file as {printable_path(first_of[real])})"))
            else:
                first_of[real] = path
                kept.append(path)
        candidates.append(kept)

    if verify:
        flat = [p for paths in candidates for p in paths]
        # Header checks are I/O-bound (PIL releases the GIL while reading), so threads help.
        # PIL warns from half its decompression-bomb limit: such photos are fine. (The filter is
        # process-wide state, so it is set here, around the threads, not inside each check.)
        with ThreadPoolExecutor(max(1, threads)) as pool, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            verdicts = {}
            for first in range(0, len(flat), 4096):  # map() makes every future at once: in
                chunk = flat[first:first + 4096]       # chunks (1.28M futures: ~1.4 GB)
                verdicts.update(zip(chunk, pool.map(check_image, chunk)))
        skipped += [(p, why) for p, why in verdicts.items() if why]
        candidates = [[p for p in paths if not verdicts[p]] for paths in candidates]

    classes, images, dropped = [], [], []
    for name, paths in zip(class_names, candidates):
        # The NFC form: "café" copied from macOS (NFD) is the same class as typed elsewhere.
        (classes if paths else dropped).append(unicodedata.normalize("NFC", name))
        if paths:
            images.append(paths)
    # Reported paths must survive being written as UTF-8, whatever bytes the disk holds.
    scan = FolderScan(root=root, classes=classes, images=images,
                      skipped=sorted((printable_path(p), why) for p, why in skipped),
                      dropped_classes=dropped)
    if not classes:
        raise DataError(f"no readable images found under {root} (looked for "
                        f"{', '.join(IMG_EXTENSIONS)} in {len(class_names)} class folders)"
                        f"{scan.skipped_note()}.")
    if len(classes) < min_classes:
        dropped_note = (f"; dropped class folder(s) with no usable image: {', '.join(dropped)}"
                        if dropped else "")
        # flower_photos/ given as its parent: the one "class" holds the class folders.
        parts = [Path(os.path.relpath(path, root)).parts for path in images[0]]
        if not loose and all(len(p) > 2 for p in parts) and len({p[1] for p in parts}) > 1:
            subs = sorted({p[1] for p in parts})
            parent_hint = (f"; its images all sit in {len(subs)} sub-folders of {parts[0][0]} "
                           f"({short_list(subs, 3)}): if those are the classes, pass --data-path "
                           f"{os.path.join(root, parts[0][0])}")
        raise DataError(f"only one class with images under {root} ({classes[0]}){dropped_note}"
                        f"{scan.skipped_note()}; classification needs at least two class folders "
                        f"with images{parent_hint}")
    return scan


def user_path(text: str) -> str:
    """A path flag with ``~`` expanded: it reaches the script unexpanded when quoted or written
    ``--flag=~/data``."""
    return os.path.expanduser(text)


def path_flag(text: str) -> str:
    """``type=`` of a path flag: :func:`user_path`, refusing an empty value. ``--resume "$CKPT"``
    with CKPT unset would otherwise mean "start over" and set an earlier run aside, and
    ``--output-dir ""`` would write the run into the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a path")
    return user_path(text)


# Where a --resume none run keeps the --weights file it started from when it saves its own file
# under that name, with that file's class_indices.json and args.json (train_common).
STARTED_FROM = "started_from"


def same_bytes(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` are one file (a hard link) or hold the same bytes (a copy)."""
    if os.path.samefile(a, b):
        return True
    return os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)


def find_run_file(weights: str | os.PathLike, name: str) -> Path | None:
    """``name`` (``class_indices.json``, ``args.json``) of the run that wrote ``weights``: training
    puts it in --output-dir beside checkpoint.pth, one folder above weights/model-N.pth.

    Weights that a ``--resume none`` run in their folder started from and kept in
    ``started_from/`` have their run's files there: the new run rewrote those beside them."""
    given = Path(os.path.abspath(weights))  # "model-1.pth": its parent's parent is "." again
    for path in dict.fromkeys((given, given.resolve())):  # beside the name, then a link's target
        for folder in (path.parent, path.parent.parent):
            kept = folder / STARTED_FROM / path.relative_to(folder)
            if kept.is_file() and path.is_file() and same_bytes(kept, path):
                path = kept
                break
        for folder in (path.parent, path.parent.parent):
            if (folder / name).is_file():
                return folder / name
    return None


def run_args_near(weights: str | os.PathLike) -> tuple[dict, Path | None]:
    """The ``args.json`` of the run that wrote ``weights`` (see :func:`find_run_file`) and its
    path, or ``({}, None)`` when there is none or it is not a JSON object (said in a warning)."""
    path = find_run_file(weights, "args.json")
    if path is None:
        return {}, None
    try:
        run_args = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("Ignoring %s, which cannot be read as JSON (%s).", path, exc)
        return {}, None
    if not isinstance(run_args, dict):
        log.warning("Ignoring %s, which is not a JSON object.", path)
        return {}, None
    return run_args, path


def _check_class_names(root: str, class_names: list[str]) -> None:
    """Refuse class folders that are not classes: a data set already split into train/ and
    val/ (it would train two classes, "train" and "val"), or two folders whose names look the
    same: one name written in two Unicode forms (NFC/NFD), or names that differ only in spaces
    at the ends, invisible characters (zero-width space, BOM) or compatibility forms
    (full-width letters, ligatures). Each would be two classes nobody can tell apart."""
    def has_sub_folders(name: str) -> bool:
        try:
            with os.scandir(os.path.join(root, name)) as entries:
                return any(e.is_dir() for e in entries)
        except OSError:  # reported by the walk
            return False

    lowered = {n.lower(): n for n in class_names}
    train = lowered.get("train", lowered.get("training"))
    # A train/ of class folders beside val/ or test/ (even an unlabelled test/ of loose images).
    if set(lowered) <= SPLIT_NAMES and len(lowered) > 1 and train and has_sub_folders(train):
        val = next((lowered[n] for n in ("val", "valid", "validation") if n in lowered), None)
        use = (f"--data-path {os.path.join(root, train)} --val-path {os.path.join(root, val)}"
               if val and has_sub_folders(val) else f"--data-path {os.path.join(root, train)} "
               "(this template holds out --val-rate of it for validation)")
        raise DataError(f"data path {root} holds {', '.join(class_names)}, which look like the "
                        f"parts of a data set that is already split, not classes; pass {use}.")
    seen: dict[str, str] = {}
    looks: dict[str, str] = {}
    for name in class_names:
        other = seen.setdefault(unicodedata.normalize("NFC", name), name)
        if other != name:
            raise DataError(f"class folders {ascii(other)} and {ascii(name)} in {root} are one "
                            "name written in two Unicode forms (NFC and NFD, e.g. after a copy "
                            "from macOS), so they would be two classes that look the same; move "
                            "the images of one into the other.")
        # Format characters (category Cf) are dropped before NFKC so that a zero-width space
        # between a letter and its accent does not keep them apart.
        visible = "".join(c for c in name if unicodedata.category(c) != "Cf")
        other = looks.setdefault(unicodedata.normalize("NFKC", visible).strip(), name)
        if other != name:
            raise DataError(f"class folders {ascii(other)} and {ascii(name)} in {root} look the "
                            "same (they differ only in spaces at the ends, invisible characters "
                            "or character forms such as full-width letters), so they would be "
                            "two classes nobody can tell apart; move the images of one into the "
                            "other, or rename one.")


def split_key(path: str, root: str | None) -> str:
    """What the split hashes for ``path``: its path below ``root`` with ``/`` separators, in NFC
    (a moved data set, a Windows machine and a macOS copy give the same key); without ``root``
    the path as given."""
    if root is None:
        return unicodedata.normalize("NFC", path)
    prefix = os.path.join(root, "")
    # The scan's paths start with root: slicing is 10x cheaper than relpath on ImageNet.
    rel = path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, root)
    return unicodedata.normalize("NFC", rel.replace(os.sep, "/"))


def split_key_fraction(seed: int, key: str) -> float:
    """Where a file falls in [0, 1) for the split: a hash of ``--seed`` and its
    :func:`split_key`, the same on every machine, rank and Python run."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def split_train_val(images: Sequence[Sequence[str]], val_rate: float, seed: int = 0,
                    class_names: Sequence[str] | None = None, *, root: str | None = None
                    ) -> tuple[list[str], list[int], list[str], list[int], list[str]]:
    """Stratified split in which each file's side depends only on ``seed`` and its own name.

    A file goes to validation when the hash of ``(seed, its path relative to root)`` falls below
    ``val_rate``, so each class gets about ``n * val_rate`` validation images. Unlike drawing
    ``k`` images per class (the classic template), adding or removing images never moves another
    file across: a run resumed on a grown data set validates on no image it trained on, and a
    moved data root splits the same way (the scheme of TensorFlow's speech_commands
    ``which_set``). Without ``root`` the paths as given are hashed. Returns train paths/labels,
    val paths/labels and warnings (classes with no validation or no training image, one line
    for each kind). ``val_rate=1`` puts every image in validation (evaluation of a test set).
    """
    if not 0 <= val_rate <= 1:
        raise DataError(f"--val-rate {val_rate} must be in [0, 1].")
    train_p, train_y, val_p, val_y = [], [], [], []
    no_val, no_train = [], []
    for label, paths in enumerate(images):
        in_val = [val_rate > 0 and split_key_fraction(seed, split_key(p, root)) < val_rate
                  for p in paths]
        name = str(class_names[label]) if class_names else str(label)
        if paths and not any(in_val) and val_rate > 0:
            no_val.append(f"{name} ({len(paths)})")
        if paths and all(in_val) and val_rate < 1:  # 1: evaluation of every image
            no_train.append(f"{name} ({len(paths)})")
        for path, val in zip(paths, in_val):
            (val_p if val else train_p).append(path)
            (val_y if val else train_y).append(label)
    warnings = []
    if no_val:
        warnings.append(f"{len(no_val)} class(es) got no validation image, so their accuracy is "
                        f"not measured (images per class in brackets): {short_list(no_val)}; add "
                        "images or raise --val-rate")
    if no_train:
        warnings.append(f"{len(no_train)} class(es) got no training image, all theirs went to "
                        f"validation: {short_list(no_train)}; add images or lower --val-rate")
    return train_p, train_y, val_p, val_y, warnings


def label_by_class_name(classes: Sequence[str], val: FolderScan, train_root: str
                        ) -> tuple[list[str], list[int], list[str]]:
    """The images of a separate validation folder (an already split data set's ``val/``),
    labelled by the index of their class folder's name in ``classes`` (the training classes).
    Returns paths, labels and warnings (training classes it has no image of). A class the
    training data lacks is a :class:`DataError`: the model has no output for it."""
    unknown = [c for c in val.classes if c not in classes]
    if unknown:
        raise DataError(f"validation folder {val.root} has class folder(s) that --data-path "
                        f"{train_root} lacks: {short_list(unknown)}; the model has no output for "
                        "them, so name each class folder as in the training data, or remove "
                        "those.")
    index = {name: i for i, name in enumerate(classes)}
    paths, labels = [], []
    for name, images in zip(val.classes, val.images):
        paths += images
        labels += [index[name]] * len(images)
    absent = [c for c in classes if c not in val.classes]
    return paths, labels, [
        f"{len(absent)} class(es) have no image in the validation folder {val.root}, so their "
        f"accuracy is not measured: {short_list(absent)}"] if absent else []


def short_list(items: Sequence[str], n: int = 10) -> str:
    """``a, b, c`` for a short list, the first ``n`` and a count (``... and 95 more``) for a
    long one: a list a log line can hold."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    """Write JSON so a reader never sees half a file (``write_atomic``: temp file + rename)."""
    text = json.dumps(obj, indent=4, ensure_ascii=False)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def read_split_data(root: str, val_rate: float = 0.2, plot_image: bool = False, *,
                    seed: int = 0, output_dir: str | None = ".", verify: bool = True
                    ) -> tuple[list[str], list[int], list[str], list[int]]:
    """The classic template's entry point: scan ``root``, split, write ``class_indices.json``.

    Returns ``(train_images_path, train_images_label, val_images_path, val_images_label)``.
    ``class_indices.json`` (``{"0": "daisy", ...}``) and, with ``plot_image``, the per-class count
    chart ``class_distribution.png`` go to ``output_dir`` (main process only).
    """
    scan = scan_image_folder(root, verify=verify)
    # What was skipped is a warning (once, on the main process): logging's last-resort handler
    # shows it even to a script that never configured logging (the classic template's scripts),
    # where info is silent. Hidden files alone (.DS_Store in every folder) are no news.
    news = scan.dropped_classes or any(why != "hidden file" for _, why in scan.skipped)
    log.log(logging.WARNING if news and is_main_process() else logging.INFO, scan.summary())
    train_p, train_y, val_p, val_y, warnings = split_train_val(scan.images, val_rate, seed,
                                                               scan.classes, root=scan.root)
    for warning in warnings:
        log.warning(warning)
    if output_dir is not None and is_main_process():
        write_json_atomic(Path(output_dir) / "class_indices.json",
                          {str(i): c for i, c in enumerate(scan.classes)})
        if plot_image:
            plot_class_distribution(scan, Path(output_dir) / "class_distribution.png")
    log.info("%d images for training, %d for validation", len(train_p), len(val_p))
    return train_p, train_y, val_p, val_y


@contextlib.contextmanager
def missing_glyphs_ignored() -> Iterator[None]:
    """Class names may be CJK or emoji; matplotlib's default font lacks them and warns once per
    character per figure, burying real warnings. Only that message is silenced, only inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font",
                                category=UserWarning)
        yield


def tick_label(name: str, width: int = 24) -> str:
    """A class name short enough for a plot's axis: a 200-character name took the whole figure
    (tight_layout gave up with a warning, and the plot was clipped)."""
    # Both ends: names that differ only in their ends (…_male, …_female) stay apart.
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "\u2026" + name[len(name) - (width - 1 - head):]


def plot_class_distribution(scan: FolderScan, path: str | os.PathLike) -> Path:
    """Bar chart of images per class, saved as PNG (headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [len(x) for x in scan.images]
    # 0.6 inch per class up to 24 inches: 1000 classes would otherwise be 60,000 px wide.
    fig, ax = plt.subplots(figsize=(min(max(4, 0.6 * len(counts) + 2), 24), 4))
    bars = ax.bar(range(len(counts)), counts, align="center")
    if len(counts) <= 60:  # names and counts while they fit
        ax.bar_label(bars)
        ax.margins(y=0.12)  # room for the tallest bar's count below the title
        # About 7 characters fit under a bar at 0.6 inch: longer names are slanted, not overlapped.
        names = [tick_label(c) for c in scan.classes]
        slant = len(counts) > 6 or max(map(len, names)) > 7
        ax.set_xticks(range(len(counts)), names, rotation=45 if slant else 0,
                      ha="right" if slant else "center")
    ax.set_xlabel("image class")
    ax.set_ylabel("number of images")
    ax.set_title("class distribution")
    with missing_glyphs_ignored():
        fig.tight_layout()
        fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _centre_of_strip(img: torch.Tensor, max_ratio: float = 8.0) -> torch.Tensor:
    """Crop the long side of ``(..., H, W)`` to ``max_ratio`` x the short side, centred.

    Without it a 2 x 20000 strip, resized to a 256 px short side, is 2.5 gigapixels. The val
    centre crop keeps only the middle anyway, but the resize's scale along the long side shifts
    a little, so pixels differ by a few levels: hence only past 8:1, which photos (panoramas
    included) do not reach; their val crop is exactly ImageNet's Resize + CenterCrop.
    """
    h, w = img.shape[-2:]
    side = math.ceil(max_ratio * min(h, w))
    if max(h, w) <= side:
        return img
    return v2.functional.center_crop(img, [min(h, side), min(w, side)])


def get_transforms(img_size: int) -> dict[str, v2.Compose]:
    """The template's augmentations on ``uint8 (3, H, W)`` tensors (normalised later, on device).

    Val resizes the short side to ``img_size * 256 / 224`` then centre-crops, as for ImageNet
    (after cutting a strip longer than 8:1 down to its middle, to bound memory).
    """
    return {
        "train": v2.Compose([v2.RandomResizedCrop(img_size, antialias=True),
                             v2.RandomHorizontalFlip()]),
        "val": v2.Compose([v2.Lambda(_centre_of_strip),
                           v2.Resize(int(img_size * 256 / 224), antialias=True),
                           v2.CenterCrop(img_size)]),
    }


_FILE_BACKENDS = frozenset({"agg", "cairo", "pdf", "pgf", "ps", "svg", "template"})


def plot_data_loader_image(data_loader: torch.utils.data.DataLoader,
                           class_indices: str | os.PathLike = "class_indices.json",
                           save_path: str | os.PathLike | None = None, max_images: int = 8
                           ) -> Path | None:
    """Show (or, headless or with ``save_path``, save) one batch with its class names.

    Handles ``uint8`` batches and ImageNet-normalised float batches (de-normalised for display).
    Returns the saved path, or None when shown on screen.
    """
    import matplotlib
    headless = save_path is not None or not os.environ.get("DISPLAY")
    if headless:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # A backend that only writes files (MPLBACKEND=Agg on a desktop) cannot show: save.
    headless = headless or matplotlib.get_backend().lower() in _FILE_BACKENDS

    names = {}
    if os.path.exists(class_indices):
        with open(class_indices, encoding="utf-8") as f:
            names = json.load(f)
    images, labels = next(iter(data_loader))
    count = min(max_images, images.shape[0])
    cols = min(4, count)
    fig, axes = plt.subplots(math.ceil(count / cols), cols, figsize=(3 * cols, 3 * math.ceil(count / cols)),
                             squeeze=False)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(count):
        img = images[i].float() / 255 if images.dtype == torch.uint8 else images[i].float() * std + mean
        ax = axes.flat[i]
        ax.imshow(img.clamp(0, 1).permute(1, 2, 0).numpy())
        label = int(labels[i])
        ax.set_title(names.get(str(label), str(label)) if label >= 0 else "unreadable")
    fig.tight_layout()
    if headless:
        path = Path(save_path or "data_loader_batch.png")
        fig.savefig(path)
        plt.close(fig)
        return path
    plt.show()
    return None


# ---------------------------------------------------------------- demo data
DEMO_CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")  # as flower_photos


def _draw_demo_image(cls: str, rng: random.Random, size: int):
    """One procedurally drawn "flower" of class ``cls`` on a random leafy or sky background.

    Classes differ by petal colour, petal count/shape and centre (daisy: white petals, yellow
    centre; dandelion: many thin yellow petals; sunflowers: yellow petals, large dark centre;
    roses: red layered disc; tulips: pink-purple cup), with jittered hue, size, position and
    clutter, so the model must find the flower: learnable in a few CPU epochs, not trivial.
    """
    def jitter(rgb: tuple[int, int, int], amount: int = 25) -> tuple[int, ...]:
        return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)

    sky = rng.random() < 0.4
    bg = jitter((110, 160, 220) if sky else (50, 110, 45), 40)
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randrange(4, 10)):  # leaves and blades of grass
        x, y = rng.uniform(0, size), rng.uniform(0, size)
        draw.line([(x, y), (x + rng.uniform(-12, 12), y - rng.uniform(5, 25))],
                  fill=jitter((40, 120, 40), 35), width=rng.randrange(1, 4))

    def ellipse_points(cx, cy, a, b, angle, n=10):
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
                draw.polygon(ellipse_points(px, py, 0.48 * r, width, angle), fill=jitter(colour, 20))
            centre = {"daisy": ((235, 190, 30), 0.25), "sunflowers": ((80, 45, 20), 0.45),
                      "dandelion": ((230, 170, 20), 0.3)}[cls]
            c_r = centre[1] * r
            draw.ellipse([cx - c_r, cy - c_r, cx + c_r, cy + c_r], fill=jitter(centre[0], 20))
        elif cls == "roses":
            base = jitter((200, 25, 45), 30)
            for layer in range(4):
                lr_ = r * (1 - 0.22 * layer)
                shade = tuple(max(0, c - 25 * layer) for c in base)
                draw.polygon(ellipse_points(cx, cy, lr_, lr_ * 0.9, spin + layer, n=7), fill=shade)
        else:  # tulips: a cup of three petals
            colour = jitter(rng.choice(((230, 90, 170), (200, 80, 220), (240, 120, 150))), 20)
            for offset in (-0.45, 0.0, 0.45):
                draw.polygon(ellipse_points(cx + offset * r, cy, 0.35 * r, 0.8 * r, 0.0), fill=colour)
            draw.rectangle([cx - 0.75 * r, cy + 0.15 * r, cx + 0.75 * r, cy + 0.6 * r], fill=colour)
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.7)))


def make_demo_data(root: str | os.PathLike, per_class: int = 120, size: int = 64,
                   seed: int = 0) -> Path:
    """Write the demo dataset (``root/<class>/NNNN.jpg``, 5 flower classes) if absent; return
    ``root``.

    Deterministic for (per_class, size, seed). Safe when several processes call it at once: each
    writes a private temp folder and renames it into place; the first rename wins.
    """
    root = Path(root)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        for cls in DEMO_CLASSES:
            (tmp / cls).mkdir()
            rng = random.Random(f"{seed}-{cls}")
            for i in range(per_class):
                _draw_demo_image(cls, rng, size).save(tmp / cls / f"{i:04d}.jpg", quality=90)
        os.rename(tmp, root)
    except OSError:
        if not root.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def user_cache_dir(instead: str) -> Path:
    """``$XDG_CACHE_HOME`` or ``~/.cache``. Where this user has no home folder (HOME unset and a
    user id the user database does not know: some containers), a DataError that ends with
    ``instead``, the flag that names another folder."""
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"])
    try:
        return Path.home() / ".cache"
    except (RuntimeError, KeyError):  # KeyError: Python before 3.12 on some platforms
        raise DataError("this user has no home folder to keep a cache in (HOME is not set, and "
                        f"the user database has no entry for this user); {instead}.") from None


def default_demo_root() -> Path:
    """Where the demo data is cached: ``$DDP_DEMO_DATA`` or the user's cache folder."""
    if os.environ.get("DDP_DEMO_DATA"):
        return Path(os.environ["DDP_DEMO_DATA"])
    cache = user_cache_dir("pass --demo-dir (or set DDP_DEMO_DATA to) a folder you can write, or "
                           "--data-path your own images")
    return cache / "ddp-template" / "demo_flowers_v1"
