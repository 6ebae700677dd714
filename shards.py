"""Training data as WebDataset tar shards, local or over HTTP (docs/shards.md), read by index
with wids (webdataset's indexed reader): sample ``i`` of a shard index is ``dataset[i]``, so the
sampler, the exact resume and the equal steps are the folder's own."""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from http.client import HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlparse

from image_folder import IMG_EXTENSIONS, DataError
from my_dataset import (MyDataSet, _machine_error, load_image_tensor, load_pil_image,
                        report_unreadable)
from run_log import write_json_atomic

log = logging.getLogger(__name__)

# Shards a loader worker keeps open (a file descriptor each). A shuffle over all samples opens
# every shard in turn, and one opened again is indexed again: keep a set's shards below this.
OPEN_SHARDS = 200
HTTP_TIMEOUT_S = 60


def is_shard_index(path: str | None) -> bool:
    """``path`` names a shard index (a ``.json`` file or URL), not an image folder."""
    return bool(path) and urlparse(path).path.endswith(".json")


def _is_url(path: str) -> bool:
    return urlparse(path).scheme in ("http", "https")


@dataclass
class ShardIndex:
    """A wids shard index: ``shards`` with absolute urls, and their ``digest``."""

    path: str
    classes: list[str]
    shards: list[dict[str, Any]]
    digest: str

    def resume_epoch(self, progress: Any, ckpt: dict[str, Any], out: Path, _: Any) -> None:
        """As ``FolderScan.resume_epoch``, for a list of shards that does not change."""
        progress.file_list = ckpt.get("in_epoch") and ckpt.get("file_list") or self.digest
        if progress.file_list != self.digest:
            log.warning("%s lists other shards than when epoch %d stopped: its rest may repeat "
                        "or miss samples", self.path, ckpt["epoch"])

    def write_files(self, out: Path) -> None:
        write_json_atomic(out / "class_indices.json", dict(enumerate(self.classes)))  # predict


def read_index(path: str, classes: list[str] | None = None) -> ShardIndex:
    """The shard index at ``path`` (a file or an http(s) URL), relative urls below it (or its
    ``base``) as wids takes them; ``classes`` where it names none. A bad one: a ``DataError``."""
    try:
        url = path if _is_url(path) else Path(path).absolute().as_uri()
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            spec = json.load(response)
        listed = [(shard["url"], int(shard["nsamples"])) for shard in spec["shardlist"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path} is not a shard index ({type(exc).__name__}: {exc}); give the "
                        "index make_shards.py or widsindex wrote (docs/shards.md).") from None
    if not (classes := spec.get("classes") or classes):
        raise DataError(f"{path} names no classes; give --num-classes N (its .cls labels are "
                        "0 to N-1).")
    base = os.path.join(spec.get("base") or os.path.dirname(
        path if _is_url(path) else os.path.abspath(path)), "")
    join = urljoin if _is_url(base) else os.path.join
    shards = [{**shard, "url": shard["url"] if _is_url(shard["url"]) else join(base, shard["url"])}
              for shard in spec["shardlist"]]
    return ShardIndex(path, list(classes), shards,
                      hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16])


def fetch(shard: dict[str, Any], cache_dir: str) -> str:
    """The file to read ``shard`` from: its own, or an http(s) one's copy in ``cache_dir``, named
    by what the index says of it (a shard made again is fetched again), downloaded whole once per
    machine and renamed when complete and of the index's ``filesize``. A failure raises
    ``OSError``, which stops the run: a shard left out would leave out its samples."""
    url = shard["url"]
    if not _is_url(url):
        return url
    listed = hashlib.sha256(json.dumps(shard, sort_keys=True).encode()).hexdigest()[:16]
    local = os.path.join(cache_dir, f"{listed}-{os.path.basename(urlparse(url).path)}")
    if os.path.exists(local):
        return local
    os.makedirs(cache_dir, exist_ok=True)
    with open(local + ".download-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(local):
            try:
                with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response, \
                        open(local + ".part", "wb") as part:
                    shutil.copyfileobj(response, part, 1 << 20)
                size = os.path.getsize(local + ".part")
                if size != shard.get("filesize", size):
                    raise OSError(f"{size} bytes, its index says {shard['filesize']}")
            except (OSError, HTTPException) as exc:  # no server, HTTP 404, cut, disk full
                raise OSError(f"shard {url} could not be downloaded ({exc})") from None
            os.replace(local + ".part", local)
    return local


class ShardSet(MyDataSet):
    """The samples of a :class:`ShardIndex`, in order: ``dataset[i]`` -> ``(transform(image),
    label)`` as :class:`MyDataSet`'s, augmented alike from ``(seed, epoch, i)``. Each process
    opens the shards it reads (:func:`fetch`). A sample that cannot be read (a damaged image,
    a label missing or not one of the classes), or each of a damaged shard, is listed once and
    stands as an ignored one (``MyDataSet.stand_in``); a missing shard stops the run."""

    def __init__(self, index: ShardIndex, transform: Callable[[Any], Any] | None = None, *,
                 seed: int = 0, skip_log: Path | None = None, cache_dir: str | None = None
                 ) -> None:
        super().__init__([], [], transform, seed=seed, skip_log=skip_log)
        self.index = index
        self.cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "shard-cache")
        self.starts = list(accumulate((shard["nsamples"] for shard in index.shards), initial=0))
        self._reader, self._listed = None, set()  # this process's open shards, listed names

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_reader": None}  # open files stay with their process

    def _load_or_replace(self, index: int) -> tuple[Any, int]:
        at = bisect.bisect_right(self.starts, index) - 1
        shard, i, sample = self.index.shards[at], index - self.starts[at], None
        if self._reader is None:  # the least recently read is closed (by the garbage collector)
            from wids.wids import IndexedTarSamples  # an extra (requirements.txt): shards only
            self._reader = lru_cache(OPEN_SHARDS)(lambda at: IndexedTarSamples(
                path=fetch(self.index.shards[at], self.cache_dir)))
        try:
            samples = self._reader(at)
            if i >= len(samples):  # a tar cut short: fewer samples than its index says
                raise IndexError(f"{len(samples)} samples, its index says {shard['nsamples']}")
            sample = samples[i]
            label = int(sample[".cls"].read())
            if not 0 <= label < len(self.index.classes):
                raise ValueError(f"label {label}, not one of {len(self.index.classes)} classes")
            image = next(sample[key] for key in IMG_EXTENSIONS if key in sample)
            return (load_pil_image(image) if self.use_pil else load_image_tensor(image)), label
        except Exception as exc:  # any decoder's error, no image or label, a damaged shard
            if isinstance(exc, OSError) and sample is None or _machine_error(exc):
                raise  # no shard file, no download (fetch), no file descriptor left
            name = f"{shard['url']}#{sample['__key__']}" if sample else shard["url"]
            if name not in self._listed:  # a damaged shard's samples: one line, not each
                self._listed.add(name)
                report_unreadable(name, exc, self.skip_log)
            return self.stand_in()


def open_shards(train_index: str, val_index: str | None, transforms: dict[str, Any], *,
                seed: int, skip_log: str | os.PathLike | None, cache_dir: str | None,
                num_classes: int | None) -> tuple[ShardIndex, ShardSet, ShardSet]:
    """``(index, train_set, val_set)`` of two shard indexes (the same one: --eval-only). Each
    rank reads the indexes; no shard is opened before a loader asks for one of its samples."""
    if not val_index:
        raise DataError(f"{train_index} is a shard index: give the validation shards' as "
                        "--val-path (make_shards.py writes val.json beside it).")
    if hasattr(transforms["train"], "read"):  # device_decode's: it reads image files
        raise DataError("--decode device reads image files; shards decode in the loader "
                        "workers: use --decode workers.")
    train = read_index(train_index, num_classes and [str(i) for i in range(num_classes)])
    val = read_index(val_index, train.classes)
    if val.classes != train.classes:
        raise DataError(f"{val.path} names other classes than {train.path}; make both from "
                        "one folder, as make_shards.py does.")
    return (train, ShardSet(train, transforms["train"], seed=seed, skip_log=skip_log,
                            cache_dir=cache_dir),
            ShardSet(val, transforms["val"], seed=seed, skip_log=skip_log, cache_dir=cache_dir))
