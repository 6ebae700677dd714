"""Distributed training computes what one process would, on CPU with gloo.

Each claim is checked against a plain single-process computation done here in the test:

- ``evaluate`` is exact for any world size, although ``DistributedSampler`` pads with repeats;
- ``SyncBatchNormCPU`` on split batches equals ``nn.BatchNorm2d`` on the whole batch, in forward,
  backward and running statistics (and per-rank BatchNorm does not);
- one DDP step on 2 x B samples equals one step on the 2B samples in one process, also with
  gradient accumulation and gradient compression (to its precision);
- all ranks hold the same weights after DDP construction and after ``train_one_epoch``;
- ``reduce_value``, ``run_on_main`` and the loss ``train_one_epoch`` returns, and how few
  collectives it uses; a non-finite loss stops every rank;
- ``format_report`` prints what ``--eval-only`` shows.

Multi-rank checks fork 2-3 workers with a gloo group (``dist_helpers.run_ranks``).
"""

from __future__ import annotations

import copy
import logging
import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from dist_helpers import flat_state, run_ranks
from model import get_model
from multi_train_utils.distributed_utils import (all_gather_object, all_ranks_ok,
                                                 broadcast_object, cleanup,
                                                 init_distributed_mode, reduce_value,
                                                 register_comm_hook, run_on_main)
from multi_train_utils.guard import ConfigError, UserError
from multi_train_utils.sync_batchnorm import SyncBatchNormCPU, convert_sync_batchnorm
from multi_train_utils.train_eval_utils import (IMAGENET_MEAN, IMAGENET_STD, EvalResult,
                                                LoopOptions, _norm_constants, evaluate,
                                                format_report, prepare_images, resolve_amp_dtype,
                                                train_one_epoch)

CPU = torch.device("cpu")
NUM_CLASSES = 7  # >= 5, so top-5 is not trivially every class


def tiny_net(num_classes: int = NUM_CLASSES, *, bn: bool = True, dtype: torch.dtype = torch.float32,
             seed: int | None = 0) -> nn.Sequential:
    """``(N, 3, H, W) -> (N, num_classes)``: conv, optional BatchNorm, ReLU, pool, linear."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Conv2d(3, 6, 3, padding=1)]
        if bn:
            layers.append(nn.BatchNorm2d(6))
        layers += [nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, num_classes)]
        return nn.Sequential(*layers).to(dtype)


def _tols(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-6, atol=1e-8) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ 1. exact evaluation
VAL_SIZE = 11
EVAL_BATCH = 5  # divides none of the per-rank shares: 11 (1 rank), 6 (2 ranks), 4 (3 ranks)


@pytest.fixture(scope="module")
def eval_case():
    """A fixed eval-mode model and 11 samples whose labels are, in turn, the model's top-1
    class, its 3rd-best class (a top-5 but not top-1 hit) and its worst class (a miss)."""
    model = tiny_net()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-default BN statistics: eval mode must really use them
        model[1].running_mean.copy_(torch.randn(6, generator=gen) * 0.3)
        model[1].running_var.copy_(torch.rand(6, generator=gen) + 0.5)
    model.eval()
    images = torch.randn(VAL_SIZE, 3, 8, 8, generator=gen)
    with torch.no_grad():
        ranked = model(images).argsort(dim=1, descending=True)
    labels = torch.stack([ranked[i, (0, 2, NUM_CLASSES - 1)[i % 3]] for i in range(VAL_SIZE)])
    return model, images, labels


def reference_eval(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """The obvious loop: one sample at a time, one process."""
    correct = top5 = 0
    losses = []
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long)
    with torch.no_grad():
        for x, y in zip(images, labels):
            logits = model(x[None])[0]
            pred = int(logits.argmax())
            correct += pred == int(y)
            top5 += int(y) in logits.topk(5).indices.tolist()
            losses.append(F.cross_entropy(logits[None], y[None]).item())
            confusion[int(y), pred] += 1
    return dict(correct=correct, top5=top5, num_samples=len(labels),
                loss=sum(losses) / len(losses), confusion=confusion)


def _summary(result) -> dict:
    return dict(correct=int(result), top5=result.top5_correct, num_samples=result.num_samples,
                loss=result.loss, confusion=result.confusion)


def _eval_worker(rank: int, world: int, model: nn.Module, images: torch.Tensor,
                 labels: torch.Tensor) -> dict:
    dataset = TensorDataset(images, labels)
    out = {}
    for shuffle in (False, True):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle,
                                     seed=3)
        sampler.set_epoch(5)
        loader = DataLoader(dataset, batch_size=EVAL_BATCH, sampler=sampler)
        out[f"shuffle={shuffle}"] = _summary(evaluate(model, loader, CPU))
    return out


@pytest.mark.parametrize("classes, top5", [(4, None), (5, None), (6, 0.5)])
def test_top5_is_reported_only_where_it_can_miss(classes, top5):
    result = EvalResult(1, top5_correct=2, num_samples=4, loss_sum=1.0,
                        confusion=torch.zeros(classes, classes, dtype=torch.long))
    assert result.top5 == top5 and result.top1 == 0.25


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_evaluate_is_exact_for_any_world_size(world_size, eval_case, tmp_path):
    model, images, labels = eval_case
    ref = reference_eval(model, images, labels)
    assert (ref["correct"], ref["top5"]) == (4, 8)  # the fixture makes every count matter

    if world_size == 1:  # no process group at all, with and without a sampler
        per_rank = [_eval_worker(0, 1, model, images, labels)]
        plain = DataLoader(TensorDataset(images, labels), batch_size=EVAL_BATCH)
        per_rank[0]["no sampler"] = _summary(evaluate(model, plain, CPU))
    else:
        per_rank = run_ranks(_eval_worker, world_size, tmp_path, model, images, labels)

    for rank, results in enumerate(per_rank):
        for mode, got in results.items():
            where = f"rank {rank}, {mode}"
            assert got["num_samples"] == VAL_SIZE, where  # padded repeats are not counted
            assert got["correct"] == ref["correct"], where
            assert got["top5"] == ref["top5"], where
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), where
            assert int(got["confusion"].sum()) == VAL_SIZE, where
            assert torch.equal(got["confusion"], ref["confusion"]), where


# ------------------------------------------------------------------ 2. SyncBatchNormCPU
BN_CHANNELS = 3


def _bn_init(dtype: torch.dtype, momentum: float | None, track: bool = True) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(BN_CHANNELS, momentum=momentum, track_running_stats=track)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        if track:
            bn.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0]))
            bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.0]))
    return bn.to(dtype)


def _bn_batches(sizes: tuple[int, int], dtype: torch.dtype) -> tuple[list, list]:
    """Two iterations of (inputs, upstream gradients) over the whole batch ``sum(sizes)``.

    The inputs have a mean far from 0 (float32 cancellation would show) and the second rank's
    samples are shifted further, so per-rank statistics differ clearly from the global ones.
    """
    gen = torch.Generator().manual_seed(7)
    n = sum(sizes)
    xs, grads = [], []
    for _ in range(2):
        x = torch.randn(n, BN_CHANNELS, 4, 4, generator=gen, dtype=torch.float64) * 2 + 3
        x[sizes[0]:] += 1.5
        xs.append(x.to(dtype))
        grad = torch.randn(n, BN_CHANNELS, 4, 4, generator=gen, dtype=torch.float64)
        grads.append(grad.to(dtype))
    return xs, grads


def _syncbn_worker(rank: int, world: int, sizes: tuple[int, int], xs: list, grads: list,
                   bn_init: nn.BatchNorm2d, skew: float = 0.0) -> dict:
    lo = sum(sizes[:rank])
    part = slice(lo, lo + sizes[rank])
    sync = SyncBatchNormCPU.convert_sync_batchnorm(copy.deepcopy(bn_init))
    if rank == 1 and skew:  # buffers not broadcast (DDP(broadcast_buffers=False), no DDP)
        with torch.no_grad():
            sync.running_mean += skew
    plain = copy.deepcopy(bn_init)
    steps = []
    for x_full, g_full in zip(xs, grads):
        x = x_full[part].clone().requires_grad_(True)
        out = sync(x)
        # The objective is the sum of every rank's loss: SyncBN's backward all-reduces the
        # statistics' gradients, so x.grad is d(total)/dx; each rank's weight/bias gradient is its
        # own share, and their sum (what DDP all-reduces) is the full-batch gradient.
        loss = (out * g_full[part]).sum()
        loss.backward()
        summed = [loss.detach().clone(), sync.weight.grad.clone(), sync.bias.grad.clone()]
        for tensor in summed:
            dist.all_reduce(tensor)
        sync.zero_grad(set_to_none=True)
        with torch.no_grad():
            plain_out = plain(x_full[part])
        steps.append(dict(out=out.detach(), x_grad=x.grad, loss=summed[0], weight_grad=summed[1],
                          bias_grad=summed[2], plain_out=plain_out))
    return dict(steps=steps, state=sync.state_dict(), plain_state=plain.state_dict())


@pytest.mark.parametrize("sizes,dtype,momentum,track", [
    ((4, 4), torch.float64, 0.1, True),
    ((3, 5), torch.float64, None, True),  # unequal shares; cumulative running average
    ((3, 5), torch.float32, 0.1, True),
    ((3, 5), torch.float32, 0.1, False),  # batch statistics only: no running mean to shift by
], ids=["equal-f64", "unequal-f64-cumulative", "unequal-f32", "unequal-f32-no-running-stats"])
def test_sync_batchnorm_cpu_equals_full_batch_batchnorm(sizes, dtype, momentum, track, tmp_path):
    xs, grads = _bn_batches(sizes, dtype)
    bn_init = _bn_init(dtype, momentum, track)
    per_rank = run_ranks(_syncbn_worker, 2, tmp_path, sizes, xs, grads, bn_init)

    ref = copy.deepcopy(bn_init)
    ref_steps = []
    for x_full, g_full in zip(xs, grads):
        x = x_full.clone().requires_grad_(True)
        out = ref(x)
        loss = (out * g_full).sum()
        loss.backward()
        ref_steps.append(dict(out=out.detach(), x_grad=x.grad, loss=loss.detach(),
                              weight_grad=ref.weight.grad.clone(), bias_grad=ref.bias.grad.clone()))
        ref.zero_grad(set_to_none=True)

    tol = _tols(dtype)
    for rank, got in enumerate(per_rank):
        part = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        for it, (step, want) in enumerate(zip(got["steps"], ref_steps)):
            msg = f"rank {rank}, iteration {it}"
            torch.testing.assert_close(step["out"], want["out"][part], **tol, msg=msg)
            torch.testing.assert_close(step["x_grad"], want["x_grad"][part], **tol, msg=msg)
            for key in ("loss", "weight_grad", "bias_grad"):
                torch.testing.assert_close(step[key], want[key], **tol, msg=f"{msg}: {key}")
        # Without the switch each rank normalises by its own half: visibly different numbers.
        plain_gap = (got["steps"][-1]["plain_out"] - ref_steps[-1]["out"][part]).abs().max()
        assert plain_gap > 0.05, f"rank {rank}: per-rank BN unexpectedly matches ({plain_gap})"
        if not track:
            assert got["state"].keys() == ref.state_dict().keys() == {"weight", "bias"}
            continue
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(got["state"][key], ref.state_dict()[key], **tol)
        assert int(got["state"]["num_batches_tracked"]) == 2
        mean_gap = (got["plain_state"]["running_mean"] - ref.running_mean).abs().max()
        assert mean_gap > 0.01, f"rank {rank}: per-rank running_mean matches ({mean_gap})"


def test_sync_batchnorm_cpu_does_not_need_the_ranks_running_means_to_agree(tmp_path):
    """The statistics were sums around each rank's running mean, which must then be the same on
    every rank: off by 5 on one rank, the output was off by 0.75 from the full-batch BatchNorm."""
    sizes, dtype = (3, 5), torch.float32
    xs, grads = _bn_batches(sizes, dtype)
    bn_init = _bn_init(dtype, 0.1)
    ref = copy.deepcopy(bn_init)
    per_rank = run_ranks(_syncbn_worker, 2, tmp_path, sizes, xs, grads, bn_init, 5.0)
    for it, (x_full, g_full) in enumerate(zip(xs, grads)):
        x = x_full.clone().requires_grad_(True)
        out = ref(x)
        (out * g_full).sum().backward()
        for rank, got in enumerate(per_rank):
            part = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
            step = got["steps"][it]
            torch.testing.assert_close(step["out"], out.detach()[part], **_tols(dtype))
            torch.testing.assert_close(step["x_grad"], x.grad[part], **_tols(dtype))
        torch.testing.assert_close(per_rank[0]["steps"][it]["weight_grad"], ref.weight.grad,
                                   **_tols(dtype))
        ref.zero_grad(set_to_none=True)


def _syncbn_bf16_worker(rank: int, world: int, x_full: torch.Tensor) -> dict:
    half = x_full.shape[0] // world
    sync = SyncBatchNormCPU(BN_CHANNELS)
    out = sync(x_full[rank * half:(rank + 1) * half])
    return dict(out=out, state=sync.state_dict())


def test_sync_batchnorm_cpu_keeps_float32_statistics_for_bf16_input(tmp_path):
    """Under --amp the convolutions hand BatchNorm bf16 tensors. Sums (and the count: 7x112x112
    = 87808 is 88064 in bf16) must be taken in float32, as torch's BatchNorm does: with a channel
    mean of 10 and std 0.5, bf16 sums cancel to garbage (differences of hundreds)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(14, BN_CHANNELS, 112, 112, generator=gen) * 0.5 + 10).to(torch.bfloat16)
    per_rank = run_ranks(_syncbn_bf16_worker, 2, tmp_path, x)
    ref = nn.BatchNorm2d(BN_CHANNELS)
    want = ref(x.float())  # float32 BatchNorm on the same bf16 values, whole batch
    for rank, got in enumerate(per_rank):
        assert got["out"].dtype == torch.bfloat16
        # bf16 holds ~3 significant digits: the output may differ by its own rounding, no more.
        torch.testing.assert_close(got["out"].float(), want[rank * 7:(rank + 1) * 7],
                                   rtol=1e-2, atol=2e-2)
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(got["state"][key], ref.state_dict()[key], rtol=1e-4,
                                       atol=1e-5)


def test_sync_batchnorm_cpu_is_exact_from_the_first_step_when_the_mean_dwarfs_the_spread(
        tmp_path):
    """Sums around a fresh running mean (0) of float32 values near 1000 with spread 0.1 cancel:
    the first step's output was off by 108. Each rank's own batch mean as the shift is as
    exact as torch's float32 BatchNorm."""
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(16, BN_CHANNELS, 8, 8, generator=gen, dtype=torch.float64) * 0.1 + 1000
    want = nn.BatchNorm2d(BN_CHANNELS).double()(x64)
    per_rank = run_ranks(_syncbn_bf16_worker, 2, tmp_path, x64.float())  # halves of 8
    got = torch.cat([r["out"] for r in per_rank]).double()
    torch_error = (nn.BatchNorm2d(BN_CHANNELS)(x64.float()).double() - want).abs().max()
    assert (got - want).abs().max() < 2 * torch_error + 1e-4


def _syncbn_constant_worker(rank: int, world: int, x_full: torch.Tensor) -> dict:
    sync = SyncBatchNormCPU(BN_CHANNELS)
    outs = [sync(x_full[rank::world]) for _ in range(3)]  # the running stats move off 0 and 1
    return dict(outs=outs, state=sync.state_dict())


def test_sync_batchnorm_cpu_gives_zeros_not_nan_for_constant_channels(tmp_path):
    """A batch of identical (or blank) images makes channels constant: variance 0, which the
    float32 sums around the running mean cancel to below -eps (NaN from rsqrt; a whole run
    then stopped as "non-finite training loss ... lower the learning rate")."""
    gen = torch.Generator().manual_seed(5)
    levels = torch.randn(1, BN_CHANNELS, 1, 1, generator=gen) * 1000
    x = levels.expand(8, BN_CHANNELS, 6, 6).contiguous()
    ref = nn.BatchNorm2d(BN_CHANNELS)
    for _ in range(3):
        want = ref(x)
    assert want.abs().max() < 0.05  # torch's BatchNorm: zeros, to float32 rounding
    for got in run_ranks(_syncbn_constant_worker, 2, tmp_path, x):
        for out in got["outs"]:
            assert out.isfinite().all()
            torch.testing.assert_close(out, torch.zeros_like(out), rtol=0, atol=0.05)
        assert (got["state"]["running_var"] >= 0).all()
        torch.testing.assert_close(got["state"]["running_mean"], ref.running_mean, rtol=1e-4,
                                   atol=1e-3)


def _compiled_syncbn_worker(rank: int, world: int, net: nn.Module, x: torch.Tensor) -> dict:
    torch._dynamo.reset()
    grads = []
    for compile_it in (False, True):
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(net))
        # aot_eager builds the joint forward/backward graph that held running_mean, without
        # inductor's code generation (15 s more on 2 cores); it caught that bug too.
        run = torch.compile(model, backend="aot_eager") if compile_it else model
        for _ in range(2):  # the second step meets the running stats the first one updated
            run(x[rank * 4:(rank + 1) * 4]).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return dict(eager=grads[0], compiled=grads[1])


def test_sync_batchnorm_cpu_trains_under_torch_compile(tmp_path):
    """--compile --syncBN on CPU: the graph kept running_mean for the backward, then the
    in-place running-stats update broke it ("modified by an inplace operation")."""
    torch.manual_seed(0)
    net = SyncBatchNormCPU.convert_sync_batchnorm(nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)))
    x = torch.randn(8, 3, 8, 8) + 3
    for got in run_ranks(_compiled_syncbn_worker, 2, tmp_path, net, x):
        for compiled, eager in zip(got["compiled"], got["eager"]):
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)


def test_sync_batchnorm_cpu_without_process_group_is_batchnorm():
    assert not dist.is_initialized()
    ref = _bn_init(torch.float64, 0.1)
    sync = SyncBatchNormCPU.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(sync, SyncBatchNormCPU)
    xs, grads = _bn_batches((3, 5), torch.float64)
    for x_full, g_full in zip(xs, grads):
        outs, x_grads = [], []
        for module in (ref, sync):
            x = x_full.clone().requires_grad_(True)
            out = module(x)
            (out * g_full).sum().backward()
            outs.append(out.detach())
            x_grads.append(x.grad)
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(x_grads[1], x_grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(sync.bias.grad, ref.bias.grad, rtol=0, atol=1e-12)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(sync.state_dict()[key], value, rtol=0, atol=1e-12)
    ref.eval()
    sync.eval()
    torch.testing.assert_close(sync(xs[0]), ref(xs[0]), rtol=0, atol=1e-12)


def test_convert_sync_batchnorm_on_cpu_converts_every_resnet18_bn():
    model = get_model("resnet18", num_classes=5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    model.eval()
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert n_bn == 20
    params_before = [id(p) for p in model.parameters()]
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with torch.no_grad():
        out_before = model(x)

    converted = convert_sync_batchnorm(model, CPU)
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == n_bn and all(type(m) is SyncBatchNormCPU for m in norms)
    assert not any(m.training for m in norms)
    assert [id(p) for p in converted.parameters()] == params_before  # same Parameter objects
    state_after = converted.state_dict()
    assert list(state_after) == list(state_before)
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    with torch.no_grad():
        torch.testing.assert_close(converted(x), out_before, rtol=0, atol=0)


# ------------------------------------------------------------------ 3. gradient averaging
PER_RANK = 4


def _ddp_step_worker(rank: int, world: int, model: nn.Module, xs: list, ys: list) -> dict:
    model = SyncBatchNormCPU.convert_sync_batchnorm(copy.deepcopy(model))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for x, y in zip(xs, ys):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x[part]), y[part]).backward()  # mean over this rank's B samples
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("bn", [False, True], ids=["no-bn", "sync-bn"])
def test_ddp_step_equals_single_process_step_on_the_union(bn, tmp_path):
    model = tiny_net(5, bn=bn, dtype=torch.float64, seed=2)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2 * PER_RANK, 3, 6, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randint(0, 5, (2 * PER_RANK,), generator=gen) for _ in range(2)]
    per_rank = run_ranks(_ddp_step_worker, 2, tmp_path, model, xs, ys)

    ref = copy.deepcopy(model)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for x, y in zip(xs, ys):  # two steps, so SGD's momentum buffer matters too
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()  # mean over all 2B samples
        optimizer.step()

    initial = model.state_dict()
    for rank, state in enumerate(per_rank):
        assert list(state) == list(ref.state_dict())
        for key, want in ref.state_dict().items():
            torch.testing.assert_close(state[key], want, rtol=1e-7, atol=1e-9,
                                       msg=f"rank {rank}: {key}")
    assert not torch.allclose(ref[0].weight, initial["0.weight"])  # the step moved something


ACCUM_STEPS, ACCUM_K = 7, 3  # optimizer steps after micro-batches 3, 6 and 7: groups 3, 3, 1


def _grad_accum_worker(rank: int, world: int, model: nn.Module, images: torch.Tensor,
                       labels: torch.Tensor) -> dict:
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=PER_RANK, sampler=sampler)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_one_epoch(ddp, optimizer, loader, CPU, 0, LoopOptions(grad_accum_steps=ACCUM_K))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_grad_accumulation_steps_on_the_mean_gradient_of_each_group(tmp_path):
    """K=3 over 7 micro-batches: each step uses the mean gradient of its group, including the
    last, shorter group of one (divided by 1, not by K)."""
    model = tiny_net(5, bn=False, dtype=torch.float64, seed=7)
    gen = torch.Generator().manual_seed(8)
    n = 2 * PER_RANK * ACCUM_STEPS
    images = torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (n,), generator=gen)
    per_rank = run_ranks(_grad_accum_worker, 2, tmp_path, copy.deepcopy(model), images, labels)

    # DistributedSampler(shuffle=False) deals round-robin; micro-batch s of rank r holds
    # indices r::2 [s*B:(s+1)*B]. One process, one step per group on the group's union.
    ref = copy.deepcopy(model)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.5)
    share = [list(range(n))[r::2] for r in range(2)]
    for start in range(0, ACCUM_STEPS, ACCUM_K):
        group = range(start, min(start + ACCUM_K, ACCUM_STEPS))
        idx = [i for s in group for r in range(2)
               for i in share[r][s * PER_RANK:(s + 1) * PER_RANK]]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ref(images[idx]), labels[idx]).backward()
        optimizer.step()

    for rank, state in enumerate(per_rank):
        for key, want in ref.state_dict().items():
            torch.testing.assert_close(state[key], want, rtol=1e-7, atol=1e-9,
                                       msg=f"rank {rank}: {key}")


def _comm_hook_worker(rank: int, world: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      hook: str) -> list[torch.Tensor]:
    ddp = DDP(copy.deepcopy(model))
    register_comm_hook(ddp, hook)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    F.cross_entropy(ddp(x[part]), y[part]).backward()
    return [p.grad.clone() for p in ddp.parameters()]


# Unit roundoff of a 16-bit cast: bf16 keeps 8 significant bits, fp16 11.
ROUNDOFF = {"none": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("hook", ["none", "bf16", "fp16"])
def test_comm_hook_all_reduces_the_mean_gradient_at_its_precision(hook, tmp_path):
    model = tiny_net(5, bn=False, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2 * PER_RANK, 3, 6, 6, generator=gen)
    y = torch.randint(0, 5, (2 * PER_RANK,), generator=gen)
    per_rank = run_ranks(_comm_hook_worker, 2, tmp_path, model, x, y, hook)

    exact = _grads(model, x, y)  # the mean over all 2B samples, in fp32
    halves = [_grads(model, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
              for r in range(2)]
    u = ROUNDOFF[hook]
    for a, b in zip(*per_rank):
        assert torch.equal(a, b)  # every rank holds the same averaged gradient
    worst = 0.0
    for got, want, g0, g1 in zip(per_rank[0], exact, *halves):
        # Each rank's g/2 is rounded once, their sum once more: |error| <= u(|g0|+|g1|)/2 + u|sum|.
        bound = u * (g0.abs() + g1.abs()) / 2 + u * want.abs() + 1e-6
        assert torch.all((got - want).abs() <= bound), hook
        worst = max(worst, ((got - want).abs() / (g0.abs() + g1.abs() + 1e-6)).max().item())
    if hook != "none":  # the gradients really went through 16 bits
        assert worst > u / 64, f"{hook}: gradients are exact, the hook did not run"


def test_register_comm_hook_rejects_unknown_names():
    with pytest.raises(ValueError, match="'powersgd' is not one of none, bf16, fp16"):
        register_comm_hook(nn.Linear(2, 2), "powersgd")


# ------------------------------------------------------------------ 4. ranks stay in lockstep
def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def _lockstep_worker(rank: int, world: int, images: torch.Tensor, labels: torch.Tensor) -> dict:
    torch.manual_seed(1000 + rank)  # deliberately different initial weights on each rank
    model = SyncBatchNormCPU.convert_sync_batchnorm(tiny_net(5, seed=None))
    before = flat_state(model)
    ddp = DDP(model)
    after_ddp = flat_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, 4, drop_last=True))
    loss = train_one_epoch(ddp, optimizer, loader, CPU, 0, LoopOptions(print_freq=2))
    after_train = flat_state(model)
    return dict(loss=loss, before=_gather(before), after_ddp=_gather(after_ddp),
                after_train=_gather(after_train))


def test_ranks_hold_identical_weights_after_ddp_and_after_an_epoch(tmp_path):
    gen = torch.Generator().manual_seed(4)
    images = torch.randint(0, 256, (24, 3, 8, 8), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 5, (24,), generator=gen)
    per_rank = run_ranks(_lockstep_worker, 2, tmp_path, images, labels)

    for got in per_rank:
        before, after_ddp, after_train = got["before"], got["after_ddp"], got["after_train"]
        assert not torch.equal(before[0], before[1])  # the seeds really differed
        # DDP's constructor broadcasts rank 0's parameters and buffers.
        assert torch.equal(after_ddp[0], before[0]) and torch.equal(after_ddp[1], before[0])
        # Averaged gradients + synchronised BN statistics keep every rank identical.
        assert torch.equal(after_train[0], after_train[1])
        assert not torch.equal(after_train[0], after_ddp[0])  # it did train
    assert per_rank[0]["loss"] == per_rank[1]["loss"]


# ------------------------------------------------------------------ 5. rank helpers
def _reduce_worker(rank: int, world: int) -> dict:
    tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)
    original = tensor.clone()
    mean = reduce_value(tensor, average=True)
    total = reduce_value(tensor, average=False)
    scalar = reduce_value(float(rank + 1), average=False)
    big = reduce_value(16777217.0, average=False)  # 2**24 + 1: float32 cannot hold it
    counts = reduce_value(torch.tensor(rank + 2), average=True)  # integers: 2, 3, 4
    return dict(mean=mean, total=total, scalar=scalar, untouched=torch.equal(tensor, original),
                big=big, counts=counts, gathered=all_gather_object(f"r{rank}"),
                broadcast=broadcast_object(f"from {rank}", src=world - 1),
                all_ok=all_ranks_ok(True), one_failed=all_ranks_ok(rank != 1))


def test_reduce_value_and_object_collectives_agree_on_every_rank(tmp_path):
    for rank, got in enumerate(run_ranks(_reduce_worker, 3, tmp_path)):
        assert torch.equal(got["mean"], torch.tensor([2.0, 20.0], dtype=torch.float64)), rank
        assert torch.equal(got["total"], torch.tensor([6.0, 60.0], dtype=torch.float64)), rank
        assert float(got["scalar"]) == 6.0, rank
        assert got["big"].item() == 3 * 16777217, rank
        assert got["counts"].item() == 3.0 and got["counts"].is_floating_point(), rank
        assert got["untouched"], f"rank {rank}: reduce_value modified its input"
        assert got["gathered"] == ["r0", "r1", "r2"] and got["broadcast"] == "from 2", rank
        assert got["all_ok"] is True and got["one_failed"] is False, rank


def test_rank_helpers_without_process_group_return_the_value():
    assert not dist.is_initialized()
    tensor = torch.tensor([1.5, -2.0], requires_grad=True)
    for average in (True, False):
        out = reduce_value(tensor, average=average)
        assert torch.equal(out, torch.tensor([1.5, -2.0]))
        # a new detached tensor, as with many ranks: changing it leaves the input alone
        assert out is not tensor and not out.requires_grad
    assert float(reduce_value(2.5)) == 2.5 and reduce_value(16777217.0).item() == 16777217
    counts = reduce_value(torch.tensor(3), average=True)
    assert counts.item() == 3.0 and counts.is_floating_point()  # a mean, as with many ranks
    assert all_gather_object(7) == [7] and broadcast_object("x") == "x"
    assert all_ranks_ok(True) and not all_ranks_ok(False)
    assert run_on_main(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ConfigError, match="^one process$"):
        run_on_main(_raise, ConfigError("one process"))


def _raise(error: Exception) -> None:
    raise error


def _init_again_worker(rank: int, world: int) -> tuple:
    info = init_distributed_mode(device="cpu")  # the group exists already (made by run_ranks)
    return info.rank, info.world_size, info.backend, str(info.device), info.distributed


def test_init_distributed_mode_called_again_describes_the_group_there_is(tmp_path):
    """A second call (a helper that initialises too) raised torch's "trying to initialize the
    default process group twice!" under torchrun, and called itself a lone process elsewhere."""
    got = run_ranks(_init_again_worker, 2, tmp_path)
    assert got == [(0, 2, "gloo", "cpu", True), (1, 2, "gloo", "cpu", True)]


def _run_on_main_worker(rank: int, world: int, folder: str) -> dict:
    calls = []

    def scan(path: str, *, suffix: str) -> list[str]:
        calls.append(path)
        return [path + suffix, f"made by rank {dist.get_rank()}"]

    out: dict[str, Any] = {"value": run_on_main(scan, folder, suffix="/x")}
    for error in (ConfigError(f"--epochs 0 is not a number of epochs (rank {rank})"),
                  OSError(28, "No space left on device")):
        try:
            run_on_main(_raise, error)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the point
            out[type(error).__name__] = (type(exc).__name__, str(exc))
    # Every rank got here: the group still works, nobody waits in a collective.
    out["after"] = reduce_value(1.0, average=False).item()
    out["calls"] = calls
    return out


def test_run_on_main_gives_every_rank_rank_0s_value_or_error(tmp_path):
    """A folder scan or a file written once: the others must not run it, and an error on rank 0
    must stop them too instead of leaving them in the next collective until the timeout."""
    per_rank = run_ranks(_run_on_main_worker, 2, tmp_path, "/data")
    for rank, got in enumerate(per_rank):
        assert got["value"] == ["/data/x", "made by rank 0"], rank
        assert got["calls"] == (["/data"] if rank == 0 else []), rank
        # The very error rank 0 raised (its message says rank 0), on every rank.
        assert got["ConfigError"] == ("ConfigError",
                                      "--epochs 0 is not a number of epochs (rank 0)"), rank
        assert got["OSError"] == ("OSError", "[Errno 28] No space left on device"), rank
        assert got["after"] == 2.0, rank
    assert issubclass(ConfigError, UserError)


class _InCycle:
    def __init__(self) -> None:
        self.me = self


def test_cleanup_destroys_the_group_and_collects_garbage_cycles():
    """What DDP leaves in garbage cycles (gloo work holding Python state) is freed by cleanup(),
    not during interpreter shutdown, where it aborted 1 in 3 torchrun runs of the example."""
    import gc
    import weakref

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gc.disable()  # only cleanup() may collect
    try:
        garbage = weakref.ref(_InCycle())
        assert garbage() is not None
        cleanup()
        assert garbage() is None and not dist.is_initialized()
        cleanup()  # safe twice
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ 6. the loss of an epoch
LOG_SAMPLES, LOG_BATCH = 14, 3  # 7 per rank -> batches of 3, 3, 1: batch means != sample mean
IGNORED = 4  # one unreadable sample (label -100): excluded from the mean, not counted as 0


def _loss_worker(rank: int, world: int, model: nn.Module, images: torch.Tensor,
                 labels: torch.Tensor) -> dict:
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=LOG_BATCH, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights never change
    out = {"ddp": train_one_epoch(DDP(model), optimizer, loader, CPU, 0, LoopOptions(print_freq=2))}
    # Collectives made by train_one_epoch itself: the model is not DDP-wrapped here, so no
    # gradient hook all-reduces; every call counted is the loop's own.
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for print_freq in (1000, 1):
            calls.clear()
            out[f"loss@{print_freq}"] = train_one_epoch(model, optimizer, loader, CPU, 0,
                                                        LoopOptions(print_freq=print_freq))
            out[f"all_reduce@{print_freq}"] = len(calls)
    finally:
        dist.all_reduce = real_all_reduce
    out["steps"] = len(loader)
    return out


def test_train_one_epoch_returns_exact_mean_loss_and_syncs_rarely(tmp_path):
    model = tiny_net(5, bn=False, seed=5)  # no BN/dropout: train mode computes what eval does
    gen = torch.Generator().manual_seed(6)
    images = torch.randn(LOG_SAMPLES, 3, 6, 6, generator=gen)
    labels = torch.randint(0, 5, (LOG_SAMPLES,), generator=gen)
    labels[IGNORED] = -100
    per_rank = run_ranks(_loss_worker, 2, tmp_path, model, images, labels)

    with torch.no_grad():
        per_sample = F.cross_entropy(model(images), labels, reduction="none", ignore_index=-100)
    valid = labels != -100
    everything = float(per_sample[valid].double().mean())
    # Not the mean of the batch means: DistributedSampler deals round-robin, 3 + 3 + 1 per rank.
    shares = [list(range(LOG_SAMPLES))[r::2] for r in range(2)]
    batch_means = [float(per_sample[b][valid[b]].mean()) for share in shares
                   for b in (share[:3], share[3:6], share[6:])]
    assert abs(everything - sum(batch_means) / len(batch_means)) > 1e-3
    for rank, got in enumerate(per_rank):
        assert got["steps"] == 3
        for key in ("ddp", "loss@1000", "loss@1"):
            assert got[key] == pytest.approx(everything, rel=1e-6), (rank, key)
        # No per-step collective: one all-reduce per epoch, or one per reported step.
        assert got["all_reduce@1000"] == 1, got["all_reduce@1000"]
        assert got["all_reduce@1"] == got["steps"], got["all_reduce@1"]


def _nan_worker(rank: int, world: int, model: nn.Module, images: torch.Tensor,
                labels: torch.Tensor) -> str:
    if rank == 1:  # one rank's data goes bad; rank 0's stays fine
        images = images.clone()
        images[5] = float("nan")
    dataset = TensorDataset(images, labels)
    loader = DataLoader(dataset, batch_size=2,
                        sampler=DistributedSampler(dataset, world, rank, shuffle=False))
    try:
        train_one_epoch(DDP(model), torch.optim.SGD(model.parameters(), lr=0.1), loader, CPU, 3,
                        LoopOptions(print_freq=2))
    except FloatingPointError as exc:
        return str(exc)
    return "trained on"


def test_a_non_finite_loss_stops_every_rank_with_one_sentence(tmp_path):
    """Rank 1 alone sees the NaN; were only it to stop, rank 0 would wait in DDP's next
    all-reduce until the timeout."""
    gen = torch.Generator().manual_seed(2)
    images, labels = torch.randn(16, 3, 6, 6, generator=gen), torch.randint(0, 4, (16,),
                                                                           generator=gen)
    got = run_ranks(_nan_worker, 2, tmp_path, tiny_net(4, bn=False), images, labels)
    # Sample 5 is rank 1's third (round-robin), in its step 1: noticed at step 1 (print_freq 2).
    assert got == ["loss is nan at epoch 3 step 1 (checked every 2 steps); lower the learning "
                   "rate (--lr) or check the data."] * 2


class _UnusedBranch(nn.Module):
    """A model whose forward skips a layer (an auxiliary head, a branch taken only sometimes)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(12, 4), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x.flatten(1))


def _unused_branch_worker(rank: int, world: int, wrapper: str) -> dict[str, Any]:
    from multi_train_utils.checkpoint_io import whole_state
    from multi_train_utils.strategy import shard_model

    torch.manual_seed(0)
    model = _UnusedBranch()
    before = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 3, 2, 2, generator=gen), torch.randint(0, 4, (16,)))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, world, rank))
    wrapped = (shard_model(model) if wrapper == "fsdp" else
               DDP(model, find_unused_parameters=wrapper == "ddp, find unused"))
    try:
        loss = train_one_epoch(wrapped, torch.optim.SGD(model.parameters(), lr=0.1), loader, CPU,
                               0)
    except ConfigError as exc:
        return {"error": str(exc)}
    after = whole_state(model, torch.optim.SGD(model.parameters(), lr=0.1))[0]  # FSDP: gathered
    return {"loss": loss, "changed": {k: not torch.equal(v, before[k]) for k, v in after.items()}}


@pytest.mark.parametrize("wrapper", ["ddp, find unused", "fsdp"])
def test_an_unused_branch_trains_with_find_unused_parameters_or_fsdp(wrapper, tmp_path):
    got = run_ranks(_unused_branch_worker, 2, tmp_path, wrapper)
    assert all(math.isfinite(rank["loss"]) for rank in got)
    assert got[0]["changed"] == {"used.weight": True, "used.bias": True,  # rank 0's whole state
                                 "unused.weight": False, "unused.bias": False}


def test_an_unused_branch_under_plain_ddp_is_one_sentence_naming_the_flag(tmp_path):
    # DDP stops the second step with a paragraph; one sentence names the fix.
    refused = run_ranks(_unused_branch_worker, 2, tmp_path, "ddp")
    for got in refused:
        assert "add --find-unused-parameters" in got["error"]
        assert "find_unused_parameters=True" in got["error"]


def test_progress_is_a_log_line_every_print_freq_steps(caplog, capsys):
    """A log line every print_freq steps says the step, loss, lr, speed and time left (a bar
    would be one endless "\\r"-joined line under SLURM or nohup)."""
    model = tiny_net(4, bn=False, seed=2)
    gen = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.randn(10, 3, 6, 6, generator=gen),
                                      torch.randint(0, 4, (10,), generator=gen)), batch_size=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level("INFO", logger="multi_train_utils.train_eval_utils"):
        loss = train_one_epoch(model, optimizer, loader, CPU, 3, LoopOptions(print_freq=2))
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("  ")[0] for line in lines] == [
        "[train epoch 3] step 2/5", "[train epoch 3] step 4/5", "[train epoch 3] step 5/5"]
    assert lines[-1].startswith(f"[train epoch 3] step 5/5  loss {loss:.4f}  lr 1.00e-02  ")
    assert all(re.search(r"  \d+ img/s per process  eta \d+:\d\d$", line) for line in lines)
    assert lines[-1].endswith("eta 0:00")
    assert "[train epoch" not in capsys.readouterr().out  # no bar


# ------------------------------------------------------------------ 7. own data and models
def test_soft_and_int32_labels_train_as_their_cross_entropy():
    """Class probabilities (one-hot, smoothing, MixUp) count one sample per row, not per class;
    int32 labels (numpy's) are class indices like int64."""
    model = tiny_net(4, bn=False, seed=2)
    gen = torch.Generator().manual_seed(3)
    images, labels = torch.randn(16, 3, 6, 6, generator=gen), torch.randint(0, 4, (16,),
                                                                          generator=gen)
    with torch.no_grad():
        want = F.cross_entropy(model(images), labels).item()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the loss of these weights
    # F.one_hot gives int64 rows: probabilities all the same
    for targets in (F.one_hot(labels, 4).float(), F.one_hot(labels, 4), labels.int(), labels):
        loader = DataLoader(TensorDataset(images, targets), batch_size=5)
        got = train_one_epoch(model, optimizer, loader, CPU, 0)
        assert got == pytest.approx(want, rel=1e-5), targets.dtype


@pytest.mark.parametrize("fp16", [False, True])
def test_clip_grad_norm_clips_the_true_mean_gradient_also_under_a_grad_scaler(fp16):
    """--clip-grad-norm with --grad-accum-steps 2, and with fp16 autocast and a GradScaler (GPUs
    without bf16): the clip must see the unscaled mean gradient, else it clips gradients 65536x
    too large and the step shrinks by that factor."""
    model = tiny_net(4, bn=False, seed=2)
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(8, 3, 6, 6, generator=gen)
    labels = torch.randint(0, 4, (8,), generator=gen)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(images), labels).backward()  # the mean gradient of all 8, fp32
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    clip = norm.item() / 10  # the clip bites
    want = [-p.grad * clip / norm for p in reference.parameters()]  # SGD, lr 1

    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=fp16)
    train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=1.0),
                    DataLoader(TensorDataset(images, labels), batch_size=4), CPU, 0,
                    LoopOptions(scaler=scaler, amp_dtype=torch.float16 if fp16 else None,
                                grad_accum_steps=2, clip_grad_norm=clip))

    got = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    want = torch.cat([w.flatten() for w in want])
    assert (got - want).norm() / want.norm() < (0.02 if fp16 else 1e-5)
    if fp16:
        assert scaler.get_scale() == 2.0**16  # finite gradients: the step was taken, not skipped


class _Pair(nn.Module):  # a model that returns (logits, features), as many do
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net(4, bn=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), x


class _Unsized(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(3, 6, 6), 0)] * 4)


@pytest.mark.parametrize("case", ["dict batches", "model returns a tuple", "one logit",
                                  "multi-hot labels", "negative accumulation", "print_freq 0",
                                  "no length", "string labels"])
def test_what_the_loop_cannot_train_is_one_sentence_not_a_wrong_loss(case):
    """Each of these trained silently wrong (one logit: loss 0; multi-hot: softmax cross-entropy;
    grad_accum_steps -1: gradient ascent) or failed deep inside torch."""
    gen = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 4, (8,),
                                                                         generator=gen)
    model, kwargs = tiny_net(4, bn=False), {}
    data: Any = TensorDataset(images, labels)
    error, message = ValueError, None
    if case == "dict batches":
        data, error = [{"image": x, "label": y} for x, y in zip(images, labels)], TypeError
        message = (r"^train_one_epoch takes batches of tensors \(inputs, labels\), got "
                   r"\(dict\); .* a collate_fn that returns \(inputs, labels\)\.$")
    elif case in ("model returns a tuple", "one logit"):
        model = _Pair() if case[0] == "m" else tiny_net(1, bn=False)
        got = "tuple" if case[0] == "m" else r"\(4, 1\)"
        message = (rf"^train_one_epoch needs the model to return logits \(N, C\) for C >= 2 "
                   rf"classes, got {got}; wrap the model")
    elif case == "multi-hot labels":
        data = TensorDataset(images, (torch.rand(8, 4, generator=gen) > 0.3).float())
        message = (r"takes \(N, C\) labels as class probabilities \(rows >= 0 summing to 1\), "
                   r"but row sums range over \[[0-4], [2-4]\].*BCEWithLogitsLoss")
    elif case in ("negative accumulation", "print_freq 0"):
        name, value = ("grad_accum_steps", -1) if case[0] == "n" else ("print_freq", 0)
        kwargs = {name: value}
        message = rf"^LoopOptions: {name} must be an integer >= 1, got {value}\.$"
    elif case == "no length":
        data, error = _Unsized(), TypeError
        message = r"needs a data loader with a length; give the IterableDataset a __len__"
    else:
        data, error = [(image, "cat") for image in images], TypeError
        message = r"takes batches of tensors \(inputs, labels\), got \(Tensor, tuple\); "
    before = flat_state(model)
    with pytest.raises(error, match=message):
        train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(data, batch_size=4), CPU, 0, LoopOptions(**kwargs))
    assert torch.equal(flat_state(model), before)  # refused before any step


def test_batches_evaluate_cannot_use_are_one_sentence():
    model = tiny_net(4, bn=False)
    images, labels = torch.randn(6, 3, 6, 6), torch.randint(0, 4, (6,))
    soft = DataLoader(TensorDataset(images, F.one_hot(labels, 4).float()), batch_size=3)
    with pytest.raises(ValueError, match=r"^evaluate needs class indices \(N,\) as labels, got "
                                         r"class probabilities of shape \(3, 4\)\.$"):
        evaluate(model, soft, CPU)
    gray = DataLoader(TensorDataset(torch.zeros(6, 1, 6, 6, dtype=torch.uint8), labels),
                      batch_size=3)
    with pytest.raises(ValueError, match=r"^uint8 inputs are taken as images \(N, 3, H, W\) to "
                                         r"normalise, but this batch is \(3, 1, 6, 6\)"):
        evaluate(model, gray, CPU)


def test_eval_result_survives_copy_and_pickle():
    import pickle

    result = EvalResult(3, top5_correct=5, num_samples=6, loss_sum=4.5,
                        confusion=torch.eye(6, dtype=torch.long))
    for other in (copy.copy(result), copy.deepcopy(result),
                  pickle.loads(pickle.dumps(result))):
        assert (int(other), other.top5_correct, other.num_samples, other.loss) == (3, 5, 6, 0.75)
        assert torch.equal(other.confusion, result.confusion) and other.top1 == 0.5


def _eval_without_sampler_worker(rank: int, world: int, model: nn.Module, images: torch.Tensor,
                                 labels: torch.Tensor) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("multi_train_utils.train_eval_utils").addHandler(handler)
    result = evaluate(model, DataLoader(TensorDataset(images, labels), batch_size=4), CPU)
    return [*records, f"num_samples={result.num_samples}"]


def test_evaluate_warns_when_a_loader_would_count_samples_twice_or_drop_them(eval_case, tmp_path,
                                                                           caplog):
    model, images, labels = eval_case
    per_rank = run_ranks(_eval_without_sampler_worker, 2, tmp_path, model, images, labels)
    assert per_rank[0][0].startswith("evaluate: the loader has no DistributedSampler, so every "
                                     "rank scores the whole val set and each sample counts 2 "
                                     "times; give it DistributedSampler(val_set, shuffle=False).")
    assert per_rank[0][-1] == per_rank[1][-1] == f"num_samples={2 * VAL_SIZE}"
    assert per_rank[1] == [f"num_samples={2 * VAL_SIZE}"]  # said once, by rank 0
    dropping = DataLoader(TensorDataset(images, labels), batch_size=4, drop_last=True)
    assert evaluate(model, dropping, CPU).num_samples == 8
    assert ("evaluate: the val loader or its DistributedSampler has drop_last=True, so some val "
            "samples are never scored; build both with drop_last=False.") in caplog.text
    # Out of order (workers deliver as they finish), a padded repeat could take a real
    # sample's position: refused, not silently miscounted.
    sampler = DistributedSampler(TensorDataset(images, labels), num_replicas=2, rank=1,
                                 shuffle=False)
    unordered = DataLoader(TensorDataset(images, labels), batch_size=4, sampler=sampler,
                           num_workers=1, in_order=False)
    with pytest.raises(ValueError, match=re.escape(
            "evaluate needs the val loader's batches in the sampler's order")):
        evaluate(model, unordered, CPU)


# ------------------------------------------------------------------ 8. the --eval-only report
def test_format_report_lists_each_class_then_the_totals():
    # 3 daisies (2 right), 1 rose (right), no tulip; 6 classes, so top-5 can miss.
    confusion = torch.zeros(6, 6, dtype=torch.int64)
    confusion[0, 0], confusion[0, 1], confusion[1, 1] = 2, 1, 1
    result = EvalResult(3, top5_correct=4, num_samples=4, loss_sum=2.0, confusion=confusion)
    classes = ["daisy", "red\trose", "tulip\nnew", "a", "b", "c"]
    assert format_report(result, classes).splitlines() == [
        "accuracy per class:",
        "  daisy: 0.6667 (3 images)",
        "  red\\trose: 1.0000 (1 image)",  # a tab or line break would break the column
        "  tulip\\nnew: n/a (no validation images)",
        "  a: n/a (no validation images)",
        "  b: n/a (no validation images)",
        "  c: n/a (no validation images)",
        "val images: 4",
        "top-1 accuracy: 0.7500",
        "top-5 accuracy: 1.0000",
        "val loss: 0.5000",
    ]
    few = EvalResult(1, top5_correct=2, num_samples=2, loss_sum=1.0,
                     confusion=torch.eye(2, dtype=torch.int64))
    assert "top-5" not in format_report(few, ["x", "y"])  # 2 classes: top-5 is always 1


# ------------------------------------------------------------------ GPU choices, checked on CPU
@pytest.mark.parametrize("native_bf16, want", [(True, torch.bfloat16), (False, torch.float16)])
def test_amp_takes_bf16_only_where_the_gpu_has_it(native_bf16, want, monkeypatch):
    """Before Ampere, torch.cuda.is_bf16_supported() says yes by emulation, but cuDNN has no bf16
    convolutions there: those GPUs must get fp16 (with the GradScaler), not bf16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native_bf16 or including_emulation)
    assert resolve_amp_dtype(None, torch.device("cuda", 0)) == want  # on by default on CUDA
    assert resolve_amp_dtype(False, torch.device("cuda", 0)) is None
    assert resolve_amp_dtype(None, torch.device("cpu")) is None  # off by default on CPU
    assert resolve_amp_dtype(True, torch.device("cpu")) == torch.bfloat16


def test_channels_last_leaves_inputs_that_are_not_images_alone():
    features = torch.randn(4, 7)  # (N, features) for an MLP: no 4-D layout to take
    out = prepare_images(features, torch.device("cpu"), channels_last=True)
    assert torch.equal(out, features)


@pytest.mark.parametrize("channels_last", [False, True])
def test_prepare_images_normalises_on_the_device_once_per_device(channels_last):
    batch = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8)
    out = prepare_images(batch, torch.device("cpu"), channels_last=channels_last)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (batch.float() / 255 - mean) / std)
    assert out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    # The constants are made once (on CUDA each torch.tensor(..., device=) would wait for the GPU).
    first = _norm_constants(torch.device("cpu"))
    assert _norm_constants(torch.device("cpu"))[0] is first[0]
