"""Training from WebDataset shards (shards.py, make_shards.py), with a folder's guarantees.

- in process: a class-sorted set of shards gives mixed batches; start-up reads the index alone
  (no shard is opened); a damaged sample, a shard cut short or not a tar at all is listed once
  and stands in as an ignored sample, a missing shard is an error; a bad index is one line;
- end to end (2 gloo ranks): shards made from the reference's folder train to its weights,
  tensor for tensor, also from a real HTTP server; a stop mid-epoch continues to those weights,
  or on one process with each sample of the epoch's rest once; --eval-only and predict.py take
  the run's classes; damaged shards are listed and the run goes on; a shard the server lacks is
  one error line."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import webdataset
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader

from conftest import (LAUNCH, REFERENCE_EPOCHS, assert_same_run, clone_run, error_lines, flags,
                      load_ckpt, make_stopper, ranks, read_metrics)
from http_server import nginx_binary, serve
from test_predict import AS_PREDICT
from test_preemption import RECORD_SAMPLER, STEPS_PER_EPOCH, flags_for
import make_shards
from augment import get_transforms
from image_folder import DataError
from multi_train_utils.data import ResumableSampler
from multi_train_utils.train_eval_utils import IGNORE_INDEX
from shards import ShardSet, fetch, open_shards, read_index

SERVER = "nginx" if nginx_binary() else "http.server"
CLASSES = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]  # tiny_data
SHARD_SIZE = 7  # 44 training images: 6 shards of 7, then one of 2


@pytest.fixture(scope="module")
def shard_dir(tiny_data, tmp_path_factory) -> Path:
    """tiny_data as shards, with training's split (--val-rate 0.2, --seed 0)."""
    out = tmp_path_factory.mktemp("shards") / "tiny"
    make_shards.main(make_shards.get_args_parser().parse_args(
        [str(tiny_data), str(out), "--shard-size", str(SHARD_SIZE)]))
    return out


def shard_flags(shards: str, out: Path, *extra: str, workers: int = 1) -> list[str]:
    """flags() of the reference run, the data from ``shards`` (a folder or a URL)."""
    argv = flags(Path("x"), out, "--val-path", f"{shards}/val.json", *extra, workers=workers)
    argv[argv.index("--data-path") + 1] = f"{shards}/train.json"
    return argv


def write_tar(path: Path, samples: list[dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for name, data in sample.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------- in process
def test_class_sorted_shards_give_mixed_batches(shard_dir):
    """make_shards writes class after class; each epoch is one shuffle of every sample."""
    index = read_index(str(shard_dir / "train.json"))
    dataset = ShardSet(index, seed=0)
    in_order = [dataset[i][1] for i in range(8)]
    assert in_order == [0] * 8  # the shards hold one class after another
    sampler = ResumableSampler(dataset, 1, 0, seed=0)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, 8, drop_last=True),
                        collate_fn=lambda batch: [label for _, label in batch])
    batches = list(loader)
    assert len(batches) == len(dataset) // 8
    assert all(len(set(labels)) >= 3 for labels in batches), batches


def test_shards_shard_writer_wrote_train_as_they_are_with_widsindex_s_index(tmp_path):
    """A user's own WebDataset shards (jpg, jpeg and png keys, an integer cls) and the index
    ``widsindex create`` writes, which names no classes: --num-classes does."""
    images = [Image.new("RGB", (8, 8), (40 * k, 0, 0)) for k in range(5)]
    with webdataset.ShardWriter(str(tmp_path / "own-%02d.tar"), maxcount=2) as sink:
        for k, (image, ext) in enumerate(zip(images, ["jpg", "jpeg", "png", "jpg", "png"])):
            sink.write({"__key__": f"img{k}", ext: image, "cls": k % 3})
    res = subprocess.run([str(Path(sys.executable).parent / "widsindex"), "create", "-o",
                          "index.json", *sorted(p.name for p in tmp_path.glob("own-*.tar"))],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    index, train_set, _ = open_shards(str(tmp_path / "index.json"), str(tmp_path / "index.json"),
                                      {"train": None, "val": None}, seed=0, skip_log=None,
                                      cache_dir=None, num_classes=3)
    assert index.classes == ["0", "1", "2"]
    assert [train_set[i][1] for i in range(len(train_set))] == [0, 1, 2, 0, 1]
    assert train_set[2][0][:, 0, 0].tolist() == [80, 0, 0]  # the png, decoded


def test_start_up_reads_the_index_alone(tmp_path):
    """10,000 shards that are not there: the sets are made, their length known; the first
    sample of a missing shard is an error naming it, not a silently skipped shard."""
    index = tmp_path / "train.json"
    index.write_text(json.dumps({"wids_version": 1, "classes": ["a", "b"], "shardlist": [
        {"url": f"s-{i:06d}.tar", "nsamples": 100} for i in range(10_000)]}))
    _, train_set, val_set = open_shards(str(index), str(index), {"train": None, "val": None},
                                        seed=0, skip_log=None, cache_dir=None, num_classes=None)
    assert len(train_set) == len(val_set) == 1_000_000
    with pytest.raises(FileNotFoundError, match="s-000042.tar"):
        train_set[4_200]


def test_damaged_samples_and_shards_are_listed_once_and_ignored(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, "JPEG")
    jpeg = buffer.getvalue()
    write_tar(tmp_path / "a.tar", [
        {"00.jpg": jpeg, "00.cls": b"1"},
        {"01.jpg": jpeg[:40], "01.cls": b"0"},  # cut short
        {"02.jpg": jpeg, "02.cls": b"7"},  # no such class
        {"03.jpg": jpeg},  # no label
        {"04.png": b"not a png", "04.cls": b"0"}])
    write_tar(tmp_path / "b.tar", [{"00.jpg": jpeg, "00.cls": b"1"},  # its index says 5
                                   {"01.jpg": jpeg, "01.cls": b"0"}])
    (tmp_path / "c.tar").write_bytes(b"<html>not a tar</html>")
    (tmp_path / "i.json").write_text(json.dumps({"wids_version": 1, "classes": ["x", "y"],
                                                 "shardlist": [{"url": "a.tar", "nsamples": 5},
                                                               {"url": "b.tar", "nsamples": 5},
                                                               {"url": "c.tar", "nsamples": 3}]}))
    skip_log = tmp_path / "skipped_files.txt"
    dataset = ShardSet(read_index(str(tmp_path / "i.json")), skip_log=skip_log)
    labels = [dataset[i][1] for i in range(len(dataset))] * 2  # twice: each listed once
    assert labels[:5] == [1, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert labels[5:13] == [1, 0] + [IGNORE_INDEX] * 6
    listed = [line.split("\t")[0] for line in skip_log.read_text().splitlines()]
    a, b, c = (str(tmp_path / name) for name in ("a.tar", "b.tar", "c.tar"))
    assert listed == [f"{a}#01", f"{a}#02", f"{a}#03", f"{a}#04", b, c], listed
    assert "label 7, not one of 2 classes" in skip_log.read_text()
    clone = pickle.loads(pickle.dumps(dataset))  # a loader worker started by spawn
    assert clone[0][1] == 1 and clone._reader is not dataset._reader


def test_a_download_short_of_the_index_s_size_is_an_error_and_not_kept(shard_dir, tmp_path):
    """A download cut short (here: an index that expects more bytes) is never read as the shard,
    and a shard made again (another size in its index) is fetched again, not read from the cache."""
    shard = json.loads((shard_dir / "train.json").read_text())["shardlist"][0]
    with serve(shard_dir) as (url, _):
        listed = {**shard, "url": f"{url}/{shard['url']}"}
        local = fetch(listed, str(tmp_path))
        assert Path(local).read_bytes() == (shard_dir / shard["url"]).read_bytes()
        with pytest.raises(OSError, match=rf"could not be downloaded \({shard['filesize']} "
                                          rf"bytes, its index says {shard['filesize'] + 512}\)"):
            fetch({**listed, "filesize": shard["filesize"] + 512}, str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == [Path(local).name]


@pytest.mark.parametrize("text, needle", [
    ("{not json", "is not a shard index (JSONDecodeError"),
    (json.dumps({"shards": []}), "is not a shard index (KeyError"),
    (json.dumps({"shardlist": [{"url": "a.tar", "nsamples": 3}]}), "names no classes; give "
     "--num-classes N")])
def test_a_bad_index_is_one_sentence(tmp_path, text, needle):
    (tmp_path / "i.json").write_text(text)
    with pytest.raises(DataError, match=needle.replace("(", r"\(")):
        read_index(str(tmp_path / "i.json"))


@pytest.mark.parametrize("val_index, decode, needle", [
    (None, "workers", "is a shard index: give the validation shards' as --val-path"),
    ("val.json", "device", "--decode device reads image files")])
def test_what_shards_cannot_take_is_refused(val_index, decode, needle):
    transforms = get_transforms(32, decode)
    with pytest.raises(DataError, match=needle):
        open_shards("train.json", val_index, transforms, seed=0, skip_log=None, cache_dir=None,
                    num_classes=None)


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def shard_run(shard_dir, tmp_path_factory, plain):
    """The reference run's flags, from the shards, with a loader worker per rank."""
    out = tmp_path_factory.mktemp("shard-run") / "run"
    res = ranks(plain, 2, LAUNCH, *shard_flags(str(shard_dir), out, "--epochs",
                                               str(REFERENCE_EPOCHS)))
    return SimpleNamespace(out=out, result=res)


@pytest.mark.fast
def test_shards_train_to_the_folders_weights(shard_run, reference_run):
    res = shard_run.result
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert_same_run(shard_run.out, reference_run.out)
    assert "each epoch leaves out the last 2 images of each process's" in res.stderr  # 44 / 2
    assert json.loads((shard_run.out / "class_indices.json").read_text())["0"] == "daisy"


def test_eval_only_and_predict_take_the_runs_classes(shard_run, shard_dir, tiny_data, plain):
    """Validation counts each image once: 16 on 3 ranks, 2 of them padded repeats."""
    val = len(ShardSet(read_index(str(shard_dir / "val.json"))))
    assert val % 3
    argv = ["--device", "cpu", "--eval-only", "--resume", str(shard_run.out / "checkpoint.pth"),
            "--val-path", str(shard_dir / "val.json"), "--output-dir", str(shard_run.out)]
    res = ranks(plain, 3, LAUNCH, *argv)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"val images: {val}\n" in res.stderr, res.stderr[-2000:]
    image = next((tiny_data / "roses").iterdir())
    res = plain([str(image), "--weights", str(shard_run.out / "model_best.pth"), "--device",
                 "cpu"], patch=AS_PREDICT)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and all(name in text for name in CLASSES), text[-2000:]


def test_a_stopped_shard_run_continues_to_the_same_weights(shard_dir, reference_run, tmp_path,
                                                           plain):
    out = tmp_path / "run"
    argv = shard_flags(str(shard_dir), out, "--epochs", str(REFERENCE_EPOCHS))
    res = ranks(plain, 2, make_stopper(tmp_path), LAUNCH, *argv, STOP_RANK="1",
                STOP_AFTER=str(STEPS_PER_EPOCH + 3))
    assert res.codes == [143, 143], (res.stdout + res.stderr)[-3000:]
    assert load_ckpt(out / "checkpoint.pth")["in_epoch"]["batches"] == 3
    stopped = clone_run(out, tmp_path / "stopped", full=True)
    res = ranks(plain, 2, LAUNCH, *argv)  # the same command
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert f"resuming from epoch 1, step 3 of {STEPS_PER_EPOCH}\n" in res.stderr
    assert_same_run(out, reference_run.out)
    # On one process: the rest of the stopped epoch's order, each sample once.
    log = tmp_path / "sampler.jsonl"
    res = plain(flags_for(argv, stopped), patch=RECORD_SAMPLER, SAMPLER_LOG=str(log))
    assert res.returncode == 0, res.stderr[-3000:]
    first = json.loads(log.read_text().splitlines()[0])
    order = torch.randperm(first["n"], generator=torch.Generator().manual_seed(0 + 1)).tolist()
    assert (first["epoch"], first["skip"], first["indices"]) == (1, 24, order[24:])
    assert [m["epoch"] for m in read_metrics(stopped)] == [0, 1, 2]


@pytest.mark.parametrize("server", [SERVER])
def test_shards_over_http_train_to_the_same_weights(server, shard_dir, reference_run, tmp_path,
                                                    plain):
    """Served by a real server (nginx where installed: the test's id names it); each shard is
    downloaded once per machine into --shard-cache; a shard the server lacks is one line."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    with serve(shard_dir) as (url, name):
        assert name == server
        res = ranks(plain, 2, LAUNCH, *shard_flags(url, out, "--epochs", str(REFERENCE_EPOCHS),
                                                   "--shard-cache", str(cache)))
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        assert_same_run(out, reference_run.out)
        names = sorted(p.name.split("-", 1)[1] for p in cache.glob("*.tar"))
        assert names == sorted(p.name for p in shard_dir.glob("*.tar"))
        assert not list(cache.glob("*.part"))
        index = json.loads((shard_dir / "train.json").read_text())
        index["shardlist"][2]["url"] = "gone.tar"
        (shard_dir / "gone.json").write_text(json.dumps(index))
        argv = shard_flags(url, tmp_path / "gone", "--shard-cache", str(cache))
        argv[argv.index("--data-path") + 1] = f"{url}/gone.json"
        res = ranks(plain, 2, LAUNCH, *argv)
    assert res.returncode == 1, (res.stdout + res.stderr)[-4000:]
    needle = f"error: shard {url}/gone.tar could not be downloaded (HTTP Error 404"
    assert any(needle in line for line in error_lines(res.stderr)), res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def test_damaged_shards_are_listed_and_the_run_goes_on(shard_dir, tmp_path, plain):
    damaged = tmp_path / "shards"
    shutil.copytree(shard_dir, damaged)
    first = damaged / "train-000000.tar"
    first.write_bytes(first.read_bytes()[:3000])  # cut short in its first samples
    (damaged / "train-000003.tar").write_bytes(b"not a tar")
    out = tmp_path / "run"
    res = ranks(plain, 2, LAUNCH, *shard_flags(str(damaged), out, "--epochs", "1"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    listed = {line.split("\t")[0].split("#")[0]
              for line in (out / "skipped_files.txt").read_text().splitlines()}
    assert listed == {str(first), str(damaged / "train-000003.tar")}, listed
    assert [m["epoch"] for m in read_metrics(out)] == [0]
