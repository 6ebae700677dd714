"""One checkpointer of a run's resumable parts: each registered once, saved and loaded in one
call each, under DDP (one file) and FSDP (each rank's shards) alike.

    checkpointer = Checkpointer(out, {"model": ModelState(model),
                                      "optimizer": OptimizerState(model, optimizer),
                                      "scaler": scaler, "rng_states": RNGState(), "train": train})
    checkpointer.load(path)   # --eval-only registers the model alone
    checkpointer.save()       # every rank; at an epoch's end save(record=..., is_best=...)

A part is anything with ``state_dict()`` and ``load_state_dict()`` (torch's ``Stateful``).
``checkpoint.pth`` holds every part, the train state's fields as its top-level keys
(torchvision's layout); the run folder's files are in docs/resume-and-restarts.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .checkpoint_io import (CheckpointError, extract_state_dict, load_file, save_atomic, unwrap,
                            whole_state)
from .data import EpochProgress
from .distributed_utils import (all_gather_object, all_ranks_ok, get_rank, get_world_size,
                                is_main_process, reduce_value)
from .guard import StopRequest, UserError, signals_deferred
from .heartbeat import Heartbeat
from .strategy import is_sharded, load_shards, save_shards

log = logging.getLogger("train")
TRAIN = "train"  # the part whose fields are the file's top-level keys
SHARDED = ("model", "optimizer")  # under FSDP: each rank's shards, in a DCP folder


class ModelState:
    """The model's weights, saved whole on rank 0's CPU, loaded whole by every rank."""

    def __init__(self, model: nn.Module) -> None:
        self.model = unwrap(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return whole_state(self.model)[0]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class OptimizerState:
    """The optimizer's state, keyed by parameter name; its settings stay this run's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = unwrap(model), optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # {} on ranks but 0
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        groups = [{k: v for k, v in group.items() if k != "initial_lr"}  # the schedule's: laid
                  for group in state["param_groups"]]  # out anew from this run's flags
        with own_settings(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, {**state, "param_groups": groups},
                                     options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def own_settings(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """An optimizer state loaded within keeps this run's settings (lr, momentum, weight decay:
    its flags and world size), as a new run with these flags would have them."""
    settings = [{k: v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups]
    yield
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


class RNGState:
    """Every rank's RNG states as plain values (bytes, lists: ``weights_only`` loads them);
    loaded, each rank goes on with its own (a rank new to the run: its seed's)."""

    def state_dict(self) -> list[dict[str, Any]]:
        kind, keys, *rest = np.random.get_state()
        state = {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate(),
                 "numpy": [kind, keys.tolist(), *rest]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
        return all_gather_object(state)

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if get_rank() >= len(states):
            return
        state = states[get_rank()]
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
        random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


@dataclass
class TrainState:
    """The trainer's own part (torchtitan's ``train_state``): where the run stands. ``epoch`` is
    the one training now, or after a load the one to start at; ``progress`` is the loop's place in
    it (a fresh :class:`EpochProgress` between epochs: no place to save)."""

    classes: list[str] = field(default_factory=list)
    flags: dict[str, Any] = field(default_factory=dict)  # this run's, recorded in each save
    file_list: str = ""  # a digest of the image list the epoch's order is drawn over
    epoch: int = 0
    best_acc: float = 0.0
    best_loss: float = math.inf
    metrics: list[dict[str, Any]] = field(default_factory=list)
    progress: EpochProgress = field(default_factory=EpochProgress)
    saved: dict[str, Any] = field(default_factory=dict)  # after a load: the file's entries

    def state_dict(self) -> dict[str, Any]:
        """Every rank calls it: the epoch's loss so far is summed over the ranks."""
        state = {"epoch": self.epoch, "best_acc": self.best_acc, "best_loss": self.best_loss,
                 "classes": self.classes, "args": self.flags, "metrics": self.metrics,
                 "file_list": self.progress.file_list or self.file_list}
        part = self.progress
        if part.batches_in_epoch:
            loss_sum, count = reduce_value(part.loss, average=False).tolist()
            state["in_epoch"] = {"batches": part.batches, "batches_in_epoch": part.batches_in_epoch,
                                 "samples": part.samples, "loss_sum": loss_sum, "count": count}
        return state

    def end_epoch(self, record: dict[str, Any], top1: float, loss: float) -> bool:
        """The epoch is done: its metrics line kept, no place in it left to save. Returns
        whether it is the best so far (of a tie in accuracy, the lower validation loss)."""
        self.metrics.append(record)
        self.progress = EpochProgress()
        best = (top1, -loss) > (self.best_acc, -self.best_loss)
        if best:
            self.best_acc, self.best_loss = top1, loss
        return best

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved, part = state, state.get("in_epoch")
        self.epoch = state["epoch"] + (0 if part else 1)
        self.best_acc, self.best_loss = state.get("best_acc", 0.0), state.get("best_loss", math.inf)
        self.metrics = [m for m in state.get("metrics", []) if m["epoch"] < self.epoch]
        self.progress = EpochProgress()
        if not part:
            return
        loss = [part["loss_sum"], part["count"]] if get_rank() == 0 else [0.0, 0.0]
        self.progress = EpochProgress(part["batches"], part["samples"], part["batches_in_epoch"],
                                      torch.tensor(loss, dtype=torch.float64))
        world, size = state.get("args", {}).get("world_size", get_world_size()), get_world_size()
        log.info("resuming from epoch %d, step %d of %d%s", self.epoch, part["batches"],  # rank 0
                 part["batches_in_epoch"], f" of {world} processes; the rest of its samples go "
                 f"to these {size}" if world != size else "")


class Checkpointer:
    """Saves and loads the registered ``states`` (name -> part; None: not in this run) in the run
    folder ``out``. ``keep_last`` K keeps the newest K epochs' weights and shards (0: all)."""

    def __init__(self, out: str | os.PathLike, states: dict[str, Any], *, keep_last: int = 0,
                 heartbeat: Heartbeat | None = None) -> None:
        self.out, self.keep_last = Path(out), keep_last
        self.heartbeat = heartbeat or Heartbeat()  # none given: one that hears nothing
        self.states = {name: part for name, part in states.items() if part is not None}

    def save(self, *, record: dict[str, Any] | None = None, is_best: bool = False,
             final: bool = False) -> None:
        """Every rank calls it; rank 0 writes. At an epoch's end (``record``: its metrics line)
        also the epoch's weights, the best model and the metrics line. A stop signal waits until
        all is on disk. The ``final`` FSDP save also exports the last and best weights."""
        self.heartbeat.at("saving")
        model = self.states["model"].model
        sharded = is_sharded(model)
        with signals_deferred():
            state = {}
            for name, part in self.states.items():
                if sharded and name in SHARDED:
                    continue
                value = part.state_dict()  # some gather from every rank: all call, in order
                if name == TRAIN:
                    state.update(value)
                elif value != {}:  # a part with nothing to save: a disabled GradScaler
                    state[name] = value
            if sharded:
                step = f"-step-{state['in_epoch']['batches']}" if "in_epoch" in state else ""
                state["shards"] = f"shards/epoch-{state['epoch']}{step}"
                save_shards(self.out / state["shards"], model, self.states["optimizer"].optimizer)
            if is_main_process():
                _write(self.out, state, record, is_best)
                _prune(self.out, state.get("shards"), self.keep_last)
            if final and sharded:
                _export_weights(self.out, model, state["epoch"])
            if final and is_main_process() and not (self.out / "model_best.pth").is_file():
                log.info("no validation images, so no best model: %s holds the last epoch's "
                         "weights", self.out / "weights" / f"model-{state['epoch']}.pth")

    def load(self, path: str, check: Callable[[dict[str, Any]], None] | None = None
             ) -> dict[str, Any]:
        """Every rank reads ``path`` itself (a machine may lack it), and ``check`` (this run's
        rules: raises a :class:`UserError`) is asked; all ranks raise the same error, so none
        waits alone in a collective. Then each part takes its entry; one the file lacks stays as
        it was built, or calls its ``load_missing(path)``. Returns what the file holds."""
        problem, state = None, {}
        try:
            state = load_file(path)
            if not isinstance(state, dict) or not ({"model", "epoch"} <= state.keys()
                                                   or {"shards", "epoch"} <= state.keys()):
                raise CheckpointError(f"{path} is not a training checkpoint (model, epoch); to "
                                      "start from its weights use --weights instead.")
            if check is not None:
                check(state)
        except UserError as exc:
            problem = exc
        if not all_ranks_ok(problem is None):
            raise problem or CheckpointError(f"another process of the run could not use {path}; "
                                             "every machine needs a readable copy.")
        for name, part in self.states.items():
            try:
                self._load_part(name, part, state, path)
            except (ValueError, KeyError) as exc:  # other trainable parameters (--freeze-layers)
                raise CheckpointError(f"the {name} state of {path} does not fit this run ({exc})"
                                      "; use the flags it was trained with.") from None
        return state

    def _load_part(self, name: str, part: Any, state: dict[str, Any], path: str) -> None:
        if name == TRAIN:
            part.load_state_dict(state)
        elif "shards" in state and name == "model":  # the optimizer's shards with it, if any
            optimizer = self.states.get("optimizer")
            with own_settings(optimizer.optimizer) if optimizer else contextlib.nullcontext():
                load_shards(state["shards"], part.model, optimizer and optimizer.optimizer)
        elif name in state:
            part.load_state_dict(state[name])
        elif hasattr(part, "load_missing"):  # e.g. an EMA new to the run: from its weights
            part.load_missing(path)


def _write(out: Path, state: dict[str, Any], record: dict[str, Any] | None, is_best: bool
           ) -> None:
    epoch = state["epoch"]
    if record is not None and "model" in state:
        save_atomic(state["model"], out / "weights" / f"model-{epoch}.pth")
    if record is not None and "model_ema" in state:  # torchvision's format: no "module."
        save_atomic({k.removeprefix("module."): v for k, v in state["model_ema"].items()
                     if k != "n_averaged"}, out / "weights" / f"model_ema-{epoch}.pth")
    if is_best:
        save_atomic(state, out / "model_best.pth")
    save_atomic(state, out / "checkpoint.pth")  # last: a crash before leaves the previous one
    if record is not None:
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _prune(out: Path, shards: str | None, keep_last: int) -> None:
    """Rank 0, after a save: the shard folders that are neither an epoch's complete save nor
    named by checkpoint.pth (``shards``) or model_best.pth go (a step's, a killed save's); then
    the epochs' files (``weights/model-N.pth``, ``model_ema-N.pth``, ``shards/epoch-N``) but the
    newest ``keep_last`` epochs' (0: all) and the named ones."""
    named = {str(out / shards)} if shards else set()
    if (out / "shards").is_dir() and (out / "model_best.pth").is_file():
        with contextlib.suppress(CheckpointError):  # its shards deleted by hand: none to keep
            named.add(load_file(out / "model_best.pth").get("shards"))  # a full path, or None
    for folder in (out / "shards").glob("*"):
        complete = re.fullmatch(r"epoch-\d+", folder.name) and (folder / ".metadata").is_file()
        if not complete and str(folder) not in named:
            shutil.rmtree(folder, ignore_errors=True)
    epochs = {p: int(m[1]) for p in [*(out / "weights").glob("*"), *(out / "shards").glob("*")]
              if (m := re.fullmatch(r"(?:model|model_ema|epoch)-(\d+)(?:\.pth)?", p.name))}
    newest = sorted(set(epochs.values()))[-keep_last:] if keep_last else epochs.values()
    for path, epoch in epochs.items():
        if epoch in newest or str(path) in named:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


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


def step_saves(stop: StopRequest, save: Callable[[], None], every: int = 0
               ) -> Callable[[EpochProgress], bool]:
    """``train_one_epoch``'s ``after_step``: every ``every`` optimizer steps (0: never) and at
    the step the ranks agree to stop on (a signal, :meth:`StopRequest.poll`), ``save()`` where
    the epoch stands; then, for a stop, it ends the epoch there."""
    steps = 0

    def after_step(progress: EpochProgress) -> bool:
        nonlocal steps
        steps += 1
        stopping = stop.poll()
        if stopping or (every and steps % every == 0):
            save()
        if stopping:  # every rank says where it stopped: the same step
            log.warning("stopping after step %d of %d of the epoch, saved", progress.batches,
                        progress.batches_in_epoch)
        return stopping

    return after_step
