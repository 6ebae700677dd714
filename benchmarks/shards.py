"""Stage: reading tar shards against reading the image folder they were made from
(``--stages shards``). The same training images, three ways, side by side, each read as the
training script reads its data (``ResumableSampler``, ``BatchSampler``, ``DataLoader`` with
``my_dataset.loader_kwargs`` and its worker count), on 2 CPU processes (gloo):

- folder: ``MyDataSet`` over the image files;
- local shards: ``shards.ShardSet`` over the shards ``make_shards.py`` wrote from that folder
  (the same split, in the same order);
- HTTP: the same shards from a server on this machine (``tests/http_server.py``: nginx where
  installed, else Python's http.server), into an empty ``cache_dir`` each repeat, so its first
  epoch includes downloading them.

A fresh loader each time, timed over two epochs: the first (its workers start; the shards are
opened, or downloaded) and the next (steady state; HTTP reads its cache). The order of the three
alternates in each repeat. The images are the demo flowers (``demo_data``: JPEGs of 64 px, a few
KB): decoding them is cheap, so what a reader costs per sample shows most. The shards are small
too (``--shard-size``, 50 by default): a shard's opening weighs more than on big ones.
Every file is in the page cache (just written): this measures the readers, not a disk or a
network. Each epoch's labels are summed on every rank, and must agree: the three read the same
samples.

The ranks are spawned: each imports this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils.data import BatchSampler, DataLoader, Dataset

from augment import get_transforms
from demo_data import DEMO_CLASSES, make_demo_data
from image_folder import scan_image_folder, split_train_val
from multi_train_utils.data import ResumableSampler
from multi_train_utils.distributed_utils import (DistInfo, cleanup, find_free_port,
                                                 init_distributed_mode)
from my_dataset import MyDataSet, default_workers, loader_kwargs

from .report import spread
from .scaling import barrier, rank_environment

log = logging.getLogger(__name__)

PROCS = 2
IMAGE_SIZE = 64  # px, the demo flowers'
VAL_RATE = 0.2  # make_shards' default: the folder run reads the same training split
SHARDS_TARGET = 0.9  # local shards / folder, images/s in steady state on 2 CPU cores
WAYS = ("folder", "local", "http")
EPOCHS = ("first", "next")


def _datasets(args: argparse.Namespace, tmp: str, base_url: str, paths: list[str],
              labels: list[int]) -> dict[str, Callable[[str], Dataset]]:
    """Each way's training set, made from a cache folder (only HTTP's uses it)."""
    from shards import ShardSet, read_index  # the shards stage alone needs wids

    transform = get_transforms(args.img_size)["train"]
    local = str(Path(tmp, "shards", "train.json"))
    return {"folder": lambda cache: MyDataSet(paths, labels, transform, seed=args.seed),
            "local": lambda cache: ShardSet(read_index(local), transform, seed=args.seed),
            "http": lambda cache: ShardSet(read_index(f"{base_url}/train.json"), transform,
                                           seed=args.seed, cache_dir=cache)}


def _two_epochs(dataset: Dataset, info: DistInfo, batch_size: int, workers: int,
                seed: int) -> dict[str, list]:
    """This rank's two epochs of a fresh training loader over ``dataset``: the seconds, images
    and sum of the labels of each."""
    sampler = ResumableSampler(dataset, info.world_size, info.rank, seed=seed)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size, drop_last=True),
                        **loader_kwargs(workers, torch.device("cpu")))
    epochs: dict[str, list] = {"seconds": [], "images": [], "label_sums": []}
    for epoch in range(len(EPOCHS)):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        barrier(info)
        start, images, label_sum = time.perf_counter(), 0, 0
        for _, labels in loader:
            images += len(labels)
            label_sum += int(labels.sum())
        epochs["seconds"].append(time.perf_counter() - start)
        epochs["images"].append(images)
        epochs["label_sums"].append(label_sum)
    del loader  # its persistent workers end here, not in the next measurement
    return epochs


def shards_worker(local_rank: int, args: argparse.Namespace, port: int, tmp: str,
                  base_url: str, paths: list[str], labels: list[int]) -> None:
    """One of the 2 ranks: a warm-up pass of each way, then ``--repeats`` alternating rounds;
    its seconds and label sums go to ``tmp/rank<N>.json``."""
    rank_environment(local_rank, PROCS, port)
    # Loader workers start as in a process torchrun started (the platform's default method),
    # not by the spawn this process inherited from mp.start_processes: seconds each time.
    multiprocessing.set_start_method(None, force=True)
    torch.set_num_threads(args.threads)
    info = init_distributed_mode(device="cpu", timeout_s=600)
    try:
        workers = (default_workers(args.batch_size, info.device) if args.workers is None
                   else args.workers)
        datasets = _datasets(args, tmp, base_url, paths, labels)
        runs: dict[str, list[dict[str, list]]] = {way: [] for way in WAYS}
        for repeat in range(-1, args.repeats):  # -1: the warm-up, not kept
            for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:
                cache = str(Path(tmp, f"http-cache{repeat}"))  # empty: downloads again
                epochs = _two_epochs(datasets[way](cache), info, args.batch_size, workers,
                                     args.seed)
                if repeat >= 0:
                    runs[way].append(epochs)
        barrier(info)
        with open(Path(tmp) / f"rank{info.rank}.json", "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "workers": workers}, f)
    finally:
        cleanup()
        # After an error, the workers of the loader it left: they ignore SIGTERM, which is all
        # multiprocessing sends its daemonic children as a spawned process exits (atexit is later).
        for child in multiprocessing.active_children():
            child.kill()


def _make_data(args: argparse.Namespace, tmp: str) -> tuple[list[str], list[int], int]:
    """The demo folder and its shards in ``tmp``: the training paths and labels, and the
    number of training shards."""
    import make_shards

    folder = make_demo_data(Path(tmp, "folder"), per_class=args.shard_images // len(DEMO_CLASSES),
                            size=IMAGE_SIZE)
    make_shards.main(make_shards.get_args_parser().parse_args(
        [str(folder), str(Path(tmp, "shards")), "--shard-size", str(args.shard_size),
         "--val-rate", str(VAL_RATE), "--seed", str(args.seed)]))
    paths, labels, _, _ = split_train_val(scan_image_folder(folder, verify=False), VAL_RATE,
                                          args.seed)
    return paths, labels, len(list(Path(tmp, "shards").glob("train-*.tar")))


def run(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """The stage: ``{"shards": figures}`` (CPU processes, whatever ``device``)."""
    from tests.http_server import serve  # the test suite's server: nginx, else http.server

    with tempfile.TemporaryDirectory(prefix="ddp-bench-shards-") as tmp:
        paths, labels, shard_count = _make_data(args, tmp)
        size_kb = sum(os.path.getsize(p) for p in paths) / len(paths) / 1024
        with serve(Path(tmp, "shards")) as (base_url, server):
            log.info("shards: %d training images, %d shards, the folder, local and over HTTP "
                     "(%s), %d processes", len(paths), shard_count, server, PROCS)
            mp.start_processes(shards_worker, nprocs=PROCS, join=True,
                               start_method=args.start_method,
                               args=(args, find_free_port(), tmp, base_url, paths, labels))
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(PROCS)]
    runs = [{way: [(r["images"], r["label_sums"]) for r in rank["runs"][way]] for way in WAYS}
            for rank in ranks]
    if any(rank[way] != rank["folder"] for rank in runs for way in WAYS):
        raise RuntimeError(f"the three ways read different samples (images and label sums per "
                           f"rank, repeat and epoch): {runs}")
    rates = {way: {epoch: [sum(rank["runs"][way][i]["images"][e] for rank in ranks)
                           / max(rank["runs"][way][i]["seconds"][e] for rank in ranks)
                           for i in range(args.repeats)]
                   for e, epoch in enumerate(EPOCHS)} for way in WAYS}
    ratios = {way: {epoch: [x / f for x, f in zip(rates[way][epoch], rates["folder"][epoch])]
                    for epoch in EPOCHS} for way in ("local", "http")}
    return {"shards": {
        "processes": PROCS, "workers": ranks[0]["workers"], "images": len(paths),
        "epoch_images": sum(rank["runs"]["folder"][0]["images"][0] for rank in ranks),
        "shards": shard_count, "shard_size": args.shard_size,
        "image_size": IMAGE_SIZE, "mean_file_kb": round(size_kb, 1), "crop": args.img_size,
        "batch_size": args.batch_size, "server": server, "runs_img_per_s": rates,
        "img_per_s": {way: {epoch: statistics.median(v) for epoch, v in r.items()}
                      for way, r in rates.items()},
        "paired_ratios": ratios,
        "ratio": {way: {epoch: statistics.median(v) for epoch, v in r.items()}
                  for way, r in ratios.items()},
        "target_ratio": SHARDS_TARGET}}


def table_lines(report: dict[str, Any]) -> list[str]:
    s, repeats = report["shards"], report["config"]["repeats"]

    def line(label: str, values: dict[str, float], fmt: str, note: str = "") -> str:
        return f"   {label:<52}" + "".join(f"{values[e]:>13{fmt}}" for e in EPOCHS) + note

    return [f"Shards: img/s reading the same {s['images']} images ({s['processes']} CPU "
            f"processes, gloo, {s['workers']} loader worker(s) each; JPEGs {s['image_size']} px, "
            f"~{s['mean_file_kb']:.1f} KB; {s['shards']} shards of {s['shard_size']}; batch "
            f"{s['batch_size']}, crop {s['crop']}; a fresh loader's two epochs; median of "
            f"{repeats})",
            f"   {'':<52}{'first epoch':>13}{'next epoch':>13}",
            line("image folder: MyDataSet", s["img_per_s"]["folder"], ".1f"),
            line("local shards: ShardSet", s["img_per_s"]["local"], ".1f"),
            line(f"shards over HTTP ({s['server']}), empty cache at start",
                 s["img_per_s"]["http"], ".1f"),
            line("local shards / folder", s["ratio"]["local"], ".3f",
                 f"   target >= {s['target_ratio']} next epoch; repeats "
                 f"{spread(s['paired_ratios']['local']['next'])}"),
            line("HTTP / folder", s["ratio"]["http"], ".3f",
                 "   the first epoch downloads the shards")]
