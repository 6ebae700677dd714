"""Two ways to spread training over N processes: DDP replicates the model, FSDP2 shards it.

``--strategy ddp`` (the default) keeps the whole model, its gradients and its optimizer state on
every rank and all-reduces the gradients: the fastest choice whenever they fit on one device.
``--strategy fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard``) keeps 1/N of each on each
rank: it all-gathers a stage's parameters just before that stage's forward (and again for its
backward) and reduce-scatters its gradients, so a model whose training state does not fit one
device trains on several. Both take the same optimizer steps (tests/test_fsdp.py); checkpoints
hold full state dicts either way (``checkpoint.py``), so a run resumes under either strategy.

    model = shard_model(model, mixed_precision=torch.bfloat16)   # in place of DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), ...)          # after: on the shards
    with gradient_sync(model, enabled=last_micro_batch): loss.backward()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .guard import ConfigError

log = logging.getLogger("train")
STRATEGIES = ("ddp", "fsdp")
RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


def check_strategy(strategy: str, world_size: int, *, compile: bool, comm_hook: str) -> None:
    """One sentence for a flag ``strategy`` cannot honour; a note where it changes nothing."""
    if strategy != "fsdp":
        return
    if compile:
        raise ConfigError("--compile is not supported with --strategy fsdp here (only with "
                          "ddp); drop --compile, or use --strategy ddp.")
    if comm_hook != "none":
        raise ConfigError(f"--comm-hook {comm_hook} compresses DDP's all-reduce; with "
                          "--strategy fsdp use --amp (16-bit parameters, float32 reduction).")
    if world_size == 1:
        log.info("--strategy fsdp with one process holds the whole model: "
                 "training as ddp does.")


def shard_model(model: nn.Module, *, mixed_precision: torch.dtype | None = None,
                units: Sequence[str] = RESNET_STAGES) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (the caller's process group must be initialised):
    each child named in ``units`` (ResNet's residual stages) is one unit that is all-gathered
    whole for its forward and backward, the root holds the rest (stem, fc). Returns ``model``,
    now also an ``FSDPModule`` whose parameters are ``DTensor`` shards; build the optimizer
    after this, on ``model.parameters()``. Without the units, the root is the only unit: state
    is still sharded, but the whole model is gathered at once during forward.

    ``mixed_precision`` (``--amp``): parameters are gathered and computed in that dtype and
    gradients reduced in float32; BatchNorm keeps float32 weights (its kernels take a bf16 input
    only with float32 weights and statistics), in one unit per stage so it adds few collectives.
    """
    # Imported here: FSDP and DTensor add about half a second to every process's start-up.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # DDP copies rank 0's weights to every rank when it wraps; fully_shard only cuts each rank's
    # own tensors, so copy them first (only rank 0 read --weights).
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    # Without a mesh, fully_shard puts the shards on the machine's accelerator: a --device cpu
    # run on a GPU host would shard onto CUDA under a gloo group. The model's device decides.
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    stages = [getattr(model, name) for name in units if hasattr(model, name)]
    inner = {id(m) for stage in stages for m in stage.modules()}
    for unit in [*stages, model]:
        if mixed_precision is not None:
            norms = [m for m in unit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     and (unit is not model or id(m) not in inner)]
            if norms:
                fully_shard(norms, mesh=mesh)  # one float32 unit (no policy: their own dtype)
        # The root too frees its gathered parameters after forward (FSDP2 keeps them by default,
        # for the backward that follows): after evaluate() no unit stays whole.
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    model.register_forward_pre_hook(_share_buffers_for_eval)
    return model


def _share_buffers_for_eval(module: nn.Module, inputs: object) -> None:
    """Before an eval-mode forward, every rank takes rank 0's buffers (BatchNorm's running
    statistics), as DDP's ``broadcast_buffers`` does: each rank scores its share of the val set
    with the statistics that are saved. FSDP2 leaves buffers unsharded and unsynchronised; with
    SyncBatchNorm they are equal anyway, and training-mode forwards do not read them."""
    if module.training:
        return
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])  # one collective, not one per layer
    dist.broadcast(flat, src=0)
    for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(value.view_as(buffer))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward inside it reduces gradients across ranks only if ``enabled``: the non-final
    micro-batches of gradient accumulation skip it (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``), and the final one reduces the summed gradient."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if enabled:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDPModule
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
            yield


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer state
    (for FSDP the local shards of each ``DTensor``): what ``docs/strategies.md`` tabulates."""
    def size(tensors: Iterator[torch.Tensor]) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensor
        return sum(t.numel() * t.element_size() for t in local)

    params = list(model.parameters())
    state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]  # not SGD's/Adam's scalar step counts
    return {"parameters": size(iter(params)),
            "gradients": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(iter(state))}


__all__ = ["STRATEGIES", "check_strategy", "shard_model", "gradient_sync", "local_bytes"]
