"""Checkpoints that survive crashes: atomic saves, safe loads, resume (their folder: run_folder.py).

A run folder holds ``checkpoint.pth`` (everything to continue: model, optimizer, epoch, RNG,
the run's flags and classes), ``model_best.pth`` (the same, of the best epoch),
``weights/model-N.pth`` (bare state dicts, loadable by torchvision) and ``metrics.jsonl``.
``checkpoint.pth`` is written last in each save, so it always marks a save that is complete.
Under FSDP it names a folder of every rank's shards instead of holding the state; either kind
resumes under either strategy, at any world size.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import zipfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .data import EpochProgress
from .distributed_utils import (all_gather_object, all_ranks_ok, get_rank, get_world_size,
                                is_main_process, reduce_value)
from .guard import StopRequest, UserError, signals_deferred
from .heartbeat import Heartbeat
from .strategy import is_sharded, load_shards, read_shards, save_shards

log = logging.getLogger("train")
# A continued run compares every flag the checkpoint recorded with its own (the table is in
# docs/resume-and-restarts.md). These are refused: another value would put validation images
# into training (the split), or the saved state would not fit (the parameters, their training).
# Where the run is kept is not compared; every other change applies from the resumed step.
# --opt and the RA sampler's: the optimizer state's kind, the stopped epoch's order. A
# weight decay of a group given to only one run changes the optimizer's groups.
REFUSED = ("model", "freeze_layers", "seed", "val_rate", "weights", "opt", "ra_sampler", "ra_reps")
ONE_RUN_ONLY = ("val_path", "norm_weight_decay", "bias_weight_decay",
                "transformer_embedding_decay")
BEFORE_RECIPES = {  # what runs saved before torchvision's recipe flags trained with
    "opt": "sgd", "lr_scheduler": "cosine", "lr_warmup_epochs": 0, "label_smoothing": 0.0,
    "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "auto_augment": None, "random_erase": 0.0,
    "model_ema": False, "ra_sampler": False, "ra_reps": 3, "norm_weight_decay": None,
    "bias_weight_decay": None, "transformer_embedding_decay": None}
NOT_COMPARED = ("output_dir", "resume", "local_rank", "eval_only", "world_size", "images_per_step")


class CheckpointError(UserError):
    """A file given as a checkpoint or weights cannot be used (one sentence, with the path)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under DDP and/or ``torch.compile`` (what is saved: no ``module.`` keys)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` into a temp file beside ``path``, fsync, then rename: a crash at any point
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
            raise exc.__context__ from None  # torch's zip writer hides a full disk behind this
        raise


def load_file(path: str | os.PathLike) -> Any:
    """``torch.load`` on the CPU with ``weights_only=True``, memory-mapped (a tensor is read when
    it is used); one sentence for an unusable file. A sharded checkpoint's ``shards`` folder is
    given back as a full path."""
    if not os.path.isfile(path):
        what = "is a folder; give a file in it" if os.path.isdir(path) else "does not exist"
        raise CheckpointError(f"{path} {what}.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True,
                         mmap=zipfile.is_zipfile(path))  # a legacy (not zip) file: no mmap
        if isinstance(obj, dict) and isinstance(obj.get("shards"), str):
            obj["shards"] = str(Path(path).parent / obj["shards"])
        return obj
    except Exception as exc:  # truncated, damaged, pickled objects, another format
        detail = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().split("\n")[0][:160]
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                              f"({type(exc).__name__}: {detail}).") from None


def extract_state_dict(obj: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model state dict in ``obj`` (ours, torchvision's or Lightning's checkpoint, or a bare
    state dict), without the ``module.`` / ``_orig_mod.`` prefixes of wrappers."""
    if isinstance(obj, dict) and "shards" in obj and "model" not in obj:  # saved under fsdp
        try:
            obj = read_shards(obj["shards"])
        except Exception as exc:  # missing, or a save that never finished
            raise CheckpointError(f"{path} names the shards {obj['shards']}, which cannot be "
                                  f"read ({type(exc).__name__}); copy the whole run folder."
                                  ) from None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
        raise CheckpointError(f"{path} holds no model state dict (a dict of tensors, or a "
                              "checkpoint with a 'model' entry).")
    prefix = re.compile(r"(module\.|_orig_mod\.)")
    while all(prefix.match(k) for k in obj):  # only when a wrapper prefixed every key
        obj = {prefix.sub("", k, count=1): v for k, v in obj.items()}
    return dict(obj)


def load_matching_weights(model: nn.Module, path: str | os.PathLike, *, head: str = "fc",
                          state: dict[str, torch.Tensor] | None = None
                          ) -> tuple[list[str], list[str]]:
    """Load the tensors of ``path`` (or ``state``, read already; ``path`` then only names it)
    whose names and shapes fit ``model``, e.g. all but a 1000-class classifier ``head`` (its
    top-level module). Returns (the file's keys left out, the model's keys left as initialised).
    Weights of another architecture (backbone shapes differ) are refused, not mixed in."""
    state = extract_state_dict(load_file(path), path) if state is None else state
    own = unwrap(model).state_dict()
    other = [k for k in state if k in own and own[k].shape != state[k].shape
             and not k.startswith(f"{head}.")]
    if other or not any(k in own for k in state):
        example = f" (e.g. {other[0]}: {list(state[other[0]].shape)})" if other else ""
        raise CheckpointError(f"{path} does not fit this model{example}; were the weights made "
                              "for another --model?")
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    unwrap(model).load_state_dict(fitting, strict=False)
    return sorted(state.keys() - fitting.keys()), sorted(own.keys() - fitting.keys())


def load_pretrained(model: nn.Module, path: str, strict: bool = False, *, head: str = "fc",
                    state: dict[str, torch.Tensor] | None = None) -> None:
    """``--weights``: start from every tensor that fits, and say what did not; ``head`` and
    ``state`` as in :func:`load_matching_weights`. ``strict`` (evaluation): every tensor of the
    model must come from the file."""
    skipped, missing = load_matching_weights(model, path, head=head, state=state)
    if strict and missing:
        raise CheckpointError(f"{path} does not fit this model and data ({len(missing)} "
                              f"tensor(s) missing or of other shapes, e.g. {missing[0]}), so its "
                              "accuracy would be meaningless; pass its --model and data.")
    total = len(unwrap(model).state_dict())
    new = sorted({k.rsplit(".", 1)[0] for k in missing if k.startswith(f"{head}.")})  # layers
    log.info("loaded %s: %d of the model's %d tensors%s", path, total - len(missing), total,
             f"; new for the data's classes: {', '.join(new)}" if new else "")
    if any(not k.startswith(f"{head}.") for k in [*missing, *skipped]):
        log.warning("%s and the model differ beyond the classifier (%d tensor(s) of the model "
                    "not loaded, %d of the file unused)", path, len(missing), len(skipped))


def load_checkpoint(path: str, args: Any, classes: list[str], inert: Collection[str] = ()
                    ) -> dict[str, Any]:
    """Every rank reads ``path`` itself (a machine may lack it) and checks that this run can go
    on from it; all ranks raise the same error, so none waits alone in a collective."""
    problem, ckpt = None, None
    try:
        ckpt = load_file(path)
        if not isinstance(ckpt, dict) or not ({"model", "optimizer", "epoch"} <= ckpt.keys()
                                              or {"shards", "epoch"} <= ckpt.keys()):
            raise CheckpointError(f"{path} is not a training checkpoint (model, optimizer, "
                                  "epoch); to start from its weights use --weights instead.")
        if "shards" in ckpt and not os.path.isfile(os.path.join(ckpt["shards"], ".metadata")):
            raise CheckpointError(f"{path} names the shards {ckpt['shards']}, which are not "
                                  "there (complete); copy the whole run folder.")
        refused, ckpt["changed_flags"] = ([], []) if args.eval_only else changed_flags(
            ckpt.get("args", {}), args, inert)  # evaluation: recorded_defaults checks the flags
        if ckpt.get("classes", classes) != classes:
            refused.append(f"the classes {classes} (the run had {ckpt['classes']})")
        if refused:
            raise CheckpointError(f"{path} cannot be continued with {', '.join(refused)}; give "
                                  "the run's values to continue it, or start a new run with "
                                  "--resume none or another --output-dir.")
    except UserError as exc:
        problem = exc
    if not all_ranks_ok(problem is None):
        raise problem or CheckpointError(f"another process of the run could not use {path}; "
                                         "every machine needs a readable copy.")
    return ckpt


def recorded_defaults(args: Any, path: str | None, defaults: dict[str, Any]) -> Any:
    """``args`` with each of ``defaults``' flags that was not given taken from the run that made
    ``path`` (a checkpoint, or weights it saved), else from ``defaults``. ``--eval-only``
    refuses a given flag the file contradicts (a model scored at another size is misjudged)."""
    try:
        saved = load_file(path).get("args", {}) if path else {}
    except (CheckpointError, AttributeError):  # not there or not ours: said where it is used
        saved = {}
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    if args.eval_only and (differ := [f"--{k.replace('_', '-')} {v} (it has {saved[k]})"
                                      for k, v in given.items() if saved.get(k, v) != v]):
        raise CheckpointError(f"{path} was trained with other flags than {', '.join(differ)}; "
                              "drop them: --eval-only takes them from the file.")
    recorded = {k: saved[k] for k in defaults if k in saved}
    return type(args)(**{**vars(args), **defaults, **recorded, **given})


def changed_flags(saved: dict[str, Any], args: Any, inert: Collection[str] = ()
                  ) -> tuple[list[str], list[str]]:
    """The flags of ``args`` whose values differ from the run's ``saved`` ones, as ``--lr 0.05
    (the run had 0.01)``: (refused, applied). ``inert`` (``recipe.inert_flags``): never refused."""
    def flag(key: str, value: Any, bare: bool = False) -> str:
        name = key.replace("_", "-")
        if value is None:
            return f"no --{name}"
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        return str(value) if bare else f"--{name} {value}"

    refused, applied, saved = [], [], {**BEFORE_RECIPES, **saved}
    if not (saved["ra_sampler"] or vars(args).get("ra_sampler")):  # no repeats: --ra-reps unused
        inert = {*inert, "ra_reps"}
    for key, value in sorted(vars(args).items()):
        if key in NOT_COMPARED or key not in saved or saved[key] == value:
            continue
        # --val-path given to only one run moves images between training and validation.
        split = key in REFUSED or key in ONE_RUN_ONLY and None in (value, saved[key])
        (refused if split and key not in inert else applied).append(
            f"{flag(key, value)} (the run had {flag(key, saved[key], bare=True)})")
    return refused, applied


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The model's and optimizer's state dicts (None without ``optimizer``) as whole tensors
    keyed by parameter name, on the CPU of rank 0 (the others get ``{}``): the same under DDP
    and FSDP, at any world size. Every rank must call it (FSDP gathers the shards, a tensor at a
    time). On a CPU run the tensors are the live ones."""
    # Imported here: torch.distributed.checkpoint adds half a second to each process's start.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model, options = unwrap(model), StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = None if optimizer is None else get_optimizer_state_dict(
        model, optimizer, options=options)
    return get_model_state_dict(model, options=options), optimizer_state


def _prune_shards(out: Path, current: str, keep_last: int) -> None:
    """Rank 0, after a save: remove the shard folders but ``current`` (the save's), the best's
    (if ``model_best.pth`` is sharded) and the newest ``keep_last`` complete ones."""
    best = load_file(out / "model_best.pth") if (out / "model_best.pth").is_file() else {}
    named = {Path(folder).name for folder in (current, best.get("shards")) if folder}
    epochs = sorted((p for p in (out / "shards").iterdir()
                     if re.fullmatch(r"epoch-\d+", p.name) and (p / ".metadata").is_file()),
                    key=lambda p: int(p.name[6:]))
    kept = {p.name for p in epochs[-keep_last:]} if keep_last else {p.name for p in epochs}
    for folder in (out / "shards").iterdir():
        if folder.name not in named | kept:
            shutil.rmtree(folder, ignore_errors=True)


def _export_weights(out: Path, model: nn.Module, epoch: int) -> None:
    """The final FSDP save: the last model, gathered a tensor at a time to rank 0's CPU, and the
    best one, read from its shards, as ``weights/model-N.pth`` (torchvision's format)."""
    last = whole_state(model)[0]  # {} on the other ranks
    if is_main_process():
        save_atomic(last, out / "weights" / f"model-{epoch}.pth")
        path = out / "model_best.pth"  # none without validation images; sharded, or ddp's
        if path.is_file() and (best := load_file(path))["epoch"] != epoch:
            save_atomic(extract_state_dict(best, path),
                        out / "weights" / f"model-{best['epoch']}.pth")


def load_model(ckpt: dict[str, Any], model: nn.Module) -> None:
    """``--eval-only``: the weights of ``ckpt`` (either kind) alone, under any strategy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if "shards" in ckpt:
        load_shards(ckpt["shards"], model)
    else:  # every rank has it whole: FSDP keeps a shard
        set_model_state_dict(unwrap(model), ckpt["model"],
                             options=StateDictOptions(full_state_dict=True))


def restore(ckpt: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LambdaLR, scaler: torch.amp.GradScaler,
            images_per_step: int, *, ema: nn.Module | None = None
            ) -> tuple[int, float, float, list[dict], EpochProgress]:
    """Continue from ``ckpt``: weights, optimizer, loss scale, this rank's RNG, and the cosine
    schedule at the next epoch, or at the epoch a stop interrupted. Returns (start epoch, best
    acc, best val loss, metrics so far, the start epoch's progress: none, or where it stopped).
    The schedule is laid out anew (more ``--epochs``: the longer cosine) and the optimizer's
    settings (lr, momentum, ...) are this run's, as for a new run with its flags and world size;
    its state (momentum buffers) is the checkpoint's, as is ``ema``'s (``recipe.ModelEma``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    rank = get_rank()
    command = [{k: v for k, v in group.items() if k != "params"}
               for group in optimizer.param_groups]
    options = StateDictOptions(full_state_dict=True)  # every rank has it whole: FSDP keeps a shard
    try:
        if "shards" in ckpt:
            load_shards(ckpt["shards"], model, optimizer)
        elif any(isinstance(key, int) for key in ckpt["optimizer"]["state"]):  # an older file
            load_model(ckpt, model)
            optimizer.load_state_dict(ckpt["optimizer"])  # keyed by position, as it was saved
        else:
            set_state_dict(unwrap(model), optimizer, model_state_dict=ckpt["model"],
                           optim_state_dict=ckpt["optimizer"], options=options)
    except (ValueError, KeyError) as exc:  # other trainable parameters (--freeze-layers)
        raise CheckpointError(f"the optimizer state of the checkpoint does not fit this run "
                              f"({exc}); use the flags it was trained with.") from None
    if "scaler" in ckpt and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and "model_ema" in ckpt:
        ema.load_state_dict(ckpt["model_ema"])
    elif ema is not None:  # n_averaged 0: its next update copies the weights again
        ema.module.load_state_dict(unwrap(model).state_dict())
        if rank == 0:
            log.info("the checkpoint holds no --model-ema average: it starts from these weights")
    rng = ckpt.get("rng_states") or []
    if rank < len(rng):
        restore_rng_state(rng[rank])
    saved, part = ckpt.get("args", {}), ckpt.get("in_epoch")
    start, progress = ckpt["epoch"] + (0 if part else 1), EpochProgress()
    if part:
        loss = [part["loss_sum"], part["count"]] if rank == 0 else [0.0, 0.0]
        progress = EpochProgress(part["batches"], part["samples"], part["batches_in_epoch"],
                                 torch.tensor(loss, dtype=torch.float64))
        moved = saved.get("world_size", get_world_size()) != get_world_size()
        log.info("resuming from epoch %d, step %d of %d%s", start, part["batches"],  # rank 0 only
                 part["batches_in_epoch"], f" of {saved['world_size']} processes; the rest "
                 f"of its samples go to these {get_world_size()}" if moved else "")
    changed = ckpt.get("changed_flags", [])
    if saved.get("images_per_step", images_per_step) != images_per_step:
        changed.append(f"{images_per_step} images per step (the run had "
                       f"{saved['images_per_step']}), lr {command[0]['initial_lr']:.4g}")
    if changed and rank == 0:
        log.warning("%s: applied from epoch %d%s", ", ".join(changed), start,
                    f", step {part['batches']}" if part else "")
    for group, hyper, lr_lambda in zip(optimizer.param_groups, command, scheduler.lr_lambdas):
        group.update(hyper)  # initial_lr: the lr this run's flags give (LambdaLR's base)
        group["lr"] = group["initial_lr"] * lr_lambda(start)
    scheduler.last_epoch = start
    history = [m for m in ckpt.get("metrics", []) if m["epoch"] < start]
    return start, ckpt.get("best_acc", 0.0), ckpt.get("best_loss", math.inf), history, progress


def save_checkpoint(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, state: dict[str, Any], *,
                    record: dict[str, Any] | None = None, is_best: bool = False,
                    keep_last: int = 0, progress: EpochProgress | None = None,
                    final: bool = False, ema: nn.Module | None = None,
                    heartbeat: Heartbeat | None = None) -> None:
    """Every rank calls it; rank 0 writes ``state`` (epoch, metrics, ...) with the model and
    optimizer state, every rank's RNG state and (``progress``) where the epoch stands. At an
    epoch's end (``record``: its metrics line) also the epoch's weights, the best model and the
    metrics line; part-way ``checkpoint.pth`` alone. A stop signal waits until all is on disk.
    Under FSDP each rank writes its shards, nothing gathered, to ``shards/epoch-N[-step-S]/`` (a
    folder every rank can see), which ``checkpoint.pth`` names. ``--keep-last`` K keeps the newest
    K epochs' weights or shards; the ``final`` FSDP save also exports the weights. ``ema``
    (the same on every rank) is saved whole, and exported as ``weights/model_ema-N.pth``."""
    if heartbeat is not None:
        heartbeat.at("saving")
    with signals_deferred():
        if is_sharded(model):
            tag = f"epoch-{state['epoch']}" + (f"-step-{progress.batches}" if progress else "")
            state = {**state, "shards": f"shards/{tag}"}
            save_shards(out / state["shards"], model, optimizer)
        else:
            weights, optimizer_state = whole_state(model, optimizer)
            state = {**state, "model": weights, "optimizer": optimizer_state}
        rng_states = all_gather_object(capture_rng_state())
        if progress is not None:
            loss_sum, count = reduce_value(progress.loss, average=False).tolist()
            state["in_epoch"] = {
                "batches": progress.batches, "batches_in_epoch": progress.batches_in_epoch,
                "samples": progress.samples, "loss_sum": loss_sum, "count": count}
        if is_main_process():
            state["rng_states"] = rng_states
            if scaler.is_enabled():
                state["scaler"] = scaler.state_dict()
            if ema is not None:
                state["model_ema"] = {k: v.cpu() for k, v in ema.state_dict().items()}
            _write(out, state, record, is_best, keep_last)
        if final and "shards" in state:
            _export_weights(out, model, state["epoch"])
        if final and is_main_process() and not (out / "model_best.pth").is_file():
            log.info("no validation images, so no best model: %s holds the last epoch's "
                     "weights", out / "weights" / f"model-{state['epoch']}.pth")


def _write(out: Path, state: dict[str, Any], record: dict[str, Any] | None, is_best: bool,
           keep_last: int) -> None:
    epoch = state["epoch"]
    if record is not None and "model" in state:
        save_atomic(state["model"], out / "weights" / f"model-{epoch}.pth")
    if record is not None and "model_ema" in state:  # torchvision's format: no "module."
        save_atomic({k.removeprefix("module."): v for k, v in state["model_ema"].items()
                     if k != "n_averaged"}, out / "weights" / f"model_ema-{epoch}.pth")
    if is_best:
        save_atomic(state, out / "model_best.pth")
    save_atomic(state, out / "checkpoint.pth")
    if "shards" in state:
        _prune_shards(out, state["shards"], keep_last)
    if record is None:
        return
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    numbered = sorted(int(m.group(1)) for p in (out / "weights").glob("model-*.pth")
                      if (m := re.fullmatch(r"model-(\d+)\.pth", p.name)))
    for old in numbered[:-keep_last] if keep_last else []:
        (out / "weights" / f"model-{old}.pth").unlink()
        (out / "weights" / f"model_ema-{old}.pth").unlink(missing_ok=True)


def step_saves(stop: StopRequest, save: Callable[..., None], every: int = 0
               ) -> Callable[[EpochProgress], bool]:
    """``train_one_epoch``'s ``after_step``: every ``every`` optimizer steps (0: never) and at
    the step the ranks agree to stop on (a signal, :meth:`StopRequest.poll`), ``save(progress=
    ...)`` where the epoch stands; then, for a stop, it ends the epoch there."""
    steps = 0

    def after_step(progress: EpochProgress) -> bool:
        nonlocal steps
        steps += 1
        stopping = stop.poll()
        if stopping or (every and steps % every == 0):
            save(progress=progress)
        if stopping:  # every rank says where it stopped: the same step
            log.warning("stopping after step %d of %d of the epoch, saved", progress.batches,
                        progress.batches_in_epoch)
        return stopping

    return after_step


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as plain values (bytes, lists), for ``weights_only`` loading."""
    kind, keys, *rest = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate(),
             "numpy": [kind, keys.tolist(), *rest]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
