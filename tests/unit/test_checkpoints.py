"""Training checkpoints: safetensors + JSON, never unpickled; a damaged one is one error naming it, with the previous
good checkpoint offered; a save killed half-way resumes from the previous one."""

import os
import pickle

import pytest
import torch
from safetensors import safe_open

from hf_mixers.recipes.config import TrainSection
from hf_mixers.recipes.checkpoint import CheckpointError, previous_checkpoint
from hf_mixers.recipes.strategies import LocalStrategy
from hf_mixers.recipes.processes import Processes
from hf_mixers.recipes.run_plan import plan_training


def cpu_plan(train):
    return plan_training(train, torch.device("cpu"))


def _optimizer(path, seed=0, optimizer="adamw"):
    torch.manual_seed(seed)
    parameters = {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.zeros(4))}
    return LocalStrategy(parameters, cpu_plan(TrainSection(optimizer=optimizer)), 1e-2, Processes(), str(path),
                         loss_fn=None)


def _train_steps(optimizer, count):
    for _ in range(count):
        optimizer.zero_grad()
        (optimizer.parameters["w"].sum(0) * optimizer.parameters["b"] + optimizer.parameters["w"]).pow(2).sum() \
            .backward()
        optimizer.step()


@pytest.mark.parametrize("optimizer, state", [("adamw", "exp_avg"), ("adafactor", "exp_avg_sq_row")])
def test_a_checkpoint_round_trips_without_pickle(tmp_path, optimizer, state):
    path = tmp_path / "stage2.safetensors"
    first = _optimizer(path, optimizer=optimizer)
    _train_steps(first, 2)
    first.save(2, [{"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}])
    with safe_open(str(path), framework="pt") as handle:  # a plain safetensors file: tensors + JSON metadata
        assert "parameter/w" in handle.keys() and f"optimizer/0/{state}" in handle.keys()
    second = _optimizer(path, seed=1, optimizer=optimizer)
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


@pytest.mark.parametrize("library", ["deepspeed", "fsdp"])
def test_a_pickled_checkpoint_of_an_earlier_version_is_refused_unread(tmp_path, library):
    """deepspeed and fsdp runs of earlier versions kept their libraries' pickled checkpoints: never loaded, and
    never silently trained over from step 0 either."""
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    folder = tmp_path / f"stage2-{library}" / "step2"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=rf"stage2-{library}: a checkpoint in the pickled format of earlier "
                                              r"versions, which is no longer read .*new output.dir"):
        _optimizer(tmp_path / "stage2.safetensors").load()
    assert not marker.exists()


def test_a_checkpoint_of_other_tensors_is_refused(tmp_path):
    _optimizer(tmp_path / "stage2.safetensors").save(1, [])
    torch.manual_seed(0)
    other = LocalStrategy({"w": torch.nn.Parameter(torch.randn(3, 4)), "c": torch.nn.Parameter(torch.zeros(4))},
                           cpu_plan(TrainSection()), 1e-2, Processes(), str(tmp_path / "stage2.safetensors"),
                           loss_fn=None)
    with pytest.raises(CheckpointError, match=r"stage2.safetensors: checkpoint does not match this run \(it trains "
                                              r"other tensors: no \['c'\]\); use another output.dir"):
        other.load()


def test_a_cpu_process_moves_models_to_plain_cpu_without_copying():
    """Under torchrun accelerate's CPU device is ``cpu:0``, and ``.to("cpu:0")`` copies every tensor already on the
    CPU (a whole teacher per move); Processes.device is plain ``cpu``, so moving a model there copies nothing."""
    from types import SimpleNamespace

    processes = Processes(SimpleNamespace(device=torch.device("cpu", 0), process_index=0, num_processes=1))
    model = torch.nn.Linear(4, 4)
    storage = model.weight.data_ptr()
    assert processes.device == torch.device("cpu")
    assert model.to(processes.device).weight.data_ptr() == storage
    assert model.weight.to(torch.device("cpu", 0)).data_ptr() != storage  # what it avoids: a copy


def test_main_first_runs_the_block_on_the_main_process_before_the_others():
    """Processes.main_first: rank 0 runs the block, then meets the others at the barrier; every other rank waits at
    the barrier first (a dataset tokenised once into datasets' cache, then read back)."""
    from types import SimpleNamespace

    for rank, expected in ((0, ["block", "barrier"]), (1, ["barrier", "block"])):
        events = []
        accelerator = SimpleNamespace(process_index=rank, num_processes=2,
                                      wait_for_everyone=lambda: events.append("barrier"))
        with Processes(accelerator).main_first():
            events.append("block")
        assert events == expected, rank
    events = []
    with Processes().main_first():  # one process: no barrier at all
        events.append("block")
    assert events == ["block"]


def test_an_fp16_loss_scale_crosses_between_torch_and_deepspeed():
    """A checkpoint's loss scaler is written as (scale, clean steps since the last overflow) beside each scaler's own
    state: a ddp / fsdp run (torch's GradScaler) resumes a DeepSpeed run's scale and progress towards the next
    growth, and the other way round; a bf16 run's checkpoint (no scaler) leaves the scale as it starts."""
    from types import SimpleNamespace

    from hf_mixers.recipes.strategies import DeepSpeedStrategy

    local = LocalStrategy({"w": torch.nn.Parameter(torch.ones(2))}, cpu_plan(TrainSection(precision="fp16")), 1e-2,
                           Processes(), "unused", loss_fn=None)
    speed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # only its scaler: a stand-in for ZeRO's
    speed.fp16, speed.optimizer = True, SimpleNamespace(loss_scaler=SimpleNamespace(
        cur_scale=4096.0, cur_iter=20, last_overflow_iter=12, cur_hysteresis=1))
    saved = speed._scaler_state()
    assert (saved["scale"], saved["clean_steps"]) == (4096.0, 7)
    local._restore_scaler(saved)
    assert local.loss_scale() == 4096.0 and local.scaler.state_dict()["_growth_tracker"] == 7
    fresh = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    fresh.fp16, fresh.optimizer = True, SimpleNamespace(loss_scaler=SimpleNamespace(
        cur_scale=65536.0, cur_iter=0, last_overflow_iter=-1, cur_hysteresis=2))
    fresh._restore_scaler(local._scaler_state())
    assert fresh.loss_scale() == 4096.0 and fresh._scaler_state()["clean_steps"] == 7
    assert fresh.optimizer.loss_scaler.cur_hysteresis == 2  # DeepSpeed's own counter, which torch has not
    local._restore_scaler(None)
    assert local.loss_scale() == 4096.0
