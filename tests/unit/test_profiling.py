"""train.profile_steps: torch.profiler over a stage's steps, written next to the run's metrics."""

import json

import torch

from hf_mixers.recipes.config import load_recipe
from hf_mixers.recipes.processes import Processes
from hf_mixers.recipes.run_plan import plan_training
from hf_mixers.recipes.trainer import run_stage


def _train(tmp_path, steps, profile_steps):
    train = load_recipe([], [f"train.profile_steps={profile_steps}", "train.precision=fp32",
                             f"output.dir={tmp_path}"]).train
    weight = torch.nn.Parameter(torch.ones(4, 4))
    reads = []

    def loss_fn(batch, metrics):
        loss = (batch.float() @ weight).pow(2).mean()
        reads.append(float(loss.detach()))  # one host read per step: what the summary counts
        return loss, {}

    run_stage("stage2", loss_fn, {"weight": weight}, torch.arange(64).view(16, 4), steps,
              plan_training(train, torch.device("cpu")), 1e-3,
              str(tmp_path), checkpoint_every=100, progress=False, processes=Processes())


def test_the_steps_after_the_first_two_are_profiled_and_summarised(tmp_path):
    _train(tmp_path, steps=5, profile_steps=2)
    text = (tmp_path / "profile_stage2.txt").read_text()
    header = dict(line.strip().split(": ", 1) for line in text.split("\n\n")[0].splitlines()[1:])
    assert text.startswith("stage2: torch.profiler over 2 step(s) after 2 unrecorded (cpu)")
    assert float(header["wall_s_per_step"]) > 0 and float(header["aten_calls_per_step"]) > 10
    assert float(header["host_reads_per_step"]) >= 1  # float(loss) in loss_fn, loss.item() in the loop
    assert float(header["kernel_launches_per_step"]) == 0  # no CUDA here
    assert "aten::mm" in text  # the operator table
    trace = json.loads((tmp_path / "profile_stage2.json").read_text())
    assert trace["traceEvents"]


def test_a_stage_shorter_than_the_schedule_writes_what_it_recorded_and_profile_steps_0_nothing(tmp_path, capsys):
    _train(tmp_path / "short", steps=3, profile_steps=4)  # one step recorded of four: what there is is written
    assert "over 1 step(s)" in (tmp_path / "short" / "profile_stage2.txt").read_text()
    _train(tmp_path / "off", steps=3, profile_steps=0)
    assert not list((tmp_path / "off").glob("profile_*"))
    assert "recorded nothing" not in capsys.readouterr().err
    _train(tmp_path / "two", steps=2, profile_steps=4)  # ended before its first recorded step: it says so
    assert not list((tmp_path / "two").glob("profile_*"))
    assert "stage2: train.profile_steps recorded nothing: the stage ran 2 step(s)" in capsys.readouterr().err
