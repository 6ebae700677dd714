"""Checkpoint files that survive crashes: atomic saves, safe loads, and weights from any source
(ours, torchvision's, Lightning's, a bare state dict), loaded as far as they fit the model."""

from __future__ import annotations

import logging
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .guard import UserError
from .strategy import read_shards

log = logging.getLogger("train")


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
    given back as a full path, checked to be there."""
    if not os.path.isfile(path):
        what = "is a folder; give a file in it" if os.path.isdir(path) else "does not exist"
        raise CheckpointError(f"{path} {what}.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True,
                         mmap=zipfile.is_zipfile(path))  # a legacy (not zip) file: no mmap
    except Exception as exc:  # truncated, damaged, pickled objects, another format
        detail = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().split("\n")[0][:160]
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                              f"({type(exc).__name__}: {detail}).") from None
    if isinstance(obj, dict) and isinstance(obj.get("shards"), str):
        obj["shards"] = str(Path(path).parent / obj["shards"])
        if not os.path.isfile(os.path.join(obj["shards"], ".metadata")):
            raise CheckpointError(f"{path} names the shards {obj['shards']}, which are not there "
                                  "(complete); copy the whole run folder.")
    return obj


def extract_state_dict(obj: Any, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model state dict in ``obj`` (ours, torchvision's or Lightning's checkpoint, or a bare
    state dict), without the ``module.`` / ``_orig_mod.`` prefixes of wrappers."""
    if isinstance(obj, dict) and "shards" in obj and "model" not in obj:  # saved under fsdp
        obj = read_shards(obj["shards"])
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
        raise CheckpointError(f"{path} holds no model state dict (a dict of tensors, or a "
                              "checkpoint with a 'model' entry).")
    while all(k.startswith(("module.", "_orig_mod.")) for k in obj):  # a wrapper's, on every key
        obj = {k.split(".", 1)[1]: v for k, v in obj.items()}
    return dict(obj)


def load_pretrained(model: nn.Module, path: str, strict: bool = False, *, head: str = "fc",
                    state: dict[str, torch.Tensor] | None = None) -> None:
    """``--weights``: load the tensors of ``path`` (or ``state``, read already; ``path`` then
    only names it) whose names and shapes fit ``model``, e.g. all but a 1000-class classifier
    ``head`` (its top-level module), and say what did not. ``strict`` (evaluation): every
    tensor of the model must come from the file."""
    state = extract_state_dict(load_file(path), path) if state is None else state
    own = unwrap(model).state_dict()
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped, missing = sorted(state.keys() - fitting.keys()), sorted(own.keys() - fitting.keys())
    # Refused: a backbone tensor of another shape (strict: any the file lacks), or none fits.
    refused = [k for k in missing if strict or k in state and not k.startswith(f"{head}.")]
    if refused or not fitting:
        refused = refused or missing
        raise CheckpointError(f"{path} does not fit this model ({len(refused)} tensor(s) missing "
                              f"or of other shapes, e.g. {refused[0]}); pass the --model and data "
                              "it was trained for.")
    unwrap(model).load_state_dict(fitting, strict=False)
    new = sorted({k.rsplit(".", 1)[0] for k in missing if k.startswith(f"{head}.")})  # layers
    log.info("loaded %s: %d of the model's %d tensors%s", path, len(own) - len(missing),
             len(own), f"; new for the data's classes: {', '.join(new)}" if new else "")
    if any(not k.startswith(f"{head}.") for k in [*missing, *skipped]):
        log.warning("%s and the model differ beyond the classifier (%d tensor(s) of the model "
                    "not loaded, %d of the file unused)", path, len(missing), len(skipped))


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The model's and optimizer's (None without one) state dicts, whole tensors keyed by
    parameter name on rank 0's CPU (``{}`` on the others), at any world size. Every rank calls
    it: FSDP gathers the shards a tensor at a time. On a CPU run the tensors are the live ones."""
    # Imported here: torch.distributed.checkpoint adds half a second to each process's start.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model, options = unwrap(model), StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = None if optimizer is None else get_optimizer_state_dict(
        model, optimizer, options=options)
    return get_model_state_dict(model, options=options), optimizer_state
