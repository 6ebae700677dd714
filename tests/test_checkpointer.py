"""The checkpointer of stateful parts, in one process: a part of one's own is one entry; a part
the file lacks stays as built; the model can be loaded alone; a loaded optimizer keeps this
run's settings and the run's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_same_tensors
from multi_train_utils.checkpoint import Checkpointer, ModelState, OptimizerState, TrainState
from multi_train_utils.checkpoint_io import CheckpointError


class Counter:
    """A resumable piece of one's own: anything with state_dict() and load_state_dict()."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def trained(lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.randn(8, 4)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def parts(model, optimizer, train, **more) -> dict:
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
            "train": train, **more}


def test_a_part_of_ones_own_is_one_entry_saved_and_loaded(tmp_path):
    model, optimizer = trained()
    Checkpointer(tmp_path, parts(model, optimizer, TrainState(epoch=4), counter=Counter(7))).save()
    saved = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert saved["counter"] == {"value": 7} and saved["epoch"] == 4  # the train state: top level

    fresh = nn.Linear(4, 3)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.5)
    train, counter = TrainState(), Counter()
    Checkpointer(tmp_path, parts(fresh, fresh_optimizer, train, counter=counter)).load(
        str(tmp_path / "checkpoint.pth"))
    assert counter.value == 7 and train.epoch == 5  # an epoch saved at its end: the next one
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    # The momentum buffers are the run's; the settings (lr, momentum) this run's flags'.
    ours, theirs = fresh_optimizer.state_dict(), optimizer.state_dict()
    assert all(torch.equal(ours["state"][i]["momentum_buffer"], theirs["state"][i][
        "momentum_buffer"]) for i in theirs["state"])
    assert (fresh_optimizer.param_groups[0]["lr"], fresh_optimizer.param_groups[0]["momentum"]) \
        == (0.5, 0.5)


def test_a_part_the_file_lacks_stays_as_built_and_the_model_loads_alone(tmp_path):
    model, optimizer = trained()
    Checkpointer(tmp_path, parts(model, optimizer, TrainState(epoch=1))).save()
    counter, fresh = Counter(3), nn.Linear(4, 3)
    Checkpointer(tmp_path, {"model": ModelState(fresh), "counter": counter}).load(
        str(tmp_path / "checkpoint.pth"))  # as --eval-only: the model part, nothing else
    assert counter.value == 3
    assert_same_tensors(fresh.state_dict(), model.state_dict())


def test_a_file_without_our_parts_is_refused_not_half_loaded(tmp_path):
    """Lightning's checkpoints have an epoch but no "model": resumed, the model would stay as
    built, silently; weights go through --weights instead."""
    model, optimizer = trained()
    path = tmp_path / "lightning.ckpt"
    torch.save({"epoch": 3, "state_dict": model.state_dict()}, path)
    train = TrainState()
    with pytest.raises(CheckpointError, match="is not a training checkpoint"):
        Checkpointer(tmp_path, parts(*trained(lr=0.2), train)).load(str(path))
    assert train.epoch == 0
