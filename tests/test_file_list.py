"""A continued run starts without listing the data folder again (issue 38).

Unit level: the list a run stores (``file_list.json``) is reused while no folder of the data
changed, and listed again when a file is added or removed (no file changes side in the split),
when a folder changed too recently to trust its times, or for ``--verify-images`` over a list
made without it. End to end: unreadable images are found by the loader, replaced and listed,
and a continued run keeps that list; a 2-process run stores what it trained on (its 2-process
continuation, which reuses it, is in test_preemption.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import image_folder
from conftest import flags, read_metrics
from demo_data import make_demo_data
from image_folder import SCAN_FILE, FolderScan, scan_image_folder, split_train_val

# The folders were written long ago: their times are trusted (see image_folder._times).
SETTLED = "import time, image_folder\nimage_folder.time_ns = lambda: time.time_ns() + 10**10\n"


@pytest.fixture
def settled(monkeypatch):
    monkeypatch.setattr(image_folder, "time_ns", lambda: time.time_ns() + 10**10)


def data_tree(root: Path, per_class: int) -> Path:
    """The demo's 5 classes, a nested folder and a file that is no image."""
    make_demo_data(root, per_class=per_class, size=16)
    shutil.copytree(root / "roses", root / "daisy" / "more")
    (root / "tulips" / "notes.txt").write_text("picked in May\n")
    return root


def stored(out: Path, root: Path, verify: bool = False) -> FolderScan:
    scan = scan_image_folder(root, verify=verify, reuse=out)
    scan.write_files(out)
    return scan


def side(scan: FolderScan) -> dict[str, str]:
    train, _, val, _ = split_train_val(scan, 0.3, seed=0)
    return dict.fromkeys(train, "train") | dict.fromkeys(val, "val")


def test_the_stored_list_is_reused_while_no_folder_changes(tmp_path, settled, monkeypatch):
    data, out = data_tree(tmp_path / "data", 3), tmp_path / "run"
    out.mkdir()
    first = stored(out, data)
    assert not first.reused and sum(map(len, first.images)) == 18
    assert sorted(json.loads((out / SCAN_FILE).read_text())["times"]) == [
        "", "daisy", "daisy/more", "dandelion", "roses", "sunflowers", "tulips"]
    with open(out / "skipped_files.txt", "a", encoding="utf-8") as f:  # as the loader appends
        f.write(f"{data / 'roses' / '0001.jpg'}\tnot a readable image at load time (...)\n")
    listed = (out / "skipped_files.txt").read_text(encoding="utf-8")
    with monkeypatch.context() as patched:
        patched.setattr(os, "scandir", lambda path: pytest.fail(f"{path} was listed"))
        again = stored(out, data)
    assert again.reused and (again.root, again.classes, again.images, again.skipped) == (
        first.root, first.classes, first.images, first.skipped)
    assert (out / "skipped_files.txt").read_text(encoding="utf-8") == listed  # kept whole
    thorough = stored(out, data, verify=True)  # a list made without reading headers: not enough
    assert not thorough.reused and thorough.verified
    assert stored(out, data).reused  # the verified list serves a run without --verify-images


@pytest.mark.parametrize("change", ["add", "remove", "add nested", "remove nested"])
def test_a_file_added_or_removed_is_listed_again_and_none_changes_side(tmp_path, settled,
                                                                        change):
    data, out = data_tree(tmp_path / "data", 12), tmp_path / "run"
    out.mkdir()
    before = stored(out, data)
    time.sleep(0.05)  # a clock tick on: a folder's times change with what is put in it
    folder = data / "daisy" / ("more" if "nested" in change else "")
    if change.startswith("add"):
        shutil.copy(data / "tulips" / "0000.jpg", folder / "new.jpg")
    else:
        removed = next(folder.glob("*.jpg"))
        removed.unlink()
    after = stored(out, data)
    assert not after.reused
    old, new = ({*sum(scan.images, [])} for scan in (before, after))
    if change.startswith("add"):
        assert new - old == {str(folder / "new.jpg")} and not old - new
    else:
        assert old - new == {str(removed)} and not new - old
    was, now = side(before), side(after)
    assert all(was[path] == now[path] for path in old & new)
    assert stored(out, data).reused  # the new list is stored, and serves the next start


def test_a_folder_changed_in_the_last_seconds_is_listed_again(tmp_path):
    """Its times may not show a change made in the same clock tick, so they are not trusted."""
    data, out = data_tree(tmp_path / "data", 2), tmp_path / "run"
    out.mkdir()
    stored(out, data)
    assert [] in json.loads((out / SCAN_FILE).read_text())["times"].values()
    assert not scan_image_folder(data, verify=False, reuse=out).reused


def test_bad_images_are_found_at_load_time_and_a_continued_run_keeps_the_list(tiny_data,
                                                                               tmp_path, plain,
                                                                               settled):
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    (data / "daisy" / "corrupt.jpg").write_bytes(np.random.default_rng(0).bytes(3000))
    (data / "roses" / "empty.jpg").write_bytes(b"")
    res = plain(flags(data, out, "--epochs", "1"), patch=SETTLED)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not listed again" not in res.stderr
    names = {str(data / "daisy" / "corrupt.jpg"), str(data / "roses" / "empty.jpg")}
    stored_list = scan_image_folder(data, verify=False, reuse=out)
    assert stored_list.reused and names <= {*sum(stored_list.images, [])}  # in the data set

    def listed() -> list[tuple[str, str]]:
        lines = (out / "skipped_files.txt").read_text(encoding="utf-8").splitlines()
        return sorted(tuple(line.split("\t")) for line in lines)
    found = listed()
    assert [path for path, _ in found] == sorted(names)  # by whichever loader met them
    assert all(why.startswith("not a readable image at load time (") for _, why in found)
    res = plain(flags(data, out, "--epochs", "2"), patch=SETTLED)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{data} is unchanged since {out / SCAN_FILE} listed it: not listed again" in res.stderr
    assert listed() == found and [m["epoch"] for m in read_metrics(out)] == [0, 1]


@pytest.mark.fast
def test_a_two_process_run_stores_the_list_it_trained_on(reference_run, tiny_data):
    stored_list = scan_image_folder(tiny_data, verify=False, reuse=reference_run.out)
    fresh = scan_image_folder(tiny_data, verify=False)
    assert stored_list.reused and not stored_list.verified
    assert (stored_list.root, stored_list.classes, stored_list.images) == (
        fresh.root, fresh.classes, fresh.images)
    assert sum(map(len, stored_list.images)) == 60
