"""make_shards.py: every readable image in a shard once, in training's split and order, read back
byte for byte by wids; damaged files listed, not written; a rerun leaves no stale shard; one
error line for a mistake."""

from __future__ import annotations

import json
import logging
import math
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import wids
from PIL import Image

import make_shards
from conftest import assert_user_error, run
from image_folder import scan_image_folder, split_train_val

CLASSES = ["cat", "dog", "eel"]
EXTENSIONS = {".jpg": "JPEG", ".png": "PNG", ".JPE": "JPEG"}  # .JPE: stored as "jpg"


def make_folder(root: Path, per_class: int = 7) -> Path:
    """``root/<class>/<k><ext>``: noise images of 16 px, each extension in turn."""
    rng = np.random.default_rng(0)
    for cls in CLASSES:
        (root / cls).mkdir(parents=True)
        for k in range(per_class):
            ext, fmt = list(EXTENSIONS.items())[k % len(EXTENSIONS)]
            pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{k}{ext}", fmt)
    return root


def damage(root: Path) -> dict[Path, bytes]:
    """A JPEG cut short and a text file named .jpg, by path: their bytes."""
    good = (root / "cat" / "0.jpg").read_bytes()
    bad = {root / "cat" / "cut.jpg": good[:len(good) // 2],
           root / "dog" / "notes.jpg": b"not an image\n"}
    for path, data in bad.items():
        path.write_bytes(data)
    return bad


def shard_members(out: Path) -> dict[str, bytes]:
    """Every member of every shard in ``out``, by ``shard/member``."""
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members.update({f"{shard.name}/{m.name}": tar.extractfile(m).read() for m in tar})
    return members


def read_back(index: Path, cache: Path) -> list[tuple[str, str, bytes, int]]:
    """``(key, member extension, bytes, label)`` of each sample, in order, as wids reads it
    (its keys keep the dot: ``.jpg``, ``.cls``)."""
    dataset = wids.ShardListDataset(str(index), transformations=[], cache_dir=str(cache))
    samples = []
    for i in range(len(dataset)):
        sample = dataset[i]
        (ext,) = [k for k in sample if not k.startswith("__") and k != ".cls"]
        samples.append((sample["__key__"], ext, sample[ext].getvalue(),
                        int(sample[".cls"].getvalue().decode("ascii"))))
    return samples


def expected(paths: list[str], labels: list[int]) -> list[tuple[str, str, bytes, int]]:
    return [(f"{i:08d}", ".jpg" if Path(p).suffix == ".JPE" else Path(p).suffix,
             Path(p).read_bytes(), label) for i, (p, label) in enumerate(zip(paths, labels))]


def make(folder: Path, out: Path, *flags: str) -> None:
    make_shards.main(make_shards.get_args_parser().parse_args([str(folder), str(out), *flags]))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> SimpleNamespace:
    """The tool run as users run it (``python -m``) on 3 classes x 7 images and 2 damaged files,
    4 images a shard, seed 3."""
    tmp = tmp_path_factory.mktemp("make_shards")
    folder = make_folder(tmp / "pets")
    bad = damage(folder)
    out = tmp / "shards"
    res = run([sys.executable, "-m", "make_shards", str(folder), str(out), "--shard-size", "4",
               "--seed", "3"], timeout=120)
    split = split_train_val(scan_image_folder(folder), 0.2, 3)
    return SimpleNamespace(folder=folder, bad=bad, out=out, res=res, split=split, tmp=tmp)


def test_the_indexes_count_every_image_in_shards_of_the_size_asked(made):
    assert made.res.returncode == 0, made.res.stderr[-3000:]
    urls = []
    for name, paths in (("train", made.split[0]), ("val", made.split[2])):
        index = json.loads((made.out / f"{name}.json").read_text())
        assert (index["__kind__"], index["wids_version"], index["name"]) == (
            "wids-shard-index-v1", 1, name)
        assert index["classes"] == CLASSES
        shards = index["shardlist"]
        assert len(shards) == math.ceil(len(paths) / 4)
        assert [s["nsamples"] for s in shards] == [4] * (len(shards) - 1) + [
            len(paths) - 4 * (len(shards) - 1)]
        assert [s["url"] for s in shards] == [f"{name}-{i:06d}.tar" for i in range(len(shards))]
        assert [s["filesize"] for s in shards] == [(made.out / s["url"]).stat().st_size
                                                   for s in shards]
        urls += [s["url"] for s in shards]
    assert sorted(p.name for p in made.out.glob("*.tar")) == sorted(urls)
    assert len(made.split[0]) + len(made.split[2]) == 3 * 7  # all the readable images


def test_samples_are_the_split_training_gives_the_folder_in_its_order(made):
    train_paths, train_labels, val_paths, val_labels = made.split
    assert val_paths and train_paths
    assert read_back(made.out / "train.json", made.tmp / "cache-train") == expected(
        train_paths, train_labels)
    assert read_back(made.out / "val.json", made.tmp / "cache-val") == expected(
        val_paths, val_labels)
    # --seed reached the split: seed 0 holds out other images.
    assert split_train_val(scan_image_folder(made.folder), 0.2, 0)[2] != val_paths


def test_damaged_files_are_listed_not_written(made):
    assert made.res.returncode == 0
    assert not set(made.bad.values()) & set(shard_members(made.out).values())
    listed = dict(line.split("\t") for line in
                  (made.out / "skipped_files.txt").read_text().splitlines())
    assert listed.keys() == {str(p) for p in made.bad}
    assert all(why.startswith("not a readable image") for why in listed.values())
    assert "skipped 2 files" in made.res.stderr


def test_the_log_says_what_was_written(made):
    lines = made.res.stderr.splitlines()
    for name, paths in (("train", made.split[0]), ("val", made.split[2])):
        assert any(f"{name}: {len(paths)} images in {math.ceil(len(paths) / 4)} shards" in line
                   for line in lines), made.res.stderr


def test_a_rerun_leaves_no_stale_shard(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    folder, out = make_folder(tmp_path / "pets"), tmp_path / "shards"
    make(folder, out, "--shard-size", "2")
    damage(folder)
    assert len(list(out.glob("train-*.tar"))) > 1 and (out / "val.json").exists()
    make(folder, out, "--shard-size", "100", "--val-rate", "0")

    assert sorted(p.name for p in out.iterdir()) == ["skipped_files.txt", "train-000000.tar",
                                                     "train.json"]
    assert "val: no image, so no val.json" in caplog.text
    train_paths, train_labels = split_train_val(scan_image_folder(folder), 0, 0)[:2]
    assert read_back(out / "train.json", tmp_path / "cache") == expected(train_paths, train_labels)

    (folder / "cat" / "cut.jpg").unlink()
    (folder / "dog" / "notes.jpg").unlink()
    make(folder, out)
    assert not (out / "skipped_files.txt").exists()  # an earlier run's list would mislead


@pytest.mark.filterwarnings("ignore:String specifications:UserWarning")  # wids' own default
def test_the_index_loads_with_wids_as_users_read_shards(made):
    dataset = wids.ShardListDataset(str(made.out / "train.json"), cache_dir=str(made.tmp / "c"))
    assert len(dataset) == len(made.split[0])
    for i in (0, len(dataset) - 1):
        sample = dataset[i]
        image = sample[".jpg"] if ".jpg" in sample else sample[".png"]
        assert image.convert("RGB").size == (16, 16)
        assert sample[".cls"] == made.split[1][i]


def test_a_missing_folder_is_one_error_line(tmp_path):
    res = run([sys.executable, "make_shards.py", str(tmp_path / "nope"), str(tmp_path / "out")],
              timeout=120)
    assert_user_error(res, f"data path {tmp_path / 'nope'} does not exist")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--shard-size", "0"), ("--val-rate", "1.5"),
                                         ("--val-rate", "-0.1")])
def test_bad_numbers_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        make_shards.get_args_parser().parse_args(["pets", "out", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "error:" in err.splitlines()[-1] and flag in err
