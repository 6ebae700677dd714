"""Bad data never kills a run: odd files are skipped and listed, user mistakes get one clear line.

Most checks call the data helpers directly; a few launch the real script (plain python and
torchrun with 2 gloo processes) to check exit codes, what the user reads and that every rank
stops together.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
import unicodedata
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from conftest import ROOT, TINY_FLAGS, run, torchrun_cmd
from model import get_model
from multi_train_utils.checkpoint import CheckpointError
from multi_train_utils.distributed_utils import DistInfo
from my_dataset import IGNORE_INDEX, MyDataSet, check_image, load_image_tensor, load_pil_image
from train_common import _build_data, _build_model, get_args_parser
from utils import (IMG_EXTENSIONS, DataError, get_transforms, read_split_data, scan_image_folder,
                   split_train_val, write_json_atomic)

LAUNCH = "train_multi_gpu_using_launch.py"
# Class folder names sort as Python sorts str: "café" < "red rose" < "single" < "日本".
USED_CLASSES = ["café", "red rose", "single", "日本"]
BAD_FILES = {  # name -> reason prefix as scan_image_folder reports it
    "corrupt.jpg": "not a readable image",
    "truncated.jpg": "not a readable image",
    "zero.jpg": "empty file",
    "notes.txt": "not an image extension",
    ".DS_Store": "hidden file",
    ".hidden.jpg": "hidden file",
    "text.png": "not a readable image",
    "dangling.jpg": "dangling link",
}


# ---------------------------------------------------------------- data builders
def write_jpeg(path: Path, seed: int, size: tuple[int, int] = (32, 32)) -> Path:
    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    pixels = np.clip(colour + rng.integers(-20, 20, (size[1], size[0], 3)), 0, 255)
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
    return path


def jpeg_without_scan(good: Path, path: Path) -> Path:
    """A JPEG whose header (size, format) and end marker are intact but which has no image data:
    it passes the cheap up-front check and fails only when decoded."""
    data = good.read_bytes()
    path.write_bytes(data[:data.index(b"\xff\xda")] + b"\xff\xd9")  # cut at start-of-scan
    return path


def png_with_damaged_data(path: Path, seed: int = 0) -> Path:
    """A PNG whose header, chunk checksums and end marker are intact but whose compressed pixel
    data is damaged: it passes the up-front check and fails only when decoded."""
    import io
    import zlib

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), np.uint8)).save(
        buf, "PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 4  # the chunk's data; its length is the 4 bytes before
    length = int.from_bytes(data[start - 8:start - 4], "big")
    data[start + 20:start + 60] = np.random.default_rng(seed + 1).bytes(40)
    data[start + length:start + length + 4] = zlib.crc32(data[start - 4:start + length]
                                                         ).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    return path


def _in_child(fn: Callable[[], object]) -> str:
    """What ``fn()`` does in a forked child: "returned", "raised <type>" or "killed by <signal>"
    (a crash in native code must not take pytest down with it)."""
    import signal

    pid = os.fork()
    if pid == 0:
        try:
            fn()
            code = 0
        except Exception as exc:
            code = 3 if isinstance(exc, OSError) else 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return {0: "returned", 3: "raised OSError", 4: "raised another error"}[os.WEXITSTATUS(status)]


def make_class(folder: Path, n: int, seed: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        write_jpeg(folder / f"{i:02d}.jpg", seed * 100 + i)
    return folder


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> Path:
    """Four usable classes (spaces, non-ASCII, a symlinked folder, one with a single image), an
    empty class folder and every kind of junk file.

    Usable images: café 6 + symlinked file = 7, red rose 6, single 1, 日本 6 -> 20.
    """
    base = tmp_path_factory.mktemp("messy")
    root = base / "data"
    rose = make_class(root / "red rose", 6, 1)
    make_class(root / "café", 6, 2)
    make_class(root / "single", 1, 3)
    (root / "empty").mkdir()
    outside = make_class(base / "elsewhere" / "japan", 6, 4)
    (root / "日本").symlink_to(outside, target_is_directory=True)
    (root / "café" / "linked.jpg").symlink_to(write_jpeg(base / "elsewhere" / "real.jpg", 99))
    (root / "café" / "dangling.jpg").symlink_to(base / "elsewhere" / "gone.jpg")

    good = (rose / "00.jpg").read_bytes()
    (rose / "corrupt.jpg").write_bytes(np.random.default_rng(0).bytes(4000))
    (rose / "truncated.jpg").write_bytes(good[:len(good) // 2])
    (rose / "zero.jpg").write_bytes(b"")
    (rose / "notes.txt").write_text("not an image")
    (rose / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (rose / ".hidden.jpg").write_bytes(good)
    (rose / "text.png").write_text("this is text, not a PNG")
    return root


def two_class_data(root: Path, per_class: int) -> Path:
    make_class(root / "a", per_class, 1)
    make_class(root / "b", per_class, 2)
    return root


def combined(res) -> str:
    return res.stdout + res.stderr


# ---------------------------------------------------------------- scanning (unit level)
def test_scan_skips_and_reports_every_kind_of_junk(messy):
    scan = scan_image_folder(str(messy))
    assert scan.classes == USED_CLASSES
    assert [len(x) for x in scan.images] == [7, 6, 1, 6]
    assert scan.dropped_classes == ["empty"]
    # Symlinked file and symlinked class folder are followed.
    assert str(messy / "café" / "linked.jpg") in scan.images[0]
    assert all(p.startswith(str(messy / "日本")) for p in scan.images[3])
    skipped = {Path(p).name: why for p, why in scan.skipped}
    assert set(skipped) == set(BAD_FILES)
    for name, reason in BAD_FILES.items():
        assert skipped[name].startswith(reason), (name, skipped[name])
    summary = scan.summary()
    assert "20 images in 4 classes" in summary
    assert "dropped 1 class folder(s) with no usable image: empty" in summary
    assert summary.count("skipped 8 file(s)") == 1
    assert "3 not readable images" in summary and "2 hidden files" in summary
    # Deterministic: what rank 0 broadcasts is what any rank would have found.
    again = scan_image_folder(str(messy), threads=1)
    assert (again.classes, again.images, again.skipped) == (scan.classes, scan.images,
                                                            scan.skipped)


def test_read_split_data_writes_only_used_classes(messy, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        train_p, train_y, val_p, val_y = read_split_data(str(messy), 0.2, output_dir=str(tmp_path))
    # What was skipped is a warning: a script that set up no logging still sees it (logging's
    # last-resort handler prints warnings only).
    (summary,) = [r for r in caplog.records if "20 images in 4 classes" in r.getMessage()]
    assert summary.levelno == logging.WARNING and "skipped 8 file(s)" in summary.getMessage()
    indices = json.loads((tmp_path / "class_indices.json").read_text(encoding="utf-8"))
    assert indices == {str(i): c for i, c in enumerate(USED_CLASSES)}
    assert len(train_p) + len(val_p) == 20 and set(train_y + val_y) == {0, 1, 2, 3}
    # With a few images per class the hash split can leave a side empty (with seed 0 it puts
    # none of café's 7 in validation, and single's one there): said once per kind.
    assert set(train_y) == {0, 1, 3} and set(val_y) == {1, 2, 3}
    assert caplog.text.count("1 class(es) got no validation image") == 1
    assert "accuracy is not measured (images per class in brackets): café (7);" in caplog.text
    assert "1 class(es) got no training image, all theirs went to validation: single (1)" \
        in caplog.text


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist; expected a folder with one sub-folder of images per class"),
    ("file", "is not a folder; expected a folder"),
    ("no_subfolders", "has no class sub-folders"),
    # Why the images are missing, not only that they are: the skipped files, counted.
    ("no_images", "no readable images found under {root} (looked for {extensions} in 2 class "
                  "folders); skipped 3 file(s): 1 empty file, 1 not a readable image, 1 not an "
                  "image extension (e.g. {root}/b/bad.jpg: not a readable image ("),
    ("one_class_left", "only one class with images under {root} (a); dropped class folder(s) "
                       "with no usable image: b; skipped 1 file(s): 1 empty file (e.g. "
                       "{root}/b/zero.jpg: empty file); classification needs"),
    # --data-path flower_photos/roses: its images lie in it, a sub-folder is one class at most
    ("class_folder", "with images; it holds 2 image(s) itself, like one class's folder: did you "
                     "mean {parent}?"),
    # --data-path one level above flower_photos: its one "class" holds the class folders
    ("parent_folder", "only one class with images under {root} (flower_photos); classification "
                      "needs at least two class folders with images; its images all sit in 2 "
                      "sub-folders of flower_photos (daisy, roses): if those are the classes, "
                      "pass --data-path {root}/flower_photos"),
    # ...but one class whose images sit in a year folder is just that: no such hint
    ("one_nested_class", "only one class with images under {root} (cats); classification needs "
                         "at least two class folders with images."),
])
def test_scan_errors_say_what_and_where(tmp_path, case, message):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "no_subfolders":  # images straight in the root, no class folders
        root.mkdir()
        write_jpeg(root / "a.jpg", 0)
    elif case == "no_images":
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
        (root / "b" / "readme.txt").write_text("hi")
        (root / "b" / "bad.jpg").write_bytes(b"nope")
        (root / "b" / "zero.png").write_bytes(b"")
    elif case == "one_class_left":  # one class emptied by the checks, one with images
        make_class(root / "a", 3, 0)
        (root / "b").mkdir()
        (root / "b" / "zero.jpg").write_bytes(b"")
    elif case == "parent_folder":
        make_class(root / "flower_photos" / "daisy", 2, 0)
        make_class(root / "flower_photos" / "roses", 2, 1)
    elif case == "one_nested_class":
        make_class(root / "cats" / "2019", 2, 0)
    elif case == "class_folder":
        make_class(root / "sub", 3, 0)
        write_jpeg(root / "a.jpg", 0)
        write_jpeg(root / "B.JPG", 1)
    with pytest.raises(DataError) as err:
        scan_image_folder(str(root))
    message = message.format(parent=tmp_path, root=root, extensions=", ".join(IMG_EXTENSIONS))
    assert message in str(err.value) and str(root) in str(err.value)
    if case == "no_images":
        assert str(err.value).endswith(f"; {root}/b/readme.txt: not an image extension; "
                                       f"{root}/b/zero.png: empty file).")
    if case == "no_subfolders":
        assert str(err.value).endswith("it holds 1 image(s) itself, like one class's folder: did "
                                       f"you mean {tmp_path}? Otherwise sort its images into one "
                                       "sub-folder per class.")


def _bytes_path(folder: Path, name: bytes) -> str:
    """A path whose last part is raw bytes (e.g. latin-1), as Python sees it: surrogate-escaped."""
    return os.fsdecode(os.path.join(os.fsencode(folder), name))


def _write_skipped_like_training(scan, out: Path) -> list[str]:
    # As train_common writes skipped_files.txt: this raised UnicodeEncodeError before the fix.
    (out / "skipped_files.txt").write_text("".join(f"{p}\t{why}\n" for p, why in scan.skipped),
                                           encoding="utf-8")
    return (out / "skipped_files.txt").read_text(encoding="utf-8").splitlines()


def test_non_utf8_file_names_are_skipped_and_listed_printably(tmp_path):
    root = two_class_data(tmp_path / "data", 3)
    write_jpeg(Path(_bytes_path(root / "a", b"bad\xff.jpg")), 7)  # a valid image, bad name
    os.mkdir(_bytes_path(root / "b", b"sub\xe9"))
    write_jpeg(Path(_bytes_path(root / "b", b"sub\xe9")) / "ok.jpg", 8)
    scan = scan_image_folder(str(root))
    assert [len(x) for x in scan.images] == [3, 3]
    assert scan.skipped == [
        (str(root / "a" / "bad\\xff.jpg"), "file name is not valid UTF-8; rename it"),
        (str(root / "b" / "sub\\xe9" / "ok.jpg"), "folder name is not valid UTF-8; rename it")]
    (tmp_path / "out").mkdir()
    listed = _write_skipped_like_training(scan, tmp_path / "out")
    assert listed[0] == f"{root / 'a'}/bad\\xff.jpg\tfile name is not valid UTF-8; rename it"
    assert "1 file name is not valid UTF-8; rename it" in scan.summary()


def test_non_utf8_class_folder_is_a_data_error_naming_it(tmp_path):
    root = two_class_data(tmp_path / "data", 2)
    make_class(Path(_bytes_path(root, b"caf\xe9")), 2, 3)
    with pytest.raises(DataError) as err:
        read_split_data(str(root), output_dir=str(tmp_path))
    message = str(err.value)
    assert "class folder caf\\xe9 in" in message and str(root) in message
    assert "not valid UTF-8; rename it" in message
    message.encode("utf-8")  # printable, so the one "error:" line can be shown and logged
    assert not (tmp_path / "class_indices.json").exists()


def test_utf8_names_read_by_a_python_that_is_not_in_utf8_mode_say_how_to_run_it(tmp_path):
    """LC_ALL=C with PYTHONUTF8=0: Python decodes file names as ASCII, so a valid UTF-8 class
    folder was called "not valid UTF-8; rename it"."""
    root = two_class_data(tmp_path / "data", 2)
    make_class(root / "Löwenzahn", 2, 3)
    # The second line: a class name read from a checkpoint is text, and predict.py printed none
    # of its lines.
    code = ("import sys; from utils import scan_image_folder, DataError\n"
            "from my_dataset import printable_path\n"
            "try: scan_image_folder(sys.argv[1])\n"
            "except DataError as exc: print(exc, file=sys.stderr)\n"  # escaped there, as in logs
            "print(ascii(printable_path('L\\u00f6wenzahn')))")
    result = run([sys.executable, "-c", code, str(root)], timeout=60,
                 LC_ALL="C", PYTHONUTF8="0", PYTHONPATH=str(ROOT))
    assert result.stderr.strip() == (
        f"class folder L\\xf6wenzahn in {root}: its name is UTF-8, but this Python reads file "
        "names as ascii; run it with PYTHONUTF8=1 (or in a UTF-8 locale, LC_ALL=C.UTF-8) (class "
        "names are written to class_indices.json and checkpoints)."), result.stderr[-2000:]
    assert result.stdout.strip() == "'L\\xf6wenzahn'", result.stderr[-2000:]


def test_a_dataset_built_without_shared_memory_works_without_workers_only(tmp_path, monkeypatch):
    """/dev/shm read-only: the counters stay private, which a process without loader workers
    can use; a worker would not see set_epoch(), so it raises torch's error instead of
    repeating one epoch's augmentation unseen."""
    root = two_class_data(tmp_path / "data", 1)
    error = ("unable to open shared memory object </torch_1_2_3> in read-write mode: Read-only "
             "file system (30)")

    def read_only(self):
        raise RuntimeError(error)
    monkeypatch.setattr(torch.Tensor, "share_memory_", read_only)
    dataset = MyDataSet([str(p) for p in sorted(root.rglob("*.jpg"))], [0, 1], decoder="tensor")
    dataset.set_epoch(3)
    assert dataset[0][1] == 0 and int(dataset._epoch[0]) == 3
    monkeypatch.setattr("my_dataset.get_worker_info", lambda: object())  # as in a worker
    with pytest.raises(RuntimeError, match=re.escape(error)):
        dataset[0]


def test_running_out_of_file_descriptors_is_not_a_bad_image(tmp_path, monkeypatch):
    """At ulimit -n 32 the loader workers called good images unreadable and trained their
    placeholders: the error is the machine's, and is raised."""
    root = two_class_data(tmp_path / "data", 1)
    dataset = MyDataSet([str(p) for p in sorted(root.rglob("*.jpg"))], [0, 1])

    def no_descriptors(path, *args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr("my_dataset.load_pil_image", no_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        dataset[0]
    assert not dataset._reported.any()


def test_write_json_atomic_cleans_up_and_uses_normal_permissions(tmp_path):
    target = tmp_path / "class_indices.json"
    old_umask = os.umask(0o022)
    try:
        write_json_atomic(target, {"0": "a"})
        assert target.stat().st_mode & 0o777 == 0o644  # mkstemp would give 0o600
        os.umask(0o002)
        write_json_atomic(target, {"0": "b"})
        assert target.stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old_umask)
    with pytest.raises(UnicodeEncodeError):  # a surrogate-escaped name cannot be written
        write_json_atomic(target, {"0": "caf\udce9"})
    with pytest.raises(TypeError):  # not JSON at all
        write_json_atomic(target, {"0": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["class_indices.json"]  # no temp left
    assert json.loads(target.read_text(encoding="utf-8")) == {"0": "b"}  # old file intact


def _deny(monkeypatch, *denied: Path) -> None:
    """Make listing ``denied`` folders fail as chmod 000 would (tests run as root, which
    ignores permission bits)."""
    real_scandir, real_listdir = os.scandir, os.listdir

    def check(path):
        if path is not None and os.fspath(path) in {str(d) for d in denied}:
            raise PermissionError(13, "Permission denied", os.fspath(path))

    def scandir(path="."):
        check(path)
        return real_scandir(path)

    def listdir(path="."):
        check(path)
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)


def test_unreadable_data_root_is_a_data_error(tmp_path, monkeypatch):
    root = two_class_data(tmp_path / "data", 2)
    _deny(monkeypatch, root)
    with pytest.raises(DataError, match="cannot read data folder .*: permission denied") as err:
        scan_image_folder(str(root))
    assert str(root) in str(err.value)


def test_unreadable_class_or_sub_folder_is_listed(tmp_path, monkeypatch):
    root = two_class_data(tmp_path / "data", 2)
    make_class(root / "locked", 2, 3)
    make_class(root / "b" / "private", 2, 4)
    _deny(monkeypatch, root / "locked", root / "b" / "private")
    scan = scan_image_folder(str(root))
    assert scan.classes == ["a", "b"] and [len(x) for x in scan.images] == [2, 2]
    assert scan.dropped_classes == ["locked"]
    assert scan.skipped == [(str(root / "b" / "private"), "permission denied"),
                            (str(root / "locked"), "permission denied")]
    assert "2 permission denied" in scan.summary()
    # An unreadable file: the same words as an unreadable folder, not "not a readable image".
    import my_dataset

    secret = str(root / "a" / "00.jpg")

    def denying_open(file, *args, **kwargs):
        if os.fspath(file) == secret:
            raise PermissionError(13, "Permission denied", secret)
        return open(file, *args, **kwargs)

    monkeypatch.setattr(my_dataset, "open", denying_open, raising=False)
    assert (secret, "permission denied") in scan_image_folder(str(root)).skipped


def test_images_in_the_data_root_are_listed_not_lost(tmp_path):
    root = two_class_data(tmp_path / "data", 2)
    write_jpeg(root / "stray.jpg", 5)
    (root / "README.txt").write_text("not an image, not listed")
    scan = scan_image_folder(str(root))
    assert scan.classes == ["a", "b"] and sum(map(len, scan.images)) == 4
    assert scan.skipped == [(str(root / "stray.jpg"),
                             "image in the data root, not in a class folder")]


def test_a_data_set_already_split_into_train_and_val_is_refused(tmp_path):
    root = tmp_path / "data"
    for part in ("train", "val"):
        two_class_data(root / part, 2)
    with pytest.raises(DataError) as err:
        scan_image_folder(str(root))
    assert str(err.value) == (
        f"data path {root} holds train, val, which look like the parts of a data set that is "
        f"already split, not classes; pass --data-path {root / 'train'} --val-path "
        f"{root / 'val'}.")
    write_jpeg(root / "test.jpg", 9)
    (root / "test").mkdir()  # an unlabelled test/ of loose images beside them
    write_jpeg(root / "test" / "0.jpg", 8)
    with pytest.raises(DataError, match=r"holds test, train, val, which look like the parts"):
        scan_image_folder(str(root))
    shutil.rmtree(root / "val")  # no labelled validation folder: hold out part of train/
    with pytest.raises(DataError) as err:
        scan_image_folder(str(root))
    assert str(err.value).endswith(f"already split, not classes; pass --data-path "
                                   f"{root / 'train'} (this template holds out --val-rate of it "
                                   "for validation).")
    make_class(tmp_path / "flat" / "test", 2, 1)  # a class that happens to be called "test"
    make_class(tmp_path / "flat" / "val", 2, 2)
    assert scan_image_folder(str(tmp_path / "flat")).classes == ["test", "val"]


def test_class_names_are_compared_in_one_unicode_form(tmp_path):
    nfc, nfd = "caf\u00e9", "cafe\u0301"  # the same visible name; macOS writes the second
    root = tmp_path / "data"
    make_class(root / nfd, 2, 1)
    make_class(root / "tea", 2, 2)
    assert scan_image_folder(str(root)).classes == [nfc, "tea"]  # named as typed elsewhere
    # The same data set copied with NFC names and with NFD names (file names too): the same
    # class indices (NFD "cafe\u0301" sorts before "caff", NFC "caf\u00e9" after) and split.
    splits = []
    for form in ("NFC", "NFD"):
        copy_root = tmp_path / form
        for cls, seed in ((f"{nfc}s", 3), ("caff", 4)):
            folder = make_class(copy_root / unicodedata.normalize(form, cls), 0, seed)
            for i in range(30):
                write_jpeg(folder / unicodedata.normalize(form, f"{nfc}{i}.jpg"), seed * 50 + i)
        scan = scan_image_folder(str(copy_root))
        _, _, val_p, val_y, _ = split_train_val(scan.images, 0.3, root=scan.root)
        splits.append((scan.classes, sorted((unicodedata.normalize("NFC", os.path.relpath(
            p, copy_root)), y) for p, y in zip(val_p, val_y))))
    assert splits[0] == splits[1] and splits[0][0] == ["caff", f"{nfc}s"] and splits[0][1]
    make_class(root / nfc, 2, 3)
    with pytest.raises(DataError, match=r"class folders 'cafe\\u0301' and 'caf\\xe9' in .* are "
                                        r"one name written in two Unicode forms"):
        scan_image_folder(str(root))


def test_a_fifo_or_a_photo_too_large_is_skipped_with_its_reason(tmp_path, monkeypatch, recwarn):
    root = two_class_data(tmp_path / "data", 2)
    os.mkfifo(root / "a" / "pipe.jpg")  # opening it would block the scan forever
    Image.new("RGB", (1000, 1000)).save(root / "b" / "huge.png")
    Image.new("RGB", (700, 700)).save(root / "b" / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400_000)  # 1 MP is over twice this
    scan = scan_image_folder(str(root))
    assert dict(scan.skipped) == {
        str(root / "a" / "pipe.jpg"): "not a regular file",
        str(root / "b" / "huge.png"): "image too large (over 1 megapixels, PIL's "
                                      "decompression-bomb limit); downscale it"}
    assert str(root / "b" / "big.png") in scan.images[1]  # over the limit, under twice it
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
    # Without the header checks (--no-verify-images) a FIFO and an empty file are still left
    # out: a loader worker reading the FIFO blocked the run for good, without a word.
    (root / "a" / "zero.jpg").write_bytes(b"")
    quick = dict(scan_image_folder(str(root), verify=False).skipped)
    assert quick == {str(root / "a" / "pipe.jpg"): "not a regular file",
                     str(root / "a" / "zero.jpg"): "empty file"}


def test_summary_shows_examples_of_every_reason_and_the_extensions_read(tmp_path):
    root = two_class_data(tmp_path / "data", 2)
    for i in range(30):
        (root / "a" / f"a{i:02d}.txt").write_text("sidecar")
    (root / "b" / "zz_bad.jpg").write_bytes(b"not a jpeg")
    summary = scan_image_folder(str(root)).summary()
    assert ("skipped 31 file(s): 1 not a readable image, 30 not an image extension (read: .jpg "
            ".jpeg .jpe .jfif .png .bmp .webp .gif .tif .tiff .avif)") in summary
    assert f"  skipped {root / 'b' / 'zz_bad.jpg'}: not a readable image" in summary
    assert summary.count("not an image extension\n") == 10
    assert summary.endswith("... and 20 more (see skipped_files.txt)")


def test_validation_resize_caps_the_long_side_of_a_strip():
    val = get_transforms(32)["val"]
    strip = torch.zeros(3, 2, 20000, dtype=torch.uint8)  # 256 x 2.5M pixels without the cap
    assert val(strip).shape == (3, 32, 32)
    # Up to 8:1 (any photo, panoramas too) it is exactly ImageNet's val crop.
    for size, shape in [(32, (60, 300)), (224, (375, 1000)), (224, (1000, 375)), (32, (400, 50))]:
        image = torch.randint(0, 256, (3, *shape), dtype=torch.uint8)
        plain = v2.Compose([v2.Resize(int(size * 256 / 224), antialias=True), v2.CenterCrop(size)])
        got = get_transforms(size)["val"](image)
        assert got.shape == (3, size, size)
        assert torch.equal(got, plain(image)), shape


def test_without_torchvision_image_decoding_pil_decodes(tmp_path, monkeypatch):
    """torchvision.io's decoders are deprecated (0.29) for TorchCodec: when they are gone the
    loader keeps working through PIL."""
    import my_dataset

    path = write_jpeg(tmp_path / "x.jpg", 0, (40, 30))
    monkeypatch.setattr(my_dataset, "decode_image", None)
    got = load_image_tensor(str(path))
    assert got.dtype == torch.uint8 and torch.equal(got, v2.functional.pil_to_tensor(
        load_pil_image(str(path))))


def test_hidden_folders_in_a_class_are_listed_not_entered(tmp_path):
    root = two_class_data(tmp_path / "data", 2)
    make_class(root / "a" / ".hiddendir", 2, 3)
    (root / "a" / ".hiddendir" / "notes.txt").write_text("inside: must not be listed")
    scan = scan_image_folder(str(root))
    assert [len(x) for x in scan.images] == [2, 2]
    assert scan.skipped == [(str(root / "a" / ".hiddendir"), "hidden folder")]


def test_symlinked_duplicates_are_kept_once(tmp_path):
    root = two_class_data(tmp_path / "data", 3)
    a, b = root / "a", root / "b"
    (tmp_path / "elsewhere").mkdir()
    outside = write_jpeg(tmp_path / "elsewhere" / "real.jpg", 9)
    (a / "link_to_00.jpg").symlink_to(a / "00.jpg")  # same class
    (a / "out.jpg").symlink_to(outside)  # outside the data: "a" sorts first, keeps it
    (b / "out_too.jpg").symlink_to(outside)
    (b / "zz_from_a.jpg").symlink_to(a / "01.jpg")  # into another class: only a labels it
    (a / "aa_from_b.jpg").symlink_to(b / "02.jpg")  # the link sorts first, b keeps its file
    (b / "loop").symlink_to(b, target_is_directory=True)  # a folder loop: walked once
    scan = scan_image_folder(str(root))
    flat = [p for paths in scan.images for p in paths]
    assert len({os.path.realpath(p) for p in flat}) == len(flat) == 7  # 7 real files, each once
    assert scan.images[0] == [str(a / n) for n in ("00.jpg", "01.jpg", "02.jpg", "out.jpg")]
    assert scan.images[1] == [str(b / n) for n in ("00.jpg", "01.jpg", "02.jpg")]
    assert scan.skipped == [
        (str(a / "aa_from_b.jpg"), "link into class b"),
        (str(a / "link_to_00.jpg"), f"duplicate (same file as {a / '00.jpg'})"),
        (str(b / "loop"), f"duplicate (same folder as {b})"),
        (str(b / "out_too.jpg"), f"duplicate (same file as {a / 'out.jpg'})"),
        (str(b / "zz_from_a.jpg"), "link into class a")]
    # One count per reason, however many first paths the duplicates have.
    assert ("skipped 5 file(s): 3 duplicates, 1 link into class a, 1 link into class b"
            in scan.summary())
    _, _, val_p, _, _ = split_train_val(scan.images, 0.5)
    assert not {os.path.realpath(p) for p in val_p} & {
        os.path.realpath(p) for p in flat if p not in val_p}  # no image in both splits


def test_a_class_folder_linked_to_storage_that_is_not_there_is_a_data_error(tmp_path):
    """It was left out without a word: the run trained on the other classes and exited 0."""
    root = two_class_data(tmp_path / "data", 2)
    nas = tmp_path / "nas" / "roses"  # the share, not mounted
    (root / "roses").symlink_to(nas, target_is_directory=True)
    (root / ".old").symlink_to(tmp_path / "gone")  # hidden: ignored, as hidden folders are
    (root / "labels.csv").symlink_to(tmp_path / "gone.csv")  # a file's name: listed, no error
    with pytest.raises(DataError) as err:
        scan_image_folder(str(root))
    assert str(err.value) == (
        f"class folder roses in {root} is a link to {nas}, which does not exist (storage not "
        "mounted?); mount it, or remove the link to train without that class.")
    make_class(nas, 2, 3)  # mounted
    scan = scan_image_folder(str(root))
    assert scan.classes == ["a", "b", "roses"]
    assert scan.skipped == [(str(root / "labels.csv"), "dangling link")]
    (root / "loop").symlink_to("loop")
    with pytest.raises(DataError, match=r"^class folder loop in .* is a link to .*loop, which "
                                        r"cannot be reached \(it loops back to itself\);"):
        scan_image_folder(str(root))


def test_a_dangling_link_in_a_class_folder_is_listed_as_one(tmp_path):
    root = two_class_data(tmp_path / "data", 2)
    (root / "a" / "more").symlink_to(tmp_path / "gone", target_is_directory=True)  # no extension
    (root / "a" / "notes.txt").write_text("a sidecar")
    assert scan_image_folder(str(root)).skipped == [
        (str(root / "a" / "more"), "dangling link"),
        (str(root / "a" / "notes.txt"), "not an image extension")]


def test_links_back_into_the_data_set_do_not_relabel_images(tmp_path):
    """Only an image's real class folder labels it: links to the data folder or into another
    class are skipped (they gave class c's images class b's label, and c was dropped)."""
    root = tmp_path / "data"
    for i, cls in enumerate(("a", "b", "c", "roses")):
        make_class(root / cls, 2, i)
    make_class(root / "c" / "sub", 1, 7)
    outside = make_class(tmp_path / "elsewhere" / "japan", 2, 8)
    (root / "b" / "up").symlink_to("..", target_is_directory=True)  # ln -s .. DATA/b/up
    (root / "b" / "cc").symlink_to(root / "c" / "sub", target_is_directory=True)
    (root / "b" / "own").symlink_to(root / "b", target_is_directory=True)  # same class: a loop
    (root / "Rose").symlink_to("roses", target_is_directory=True)  # sorts before "roses"
    (root / "all").symlink_to(".", target_is_directory=True)
    (root / "日本").symlink_to(outside, target_is_directory=True)  # outside: a class as before
    (root / "a" / "x.jpg").symlink_to("../b/01.jpg")  # "a" sorts first
    (root / "a" / "out.jpg").symlink_to(write_jpeg(tmp_path / "elsewhere" / "x.jpg", 9))
    scan = scan_image_folder(str(root))
    assert scan.classes == ["a", "b", "c", "roses", "日本"] and not scan.dropped_classes
    assert scan.images == [
        [str(root / "a" / n) for n in ("00.jpg", "01.jpg", "out.jpg")],
        [str(root / "b" / n) for n in ("00.jpg", "01.jpg")],
        [str(root / "c" / n) for n in ("00.jpg", "01.jpg", "sub/00.jpg")],
        [str(root / "roses" / n) for n in ("00.jpg", "01.jpg")],
        [str(root / "日本" / n) for n in ("00.jpg", "01.jpg")]]
    assert scan.skipped == [
        (str(root / "Rose"), "link into class roses"),
        (str(root / "a" / "x.jpg"), "link into class b"),
        (str(root / "all"), "link to the data folder"),
        (str(root / "b" / "cc"), "link into class c"),
        (str(root / "b" / "own"), f"duplicate (same folder as {root / 'b'})"),
        (str(root / "b" / "up"), "link to the data folder")]
    assert "2 links to the data folder" in scan.summary()


@pytest.mark.parametrize("twin", ["cat ", " cat", "ca\u200bt", "\ufeffcat", "\uff43\uff41\uff54"])
def test_class_folder_names_that_look_the_same_are_refused(tmp_path, twin):
    """Trailing space, zero-width space, BOM, full-width letters: two classes nobody can tell
    apart, as with NFC/NFD."""
    root = tmp_path / "data"
    make_class(root / "cat", 2, 1)
    make_class(root / twin, 2, 2)
    make_class(root / "Cat", 2, 3)  # another case is visibly another name
    names = sorted(["cat", twin], key=lambda n: unicodedata.normalize("NFC", n))
    with pytest.raises(DataError) as err:
        scan_image_folder(str(root))
    assert str(err.value) == (
        f"class folders {ascii(names[0])} and {ascii(names[1])} in {root} look the same (they "
        "differ only in spaces at the ends, invisible characters or character forms such as "
        "full-width letters), so they would be two classes nobody can tell apart; move the "
        "images of one into the other, or rename one.")


def test_jfif_and_jpe_files_are_read_as_jpeg(tmp_path):
    root = two_class_data(tmp_path / "data", 1)
    jpeg = (root / "a" / "00.jpg").read_bytes()
    for name in ("b/photo.JFIF", "b/photo.jpe"):
        (root / name).write_bytes(jpeg)
    scan = scan_image_folder(str(root))
    assert not scan.skipped
    assert scan.images[1] == [str(root / "b" / n) for n in ("00.jpg", "photo.JFIF", "photo.jpe")]
    expected = load_image_tensor(str(root / "a" / "00.jpg"))
    for path in scan.images[1][1:]:
        assert torch.equal(load_image_tensor(path), expected)
        assert torch.equal(v2.functional.pil_to_tensor(load_pil_image(path)), expected)


def test_split_keeps_every_file_on_its_side_when_the_data_changes():
    images = [[f"/data/c{c}/{i:04d}.jpg" for i in range(1000)] for c in range(3)]
    train_p, train_y, val_p, val_y, warnings = split_train_val(images, 0.2, root="/data")
    assert warnings == [] and sorted(train_p + val_p) == sorted(sum(images, []))
    for label in range(3):  # stratified: about val_rate of each class
        assert 170 <= val_y.count(label) <= 230
    assert all(f"/c{y}/" in p for p, y in zip(train_p + val_p, train_y + val_y))
    # Images added to one class and removed from another: no file changes side.
    grown = [images[0] + [f"/data/c0/new{i}.jpg" for i in range(300)], images[1][::2], images[2]]
    g_train, _, g_val, _, _ = split_train_val(grown, 0.2, root="/data")
    assert not set(g_val) & set(train_p) and not set(g_train) & set(val_p)
    assert set(val_p) - set(g_val) == set(images[1][1::2]) & set(val_p)
    # A moved data root splits the same way; another seed draws another split.
    moved = [[p.replace("/data/", "/scratch/flowers/") for p in ps] for ps in images]
    m_val = split_train_val(moved, 0.2, root="/scratch/flowers")[2]
    assert [p.replace("/scratch/flowers/", "/data/") for p in m_val] == val_p
    assert split_train_val(images, 0.2, seed=1, root="/data")[2] != val_p


def test_split_names_classes_left_without_a_side_once_and_val_rate_zero_is_empty():
    images = [[f"c{c}/{i}.jpg" for i in range(3)] for c in range(12)]
    names = [f"class{c}" for c in range(12)]
    *_, val_y, warnings = split_train_val(images, 1e-9, class_names=names)
    assert val_y == [] and warnings == [
        "12 class(es) got no validation image, so their accuracy is not measured (images per "
        "class in brackets): " + ", ".join(f"class{c} (3)" for c in range(10)) + " and 2 more; "
        "add images or raise --val-rate"]
    train_p, *_, warnings = split_train_val(images, 1 - 1e-9, class_names=names)
    assert train_p == [] and warnings[0].startswith("12 class(es) got no training image, all "
                                                    "theirs went to validation: class0 (3), ")
    _, train_y, val_p, _, warnings = split_train_val(images, 0.0)
    assert val_p == [] and len(train_y) == 36 and warnings == []


def test_build_data_rejects_empty_val_split_and_too_few_images(tmp_path):
    single = two_class_data(tmp_path / "single", 1)  # both images hash above 0.1: training
    args = get_args_parser().parse_args(
        ["--data-path", str(single), *TINY_FLAGS, "--output-dir", str(tmp_path / "out"),
         "--val-rate", "0.1"])
    (tmp_path / "out").mkdir()
    with pytest.raises(DataError, match=r"validation split of .* is empty \(val rate 0.1\)"):
        _build_data(args, DistInfo(), tmp_path / "out")
    root = two_class_data(tmp_path / "data", 4)
    args.data_path = str(root)
    # 8 images, 1 to val (seed 0's hash): 7 training images for 2 processes x 4 (single
    # process here, the check only reads world_size; the torchrun test below runs it for real).
    args.val_rate = 0.25
    with pytest.raises(DataError, match=r"7 training images are fewer than world size 2 x "
                                        r"batch size 4 = 8"):
        _build_data(args, DistInfo(world_size=2), tmp_path / "out")


def test_the_more_workers_hint_is_logged_on_cuda(tmp_path, caplog, monkeypatch):
    """_build_data names the --workers to try on a GPU process with CPUs beyond the cap (the
    loaders are only built here, so a CPU machine can stand in for the GPU one)."""
    import train_common
    monkeypatch.setattr(train_common, "cpus_per_process", lambda: 12)
    root = two_class_data(tmp_path / "data", 12)
    args = get_args_parser().parse_args(["--data-path", str(root), "--img-size", "32",
                                         "--batch-size", "16", "--epochs", "1",
                                         "--output-dir", str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    gpu = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="train"):
        _build_data(args, DistInfo(device=gpu), tmp_path / "out")
    hints = [r.getMessage() for r in caplog.records if "try --workers" in r.getMessage()]
    assert hints == ["the default stops at 8 loader workers per process, and this one has 12 "
                     "CPUs: if training waits for data, try --workers 11 (README: On an H200)."]


def test_a_separate_validation_folder_is_labelled_by_class_name(tmp_path, caplog):
    """--val-path: every --data-path image trains; the validation folder's images take the
    index of their class's name among the training classes, whichever of them it holds."""
    train = tmp_path / "train"
    for name, n in (("apple", 3), ("fig", 4), ("kiwi", 5)):
        make_class(train / name, n, n)
    val = tmp_path / "val"
    make_class(val / "fig", 2, 7)
    make_class(val / "kiwi", 3, 8)  # no apple: the first class, so its own index would be off
    (val / "kiwi" / "notes.txt").write_text("junk")
    args = get_args_parser().parse_args(["--data-path", str(train), "--val-path", str(val),
                                         *TINY_FLAGS, "--output-dir", str(tmp_path / "out")])
    scan, val_scan, train_set, val_set, *_ = _build_data(args, DistInfo(), tmp_path / "out")
    assert scan.classes == ["apple", "fig", "kiwi"] and val_scan.skipped == [
        (str(val / "kiwi" / "notes.txt"), "not an image extension")]
    assert sorted(train_set.images_path) == sorted(str(p) for p in train.glob("*/*.jpg"))
    # an unreadable training image gives way to a readable one; a validation image is not scored
    assert train_set.replace_unreadable and not val_set.replace_unreadable
    labels = {Path(p).relative_to(val).as_posix(): int(y)
              for p, y in zip(val_set.images_path, val_set.images_class)}
    assert labels == {"fig/00.jpg": 1, "fig/01.jpg": 1,
                      "kiwi/00.jpg": 2, "kiwi/01.jpg": 2, "kiwi/02.jpg": 2}
    assert (f"1 class(es) have no image in the validation folder {val}, so their accuracy is "
            "not measured: apple") in caplog.messages

    make_class(val / "Apple", 1, 9)  # a name the training data lacks (here: by case)
    with pytest.raises(DataError) as err:
        _build_data(args, DistInfo(), tmp_path / "out")
    assert str(err.value) == (f"validation folder {val} has class folder(s) that --data-path "
                              f"{train} lacks: Apple; the model has no output for them, so name "
                              "each class folder as in the training data, or remove those.")


# ---------------------------------------------------------------- checks and decoding
def test_check_image_reads_headers_only(tmp_path, monkeypatch):
    good = write_jpeg(tmp_path / "good.jpg", 0, (500, 375))
    png = tmp_path / "good.png"
    Image.open(good).save(png)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    assert check_image(str(truncated)).startswith("not a readable image")

    def no_decode(self):
        raise AssertionError("check_image decoded a complete file")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert check_image(str(good)) is None and check_image(str(png)) is None
    assert check_image(str(tmp_path / "missing.jpg")) == "dangling link or missing file"


@pytest.mark.parametrize("broken_kind", ["jpeg", "png"])
@pytest.mark.parametrize("decoder", ["tensor", "pil"])
def test_unreadable_at_load_time_becomes_ignored_placeholder(tmp_path, decoder, broken_kind):
    goods = [write_jpeg(tmp_path / f"{i}.jpg", i, (20, 12)) for i in range(5)]
    broken = (jpeg_without_scan(goods[0], tmp_path / "broken.jpg") if broken_kind == "jpeg"
              else png_with_damaged_data(tmp_path / "broken.png"))
    # Pillow 13's up-front header check passes the JPEG (Pillow 12's, on Python 3.10, refuses
    # it already); the loader must handle it either way.
    verdict = check_image(str(broken))
    assert verdict is None or (broken_kind == "jpeg" and verdict.startswith("not a readable image"))
    # torchvision's PNG decoder crashes the process on this one (SIGSEGV): it must raise.
    assert _in_child(lambda: load_image_tensor(str(broken))) == "raised OSError"
    paths = [str(p) for p in goods[:2]] + [str(broken)] + [str(p) for p in goods[2:]]
    labels = [1, 1, 0, 1, 0, 1]
    to_tensor = [] if decoder == "tensor" else [v2.PILToTensor()]
    ds = MyDataSet(paths, labels, v2.Compose([*to_tensor, v2.Resize((8, 8), antialias=True)]),
                   decoder=decoder)
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=MyDataSet.collate_fn)
    images, got = zip(*loader)
    images, got = torch.cat(images), torch.cat(got)
    assert got.tolist() == [1, 1, IGNORE_INDEX, 1, 0, 1]
    assert images.shape == (6, 3, 8, 8) and images.dtype == torch.uint8
    assert images[2].sum() == 0 and images[3].float().mean() > 0  # black placeholder only


def test_a_training_set_replaces_unreadable_images_by_readable_ones_of_their_class(tmp_path):
    """Placeholders pass through BatchNorm in training and drag its statistics (half the files
    unreadable: val loss 190-11,000 after an epoch, against under 1): a training set gives a
    readable sample of the same class instead (of another class if it has none), each
    unreadable file is still reported once and read once, and a validation set, whose
    unreadable samples are not scored, keeps placeholders."""
    goods = [write_jpeg(tmp_path / f"{i}.jpg", i, (20, 12)) for i in range(4)]
    bad = [str(jpeg_without_scan(goods[0], tmp_path / f"bad{i}.jpg")) for i in range(40)]
    # class 0: 3 readable files and a run of 30 unreadable ones; class 1: 1 and 10
    paths = [str(goods[0]), *bad[:30], str(goods[1]), str(goods[2]), str(goods[3]), *bad[30:]]
    labels = [0] * 33 + [1] * 11
    log_file = tmp_path / "skipped.txt"
    ds = MyDataSet(paths, labels, decoder="tensor", seed=0, replace_unreadable=True,
                   skip_log=log_file, report_errors=False)
    reads = []
    ds._load = lambda path, load=ds._load: reads.append(path) or load(path)
    stand_ins = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = [ds[i] for i in range(len(ds))]
        assert [label for _, label in got] == labels, epoch
        by_image = {tuple(img.flatten()[:64].tolist()): p for p, (img, _) in zip(paths, got)
                    if not p.startswith(str(tmp_path / "bad"))}
        stand_ins.append([by_image[tuple(img.flatten()[:64].tolist())] for img, _ in got[1:31]])
    # drawn at random among the 3 readable files of class 0, not one neighbour for all
    assert set(stand_ins[0]) == {str(goods[0]), str(goods[1]), str(goods[2])}
    assert stand_ins[1] != stand_ins[0]  # and anew each epoch
    # The same whichever unreadable files were met before (a resumed run knows none yet).
    for epoch in (2, 0):
        fresh = MyDataSet(paths, labels, decoder="tensor", seed=0, replace_unreadable=True,
                          report_errors=False)
        fresh.set_epoch(epoch)
        images = [fresh[i][0] for i in reversed(range(1, 31))]  # in another order, too
        assert [by_image[tuple(img.flatten()[:64].tolist())] for img in images[::-1]
                ] == stand_ins[epoch]
    assert len([p for p in reads if p in bad]) == 40  # each unreadable file read once
    assert sorted(Path(line.split("\t")[0]).name for line in log_file.read_text().splitlines()
                  ) == sorted(Path(p).name for p in bad)
    lonely = MyDataSet([str(goods[0]), bad[0]], [0, 1], decoder="tensor",
                       replace_unreadable=True, report_errors=False)
    assert lonely[1][1] == 0  # no readable image of its class: one of another class
    everything_bad = MyDataSet(bad[:3], [5] * 3, decoder="tensor", replace_unreadable=True,
                               report_errors=False)
    assert [everything_bad[i][1] for i in range(3)] == [IGNORE_INDEX] * 3
    val = MyDataSet(paths[:3], labels[:3], decoder="tensor", report_errors=False)
    assert [val[i][1] for i in range(3)] == [0, IGNORE_INDEX, IGNORE_INDEX]  # not scored


def test_an_animated_gif_is_not_decoded_frame_by_frame(tmp_path, monkeypatch):
    """torchvision decodes every frame to give the first: a 300-frame 1000 px GIF of 56 KB
    took 858 MiB in each worker; only the first frame is decoded (by PIL)."""
    path, first, _ = _write_mode("animated-gif", tmp_path / "anim")
    import my_dataset

    shapes = []

    def spy(*args, **kwargs):
        out = decode(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    decode = my_dataset.decode_image
    monkeypatch.setattr(my_dataset, "decode_image", spy)
    got = load_image_tensor(str(path))
    assert torch.equal(got, torch.from_numpy(first).permute(2, 0, 1))
    assert not [shape for shape in shapes if len(shape) == 4], shapes


def test_a_large_photo_below_the_bomb_limit_is_decoded_without_a_warning(tmp_path, monkeypatch):
    """PIL warns from half its limit, at the open: the filter was set after it."""
    path = write_jpeg(tmp_path / "big.jpg", 0, (16, 8))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 128 px: over the warning, under 200
    with pytest.warns(Image.DecompressionBombWarning):
        Image.open(path).close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_pil_image(str(path)).size == (16, 8)
    assert not [w for w in caught if w.category is Image.DecompressionBombWarning]


def test_unreadable_image_is_reported_once(tmp_path, caplog):
    broken = jpeg_without_scan(write_jpeg(tmp_path / "g.jpg", 0), tmp_path / "broken.jpg")
    ds = MyDataSet([str(broken)], [3], decoder="tensor")
    with caplog.at_level(logging.WARNING, logger="my_dataset"):
        assert ds[0][1] == IGNORE_INDEX and ds[0][1] == IGNORE_INDEX
    assert caplog.text.count(f"skipping unreadable image {broken}") == 1


def test_many_unreadable_images_log_a_few_lines_and_list_them_all(tmp_path, caplog):
    """A dirty folder under --no-verify-images: 3,581 warning lines in 20 s before; now the
    first MAX_LOGGED_ERRORS, the last saying where the rest are, and every one in the file."""
    from my_dataset import MAX_LOGGED_ERRORS

    broken = jpeg_without_scan(write_jpeg(tmp_path / "g.jpg", 0), tmp_path / "broken.jpg")
    count = MAX_LOGGED_ERRORS + 15
    paths = []
    for i in range(count):
        paths.append(tmp_path / f"bad{i:03d}.jpg")
        shutil.copy(broken, paths[-1])
    log_file = tmp_path / "skipped_files.txt"
    log_file.write_text("", encoding="utf-8")
    ds = MyDataSet([str(p) for p in paths], [0] * count, decoder="tensor", skip_log=log_file)
    with caplog.at_level(logging.WARNING, logger="my_dataset"):
        assert all(ds[i][1] == IGNORE_INDEX for i in range(count))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_LOGGED_ERRORS
    assert lines[-1].endswith(f"; further ones are not logged one by one, see {log_file}")
    listed = [line.split("\t")[0] for line in log_file.read_text(encoding="utf-8").splitlines()]
    assert listed == [str(p) for p in paths]  # nothing lost, once each

    # The file rewritten behind this process's back (rank 0 does so before training): its
    # view is read again, so a file reported before is listed again, once.
    log_file.write_text("other\tx\n", encoding="utf-8")
    again = MyDataSet([str(paths[0])], [0], decoder="tensor", report_errors=False,
                      skip_log=log_file)
    ds._reported.zero_()
    assert ds[1][1] == again[0][1] == IGNORE_INDEX
    assert [line.split("\t")[0] for line in log_file.read_text(encoding="utf-8").splitlines()] \
        == ["other", str(paths[1]), str(paths[0])]


@pytest.mark.parametrize("persistent", [False, True])
def test_unreadable_at_load_time_goes_to_skip_log_once(tmp_path, persistent):
    good = write_jpeg(tmp_path / "g.jpg", 0)
    broken = jpeg_without_scan(good, tmp_path / "broken.jpg")
    odd = jpeg_without_scan(good, Path(_bytes_path(tmp_path, b"bad\xff.jpg")))
    log_file = tmp_path / "out" / "skipped_files.txt"
    log_file.parent.mkdir()
    log_file.write_text("from/the/scan.jpg\tempty file\n", encoding="utf-8")
    # Every rank logs (report_errors off here: the file must not depend on it).
    ds = MyDataSet([str(good), str(broken), str(odd)], [0, 1, 1], decoder="tensor",
                   report_errors=False, skip_log=log_file)
    loader = DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=persistent,
                        collate_fn=MyDataSet.collate_fn)
    for _ in range(3):  # each bad sample meets a different worker over the epochs
        assert torch.cat([y for _, y in loader]).tolist() == [0, IGNORE_INDEX, IGNORE_INDEX]
    # Another rank (its own dataset and marks) meets the same files after the shuffle.
    other_rank = MyDataSet([str(odd), str(broken)], [1, 1], decoder="tensor",
                           report_errors=False, skip_log=log_file)
    assert [other_rank[i][1] for i in (0, 1)] == [IGNORE_INDEX, IGNORE_INDEX]
    lines = log_file.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "from/the/scan.jpg\tempty file"  # appended, not overwritten
    assert sorted(line.split("\t")[0] for line in lines[1:]) == [
        str(tmp_path / "bad\\xff.jpg"), str(broken)]  # once each, printable
    assert all(line.split("\t")[1].startswith("not a readable image at load time (")
               for line in lines[1:])


def _exif_image(path: Path, orientation: int) -> Path:
    # 48 wide x 24 high, four flat colour blocks, so a rotation is visible in shape and pixels.
    pixels = np.zeros((24, 48, 3), np.uint8)
    pixels[:12, :24], pixels[:12, 24:] = (255, 0, 0), (0, 255, 0)
    pixels[12:, :24], pixels[12:, 24:] = (0, 0, 255), (255, 255, 0)
    exif = Image.Exif()
    exif[0x0112] = orientation
    lossless = {".jpg": {"quality": 95}, ".webp": {"lossless": True}}.get(path.suffix, {})
    Image.fromarray(pixels).save(path, exif=exif, **lossless)
    return path


def _write_mode(kind: str, path_base: Path) -> tuple[Path, np.ndarray, float]:
    """A file in an awkward mode, the RGB pixels it must decode to ``(H, W, 3)`` and the
    tolerance in levels (lossless: per pixel; JPEG: mean, decoders differ slightly)."""
    ramp = np.tile(np.linspace(0, 255, 32).astype(np.uint8), (16, 1))
    if kind == "L":
        path = path_base.with_suffix(".png")
        Image.fromarray(ramp, "L").save(path)
        return path, np.repeat(ramp[..., None], 3, axis=2), 0
    if kind == "P":
        path = path_base.with_suffix(".png")
        rgb = np.zeros((16, 32, 3), np.uint8)
        rgb[:, 16:] = (200, 30, 90)
        rgb[8:, :16] = (10, 220, 40)
        Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(path)
        assert Image.open(path).mode == "P"
        return path, rgb, 0
    if kind == "RGBA":
        path = path_base.with_suffix(".png")
        rgba = np.zeros((16, 32, 4), np.uint8)
        rgba[..., 0], rgba[..., 1], rgba[..., 2] = ramp, 255 - ramp, 77
        rgba[..., 3] = np.linspace(0, 255, 16).astype(np.uint8)[:, None]
        Image.fromarray(rgba, "RGBA").save(path)
        return path, rgba[..., :3], 0
    if kind == "CMYK":
        path = path_base.with_suffix(".jpg")
        rgb = np.zeros((16, 32, 3), np.uint8)
        rgb[:, :16], rgb[:, 16:] = (220, 40, 40), (30, 60, 200)
        Image.fromarray(rgb).convert("CMYK").save(path, quality=95)
        assert Image.open(path).mode == "CMYK"
        return path, rgb, 3
    if kind == "I;16":
        path = path_base.with_suffix(".png")
        values = np.tile(np.linspace(0, 65535, 32).astype(np.uint16), (16, 1))
        values[:, 15] = 32768  # mid-gray must become ~128, not 255
        Image.fromarray(values).save(path)
        assert Image.open(path).mode.startswith("I;16")
        return path, np.repeat((values >> 8).astype(np.uint8)[..., None], 3, axis=2), 1
    if kind in ("F", "I"):  # 32-bit float in [0, 1] / 32-bit int in [0, 255] (TIFF)
        path = path_base.with_suffix(".tif")
        values = ramp / 255.0 if kind == "F" else ramp.astype(np.int32)
        Image.fromarray(values.astype(np.float32 if kind == "F" else np.int32), kind).save(path)
        assert Image.open(path).mode == kind
        return path, np.repeat(ramp[..., None], 3, axis=2), 1
    if kind == "animated-gif":  # decode_image gives (frames, 3, H, W); we train on frame 0
        path = path_base.with_suffix(".gif")
        frames = [np.zeros((16, 32, 3), np.uint8) for _ in range(3)]
        frames[0][:, :16], frames[1][:] = (255, 0, 0), (0, 0, 255)
        Image.fromarray(frames[0]).save(path, save_all=True, duration=100, loop=0,
                                        append_images=[Image.fromarray(f) for f in frames[1:]])
        assert Image.open(path).n_frames == 3
        return path, frames[0], 0
    # "exif6" is a JPEG; "png-exif6"/"webp-exif6" (torchvision.io orients only JPEG and PNG)
    suffix, _, orientation = kind.rpartition("exif")
    orientation = int(orientation)
    path = _exif_image(path_base.with_suffix("." + (suffix.rstrip("-") or "jpg")), orientation)
    with Image.open(path) as img:
        assert img.size == (48, 24) and img.getexif()[0x0112] == orientation
        expected = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
        stored = np.asarray(img.convert("RGB"))
    # 5-8 turn it (now 48 high, 24 wide); 2-4 mirror or flip it in place
    assert expected.shape == ((48, 24, 3) if orientation >= 5 else (24, 48, 3))
    assert expected.shape != stored.shape or not np.array_equal(expected, stored)
    return path, expected, 3 if path.suffix == ".jpg" else 0


@pytest.mark.parametrize("kind", ["L", "P", "RGBA", "CMYK", "I;16", "F", "I", "exif6", "exif8",
                                  "png-exif6", "webp-exif6", "webp-exif2", "animated-gif"])
def test_awkward_modes_decode_to_uint8_rgb(tmp_path, kind):
    path, expected, tol = _write_mode(kind, tmp_path / "img")
    tensor = load_image_tensor(str(path))
    pil = load_pil_image(str(path))
    assert pil.mode == "RGB"
    pil = torch.from_numpy(np.array(pil)).permute(2, 0, 1)
    want = torch.from_numpy(expected).permute(2, 0, 1)
    for name, got in (("tensor", tensor), ("pil", pil)):
        assert got.dtype == torch.uint8 and got.shape == want.shape, (name, got.shape)
        err = (got.float() - want.float()).abs()
        assert err.mean() <= tol, (name, float(err.mean()), float(err.max()))
        if tol <= 1:  # lossless source: every pixel exact (16 -> 8 bit: within one level)
            assert err.max() <= tol, (name, float(err.max()))
    if kind == "I;16":
        for got in (tensor, pil):
            assert abs(int(got[0, 0, 15]) - 128) <= 1 and got[0, 0, 0] == 0 and got[0, 0, -1] == 255


# ---------------------------------------------------------------- weights (unit level)
@pytest.mark.parametrize("kind, message", [
    ("list", "holds no model state dict"),
    ("text", "is not a readable PyTorch checkpoint"),
    ("no_match", "no tensor in .* matches the model"),
    ("missing", "does not exist"),
    ("whole_model", r"holds Python objects, not only tensors \(e.g. a whole model saved with "
                    r"torch.save\(model\)\), which are not loaded, for safety; if you trust it, "
                    r"load it yourself and save model.state_dict\(\) instead.$"),
])
def test_bad_weights_are_checkpoint_errors(tmp_path, kind, message):
    path = tmp_path / "w.pth"
    if kind == "list":
        torch.save([torch.zeros(3)], path)
    elif kind == "text":
        path.write_text("these are not weights")
    elif kind == "no_match":
        torch.save({"encoder.weight": torch.zeros(3, 3)}, path)
    elif kind == "whole_model":
        torch.save(torch.nn.Linear(2, 2), path)
    args = get_args_parser().parse_args([*TINY_FLAGS, "--weights", str(path)])
    with pytest.raises(CheckpointError, match=message) as err:
        _build_model(args, DistInfo(), ["a", "b", "c"])
    assert str(path) in str(err.value)


def test_weights_of_another_model_warn_but_a_new_head_does_not(tmp_path, caplog):
    path, deeper = tmp_path / "resnet18-3classes.pth", tmp_path / "resnet34.pth"
    torch.save(get_model("resnet18", num_classes=3).state_dict(), path)
    torch.save(get_model("resnet34", num_classes=3).state_dict(), deeper)

    def build(model: str, weights: Path, classes: int) -> tuple[list[str], list[str]]:
        caplog.clear()
        args = get_args_parser().parse_args([*TINY_FLAGS, "--model", model, "--weights",
                                             str(weights)])
        with caplog.at_level(logging.INFO):
            _build_model(args, DistInfo(), [f"c{i}" for i in range(classes)])
        return ([r.getMessage() for r in caplog.records if r.levelname == "INFO"],
                [r.getMessage() for r in caplog.records if r.levelname == "WARNING"])

    infos, warnings = build("resnet18", path, 5)  # fine-tuning: only the head is new
    assert warnings == [] and (f"loaded {path} into --model resnet18: 120 of the model's 122 "
                               "tensors; the classifier (fc.bias, fc.weight) starts new for 5 "
                               "classes") in infos
    _, warnings = build("resnet34", path, 3)  # a shallower file leaves blocks as initialised
    assert len(warnings) == 1
    assert f"backbone tensor(s) of --model resnet34 were not loaded from {path}" in warnings[0]
    assert "were the weights made for another --model?" in warnings[0]
    infos, warnings = build("resnet18", deeper, 3)  # a deeper one loads every resnet18 tensor
    assert f"loaded {deeper} into --model resnet18: 122 of the model's 122 tensors" in infos
    assert len(warnings) == 1 and warnings[0].startswith(
        f"{deeper} holds 96 tensor(s) that --model resnet18 does not have (layer1.2.bn1.bias, ")
    assert "left out; were the weights made for a deeper --model?" in warnings[0]


def test_a_head_trained_on_other_class_names_starts_new(tmp_path):
    """Same count, other names: kept, the head would map the old class i to the new class i."""
    trained = get_model("resnet18", num_classes=3)
    path = tmp_path / "model_best.pth"
    torch.save({"model": trained.state_dict(), "epoch": 4, "classes": ["a", "b", "c"]}, path)
    args = get_args_parser().parse_args([*TINY_FLAGS, "--weights", str(path)])
    for classes, kept in ((["a", "b", "c"], True), (["cat", "dog", "owl"], False),
                          (["c", "b", "a"], False)):
        head = _build_model(args, DistInfo(), classes).fc.weight
        assert torch.equal(head, trained.fc.weight) == kept, classes
    assert torch.equal(_build_model(args, DistInfo(), ["x", "y", "z"]).conv1.weight,
                       trained.conv1.weight)  # the backbone loads either way


# ---------------------------------------------------------------- as users run it
def _plain(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, LAUNCH, "--data-path", str(data), *TINY_FLAGS, "--epochs", "1",
            "--output-dir", str(out), *extra]


def test_a_home_folder_in_path_flags_is_expanded(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    args = get_args_parser().parse_args(["--data-path", "~/flowers", "--output-dir=~/runs/a",
                                         "--weights", "~/w.pth", "--resume", "none"])
    assert (args.data_path, args.output_dir, args.weights, args.resume) == (
        "/home/someone/flowers", "/home/someone/runs/a", "/home/someone/w.pth", "none")


def test_plain_python_user_errors_exit_2_with_one_line(tiny_data, tmp_path):
    text_weights = tmp_path / "weights.pth"
    text_weights.write_text("not weights")
    missing = tmp_path / "no such folder"
    cases = {  # name -> (command, substrings of the one error line)
        "missing data path": (_plain(missing, tmp_path / "o1"),
                              [str(missing), "does not exist", "expected a folder"]),
        "num classes": (_plain(tiny_data, tmp_path / "o2", "--num-classes", "7"),
                        ["--num-classes 7 disagrees with the 5 class folders", str(tiny_data)]),
        "text weights": (_plain(tiny_data, tmp_path / "o3", "--weights", str(text_weights)),
                         [str(text_weights), "not a readable PyTorch checkpoint"]),
    }
    # Independent processes: run them side by side (each is mostly Python start-up).
    with ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(lambda c: run(c[0], timeout=120), cases.values())))
    for name, (_, needles) in cases.items():
        res = results[name]
        assert res.returncode == 2, (name, combined(res)[-2000:])
        errors = [line for line in res.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, (name, res.stderr[-2000:])
        for needle in needles:
            assert needle in errors[0], (name, errors[0])
        assert "Traceback" not in combined(res), name
    assert not any(tmp_path.glob("o*/checkpoint.pth"))


@pytest.mark.parametrize("case", ["data path is a file", "too few images"])
def test_torchrun_user_errors_stop_every_rank(tmp_path, case):
    if case == "data path is a file":
        data = tmp_path / "data.zip"
        data.write_bytes(b"PK")
        needle = f"data path {data} is not a folder; expected a folder"
        timeout = 60  # a rank left waiting in a collective would hit this
    else:
        data = two_class_data(tmp_path / "data", 4)  # seed 0: 1 of 8 for val -> 7 < 2 x 4
        needle = "7 training images are fewer than world size 2 x batch size 4 = 8"
        timeout = 90  # this one imports and scans first
    res = run(torchrun_cmd(2, LAUNCH, "--data-path", str(data), *TINY_FLAGS, "--epochs", "1",
                           "--val-rate", "0.25", "--output-dir", str(tmp_path / "out")),
              timeout=timeout)
    out = combined(res)
    assert res.returncode != 0
    assert out.count(needle) == 1, out[-3000:]  # rank 0 says it once; no rank hangs
    assert "exitcode  : 2" in out  # the worker's own exit code, as torchrun reports it
    assert not (tmp_path / "out" / "checkpoint.pth").exists()


def test_torchrun_trains_through_messy_folder(messy, tmp_path):
    out_dir = tmp_path / "out"
    res = run(torchrun_cmd(2, LAUNCH, "--data-path", str(messy), *TINY_FLAGS, "--epochs", "1",
                           "--output-dir", str(out_dir)), timeout=300)
    out = combined(res)
    assert res.returncode == 0, out[-4000:]
    # Summary once (rank 0 only), with counts, each skipped file once, dropped class named.
    assert out.count("20 images in 4 classes") == 1, out[-4000:]
    assert out.count("skipped 8 file(s): 1 dangling link, 1 empty file, 2 hidden files, "
                     "3 not readable images, 1 not an image extension") == 1, out[-4000:]
    for p in (messy / "red rose" / "corrupt.jpg", messy / "café" / "dangling.jpg"):
        assert out.count(f"skipped {p}:") == 1
    assert out.count("dropped 1 class folder(s) with no usable image: empty") == 1
    assert out.count("1 class(es) got no training image") == 1
    assert "skipping unreadable image" not in out  # the up-front check caught all of them
    listed = (out_dir / "skipped_files.txt").read_text(encoding="utf-8").splitlines()
    assert sorted(Path(line.split("\t")[0]).name for line in listed) == sorted(BAD_FILES)
    indices = json.loads((out_dir / "class_indices.json").read_text(encoding="utf-8"))
    assert indices == {str(i): c for i, c in enumerate(USED_CLASSES)}
    ckpt = torch.load(out_dir / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and ckpt["classes"] == USED_CLASSES
    assert ckpt["model"]["fc.weight"].shape[0] == 4
    assert len((out_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_dataset_paths_read_like_a_list_of_the_names_given(tmp_path):
    """MyDataSet packs its paths (forked workers then share them, not copy them: ~0.3 KB a path
    a worker, PyTorch issue 13246); images_path still reads like the list it was given."""
    from my_dataset import PackedStrings

    names = [str(tmp_path / "a.jpg"), "", "é/ü.png", os.fsdecode(b"bad\xff.jpg"), "x\ty.png"]
    packed = PackedStrings(names)
    assert list(packed) == names and len(packed) == 5
    assert packed[-1] == names[-1] and packed[1:4] == names[1:4] and packed[::-2] == names[::-2]
    with pytest.raises(IndexError):
        packed[5]
    assert list(PackedStrings([])) == []
    ds = MyDataSet(names, [4, 0, 1, 2, 3], decoder="tensor", report_errors=False)
    assert list(ds.images_path) == names and set(ds.images_path) == set(names)
    label = ds[2][1]  # unreadable: the ignore label, as an int
    assert label == IGNORE_INDEX and type(label) is int
    good = write_jpeg(tmp_path / "a.jpg", 0)
    assert MyDataSet([str(good)], [7], decoder="tensor")[0][1] == 7
    assert type(MyDataSet([str(good)], [7], decoder="tensor")[0][1]) is int  # as the template


def test_skip_counts_read_as_english(tmp_path):
    """Counts stand in the summary and in error messages: the thing counted takes its plural
    (the log said "35 image in the data root"); a reason with nothing to count is a label."""
    from utils import _counted

    reasons = {  # every short reason the scan gives -> that reason counted twice
        "hidden file": "2 hidden files",
        "hidden folder": "2 hidden folders",
        "empty file": "2 empty files",
        "dangling link": "2 dangling links",
        "dangling link or missing file": "2 dangling links or missing files",
        "duplicate": "2 duplicates",
        "image in the data root, not in a class folder":
            "2 images in the data root, not in a class folder",
        "image too large": "2 images too large",
        "image has no pixels": "2 images have no pixels",
        "link into class roses": "2 links into class roses",
        "link to the data folder": "2 links to the data folder",
        "unreadable folder": "2 unreadable folders",
        "not a regular file": "2 not regular files",
        "not a readable image": "2 not readable images",
        "file name is not valid UTF-8; rename it": "2 file names are not valid UTF-8; rename them",
        "folder name is UTF-8, but this Python reads file names as ascii; run it with "
        "PYTHONUTF8=1": "2 folder names are UTF-8, but this Python reads file names as ascii; "
                        "run it with PYTHONUTF8=1",
        "not an image extension": "2 not an image extension",
        "permission denied": "2 permission denied",
    }
    assert {r: _counted(2, r) for r in reasons} == reasons
    assert {r: _counted(1, r) for r in reasons} == {r: f"1 {r}" for r in reasons}
    root = two_class_data(tmp_path / "data", 2)
    for i in range(35):
        write_jpeg(root / f"stray{i:02d}.jpg", i)
    summary = scan_image_folder(str(root)).summary()
    assert "skipped 35 file(s): 35 images in the data root, not in a class folder\n" in summary
