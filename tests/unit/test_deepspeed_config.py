"""train.deepspeed_config (recipes/deepspeed_config.py): a user's DeepSpeed JSON merged with what the recipe sets:
"auto" takes the recipe's value, its own keys are kept, a contradiction or a scheduler is refused when the recipe
loads, naming the file, the key and the recipe field."""

import json

import pytest
import torch

from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.config import RecipeError, TrainSection
from hf_mixers.recipes.deepspeed_config import deepspeed_settings, merged


def write(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(path)


def test_auto_takes_the_recipes_values_and_the_files_own_keys_are_kept(tmp_path):
    user = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
            "bf16": {"enabled": "auto"}, "wall_clock_breakdown": False}
    ours = deepspeed_settings(TrainSection(batch_size=4, grad_accum=2, zero_stage=3), 3e-4, torch.bfloat16)
    config = merged(user, ours, "ds.json")
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert "train_batch_size" not in config  # "auto" for a key the recipe does not set: DeepSpeed's own
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True}
    assert config["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.0, "torch_adam": True,
                                             "betas": [0.9, 0.95]}
    assert config["bf16"] == {"enabled": True} and config["wall_clock_breakdown"] is False


def test_contradictions_and_a_scheduler_are_refused_when_the_recipe_loads(tmp_path):
    path = write(tmp_path, {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 8,
                            "optimizer": {"params": {"lr": 1e-5}}, "scheduler": {"type": "WarmupLR"}})
    with pytest.raises(RecipeError) as error:
        load_recipe([], ["train.strategy=deepspeed", "train.zero_stage=2", f"train.deepspeed_config={path}",
                         "output.dir=unused"])
    message = str(error.value)
    assert f"--set train.deepspeed_config={path}: train.deepspeed_config: {path} disagrees with the recipe" in message
    for part in ("scheduler: the recipe's train.lr_scheduler sets each step's rate",
                 "zero_optimization.stage is 3 there, 2 from train.zero_stage",
                 "gradient_accumulation_steps is 8 there, 1 from train.grad_accum",
                 'optimizer.params.lr is 1e-05 there, 0.001 from train.lr / stage2.lr (set it to "auto")'):
        assert part in message


def test_keys_deepspeed_would_not_read_are_refused_when_the_recipe_loads(tmp_path):
    """A misspelt top-level key, which DeepSpeed itself would silently ignore, and a misspelt key in a section, which
    it would refuse only once the run starts (after conversion), are named when the recipe loads: checked by
    DeepSpeed's own parser (the keys its DeepSpeedConfig reads; the sections' models), with the close known name."""
    settings = ["train.strategy=deepspeed", "output.dir=unused"]
    path = write(tmp_path, {"gradient_acumulation_steps": 2, "steps_per_print": 10,
                            "zero_optimization": {"stage": "auto", "overlap_comm": True}})
    with pytest.raises(RecipeError, match=r"DeepSpeed does not know gradient_acumulation_steps \(did you mean "
                                          r"gradient_accumulation_steps\?\)$"):
        load_recipe([], [*settings, f"train.deepspeed_config={path}"])
    path = write(tmp_path, {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu",
                                                                                         "pin_memoryy": True}}})
    with pytest.raises(RecipeError, match=r"DeepSpeed does not know zero_optimization\.offload_optimizer\.pin_memoryy "
                                          r"\(extra inputs are not permitted\)"):
        load_recipe([], [*settings, f"train.deepspeed_config={path}"])
    path = write(tmp_path, {"train_batch_size": 64, "steps_per_print": 10, "wall_clock_breakdown": False,
                            "zero_optimization": {"stage": "auto", "overlap_comm": True, "reduce_bucket_size": 5e7}})
    load_recipe([], [*settings, f"train.deepspeed_config={path}"])  # known keys pass (the batch: at launch)


@pytest.mark.parametrize("content, said", [("{not json", "not valid JSON"), ("[1, 2]", "is a JSON object")])
def test_a_bad_file_is_named(tmp_path, content, said):
    path = write(tmp_path, content)
    with pytest.raises(RecipeError, match=f"train.deepspeed_config: {path}: .*{said}"):
        load_recipe([], ["train.strategy=deepspeed", f"train.deepspeed_config={path}", "output.dir=unused"])
    with pytest.raises(RecipeError, match="cannot be read"):
        load_recipe([], ["train.strategy=deepspeed", f"train.deepspeed_config={tmp_path / 'none.json'}",
                         "output.dir=unused"])
    with pytest.raises(RecipeError, match="train.deepspeed_config is read with train.strategy=deepspeed only"):
        load_recipe([], [f"train.deepspeed_config={path}", "output.dir=unused"])


def test_zero3_gathers_at_most_two_blocks_ahead_and_a_users_json_may_say_otherwise(tmp_path):
    """ZeRO-3's prefetch and reuse are sized to the model (DeepSpeed's defaults of 1e9 values each let a 1.1B model
    be gathered nearly whole); the plan's bound follows the settings, a user's JSON over them."""
    from hf_mixers.recipes.deepspeed_config import zero3_gathered, zero3_settings

    ours = zero3_settings(hidden=64, largest_block=1000)
    assert ours == {"stage3_param_persistence_threshold": 640, "stage3_prefetch_bucket_size": int(0.9 * 64**2),
                    "stage3_max_live_parameters": 2000, "stage3_max_reuse_distance": 1000}
    assert zero3_gathered(ours, parameters=10**6) == 3000
    assert zero3_gathered({}, parameters=10**6) == 10**6  # DeepSpeed's defaults: everything, for a small model
    assert zero3_gathered({}, parameters=10**10) == 2 * 10**9
    train = TrainSection(zero_stage=3)
    config = merged({"zero_optimization": {"stage3_max_live_parameters": 5000, "stage3_max_reuse_distance": "auto"}},
                    {**deepspeed_settings(train, 1e-3, torch.float32),
                     "zero_optimization": {"stage": 3, **ours}}, "ds.json")
    assert config["zero_optimization"]["stage3_max_live_parameters"] == 5000
    assert config["zero_optimization"]["stage3_max_reuse_distance"] == 1000
