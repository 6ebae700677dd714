"""Two ways to spread training over N processes: DDP replicates the model, FSDP2 shards it, for
a model too big for one device (docs/strategies.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .guard import ConfigError

log = logging.getLogger("train")
STRATEGIES = ("ddp", "fsdp")
RESIDUAL_BLOCKS = ("BasicBlock", "Bottleneck")  # torchvision's ResNet blocks: its fsdp_units


def check_strategy(strategy: str, world_size: int, *, compile: bool, comm_hook: str,
                   model_ema: bool = False) -> None:
    """One sentence for a flag ``strategy`` cannot honour; a note where it changes nothing."""
    if strategy != "fsdp":
        return
    if model_ema or compile:  # --model-ema: a whole copy of the model on every rank
        raise ConfigError(f"{'--model-ema' if model_ema else '--compile'} is not supported with "
                          "--strategy fsdp; drop it, or use --strategy ddp.")
    if comm_hook != "none":
        raise ConfigError(f"--comm-hook {comm_hook} compresses DDP's all-reduce; with "
                          "--strategy fsdp use --amp (16-bit parameters, float32 reduction).")
    if world_size == 1:
        log.info("--strategy fsdp with one process holds the whole model: training as ddp does.")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``, :func:`shard_model`'s units: the outermost modules with
    submodules and parameters whose class, not ``torch.nn``'s nor a container, ``model`` holds
    twice or more (ResNet's BasicBlock, ViT's EncoderBlock, MobileNet's InvertedResidual, ...)."""
    counts = Counter(type(m) for m in model.modules())
    units: list[nn.Module] = []
    taken: set[int] = set()  # the modules inside a unit found
    for m in model.modules():  # parents before their children
        if (id(m) not in taken and counts[type(m)] >= 2
                and not type(m).__module__.startswith("torch.nn.")
                and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
                and any(True for _ in m.children()) and any(True for _ in m.parameters())):
            units.append(m)
            taken |= {id(x) for x in m.modules()}
    return units


def return_freed_memory() -> None:
    """Buffers of 1 MiB and up from mmap, back to the OS when freed (glibc; unless the user set
    ``MALLOC_MMAP_THRESHOLD_``): under glibc's defaults the heap fragments as FSDP gathers and
    frees whole blocks, and rank 1 peaked above ddp (2,030 vs 1,803 MiB, resnext101_32x8d)."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        with contextlib.suppress(AttributeError, OSError, TypeError):  # not glibc
            ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB


def shard_model(model: nn.Module, device: torch.device | None = None, *,
                mixed_precision: torch.dtype | None = None,
                units: Sequence[type[nn.Module] | str] | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 on ``device`` (default: where the model is) and return
    it, now also an ``FSDPModule`` of ``DTensor`` shards (build the optimizer after), a unit per
    block of ``units`` (classes or class names; default :func:`fsdp_units`). BatchNorm keeps
    float32 weights (its kernels need them) under ``mixed_precision``."""
    # Imported here: FSDP and DTensor add about half a second to every process's start-up.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    whole = model.state_dict() if dist.get_rank() == 0 else {}  # before the shards replace it
    device = device or next(model.parameters()).device
    if device.type == "cpu":
        return_freed_memory()
    # The run's device, not fully_shard's default (the machine's accelerator: CUDA under gloo).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    blocks = fsdp_units(model) if units is None else [
        m for m in model.modules() if m is not model and any(
            isinstance(m, u) if isinstance(u, type) else type(m).__name__ == u for u in units)]
    for unit in [*reversed(blocks), model]:  # innermost first: each unit takes what is left
        norms = [m for m in unit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and not isinstance(m, FSDPModule)]  # not in an inner unit already
        if mixed_precision is not None and norms:
            fully_shard(norms, mesh=mesh)  # one float32 unit (no policy: their own dtype)
        # The root too frees its gathered parameters after forward (FSDP2's default keeps them
        # for backward): after evaluate() no unit stays whole.
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)  # this rank's shards, uninitialised until filled below
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    # Rank 0's CPU random state too, as after a build on every rank (DDP): a build on the meta
    # device draws none, so dropout would differ. A build does not use CUDA's generators.
    rng = torch.get_rng_state().to(device)  # NCCL sends device tensors
    dist.broadcast(rng, src=0)
    torch.set_rng_state(rng.cpu())
    model.register_forward_pre_hook(_share_buffers_for_eval)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP shards (:func:`shard_model`), under torch.compile too."""
    return hasattr(getattr(model, "_orig_mod", model), "set_requires_gradient_sync")


def save_shards(folder: str | os.PathLike, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the (bare) model's and the optimizer's state into
    ``folder`` with ``torch.distributed.checkpoint``, gathering nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as states

    share_buffers(model)  # rank 0's BatchNorm statistics, as a whole-state save takes them
    dcp.save({"model": states.get_model_state_dict(model),
              "optimizer": states.get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)


def load_shards(folder: str | os.PathLike, model: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """Inverse of :func:`save_shards` (no ``optimizer``: the model alone), at any world size,
    under FSDP, DDP or in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as states

    state = {"model": states.get_model_state_dict(model)}
    if optimizer is not None:  # its lazy state made, zeros, for the file's to fill
        state["optimizer"] = states.get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    states.set_model_state_dict(model, state["model"])
    if optimizer is not None:
        states.set_optimizer_state_dict(model, optimizer, state["optimizer"])


def read_shards(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model state dict in a :func:`save_shards` folder, read by this process alone
    (to predict, to export)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    index = FileSystemReader(folder).read_metadata().state_dict_metadata
    model = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in index.items() if k.startswith("model.") and hasattr(m, "size")}
    load({"model": model}, checkpoint_id=folder, no_dist=True)
    return model


def _share_buffers_for_eval(module: nn.Module, inputs: object) -> None:
    """Once before each evaluation, every rank takes rank 0's buffers (BatchNorm's running
    statistics, which FSDP2 does not synchronise), as DDP's ``broadcast_buffers`` does."""
    if not (module.training or getattr(module, "buffers_shared", False)):
        share_buffers(module)
    module.buffers_shared = not module.training


def share_buffers(module: nn.Module) -> None:
    """Every rank takes rank 0's floating-point buffers, in one collective."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.broadcast(flat, src=0)
    for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(value.view_as(buffer))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward inside it reduces gradients across ranks only if ``enabled`` (DDP's ``no_sync``,
    FSDP2's ``set_requires_gradient_sync``): gradient accumulation's last micro-batch alone."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        skip = not enabled and hasattr(model, "no_sync")  # DDP; else one process: nothing to skip
        with model.no_sync() if skip else contextlib.nullcontext():
            yield
