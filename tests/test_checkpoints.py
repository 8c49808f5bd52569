"""Training checkpoints: safetensors + JSON, never unpickled; a damaged one is one error naming it, with the previous
good checkpoint offered; a save killed half-way resumes from the previous one."""

import os
import pickle

import pytest
import torch
from safetensors import safe_open

from hf_mixers.recipes.config import TrainSection
from hf_mixers.recipes.strategies import CheckpointError, LocalOptimizer, previous_checkpoint
from hf_mixers.recipes.trainer import Processes


def _optimizer(path, seed=0):
    torch.manual_seed(seed)
    parameters = {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.zeros(4))}
    return LocalOptimizer(parameters, TrainSection(), 1e-2, Processes(), str(path), loss_fn=None)


def _train_steps(optimizer, count):
    for _ in range(count):
        optimizer.zero_grad()
        (optimizer.parameters["w"].sum(0) * optimizer.parameters["b"] + optimizer.parameters["w"]).pow(2).sum() \
            .backward()
        optimizer.step()


def test_a_checkpoint_round_trips_without_pickle(tmp_path):
    path = tmp_path / "stage2.safetensors"
    first = _optimizer(path)
    _train_steps(first, 2)
    first.save(2, [{"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}])
    with safe_open(str(path), framework="pt") as handle:  # a plain safetensors file: tensors + JSON metadata
        assert "parameter/w" in handle.keys() and "optimizer/0/exp_avg" in handle.keys()
    second = _optimizer(path, seed=1)
    assert second.load() == (2, [{"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}])
    for name in first.parameters:
        assert torch.equal(first.parameters[name], second.parameters[name])
    _train_steps(first, 1)
    _train_steps(second, 1)  # the optimizer state came back too: the next step is the same
    assert torch.equal(first.parameters["w"], second.parameters["w"])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "pickle"])
def test_a_damaged_checkpoint_names_its_path_and_offers_the_previous(tmp_path, damage):
    path = tmp_path / "stage2.safetensors"
    optimizer = _optimizer(path)
    _train_steps(optimizer, 1)
    optimizer.save(1, [])
    _train_steps(optimizer, 1)
    optimizer.save(2, [])
    assert os.path.exists(previous_checkpoint(str(path)))
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    if damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.write_bytes(pickle.dumps({"parameters": Payload()}))
    with pytest.raises(CheckpointError, match=rf"{path}: the checkpoint cannot be read .*the previous checkpoint "
                                              rf".*previous.safetensors \(step 1\) is intact: delete {path}"):
        _optimizer(path).load()
    assert not marker.exists()  # nothing in the file was ever executed
    os.remove(path)
    assert _optimizer(path).load()[0] == 1  # the way out the error names


def test_a_save_killed_before_completing_resumes_from_the_previous(tmp_path):
    path = tmp_path / "stage1.safetensors"
    optimizer = _optimizer(path)
    optimizer.save(4, [{"step": 4}])
    os.replace(path, previous_checkpoint(str(path)))  # what a kill between the rotation and the write leaves
    assert _optimizer(path).load() == (4, [{"step": 4}])
    assert _optimizer(tmp_path / "none.safetensors").load() is None
