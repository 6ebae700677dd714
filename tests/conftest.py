"""Shared fixtures: tiny generated datasets and helpers to run the launchers as users do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from utils import make_demo_data  # noqa: E402

# Small enough for 2 CPU cores: 32 px, resnet18, a couple of steps per epoch.
TINY_FLAGS = ["--device", "cpu", "--model", "resnet18", "--img-size", "32", "--batch-size", "4",
              "--workers", "0", "--print-freq", "2", "--no-tensorboard"]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a launched training process: one thread each, no stray rank variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "LOCAL_WORLD_SIZE") and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning", **extra)
    return env


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *extra]


def run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo root; output captured as text."""
    return subprocess.run(cmd, cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """5 classes x 12 generated 32 px JPEGs (the demo generator, smaller)."""
    return make_demo_data(tmp_path_factory.mktemp("data") / "flowers", per_class=12, size=32)
