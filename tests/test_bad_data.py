"""Bad data never kills a run: odd files are skipped and listed, layout mistakes are one sentence.

Unit level: the folder scan, the split, decoding and ``MyDataSet``, the data plots and the small
file helpers. The runs of the training scripts on bad data are in the end-to-end test files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps
from torch.utils.data import DataLoader
from torchvision import transforms as v1
from torchvision.transforms import v2

import demo_data
import image_folder
from augment import get_transforms
from demo_data import make_demo_data
from flags import path_flag
from image_folder import (DataError, FolderScan, label_by_class_name, read_split_data,
                          scan_image_folder, split_train_val)
from multi_train_utils.train_eval_utils import IGNORE_INDEX, IMAGENET_MEAN, IMAGENET_STD
from my_dataset import (LOADER_TIMEOUT_S, MyDataSet, check_image, load_image_tensor,
                        load_pil_image, loader_kwargs, printable_path)
from run_log import plot_class_distribution, write_json_atomic

# Class folder names sort as Python sorts str: "café" < "red rose" < "single" < "日本".
USED_CLASSES = ["café", "red rose", "single", "日本"]
BAD_FILES = {  # path below the root -> reason (prefix) as scan_image_folder gives it
    "red rose/corrupt.jpg": "not a readable image (",
    "red rose/truncated.jpg": "not a readable image (",
    "red rose/text.png": "not a readable image (",
    "red rose/zero.jpg": "empty file",
    "red rose/notes.txt": "not an image extension",
    "red rose/.DS_Store": "hidden",
    "red rose/.hidden.jpg": "hidden",
    "red rose/.thumbs": "hidden",
    "red rose/up": "linked folder, not followed",
    "café/dangling.jpg": "dangling link",
    "stray.jpg": "not in a class folder",
}


# ---------------------------------------------------------------- data builders
def write_jpeg(path: Path, seed: int, size: tuple[int, int] = (32, 32)) -> Path:
    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    pixels = np.clip(colour + rng.integers(-20, 20, (size[1], size[0], 3)), 0, 255)
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
    return path


def jpeg_without_scan(good: Path, path: Path) -> Path:
    """A JPEG whose header and end marker are intact but which has no image data: it may pass
    the up-front header check and fails when decoded."""
    data = good.read_bytes()
    path.write_bytes(data[:data.index(b"\xff\xda")] + b"\xff\xd9")  # cut at start-of-scan
    return path


def png_with_damaged_data(path: Path, seed: int = 0) -> Path:
    """A PNG whose header, chunk checksums and end marker are intact but whose compressed pixels
    are damaged: it passes the header check and fails only when decoded."""
    import io
    import zlib

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), np.uint8)).save(
        buf, "PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8:start - 4], "big")
    data[start + 20:start + 60] = np.random.default_rng(seed + 1).bytes(40)
    data[start + length:start + length + 4] = zlib.crc32(data[start - 4:start + length]
                                                         ).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    return path


def make_class(folder: Path, n: int, seed: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        write_jpeg(folder / f"{i:02d}.jpg", seed * 100 + i)
    return folder


def two_class_data(root: Path, per_class: int) -> Path:
    make_class(root / "a", per_class, 1)
    make_class(root / "b", per_class, 2)
    return root


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> Path:
    """Four classes (a space, non-ASCII, a linked class folder, one of a single image) and every
    kind of junk. Usable images: café 6 + a linked file, red rose 6 + 1 in a sub-folder,
    single 1, 日本 6: 21."""
    base = tmp_path_factory.mktemp("messy")
    root = base / "data"
    rose = make_class(root / "red rose", 6, 1)
    make_class(rose / "more", 1, 5)
    make_class(rose / ".thumbs", 2, 6)
    (rose / "up").symlink_to("..", target_is_directory=True)  # a loop, were it followed
    make_class(root / "café", 6, 2)
    make_class(root / "single", 1, 3)
    (root / "日本").symlink_to(make_class(base / "elsewhere" / "japan", 6, 4))
    (root / "café" / "linked.jpg").symlink_to(write_jpeg(base / "elsewhere" / "real.jpg", 99))
    (root / "café" / "dangling.jpg").symlink_to(base / "elsewhere" / "gone.jpg")
    write_jpeg(root / "stray.jpg", 7)
    good = (rose / "00.jpg").read_bytes()
    (rose / "corrupt.jpg").write_bytes(np.random.default_rng(0).bytes(4000))
    (rose / "truncated.jpg").write_bytes(good[:len(good) // 2])
    (rose / "zero.jpg").write_bytes(b"")
    (rose / "notes.txt").write_text("not an image")
    (rose / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (rose / ".hidden.jpg").write_bytes(good)
    (rose / "text.png").write_text("this is text, not a PNG")
    return root


# ---------------------------------------------------------------- scanning
def test_scan_skips_and_lists_every_kind_of_junk(messy):
    scan = scan_image_folder(messy)
    assert scan.classes == USED_CLASSES and [len(x) for x in scan.images] == [7, 7, 1, 6]
    assert str(messy / "café" / "linked.jpg") in scan.images[0]  # a linked file is followed
    assert str(messy / "red rose" / "more" / "00.jpg") in scan.images[1]  # nested images count
    assert all(p.startswith(str(messy / "日本")) for p in scan.images[3])  # a linked class
    skipped = {os.path.relpath(p, messy): why for p, why in scan.skipped}
    assert skipped.keys() == BAD_FILES.keys()
    assert all(skipped[name].startswith(why) for name, why in BAD_FILES.items()), skipped
    assert scan.skipped == sorted(scan.skipped)
    lines = scan.summary().splitlines()
    assert lines[0] == (f"21 images in 4 classes in {messy}; skipped 11 files (dangling link or "
                        "not a regular file: 1, "
                        "empty file: 1, hidden: 3, linked folder, not "
                        "followed: 1, not a readable image: 3, not an image extension: 1, not in "
                        "a class folder: 1)")
    assert len(lines) == 12 and lines[-1] == "  ... and 1 more"  # a line, 10 examples
    assert scan_image_folder(messy) == scan  # what rank 0 broadcasts, any rank would find


def test_without_verify_only_names_and_types_are_read(tmp_path, monkeypatch):
    """As ImageFolder: what os.scandir reads with the names (d_type), a stat per folder (its
    times) and none per file, no header; empty and unreadable images are left to the loader."""
    root = two_class_data(tmp_path / "data", 2)
    make_class(root / "b" / "more", 1, 3)
    os.mkfifo(root / "a" / "pipe.jpg")  # opening it would block the scan forever
    (root / "a" / "zero.jpg").write_bytes(b"")
    (root / "b" / "bad.jpg").write_bytes(b"not a jpeg")
    stat, stats = os.stat, []
    monkeypatch.setattr(os, "stat", lambda path, **kw: stats.append(Path(path)) or stat(path, **kw))
    monkeypatch.setattr(image_folder, "check_image", lambda path: pytest.fail(f"{path} was opened"))
    quick = scan_image_folder(root, verify=False)
    assert set(stats) == {root, root / "a", root / "b", root / "b" / "more"}
    pipe = (str(root / "a" / "pipe.jpg"), "dangling link or not a regular file")
    assert quick.skipped == [pipe]
    assert {str(root / "a" / "zero.jpg"), str(root / "b" / "bad.jpg")} <= {*sum(quick.images, [])}
    monkeypatch.undo()
    assert scan_image_folder(root).skipped == [
        pipe,
        (str(root / "a" / "zero.jpg"), "empty file"),
        (str(root / "b" / "bad.jpg"), "not a readable image (UnidentifiedImageError: cannot "
         f"identify image file '{root / 'b' / 'bad.jpg'}')")]


def _deny(monkeypatch, *denied: Path) -> None:
    """Listing ``denied`` folders fails as with chmod 000 (tests may run as root)."""
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) in {str(d) for d in denied}:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("case, message", [
    ("missing", "data path {root} does not exist; expected a folder with one sub-folder of "
                "images per class (e.g. flower_photos/daisy/*.jpg)."),
    ("file", "data path {root} is not a folder; expected a folder with one sub-folder"),
    ("unreadable", "cannot read data folder {root} (Permission denied); give the training user "
                   "read and execute access to it."),
    # --data-path flower_photos/roses: the folder of one class
    ("class_folder", "data path {root} has no class sub-folders; expected one sub-folder of "
                     "images per class (e.g. flower_photos/daisy/*.jpg); it holds images "
                     "itself: did you mean {parent}?"),
    # --val-path ILSVRC2012/val: its 50,000 images in one folder, as it ships
    ("flat_val", "data path {root} has no class sub-folders; expected one sub-folder of images "
                 "per class (e.g. flower_photos/daisy/*.jpg); it holds images itself: sort them "
                 "into folders named as the training classes."),
    ("one_class", "data path {root} has 1 class folder(s) (a); at least 2 are needed, one "
                  "sub-folder of images per class"),
    ("empty_class", "class folder {root}/b has no usable image (skipped 2 files, e.g. "
                    "{root}/b/notes.txt: not an image extension); add images or remove the "
                    "folder."),
    ("not_mounted", "class folder roses in {root} is a link to {parent}/nas/roses, which does not "
                    "exist (storage not mounted?); mount it, or remove the link to train "
                    "without that class."),
])
def test_layout_mistakes_are_one_sentence_naming_the_path(tmp_path, monkeypatch, case, message):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "unreadable":
        two_class_data(root, 1)
        _deny(monkeypatch, root)
    elif case in ("class_folder", "flat_val"):
        root.mkdir()
        write_jpeg(root / "a.jpg", 0)
    elif case == "one_class":
        make_class(root / "a", 2, 0)
    elif case == "empty_class":
        make_class(root / "a", 2, 0)
        (root / "b").mkdir()
        (root / "b" / "notes.txt").write_text("x")
        (root / "b" / "zero.jpg").write_bytes(b"")
    elif case == "not_mounted":
        two_class_data(root, 1)
        (root / "roses").symlink_to(tmp_path / "nas" / "roses", target_is_directory=True)
    with pytest.raises(DataError) as err:
        scan_image_folder(root, min_classes=1 if case == "flat_val" else 2)  # 1: a --val-path
    assert str(err.value).startswith(message.format(root=root, parent=tmp_path))
    assert "\n" not in str(err.value)


def test_one_class_is_enough_where_asked_and_a_dangling_file_link_is_no_class(tmp_path):
    root = make_class(tmp_path / "data" / "a", 2, 0).parent
    (root / "labels.csv").symlink_to(tmp_path / "gone.csv")  # has an extension: no class folder
    scan = scan_image_folder(root, min_classes=1)
    assert scan.classes == ["a"] and scan.skipped == [(str(root / "labels.csv"),
                                                       "not in a class folder")]


def test_unreadable_sub_folders_are_listed_not_lost(tmp_path, monkeypatch):
    root = two_class_data(tmp_path / "data", 2)
    make_class(root / "b" / "private", 2, 4)
    _deny(monkeypatch, root / "b" / "private")
    scan = scan_image_folder(root)
    assert [len(x) for x in scan.images] == [2, 2]
    assert scan.skipped == [(str(root / "b" / "private"), "unreadable folder (Permission denied)")]


def test_skipped_paths_are_printable_and_odd_names_still_load(tmp_path):
    root = two_class_data(tmp_path / "data", 1)
    odd = os.fsdecode(os.path.join(os.fsencode(root / "a"), b"caf\xe9.jpg"))  # latin-1 bytes
    write_jpeg(Path(odd), 3)
    (root / "b" / "tab\there.txt").write_text("x")
    scan = scan_image_folder(root)
    assert odd in scan.images[0] and load_image_tensor(odd).shape == (3, 32, 32)
    assert scan.skipped == [(str(root / "b" / "tab\\there.txt"), "not an image extension")]
    assert printable_path(odd) == str(root / "a" / "caf\\xe9.jpg")


def test_rebased_scan_points_below_another_root(messy, tmp_path):
    scan = scan_image_folder(messy)
    moved = scan.rebased("/mnt/node1/flowers")
    assert moved.root == "/mnt/node1/flowers" and moved.classes == scan.classes
    assert moved.images[1][0] == "/mnt/node1/flowers/red rose/00.jpg"
    assert [p for p, _ in moved.skipped][-1] == "/mnt/node1/flowers/stray.jpg"
    assert split_train_val(moved, 0.3, 5)[2] == [p.replace(str(messy), moved.root)
                                                 for p in split_train_val(scan, 0.3, 5)[2]]


def test_jfif_and_jpe_files_are_read_as_jpeg(tmp_path):
    root = two_class_data(tmp_path / "data", 1)
    jpeg = (root / "a" / "00.jpg").read_bytes()
    for name in ("b/photo.JFIF", "b/photo.jpe"):
        (root / name).write_bytes(jpeg)
    scan = scan_image_folder(root)
    assert not scan.skipped and len(scan.images[1]) == 3
    expected = load_image_tensor(str(root / "a" / "00.jpg"))
    assert all(torch.equal(load_image_tensor(p), expected) for p in scan.images[1][1:])


# ---------------------------------------------------------------- splitting
def _scan_of(root: str, images: list[list[str]]) -> FolderScan:
    return FolderScan(root, [f"c{i}" for i in range(len(images))], images)


def test_split_keeps_every_file_on_its_side_when_the_data_changes():
    images = [[f"/data/c{c}/{i:04d}.jpg" for i in range(1000)] for c in range(3)]
    train_p, train_y, val_p, val_y = split_train_val(_scan_of("/data", images), 0.2, 0)
    assert sorted(train_p + val_p) == sorted(sum(images, []))
    assert all(170 <= val_y.count(c) <= 230 for c in range(3))  # stratified: about val_rate
    assert all(f"/c{y}/" in p for p, y in zip(train_p + val_p, train_y + val_y))
    # Files added to one class and removed from another: no other file changes side.
    grown = [images[0] + [f"/data/c0/new{i}.jpg" for i in range(300)], images[1][::2], images[2]]
    g_train, _, g_val, _ = split_train_val(_scan_of("/data", grown), 0.2, 0)
    assert not set(g_val) & set(train_p) and not set(g_train) & set(val_p)
    # A moved data root splits the same way; another seed draws another split.
    moved = [[p.replace("/data/", "/scratch/flowers/") for p in ps] for ps in images]
    m_val = split_train_val(_scan_of("/scratch/flowers", moved), 0.2, 0)[2]
    assert [p.replace("/scratch/flowers/", "/data/") for p in m_val] == val_p
    assert split_train_val(_scan_of("/data", images), 0.2, 1)[2] != val_p


def test_split_leaves_every_class_of_two_images_one_on_each_side():
    images = [[f"/d/c{c}/{i}.jpg" for i in range(2 + c % 3)] for c in range(40)]
    for rate in (1e-9, 0.5, 1 - 1e-9):
        _, train_y, _, val_y = split_train_val(_scan_of("/d", images), rate, 0)
        assert set(train_y) == set(val_y) == set(range(40)), rate
    single = _scan_of("/d", [["/d/a/0.jpg"], ["/d/b/0.jpg", "/d/b/1.jpg"]])
    assert split_train_val(single, 0.0, 0) == (["/d/a/0.jpg", "/d/b/0.jpg", "/d/b/1.jpg"],
                                               [0, 1, 1], [], [])
    assert split_train_val(single, 1.0, 0)[0] == []  # evaluation of every image
    with pytest.raises(DataError, match=r"^--val-rate 1.5 must be between 0 and 1.$"):
        split_train_val(single, 1.5, 0)


def test_a_separate_validation_folder_is_labelled_by_class_name(tmp_path, caplog):
    val = tmp_path / "val"
    make_class(val / "fig", 2, 7)
    make_class(val / "kiwi", 3, 8)  # no apple: the first class, so its own index would be off
    paths, labels = label_by_class_name(["apple", "fig", "kiwi"], scan_image_folder(val))
    assert {os.path.relpath(p, val): y for p, y in zip(paths, labels)} == {
        "fig/00.jpg": 1, "fig/01.jpg": 1, "kiwi/00.jpg": 2, "kiwi/01.jpg": 2, "kiwi/02.jpg": 2}
    assert caplog.messages == [f"1 class(es) have no image in {val}, so their accuracy is not "
                               "measured: apple"]
    make_class(val / "Apple", 1, 9)  # a name the training data lacks (here: by case)
    with pytest.raises(DataError) as err:
        label_by_class_name(["apple", "fig", "kiwi"], scan_image_folder(val))
    assert str(err.value) == (f"validation folder {val} has class folder(s) the training data "
                              "lacks: Apple; the model has no output for them, so name them as "
                              "in the training data or remove them.")


def test_read_split_data_as_the_classic_tutorial(messy, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        train_p, train_y, val_p, val_y = read_split_data(str(messy), 0.2, plot_image=True)
    indices = json.loads((tmp_path / "class_indices.json").read_text(encoding="utf-8"))
    assert indices == {str(i): c for i, c in enumerate(USED_CLASSES)}
    with Image.open(tmp_path / "class_distribution.png") as img:
        assert img.format == "PNG"
    assert len(train_p) + len(val_p) == 21 and not set(train_p) & set(val_p)
    assert set(train_y) >= {0, 1, 3} and set(val_y) >= {0, 1, 3}
    # Skipped files are a warning: a script that set up no logging still shows it.
    (summary,) = [r for r in caplog.records if r.getMessage().startswith("21 images in 4")]
    assert summary.levelno == logging.WARNING


# ---------------------------------------------------------------- checks and decoding
def test_check_image_reads_headers_only(tmp_path, monkeypatch):
    good = write_jpeg(tmp_path / "good.jpg", 0, (500, 375))
    Image.open(good).save(tmp_path / "good.png")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    assert check_image(str(truncated)).startswith("not a readable image (OSError: ")

    def no_decode(self):
        raise AssertionError("check_image decoded a complete file")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert check_image(str(good)) is None and check_image(str(tmp_path / "good.png")) is None
    assert check_image(str(tmp_path / "missing.jpg")).startswith(
        "not a readable image (FileNotFoundError: ")


def _in_child(fn: Callable[[], object]) -> str:
    """What ``fn()`` does in a forked child: a crash in native code must not take pytest down."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except OSError:
            os._exit(3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return {0: "returned", 3: "raised OSError", 4: "raised another error"}[os.WEXITSTATUS(status)]


@pytest.mark.parametrize("classic", [False, True])
def test_unreadable_at_load_time_becomes_an_ignored_placeholder(tmp_path, classic):
    goods = [write_jpeg(tmp_path / f"{i}.jpg", i, (20, 12)) for i in range(4)]
    broken = png_with_damaged_data(tmp_path / "broken.png")
    assert check_image(str(broken)) is None  # passes the scan...
    # ...and torchvision's PNG decoder would kill the worker on it (SIGSEGV): PIL raises.
    assert _in_child(lambda: load_image_tensor(str(broken))) == "raised OSError"
    paths = [str(goods[0]), str(broken), *map(str, goods[1:])]
    # The classic call: a v1 pipeline on PIL images, to float; else v2 on uint8 tensors.
    transform = (v1.Compose([v1.Resize((8, 8)), v1.ToTensor()]) if classic
                 else v2.Compose([v2.Resize((8, 8))]))
    ds = MyDataSet(paths, [1, 1, 0, 1, 0], transform)
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=MyDataSet.collate_fn)
    images, labels = (torch.cat(x) for x in zip(*loader))
    assert labels.tolist() == [1, IGNORE_INDEX, 0, 1, 0]
    assert images.shape == (5, 3, 8, 8) and images.dtype == (torch.float32 if classic
                                                             else torch.uint8)
    assert images[1].sum() == 0 and images[0].float().mean() > 0  # black placeholder only


def test_a_training_set_replaces_unreadable_images_by_readable_ones_of_their_class(tmp_path):
    """A black placeholder would pass through BatchNorm and drag its statistics: training
    gets a readable image of the same class, drawn from (seed, epoch, index), each unreadable
    file read and listed once; a class with no readable image gives the ignored label."""
    goods = [write_jpeg(tmp_path / f"{i}.jpg", i, (20, 12)) for i in range(4)]
    bad = [str(jpeg_without_scan(goods[0], tmp_path / f"bad{i}.jpg")) for i in range(23)]
    paths = [str(goods[0]), *bad[:20], str(goods[1]), str(goods[2]), str(goods[3]), *bad[20:]]
    labels = [0] * 23 + [1] + [2] * 3  # class 0: 3 readable, 20 not; class 2: none readable
    log_file = tmp_path / "skipped_files.txt"
    ds = MyDataSet(paths, labels, seed=0, skip_log=log_file, replace_unreadable=True)
    reads = []
    ds._load = lambda i, load=ds._load: reads.append(paths[i]) or load(i)
    fingerprint = {tuple(load_image_tensor(str(g)).flatten()[:64].tolist()): str(g)
                   for g in goods}
    stand_ins = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = [ds[i] for i in range(len(ds))]
        assert [y for _, y in got] == labels[:24] + [IGNORE_INDEX] * 3
        stand_ins.append([fingerprint[tuple(img.flatten()[:64].tolist())]
                          for img, _ in got[1:21]])
    assert set(stand_ins[0]) == {str(g) for g in goods[:3]}  # drawn, not one neighbour for all
    assert stand_ins[1] != stand_ins[0]  # and anew each epoch
    fresh = MyDataSet(paths, labels, seed=0, replace_unreadable=True)  # a resumed run
    fresh.set_epoch(1)
    assert [fingerprint[tuple(fresh[i][0].flatten()[:64].tolist())]
            for i in reversed(range(1, 21))] == stand_ins[1][::-1]
    assert sorted(p for p in reads if p in bad) == sorted(bad)  # each unreadable file read once
    listed = log_file.read_text(encoding="utf-8").splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(bad)
    assert all(line.split("\t")[1].startswith("not a readable image at load time (")
               for line in listed)


@pytest.mark.parametrize("persistent", [False, True])
def test_each_unreadable_file_is_listed_once_whichever_worker_or_rank_meets_it(tmp_path,
                                                                              persistent, caplog):
    good = write_jpeg(tmp_path / "g.jpg", 0)
    broken = png_with_damaged_data(tmp_path / "broken.png")
    odd = jpeg_without_scan(good, Path(os.fsdecode(os.path.join(os.fsencode(tmp_path),
                                                                b"bad\xff.jpg"))))
    log_file = tmp_path / "skipped_files.txt"
    log_file.write_text("from/the/scan.jpg\tempty file\n", encoding="utf-8")
    ds = MyDataSet([str(good), str(broken), str(odd)], [0, 1, 1], skip_log=log_file)
    loader = DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=persistent,
                        collate_fn=MyDataSet.collate_fn)
    for _ in range(3):  # each bad sample meets another worker in another epoch
        assert torch.cat([y for _, y in loader]).tolist() == [0, IGNORE_INDEX, IGNORE_INDEX]
    other_rank = MyDataSet([str(odd), str(broken)], [1, 1], skip_log=log_file)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="my_dataset"):
        assert [other_rank[i][1] for i in (0, 1, 1, 1)] == [IGNORE_INDEX] * 4
    assert caplog.text.count(f"skipping {broken}: not a readable image at load time (") == 1
    lines = log_file.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "from/the/scan.jpg\tempty file"  # appended, never overwritten
    assert sorted(line.split("\t")[0] for line in lines[1:]) == sorted(
        [str(broken), str(tmp_path / "bad\\xff.jpg")])


def test_augmentation_depends_only_on_seed_epoch_and_index(tmp_path):
    paths = [str(write_jpeg(tmp_path / f"{i}.jpg", i, (40, 30))) for i in range(8)]
    transform = get_transforms(16)["train"]

    def epoch_batches(workers: int, epochs: list[int], seed: int = 3) -> list[torch.Tensor]:
        ds = MyDataSet(paths, [0] * 8, transform, seed=seed)
        loader = DataLoader(ds, batch_size=4, **loader_kwargs(workers, torch.device("cpu")))
        return [ds.set_epoch(e) or torch.cat([x for x, _ in loader]) for e in epochs]

    first, second = epoch_batches(0, [1, 2])
    assert first.shape == (8, 3, 16, 16) and first.dtype == torch.uint8
    assert not torch.equal(first, second)
    # Neither the worker count matters nor that workers persist across set_epoch (a resume).
    assert all(map(torch.equal, epoch_batches(2, [1, 2]), (first, second)))
    assert not torch.equal(epoch_batches(0, [1], seed=4)[0], first)
    # Before set_epoch (the classic tutorial never calls it): torch's global RNG, as usual.
    ds = MyDataSet(paths, [0] * 8, transform)
    torch.manual_seed(0)
    assert not torch.equal(ds[0][0], ds[0][0])


def test_running_out_of_file_descriptors_is_raised_not_called_a_bad_image(tmp_path, monkeypatch):
    path = write_jpeg(tmp_path / "a.jpg", 0)
    dataset = MyDataSet([str(path)], [0])

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr("my_dataset.load_image_tensor", no_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        dataset[0]
    assert not dataset._bad.any()


def test_loader_kwargs_turn_a_lost_batch_into_an_error():
    kwargs = loader_kwargs(0, torch.device("cpu"))
    assert isinstance(kwargs.pop("generator"), torch.Generator)  # not torch's global RNG
    assert kwargs == dict(num_workers=0, collate_fn=MyDataSet.collate_fn, pin_memory=False)
    kwargs = loader_kwargs(3, torch.device("cuda", 0))
    assert kwargs["timeout"] == LOADER_TIMEOUT_S == 600 and kwargs["persistent_workers"]
    assert kwargs["pin_memory"] and kwargs["num_workers"] == 3 and kwargs["prefetch_factor"] >= 2
    images, labels = MyDataSet.collate_fn([(torch.zeros(3, 4, 4, dtype=torch.uint8), 2)] * 5)
    assert images.shape == (5, 3, 4, 4) and labels.tolist() == [2] * 5
    assert labels.dtype == torch.int64


def _exif_image(path: Path, orientation: int) -> Path:
    # 48 wide x 24 high, four flat colour blocks: a rotation shows in shape and pixels.
    pixels = np.zeros((24, 48, 3), np.uint8)
    pixels[:12, :24], pixels[:12, 24:] = (255, 0, 0), (0, 255, 0)
    pixels[12:, :24], pixels[12:, 24:] = (0, 0, 255), (255, 255, 0)
    exif = Image.Exif()
    exif[0x0112] = orientation
    options = {".jpg": {"quality": 95}, ".webp": {"lossless": True}}.get(path.suffix, {})
    Image.fromarray(pixels).save(path, exif=exif, **options)
    return path


def _write_mode(kind: str, base: Path) -> tuple[Path, np.ndarray, float]:
    """A file in an awkward mode, the ``(H, W, 3)`` RGB it must decode to and the tolerance in
    levels (lossless: every pixel; JPEG: the mean, decoders differ slightly)."""
    ramp = np.tile(np.linspace(0, 255, 32).astype(np.uint8), (16, 1))
    rgb = np.zeros((16, 32, 3), np.uint8)
    rgb[:, 16:], rgb[8:, :16] = (200, 30, 90), (10, 220, 40)
    if kind == "L":
        Image.fromarray(ramp, "L").save(path := base.with_suffix(".png"))
        return path, np.repeat(ramp[..., None], 3, axis=2), 0
    if kind == "P":
        Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(
            path := base.with_suffix(".png"))
        return path, rgb, 0
    if kind == "RGBA":
        rgba = np.dstack([rgb, np.full((16, 32), 128, np.uint8)])
        Image.fromarray(rgba, "RGBA").save(path := base.with_suffix(".png"))
        return path, rgb, 0
    if kind == "CMYK":
        Image.fromarray(rgb).convert("CMYK").save(path := base.with_suffix(".jpg"), quality=95)
        return path, rgb, 4
    if kind == "I;16":  # 16-bit grayscale: mid-gray must become ~128, not white
        values = np.tile(np.linspace(0, 65535, 32).astype(np.uint16), (16, 1))
        Image.fromarray(values).save(path := base.with_suffix(".png"))
        assert Image.open(path).mode.startswith("I;16")
        return path, np.repeat((values >> 8).astype(np.uint8)[..., None], 3, axis=2), 1
    if kind == "animated-gif":  # the first frame
        frames = [Image.fromarray(np.full((16, 32, 3), c, np.uint8)) for c in (255, 0, 90)]
        frames[0].save(path := base.with_suffix(".gif"), save_all=True, append_images=frames[1:])
        return path, np.full((16, 32, 3), 255, np.uint8), 0
    suffix, _, orientation = kind.rpartition("-exif")  # jpg/png/webp with an EXIF orientation
    path = _exif_image(base.with_suffix("." + suffix), int(orientation))
    with Image.open(path) as img:
        expected = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
    assert expected.shape == (48, 24, 3)  # turned
    return path, expected, 3 if suffix == "jpg" else 0


@pytest.mark.parametrize("kind", ["L", "P", "RGBA", "CMYK", "I;16", "animated-gif", "jpg-exif6",
                                  "png-exif8", "webp-exif6"])
def test_awkward_modes_decode_to_uint8_rgb(tmp_path, kind):
    path, expected, tol = _write_mode(kind, tmp_path / "img")
    want = torch.tensor(expected).permute(2, 0, 1).float()
    pil = torch.from_numpy(np.array(load_pil_image(str(path)))).permute(2, 0, 1)
    for got in (load_image_tensor(str(path)), pil):
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert (got.float() - want).abs().mean() <= tol


# ---------------------------------------------------------------- plots, files, flags
def test_plots_stay_readable_for_long_names_and_many_classes(tmp_path):
    long = "x" * 190 + "_female"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied"; a warning per CJK glyph
        plot_class_distribution([long, "玫瑰"], [1, 2], tmp_path / "classes.png")
    many = [f"c{i}" for i in range(1200)]
    plot_class_distribution(many, [i % 7 + 1 for i in range(1200)], tmp_path / "many.png")
    with Image.open(tmp_path / "many.png") as img:
        assert img.width <= 2400  # 0.6 inch a class would be 72,000 px


def test_plot_data_loader_image_shows_a_batch_named_as_the_classic_tutorial(tmp_path,
                                                                         monkeypatch):
    """The classic launcher's import; uint8, normalised and --decode device batches show the
    same pixels, named from class_indices.json here or by ``classes``; headless: a file."""
    from image_folder import read_split_data  # noqa: F401 (the classic line)
    from run_log import plot_data_loader_image  # noqa: F401 (the classic line)
    monkeypatch.chdir(tmp_path)
    paths = [str(write_jpeg(tmp_path / f"{i}.jpg", i, (40, 50))) for i in range(5)]
    write_json_atomic("class_indices.json", {0: "red", 1: "blue"})
    classic = v1.Compose([v1.Resize(36), v1.CenterCrop(32), v1.ToTensor(),
                          v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    shown = []
    for transform in (get_transforms(32)["val"], classic, get_transforms(32, "device")["val"]):
        loader = DataLoader(MyDataSet(paths, [0, 1, 0, 1, 1], transform), batch_size=5,
                            collate_fn=MyDataSet.collate_fn)
        fig = plot_data_loader_image(loader, path=tmp_path / "batch.png")
        assert [ax.get_xlabel() for ax in fig.axes] == ["red", "blue", "red", "blue"]
        shown.append(np.stack([ax.images[0].get_array() for ax in fig.axes]).astype(int))
        with Image.open(tmp_path / "batch.png") as img:
            assert img.format == "PNG"
    assert shown[0].shape == (4, 32, 32, 3) and np.array_equal(shown[0], shown[2])
    assert np.abs(shown[0] - shown[1]).mean() < 2  # v1 on PIL, undone: the same to a level
    fig = plot_data_loader_image(loader, classes=["r", "b"], path=tmp_path / "b.png", count=2)
    assert [ax.get_xlabel() for ax in fig.axes] == ["r", "b"]


def test_write_json_atomic_leaves_no_temporary_file_and_normal_permissions(tmp_path):
    target = tmp_path / "class_indices.json"
    old_umask = os.umask(0o022)
    try:
        write_json_atomic(target, {"0": "a"})
        assert target.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old_umask)
    with pytest.raises(TypeError):  # nothing written
        write_json_atomic(target, {"0": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["class_indices.json"]
    assert json.loads(target.read_text(encoding="utf-8")) == {"0": "a"}
    names = {"0": "caf\udce9", "1": "caf\u00e9"}  # a folder name that is not UTF-8, one that is
    write_json_atomic(target, names)
    assert json.loads(target.read_text(encoding="utf-8")) == names
    assert "caf\\udce9" in target.read_text(encoding="utf-8")  # an escape: the file is UTF-8


def test_path_flags_expand_home_and_refuse_an_empty_value(monkeypatch):
    import argparse

    monkeypatch.setenv("HOME", "/home/someone")
    assert path_flag("~/flowers") == "/home/someone/flowers" and path_flag("runs/a") == "runs/a"
    with pytest.raises(argparse.ArgumentTypeError, match="an unset shell variable"):
        path_flag("  ")


def test_demo_data_is_made_once_and_the_same_every_time(tmp_path, monkeypatch):
    first = make_demo_data(tmp_path / "a", per_class=2, size=16)
    again = make_demo_data(tmp_path / "b", per_class=2, size=16)
    names = sorted(p.relative_to(first).as_posix() for p in first.rglob("*.jpg"))
    assert names == [f"{c}/{i:04d}.jpg" for c in demo_data.DEMO_CLASSES for i in range(2)]
    assert all((first / n).read_bytes() == (again / n).read_bytes() for n in names)
    (first / "daisy" / "0000.jpg").unlink()
    assert make_demo_data(first, per_class=2) == first  # there: not drawn again
    assert not (first / "daisy" / "0000.jpg").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.setenv("DDP_DEMO_DATA", str(tmp_path / "demo"))
    assert demo_data.default_demo_root() == tmp_path / "demo"
    monkeypatch.delenv("DDP_DEMO_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert demo_data.default_demo_root() == tmp_path / "cache" / "ddp-template" / "demo_flowers_v1"
