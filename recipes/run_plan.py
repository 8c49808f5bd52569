"""A recipe resolved once for a launch: the decisions every part of a run reads.

``plan_run(recipe, device, world)`` turns the recipe's switches ("auto" precision, compile and host-memory release;
the strategy and its ZeRO stage; kl:K's selection; which stages train what) into one frozen ``RunPlan``. The stages
(stages.py, sft.py), the trainer, the sharding strategies, the memory plan (``--plan``) and the run's summary
(``summary.json`` and the saved folder's training summary) read it; none of them decides these again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.dtypes import dtype_name
from .config import Recipe, TrainSection, compile_mode, releases_host_memory, selects_after_stage1, shards_the_model
from .precision import training_dtype


@dataclass(frozen=True)
class StagePlan:
    """One stage that trains: its name, its optimizer steps, and what it trains (everything else is frozen)."""
    name: str
    steps: int
    trains: str


@dataclass(frozen=True)
class RunPlan:
    """What a run on ``world`` processes of ``device`` does, decided once from its recipe.

    dtype: the training dtype (the teacher, the frozen weights, autocast); what trains is kept in fp32.
    shards_model: fsdp and ZeRO-3 partition the whole student over the processes.
    partitions_optimizer: fsdp and deepspeed keep 1/N of the optimizer states per process.
    releases_host_memory: each block's freed memory handed back to the OS (``train.release_host_memory``; a CPU host).
    compile_mode: the torch.compile mode of the decoder blocks' training step, or None (eager).
    selection_steps: kl:K ranks the layers after this many stage-1 steps (0: at conversion, or no ranking).
    stages: the stages that train, in order.
    """
    train: TrainSection
    device: torch.device
    world: int
    dtype: torch.dtype
    shards_model: bool
    partitions_optimizer: bool
    releases_host_memory: bool
    compile_mode: str | None
    selection_steps: int = 0
    stages: tuple[StagePlan, ...] = ()

    @property
    def strategy(self) -> str:
        """"ddp", "fsdp", or "deepspeed ZeRO-N"."""
        train = self.train
        return train.strategy + (f" ZeRO-{train.zero_stage}" if train.strategy == "deepspeed" else "")

    def describe(self) -> dict:
        """The plan as JSON values (the run's summary keeps it)."""
        return {"device": self.device.type, "processes": self.world, "dtype": dtype_name(self.dtype),
                "strategy": self.strategy, "shards_model": self.shards_model,
                "partitions_optimizer": self.partitions_optimizer, "releases_host_memory": self.releases_host_memory,
                "compile_mode": self.compile_mode, "selection_steps": self.selection_steps,
                "stages": [{"name": stage.name, "steps": stage.steps, "trains": stage.trains} for stage in self.stages]}


def plan_training(train: TrainSection, device: torch.device, world: int = 1, planned: bool = False,
                  **decided) -> RunPlan:
    """The plan of a run's ``train`` section on ``world`` processes of ``device`` (``planned``: for a device this
    machine lacks, ``--plan``'s case: see ``training_dtype``); ``decided``: the recipe's own fields
    (``selection_steps``, ``stages``)."""
    return RunPlan(train=train, device=device, world=world, dtype=training_dtype(train.precision, device, planned),
                   shards_model=shards_the_model(train),
                   partitions_optimizer=train.strategy in ("deepspeed", "fsdp"),
                   releases_host_memory=releases_host_memory(train) and device.type == "cpu",
                   compile_mode=compile_mode(train, device), **decided)


def plan_run(recipe: Recipe, device: torch.device, world: int = 1, planned: bool = False,
             finetune: bool = False) -> RunPlan:
    """``recipe`` resolved for ``world`` processes of ``device``: a distillation's stages, or (``finetune``) the
    fine-tuning stage of ``hf-mixers finetune``."""
    if finetune:
        section = recipe.finetune
        trains = (f"LoRA adapters (r = {section.lora_r}) on {', '.join(section.lora_targets)}" if section.lora
                  else "every weight")
        return plan_training(recipe.train, device, world, planned, stages=(StagePlan("finetune", section.steps,
                                                                                      trains),))
    stages = []
    if recipe.stage1.enabled and recipe.stage1.steps > 0:
        trains = "the converted layers' new mixer parameters" + (" and q/k/v" if recipe.stage1.train_qkv else "")
        stages.append(StagePlan("stage1", recipe.stage1.steps, trains))
    if recipe.stage2.enabled and recipe.stage2.steps > 0:
        targets = ", ".join(recipe.stage2.lora_targets)
        trains = f"LoRA adapters (r = {recipe.stage2.lora_r}) on {targets}"
        stages.append(StagePlan("stage2", recipe.stage2.steps, trains))
    selection = recipe.stage1.selection_steps if selects_after_stage1(recipe) else 0
    return plan_training(recipe.train, device, world, planned, selection_steps=selection, stages=tuple(stages))
