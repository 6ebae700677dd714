"""Data-parallel training started by torchrun (or SLURM's srun, or plain python).

    torchrun --nproc_per_node=4 train_multi_gpu_using_launch.py --data-path flower_photos
    python -m torch.distributed.launch --use_env --nproc_per_node=4 train_multi_gpu_using_launch.py ...
    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --device cpu   # gloo, no GPU
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        train_multi_gpu_using_launch.py ...                                   # two machines
    torchrun --nproc_per_node=4 --max-restarts=3 train_multi_gpu_using_launch.py ...
        # a dead worker restarts the group, which resumes from <output-dir>/checkpoint.pth
    srun python train_multi_gpu_using_launch.py ...                          # SLURM, one task per GPU
    python train_multi_gpu_using_launch.py ...                               # one process

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; each process runs the shared
worker in ``train_common.py``.
"""

import argparse
import os

# Read before importing torch (seconds): a torchrun killed meanwhile must not leave this rank
# training on as an orphan (train_common.die_with_launcher).
_LAUNCHER_PID = os.getppid()

from train_common import get_args_parser as _common_parser  # noqa: E402
from train_common import train  # noqa: E402


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    return _common_parser(add_help=add_help, launcher="launch")


def main(args: argparse.Namespace) -> None:
    train(args, launcher_pid=_LAUNCHER_PID)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
