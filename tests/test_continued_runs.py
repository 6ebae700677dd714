"""The same command continues the same run, and only that run: what changed between a stop and
the rerun (a flag, a link, a restart) is applied and said once, or refused in one line.

Cases that run training reuse ``reference_run`` (conftest): 3 epochs on 2 processes, cloned
into a folder of their own, then continued in one process (``plain``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import (LAUNCH, ROOT, TINY_FLAGS, assert_user_error, clone_run, flags, load_ckpt,
                      ranks, read_metrics)
from multi_train_utils.guard import ConfigError
from train_flags import (NOT_COMPARED, check_args, flag_changes, get_args_parser,
                         run_flags)

CONTRACT = ROOT / "docs" / "resume-and-restarts.md"


def cosine(epoch: int, epochs: int, lrf: float = 0.1) -> float:
    return (1 + torch.cos(torch.tensor(epoch * torch.pi / epochs)).item()) / 2 * (1 - lrf) + lrf


# ---------------------------------------------------------------- flags: the table, every row
def contract_rows() -> list[tuple[list[str], str]]:
    """The rows of the docs' flag table: ([--flag, ...], "applied" | "refused")."""
    text = CONTRACT.read_text(encoding="utf-8")
    table = text[text.index("| flags on the rerun |"):].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((re.findall(r"`(--[\w-]+)", cells[0]), re.match(r"\w+", cells[1])[0]))
    return rows


def other_value(action: argparse.Action, value):
    """A value the flag could have had in the run, other than ``value``."""
    if isinstance(value, bool) or action.nargs == "?":
        return not value
    if action.choices:
        return next(c for c in action.choices if c != value)
    if value is None:
        return 7 if action.type and action.type.__name__ == "int" else "elsewhere"
    return value * 2 + 1 if isinstance(value, (int, float)) else f"{value}-other"


def test_the_docs_table_names_every_flag_once_and_says_what_the_code_does():
    parser, rows = get_args_parser(), contract_rows()
    named = [flag for row_flags, _ in rows for flag in row_flags]
    assert len(named) == len(set(named)), named
    defaults = vars(parser.parse_args(["--model", "resnet18", "--img-size", "32"]))
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    compared = {a.dest for a in parser._actions
                if a.dest != "help" and a.dest not in NOT_COMPARED}
    assert compared == {by_flag[f].dest for f in named}, "a flag missing from the table"
    for row_flags, behaviour in rows:
        assert behaviour in ("applied", "refused"), behaviour
        for flag in row_flags:
            action = by_flag[flag]
            saved = {**defaults, action.dest: other_value(action, defaults[action.dest])}
            refused, applied = flag_changes(saved, defaults)
            said = {"refused": refused, "applied": applied}
            assert len(said[behaviour]) == 1 and len(refused) + len(applied) == 1, (
                flag, behaviour, said)


def test_val_path_given_to_one_run_only_is_refused_another_folder_applied():
    flags = {"val_path": "/data/val2", "eval_only": False}
    assert flag_changes({"val_path": "/data/val"}, flags) == (
        [], ["--val-path /data/val2 (the run had /data/val)"])
    assert flag_changes({"val_path": None}, flags)[0] == [
        "--val-path /data/val2 (the run had no --val-path)"]


def test_changed_lr_momentum_and_batch_size_apply_from_the_resumed_epoch(reference_run, tiny_data,
                                                                        tmp_path, plain):
    """--lr 0.05 on a run made with 0.001 trains at 0.05 from epoch 3 (one process: no scaling),
    with the new momentum; the momentum buffers are the run's. Said once, in one line."""
    out = clone_run(reference_run.out, tmp_path / "run")
    res = plain(flags(tiny_data, out, "--epochs", "4", "--lr", "0.05", "--momentum", "0.5",
                      "--batch-size", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(out)
    assert metrics[:3] == read_metrics(reference_run.out)
    assert metrics[3]["lr"] == pytest.approx(0.05 * cosine(3, 4), rel=1e-6)
    group = load_ckpt(out / "checkpoint.pth")["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["initial_lr"]) == (0.5, pytest.approx(0.05))
    said = [line for line in res.stderr.splitlines() if "applied from epoch 3" in line]
    assert len(said) == 1, res.stderr[-3000:]
    for part in ("--lr 0.05 (the run had 0.001)", "--momentum 0.5 (the run had 0.9)",
                 "--batch-size 2 (the run had 4)", "2 images per step (the run had 8)"):
        assert part in said[0], said[0]


def test_every_refused_flag_is_listed_in_one_line_with_both_ways_on(reference_run, tiny_data,
                                                                    tmp_path, plain):
    out = clone_run(reference_run.out, tmp_path / "run")
    before = (out / "checkpoint.pth").read_bytes()
    res = plain([*flags(tiny_data, out, "--epochs", "4"), "--seed", "3", "--val-rate", "0.3",
                 "--model", "resnet34"])
    line = assert_user_error(res, "--seed 3 (the run had 0)", "--val-rate 0.3 (the run had 0.2)",
                             "--model resnet34 (the run had resnet18)", "--resume none",
                             "--output-dir")
    assert "lr" not in line
    assert (out / "checkpoint.pth").read_bytes() == before


# ---------------------------------------------------------------- restarts and links
def test_a_torchrun_restart_continues_its_own_checkpoint_not_resume_path(reference_run,
                                                                         tiny_data, tmp_path,
                                                                         plain):
    """The first attempt started from --resume PATH and saved epochs of its own; the restarted
    group continues those, moving nothing aside."""
    start = clone_run(reference_run.out, tmp_path / "start")
    out = clone_run(reference_run.out, tmp_path / "run")
    res = plain(flags(tiny_data, out, "--epochs", "4", "--resume", str(start / "checkpoint.pth")),
                TORCHELASTIC_RESTART_COUNT="1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1, 2, 3]
    assert not (out / "previous-runs").exists()


def test_resume_through_a_link_to_the_runs_own_folder_continues_it(reference_run, tiny_data,
                                                                   tmp_path, plain):
    out = clone_run(reference_run.out, tmp_path / "runs" / "a")
    (tmp_path / "runs" / "latest").symlink_to("a")
    res = plain(flags(tiny_data, out, "--epochs", "4", "--resume",
                      str(tmp_path / "runs" / "latest" / "checkpoint.pth")))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1, 2, 3]
    assert not (out / "previous-runs").exists()


def test_a_link_in_the_runs_path_still_finds_the_files_moved_aside(tmp_path):
    """``runs/latest -> runs/b``: a --resume or --weights file of the earlier run, named through
    the other spelling of the folder, or through a link to the file (``best.pth ->
    runs/b/model_best.pth``), is read from where it was moved."""
    from multi_train_utils.run_folder import move_earlier_run

    for linked in ("output-dir", "files", "a link to the file"):  # the spelling through a link
        runs = tmp_path / linked
        (runs / "b" / "weights").mkdir(parents=True)
        for name in ("checkpoint.pth", "model_best.pth", "weights/model-0.pth"):
            (runs / "b" / name).write_text(name)
        (runs / "latest").symlink_to("b")
        (runs / "best.pth").symlink_to("b/model_best.pth")
        out, named = ((runs / "latest", runs / "b") if linked == "output-dir"
                      else (runs / "b", runs / "latest"))
        best = runs / "best.pth" if linked == "a link to the file" else named / "model_best.pth"
        resume, weights = move_earlier_run(out, str(best), str(named / "weights" / "model-0.pth"))
        (stamp,) = (runs / "b" / "previous-runs").iterdir()
        assert Path(resume).read_text() == "model_best.pth", linked
        assert Path(weights).read_text() == "weights/model-0.pth", linked
        assert Path(resume).samefile(stamp / "model_best.pth")


def test_resume_from_the_run_named_through_a_link_to_the_output_dir(reference_run, tiny_data,
                                                                    tmp_path, plain):
    """``--output-dir runs/latest --resume runs/b/model_best.pth``: the earlier run moves aside
    and the run goes on from its best epoch (here: nothing left to train)."""
    runs = tmp_path / "runs"
    clone_run(reference_run.out, runs / "b", full=True)
    (runs / "latest").symlink_to("b")
    best = load_ckpt(reference_run.out / "model_best.pth")["epoch"]
    res = plain(flags(tiny_data, runs / "latest", "--epochs", str(best + 1),
                      "--resume", str(runs / "b" / "model_best.pth")))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "leaves nothing to train" in res.stderr
    (stamp,) = (runs / "b" / "previous-runs").iterdir()
    assert (stamp / "model_best.pth").is_file()
    assert read_metrics(runs / "b") == read_metrics(reference_run.out)[:best + 1]


def test_a_flag_that_changes_nothing_is_applied_not_refused(reference_run, tiny_data, tmp_path,
                                                            plain):
    """--ra-reps without --ra-sampler in either run, an embedding decay for a model without
    embeddings (resnet18): the continued run trains on."""
    out = clone_run(reference_run.out, tmp_path / "run")
    res = plain(flags(tiny_data, out, "--epochs", "4", "--ra-reps", "4",
                      "--transformer-embedding-decay", "0"))
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(line for line in res.stderr.splitlines() if "applied from epoch 3" in line)
    for part in ("--ra-reps 4 (the run had 3)", "--transformer-embedding-decay 0.0 (the run "
                 "had no --transformer-embedding-decay)"):
        assert part in line, line
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1, 2, 3]


# ---------------------------------------------------------------- no validation set
def test_fsdp_without_validation_images_ends_well_and_exports_the_last_weights(tiny_data,
                                                                               tmp_path, plain):
    out = tmp_path / "run"
    res = ranks(plain, 2, LAUNCH, *flags(tiny_data, out, "--epochs", "1", "--val-rate", "0",
                                         "--strategy", "fsdp"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "no validation images, so no best model" in res.stderr
    assert not (out / "model_best.pth").exists()
    weights = torch.load(out / "weights" / "model-0.pth", weights_only=True)
    pytest.importorskip("torchvision").models.resnet18(num_classes=5).load_state_dict(weights)


# ---------------------------------------------------------------- --eval-only from the file
def without_model_flags(argv: list[str]) -> list[str]:
    """``argv`` less TINY_FLAGS' --model and --img-size (the checkpoint has them)."""
    drop = {i + k for i, a in enumerate(argv) if a in ("--model", "--img-size") for k in (0, 1)}
    return [a for i, a in enumerate(argv) if i not in drop]


def test_eval_only_takes_model_and_size_from_the_checkpoint_and_refuses_others(
        reference_run, tiny_data, tmp_path, plain):
    assert {"--model", "--img-size"} <= set(TINY_FLAGS)
    ckpt = str(reference_run.out / "checkpoint.pth")
    base = without_model_flags(flags(tiny_data, tmp_path / "eval", "--eval-only",
                                     "--resume", ckpt))
    res = plain(base)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "top-1 accuracy" in res.stderr
    res = plain([*base, "--img-size", "64"])
    assert_user_error(res, "--img-size 64 (it has 32)", ckpt)
    # A separate test folder: --val-path alone, all of it scored, no --data-path.
    argv = [a for a in base if a != str(tiny_data)]
    argv.remove("--data-path")
    res = plain([*argv, "--val-path", str(tiny_data)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "val images: 60" in res.stderr, res.stderr[-2000:]


# ---------------------------------------------------------------- the model, at the run's sizes
def test_a_continued_run_checks_the_runs_model_at_its_size_and_batch(reference_run, tiny_data,
                                                                     tmp_path, plain):
    """resnet18 at 32 px from its best epoch (``--resume <out>/model_best.pth``: a new run in
    the folder, which moves the earlier one aside), in one process with --batch-size 1: its
    layer4 BatchNorm would see one value per channel. One line, before any file moves."""
    out = clone_run(reference_run.out, tmp_path / "run")
    shutil.copy2(reference_run.out / "model_best.pth", out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = plain(without_model_flags(flags(tiny_data, out, "--epochs", "4", "--batch-size", "1",
                                          "--resume", str(out / "model_best.pth"))))
    assert_user_error(res, "--model resnet18 cannot train on --batch-size 1 at --img-size 32: "
                      "BatchNorm would see one value per channel (",
                      "); raise --batch-size or --img-size.")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_model_check_takes_the_runs_model_and_the_processes_batchnorm(tmp_path):
    """A squeezenet1_1 run at 32 px continued at --img-size 16 (no --model: the run's) is
    refused. A batch of 1 per process is not refused where BatchNorm sees more: SyncBatchNorm
    over two processes, --freeze-layers (BatchNorm in eval mode), or --eval-only."""
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"args": {"model": "squeezenet1_1", "img_size": 32}}, out / "checkpoint.pth")

    def complete(*argv: str, world_size: int = 1, run: Path | None = out / "checkpoint.pth"
                 ) -> dict:
        args, defaults = check_args(get_args_parser().parse_args(["--output-dir", str(out),
                                                                  *argv]), world_size)
        return run_flags(args, run and str(run), defaults, world_size)

    assert complete()["img_size"] == 32
    with pytest.raises(ConfigError, match=r"^--model squeezenet1_1 cannot take --img-size 16 "
                       r"crops \(Given input size: \(256x1x1\)\. .*\); use 224\.$"):
        complete("--img-size", "16")
    one = ["--model", "resnet18", "--img-size", "32", "--batch-size", "1"]  # a new run
    with pytest.raises(ConfigError, match=r"^--model resnet18 cannot train on --batch-size 1 "):
        complete(*one, "--no-sync-bn", world_size=2, run=None)
    complete(*one, world_size=2, run=None)  # --sync-bn: 2 values per channel
    complete(*one, "--weights", "w.pth", "--freeze-layers", run=None)
    complete(*one, "--weights", "w.pth", "--eval-only", run=None)


@pytest.mark.parametrize("recipe", [["--opt", "adamw"], ["--freeze-layers", "--weights"]],
                         ids=["adamw", "freeze-layers"])
def test_eval_only_loads_the_model_alone_whatever_the_optimizer(recipe, reference_run, tiny_data,
                                                                tmp_path, plain):
    """The documented ``--eval-only --resume DIR/model_best.pth`` of a run whose optimizer
    state this command's optimizer would not take: it scores the epoch as training did."""
    if recipe[-1] == "--weights":  # the features of an earlier run, only the classifier trains
        recipe = [*recipe, str(reference_run.out / "weights" / "model-0.pth")]
    out = tmp_path / "run"
    res = plain(flags(tiny_data, out, "--epochs", "1", *recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    res = plain(without_model_flags(flags(tiny_data, tmp_path / "eval", "--eval-only",
                                          "--resume", str(out / "model_best.pth"))))
    assert res.returncode == 0, res.stderr[-3000:]
    (epoch,) = read_metrics(out)
    assert f"top-1 accuracy: {epoch['val_acc']:.4f}\n" in res.stderr, res.stderr[-2000:]
    assert f"val loss: {epoch['val_loss']:.4f}" in res.stderr

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
