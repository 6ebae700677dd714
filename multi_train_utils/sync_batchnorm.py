"""Synchronised BatchNorm that also runs on CPU with gloo (``torch.nn.SyncBatchNorm`` is CUDA-only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose backward sums every rank's gradient (d(sum)/dx_r = 1). Written here:
    ``torch.distributed.nn.functional.all_reduce`` is deprecated, and the functional collectives
    suggested instead are not differentiable on every version."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNormCPU(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batches of all ranks of ``process_group`` (default: all); plain
    BatchNorm in one process. ``(N, C, *)`` -> the same shape; state dict as ``BatchNorm2d``'s."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return super().forward(input)  # as plain BatchNorm: nothing to synchronise

        channels = input.shape[1]
        dims = [d for d in range(input.dim()) if d != 1]
        shape = [1, channels] + [1] * (input.dim() - 2)
        # Statistics in float32 under bf16/fp16 autocast too, as torch's BatchNorm keeps them.
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        n = input.numel() / channels
        # Each rank sums x and x^2 around its own batch mean m (no cancellation when
        # |mean| >> std) and expands the sums exactly in float64: one all-reduce, no shared m.
        m = x.detach().sum(dims) / max(n, 1)  # 0 for a rank with an empty batch
        c = x - m.view(shape)
        s1, s2, m = c.sum(dims).double(), (c * c).sum(dims).double(), m.double()
        count = torch.full((1,), n, dtype=torch.float64, device=x.device)
        stats = _AllReduceSum.apply(torch.cat([s1 + n * m, s2 + 2 * m * s1 + n * m * m, count]),
                                    self.process_group)
        total = stats[-1]
        if total.item() < 2:
            raise ValueError("SyncBatchNorm needs more than one value per channel over all ranks "
                             f"(got {int(total.item())}); use a larger batch.")
        mean, mean_square = stats[:-1].view(2, channels) / total
        # Biased, for normalising. Clamped: a constant channel's 0 can round below -eps.
        var = (mean_square - mean * mean).clamp(min=0)
        mean, var = mean.to(x.dtype), var.to(x.dtype)

        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                            else self.momentum)
                unbiased = var * (total / (total - 1))  # as torch's BatchNorm/SyncBatchNorm
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased.detach())

        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module,
                               process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """torch's converter (parameters and buffers shared, not copied), to this class: an
        ``nn.SyncBatchNorm`` itself would make DDP refuse a CPU model."""
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        for layer in module.modules():
            if type(layer) is nn.SyncBatchNorm:
                layer.__class__ = cls  # the same attributes; this forward
        return module


def convert_sync_batchnorm(module: nn.Module, device: torch.device,
                           process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """torch's SyncBatchNorm on CUDA (fused kernels), :class:`SyncBatchNormCPU` elsewhere."""
    convert = nn.SyncBatchNorm if device.type == "cuda" else SyncBatchNormCPU
    return convert.convert_sync_batchnorm(module, process_group)
