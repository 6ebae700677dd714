"""torchvision's training recipe, each piece exactly resumable: its optimizers with their
weight-decay groups, warmup and lr schedules, mixup/cutmix and the EMA of the weights, under
the names of ``references/classification/train.py``'s flags (docs/recipes.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
from torch.optim import lr_scheduler as schedulers
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .distributed_utils import get_rank, get_world_size, is_main_process
from .strategy import share_buffers
from .train_eval_utils import cosine_schedule

log = logging.getLogger("train")
OPTIMIZERS = ("sgd", "sgd_nesterov", "rmsprop", "adamw")
SCHEDULES = ("cosine", "cosineannealinglr", "steplr", "exponentiallr")
NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
         nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
EMBEDDINGS = ("class_token", "position_embedding", "relative_position_bias_table")


def resolve_recipe(*, opt: str | None, lr_scheduler: str | None, lr_step_size: int | None,
                   lr_gamma: float | None, scale_lr: bool | None
                   ) -> tuple[dict[str, Any], dict[str, int]]:
    """These flags (None: not given) filled in, and the validation sizes to default to: given
    any of the first four, torchvision's meanings (an unscaled lr, crops 224 of 256)."""
    step = lr_step_size is not None or lr_gamma is not None
    torchvision = opt is not None or lr_scheduler is not None or step
    scale_lr = not torchvision if scale_lr is None else scale_lr
    if torchvision:
        log.info("torchvision's recipe flags: --lr is %s; validation crops 224 of 256 unless "
                 "given or continued", "scaled with the world size (--scale-lr)" if scale_lr
                 else "the total, not scaled with the world size")
    flags = {"opt": opt or "sgd", "lr_scheduler": lr_scheduler or ("steplr" if step else "cosine"),
             "lr_step_size": 30 if lr_step_size is None else lr_step_size,
             "lr_gamma": 0.1 if lr_gamma is None else lr_gamma, "scale_lr": scale_lr}
    return flags, {"val_resize_size": 256, "val_crop_size": 224} if torchvision else {}


def make_optimizer(model: nn.Module, *, opt: str, lr: float, momentum: float,
                   weight_decay: float, norm_weight_decay: float | None = None,
                   bias_weight_decay: float | None = None,
                   transformer_embedding_decay: float | None = None) -> torch.optim.Optimizer:
    """``opt`` over ``model``'s trainable parameters in torchvision's ``set_weight_decay``
    groups (norm layers', biases, transformer embeddings); a group's decay left None is
    ``weight_decay``'s."""
    custom = {} if bias_weight_decay is None else {"bias": bias_weight_decay}
    if transformer_embedding_decay is not None:
        custom.update(dict.fromkeys(EMBEDDINGS, transformer_embedding_decay))
    decay = {"other": weight_decay, "norm": norm_weight_decay, **custom}
    groups: dict[str, list[nn.Parameter]] = {key: [] for key in decay}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue  # frozen (--freeze-layers)
            norm = norm_weight_decay is not None and isinstance(module, NORMS)
            groups[name if name in custom else "norm" if norm else "other"].append(param)
    params = [{"params": p, "weight_decay": decay[k]} for k, p in groups.items() if p]
    if opt in ("sgd", "sgd_nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=opt == "sgd_nesterov")
    if opt == "rmsprop":  # torchvision's eps and alpha (TensorFlow's, for MobileNet)
        return torch.optim.RMSprop(params, lr=lr, momentum=momentum, eps=0.0316, alpha=0.9)
    if opt == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"opt {opt!r} is not one of {', '.join(OPTIMIZERS)}")


def inert_flags(model: nn.Module) -> list[str]:
    """``--norm-weight-decay``, ``--transformer-embedding-decay`` where ``model`` trains no such
    parameter (:func:`make_optimizer`): given to one of two continued runs, they change nothing."""
    trained = [(module, name) for module in model.modules()
               for name, param in module.named_parameters(recurse=False) if param.requires_grad]
    found = {"norm_weight_decay": any(isinstance(module, NORMS) for module, _ in trained),
             "transformer_embedding_decay": any(name in EMBEDDINGS for _, name in trained)}
    return [flag for flag, has in found.items() if not has]


def lr_schedule(optimizer: torch.optim.Optimizer, *, epochs: int, lr_scheduler: str, lrf: float,
                lr_min: float, lr_step_size: int, lr_gamma: float, lr_warmup_epochs: int,
                lr_warmup_method: str, lr_warmup_decay: float, start_epoch: int = 0
                ) -> schedulers.LambdaLR:
    """``lr_scheduler`` over ``epochs`` after the warmup, stepped once per epoch, as a LambdaLR
    of the factors torch's own schedulers give on a stand-in optimizer: a resumed or longer run
    lays them out anew from ``start_epoch``, and no scheduler state needs saving."""
    lr, warm = optimizer.param_groups[0]["lr"], lr_warmup_epochs
    for group in optimizer.param_groups:  # LambdaLR's base: this run's lr, resumed or not
        group["initial_lr"] = group["lr"]
    if lr_scheduler == "cosine" and not warm:  # the template's own: its exact factors
        return cosine_schedule(optimizer, epochs, lrf, last_epoch=start_epoch - 1)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = {
        "cosine": lambda: cosine_schedule(probe, epochs - warm, lrf),
        "cosineannealinglr": lambda: schedulers.CosineAnnealingLR(
            probe, T_max=epochs - warm, eta_min=lr_min),
        "steplr": lambda: schedulers.StepLR(probe, lr_step_size, gamma=lr_gamma),
        "exponentiallr": lambda: schedulers.ExponentialLR(probe, gamma=lr_gamma),
    }[lr_scheduler]()
    if warm:
        warmup = (schedulers.LinearLR if lr_warmup_method == "linear" else schedulers.ConstantLR)(
            probe, lr_warmup_decay, total_iters=warm)
        schedule = schedulers.SequentialLR(probe, [warmup, schedule], milestones=[warm])
    factors = []
    for _ in range(epochs + 1):
        factors.append(probe.param_groups[0]["lr"] / lr)
        probe.step()  # no gradient: changes nothing, but the scheduler expects it first
        schedule.step()
    return schedulers.LambdaLR(optimizer, lambda epoch: factors[min(epoch, epochs)],
                               last_epoch=start_epoch - 1)


class ModelEma(AveragedModel):
    """torchvision's exponential moving average of the weights and buffers, updated every
    ``every`` optimizer steps; a copy of the model on every rank, the same on each."""

    def __init__(self, model: nn.Module, *, decay: float, every: int, warmup_epochs: int) -> None:
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.every, self.warmup_epochs, self.source = every, warmup_epochs, [model]  # unregistered

    @classmethod
    def create(cls, model: nn.Module, *, enabled: bool, decay: float, every: int,
               warmup_epochs: int) -> ModelEma | None:
        """The average of ``model``, or None where not ``enabled`` (as ``BatchMix.create``)."""
        if not enabled:
            return None
        return cls(model, decay=decay, every=every, warmup_epochs=warmup_epochs)

    def load_missing(self, path: str) -> None:
        """A checkpoint without an average: it starts from the weights just loaded."""
        self.module.load_state_dict(self.source[0].state_dict())
        if is_main_process():
            log.info("%s holds no --model-ema average: it starts from these weights", path)

    def after_step(self, model: nn.Module, epoch: int, step: int) -> None:
        """After optimizer step ``step`` (from 1) of ``epoch``, on every rank."""
        if (step - 1) % self.every:
            return
        self.update_parameters(model)
        if epoch < self.warmup_epochs:
            self.n_averaged.fill_(0)  # the next update copies the weights again
        if get_world_size() > 1:
            share_buffers(self.module)  # without SyncBN each rank's statistics differ: rank 0's


class BatchMix:
    """torchvision's ``v2.MixUp`` or ``v2.CutMix`` (at random, when both are on) on each
    training batch, ``(N, 3, H, W), (N,) -> (N, 3, H, W), (N, C)`` class probabilities."""

    def __init__(self, transform: Any, seed: int, num_classes: int) -> None:
        self.transform, self.seed, self.num_classes = transform, seed, num_classes

    @classmethod
    def create(cls, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0, *,
               seed: int) -> BatchMix | None:
        """Mixup and/or cutmix with these Beta(alpha, alpha) parameters; None when both are 0."""
        from torchvision.transforms import v2

        mixes = [kind(alpha=alpha, num_classes=num_classes + 1)
                 for kind, alpha in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if alpha]
        if not mixes:
            return None
        log.info("mixup/cutmix: the training loss is against mixed targets (val is not mixed)")
        return cls(v2.RandomChoice(mixes), seed, num_classes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if labels.dim() != 1:
            return images, labels  # class probabilities already
        # An unreadable image (-100, a black one) is mixed as a class of its own, then dropped:
        # its share of a target trains nothing. No host sync, as a check of the labels would be.
        labels = labels.where(labels >= 0, self.num_classes)
        rank = get_rank()
        with torch.random.fork_rng(devices=[]):  # every draw is on the CPU generator
            torch.default_generator.manual_seed(  # not torch.manual_seed: it reseeds the GPUs
                (((self.seed * 1_000_003 + epoch) * 1_000_003 + rank) * 1_000_003 + batch) % 2**63)
            images, target = self.transform(images, labels)
        return images, target[:, :-1]
