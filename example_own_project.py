"""Data-parallel training of your own model and data with multi_train_utils alone: it saves each
epoch, continues when run again, and stops cleanly on a signal.

    python example_own_project.py                        # one process (GPU, else CPU)
    torchrun --nproc_per_node=2 example_own_project.py   # two processes: NCCL on GPUs, gloo on CPU

Run it again and it continues from ``<output-dir>/checkpoint.pth``; Ctrl-C or SIGTERM saves at
a step all ranks agree on and exits. Copy ``multi_train_utils/`` next to your script and swap in
your own ``Dataset`` and ``nn.Module``; here, a synthetic 4-class task.
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multi_train_utils.checkpoint import (Checkpointer, ModelState, OptimizerState, TrainState,
                                          step_saves)
from multi_train_utils.data import EpochProgress, ResumableSampler
from multi_train_utils.distributed_utils import cleanup, init_distributed_mode, is_main_process
from multi_train_utils.guard import guarded, stop_requests
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch


def make_dataset(size: int, seed: int) -> TensorDataset:
    """``(size, 16)`` features, labelled 0..3 by the quadrant of the first two; the same on
    every rank (a fixed seed)."""
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())


def main(args: argparse.Namespace) -> None:
    info = init_distributed_mode(device=args.device)  # torchrun's variables, or one process
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(info.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # What a rerun continues from: each entry has state_dict()/load_state_dict().
    train = TrainState()  # the epoch, the place in it, the metrics so far
    checkpointer = Checkpointer(args.output_dir, {
        "model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "train": train})
    checkpoint = f"{args.output_dir}/checkpoint.pth"
    if os.path.isfile(checkpoint):
        checkpointer.load(checkpoint)  # stopped part-way: the same epoch, from its saved step
        if is_main_process():
            print(f"continuing at epoch {train.epoch}, step {train.progress.batches}", flush=True)
    if info.distributed:  # DDP checks that every rank starts from the same weights
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)

    train_set, val_set = make_dataset(4096, seed=1), make_dataset(1000, seed=2)
    # Each rank reads its share; ResumableSampler can start an epoch part-way.
    train_sampler = ResumableSampler(train_set, info.world_size, info.rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, info.world_size, info.rank, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler)

    # A signal only asks to stop: after each step the ranks agree whether to (step_saves).
    with stop_requests() as stop:
        for epoch in range(train.epoch, args.epochs):
            train.epoch = epoch
            train_sampler.set_epoch(epoch, skip=train.progress.samples)  # a stopped epoch: its rest
            loss = train_one_epoch(
                model, optimizer, train_loader, info.device, epoch, progress=train.progress,
                after_step=step_saves(stop, checkpointer.save, every=args.save_every_steps))
            if train.progress.stopped:  # saved at the step every rank stopped after
                stop.stop()  # exits with 128 + the signal
            result = evaluate(model, val_loader, info.device)  # exact: the padding dropped
            record = {"epoch": epoch, "train_loss": loss, "val_acc": result.top1}
            train.metrics.append(record)
            train.progress = EpochProgress()  # the epoch is done: no place in it to save
            checkpointer.save(record=record)
            if is_main_process():
                print(f"epoch {epoch}: train loss {loss:.4f}  val accuracy {result.top1:.4f} "
                      f"({result.correct}/{result.num_samples})", flush=True)
            if stop.poll(lag=False):  # a signal during evaluation or the save
                stop.stop()
    cleanup()


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--epochs", type=int, default=5, help="in all, continued ones included")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--output-dir", default="runs/example", help="where checkpoint.pth goes")
    parser.add_argument("--save-every-steps", type=int, default=0,
                        help="also save every K steps, for a kill no signal announces")
    return parser


if __name__ == "__main__":
    # guarded: one-line errors, an exit code per signal, logging set up per rank.
    guarded(main, get_args_parser().parse_args())
