"""Checkpoints that survive crashes: atomic writes, safe loads, RNG state, pruning."""

from __future__ import annotations

import errno
import os
import random
import re
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.nn as nn


class CheckpointError(ValueError):
    """A file given as a checkpoint or weights cannot be used (one sentence, with the path)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under DDP and/or ``torch.compile`` wrappers (what we save and load)."""
    model = getattr(model, "_orig_mod", model)
    # By type: a user's own model may well have a submodule called "module".
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)


def to_cpu(state: Any) -> Any:
    """``state`` (a state dict, possibly nested) with every tensor on the CPU, detached.

    Saved from a GPU, tensors remember their device: ``torch.load`` without ``map_location``
    then fails on a machine without CUDA and puts everything on GPU 0 on one with several.
    """
    if torch.is_tensor(state):
        return state.detach().cpu()
    if isinstance(state, dict):  # an OrderedDict stays one, with the module versions
        copy = type(state)((key, to_cpu(value)) for key, value in state.items())
        if hasattr(state, "_metadata"):  # that _load_from_state_dict reads
            copy._metadata = state._metadata
        return copy
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return state


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """``write(f)`` into a temp file in ``path``'s folder, fsync, then rename over ``path``.

    A crash (or kill -9) at any point leaves either the old file or the new one, never half; a
    failure removes the temp file. The file gets what ``open()`` would give it (0o666 less the
    umask, not mkstemp's 0o600), so teammates can read a run on shared storage.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL on a random name is as safe as mkstemp and honours the umask without reading it
    # (os.umask() can only be read by setting it, which races other threads).
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, RuntimeError) and isinstance(exc.__context__,
                                                        (OSError, KeyboardInterrupt)):
            # torch.save's zip writer hides a full disk (or a Ctrl-C that interrupted it) behind
            # "unexpected pos N vs M".
            raise exc.__context__ from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:  # make the rename itself durable
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def not_a_file(path: str | os.PathLike, name: str = "checkpoint/weights file") -> str | None:
    """One sentence if ``path`` is not a file (``name`` says which argument it is), else None.

    A folder is a common slip (a run's folder for its checkpoint): the sentence names a file in it.
    """
    if os.path.isfile(path):
        return None
    if not os.path.isdir(path):
        return f"{name} {path} does not exist."
    found = [Path(path) / f for f in ("checkpoint.pth", "model_best.pth")]
    found = [f for f in found if f.is_file()] or sorted(
        Path(path).glob("*.pth"), key=lambda f: f.stat().st_mtime, reverse=True)
    return f"{name} {path} is a folder; give a file" + (f", e.g. {found[0]}." if found else ".")


def load_file(path: str | os.PathLike) -> Any:
    """``torch.load`` on CPU with ``weights_only=True``; a clear error for anything unusable,
    including a file whose bytes were damaged after it was written (CRC check)."""
    problem = not_a_file(path)
    if problem:
        raise CheckpointError(problem)
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        damage = _zip_damage(path)
        if damage:
            raise CheckpointError(f"{path} is corrupt ({damage}); its bytes changed after it "
                                  "was saved (disk, copy or transfer error).")
    not_zip = (f"{path} is not a readable PyTorch checkpoint (not a complete zip archive: "
               "truncated, corrupt or another format).")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:  # there, but unreadable: permissions, a failing disk or network mount
        if is_zip or exc.errno != errno.EINVAL:
            raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}).") from None
        # Cut short near its end: torch reads what is left as an old-format pickle and seeks
        # past the end of the file (EINVAL).
        raise CheckpointError(not_zip) from None
    except Exception as exc:  # pickle errors, truncated zip, unsafe globals, ...
        if not is_zip:  # torch's own message would suggest weights_only=False: never for this
            raise CheckpointError(not_zip) from None
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # torch's message has colours
        if "Weights only load failed" in text:
            raise CheckpointError(f"{path} holds Python objects, not only tensors (e.g. a whole "
                                  "model saved with torch.save(model)), which are not loaded, for "
                                  "safety; if you trust it, load it yourself and save "
                                  "model.state_dict() instead.") from None
        detail = text.splitlines()[0][:160] if text else ""
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                              f"({type(exc).__name__}{': ' + detail if detail else ''}).") from None


def _zip_damage(path: str | os.PathLike) -> str | None:
    """Which member of the zip archive ``torch.save`` wrote fails its CRC, or None.

    ``torch.load`` does not check the CRCs, so flipped bytes would load as silently wrong
    weights. Reading the file once more costs well under a second for a ResNet checkpoint.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"damaged zip archive: {exc}"
    return f"{bad} fails its CRC check" if bad else None


# What a wrapper keeps beside the model's own tensors: AveragedModel's (EMA) update count.
WRAPPER_KEYS = frozenset({"n_averaged"})


def extract_state_dict(obj: Any, path: str | os.PathLike, *, strip: bool = True
                       ) -> dict[str, torch.Tensor]:
    """The model state dict inside ``obj`` (a bare state dict or a checkpoint with ``model``),
    without the ``module.`` / ``_orig_mod.`` prefixes of wrappers (``strip``)."""
    # "model" (ours, torchvision's references), "state_dict" (Lightning), "model_state_dict"
    # (the PyTorch tutorial's general checkpoint)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
        raise CheckpointError(f"{path} holds no model state dict (expected a dict of tensors or a "
                              "checkpoint with a 'model', 'state_dict' or 'model_state_dict' "
                              "entry).")
    # A wrapper (DDP's "module.", torch.compile's "_orig_mod.") prefixes every key; a model's
    # own submodule called "module" prefixes only its own, and keeps its name.
    prefix = re.compile(r"(module\.|_orig_mod\.)")
    while strip and all(prefix.match(k) for k in obj.keys() - WRAPPER_KEYS):
        obj = {prefix.sub("", k, count=1): v for k, v in obj.items()}
    return dict(obj)


def load_matching_weights(model: nn.Module, path: str | os.PathLike, *, source: Any = None,
                          leave_out: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Load the tensors of ``path`` whose names and shapes fit ``model`` (e.g. all but a new
    classifier head), except names starting with ``leave_out``; ``source``: the file's content
    when already loaded. Returns (skipped keys of the file, model keys left as initialised)."""
    source = load_file(path) if source is None else source
    model = unwrap(model)  # the file's names are the bare model's
    own = model.state_dict()

    def fitting_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items()
                if k in own and own[k].shape == v.shape and not k.startswith(leave_out)}

    state = extract_state_dict(source, path)
    fitting = fitting_part(state)
    if not fitting:  # a model whose only child is called "module" names its own tensors so
        state = extract_state_dict(source, path, strip=False)
        fitting = fitting_part(state)
    if not fitting:
        raise CheckpointError(f"no tensor in {path} matches the model by name and shape; is it "
                              "weights for another architecture?")
    model.load_state_dict(fitting, strict=False)
    skipped = sorted(set(state) - set(fitting))
    missing = sorted(set(own) - set(fitting))
    return skipped, missing


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states as plain Python values (bytes, lists), which both
    ``all_gather_object`` and ``weights_only`` loading accept.

    ``device``: the run's device; a CUDA one adds its generator. (None: CUDA's if this process
    already uses CUDA. A CPU run on a GPU machine must not create a CUDA context on GPU 0.)
    """
    kind, keys, *rest = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate(),
             "numpy": [kind, keys.tolist(), *rest]}
    if _uses_cuda(device):
        state["cuda"] = torch.cuda.get_rng_state(device or "cuda").numpy().tobytes()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Inverse of :func:`capture_rng_state` (``device`` as there)."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and _uses_cuda(device):
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8),
                                 device or "cuda")


def _uses_cuda(device: torch.device | None) -> bool:
    if device is None:
        return torch.cuda.is_available() and torch.cuda.is_initialized()
    return device.type == "cuda"


def _tuples(obj: Any) -> Any:
    # random.setstate needs tuples; a round trip through some serialisers yields lists.
    return tuple(_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def prune_weights(folder: str | os.PathLike, keep_last: int,
                  newest: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` ``model-{epoch}.pth`` files (0 keeps all).

    ``newest``: the epoch just saved. Files of later epochs are left from a run that went
    further before this one resumed an earlier checkpoint (e.g. its model_best.pth); they are
    not this run's newest, so they go first and the file just written is always kept.
    """
    if keep_last <= 0:
        return []
    numbered = []
    for path in Path(folder).glob("model-*.pth"):
        if match := re.fullmatch(r"model-(\d+)\.pth", path.name):
            numbered.append((int(match.group(1)), path))
    numbered.sort()
    stale = [p for e, p in numbered if newest is not None and e > newest]
    current = [p for e, p in numbered if newest is None or e <= newest]
    doomed = stale + current[:-keep_last]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed
