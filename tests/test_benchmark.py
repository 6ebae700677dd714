"""``python -m benchmarks`` end to end at tiny sizes: every stage's figures land in the JSON,
the table has every section, the chart is a PNG.

Timing targets (pipeline >= 1.6x, loop >= 0.95) are not asserted: CI machines are shared and
noisy. They are proven by a real run with the default sizes (see README).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from PIL import Image

from model import get_model
from my_dataset import default_workers

TINY_BENCH = ["--device", "cpu", "--model", "resnet18", "--img-size", "32", "--batch-size", "2",
              "--pipeline-images", "4", "--pipeline-size", "64", "--steps", "2",
              "--warmup-steps", "1", "--repeats", "2", "--max-procs", "2", "--epoch-images", "100",
              "--start-method", "forkserver"]  # the ranks' torch import once, not 11 times


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# ``python -m benchmarks ARGS`` run by ``plain`` (conftest): in a process forked from one that has
# imported torch already, so the command costs no import of its own.
AS_BENCHMARKS = ("import runpy, sys\n"
                 "runpy.run_module('benchmarks', run_name='__main__', alter_sys=True)\n"
                 "sys.exit(0)\n")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, plain):
    """One tiny benchmark run shared by the checks below: (process, output dir, tmp dir)."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results"
    proc = plain([*TINY_BENCH, "--output-dir", str(out), "--image-dir", str(tmp / "photos")],
                 patch=AS_BENCHMARKS, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out, tmp


@pytest.fixture(scope="module")
def report(bench):
    return json.loads((bench[1] / "benchmark.json").read_text())


def test_pipeline_figures(report):
    pipeline = report["pipeline"]
    for key in ("template_img_per_s", "ours_img_per_s", "ratio"):
        assert _positive(pipeline[key]), (key, pipeline[key])
    template_runs, ours_runs = pipeline["template_runs_img_per_s"], pipeline["ours_runs_img_per_s"]
    assert len(template_runs) == len(ours_runs) == 2
    assert all(map(_positive, template_runs + ours_runs))
    # Each repeat runs both back to back: the ratio is the median of the per-repeat ratios.
    assert pipeline["ratio"] == pytest.approx(
        statistics.median(o / t for o, t in zip(ours_runs, template_runs)))
    assert pipeline["ours_img_per_s"] == pytest.approx(statistics.median(ours_runs))
    assert pipeline["ours_best_img_per_s"] == max(ours_runs)
    assert (pipeline["images"], pipeline["image_width"], pipeline["image_height"]) == (4, 500, 375)
    assert pipeline["crop"] == 64 and pipeline["target_ratio"] == 1.6
    # Photo-like content: a 500x375 quality-90 photo is tens of KB, a flat fake a few KB.
    assert pipeline["mean_file_kb"] > 15


def test_loop_figures(report):
    loop = report["loop"]
    for key in ("bare_img_per_s", "ours_img_per_s", "efficiency"):
        assert _positive(loop[key]), (key, loop[key])
    assert loop["efficiency"] == pytest.approx(statistics.median(
        o / b for o, b in zip(loop["ours_runs_img_per_s"], loop["bare_runs_img_per_s"])))
    assert len(loop["bare_runs_img_per_s"]) == 2
    assert (loop["model"], loop["img_size"], loop["batch_size"], loop["steps"]) == \
        ("resnet18", 32, 2, 2)
    assert loop["target_efficiency"] == 0.95
    # The loop's own cost, measured around a near-free model, and the efficiency it implies.
    over = loop["overhead"]
    assert over["steps"] >= 200 and len(over["per_step_ms_runs"]) == 2
    assert math.isfinite(over["per_step_ms"]) and _positive(over["bare_step_ms"])
    assert over["implied_efficiency"] == pytest.approx(
        over["bare_step_ms"] / (over["bare_step_ms"] + over["per_step_ms"]))
    assert over["bare_step_ms"] == pytest.approx(2 / loop["bare_img_per_s"] * 1e3)


def test_scaling_figures(report):
    scaling = report["scaling"]
    results = scaling["results"]
    assert sorted(results, key=int) == ["1", "2"]
    for n, entry in results.items():
        assert entry["processes"] == int(n)
        for key in ("img_per_s", "epoch_seconds", "efficiency", "measured_seconds"):
            assert _positive(entry[key]), (n, key, entry[key])
        # Epoch time is the chart's fixed-size epoch at the measured throughput.
        assert entry["epoch_seconds"] == pytest.approx(100 / entry["img_per_s"])
        assert entry["img_per_s"] == pytest.approx(int(n) * 2 * 2 / entry["measured_seconds"])
        assert len(entry["peak_memory_mib"]) == int(n)  # one figure per rank
        assert all(_positive(m) and m > 50 for m in entry["peak_memory_mib"])  # MiB, not KiB/bytes
        # Each rank's own peak: at least what it held after imports, before model and data.
        assert all(peak >= start for peak, start in zip(entry["peak_memory_mib"],
                                                        entry["rss_at_start_mib"]))
    assert results["1"]["efficiency"] == pytest.approx(1.0)
    assert results["2"]["efficiency"] == pytest.approx(
        results["2"]["img_per_s"] / (2 * results["1"]["img_per_s"]))
    assert results["1"]["backend"].startswith("none") and results["2"]["backend"] == "gloo"
    assert scaling["memory_kind"] == "peak RSS" and scaling["comm_hook"] == "none"
    assert scaling["sync_bn"] and scaling["grad_accum_steps"] == 1
    assert results["2"]["sync_bn"] and not results["1"]["sync_bn"]
    # The largest count again: no communication (the ceiling), DDP without SyncBN, and bf16
    # compression, so the table can say what the gradient all-reduce and SyncBN each cost.
    explain = scaling["explain"]
    assert (explain["no_comm"]["variant"], explain["no_comm"]["comm_hook"]) == ("no_comm", None)
    assert (explain["no_sync_bn"]["variant"], explain["no_sync_bn"]["comm_hook"],
            explain["no_sync_bn"]["sync_bn"]) == ("no_sync_bn", "none", False)
    assert explain["comm_hook_bf16"]["comm_hook"] == "bf16" and explain["comm_hook_bf16"]["sync_bn"]
    for entry in (explain["no_comm"], explain["no_sync_bn"], explain["comm_hook_bf16"]):
        assert entry["processes"] == 2 and entry["backend"] == "gloo"
        assert entry["efficiency"] == pytest.approx(
            entry["img_per_s"] / (2 * results["1"]["img_per_s"]))
    summary = explain["summary"]
    assert summary["ceiling_efficiency"] == explain["no_comm"]["efficiency"]
    assert summary["communication_loss"] == pytest.approx(
        1 - results["2"]["efficiency"] / explain["no_comm"]["efficiency"])
    # What is lost splits into the gradient all-reduce (DDP without SyncBN) and SyncBN.
    assert summary["no_sync_bn_efficiency"] == explain["no_sync_bn"]["efficiency"]
    assert summary["gradient_loss"] == pytest.approx(
        1 - explain["no_sync_bn"]["efficiency"] / explain["no_comm"]["efficiency"])
    assert summary["gradient_loss"] + summary["sync_bn_loss"] == pytest.approx(
        summary["communication_loss"])
    assert summary["step_ms_1_process"] == pytest.approx(2 / results["1"]["img_per_s"] * 1e3)
    all_reduce = summary["all_reduce_ms"]
    assert all_reduce == results["2"]["all_reduce_ms"]
    resnet18 = get_model("resnet18", num_classes=5)
    assert all_reduce["numel"] == sum(p.numel() for p in resnet18.parameters())
    assert _positive(all_reduce["fp32"]) and _positive(all_reduce["bf16"])
    assert report["peak_memory"]["per_rank"] == {n: e["peak_memory_mib"]
                                                 for n, e in results.items()}


def test_with_data_figures(report):
    loop = report["loop"]
    # Data included: the training script's loader (its worker count) feeding train_one_epoch,
    # beside the loader alone and stage 2's compute alone; the slower of those is the limit.
    data = report["with_data"]
    for key in ("loader_img_per_s", "with_data_img_per_s", "compute_img_per_s", "data_efficiency"):
        assert _positive(data[key]), (key, data[key])
    assert data["workers"] == default_workers(2, torch.device("cpu"))  # the script's, batch 2
    # Steady state: --steps batches after --warmup-steps, each rounded up to whole rounds of
    # the workers (they deliver one batch each, together).
    burst = max(1, data["workers"])
    assert data["timed_images"] == 2 * burst * math.ceil(2 / burst)
    assert data["untimed_batches_first"] == burst * math.ceil(1 / burst)
    assert (data["files"], data["img_size"]) == (4, 32)
    assert len(data["loader_runs_img_per_s"]) == len(data["with_data_runs_img_per_s"]) == 2
    assert data["with_data_img_per_s"] == pytest.approx(
        statistics.median(data["with_data_runs_img_per_s"]))
    assert data["compute_img_per_s"] == loop["ours_img_per_s"]
    assert data["data_efficiency"] == pytest.approx(
        data["with_data_img_per_s"] / loop["ours_img_per_s"])
    from benchmarks.with_data import data_limit
    assert data["limited_by"] == data_limit(data["loader_img_per_s"], data["with_data_img_per_s"],
                                            data["compute_img_per_s"], data["workers"])
    assert [data_limit(50, 49, 100, 2), data_limit(500, 60, 100, 2),
            data_limit(500, 95, 100, 2), data_limit(500, 60, 100, 0)] == [
        "input pipeline", "CPUs shared by the loader workers and training", "compute",
        "loading in the training process (--workers 0)"]
    assert data["target_img_per_s"] is None  # the 5,000 img/s target is an H200's


def test_decode_figures(report):
    """Stage 6: each decoder per worker and batched (None: not installed), decode and augment,
    training under --decode workers and device beside the compute alone, in one run."""
    import my_dataset
    d = report["decode"]
    installed = {"torchvision.io": my_dataset.decode_jpeg is not None, "PIL": True,
                 "torchcodec": my_dataset.codec_decode_jpeg is not None}
    assert d["per_worker_img_per_s"].keys() == installed.keys()
    assert d["main_process_img_per_s"].keys() == installed.keys()  # on the CPU, PIL too
    for figures in (d["per_worker_img_per_s"], d["main_process_img_per_s"]):
        assert all(_positive(v) if installed[k] else v is None for k, v in figures.items())
    workers = default_workers(2, torch.device("cpu"))
    assert d["workers"] == {"workers": workers, "device": min(workers, 4)}
    assert _positive(d["decode_augment_img_per_s"]) and _positive(d["compute_img_per_s"])
    for decode in ("workers", "device"):
        runs = d["runs_img_per_s"][decode]
        assert len(runs) == 2 and all(map(_positive, runs))
        assert d["with_data_img_per_s"][decode] == pytest.approx(statistics.median(runs))
        assert d["efficiency"][decode] == pytest.approx(
            d["with_data_img_per_s"][decode] / d["compute_img_per_s"])
    assert d["target_efficiency"] is None and d["target_workers"] == 4  # a GPU's target


def test_run_is_described(report):
    assert report["config"]["model"] == "resnet18" and report["config"]["procs"] == [1, 2]
    assert report["versions"]["torch"] and report["versions"]["torchvision"]
    assert report["host"]["cpu_count"] >= 1 and len(report["host"]["load_avg_start"]) == 3
    assert report["command"].startswith("python -m benchmarks")
    assert "--max-procs 2" in report["command"]


def _git_describe() -> str:
    return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_every_number_carries_its_commit(bench, report):
    # The commit the run measured, "-dirty" when tracked files had uncommitted changes.
    assert report["versions"]["git_describe"] == _git_describe()
    assert f"commit: {_git_describe()}" in bench[0].stdout


def test_no_git_checkout_records_no_commit(tmp_path, monkeypatch):
    from benchmarks import report

    monkeypatch.setattr(report, "ROOT", tmp_path)  # a copied folder: not a git repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert report.git_describe() is None


def test_chart_is_a_png_and_table_is_printed(bench):
    proc, out, tmp = bench
    data = (out / "benchmark.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width > 600 and height > 200
    with Image.open(out / "benchmark.png") as img:
        img.verify()  # raises on a truncated or corrupt file

    # The generated photos are cached where --image-dir says, not in the repo or the home cache.
    assert len(list((tmp / "photos").glob("*.jpg"))) == 4
    for heading in ("Input pipeline", "Training loop", "Scaling", "speed-up", "efficiency",
                    "no communication: no DDP, no SyncBN (ceiling)", "--comm-hook bf16",
                    "DDP without SyncBN (--no-sync-bn)", "of which the gradient all-reduce",
                    "all-reduce of the", "Training with data", "train_one_epoch fed by the loader",
                    "limited by ", "6. Decoding", "training, --decode device"):
        assert heading in proc.stdout, heading
    assert "command: python -m benchmarks" in proc.stdout
    assert "[train epoch" not in proc.stdout + proc.stderr  # the loops' progress is not printed
    report = json.loads((out / "benchmark.json").read_text())
    assert f"{report['pipeline']['ratio']:.2f}x" in proc.stdout
    # The table is the header and each stage's section, in order, formatted from the JSON alone.
    from benchmarks.__main__ import DEFAULT_STAGES, format_table
    table = format_table(report)
    assert table in proc.stdout and len(table.split("\n\n")) == 1 + len(DEFAULT_STAGES)
    assert report["table"] == table  # the JSON carries the table as printed


def test_preemption_figures(report, bench):
    """The stop poll's cost (with / without it, paired) and one mid-epoch save's time and size."""
    p = report["preemption"]
    assert p["processes"] == 2 and p["backend"] == "gloo"
    assert len(p["ratio_with_to_without"]) == 2 and _positive(p["median_ratio"])
    assert p["median_ratio"] == pytest.approx(statistics.median(p["ratio_with_to_without"]))
    assert _positive(p["save_seconds"]) and _positive(p["step_ms"])
    assert 40 < p["checkpoint_mb"] < 200  # resnet18's weights and momentum, 2 x 45 MB
    assert "with / without the per-step stop poll" in bench[0].stdout
    # The heartbeat: paired as the poll, and its parts timed alone (the loop's calls a step).
    assert len(p["heartbeat_ratio_to_without"]) == 2 and _positive(p["heartbeat_median_ratio"])
    assert _positive(p["heartbeat_us_per_step"]) and _positive(p["heartbeat_write_us_per_s"])
    assert p["heartbeat_share_of_step"] < 0.01, p["heartbeat_share_of_step"]
    assert "with / without the heartbeat" in bench[0].stdout


def test_startup_stage_links_a_tree_and_reports_each_count(tmp_path):
    """The startup stage's pieces without its minutes of runs: the hard-linked tree, the table
    and the chart from a report shaped as ``startup.run`` returns it."""
    from benchmarks import startup

    source = tmp_path / "one.jpg"
    Image.new("RGB", (8, 8)).save(source)
    startup.make_tree(tmp_path / "data", 0, 25, 5, [source])
    startup.make_tree(tmp_path / "data", 25, 40, 5, [source])  # grown, as from 10k to 100k
    assert len(list((tmp_path / "data").glob("c000[0-4]/*.JPEG"))) == 40
    assert (tmp_path / "data" / "c0003" / "00000038.JPEG").stat().st_nlink == 41
    runs = {"bare": [2.0, 3.0], "fresh": [3.0, 4.5], "continued": [2.2, 3.0]}
    row = {"bare_s": 2.5, "fresh_s": 3.75, "continued_s": 2.6, "runs_s": runs,
           "fresh_ratios": [1.5, 1.5], "fresh_ratio": 1.5, "continued_ratios": [1.1, 1.0],
           "continued_ratio": 1.05,
           "listing_s": {"scandir": 0.1, "image_folder": 0.25, "ours": 0.125}}
    report = {"config": {"repeats": 2}, "versions": {"git_describe": "abc1234"},
              "startup": {"files": {"1000": row, "300000": row}, "classes": 100, "workers": 2,
                          "model": "resnet18", "img_size": 32, "batch_size": 16,
                          "device": "cpu", "targets": startup.TARGETS,
                          "broadcast": {"seconds": [0.5, 0.7], "rebase_seconds": [0.2, 0.3],
                                        "paths": 300000, "pickled_mb": 20.0},
                          "verify": {"files": 1000, "seconds": 0.5}}}
    table = "\n".join(startup.table_lines(report))
    assert "      300000          2.50      3.75        2.60       1.50x          1.05x" in table
    assert re.search(r"\n +1000 +0.100 +0.250 +0.125\n", table)
    assert re.search(r"header check of 1000 files \(--verify-images\) +0.5 s   2000 files/s",
                     table)
    assert re.search(r"rank 0's list of 300000 files to rank 1 +0.60 s   gloo, pickled 20 MB",
                     table)
    png = startup.write_chart(report, tmp_path / "startup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000


TINY_SHARDS = ["--device", "cpu", "--stages", "shards", "--shard-images", "40", "--shard-size", "8",
               "--batch-size", "2", "--img-size", "32", "--repeats", "2",
               "--start-method", "forkserver"]


def test_shards_stage_reads_the_same_images_three_ways(tmp_path, plain):
    """The folder, its shards on disk and over HTTP (the tests' server: nginx where installed),
    each way's img/s in a fresh loader's two epochs and its ratio to the folder's. The stage
    itself fails unless the three read the same samples (their labels, summed per epoch)."""
    from benchmarks.shards import EPOCHS, WAYS
    from http_server import nginx_binary

    out = tmp_path / "out"
    proc = plain([*TINY_SHARDS, "--output-dir", str(out)], patch=AS_BENCHMARKS, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "benchmark.json").read_text())["shards"]
    assert s["server"] == ("nginx" if nginx_binary() else "http.server")
    assert 30 <= s["images"] <= 35  # 8 a class, one or two of them held out for validation
    assert s["shards"] == -(-s["images"] // 8) and s["processes"] == 2
    assert s["epoch_images"] == 2 * (-(-s["images"] // 2) // 2 * 2)  # 2 ranks, full batches
    for way in WAYS:
        for epoch in EPOCHS:
            runs = s["runs_img_per_s"][way][epoch]
            assert len(runs) == 2 and all(map(_positive, runs))
            assert s["img_per_s"][way][epoch] == pytest.approx(statistics.median(runs))
            if way != "folder":
                ratios = [x / f for x, f in zip(runs, s["runs_img_per_s"]["folder"][epoch])]
                assert s["paired_ratios"][way][epoch] == pytest.approx(ratios)
                assert s["ratio"][way][epoch] == pytest.approx(statistics.median(ratios))
    for heading in ("Shards: img/s reading the same", "local shards / folder",
                    f"shards over HTTP ({s['server']}), empty cache at start",
                    f"{s['ratio']['local']['next']:.3f}"):
        assert heading in proc.stdout, heading


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "--steps must be at least 1, not 0."),
    ("--workers", "-1", "--workers must be 0 or more, not -1."),
    ("--warmup-steps", "0", "--warmup-steps must be at least 1, not 0."),
    ("--grad-accum-steps", "0", "--grad-accum-steps must be at least 1, not 0."),
    ("--shard-size", "0", "--shard-size must be at least 1, not 0."),
])
def test_bad_size_is_one_clear_error(tmp_path, flag, value, message):
    from benchmarks.__main__ import get_args_parser, main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(get_args_parser().parse_args(
            ["--device", "cpu", flag, value, "--output-dir", str(out)]))
    assert exc.value.code == f"error: {message}"  # sys.exit(text): printed, exit status 1
    assert not out.exists()


def test_shards_stage_needs_a_full_batch_on_each_rank(tmp_path):
    from benchmarks.__main__ import get_args_parser, main

    with pytest.raises(SystemExit) as exc:
        main(get_args_parser().parse_args(["--device", "cpu", "--stages", "shards",
                                           "--shard-images", "30", "--batch-size", "8",
                                           "--output-dir", str(tmp_path / "out")]))
    assert exc.value.code.startswith("error: --shard-images must be at least 4 x --batch-size")
    assert not (tmp_path / "out").exists()


def test_bad_size_from_the_command_line_is_one_line_and_exit_1(tmp_path, plain):
    proc = plain(["--device", "cpu", "--steps", "0", "--output-dir", str(tmp_path / "out")],
                 patch=AS_BENCHMARKS, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "error: --steps must be at least 1, not 0."
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_steady_window_times_the_middle_batches_not_the_start_up():
    from benchmarks.with_data import SteadyWindow

    class SlowStart:  # like a loader: its first batch waits for a worker to decode a full batch
        def __len__(self) -> int:
            return 6

        def __iter__(self):
            for i in range(6):
                time.sleep(0.5 if i == 0 else 0.02)
                yield i

    window = SteadyWindow(SlowStart(), skip=2, steps=3, device=torch.device("cpu"))
    assert len(window) == 6 and list(window) == list(range(6))  # every batch passes through
    assert 3 * 0.02 <= window.seconds < 0.4  # batches 3, 4 and 5 arrive inside the window
    with pytest.raises(ValueError, match="the window ends at batch 6: the loader has 6 batches"):
        SteadyWindow(SlowStart(), skip=3, steps=3, device=torch.device("cpu"))


def test_photos_are_cached_and_photo_like(tmp_path):
    from benchmarks.photos import make_photos

    first = make_photos(tmp_path, 2)
    stamps = [Path(p).stat().st_mtime_ns for p in first]
    more = make_photos(tmp_path, 3)  # grows the cache, keeps what is there
    assert more[:2] == first and [Path(p).stat().st_mtime_ns for p in first] == stamps
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in more)
    contents = set()
    for path in more:
        with Image.open(path) as img:
            assert (img.format, img.size, img.mode) == ("JPEG", (500, 375), "RGB")
        contents.add(Path(path).read_bytes())
        assert Path(path).stat().st_size > 15_000  # noisy photo-like content, not flat colour
    assert len(contents) == 3  # every image differs


def test_help_shows_each_default_once(monkeypatch):
    from benchmarks.__main__ import get_args_parser
    from benchmarks.scaling import FLOWER_TRAIN_IMAGES

    # argparse wraps to the terminal: keep each help on one line.
    monkeypatch.setenv("COLUMNS", "400")
    parser = get_args_parser()
    text = parser.format_help()
    # One block per option: its "  --flag" line and the help lines under it.
    blocks = {block.split()[0].rstrip(","): block for block in re.split(r"\n(?=  -)", text)[1:]}

    assert "(default: None)" not in text  # None means "decided at run time"; the help says how
    assert len(blocks) == len(parser._actions)  # every option got its own block
    for flag, block in blocks.items():
        # ArgumentDefaultsHelpFormatter appends one unless the help already names the default.
        assert block.count("(default:") == (0 if flag == "-h" else 1), block
    assert (f"(default: {FLOWER_TRAIN_IMAGES}, flower_photos' training split)"
            in blocks["--epoch-images"])
    assert "(default: on for CUDA, off for CPU)" in blocks["--amp"]
    assert "(default: False)" in blocks["--compile"]
