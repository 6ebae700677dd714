"""Run the benchmark's stages in order, print one table, write benchmark.json and benchmark.png.

    python -m benchmarks                     # CPU: ResNet34 at 64 px, 1 and 2 processes
    python -m benchmarks --device cuda       # every visible GPU: NCCL, AMP, channels-last
    python -m benchmarks --device cuda --max-procs 4 --img-size 224 --batch-size 64
    python -m benchmarks --model resnet18 --img-size 32 --pipeline-images 16 --steps 3  # smoke
    python -m benchmarks --stages startup --model resnet18 --img-size 32 --repeats 3
        # time to the first step on 10k to 1.28M hard-linked files (minutes; --startup-files)
    python -m benchmarks --stages shards      # an image folder against its shards, local and
        # over HTTP (nginx where installed, else Python's http.server)

What each stage measures is in the package's docstring (``benchmarks/__init__.py``) and in its
own module.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from flags import HelpFormatter, path_flag
from model import MODELS
from multi_train_utils.distributed_utils import COMM_HOOKS
from multi_train_utils.guard import UserError
from run_log import write_json_atomic

from . import decode, fsdp, loop, pipeline, preemption, scaling, shards, startup, with_data
from .photos import default_image_dir
from .report import header_lines, host_info, load_average, versions, write_chart

log = logging.getLogger("benchmarks")

# Run in this order; a stage may read the parts of the report the stages before it wrote.
STAGES = {"pipeline": pipeline, "loop": loop, "scaling": scaling, "with_data": with_data,
          "preemption": preemption, "decode": decode, "fsdp": fsdp, "startup": startup,
          "shards": shards}
# Run by default; fsdp and startup take minutes (startup, a million hard links), shards needs
# wids and a server: when named.
DEFAULT_STAGES = ["pipeline", "loop", "scaling", "with_data", "preemption", "decode"]


def format_table(report: dict[str, Any]) -> str:
    """The human-readable summary printed at the end (also what goes into the docs)."""
    ran = report["config"].get("stages", DEFAULT_STAGES)
    sections = [header_lines(report), *(STAGES[name].table_lines(report) for name in ran)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with what "auto" and the defaults mean here decided once, for every
    stage and rank (each rank picks its own GPU). A flag that cannot work exits with one line."""
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda was asked for, but CUDA is not available here; "
                 "use --device cpu (or auto).")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    max_procs = args.max_procs or (torch.cuda.device_count() if use_cuda else 2)
    if use_cuda and max_procs > torch.cuda.device_count():
        sys.exit(f"error: --max-procs {max_procs} but only {torch.cuda.device_count()} GPU(s) "
                 "are visible; lower --max-procs.")
    for flag, value in (("batch-size", args.batch_size), ("steps", args.steps),
                        ("repeats", args.repeats), ("pipeline-images", args.pipeline_images),
                        ("threads", args.threads), ("max-procs", max_procs),
                        ("decode-workers", args.decode_workers),
                        ("warmup-steps", args.warmup_steps),
                        ("grad-accum-steps", args.grad_accum_steps),
                        ("img-size", args.img_size), ("pipeline-size", args.pipeline_size),
                        ("epoch-images", args.epoch_images), ("num-classes", args.num_classes),
                        ("shard-size", args.shard_size)):
        if value < 1:
            sys.exit(f"error: --{flag} must be at least 1, not {value}.")
    if "fsdp" in args.stages and use_cuda:
        sys.exit("error: --stages fsdp measures host memory: add --device cpu.")
    if min(args.startup_files) < 20:
        sys.exit("error: --startup-files must each be at least 20 (10 files a class, 2 classes).")
    if "with_data" in args.stages and not {"pipeline", "loop"} <= set(
            args.stages[:args.stages.index("with_data")]):
        sys.exit("error: --stages with_data compares with the pipeline and loop stages: put "
                 "them before it.")
    if "shards" in args.stages and args.shard_images < 4 * args.batch_size:
        sys.exit("error: --shard-images must be at least 4 x --batch-size: each of the 2 ranks "
                 "reads at least a full batch of the training 80%.")
    if args.start_method == "forkserver":  # the ranks' imports, once, in the server
        preload = ["benchmarks.scaling", "benchmarks.preemption"]
        if "shards" in args.stages:  # its ranks import torchvision: only when it runs
            preload.append("benchmarks.shards")
        multiprocessing.set_forkserver_preload(preload)
    if args.workers is not None and args.workers < 0:
        sys.exit(f"error: --workers must be 0 or more, not {args.workers}.")
    try:
        image_dir = Path(args.image_dir) if args.image_dir else default_image_dir()
    except UserError as exc:  # no home folder
        sys.exit(f"error: {exc}")
    return argparse.Namespace(**{**vars(args), "device": "cuda" if use_cuda else "cpu",
                                 "max_procs": max_procs, "image_dir": str(image_dir)})


def main(args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    command = shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]])
    log.info("command: %s", command)
    args = resolve_args(args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the training script: fixed input size

    report: dict[str, Any] = {"command": command, "argv": sys.argv,
                              "config": {**vars(args),
                                         "procs": scaling.process_counts(args.max_procs)},
                              "versions": versions(), "host": host_info(device)}
    for number, name in enumerate(args.stages, start=1):
        log.info("stage %d/%d: %s", number, len(args.stages), STAGES[name].__name__)
        report.update(STAGES[name].run(args, device, report))
    report["host"]["load_avg_end"] = load_average()

    report["table"] = format_table(report)  # as printed below
    write_json_atomic(out / "benchmark.json", report)
    written = [out / "benchmark.json"]
    if {"pipeline", "loop", "with_data", "scaling"} <= set(args.stages):  # the chart's panels
        written.append(write_chart(report, out / "benchmark.png"))
    if "startup" in args.stages:
        written.append(startup.write_chart(report, out / "startup.png"))
    print("\n" + report["table"], flush=True)
    print(f"\nwrote {' and '.join(map(str, written))}", flush=True)
    return report


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark the input pipeline, training loop, DDP scaling and memory.",
        formatter_class=HelpFormatter, add_help=add_help)
    parser.add_argument("--stages", nargs="+", default=DEFAULT_STAGES, choices=list(STAGES),
                        help="which stages to run, in this order (with_data reads pipeline's "
                             "and loop's figures; fsdp, startup and shards run only when named)")
    parser.add_argument("--fsdp-models", nargs="+", default=["resnet50", "resnext101_32x8d"],
                        choices=sorted(MODELS), help="the fsdp stage's models (2 CPU ranks)")
    parser.add_argument("--model", default="resnet34", choices=sorted(MODELS), help="architecture")
    parser.add_argument("--img-size", type=int, default=64,
                        help="training crop for the loop and scaling runs")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=16,
                        help="per process (and the batch a pipeline worker collates)")
    parser.add_argument("--num-classes", type=int, default=5, help="classifier outputs")
    parser.add_argument("--lr", type=float, default=0.001, help="x world size, as in training")
    parser.add_argument("--pipeline-images", type=int, default=200,
                        help="JPEGs decoded per pipeline pass")
    parser.add_argument("--pipeline-size", type=int, default=224,
                        help="crop of the pipeline comparison (the template's 224)")
    parser.add_argument("--image-dir", type=path_flag, help="where the test JPEGs are cached "
                        "(default: ddp-template/bench_photos_v1 in $XDG_CACHE_HOME or ~/.cache)")
    parser.add_argument("--gpu-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="also time decode_jpeg(device='cuda') (default: on with CUDA)")
    parser.add_argument("--workers", type=int, help="DataLoader workers of the with_data stage "
                        "(default: the training script's)")
    parser.add_argument("--decode-workers", type=int, default=4,
                        help="at most this many loader workers for the decode stage's device runs")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps first (at least 1: loader workers start, cuDNN tunes)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed repeats of each measurement (medians and best are reported)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process on CPU (loop and every rank)")
    parser.add_argument("--max-procs", type=int,
                        help="largest process count for scaling (default: the GPUs, or 2 on CPU)")
    parser.add_argument("--epoch-images", type=int, default=scaling.FLOWER_TRAIN_IMAGES,
                        help="images per epoch in the time-per-epoch chart "
                             "(default: %(default)s, flower_photos' training split)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: CUDA if available, else the CPU")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="mixed precision (default: on for CUDA, off for CPU)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="NHWC memory format (default: on for CUDA)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model (warm-up steps absorb the compile)")
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=True,
                        help="SyncBatchNorm when distributed, as the training default")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    parser.add_argument("--comm-hook", default="none", choices=COMM_HOOKS,
                        help="DDP gradient compression, as the training flag")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="batches per gradient all-reduce in the scaling runs")
    parser.add_argument("--explain-scaling", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the largest process count without communication, without "
                             "SyncBN and with the other comm hooks; time the all-reduce alone")
    parser.add_argument("--startup-files", type=int, nargs="+", default=list(startup.FILES),
                        help="folder sizes the startup stage times (hard links, made and deleted)")
    parser.add_argument("--shard-images", type=int, default=1000,
                        help="demo images (64 px, 5 classes) the shards stage writes as a folder "
                             "and as shards")
    parser.add_argument("--shard-size", type=int, default=50,
                        help="images per shard in the shards stage (make_shards --shard-size)")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver"],
                        help="how ranks start (forkserver: torch imported once, for smoke runs)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the generated photos and the synthetic batches")
    parser.add_argument("--output-dir", default="benchmark_results", type=path_flag,
                        help="benchmark.json and benchmark.png go here")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
