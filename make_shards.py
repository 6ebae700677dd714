"""Write an image folder as WebDataset tar shards with wids indexes (docs/shards.md):

    python make_shards.py flower_photos shards
    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py \\
        --data-path shards/train.json --val-path shards/val.json

The split and its order are training's for the folder with the same --val-rate and --seed:
sample i of train.json is image i of that run's training list. Images are not re-encoded.
"""

import argparse
import logging
from pathlib import Path

from webdataset import TarWriter

from flags import HelpFormatter, number, path_flag, positive_int
from image_folder import imagenet_layout, scan_image_folder, split_train_val
from multi_train_utils.guard import guarded
from run_log import write_json_atomic

log = logging.getLogger(__name__)


def write_split(out: Path, name: str, classes: list[str], paths: list[str], labels: list[int],
                shard_size: int) -> None:
    """``out/<name>-NNNNNN.tar`` of ``shard_size`` samples each, then the index ``out/<name>.json``
    (last, so no index names a shard half written); none of them without an image."""
    shards = []
    for start in range(0, len(paths), shard_size):
        url = f"{name}-{len(shards):06d}.tar"
        with open(out / url, "wb") as stream, TarWriter(stream, encoder=False) as tar:
            for i in range(start, min(start + shard_size, len(paths))):
                ext = Path(paths[i]).suffix.lower()[1:]  # JPEG's rare names: wids knows "jpg"
                ext = {"jpe": "jpg", "jfif": "jpg"}.get(ext, ext)
                tar.write({"__key__": f"{i:08d}", ext: Path(paths[i]).read_bytes(),
                           "cls": str(labels[i]).encode("ascii")})
        shards.append({"url": url, "nsamples": min(shard_size, len(paths) - start),
                       "filesize": (out / url).stat().st_size})
    if not shards:
        log.info("%s: no image, so no %s.json", name, name)
        return
    write_json_atomic(out / f"{name}.json", {
        "__kind__": "wids-shard-index-v1", "wids_version": 1, "name": name, "classes": classes,
        "shardlist": shards})
    log.info("%s: %d images in %d shards, %d bytes: %s", name, len(paths), len(shards),
             sum(s["filesize"] for s in shards), out / f"{name}.json")


def main(args: argparse.Namespace) -> None:
    folder, val_folder = imagenet_layout(args.folder, None)  # D/train and D/val: as training
    scan = scan_image_folder(folder, verify=True)
    val_scan = val_folder and scan_image_folder(val_folder, min_classes=1, verify=True)
    train_paths, train_labels, val_paths, val_labels = split_train_val(
        scan, args.val_rate, args.seed, val_scan=val_scan)
    scan.skipped += val_scan.skipped if val_scan else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # What an earlier run left, indexes first so that none names a deleted shard: fewer images
    # make fewer shards, and a shard left over would be stale.
    old = [out / "train.json", out / "val.json", *out.glob("train-*.tar"), *out.glob("val-*.tar")]
    for path in old:
        path.unlink(missing_ok=True)
    scan.write_skipped(out)
    write_split(out, "train", scan.classes, train_paths, train_labels, args.shard_size)
    write_split(out, "val", scan.classes, val_paths, val_labels, args.shard_size)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Write an image folder as WebDataset shards.",
                                     add_help=add_help, formatter_class=HelpFormatter)
    parser.add_argument("folder", type=path_flag, metavar="FOLDER", help="a folder per class")
    parser.add_argument("out", type=path_flag, metavar="OUT", help="the shards' folder")
    parser.add_argument("--shard-size", type=positive_int, default=10_000,
                        help="images per shard (a loader worker keeps 200 shards open)")
    parser.add_argument("--val-rate", type=number(float, 0, 1), default=0.2,
                        help="held out per class, as training's --val-rate")
    parser.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                        help="the split's seed, as training's --seed")
    return parser


if __name__ == "__main__":
    guarded(main, get_args_parser().parse_args())
