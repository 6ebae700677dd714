"""``--strategy fsdp`` (FSDP2 ``fully_shard``) takes the steps DDP takes, on 1/N of the memory.

- equivalence: 2 ranks x B under FSDP against DDP from the same weights: the loss of every step,
  the final weights, momentum buffers and evaluate() agree to float32 tolerance, with per-rank
  BatchNorm, with SyncBatchNorm and clipping, and with gradient accumulation 2 and clipping;
- memory: each rank holds at most 1/N of the parameters, gradients and optimizer state (plus
  one residual block's slack), measured from its shards; ranks but 0 build on the meta device
  (their peak: their half); each unit is at most one residual block; non-final micro-batches
  skip the reduction; ``--amp`` computes in bf16 and keeps float32 shards;
- checkpoints: each rank writes its half of a sharded checkpoint, gathering nothing; they
  reload under FSDP, DDP and in one process; a restarted FSDP run continues from its last
  periodic save and ends where DDP's reference run ends; a DDP checkpoint continues under FSDP
  and an FSDP one under DDP, and at another world size; the last and best weights, and any
  checkpoint through ``predict.py --export``, load into torchvision strictly;
- flags FSDP cannot honour are one line (Ctrl-C to an FSDP run: test_resume_and_shutdown.py).

The table of docs/strategies.md: ``python -m benchmarks --stages fsdp --device cpu``.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import re
import threading

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import (LAUNCH, ProcessTree, assert_same_tensors, assert_user_error,
                      clone_run, flags, launcher, load_ckpt, make_stopper, ranks, read_metrics,
                      torchrun_cmd)
from benchmarks.fsdp import local_bytes
from dist_helpers import run_ranks
from model import Bottleneck, ResNet, get_model
from multi_train_utils.checkpoint import _prune
from multi_train_utils.checkpoint_io import extract_state_dict, load_file, save_atomic, whole_state
from multi_train_utils.run_folder import move_earlier_run
from multi_train_utils.strategy import (RESIDUAL_BLOCKS, gradient_sync, load_shards,
                                        read_shards, save_shards, shard_model)
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import LoopOptions, evaluate, train_one_epoch

CPU = torch.device("cpu")
BATCH, STEPS, CLASSES = 4, 3, 5


def _data(n: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=gen),
                         torch.randint(0, CLASSES, (n,), generator=gen))


def _loader(data: TensorDataset, rank: int, world: int) -> DataLoader:
    return DataLoader(data, batch_size=BATCH,
                      sampler=DistributedSampler(data, world, rank, shuffle=False))


def _train(rank: int, world: int, init: str, strategy: str, sync_bn: bool, accum: int,
           clip: float | None) -> dict:
    """STEPS optimizer steps of resnet18 (32 px) as the launcher takes them: the loss of each
    step, then evaluate(), and rank 0's full model and optimizer state."""
    model = get_model("resnet18", num_classes=CLASSES)
    model.load_state_dict(torch.load(init, weights_only=True))  # the same for every run
    if sync_bn:
        model = convert_sync_batchnorm(model, CPU)
    bare = model
    model = shard_model(model) if strategy == "fsdp" else DDP(model)
    optimizer = torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-3)
    per_step = world * BATCH * accum
    data = _data(per_step * STEPS)
    losses = []
    for step in range(STEPS):  # one optimizer step per call: its loss, reduced over the ranks
        part = TensorDataset(*data[step * per_step:(step + 1) * per_step])
        losses.append(train_one_epoch(model, optimizer, _loader(part, rank, world), CPU, step,
                                      LoopOptions(grad_accum_steps=accum, clip_grad_norm=clip)))
    result = evaluate(model, _loader(_data(10, seed=1), rank, world), CPU)
    weights, optimizer_state = whole_state(bare, optimizer)
    return dict(losses=losses, eval=(int(result), result.loss), model=weights,
                optimizer=optimizer_state)


def _equivalence_worker(rank: int, world: int, init: str, sync_bn: bool, accum: int,
                        clip: float | None) -> dict:
    return {strategy: _train(rank, world, init, strategy, sync_bn, accum, clip)
            for strategy in ("ddp", "fsdp")}


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("init") / "resnet18.pth"
    torch.manual_seed(0)
    torch.save(get_model("resnet18", num_classes=CLASSES).state_dict(), path)
    return str(path)


@pytest.mark.parametrize("sync_bn, accum, clip", [(False, 1, None), (True, 1, 0.5),
                                                  (False, 2, 0.5)],
                         ids=["batchnorm", "syncbn-clip", "accum2-clip"])
def test_fsdp_takes_the_steps_ddp_takes(sync_bn, accum, clip, init_weights, tmp_path):
    ranks = run_ranks(_equivalence_worker, 2, tmp_path, init_weights, sync_bn, accum, clip)
    for got in ranks:
        ddp, fsdp = got["ddp"], got["fsdp"]
        # float32 tolerance: a clipped step's norm sums the squares in another order
        torch.testing.assert_close(fsdp["losses"], ddp["losses"], rtol=1e-5, atol=1e-5)
        # Every rank scores its half of the val set with rank 0's BatchNorm statistics, as DDP.
        assert fsdp["eval"][0] == ddp["eval"][0]
        assert fsdp["eval"][1] == pytest.approx(ddp["eval"][1], rel=1e-5, abs=1e-6)
    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    init = torch.load(init_weights, weights_only=True)
    assert not torch.allclose(ddp["model"]["conv1.weight"], init["conv1.weight"])  # it trained
    assert fsdp["model"].keys() == init.keys()  # whole tensors under torchvision's names
    torch.testing.assert_close(fsdp["model"], ddp["model"])
    torch.testing.assert_close(fsdp["optimizer"]["state"], ddp["optimizer"]["state"])
    assert ranks[1]["fsdp"]["model"] == {}  # gathered to rank 0 alone


def _dropout_worker(rank: int, world: int) -> dict:
    """squeezenet1_1 (dropout before its classifier) built as the launcher builds it: on the
    meta device on ranks but 0 under fsdp; two steps, then rank 0's weights."""
    got = {}
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        with torch.device("meta" if strategy == "fsdp" and rank > 0 else "cpu"):
            bare = get_model("squeezenet1_1", num_classes=CLASSES)
        model = shard_model(bare, CPU) if strategy == "fsdp" else DDP(bare)
        optimizer = torch.optim.SGD(bare.parameters(), lr=0.05, momentum=0.9)
        data = _data(world * BATCH * 2)
        losses = [train_one_epoch(model, optimizer, _loader(data, rank, world), CPU, 0)]
        got[strategy] = dict(losses=losses, model=whole_state(bare)[0])
    return got


def test_fsdp_draws_the_dropout_masks_ddp_draws(tmp_path):
    """Rank 1 built on the meta device takes rank 0's random state, as its own build would have
    left it: the same losses and weights as DDP for a model with dropout."""
    for got in run_ranks(_dropout_worker, 2, tmp_path):
        torch.testing.assert_close(got["fsdp"]["losses"], got["ddp"]["losses"])
        torch.testing.assert_close(got["fsdp"]["model"], got["ddp"]["model"])


# ---------------------------------------------------------------- memory, sync, amp
def _memory_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = get_model("resnet18", num_classes=CLASSES)
    whole = local_bytes(model)["parameters"]
    block = local_bytes(model.layer4[0])["parameters"]  # the largest block
    rank0 = copy.deepcopy(model.state_dict())
    if rank == 1:  # as if only rank 0 had read --weights: sharding starts from rank 0's
        with torch.no_grad():
            model.fc.weight.add_(1.0)
    shard_model(model)
    gathered = whole_state(model, torch.optim.SGD(model.parameters()))[0]  # live: compare now
    from_rank0 = rank == 1 or all(torch.equal(gathered[k], v) for k, v in rank0.items())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(2 * BATCH)[:]
    with gradient_sync(model, enabled=False):  # a non-final micro-batch: nothing is reduced
        nn.functional.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()
    skipped = all(p.grad is None for p in model.parameters())
    with gradient_sync(model, enabled=True):
        nn.functional.cross_entropy(model(x[BATCH:]), y[BATCH:]).backward()
    optimizer.step()
    held = local_bytes(model, optimizer)

    torch.manual_seed(0)
    amp = shard_model(get_model("resnet18", num_classes=CLASSES), mixed_precision=torch.bfloat16)
    amp_optimizer = torch.optim.SGD(amp.parameters(), lr=0.1)
    train_one_epoch(amp, amp_optimizer, _loader(_data(2 * world * BATCH), rank, world), CPU, 0,
                    LoopOptions(amp_dtype=torch.bfloat16))
    amp.eval()
    with torch.no_grad():
        logits = amp(x)
    return dict(whole=whole, block=block, held=held, skipped=skipped, logits=logits.dtype,
                from_rank0=from_rank0,
                shards={p.to_local().dtype for p in amp.parameters()},
                finite=all(bool(p.to_local().isfinite().all()) for p in amp.parameters()))


def test_each_fsdp_rank_holds_a_half_and_skips_reductions_when_told(tmp_path):
    ranks = run_ranks(_memory_worker, 2, tmp_path)
    for got in ranks:
        limit = got["whole"] / 2 + got["block"] / 2  # 1/N, plus padding far below a block
        for what in ("parameters", "gradients", "optimizer"):  # SGD momentum: one per weight
            assert got["whole"] / 3 < got["held"][what] <= limit, (what, got)
        assert got["from_rank0"]  # as DDP, every rank starts from rank 0's weights
        assert got["skipped"]  # the unsharded gradients wait for the final micro-batch
        # --amp: bf16 compute (the root's output), float32 shards for the optimizer
        assert got["logits"] == torch.bfloat16 and got["shards"] == {torch.float32}
        assert got["finite"]
    assert sum(got["held"]["parameters"] for got in ranks) >= ranks[0]["whole"]


# ---------------------------------------------------------------- runs, restarts, resume
def _peak_rss_growth(build) -> tuple[object, int]:
    """``build()`` and how far this process's peak resident memory rose meanwhile (bytes): the
    kernel's high-water mark, which it updates only now and then, and VmRSS read every 2 ms."""
    def status(field: str) -> int:
        text = open("/proc/self/status").read()
        return int(re.search(rf"{field}:\s+(\d+) kB", text)[1]) * 1024

    gc.collect()
    # A forked process shares the pages pytest's process had freed but kept: reused, they would
    # not raise its resident memory. Given back first, each page the build touches counts.
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from what is resident now
    before, sampled, done = status("VmHWM"), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            sampled[0] = max(sampled[0], status("VmRSS"))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = build()
    finally:
        done.set()
        thread.join()
    return result, max(status("VmHWM"), sampled[0]) - before


class _Wide(nn.Module):
    """512 MiB of float32 in 128 square layers: the build's memory dwarfs the noise (layers of
    4 MiB, which glibc hands back to the system once freed)."""

    def __init__(self, layers: int = 128) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(layers)])


def _build_memory_worker(rank: int, world: int, meta: bool) -> dict:
    shard_model(_Wide(layers=2), CPU, units=(nn.Linear,))  # imports and mesh: not the model's

    def build() -> nn.Module:
        torch.manual_seed(0)
        with torch.device("meta" if meta and rank > 0 else "cpu"):
            model = _Wide()
        return shard_model(model, CPU, units=(nn.Linear,))  # a user's own block class

    model, growth = _peak_rss_growth(build)
    torch.manual_seed(0)
    return dict(growth=growth, first=model.layers[0].weight.full_tensor(),
                expected=_Wide().layers[0].weight.detach())


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc only")
def test_ranks_but_0_build_on_the_meta_device_and_hold_only_their_shards(tmp_path):
    """Rank 1's peak memory while the model is built and sharded: its half, not the whole."""
    model_bytes = 128 * 1024 * 1024 * 4
    on_meta = run_ranks(_build_memory_worker, 2, tmp_path / "meta", True)
    everywhere = run_ranks(_build_memory_worker, 2, tmp_path / "whole", False)  # the old way
    assert on_meta[1]["growth"] < 0.6 * model_bytes, on_meta[1]["growth"] / model_bytes
    # The old way: the whole model (less a few MB the allocator had free from the warm-up).
    assert everywhere[1]["growth"] >= 0.95 * model_bytes, everywhere[1]["growth"] / model_bytes
    for rank in on_meta:  # rank 0's initial weights, as an unsharded build's, in every shard
        assert torch.equal(rank["first"], rank["expected"])


def _stepped(model: nn.Module, rank: int) -> torch.optim.Optimizer:
    """One SGD step with momentum on ``model`` (a batch of this rank's): an optimizer state."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 3, 32, 32, generator=gen) if isinstance(model, ResNet) else \
        torch.randn(BATCH, 1024, generator=gen)
    model(x).float().square().mean().backward()
    optimizer.step()
    return optimizer


def _save_shards_worker(rank: int, world: int, folder: str, wide: bool) -> dict:
    torch.manual_seed(0)
    with torch.device("meta" if rank else "cpu"):
        bare = _Wide(layers=64) if wide else get_model("resnet18", num_classes=CLASSES)
    model = shard_model(bare, CPU, units=(nn.Linear,) if wide else RESIDUAL_BLOCKS)
    optimizer = _stepped(model if not wide else model.layers, rank)
    _, growth = _peak_rss_growth(lambda: save_shards(folder, model, optimizer))
    return dict(growth=growth, whole=None if wide else whole_state(model, optimizer))


def _load_shards_worker(rank: int, world: int, folder: str, strategy: str) -> dict:
    model = get_model("resnet18", num_classes=CLASSES)
    wrapped = shard_model(model, CPU) if strategy == "fsdp" else DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_shards(folder, model, optimizer)
    return whole_state(wrapped, optimizer)


def _assert_same_state(got: tuple, expected: tuple) -> None:
    assert_same_tensors(got[0], expected[0])
    state, want = got[1]["state"], expected[1]["state"]
    assert state.keys() == want.keys()
    assert_same_tensors({k: v["momentum_buffer"] for k, v in state.items()},
                        {k: v["momentum_buffer"] for k, v in want.items()})


def test_sharded_checkpoints_reload_under_fsdp_ddp_and_in_one_process(tmp_path):
    """FSDP x 2 saves its shards; FSDP x 2, DDP x 2 and one process without a group read them
    back to the state whole_state() gave before the save, tensor for tensor."""
    folder = str(tmp_path / "shards")
    expected = run_ranks(_save_shards_worker, 2, tmp_path / "save", folder, False)[0]["whole"]
    for strategy in ("fsdp", "ddp"):
        _assert_same_state(run_ranks(_load_shards_worker, 2, tmp_path / strategy, folder,
                                     strategy)[0], expected)
    model = get_model("resnet18", num_classes=CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_shards(folder, model, optimizer)  # no process group
    _assert_same_state(whole_state(model, optimizer), expected)
    assert_same_tensors(read_shards(folder), expected[0])  # the template-free read


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc only")
def test_each_rank_writes_its_half_and_rank_0_gathers_nothing(tmp_path):
    folder = tmp_path / "shards"
    got = run_ranks(_save_shards_worker, 2, tmp_path / "ranks", str(folder), True)
    state_bytes = 2 * 64 * 1024 * 1024 * 4  # the model and its momentum
    sizes = [(folder / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)]
    assert all(0.45 < size / state_bytes < 0.55 for size in sizes), sizes
    assert got[0]["growth"] < 0.6 * state_bytes, got[0]["growth"] / state_bytes


def test_pruning_and_moving_a_run_keep_its_shards_with_the_files_naming_them(tmp_path):
    """model_best.pth of a ddp checkpoint continued under fsdp names no shards; a fresh run in
    the folder moves the shards aside with the checkpoints."""
    out = tmp_path / "run"
    for tag in ("epoch-0", "epoch-1", "epoch-2"):
        (out / "shards" / tag).mkdir(parents=True)
        (out / "shards" / tag / ".metadata").write_bytes(b"")
    save_atomic({"epoch": 0, "model": {"w": torch.zeros(1)}}, out / "model_best.pth")  # ddp's
    save_atomic({"epoch": 2, "shards": "shards/epoch-2"}, out / "checkpoint.pth")
    _prune(out, "shards/epoch-2", keep_last=1)
    assert [p.name for p in (out / "shards").iterdir()] == ["epoch-2"]
    move_earlier_run(out)
    (aside,) = (out / "previous-runs").iterdir()
    assert not (out / "shards").exists()
    assert load_file(aside / "checkpoint.pth")["shards"] == str(aside / "shards" / "epoch-2")
    assert (aside / "shards" / "epoch-2" / ".metadata").is_file()


def _units_worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FSDPModule

    model = shard_model(get_model("resnet50", num_classes=CLASSES), CPU)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = {m: {id(p) for u in m.modules() if u is not m and isinstance(u, FSDPModule)
                 for p in u.parameters()} for m in units}
    sizes = [sum(p.numel() for p in m.parameters() if id(p) not in inner[m]) for m in units]
    blocks = [sum(p.numel() for p in m.parameters())
              for m in model.modules() if isinstance(m, Bottleneck)]
    return dict(units=len(units), largest=max(sizes), block=max(blocks), blocks=len(blocks))


def test_each_fsdp_unit_is_at_most_one_residual_block(tmp_path):
    got = run_ranks(_units_worker, 2, tmp_path)[0]
    assert got["units"] == got["blocks"] + 1 == 17  # resnet50's 16 blocks, and the root
    assert got["largest"] <= got["block"]


def _mesh_worker(rank: int, world: int) -> list[str]:
    # fully_shard without a mesh takes the machine's accelerator: on a GPU host a --device cpu
    # run would shard onto CUDA under a gloo group. Here any use of that default fails.
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module

    def no_default_mesh() -> None:
        raise AssertionError("fully_shard built its default mesh")

    fully_shard_module._init_default_mesh = no_default_mesh
    model = shard_model(get_model("resnet18", num_classes=CLASSES).to(CPU),
                        mixed_precision=torch.bfloat16)  # the BatchNorm units too
    return sorted({p.device_mesh.device_type for p in model.parameters()})


def test_fsdp_shards_on_a_mesh_of_the_models_device(tmp_path):
    assert run_ranks(_mesh_worker, 2, tmp_path) == [["cpu"], ["cpu"]]


@pytest.fixture(scope="module")
def restarted_fsdp_run(tiny_data, tmp_path_factory, plain):
    """torchrun --max-restarts=1 --strategy fsdp --save-every-steps 2, rank 1 killed (-9) after
    epoch 1's third step: the group restarts and continues from step 2 of epoch 1."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "run"
    cmd = torchrun_cmd(2, "--max-restarts=1", make_stopper(tmp), LAUNCH,
                       *flags(tiny_data, out, "--epochs", "3", "--strategy", "fsdp",
                              "--save-every-steps", "2"))
    tree = ProcessTree(cmd, tmp / "launcher.log", plain, STOP_TARGET="kill", STOP_RANK="1",
                       STOP_AFTER="8")
    try:
        code = tree.wait_exit(240)
        assert code == 0, tree.output()[-4000:]
        assert "resuming from epoch 1, step 2 of 5\n" in tree.output(), tree.output()[-4000:]
        assert not tree.alive_seen()
        yield out
    finally:
        tree.kill_all()


def assert_close_runs(out, expected_out, epochs: range) -> None:
    ours, ref = read_metrics(out), read_metrics(expected_out)
    assert [m["epoch"] for m in ours] == list(epochs)
    for got, want in zip(ours, ref):
        assert got["epoch"] == want["epoch"] and got["lr"] == pytest.approx(want["lr"])
        for key in ("train_loss", "val_acc", "val_loss"):
            assert got[key] == pytest.approx(want[key], abs=1e-4), (key, got, want)
    final, expected = load_ckpt(out / "checkpoint.pth"), load_ckpt(expected_out / "checkpoint.pth")
    assert final["epoch"] == expected["epoch"] == epochs[-1]
    torch.testing.assert_close(model_of(out / "checkpoint.pth"),
                               model_of(expected_out / "checkpoint.pth"), rtol=1e-4, atol=1e-5)


def model_of(path) -> dict:
    """The model's whole state dict in a checkpoint file, sharded (fsdp) or not."""
    return extract_state_dict(load_file(path), path)


def test_a_restarted_fsdp_run_ends_where_the_ddp_run_ends(restarted_fsdp_run, reference_run):
    out = restarted_fsdp_run
    assert_close_runs(out, reference_run.out, range(3))
    ckpt, best = load_ckpt(out / "checkpoint.pth"), load_ckpt(out / "model_best.pth")
    assert ckpt["args"]["strategy"] == "fsdp" and "model" not in ckpt  # each rank its shards
    assert ckpt["shards"] == "shards/epoch-2" and len(ckpt["rng_states"]) == 2
    # The shards of the last epoch and of the best; a killed save's and mid-epoch ones are gone.
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(
        {"epoch-0", "epoch-1", "epoch-2"})  # --keep-last 0: every epoch's
    # weights/: the last and the best model, whole, as torchvision loads them.
    assert sorted(p.name for p in (out / "weights").iterdir()) == sorted(
        {"model-2.pth", f"model-{best['epoch']}.pth"})
    torchvision = pytest.importorskip("torchvision")
    for path in (out / "weights" / "model-2.pth", out / "model_best.pth"):
        torchvision.models.resnet18(num_classes=5).load_state_dict(model_of(path))
    assert_same_tensors(load_ckpt(out / "weights" / f"model-{best['epoch']}.pth"),
                        model_of(out / "model_best.pth"))


PREDICT = launcher("predict.py")  # python predict.py ARGV, by ``plain``


def test_any_fsdp_checkpoint_exports_predicts_and_evaluates(restarted_fsdp_run, tiny_data,
                                                            tmp_path, plain):
    """The sharded checkpoints of a run, through the three tools that take a checkpoint."""
    out, exported = restarted_fsdp_run, tmp_path / "model.pth"
    res = plain(["--weights", str(out / "checkpoint.pth"), "--export", str(exported)],
                patch=PREDICT)
    assert res.returncode == 0, res.stderr[-3000:]
    weights = load_ckpt(exported)
    assert_same_tensors(weights, model_of(out / "checkpoint.pth"))
    torchvision = pytest.importorskip("torchvision")
    torchvision.models.resnet18(num_classes=5).load_state_dict(weights)  # strict
    image = next((tiny_data / "roses").iterdir())
    res = plain(["--weights", str(out / "model_best.pth"), "--top-k", "1", str(image)],
                patch=PREDICT)
    assert res.returncode == 0 and res.stdout.startswith(str(image)), res.stderr[-3000:]
    res = plain(flags(tiny_data, tmp_path / "eval", "--eval-only", "--resume",
                      str(out / "model_best.pth")))
    assert res.returncode == 0 and "top-1 accuracy" in res.stderr, res.stderr[-3000:]


def test_ddp_and_fsdp_checkpoints_continue_under_the_other_strategy(
        restarted_fsdp_run, reference_run, tiny_data, tmp_path, plain):
    """One more epoch from epoch 2: the DDP checkpoint under FSDP, the FSDP one under DDP (both
    2 ranks, the same numbers), and the FSDP one in one process (the lr follows the batch)."""
    runs = {}
    for strategy, source in (("fsdp", reference_run.out), ("ddp", restarted_fsdp_run)):
        out = runs[strategy] = clone_run(source, tmp_path / strategy)
        res = ranks(plain, 2, LAUNCH, *flags(tiny_data, out, "--epochs", "4",
                                             "--strategy", strategy))
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert_close_runs(runs["fsdp"], runs["ddp"], range(4))

    out = clone_run(restarted_fsdp_run, tmp_path / "one")
    res = plain(flags(tiny_data, out, "--epochs", "4", "--strategy", "fsdp"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--strategy fsdp with one process" in res.stderr
    assert "4 images per step (the run had 8), lr 0.001: applied from epoch 3" in res.stderr
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize("extra, needle", [(["--compile"], "--compile is not supported with "
                                            "--strategy fsdp"),
                                           (["--comm-hook", "bf16"], "use --amp")])
def test_what_fsdp_cannot_do_is_one_line(extra, needle, tiny_data, tmp_path, plain):
    res = plain(flags(tiny_data, tmp_path / "run", "--strategy", "fsdp", *extra))
    assert_user_error(res, needle)
