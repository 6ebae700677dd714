"""Data-parallel training of your own model and dataset with multi_train_utils alone.

    python example_own_project.py                        # one process (GPU, else CPU)
    torchrun --nproc_per_node=2 example_own_project.py   # two processes: NCCL on GPUs, gloo on CPU

Copy the ``multi_train_utils/`` folder next to your script; then swap in your own ``Dataset`` and
``nn.Module``. Here: a synthetic 4-class task (the quadrant of the first two of 16 features).
"""

import argparse
import logging

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multi_train_utils.distributed_utils import cleanup, init_distributed_mode, is_main_process
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch


def make_dataset(size: int, seed: int) -> TensorDataset:
    """``(size, 16)`` float features and labels in 0..3; a fixed seed gives every rank the same."""
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())


def main(args: argparse.Namespace) -> None:
    # The loops log a progress line every print_freq steps where stdout is not a terminal
    # (SLURM, nohup: a tqdm bar there is one endless line); without this they are dropped.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # torchrun/SLURM variables, or one process without them; args is left alone
    info = init_distributed_mode(device=args.device)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(info.device)
    if info.distributed:  # DDP copies rank 0's initial weights to the others
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    train_set, val_set = make_dataset(4096, seed=1), make_dataset(1000, seed=2)
    # Each rank reads its 1/world_size share; evaluate() drops the val sampler's padding.
    train_sampler = DistributedSampler(train_set, info.world_size, info.rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, info.world_size, info.rank, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss = train_one_epoch(model, optimizer, train_loader, info.device, epoch)
        result = evaluate(model, val_loader, info.device)  # exact, summed over all ranks
        if is_main_process():
            print(f"epoch {epoch}: train loss {loss:.4f}  val accuracy {result.top1:.4f} "
                  f"({result.correct}/{result.num_samples})")
    cleanup()


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
