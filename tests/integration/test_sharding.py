"""Sharding the whole student over processes: FSDP2 (train.strategy=fsdp) and DeepSpeed ZeRO-3, on CPU.

Each run is `hf-mixers distill` under torchrun with 2 CPU processes (gloo), stage 1 and stage 2, world size 2,
each rank its own micro-batches. A sharded run must give the losses and the saved weights of the data-parallel run
(`train.strategy=ddp`), and a relaunch with more steps must resume from its checkpoints with the same losses (each
strategy's run is resumed under the other: one checkpoint format).
"""

import importlib.util
import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import tiny_sessa_model, torchrun_distill
from hf_mixers.recipes import RecipeError, distill, load_recipe
from hf_mixers.recipes.stages import sharding_for
from hf_mixers.recipes.strategies import _meta_skeleton, _restore_whole
from test_recipes import small

STEPS = ["stage1.steps=2", "train.batch_size=1", "output.checkpoint_every=1"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
# DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (AVX512-FP16 / AMX-FP16 CPUs): elsewhere
# a ZeRO fp16 run is refused before any work (test_fp16_under_deepspeed_is_refused_where_its_accelerator_has_none)
DEEPSPEED_FP16 = HAS_DEEPSPEED and torch.ops.mkldnn._is_mkldnn_fp16_supported()
needs_deepspeed_fp16 = pytest.mark.skipif(not DEEPSPEED_FP16, reason="deepspeed is not installed, or its CPU "
                                          "accelerator has no fp16 on this CPU (no AVX512-FP16 / AMX-FP16)")


def distill_on_two_processes(teacher_dir, out, *settings) -> str:
    """`hf-mixers distill` on 2 CPU processes; returns its stdout (rank 0 reports what it sharded there)."""
    return torchrun_distill(small(teacher_dir, out, *STEPS, *settings), timeout=600)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data_parallel(teacher_dir, tmp_path_factory):
    """The reference: train.strategy=ddp, 2 stage-1 and 4 stage-2 steps, uninterrupted (rank 0's stdout beside)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    said = distill_on_two_processes(teacher_dir, out, "stage2.steps=4")
    (out.parent / "stdout.txt").write_text(said)
    return out


def test_two_processes_split_the_data_and_average_gradients(teacher_dir, data_parallel, tmp_path):
    """torchrun, 2 CPU processes (gloo) under DistributedDataParallel: world size 2, each rank trains on different
    blocks, one model written, and the losses of one process accumulating both ranks' micro-batches (what the other
    tests' one-process references rely on)."""
    said = (data_parallel.parent / "stdout.txt").read_text()
    assert "stage2: ddp: DistributedDataParallel over 2 processes" in said
    rows = metrics(data_parallel)
    assert len(rows) == 6 and all(row["world_size"] == 2 for row in rows)  # rank 0 alone writes
    for row in rows:
        first, second = row["first_tokens_per_rank"]
        assert first != second  # each rank saw its own block
    summary = json.loads((data_parallel / "summary.json").read_text())
    assert summary["world_size"] == 2 and (data_parallel / "model" / "model.safetensors").exists()
    # rank r takes micro-batch 2 * step + r: the same blocks as one process accumulating 2 micro-batches, so the
    # averaged gradients must give the same losses
    single = distill(load_recipe([], small(teacher_dir, tmp_path / "single", *STEPS, "stage2.steps=4",
                                           "train.grad_accum=2")), progress=False)
    expected = metrics(tmp_path / "single")
    assert [row["first_tokens_per_rank"][0] for row in expected] == [row["first_tokens_per_rank"][0] for row in rows]
    for got, want in zip(rows, expected):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * max(1.0, abs(want["loss"])), (got, want)
    assert summary["evaluations"]["stage2"]["kl_teacher_student"] == pytest.approx(
        single["evaluations"]["stage2"]["kl_teacher_student"], rel=1e-4, abs=1e-7)


def check_sharded_run(teacher_dir, reference, out, strategy: list[str], between=None, first_strategy=None):
    # 2 stage-2 steps, then the same run relaunched for 4: stage 1 comes back from its checkpoint, stage 2 resumes
    # (under `first_strategy`, when given, for the first launch)
    first = distill_on_two_processes(teacher_dir, out, "stage2.steps=2", *(first_strategy or strategy))
    assert [(r["stage"], r["step"]) for r in metrics(out)] == [("stage1", 1), ("stage1", 2), ("stage2", 1),
                                                                ("stage2", 2)]
    if between:
        between(out)
    distill_on_two_processes(teacher_dir, out, "stage2.steps=4", "output.overwrite=true", *strategy)
    rows, expected = metrics(out), metrics(reference)
    assert [(r["stage"], r["step"]) for r in rows] == [(r["stage"], r["step"]) for r in expected]
    assert all(r["world_size"] == 2 for r in rows)
    for got, want in zip(rows, expected):
        first_tokens, second_tokens = got["first_tokens_per_rank"]
        assert first_tokens != second_tokens and got["first_tokens_per_rank"] == want["first_tokens_per_rank"]
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * max(1.0, abs(want["loss"])), (got, want)
    # rank 0 said how much of the student it kept: about half of it in stage 2 (frozen weights included)
    stored = dict(re.findall(r"(stage[12]): .*this rank stores ([\d.]+)% of them", first))
    assert set(stored) == {"stage1", "stage2"} and float(stored["stage2"]) < 60, first
    # one checkpoint format whatever the strategy: whole tensors as safetensors, nothing pickled
    assert sorted(os.listdir(out / "checkpoints")) == ["stage1.previous.safetensors", "stage1.safetensors",
                                                       "stage2.previous.safetensors", "stage2.safetensors"]
    with safe_open(str(out / "checkpoints" / "stage2.safetensors"), framework="pt") as handle:
        assert json.loads(handle.metadata()["hf_mixers"])["step"] == 4
    # the exported folder: the same tensors as the data-parallel run's, and it loads. Adam turns float-level
    # gradient differences (ZeRO-3 reduces in other buckets) into weight differences up to ~1e-5; a missed or doubled
    # update would differ by about lr = 3e-3
    saved, wanted = load_file(out / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    assert saved.keys() == wanted.keys()
    for name in wanted:
        torch.testing.assert_close(saved[name], wanted[name], rtol=1e-4, atol=1e-4, msg=name)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    for name, tensor in model.state_dict().items():
        if name in saved:
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)


ZERO3 = ["train.strategy=deepspeed", "train.zero_stage=3"]


def test_fsdp_under_torchrun_matches_data_parallel_and_resumes(teacher_dir, data_parallel, tmp_path):
    """FSDP2's two steps, its last checkpoint lost to a kill while saving, continue under ZeRO-3 (under FSDP where
    deepspeed is not installed) as if uninterrupted: the checkpoint holds whole tensors, whatever the strategy."""
    def killed_while_saving_step_2(out):  # step 1's checkpoint set aside as .previous, step 2's never written
        os.remove(out / "checkpoints" / "stage2.safetensors")

    resumed = ZERO3 if HAS_DEEPSPEED else ["train.strategy=fsdp"]
    check_sharded_run(teacher_dir, data_parallel, tmp_path / "fsdp", resumed, between=killed_while_saving_step_2,
                      first_strategy=["train.strategy=fsdp"])


@needs_deepspeed
def test_deepspeed_zero3_under_torchrun_matches_data_parallel_and_resumes(teacher_dir, data_parallel, tmp_path):
    """ZeRO-3's two steps continue under FSDP2 as if uninterrupted (and FSDP's under ZeRO-3 in the test above); the
    ZeRO-3 launch recomputes its mixers (stage 1) and blocks (stage 2) in the backward pass and hands each block's
    freed memory back to the OS (train.gradient_checkpointing, train.release_host_memory), losses unchanged."""
    check_sharded_run(teacher_dir, data_parallel, tmp_path / "zero3", ["train.strategy=fsdp"],
                      first_strategy=[*ZERO3, "train.gradient_checkpointing=true", "train.release_host_memory=true"])


@needs_deepspeed
def test_bf16_under_every_sharding_strategy_tracks_the_fp32_run(teacher_dir, tmp_path):
    """train.precision=bf16 under FSDP2 (MixedPrecisionPolicy: bf16 gathers, fp32 reduce-scatter and masters) and
    DeepSpeed ZeRO-2 and ZeRO-3 (its bf16 block: fp32 masters in the partitions), 2 CPU processes, and as ddp runs it
    (autocast, fp32 masters and gradients, which DistributedDataParallel averages as in fp32): every loss within 1%
    of the fp32 run (a selective-SSM conversion: losses of order 1), and not equal to it. The fp32 and ddp runs are
    one process accumulating both ranks' micro-batches (test_two_processes_split_the_data_and_average_gradients:
    the same losses as gradient averaging on 2 processes; two launches less, ~25 s each)."""
    settings = [f"model.teacher={teacher_dir}", "model.mixer=selective_ssm", "data.sequence_length=32",
                "data.max_train_sequences=8", "data.heldout_sequences=2", "data.wider_evaluations=false",
                "stage1.steps=3", "stage2.steps=3", "train.lr=3e-3", "train.batch_size=1"]
    losses = {}
    for name, precision in (("fp32", "fp32"), ("ddp", "bf16")):
        out = tmp_path / name
        distill(load_recipe([], [*settings, f"train.precision={precision}", "train.grad_accum=2",
                                 f"output.dir={out}"]), progress=False)
        losses[name] = [row["loss"] for row in metrics(out)]
    runs = {"fsdp": ["train.strategy=fsdp"], "zero2": ["train.strategy=deepspeed", "train.zero_stage=2"],
            "zero3": ["train.strategy=deepspeed", "train.zero_stage=3"]}
    for name, extra in runs.items():
        out = tmp_path / name
        torchrun_distill([*settings, "train.precision=bf16", *extra, f"output.dir={out}"], timeout=600)
        assert json.loads((out / "summary.json").read_text())["precision"] == "bfloat16"
        losses[name] = [row["loss"] for row in metrics(out)]
    assert len(losses["fp32"]) == 6 and losses["fp32"][0] > 0.1
    for name in ("ddp", "fsdp", "zero2", "zero3"):
        assert losses[name] == pytest.approx(losses["fp32"], rel=1e-2, abs=1e-4), name
        assert losses[name] != losses["fp32"], name


FP16 = ["train.precision=fp16", "stage2.steps=4"]
ZERO2 = ["train.strategy=deepspeed", "train.zero_stage=2"]


def _fp16_run(teacher_dir, reference, out, strategy) -> list[dict]:
    """An fp16 run on 2 CPU processes: every row has its loss scale and the first loss (the same weights, the same
    batch) is the fp32 run's within 1%."""
    distill_on_two_processes(teacher_dir, out, *FP16, *strategy)
    assert json.loads((out / "summary.json").read_text())["precision"] == "float16"
    rows = metrics(out)
    assert [(r["stage"], r["step"]) for r in rows] == [(r["stage"], r["step"]) for r in reference]
    assert all(row["loss_scale"] in (2.0**13, 2.0**14, 2.0**15, 2.0**16) for row in rows), rows
    assert rows[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-2)
    return rows


def test_fp16_scales_the_loss_under_fsdp(teacher_dir, data_parallel, tmp_path):
    """train.precision=fp16 under FSDP2: torch's GradScaler, as under ddp, FSDP's overflow check reduced over the
    ranks."""
    _fp16_run(teacher_dir, metrics(data_parallel), tmp_path / "fsdp", ["train.strategy=fsdp"])


@needs_deepspeed_fp16
def test_fp16_scales_the_loss_under_zero2_and_resumes_its_scale(teacher_dir, data_parallel, tmp_path):
    """train.precision=fp16 under DeepSpeed ZeRO-2 (its own dynamic scaler, its fp16 block). A run stopped after
    stage 2's second step continues with its scaler's saved state (scale, hysteresis, counters): the losses and
    scales of the run that was not stopped."""
    whole = _fp16_run(teacher_dir, metrics(data_parallel), tmp_path / "zero2", ZERO2)
    out = tmp_path / "zero2-stopped"
    distill_on_two_processes(teacher_dir, out, "train.precision=fp16", "stage2.steps=2", *ZERO2)
    distill_on_two_processes(teacher_dir, out, *FP16, *ZERO2, "output.overwrite=true")
    rows = metrics(out)
    assert [row["loss_scale"] for row in rows] == [row["loss_scale"] for row in whole]
    assert [row["loss"] for row in rows] == pytest.approx([row["loss"] for row in whole], rel=1e-6)
    with safe_open(str(out / "checkpoints" / "stage2.safetensors"), framework="pt") as handle:
        scaler = json.loads(handle.metadata()["hf_mixers"])["loss_scaler"]
    assert scaler["scale"] == whole[-1]["loss_scale"] and set(scaler["deepspeed"]) >= {"cur_scale", "cur_hysteresis"}


@needs_deepspeed
def test_fp16_under_deepspeed_is_refused_where_its_accelerator_has_none(monkeypatch):
    """Where DeepSpeed's accelerator has no fp16 (a CPU without AVX512-FP16 / AMX-FP16), the launch check refuses
    train.precision=fp16 under deepspeed by name, before the models load (DeepSpeed's engine would refuse it after)."""
    from deepspeed.accelerator import get_accelerator

    from hf_mixers.recipes.config import TrainSection
    from hf_mixers.recipes.strategies import check_launch

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # as under torchrun
    with pytest.raises(ValueError, match=r"train.precision=fp16 under train.strategy=deepspeed: DeepSpeed's \w+ "
                                         r"accelerator has no fp16 here .* use train.precision=bf16"):
        check_launch(TrainSection(strategy="deepspeed", zero_stage=2, precision="fp16"))
    check_launch(TrainSection(strategy="deepspeed", zero_stage=2, precision="bf16"))


@needs_deepspeed_fp16
def test_a_zero2_fp16_run_whose_every_step_overflowed_checkpoints_and_resumes(teacher_dir, tmp_path):
    """A user's DeepSpeed JSON starting the scale at 2^32 (hysteresis 1): every step overflows and is skipped, so
    the optimizer never stepped and has no Adam state. Its checkpoints hold the parameters and the scaler only, and
    a relaunch with one more stage-2 step resumes from them (the scale halving on from where it stopped)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"fp16": {"initial_scale_power": 32, "hysteresis": 1}}))
    settings = ["train.precision=fp16", "train.strategy=deepspeed", "train.zero_stage=2",
                f"train.deepspeed_config={config}"]
    out = tmp_path / "run"
    distill_on_two_processes(teacher_dir, out, *settings, "stage2.steps=2")
    first = metrics(out)
    assert [row["loss_scale"] for row in first] == [2.0**31, 2.0**30, 2.0**31, 2.0**30]  # a new scaler per stage
    with safe_open(str(out / "checkpoints" / "stage2.safetensors"), framework="pt") as handle:
        assert not [key for key in handle.keys() if key.startswith("optimizer/")]
        assert json.loads(handle.metadata()["hf_mixers"])["loss_scaler"]["scale"] == 2.0**30
    distill_on_two_processes(teacher_dir, out, *settings, "stage2.steps=3", "output.overwrite=true")
    rows = metrics(out)
    assert rows[:4] == first and rows[4]["loss_scale"] == 2.0**29


def test_sharding_recipes_are_checked(teacher_dir, tmp_path):
    with pytest.raises(RecipeError, match="train.zero_stage must be 1, 2 or 3"):
        load_recipe([], ["train.strategy=deepspeed", "train.zero_stage=4"])
    for strategy in (["train.strategy=fsdp"], ["train.strategy=deepspeed", "train.zero_stage=3"]):
        with pytest.raises(RecipeError, match=r"stage1.blockwise trains one layer at a time in one process, but "
                                              r"train.strategy=(fsdp|deepspeed with train.zero_stage=3) shards"):
            load_recipe([], [*strategy, "stage1.blockwise=true"])
        load_recipe([], [*strategy, "stage1.blockwise=true", "stage1.enabled=false"])  # stage 2 alone is fine
        # without torchrun there is nothing to shard over: said before any model is loaded
        with pytest.raises(ValueError, match="shards the student over the processes .* launch it with torchrun"):
            distill(load_recipe([], small(teacher_dir, tmp_path / "run", *strategy)), progress=False)
    load_recipe([], ["train.strategy=deepspeed", "train.zero_stage=2", "stage1.blockwise=true"])  # ZeRO-2 is not


def test_an_accelerate_sharding_plugin_the_recipe_does_not_ask_for_is_refused(teacher_dir, tmp_path, monkeypatch):
    """`accelerate launch` with an FSDP / DeepSpeed config: the trainer would not use the plugin, so it says so."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match=r"turns on fsdp \(ACCELERATE_USE_FSDP\), but the recipe has "
                                         r"train.strategy=ddp.*Stack recipes/fsdp.yaml"):
        distill(load_recipe([], small(teacher_dir, tmp_path / "run")), progress=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="turns on deepspeed .* train.strategy=fsdp"):
        distill(load_recipe([], small(teacher_dir, tmp_path / "run", "train.strategy=fsdp")), progress=False)


def test_an_agreeing_accelerate_config_is_used_and_a_disagreeing_one_named(monkeypatch, tmp_path):
    """from_accelerate_config: with the recipe's strategy, accelerate's DeepSpeed JSON becomes
    train.deepspeed_config; another ZeRO stage, another JSON, FSDP's SHARD_GRAD_OP or parameter offload are errors
    that name both sides; without an accelerate plugin the recipe is untouched."""
    from dataclasses import replace

    from hf_mixers.recipes.strategies import from_accelerate_config

    ds = load_recipe([], ["train.strategy=deepspeed", "train.zero_stage=2"]).train
    assert from_accelerate_config(ds) is ds
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    assert from_accelerate_config(ds).deepspeed_config == str(tmp_path / "ds.json") and ds.deepspeed_config is None
    with pytest.raises(ValueError, match=r"names the DeepSpeed config .*ds.json, the recipe "
                                         r"train.deepspeed_config=.*mine.json: give one of them"):
        from_accelerate_config(replace(ds, deepspeed_config=str(tmp_path / "mine.json")))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="has zero_stage 3, the recipe train.zero_stage=2"):
        from_accelerate_config(ds)
    for variable in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(variable)
    fsdp = load_recipe([], ["train.strategy=fsdp"]).train
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    assert from_accelerate_config(fsdp) == fsdp
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    with pytest.raises(ValueError, match="sharding strategy SHARD_GRAD_OP; train.strategy=fsdp shards fully"):
        from_accelerate_config(fsdp)
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "1")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match="offloads FSDP parameters to the CPU"):
        from_accelerate_config(fsdp)


def test_a_sharded_model_comes_back_whole_in_place():
    """The gathered weights go back into the same module object: plain tensors, tied weights still one tensor."""
    model = tiny_sessa_model(feedback=False, tie_word_embeddings=True)
    sharding = sharding_for(model)
    assert sharding.units == list(model.model.layers) and sharding.root is model
    assert [unit is block.mixer for unit, block in zip(sharding_for(model, [1]).units, model.model.layers[1:])] == [True]
    skeleton = _meta_skeleton(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    trained = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    _restore_whole(model, skeleton, trained)
    for name, parameter in model.named_parameters():
        assert not parameter.is_meta and torch.equal(parameter, trained[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model(torch.randint(0, 101, (1, 5))).logits.shape == (1, 5, 101)
