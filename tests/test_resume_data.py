"""A continued run trains on the data it should, whatever changed in the folder since the stop.

- a stopped epoch ends over exactly the images it began with, the rest of its order once each,
  though images were added and one became unreadable (``--verify-images`` drops it); the new
  ones join at the next epoch (stopped on 1 process, continued on 2 under torchrun);
- an image ``--verify-images`` skipped (a copy not finished) is read again and trains once fixed;
- a class folder whose name is not UTF-8 trains, and its name is written with escapes;
- a resume leaves torch's RNG (dropout) as an uninterrupted run has it at that step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from conftest import (LAUNCH, ROOT, STOPPER, assert_same_tensors, flags, load_ckpt, read_metrics,
                      ranks)
from predict import format_prediction, load_predictor, predict
from multi_train_utils.data import EpochProgress
from image_folder import (SCAN_FILE, STOPPED_SCAN_FILE, scan_image_folder, split_train_val)

# Each ResumableSampler.__iter__: its epoch and the paths it dealt, per rank.
RECORD = """
import json, os
from multi_train_utils.data import ResumableSampler
_iter = ResumableSampler.__iter__
def _recorded(self):
    indices = list(_iter(self))
    with open(os.environ["SAMPLER_LOG"] + os.environ.get("RANK", "0"), "a") as f:
        paths = [self.dataset.images_path[i] for i in indices]
        f.write(json.dumps(dict(epoch=self.epoch, paths=paths)) + "\\n")
    return iter(indices)
ResumableSampler.__iter__ = _recorded
"""
SETTLED = "import time, image_folder\nimage_folder.time_ns = lambda: time.time_ns() + 10**10\n"


def dealt(log: Path, ranks: int = 1) -> dict[int, list[list[str]]]:
    """{epoch: [paths dealt to rank 0, to rank 1, ...]} from ``RECORD``'s files."""
    epochs: dict[int, list[list[str]]] = {}
    for rank in range(ranks):
        for line in Path(f"{log}{rank}").read_text().splitlines():
            record = json.loads(line)
            epochs.setdefault(record["epoch"], [[] for _ in range(ranks)])[rank] = record["paths"]
    return epochs


def train_list(data: Path) -> list[str]:
    return split_train_val(scan_image_folder(data, verify=True), 0.2, seed=0)[0]


def test_a_stopped_epoch_ends_over_its_own_images_and_new_ones_join_the_next(tiny_data, tmp_path,
                                                                             plain):
    data, out, log = tmp_path / "data", tmp_path / "run", tmp_path / "sampler"
    shutil.copytree(tiny_data, data)
    argv = flags(data, out, "--epochs", "2", "--verify-images")
    res = plain(argv, patch=STOPPER + RECORD, STOP_AFTER="3", SAMPLER_LOG=f"{log}-first-")
    assert res.returncode == 143, res.stderr[-3000:]
    before, order = train_list(data), dealt(Path(f"{log}-first-"))[0][0]
    read, rest = order[:12], order[12:]  # 3 steps of 4 on one process
    assert sorted(order) == sorted(before) and load_ckpt(out / "checkpoint.pth")["in_epoch"][
        "samples"] == 12
    for i, folder in enumerate(p for p in sorted(data.iterdir()) for _ in range(3)):
        shutil.copy(data / "tulips" / f"{i % 12:04d}.jpg", folder / f"new-{i}.jpg")
    bad = rest[-1]
    Path(bad).write_bytes(Path(bad).read_bytes()[:300])  # cut short: --verify-images drops it
    after = train_list(data)
    added = set(after) - set(before)
    assert len(added) > 5 and set(before) - set(after) == {bad}
    res = ranks(plain, 2, str(recorder(tmp_path)), LAUNCH, *argv, SAMPLER_LOG=f"{log}-")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "resuming from epoch 0, step 3 of 11 of 1 processes" in res.stderr
    assert (f"{len(added)} images added since the stop: they join at epoch 1; 1 gone (removed "
            "or unreadable): epoch 0 goes on without them") in res.stderr
    epochs = dealt(Path(f"{log}-"), ranks=2)
    dealt_rest = [path for pair in zip(*epochs[0]) for path in pair]  # in the epoch's order
    unread = len(before) - len(read) - 1
    assert sorted(read + dealt_rest[:unread]) == sorted(set(before) - {bad})  # each once
    assert len(dealt_rest) == unread + 1 and dealt_rest[-1] in read  # padded to equal shares
    assert set(sum(epochs[1], [])) == set(after)  # the new list from the next epoch on
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    kept = json.loads((out / STOPPED_SCAN_FILE).read_text())  # the list epoch 0 began with
    assert sum(map(len, kept["images"])) == 60 and json.loads((out / SCAN_FILE).read_text())[
        "digest"] == load_ckpt(out / "checkpoint.pth")["file_list"] != kept["digest"]


def test_a_second_stop_in_that_epoch_still_finds_the_list_it_began_with(tiny_data, tmp_path):
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    out.mkdir()
    old = scan_image_folder(data, verify=False)
    old.write_files(out)
    shutil.copy(data / "daisy" / "0000.jpg", data / "daisy" / "new.jpg")
    (data / "roses" / "0000.jpg").unlink()
    new = scan_image_folder(data, verify=False, reuse=out)
    train, before = split_train_val(new, 0.2, 0)[0], split_train_val(old, 0.2, 0)[0]
    ckpt = dict(epoch=0, in_epoch=dict(samples=8), file_list=old.digest,
                args=dict(val_rate=0.2, seed=0))
    for _ in range(2):  # the rerun, then a rerun after a second stop in the same epoch
        progress = EpochProgress()
        new.resume_epoch(progress, ckpt, out, train)
        assert progress.file_list == old.digest and len(progress.indices) == len(before)
        assert [train[i] if i >= 0 else None for i in progress.indices.tolist()] == [
            None if p.endswith("roses/0000.jpg") else p for p in before]
        new.write_files(out)  # as the rerun does: file_list.json is the new list
        assert (out / STOPPED_SCAN_FILE).is_file() and (out / SCAN_FILE).is_file()
    progress = EpochProgress()  # the epoch ended: the new list from then on
    new.resume_epoch(progress, {**ckpt, "in_epoch": None}, out, train)
    assert progress.file_list == new.digest and progress.indices is None


def recorder(folder: Path) -> Path:
    script = folder / "recorder.py"
    script.write_text(f"import runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n{RECORD}\n"
                      "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    return script


def test_an_image_skipped_while_it_was_copied_trains_once_complete(tiny_data, tmp_path, plain):
    data, out, log = tmp_path / "data", tmp_path / "run", tmp_path / "sampler"
    shutil.copytree(tiny_data, data)
    whole = (data / "daisy" / "0000.jpg").read_bytes()
    copying = data / "daisy" / "copying.jpg"
    copying.write_bytes(whole[:len(whole) // 2])  # half copied when the run starts
    argv = flags(data, out, "--epochs", "1", "--verify-images")
    res = plain(argv, patch=SETTLED)
    assert res.returncode == 0, res.stderr[-3000:]
    assert str(copying) in (out / "skipped_files.txt").read_text()
    copying.write_bytes(whole)  # the copy ends; the folder's times stay as they were
    res = plain([*argv[:-3], "--epochs", "2", "--verify-images"], patch=SETTLED + RECORD,
                SAMPLER_LOG=str(log))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"1 skipped file(s) read well now ({copying}): {data} is listed again" in res.stderr
    assert str(copying) in dealt(log)[1][0]  # it trains
    assert not (out / "skipped_files.txt").exists()
    assert str(copying.relative_to(data / "daisy")) in json.loads(
        (out / SCAN_FILE).read_text())["images"][0]


def test_a_class_folder_whose_name_is_not_utf8_trains_and_is_written_escaped(tiny_data, tmp_path,
                                                                             plain):
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    os.rename(data / "roses", os.fsdecode(os.fsencode(data) + b"/caf\xe9"))  # Latin-1 "café"
    res = plain(flags(data, out, "--epochs", "1", "--tensorboard"))  # plots the names too
    assert res.returncode == 0, res.stderr[-3000:]
    text = (out / "class_indices.json").read_text(encoding="utf-8")  # valid UTF-8
    assert '"caf\\udce9"' in text and json.loads(text)["0"] == os.fsdecode(b"caf\xe9")
    model, classes, preprocess = load_predictor(out / "weights" / "model-0.pth",
                                                class_indices=out / "class_indices.json")
    assert classes[0] == os.fsdecode(b"caf\xe9")
    assert preprocess(torch.zeros(3, 50, 60, dtype=torch.uint8)).shape == (3, 32, 32)
    image = Path(os.fsdecode(os.fsencode(data) + b"/caf\xe9/0000.jpg"))
    [line] = map(format_prediction, predict(model, [image], classes, preprocess,
                                            torch.device("cpu")))
    assert line.startswith(f"{data}/caf\\xe9/0000.jpg\t") and "caf\\xe9: " in line


DROPOUT = """
import hashlib, os, torch, torch.nn as nn, model
import multi_train_utils.train_eval_utils as loop
model.get_model = lambda name, num_classes, **kw: nn.Sequential(
    nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, num_classes)
)
_plain_step = loop._optimizer_step
def _recorded(*args, **kwargs):
    _plain_step(*args, **kwargs)
    with open(os.environ["RNG_LOG"], "a") as f:
        f.write(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest() + "\\n")
loop._optimizer_step = _recorded
"""


def test_a_resumed_model_with_dropout_draws_what_an_uninterrupted_one_draws(tiny_data, tmp_path,
                                                                            plain):
    logs = {name: tmp_path / f"{name}.rng" for name in ("whole", "stopped", "resumed")}
    whole = flags(tiny_data, tmp_path / "whole", "--epochs", "2", "--tensorboard")
    assert plain(whole, patch=DROPOUT, RNG_LOG=str(logs["whole"])).returncode == 0
    argv = flags(tiny_data, tmp_path / "run", "--epochs", "2", "--tensorboard")
    res = plain(argv, patch=DROPOUT + STOPPER, STOP_AFTER="3", RNG_LOG=str(logs["stopped"]))
    assert res.returncode == 143, res.stderr[-3000:]
    res = plain(argv, patch=DROPOUT, RNG_LOG=str(logs["resumed"]))
    assert res.returncode == 0 and "resuming from epoch 0, step 3" in res.stderr, res.stderr[-3000:]
    states = {name: path.read_text().split() for name, path in logs.items()}
    assert len(states["whole"]) == 22 and states["stopped"] == states["whole"][:3]
    assert states["resumed"] == states["whole"][3:]  # torch's RNG after each optimizer step
    assert_same_tensors(load_ckpt(tmp_path / "run" / "checkpoint.pth")["model"],
                        load_ckpt(tmp_path / "whole" / "checkpoint.pth")["model"])
