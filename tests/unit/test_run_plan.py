"""recipes/run_plan.py: a recipe resolved once into the frozen plan the stages, the trainer, the strategies, the
memory plan and the summary read."""

import dataclasses
import json

import pytest
import torch

from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.run_plan import plan_run

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def plan(*settings, device=CPU, world=1, **options):
    return plan_run(load_recipe([], list(settings)), device, world, **options)


def test_the_defaults_on_one_cpu():
    run = plan()
    assert (run.dtype, run.strategy, run.world, run.compile_mode) == (torch.float32, "ddp", 1, None)
    assert not (run.shards_model or run.partitions_optimizer or run.releases_host_memory)
    assert [stage.name for stage in run.stages] == ["stage1", "stage2"] and run.selection_steps == 0
    assert "new mixer parameters" in run.stages[0].trains and "LoRA adapters (r = " in run.stages[1].trains
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.dtype = torch.bfloat16  # decided once
    described = json.loads(json.dumps(run.describe()))  # what summary.json keeps
    assert described["dtype"] == "float32" and described["stages"][1]["name"] == "stage2"


@pytest.mark.parametrize("settings, strategy, shards, partitions, releases", [
    (["train.strategy=fsdp"], "fsdp", True, True, True),
    (["train.strategy=deepspeed", "train.zero_stage=2"], "deepspeed ZeRO-2", False, True, True),
    (["train.strategy=deepspeed", "train.zero_stage=3"], "deepspeed ZeRO-3", True, True, True),
    (["train.strategy=fsdp", "train.release_host_memory=false"], "fsdp", True, True, False),
    (["train.release_host_memory=true"], "ddp", False, False, True),
])
def test_each_strategy_decides_what_is_sharded_partitioned_and_released(settings, strategy, shards, partitions,
                                                                        releases):
    run = plan(*settings, world=2)
    assert (run.strategy, run.shards_model, run.partitions_optimizer, run.releases_host_memory) == \
        (strategy, shards, partitions, releases)
    assert not plan(*settings, device=CUDA, planned=True).releases_host_memory  # a GPU's memory is not the host's


def test_a_gpu_run_is_planned_in_bf16_and_compiled():
    """"auto" precision is bf16 on a GPU (planned here for a GPU this machine may lack), and "auto" compile compiles
    the blocks under ddp and fsdp, not under deepspeed."""
    run = plan(device=CUDA, planned=True)
    assert (run.dtype, run.compile_mode) == (torch.bfloat16, "default")
    assert plan("train.strategy=deepspeed", device=CUDA, planned=True).compile_mode is None
    assert plan("train.precision=fp16", "train.compile=reduce-overhead").dtype == torch.float16
    assert plan("train.compile=reduce-overhead").compile_mode == "reduce-overhead"


def test_what_each_stage_trains():
    run = plan("model.keep_attention=kl:1", "stage1.steps=10", "stage1.selection_steps=4", "stage1.train_qkv=true")
    assert run.selection_steps == 4 and run.stages[0].trains.endswith("and q/k/v")
    assert [stage.name for stage in plan("stage1.enabled=false").stages] == ["stage2"]
    finetune = plan("finetune.lora=false", finetune=True)
    assert [(stage.name, stage.trains) for stage in finetune.stages] == [("finetune", "every weight")]
