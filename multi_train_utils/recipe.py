"""torchvision's training recipe, each piece exactly resumable: its optimizers with their
weight-decay groups, warmup and lr schedules, mixup/cutmix and the EMA of the weights, under
the flag names of ``references/classification/train.py`` (docs/recipes.md).

    optimizer = make_optimizer(model, args, images_per_step)       # --opt, --*-weight-decay
    scheduler = lr_schedule(optimizer, args)                       # a LambdaLR, once per epoch
    ema = ModelEma.create(model, args, images_per_step, device)    # None without --model-ema
    mix = BatchMix.create(args, num_classes)                       # None without mixup/cutmix

Every random draw that is new here comes from (seed, epoch, rank, batch) or (seed, epoch,
image), and the only new state is the EMA's, saved in the checkpoint: a run stopped part-way
ends with the weights of one never stopped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .guard import ConfigError
from .strategy import share_buffers
from .train_eval_utils import cosine_schedule

log = logging.getLogger("train")
OPTIMIZERS = ("sgd", "sgd_nesterov", "rmsprop", "adamw")
SCHEDULES = ("cosine", "cosineannealinglr", "steplr", "exponentiallr")
NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
         nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)
EMBEDDINGS = ("class_token", "position_embedding", "relative_position_bias_table")


def resolve_recipe(args: Any) -> dict[str, int]:
    """Fill the recipe flags that depend on others, in ``args`` before it is recorded, and say
    so. With torchvision's ``--opt``, ``--lr-scheduler``, ``--lr-step-size`` or ``--lr-gamma``
    (alone, they choose its default ``steplr``) its meanings hold: ``--lr`` is the whole
    batch's, not scaled (``--scale-lr``), and validation crops 224 of 256: the defaults
    returned, which the sizes given, or those of the run continued, override."""
    step = args.lr_step_size is not None or args.lr_gamma is not None
    recipe = args.opt is not None or args.lr_scheduler is not None or step
    if recipe:  # torchvision's meaning of its flags, and its defaults where the command is silent
        log.info("torchvision's recipe flags: --lr %g is the lr of all processes' batch%s; "
                 "validation crops 224 of 256 unless --val-crop-size/--val-resize-size or the "
                 "run continued say otherwise", args.lr,
                 "" if args.scale_lr else ", not scaled with the world size")
    args.scale_lr = not recipe if args.scale_lr is None else args.scale_lr
    args.lr_scheduler = args.lr_scheduler or ("steplr" if step else "cosine")
    args.opt = args.opt or "sgd"
    args.lr_step_size = 30 if args.lr_step_size is None else args.lr_step_size
    args.lr_gamma = 0.1 if args.lr_gamma is None else args.lr_gamma
    if args.lr_warmup_epochs >= args.epochs:
        raise ConfigError(f"--lr-warmup-epochs {args.lr_warmup_epochs} leaves no epoch of the "
                          f"{args.epochs} for the schedule; lower it or raise --epochs.")
    return {"val_resize_size": 256, "val_crop_size": 224} if recipe else {}


def make_optimizer(model: nn.Module, args: Any, images_per_step: int) -> torch.optim.Optimizer:
    """The ``--opt`` optimizer over ``model``'s trainable parameters. The template's
    ``--lr`` is one process's and grows with the images per step (linear scaling, Goyal et al.
    2017, arXiv:1706.02677: N processes average N times as many images); torchvision's is
    already the total. Weight-decay groups as torchvision's ``set_weight_decay``: norm layers'
    parameters (``--norm-weight-decay``), biases and transformer embeddings matched by name."""
    lr = args.lr * images_per_step / args.batch_size if args.scale_lr else args.lr
    custom = ([("bias", args.bias_weight_decay)] if args.bias_weight_decay is not None else [])
    if args.transformer_embedding_decay is not None:
        custom += [(key, args.transformer_embedding_decay) for key in EMBEDDINGS]
    groups: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], **{k: [] for k, _ in custom}}
    decay = {"other": args.weight_decay, "norm": args.norm_weight_decay, **dict(custom)}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue  # --freeze-layers
            key = next((k for k, _ in custom if k == name), None)  # a custom key first
            if key is None:
                key = "norm" if args.norm_weight_decay is not None and isinstance(
                    module, NORMS) else "other"
            groups[key].append(param)
    params = [{"params": p, "weight_decay": decay[k]} for k, p in groups.items() if p]
    if args.opt.startswith("sgd"):
        optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum,
                                    nesterov=args.opt == "sgd_nesterov")
    elif args.opt == "rmsprop":  # torchvision's eps and alpha (TensorFlow's, for MobileNet)
        optimizer = torch.optim.RMSprop(params, lr=lr, momentum=args.momentum, eps=0.0316,
                                        alpha=0.9)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr)
    return optimizer


def inert_flags(model: nn.Module) -> list[str]:
    """``--norm-weight-decay``, ``--transformer-embedding-decay`` where ``model`` trains no such
    parameter (:func:`make_optimizer`): given to one of two continued runs, they change nothing."""
    trained = [(module, name) for module in model.modules()
               for name, param in module.named_parameters(recurse=False) if param.requires_grad]
    found = {"norm_weight_decay": any(isinstance(module, NORMS) for module, _ in trained),
             "transformer_embedding_decay": any(name in EMBEDDINGS for _, name in trained)}
    return [flag for flag, has in found.items() if not has]


def lr_schedule(optimizer: torch.optim.Optimizer, args: Any, start_epoch: int = 0
                ) -> lr_scheduler.LambdaLR:
    """``--lr-scheduler`` after ``--lr-warmup-epochs`` W, stepped once per epoch, as a LambdaLR
    of the factors torch's own schedulers give (run here on a stand-in optimizer): a resumed or
    longer run lays them out anew, and no scheduler state needs saving. ``cosine``: the lr
    falls to ``lr x --lrf`` on a half cosine (SGDR, arXiv:1608.03983)."""
    lr, epochs, warm = optimizer.param_groups[0]["lr"], args.epochs, args.lr_warmup_epochs
    for group in optimizer.param_groups:  # the base: this run's lr, when it resumes too
        group["initial_lr"] = group["lr"]
    if args.lr_scheduler == "cosine" and not warm:  # the template's own: its exact factors
        return cosine_schedule(optimizer, epochs, args.lrf, last_epoch=start_epoch - 1)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = {
        "cosine": lambda: cosine_schedule(probe, epochs - warm, args.lrf),
        "cosineannealinglr": lambda: lr_scheduler.CosineAnnealingLR(
            probe, T_max=epochs - warm, eta_min=args.lr_min),
        "steplr": lambda: lr_scheduler.StepLR(probe, args.lr_step_size, gamma=args.lr_gamma),
        "exponentiallr": lambda: lr_scheduler.ExponentialLR(probe, gamma=args.lr_gamma),
    }[args.lr_scheduler]()
    if warm:
        warmup = (lr_scheduler.LinearLR(probe, args.lr_warmup_decay, total_iters=warm)
                  if args.lr_warmup_method == "linear" else
                  lr_scheduler.ConstantLR(probe, args.lr_warmup_decay, total_iters=warm))
        schedule = lr_scheduler.SequentialLR(probe, [warmup, schedule], milestones=[warm])
    factors = []
    for _ in range(epochs + 1):
        factors.append(probe.param_groups[0]["lr"] / lr)
        probe.step()  # no gradient: changes nothing, but the scheduler expects it first
        schedule.step()
    return lr_scheduler.LambdaLR(optimizer, lambda epoch: factors[min(epoch, epochs)],
                                 last_epoch=start_epoch - 1)


class ModelEma(AveragedModel):
    """An exponential moving average of the weights and buffers (``--model-ema``), updated
    every ``--model-ema-steps`` optimizer steps as torchvision's recipe does, its decay adjusted
    for the images per update and the epochs; a copy of the model held on every rank, the same
    on each. During warmup it follows the weights. Its ``state_dict`` (``n_averaged`` too) is
    saved with the checkpoint."""

    def __init__(self, model: nn.Module, device: torch.device, decay: float, every: int,
                 warmup_epochs: int) -> None:
        super().__init__(model, device, multi_avg_fn=get_ema_multi_avg_fn(decay),
                         use_buffers=True)
        self.every, self.warmup_epochs = every, warmup_epochs

    @classmethod
    def create(cls, model: nn.Module, args: Any, images_per_step: int, device: torch.device
               ) -> ModelEma | None:
        if not args.model_ema:
            return None
        adjust = images_per_step * args.model_ema_steps / args.epochs
        alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
        return cls(model, device, 1.0 - alpha, args.model_ema_steps, args.lr_warmup_epochs)

    def after_step(self, model: nn.Module, epoch: int, step: int) -> None:
        """After optimizer step ``step`` (from 1) of ``epoch``, on every rank."""
        if (step - 1) % self.every:
            return
        self.update_parameters(model)
        if epoch < self.warmup_epochs:
            self.n_averaged.fill_(0)  # the next update copies the weights again
        if dist.is_initialized() and dist.get_world_size() > 1:
            share_buffers(self.module)  # without SyncBN each rank's statistics differ: rank 0's


class BatchMix:
    """``--mixup-alpha``/``--cutmix-alpha``: torchvision's ``v2.MixUp`` or ``v2.CutMix`` (one
    of the two, at random, when both are set) on each training batch, ``(N, 3, H, W), (N,) ->
    (N, 3, H, W), (N, C)`` class probabilities. Drawn from (seed, epoch, rank, batch), so a
    resumed epoch mixes its batches as the uninterrupted one did."""

    def __init__(self, transform: Any, seed: int, num_classes: int) -> None:
        self.transform, self.seed, self.num_classes = transform, seed, num_classes

    @classmethod
    def create(cls, args: Any, num_classes: int) -> BatchMix | None:
        from torchvision.transforms import v2

        # One class more: an unreadable image's (below), whose share of a target is dropped.
        mixes = ([v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes + 1)]
                 if args.mixup_alpha else [])
        if args.cutmix_alpha:
            mixes.append(v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes + 1))
        if not mixes:
            return None
        log.info("mixup/cutmix: the training loss is against mixed targets (val is not mixed)")
        return cls(v2.RandomChoice(mixes), args.seed, num_classes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if labels.dim() != 1:
            return images, labels  # class probabilities already
        # An unreadable image (-100, a black one) is mixed as a class of its own, then dropped:
        # its share of a target trains nothing. No host sync, as a check of the labels would be.
        labels = labels.where(labels >= 0, self.num_classes)
        rank = dist.get_rank() if dist.is_initialized() else 0
        with torch.random.fork_rng(devices=[]):  # every draw is on the CPU generator
            torch.default_generator.manual_seed(  # not torch.manual_seed: it reseeds the GPUs
                (((self.seed * 1_000_003 + epoch) * 1_000_003 + rank) * 1_000_003 + batch) % 2**63)
            images, target = self.transform(images, labels)
        return images, target[:, :-1]
