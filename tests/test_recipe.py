"""torchvision's recipe, piece by piece, against torchvision's own code: the optimizer groups,
the schedules, mixup/cutmix, the EMA and the RA sampler (references/classification, copied
below where it is not importable), the augmentation policies, the flags that follow from others
and the ImageNet folder layout, in-process on small or meta models; then one launched recipe
run, stopped and continued."""

from __future__ import annotations

import argparse
import itertools
import math
import re
import shlex
import time

import pytest
import torch
import torchvision
from torch import nn
from torchvision.transforms import v2

from conftest import (LAUNCH, ROOT, assert_same_run, assert_same_tensors, assert_user_error, flags,
                      load_ckpt, make_stopper, ranks, read_metrics)
from multi_train_utils.checkpoint import Checkpointer, ModelState, OptimizerState
from multi_train_utils.checkpoint_io import whole_state
from multi_train_utils.data import ResumableSampler
from multi_train_utils.guard import ConfigError
from multi_train_utils.recipe import (BatchMix, ModelEma, inert_flags, lr_schedule,
                                      make_optimizer, resolve_recipe)
from multi_train_utils.train_eval_utils import LoopOptions, train_one_epoch
from predict import load_predictor
from test_bad_data import make_class
from train_flags import (BEFORE_RECIPES, check_args, ema_kwargs, flag_changes,
                         get_args_parser, optimizer_kwargs, run_flags, schedule_kwargs)
from augment import get_transforms
from image_folder import DataError, imagenet_layout


def parse(*argv: str) -> argparse.Namespace:
    """The flags as ``main`` has them: parsed, and completed by ``check_args``."""
    return check_args(get_args_parser().parse_args(list(argv)), 1)[0]


def vparse(*argv: str) -> dict:
    return vars(parse(*argv))


# ---------------------------------------------------------------- torchvision's, copied
def set_weight_decay(model, weight_decay, norm_weight_decay=None, norm_classes=None,
                     custom_keys_weight_decay=None):
    """references/classification/utils.py, verbatim but for line breaks."""
    if not norm_classes:
        norm_classes = [nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                        nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm]
    norm_classes = tuple(norm_classes)
    params = {"other": [], "norm": []}
    params_weight_decay = {"other": weight_decay, "norm": norm_weight_decay}
    custom_keys = []
    if custom_keys_weight_decay is not None:
        for key, weight_decay in custom_keys_weight_decay:
            params[key] = []
            params_weight_decay[key] = weight_decay
            custom_keys.append(key)

    def _add_params(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)
        for child_name, child_module in module.named_children():
            child_prefix = f"{prefix}.{child_name}" if prefix != "" else child_name
            _add_params(child_module, prefix=child_prefix)

    _add_params(model)
    return [{"params": params[key], "weight_decay": params_weight_decay[key]}
            for key in params if len(params[key]) > 0]


def ra_sampler_indices(n, num_replicas, rank, seed, epoch, repetitions):
    """references/classification/sampler.py's RASampler.__iter__."""
    num_samples = int(math.ceil(n * float(repetitions) / num_replicas))
    total_size = num_samples * num_replicas
    num_selected_samples = int(math.floor(n // 256 * 256 / num_replicas))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    indices = torch.randperm(n, generator=g).tolist()
    indices = [ele for ele in indices for i in range(repetitions)]
    indices += indices[: (total_size - len(indices))]
    indices = indices[rank: total_size: num_replicas]
    return indices[:num_selected_samples]


# ---------------------------------------------------------------- the optimizer
@pytest.mark.parametrize("model_name,argv,custom,groups", [
    ("resnet18", [], None, 1),
    ("resnet18", ["--norm-weight-decay", "0", "--bias-weight-decay", "0.1"], [("bias", 0.1)], 3),
    ("vit_b_16", ["--norm-weight-decay", "0", "--transformer-embedding-decay", "0"],
     [(k, 0.0) for k in ("class_token", "position_embedding", "relative_position_bias_table")],
     3),  # other, norm, class_token (its position embedding is named pos_embedding)
])
def test_weight_decay_groups_are_torchvisions(model_name, argv, custom, groups):
    with torch.device("meta"):
        model = torchvision.models.get_model(model_name, num_classes=5)
    args = parse("--opt", "adamw", "--wd", "0.05", *argv)
    ours = make_optimizer(model, **optimizer_kwargs(args, images_per_step=16)).param_groups
    theirs = set_weight_decay(model, 0.05, args.norm_weight_decay,
                              custom_keys_weight_decay=custom)
    assert [(g["weight_decay"], [id(p) for p in g["params"]]) for g in ours] == \
           [(g["weight_decay"], [id(p) for p in g["params"]]) for g in theirs]
    assert len(ours) == groups


@pytest.mark.parametrize("opt,kind,settings", [
    ("sgd", torch.optim.SGD, {"nesterov": False, "momentum": 0.9}),
    ("sgd_nesterov", torch.optim.SGD, {"nesterov": True}),
    ("rmsprop", torch.optim.RMSprop, {"eps": 0.0316, "alpha": 0.9}),
    ("adamw", torch.optim.AdamW, {}),
])
def test_opt_builds_torchvisions_optimizer_at_the_total_lr(opt, kind, settings):
    model = nn.Linear(3, 2)
    args = parse("--opt", opt, "--lr", "0.5")
    optimizer = make_optimizer(model, **optimizer_kwargs(args, images_per_step=64))
    assert type(optimizer) is kind and optimizer.param_groups[0]["lr"] == 0.5  # not scaled
    assert settings.items() <= optimizer.param_groups[0].items()
    # The template's own --lr is one process's batch's (16): x4 for 64 images a step.
    assert optimizer_kwargs(parse("--lr", "0.5"), images_per_step=64)["lr"] == 2.0
    with pytest.raises(ValueError, match="^opt 'lamb' is not one of sgd, sgd_nesterov, "):
        make_optimizer(model, opt="lamb", lr=0.5, momentum=0.9, weight_decay=0.0)


# ---------------------------------------------------------------- the schedule
def torchvision_lrs(argv: list[str], epochs: int) -> list[float]:
    """The lr of each epoch as torchvision's train.py builds its scheduler."""
    args = parse("--epochs", str(epochs), *argv)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=args.lr)
    main = {"steplr": lambda: torch.optim.lr_scheduler.StepLR(
                opt, step_size=args.lr_step_size, gamma=args.lr_gamma),
            "cosineannealinglr": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=args.epochs - args.lr_warmup_epochs, eta_min=args.lr_min),
            "exponentiallr": lambda: torch.optim.lr_scheduler.ExponentialLR(
                opt, gamma=args.lr_gamma)}[args.lr_scheduler]()
    if args.lr_warmup_epochs > 0:
        warm = (torch.optim.lr_scheduler.LinearLR if args.lr_warmup_method == "linear" else
                torch.optim.lr_scheduler.ConstantLR)(
            opt, args.lr_warmup_decay, total_iters=args.lr_warmup_epochs)
        main = torch.optim.lr_scheduler.SequentialLR(
            opt, schedulers=[warm, main], milestones=[args.lr_warmup_epochs])
    lrs = []
    for _ in range(epochs):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        main.step()
    return lrs


@pytest.mark.parametrize("warmup", [[], ["--lr-warmup-epochs", "3", "--lr-warmup-method",
                                         "linear", "--lr-warmup-decay", "0.033"],
                                    ["--lr-warmup-epochs", "2"]])
@pytest.mark.parametrize("main", [["--lr-scheduler", "cosineannealinglr", "--lr-min", "1e-4"],
                                  ["--lr-step-size", "4", "--lr-gamma", "0.5"],
                                  ["--lr-scheduler", "exponentiallr", "--lr-gamma", "0.9"]])
def test_schedules_give_torchvisions_lr_each_epoch(warmup, main):
    argv, epochs = ["--lr", "0.5", *main, *warmup], 12
    model = nn.Linear(2, 2)
    args = parse("--epochs", str(epochs), *argv)
    scheduler = lr_schedule(make_optimizer(model, **optimizer_kwargs(args, 16)),
                            **schedule_kwargs(args))
    ours = [scheduler.lr_lambdas[0](e) * 0.5 for e in range(epochs)]
    assert ours == pytest.approx(torchvision_lrs(argv, epochs), rel=1e-12, abs=1e-15)


def test_cosine_with_warmup_warms_then_falls_to_lrf():
    args = parse("--epochs", "10", "--lr-warmup-epochs", "2", "--lr-warmup-method", "linear",
                 "--lrf", "0.1", "--lr-warmup-decay", "0.1")
    scheduler = lr_schedule(make_optimizer(nn.Linear(2, 2), **optimizer_kwargs(args, 16)),
                            **schedule_kwargs(args))
    factors = [scheduler.lr_lambdas[0](e) for e in range(11)]
    assert factors[:3] == pytest.approx([0.1, 0.55, 1.0])
    assert factors[10] == pytest.approx(0.1) and factors[2:] == sorted(factors[2:], reverse=True)


def test_flags_that_follow_from_others():
    assert parse().lr_scheduler == "cosine" and parse().scale_lr  # the template's own
    mobilenet = parse("--opt", "rmsprop", "--lr-step-size", "2", "--lr-gamma", "0.973")
    assert (mobilenet.lr_scheduler, mobilenet.scale_lr) == ("steplr", False)
    assert parse("--lr-scheduler", "steplr", "--scale-lr").scale_lr
    assert parse("--lr-warmup-epochs", "1").scale_lr  # warmup alone: the template's own lr
    unset = dict.fromkeys(("opt", "lr_scheduler", "lr_step_size", "lr_gamma", "scale_lr"))
    assert resolve_recipe(**unset) == ({"opt": "sgd", "lr_scheduler": "cosine", "lr_step_size": 30,
                                        "lr_gamma": 0.1, "scale_lr": True}, {})
    assert resolve_recipe(**{**unset, "opt": "adamw"})[1] == {
        "val_resize_size": 256, "val_crop_size": 224}  # torchvision's, with its flags
    assert check_args(get_args_parser().parse_args(["--lr-gamma", "0.5"]), 1)[1][
        "val_crop_size"] == 224  # what main's run takes, unless given or continued
    assert parse("--lr-scheduler", "exponentiallr", "--lr-gamma", "0").lr_gamma == 0
    with pytest.raises(ConfigError, match="--lr-warmup-epochs 5 leaves no epoch of the 5"):
        parse("--epochs", "5", "--lr-warmup-epochs", "5")
    with pytest.raises(ConfigError, match="--decode workers"):
        get_transforms(32, "device", interpolation="bicubic")
    args = get_args_parser().parse_args(
        ["--wd", "0.1", "-b", "8", "-j", "2", "--test-only", "--train-crop-size", "176"])
    assert (args.weight_decay, args.batch_size, args.workers, args.eval_only, args.img_size) == \
           (0.1, 8, 2, True, 176)


def test_a_continued_run_refuses_another_optimizer_order_or_decay_groups():
    saved = vars(parse("--norm-weight-decay", "0"))
    refused, applied = flag_changes(saved, vparse(
        "--opt", "adamw", "--ra-sampler", "--ra-reps", "4", "--mixup-alpha", "0.2"))
    assert refused == ["no --norm-weight-decay (the run had 0.0)",
                       "--opt adamw (the run had sgd)", "--ra-reps 4 (the run had 3)",
                       "--ra-sampler (the run had --no-ra-sampler)"]
    assert applied == ["--mixup-alpha 0.2 (the run had 0.0)",  # and, as --opt asks:
                       "--no-scale-lr (the run had --scale-lr)"]  # torchvision's lr
    assert flag_changes(saved, vparse("--norm-weight-decay", "0.01")) == (
        [], ["--norm-weight-decay 0.01 (the run had 0.0)"])
    # A run saved before these flags existed trained with SGD and no groups.
    before = {k: v for k, v in saved.items() if k not in BEFORE_RECIPES}
    assert flag_changes(before, vparse("--opt", "adamw", "--scale-lr"))[0] == [
        "--opt adamw (the run had sgd)"]
    assert flag_changes(before, vparse("--norm-weight-decay", "0"))[0] == [
        "--norm-weight-decay 0.0 (the run had no --norm-weight-decay)"]
    assert flag_changes(before, vparse("--mixup-alpha", "0.2")) == (
        [], ["--mixup-alpha 0.2 (the run had 0.0)"])
    assert flag_changes(before, vparse()) == ([], [])  # its own command: nothing changed


def test_a_flag_that_changes_nothing_is_applied_not_refused():
    """--ra-reps while neither run uses --ra-sampler; a weight decay for a group the model has no
    trainable parameter for (the launcher passes ``inert_flags`` of its model)."""
    saved = vars(parse())
    assert flag_changes(saved, vparse("--ra-reps", "4")) == ([], ["--ra-reps 4 (the run had 3)"])
    assert flag_changes({**saved, "ra_sampler": True}, vparse("--ra-reps", "4"))[0] == [
        "--ra-reps 4 (the run had 3)", "--no-ra-sampler (the run had --ra-sampler)"]
    with torch.device("meta"):
        resnet, vit, alexnet = (torchvision.models.get_model(name)
                                for name in ("resnet18", "vit_b_16", "alexnet"))
    assert inert_flags(resnet) == ["transformer_embedding_decay"]
    assert inert_flags(alexnet) == ["norm_weight_decay", "transformer_embedding_decay"]
    assert inert_flags(vit) == []
    embedding = parse("--transformer-embedding-decay", "0")
    said = ["--transformer-embedding-decay 0.0 (the run had no --transformer-embedding-decay)"]
    assert flag_changes(saved, vars(embedding), inert=inert_flags(resnet)) == ([], said)
    assert flag_changes(saved, vars(embedding), inert=inert_flags(vit)) == (said, [])


def test_a_continued_or_evaluated_run_keeps_its_validation_sizes(tmp_path):
    """The sizes and interpolation the run validated with are its defaults, also under
    torchvision's flags, whose 256/224 only a new run takes; predict.py uses them too."""
    path = tmp_path / "checkpoint.pth"
    recorded = {"model": "resnet18", "img_size": 32, "val_resize_size": 40, "val_crop_size": 36,
                "interpolation": "bicubic"}
    torch.manual_seed(0)
    torch.save({"model": torchvision.models.resnet18(num_classes=3).state_dict(),
                "args": recorded, "classes": ["a", "b", "c"]}, path)
    for argv in ([], ["--eval-only"], ["--opt", "sgd", "--lr-scheduler", "cosineannealinglr"]):
        args, defaults = check_args(get_args_parser().parse_args([*argv, "--resume", str(path)]),
                                    1)
        assert run_flags(args, str(path), defaults, 1) == recorded, argv
    args, defaults = check_args(get_args_parser().parse_args(["--opt", "sgd"]), 1)  # a new run
    run = run_flags(args, None, {**defaults, "model": "resnet18", "img_size": 32}, 1)
    assert (run["val_resize_size"], run["val_crop_size"], run["interpolation"]) == (
        256, 224, "bilinear")  # torchvision's sizes
    preprocess = load_predictor(path)[2]
    assert (preprocess.transforms[0].size, preprocess.transforms[1].size) == ([40], (36, 36))
    assert preprocess.transforms[0].interpolation == v2.InterpolationMode.BICUBIC


def test_label_smoothing_is_cross_entropys_in_the_training_loss():
    torch.manual_seed(0)
    model, batch = nn.Linear(6, 4), (torch.randn(8, 6), torch.arange(8) % 4)
    losses = [train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.0), [batch],
                              torch.device("cpu"), 0, LoopOptions(label_smoothing=smoothing))
              for smoothing in (0.0, 0.1)]
    with torch.no_grad():
        expected = [nn.functional.cross_entropy(model(batch[0]), batch[1], label_smoothing=s)
                    for s in (0.0, 0.1)]
    assert losses == pytest.approx([e.item() for e in expected], rel=1e-6)
    assert losses[0] < losses[1]


# ---------------------------------------------------------------- mixup, cutmix, EMA, RA
def test_batch_mix_is_torchvisions_mixup_or_cutmix_drawn_from_seed_epoch_batch():
    args = parse("--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--seed", "3")
    mix = BatchMix.create(5, args.mixup_alpha, args.cutmix_alpha, seed=args.seed)  # as main
    images, labels = torch.rand(8, 3, 16, 16), torch.arange(8) % 5
    theirs = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=5),
                              v2.CutMix(alpha=1.0, num_classes=5)])
    outputs = []
    for epoch, batch in [(0, 0), (0, 1), (1, 0), (0, 0)]:
        state = torch.get_rng_state()
        out = mix(images, labels, epoch, batch)
        assert torch.equal(torch.get_rng_state(), state)  # the global generator untouched
        torch.manual_seed((((3 * 1_000_003 + epoch) * 1_000_003) * 1_000_003 + batch) % 2**63)
        expected = theirs(images, labels)
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
        outputs.append(out[1])
    assert torch.equal(outputs[0], outputs[3]) and not torch.equal(outputs[0], outputs[1])
    assert outputs[0].sum(1).allclose(torch.ones(8))
    unreadable = labels.clone()
    unreadable[2] = -100  # a black image: its share of a target is dropped, no host sync
    mixed = mix(images, unreadable, 0, 0)[1]
    assert torch.equal(mixed[[0, 1, 4, 5, 6, 7]], outputs[0][[0, 1, 4, 5, 6, 7]])
    assert torch.allclose(mixed[2:4].sum(1), 1 - outputs[0][2:4, 2])
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 5))  # the first batch: no error
    loss = train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           [(images, unreadable)], torch.device("cpu"), 0, mix=mix)
    assert math.isfinite(loss)
    assert BatchMix.create(5, 0.0, 0.0, seed=3) is None


def test_model_ema_follows_torchvisions_decay_and_update_rule():
    args = parse("--model-ema", "--model-ema-steps", "4", "--epochs", "10",
                 "--lr-warmup-epochs", "1", "--model-ema-decay", "0.999")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ema = ModelEma.create(model, **ema_kwargs(args, images_per_step=50))
    decay = 1 - min(1.0, (1 - 0.999) * 50 * 4 / 10)  # torchvision's adjustment: 0.98
    assert ema.every == 4 and decay == pytest.approx(0.98)
    theirs, n_averaged = [], 0
    for epoch, step in itertools.product(range(2), range(1, 9)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
        ema.after_step(model, epoch, step)
        if (step - 1) % 4 == 0:  # torchvision: at batch i % steps == 0, after its step
            current = list(itertools.chain(model.parameters(), model.buffers()))
            theirs = [c.detach().clone() if n_averaged == 0 else
                      (decay * t + (1 - decay) * c).to(t.dtype) for t, c in zip(theirs, current)]
            n_averaged = 0 if epoch < 1 else n_averaged + 1  # 0 while warming up: it copies
    assert int(ema.n_averaged) == n_averaged == 2
    ours = list(itertools.chain(ema.module.parameters(), ema.module.buffers()))
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    assert ModelEma.create(model, **ema_kwargs(parse(), 50)) is None


def test_model_ema_turned_on_for_a_continued_run_starts_from_its_weights(tmp_path):
    torch.manual_seed(0)
    model, args = nn.Linear(4, 3), parse("--model-ema", "--epochs", "2")
    optimizer = make_optimizer(model, **optimizer_kwargs(args, 16))
    weights, optimizer_state = whole_state(model, optimizer)
    ckpt = {"model": {k: v + 1 for k, v in weights.items()}, "optimizer": optimizer_state,
            "epoch": 0}  # saved without --model-ema
    torch.save(ckpt, tmp_path / "checkpoint.pth")
    ema = ModelEma.create(model, **ema_kwargs(args, 16))
    Checkpointer(tmp_path, {"model": ModelState(model), "model_ema": ema,
                            "optimizer": OptimizerState(model, optimizer)}).load(
        str(tmp_path / "checkpoint.pth"))
    assert_same_tensors(ema.module.state_dict(), model.state_dict())
    assert torch.equal(model.weight, ckpt["model"]["weight"]) and int(ema.n_averaged) == 0


def test_ra_sampler_order_is_torchvisions_and_each_copy_is_its_own_sample():
    dataset = list(range(512))
    for rank in range(2):
        sampler = ResumableSampler(dataset, 2, rank, seed=7, repeats=3)
        sampler.set_epoch(4)
        ours = list(sampler)
        assert [i % 512 for i in ours] == ra_sampler_indices(512, 2, rank, 7, 4, 3)
        assert len(sampler) == 256 and len(set(ours)) == len(ours)  # copies: i + k * 512
    # A stop after 40 samples of the epoch: the rest, as the uninterrupted epoch deals it.
    whole = [list(s) for s in [ResumableSampler(dataset, 2, r, seed=7, repeats=3)
                               for r in range(2)] if not s.set_epoch(4)]
    for rank in range(2):
        rest = ResumableSampler(dataset, 2, rank, seed=7, repeats=3)
        rest.set_epoch(4, skip=40)
        assert list(rest) == whole[rank][20:]


def test_ra_sampler_has_its_epochs_length_from_the_start_so_few_images_are_one_line(
        tmp_path, plain):
    """5 images, 2 ranks, 3 repeats: an epoch deals 5 // 2 = 2 samples a rank (not
    DistributedSampler's 3) before set_epoch too, so the launcher sees no batch of 3 is made."""
    for rank in range(2):
        sampler = ResumableSampler(list(range(5)), 2, rank, seed=7, repeats=3)
        first = list(sampler)
        sampler.set_epoch(0)
        assert len(sampler) == len(first) == 2 and first == list(sampler)
    for part, sizes in (("train", (3, 2)), ("val", (1, 1))):  # ImageNet's layout
        for cls, n in zip("ab", sizes):
            make_class(tmp_path / "data" / part / cls, n, 0)
    res = ranks(plain, 2, LAUNCH, *flags(tmp_path / "data", tmp_path / "out", "--batch-size", "3",
                                         "--ra-sampler", "--ra-reps", "3"))
    assert_user_error(res, "error: 5 training images make no batch of 3 for each of 2 "
                           "process(es); lower --batch-size.")


# ---------------------------------------------------------------- augmentation and layout
@pytest.mark.parametrize("policy,kind", [("ta_wide", v2.TrivialAugmentWide),
                                         ("ra", v2.RandAugment), ("augmix", v2.AugMix),
                                         ("imagenet", v2.AutoAugment)])
def test_auto_augment_random_erase_and_val_sizes(policy, kind):
    t = get_transforms(32, auto_augment=policy, random_erase=0.25, interpolation="bicubic",
                       val_resize_size=40, val_crop_size=36, ra_magnitude=5, augmix_severity=4)
    steps = t["train"].transforms
    assert steps[0].interpolation == v2.InterpolationMode.BICUBIC
    # The policies' warps on tensors have no bicubic: bilinear there.
    assert isinstance(steps[2], kind) and steps[2].interpolation == v2.InterpolationMode.BILINEAR
    assert getattr(steps[2], {"ra": "magnitude", "augmix": "severity"}.get(policy, ""), 0) in (
        {"ra": 5, "augmix": 4}.get(policy, 0),)
    assert steps[3].p == 0.25 and steps[3].value == [124.0, 116.0, 104.0]  # the mean colour
    image = torch.randint(0, 256, (3, 50, 60), dtype=torch.uint8)
    assert t["train"](image).shape == (3, 32, 32) and t["val"](image).shape == (3, 36, 36)
    assert t["val"].transforms[0].size == [40]
    plain = get_transforms(32)["train"].transforms
    assert len(plain) == 2  # the template's own: crop and flip


def test_imagenet_layout_reads_train_and_val(tmp_path):
    for part in ("train", "val"):
        (tmp_path / "in" / part / "n01440764").mkdir(parents=True)
    (tmp_path / "flat" / "train").mkdir(parents=True)  # classes "train" and "val": not it
    (tmp_path / "flat" / "val").mkdir()
    d = str(tmp_path / "in")
    assert imagenet_layout(d, None) == (f"{d}/train", f"{d}/val")
    assert imagenet_layout(d, None, eval_only=True) == (None, f"{d}/val")  # the val folder alone
    for given in [(str(tmp_path / "flat"), None), (d, "v"), (None, "v")]:
        assert imagenet_layout(*given) == given


LOOSE = "ILSVRC2012_val_00000001.JPEG"
UNLIKE = ("{d}/train holds class folders, so {d}/val must hold the same ones and no image beside "
          "them; sort its images so, or give --data-path {d}/train (which holds out --val-rate of "
          "it) and --val-path FOLDER.")


@pytest.mark.parametrize("val", [[LOOSE], ["n01", "n02", LOOSE], ["n01"], ["n01", "n02", "n03"]],
                         ids=["flat", "half sorted", "lacking a class", "with another class"])
def test_imagenet_layout_refuses_a_flat_val_or_one_of_other_classes(tmp_path, val):
    d = tmp_path / "in"
    for name in ("n01", "n02"):
        (d / "train" / name).mkdir(parents=True)
    (d / "val").mkdir()
    for name in val:
        if name == LOOSE:
            (d / "val" / name).touch()
        else:
            (d / "val" / name).mkdir()
    (d / "val" / "LOC_val_solution.csv").touch()  # the labels: no image
    for eval_only in (False, True):  # --eval-only --data-path D reads D/val alone
        with pytest.raises(DataError) as err:
            imagenet_layout(str(d), None, eval_only=eval_only)
        assert str(err.value) == UNLIKE.format(d=d)


def test_imagenet_layout_needs_val_and_ignores_hidden_files(tmp_path):
    """train/ of class folders beside valid/ (not val/): one line, not a model of "train"
    against "valid"; a hidden file in val/ (macOS's ``._`` metadata) is not a loose image."""
    d = tmp_path / "in"
    for name in ("n01", "n02"):
        (d / "train" / name).mkdir(parents=True)
        (d / "valid" / name).mkdir(parents=True)
    with pytest.raises(DataError, match=f"^{re.escape(UNLIKE.format(d=d))}$"):
        imagenet_layout(str(d), None)
    (d / "valid").rename(d / "val")
    (d / "val" / "._ILSVRC2012_val_00000001.JPEG").touch()
    assert imagenet_layout(str(d), None) == (str(d / "train"), str(d / "val"))


def test_a_flat_val_folder_is_one_line_not_a_model_of_train_against_val(tmp_path, plain):
    for cls in ("n01", "n02"):
        make_class(tmp_path / "in" / "train" / cls, 2, 0)
    make_class(tmp_path / "in" / "val", 2, 1)  # 00.jpg, 01.jpg: no class folder
    res = plain(flags(tmp_path / "in", tmp_path / "out", "--epochs", "1"))
    assert_user_error(res, f"error: {tmp_path / 'in' / 'train'} holds class folders, so "
                           f"{tmp_path / 'in' / 'val'} must hold the same ones")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- launched: stopped, continued
# torchvision's ResNet50 v2 command, scaled down (32 px, 2 epochs, an EMA update each step).
RESNET50_V2 = ["--lr", "0.05", "--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "1",
               "--lr-warmup-method", "linear", "--auto-augment", "ta_wide", "--epochs", "2",
               "--random-erase", "0.1", "--weight-decay", "0.00002", "--norm-weight-decay", "0.0",
               "--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
               "--train-crop-size", "32", "--model-ema", "--model-ema-steps", "1",
               "--val-resize-size", "36", "--val-crop-size", "32", "--ra-sampler", "--ra-reps",
               "4"]


@pytest.mark.fast
def test_mobilenet_under_the_resnet50_v2_recipe_stopped_ends_bitwise_as_never_stopped(
        tiny_data, tmp_path, plain):
    """mobilenet_v3_small (dropout, BatchNorm) by name, 2 processes, every recipe piece on: a run
    stopped in the epoch after warmup and continued by the same command ends with the weights,
    momentum and EMA (n_averaged too) of the run never stopped. The exported weights, the
    EMA's too, load into torchvision's own model."""
    def launch(out, **stop):  # the stopper runs the script after it
        argv = flags(tiny_data, out, "--model", "mobilenet_v3_small", *RESNET50_V2)
        return ranks(plain, 2, *([make_stopper(tmp_path)] if stop else []), LAUNCH, *argv,
                     **stop)

    reference = launch(tmp_path / "ref")
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "run"
    res = launch(out, STOP_AFTER="8")  # after the warmup epoch's 6 steps
    assert res.returncode != 0 and "interrupted by SIGTERM" in res.stderr, res.stderr[-3000:]
    part = load_ckpt(out / "checkpoint.pth")
    assert part["epoch"] == 1 and 2 <= part["in_epoch"]["batches"] < 6, part["in_epoch"]
    assert int(part["model_ema"]["n_averaged"]) == part["in_epoch"]["batches"]
    res = launch(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not scaled with the world size" in res.stderr
    assert_same_run(out, tmp_path / "ref")
    done, ref = (load_ckpt(p / "checkpoint.pth") for p in (out, tmp_path / "ref"))
    assert_same_tensors(done["model_ema"], ref["model_ema"])
    assert int(done["model_ema"]["n_averaged"]) > 1  # updated after the warmup epoch
    metrics = read_metrics(out)
    assert [set(m) >= {"ema_val_acc", "ema_val_loss", "ema_val_top5"} for m in metrics] == \
           [True, True]
    for name in ("model-1.pth", "model_ema-1.pth"):
        model = torchvision.models.get_model("mobilenet_v3_small", num_classes=5)
        model.load_state_dict(torch.load(out / "weights" / name, weights_only=True))


def test_weights_by_name_come_from_the_hub_cache_and_freeze_layers_trains_the_classifier(
        tiny_data, tmp_path, plain):
    """--weights MobileNet_V3_Small_Weights.DEFAULT from a planted $TORCH_HOME cache (nothing
    downloads) with --freeze-layers: after training the features are the file's and only the
    classifier moved. Without the file and the network: one error line naming the file and the
    folder to put it in, at once; a damaged file, one line naming it."""
    name = torchvision.models.MobileNet_V3_Small_Weights.DEFAULT.url.rsplit("/", 1)[-1]
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.manual_seed(1)
    planted = torchvision.models.mobilenet_v3_small(num_classes=1000).state_dict()
    torch.save(planted, cache / name)
    argv = flags(tiny_data, tmp_path / "run", "--model", "mobilenet_v3_small", "--epochs", "1",
                 "--weights", "MobileNet_V3_Small_Weights.DEFAULT", "--freeze-layers")
    res = plain(argv, TORCH_HOME=str(tmp_path / "torch"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--freeze-layers: training only classifier" in res.stderr
    final = load_ckpt(tmp_path / "run" / "checkpoint.pth")["model"]
    assert_same_tensors({k: v for k, v in final.items() if k.startswith("features.")},
                        {k: v for k, v in planted.items() if k.startswith("features.")})
    assert not torch.equal(final["classifier.0.weight"], planted["classifier.0.weight"])
    assert final["classifier.3.weight"].shape == (5, 1024)  # the data's classes, new

    offline = {k: "http://127.0.0.1:9" for k in ("https_proxy", "HTTPS_PROXY", "http_proxy")}
    started = time.monotonic()
    res = plain([*argv, "--output-dir", str(tmp_path / "offline")],
                TORCH_HOME=str(tmp_path / "empty"), **offline)
    assert_user_error(res, name, str(tmp_path / "empty" / "hub" / "checkpoints"))
    assert time.monotonic() - started < 20
    (cache / name).write_bytes(b"<html>sign in</html>")  # a proxy's page saved as the file
    res = plain([*argv, "--output-dir", str(tmp_path / "damaged")],
                TORCH_HOME=str(tmp_path / "torch"), **offline)
    assert_user_error(res, f"cannot load {cache / name} (UnpicklingError: invalid load key, "
                      "'<'.); put a copy of")


def test_every_command_of_recipes_md_parses_and_builds_its_model_here():
    """torchvision's published commands, as docs/recipes.md gives them, run unchanged: every
    flag parses with its meaning, and the model takes the crops (on the meta device)."""
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    commands = re.findall(r"^\$L (.*?)(?<!\\)$", text.replace("\\\n", " "), re.M)
    assert len(commands) == 4, commands
    for command in commands:  # run_flags builds the model at both crop sizes, and trains
        args, defaults = check_args(get_args_parser().parse_args(shlex.split(command)), 8)
        assert not args.scale_lr and args.opt in ("sgd", "rmsprop", "adamw")
        assert defaults["val_crop_size"] == 224
        run_flags(args, None, defaults, 8)


def test_vit_weights_by_name_set_the_crop_size_they_were_trained_at():
    """ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1 is torchvision's vit_b_16 at 384 px: --img-size
    defaults to 384 (the model is built for it); another size is one line."""
    def complete(*argv: str) -> dict:
        args, defaults = check_args(get_args_parser().parse_args(
            ["--model", "vit_b_16", "--weights", "ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1",
             *argv]), 1)
        return run_flags(args, None, defaults, 1)

    assert complete()["img_size"] == 384
    assert complete("--img-size", "384", "--val-crop-size", "384")["img_size"] == 384
    with pytest.raises(ConfigError, match=r"^--weights ViT_B_16_Weights\.IMAGENET1K_SWAG_E2E_V1 "
                       r"is for 384 px crops \(its position embeddings fit that size alone\); "
                       r"use --img-size 384\.$"):
        complete("--img-size", "224")
    with pytest.raises(ConfigError, match=r"^--model vit_b_16 cannot take --val-crop-size 224 "
                       r"crops \(Wrong image height! Expected 384 but got 224!\); use 384\.$"):
        complete("--val-crop-size", "224")
