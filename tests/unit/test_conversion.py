"""hf_mixers.conversion on tiny random teachers of every supported family, built and saved offline."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, GPT2LMHeadModel

from conftest import TEACHER_FAMILIES, first_in_fast, tiny_teacher, tiny_tokenizer
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.conversion import (ConversionReport, TeacherLoadError, UnsupportedArchitecture, convert,
                                  load_teacher)
from hf_mixers.common.remote_check import load_in_fresh_process

SMALL = dict(sequence_length=48, calibration_sequences=4, heldout_sequences=2, progress=False)
RSA_SMALL = {"rsa_num_slots": 8, "rsa_num_levels": 2}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tokenizer):
    """{family: folder} of saved tiny teachers with the tokenizer (chat template) and a generation config."""
    folders = {}
    for family in TEACHER_FAMILIES:
        folder = str(tmp_path_factory.mktemp(f"teacher-{family}"))
        tiny_teacher(family, len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[family] = folder
    return folders


def teacher_logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", TEACHER_FAMILIES)
def test_sessa_conversion_is_exact(family, teachers, tmp_path):
    model, report = convert(teachers[family], "sessa", out=str(tmp_path / "out"), **SMALL)
    ids = torch.randint(1, 300, (2, 40))
    with torch.no_grad():
        difference = (model(ids).logits - teacher_logits(teachers[family], ids)).abs().max().item()
    assert difference <= 1e-5
    assert report.family == family and report.layers_converted == [0, 1, 2] and report.layers_kept == []
    assert all(layer.error < 1e-6 for layer in report.layers)
    assert report.kl_teacher_student < 1e-8 and report.top1_agreement == 1.0
    assert report.student_perplexity == pytest.approx(report.teacher_perplexity, rel=1e-5)
    assert report.verified_tensors == len(AutoModelForCausalLM.from_pretrained(teachers[family]).state_dict())
    assert report.parameters_added == 3 * (64 * 2 * 64 + 2 * 64 + 64 + 1)  # feedback q/k (+bias), w_gamma, b_gamma


@pytest.mark.parametrize("family", TEACHER_FAMILIES)
def test_rsa_conversion_runs_on_every_family(family, teachers, tmp_path):
    model, report = convert(teachers[family], "rsa", mixer_options=RSA_SMALL, **SMALL)
    assert [layer.kind for layer in report.layers] == ["rsa"] * 3
    assert all(0 < layer.error < 1 for layer in report.layers)
    assert torch.isfinite(torch.tensor(report.student_perplexity)) and report.kl_teacher_student >= 0
    assert model.config.rsa_readout == "softmax_count"  # the conversion default (spec §11.2)
    assert model.config.qk_norm == (family == "qwen3")


@pytest.mark.parametrize("family", TEACHER_FAMILIES)
@pytest.mark.parametrize("variant", ["s6", "s4d", "mamba2", "delta_t"])
def test_selective_ssm_conversion_runs_on_every_family_and_variant(family, variant, teachers):
    model, report = convert(teachers[family], "selective_ssm", mixer_options={"selective_ssm_variant": variant},
                            **SMALL)
    assert [layer.kind for layer in report.layers] == ["selective_ssm"] * 3
    assert all(0 < layer.error < float("inf") for layer in report.layers)
    assert torch.isfinite(torch.tensor(report.student_perplexity)) and report.kl_teacher_student >= 0
    config = model.config
    assert (config.selective_ssm_conv_mode, config.selective_ssm_conv_activation) == ("independent", "identity")
    assert config.qk_norm == (family == "qwen3") and config.selective_ssm_variant == variant


@pytest.mark.parametrize("family", first_in_fast(*TEACHER_FAMILIES))  # ~6 s a family
def test_gltm_dense_conversion_keeps_the_teacher_and_sparse_patterns_calibrate_their_gates(family, teachers):
    ids = torch.randint(1, 300, (2, 40))
    model, report = convert(teachers[family], "gltm", mixer_options={"gltm_pattern": "dense"}, **SMALL)
    with torch.no_grad():  # the gate stays off (1e-6): the teacher to ~1e-6 relative
        assert (model(ids).logits - teacher_logits(teachers[family], ids)).abs().max().item() <= 1e-4
    assert all(layer.error < 1e-5 for layer in report.layers) and report.top1_agreement == 1.0
    assert model.config.qk_norm == (family == "qwen3")
    mixer = model.model.layers[0].mixer
    torch.testing.assert_close(mixer.qb_proj.weight, mixer.q_proj.weight)  # the B-branch mirrors q / k
    torch.testing.assert_close(mixer.kb_proj.weight, mixer.k_proj.weight)
    for options in ({"gltm_pattern": "pow2_ce"}, {"gltm_pattern": "quad_ce"}, {"gltm_pattern": "banded"},
                    {"gltm_pattern": "pow2_ce", "gltm_weight_sharing": True},
                    {"gltm_pattern": "ssm", "gltm_ssm_rule": "mamba"}):
        model, report = convert(teachers[family], "gltm", mixer_options=options, **SMALL)
        assert [layer.kind for layer in report.layers] == ["gltm"] * 3
        assert all(0 < layer.error < float("inf") for layer in report.layers), options
        assert torch.isfinite(torch.tensor(report.student_perplexity))
        if not options.get("gltm_weight_sharing") and options["gltm_pattern"] != "ssm":
            assert all(layer.error < 1 for layer in report.layers)  # the calibrated gate beats silence
            assert all("calibrated: error" in layer.note for layer in report.layers)  # the chosen gate, per layer


@pytest.mark.parametrize("family", first_in_fast(*TEACHER_FAMILIES))
def test_vort_conversion_keeps_the_teacher_inside_its_window_on_every_family(family, teachers):
    """The conversion defaults: window 64 (longer than these 40 tokens), one shared normaliser, so the converted
    model is its teacher; with a 16-token window the power-law memory takes part and stays finite."""
    ids = torch.randint(1, 300, (2, 40))
    model, report = convert(teachers[family], "vort", **SMALL)
    assert [layer.kind for layer in report.layers] == ["vort"] * 3
    config = model.config
    assert (config.vort_window, config.vort_combine, config.vort_global_rope, config.vort_alpha_init,
            config.vort_feature_map) == (64, "shared_normalizer", True, 0.95, "hedgehog")
    with torch.no_grad():
        assert (model(ids).logits - teacher_logits(teachers[family], ids)).abs().max().item() <= 1e-4
    model, report = convert(teachers[family], "vort", mixer_options={"vort_window": 16}, **SMALL)
    assert all(0 < layer.error < float("inf") for layer in report.layers)
    assert torch.isfinite(torch.tensor(report.student_perplexity)) and config.qk_norm == (family == "qwen3")


def test_rope_scaling_is_carried_over(tokenizer, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    folder = str(tmp_path / "llama3")
    teacher = tiny_teacher("llama", len(tokenizer), rope_parameters=rope)
    teacher.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, _ = convert(folder, "sessa", **SMALL)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(1, 300, (1, 96))  # beyond original_max_position_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, teacher(ids).logits, rtol=0, atol=1e-5)


def test_copied_tensors_and_ties(teachers):
    for family, tied in (("llama", True), ("qwen2", False)):
        teacher = AutoModelForCausalLM.from_pretrained(teachers[family])
        model, _ = convert(teachers[family], "rsa", mixer_options=RSA_SMALL, **SMALL)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert torch.equal(model.model.layers[1].mixer.k_proj.weight, teacher.model.layers[1].self_attn.k_proj.weight)
        assert torch.equal(model.model.layers[2].mlp.down_proj.weight, teacher.model.layers[2].mlp.down_proj.weight)
        if family == "qwen2":
            assert torch.equal(model.model.layers[0].mixer.q_proj.bias, teacher.model.layers[0].self_attn.q_proj.bias)
        # the student owns its tensors: training it can never change the teacher
        assert model.model.embed_tokens.weight.data_ptr() != teacher.model.embed_tokens.weight.data_ptr()


def test_output_folder_loads_without_hf_mixers_and_generates(teachers, tmp_path):
    out = tmp_path / "hybrid"
    model, report = convert(teachers["qwen3"], "rsa", keep_attention="auto:1", mixer_options=RSA_SMALL,
                            out=str(out), **SMALL)
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "chat_template.jinja",
            "conversion_report.json", "conversion_report.md", "modeling_hf_mixers.py"} <= names
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
    ids = torch.randint(1, 300, (1, 12))
    remote = load_in_fresh_process(out, ids, max_new_tokens=6)
    assert not remote["hf_mixers_imported"] and remote["class"] == "RSAForCausalLM"
    assert remote["tokenizer"] is not None  # AutoTokenizer without trust_remote_code accepts the saved config
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], model(ids).logits, rtol=0, atol=1e-5)
    assert remote["tokens"].shape == (1, 18)
    saved = ConversionReport.load(out)
    assert saved.layers_kept == report.layers_kept and len(saved.layers_kept) == 1
    assert "Conversion report" in (out / "conversion_report.md").read_text()


def test_conversion_is_deterministic(teachers, tmp_path):
    for name in ("a", "b"):
        convert(teachers["llama"], "rsa", mixer_options=RSA_SMALL, out=str(tmp_path / name), **SMALL)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()


def test_keep_attention_auto_keeps_the_worst_layers(teachers):
    _, full = convert(teachers["llama"], "rsa", mixer_options=RSA_SMALL, **SMALL)
    errors = {layer.index: layer.error for layer in full.layers}
    worst = sorted(sorted(errors, key=errors.get, reverse=True)[:2])
    model, report = convert(teachers["llama"], "rsa", keep_attention="auto:2", mixer_options=RSA_SMALL, **SMALL)
    assert report.layers_kept == worst and report.layers_converted == [i for i in range(3) if i not in worst]
    assert [model.config.layer_types[i] for i in worst] == ["full_attention"] * 2
    assert all(report.layers[i].note == "kept as attention" for i in worst)


def test_keep_attention_kl_keeps_the_layers_whose_restoration_lowers_the_kl_most(teachers):
    """kl:K ranks by the marginal KL on calibration text; each drop equals what the model with that one layer
    kept as attention measures, and the K largest are kept."""
    from hf_mixers.common.measures import compare_to_teacher
    from hf_mixers.conversion import load_teacher
    from hf_mixers.conversion.converter import KL_RANKING_SEQUENCES, _calibration_tokens

    model, report = convert(teachers["llama"], "rsa", keep_attention="kl:1", mixer_options=RSA_SMALL, **SMALL)
    drops = {layer.index: layer.kl_drop for layer in report.layers}
    assert all(drop is not None for drop in drops.values())
    assert report.layers_kept == [max(drops, key=drops.get)] and report.keep_attention == "kl:1"
    assert "KL drop" in report.to_markdown()
    teacher = load_teacher(teachers["llama"])
    ids = _calibration_tokens(teacher.tokenizer, None, SMALL["sequence_length"], SMALL["calibration_sequences"],
                              SMALL["heldout_sequences"])[0][:KL_RANKING_SEQUENCES]
    everything, _ = convert(teachers["llama"], "rsa", mixer_options=RSA_SMALL, **SMALL)
    base = compare_to_teacher(teacher.model, everything, ids)["kl_teacher_student"]
    for index in (0, 2):
        one_kept, _ = convert(teachers["llama"], "rsa", keep_attention=[index], mixer_options=RSA_SMALL, **SMALL)
        restored = compare_to_teacher(teacher.model, one_kept, ids)["kl_teacher_student"]
        assert drops[index] == pytest.approx(base - restored, abs=1e-6)
    with pytest.raises(ValueError, match=r"--keep-attention kl:9: K must lie in 0..3"):
        convert(teachers["llama"], "rsa", keep_attention="kl:9", **SMALL)


def test_explicit_layers_and_keep_list(teachers):
    model, report = convert(teachers["llama"], "sessa", layers=[1, 2], keep_attention=[2], **SMALL)
    assert model.config.layer_types == ["full_attention", "sessa", "full_attention"]
    assert report.layers_converted == [1] and report.layers_kept == [0, 2]
    assert report.layers[0].error is None and report.layers[1].error is not None


def test_bfloat16_output(teachers, tmp_path):
    model, report = convert(teachers["llama"], "sessa", dtype="bfloat16", out=str(tmp_path / "bf16"), **SMALL)
    assert model.dtype == torch.bfloat16 and report.dtype == "bfloat16"
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert tensors["model.layers.0.mixer.q_proj.weight"].dtype == torch.bfloat16
    assert report.kl_teacher_student < 1e-2
    # the report's decode caches after 2,048 tokens, both in bf16: the teacher's K/V; Sessa adds its feedback keys
    # and past outputs: lean by default (keys one head's width, 64 here, and outputs in bf16), or the official
    # hidden-wide keys with fp32 outputs
    config, per_layer = model.config, 2048 * model.config.num_hidden_layers
    kv = per_layer * 2 * config.num_key_value_heads * config.head_dim * 2
    assert report.cache_context == 2048 and report.teacher_cache_bytes == kv
    assert (config.sessa_feedback_dim, config.sessa_outputs_cache) == (64, "activation")
    assert report.cache_bytes == kv + per_layer * (64 * 2 + config.hidden_size * 2)
    assert "decode cache after 2,048 tokens" in report.to_markdown()
    full = {"sessa_feedback_dim": 2 * config.hidden_size, "sessa_outputs_cache": "compute"}
    _, full_report = convert(teachers["llama"], "sessa", dtype="bfloat16", mixer_options=full, **SMALL)
    assert full_report.cache_bytes == kv + per_layer * (2 * config.hidden_size * 2 + config.hidden_size * 4)
    assert full_report.kl_teacher_student < 1e-2  # gain 0 at init: still the teacher


def test_float16_output_loads_and_generates(teachers, tmp_path):
    """convert --dtype float16 (a student for fp16 serving or train.precision=fp16): the folder in fp16, the report
    computed in it (still the teacher at init), and it loads back and generates."""
    from transformers import AutoModelForCausalLM

    model, report = convert(teachers["llama"], "sessa", dtype="float16", out=str(tmp_path / "fp16"), **SMALL)
    assert model.dtype == torch.float16 and report.dtype == "float16" and report.kl_teacher_student < 1e-2
    tensors = load_file(str(tmp_path / "fp16" / "model.safetensors"))
    assert {tensor.dtype for tensor in tensors.values()} == {torch.float16}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp16")
    assert loaded.dtype == torch.float16
    out = loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_sliding_window_teacher_kept_as_sliding_attention(tokenizer, tmp_path):
    folder = str(tmp_path / "mistral")
    teacher = tiny_teacher("mistral", len(tokenizer), sliding_window=8)
    teacher.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, report = convert(folder, "sessa", keep_attention=[0, 2], **SMALL)
    assert model.config.layer_types == ["sliding_attention", "sessa", "sliding_attention"]
    assert "within 8 tokens" in report.layers[1].note
    hybrid, _ = convert(folder, "sessa", keep_attention=[0, 1, 2], **SMALL)
    ids = torch.randint(1, 300, (2, 30))  # longer than the window: the window must be applied
    with torch.no_grad():
        torch.testing.assert_close(hybrid(ids).logits, teacher(ids).logits, rtol=0, atol=1e-5)
        # cached decoding through transformers' sliding-window cache layers equals the full forward
        cache = DynamicCache(config=hybrid.config)
        steps = [hybrid(ids[:, :20], past_key_values=cache, use_cache=True).logits]
        steps += [hybrid(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(20, 30)]
        torch.testing.assert_close(torch.cat(steps, 1), teacher(ids).logits, rtol=0, atol=1e-5)


def test_user_calibration_text(teachers, tmp_path):
    text = tmp_path / "notes.jsonl"
    lines = [json.dumps({"text": f"Line {i}: the quick brown fox jumps over the lazy dog."}) for i in range(400)]
    text.write_text("\n".join(lines))
    _, report = convert(teachers["llama"], "rsa", calibration=str(text), mixer_options=RSA_SMALL, **SMALL)
    assert report.calibration == str(text) and report.calibration_tokens == 4 * 48


# ---------------------------------------------------------------------------------------------- bad input


def test_unsupported_architecture_lists_the_families(tmp_path, tokenizer):
    folder = str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer))).save_pretrained(folder)
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'.*supported families: llama .*mistral.*qwen2.*qwen3"):
        convert(folder, "sessa", **SMALL)


def test_missing_and_corrupt_weight_files(teachers, tmp_path):
    import shutil

    missing = tmp_path / "missing"
    shutil.copytree(teachers["llama"], missing)
    os.remove(missing / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no weight files"):
        load_teacher(str(missing))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(teachers["llama"], corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(TeacherLoadError, match="cannot read the weights"):
        load_teacher(str(corrupt))
    no_config = tmp_path / "no_config"
    shutil.copytree(teachers["llama"], no_config)
    os.remove(no_config / "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_teacher(str(no_config))


def test_a_weight_index_naming_a_missing_shard_is_refused(teachers, tmp_path):
    import shutil

    sharded = tmp_path / "sharded"
    shutil.copytree(teachers["llama"], sharded)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="lists shards that are missing: .*model-00001-of-00002"):
        load_teacher(str(sharded))


def test_incomplete_weights_are_refused(teachers, tmp_path):
    import shutil

    from safetensors.torch import save_file

    partial = tmp_path / "partial"
    shutil.copytree(teachers["llama"], partial)
    tensors = load_file(str(partial / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TeacherLoadError, match="lack 1 tensors.*layers.1.mlp.up_proj"):
        load_teacher(str(partial))


def test_gguf_without_the_gguf_package(tmp_path, monkeypatch):
    import importlib.util

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="needs the 'gguf' package"):
        load_teacher(str(fake))


def test_corrupt_gguf_and_missing_sources(tmp_path):
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(TeacherLoadError, match="broken.gguf: cannot read the GGUF file"):
        load_teacher(str(fake))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_teacher(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_teacher(str(tmp_path / "absent"))


def test_hub_id_while_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="HF_HUB_OFFLINE is set"):
        load_teacher("HuggingFaceTB/SmolLM2-135M")


def test_bad_mixer_and_layer_indices(teachers):
    with pytest.raises(ValueError, match="unknown mixer 'mamba'"):
        convert(teachers["llama"], "mamba", **SMALL)
    with pytest.raises(ValueError, match="--keep-attention: layer index 3 is out of range; the teacher has 3 layers"):
        convert(teachers["llama"], "sessa", keep_attention=[0, 3], **SMALL)
    with pytest.raises(ValueError, match="--layers: layer index -1 is out of range"):
        convert(teachers["llama"], "sessa", layers=[-1], **SMALL)
    with pytest.raises(ValueError, match="auto:4: K must lie in 0..3"):
        convert(teachers["llama"], "sessa", keep_attention="auto:4", **SMALL)
    with pytest.raises(ValueError, match="mixer options.*rsa_num_slots"):
        convert(teachers["llama"], "rsa", mixer_options={"rsa_num_slots": 0}, **SMALL)
    with pytest.raises(ValueError, match="unknown rsa option.*'rsa_slots'.*rsa_num_slots"):
        convert(teachers["llama"], "rsa", mixer_options={"rsa_slots": 8}, **SMALL)
    with pytest.raises(ValueError, match="unknown sessa option.*'hidden_size'"):
        convert(teachers["llama"], "sessa", mixer_options={"hidden_size": 8}, **SMALL)


def test_teacher_without_tokenizer(teachers, tmp_path):
    folder = str(tmp_path / "no_tokenizer")
    AutoModelForCausalLM.from_pretrained(teachers["llama"]).save_pretrained(folder)
    with pytest.raises(ValueError, match="no tokenizer files"):
        convert(folder, "sessa", **SMALL)


def test_existing_output_is_refused_and_never_half_written(teachers, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert(teachers["llama"], "sessa", out=str(out), **SMALL)
    assert os.listdir(out) == ["keep.txt"]

    def fail(self, folder):
        raise OSError("disk full")

    monkeypatch.setattr(ConversionReport, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(teachers["llama"], "sessa", out=str(out), overwrite=True, **SMALL)
    assert os.listdir(out) == ["keep.txt"]  # the old folder is intact
    assert sorted(os.listdir(tmp_path)) == ["out"]  # and no staging folder is left behind


def test_cli_convert(teachers, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [teachers["llama"], "--mixer", "rsa", "--out", str(out), "--keep-attention", "0", "--option",
            "rsa_num_slots=8", "--option", "num_levels=2", "--option", "window=16", "--sequence-length", "48",
            "--calibration-sequences", "4", "--heldout-sequences", "2"]
    assert cli_main(["convert", *args]) == 0
    assert "# Conversion report" in capsys.readouterr().out
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["layers_kept"] == [0] and report["mixer_options"]["rsa_num_slots"] == 8
    # options without the mixer's prefix are the mixer's own
    assert report["mixer_options"]["rsa_num_levels"] == 2 and report["mixer_options"]["rsa_window"] == 16
    assert cli_main(["convert", *args]) == 2  # exists, no --overwrite
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli_main(["convert", teachers["llama"], "--mixer", "gltm", "--option", "pattern=pow2_ce", "--out",
                     str(tmp_path / "gltm"), "--sequence-length", "48", "--calibration-sequences", "4",
                     "--heldout-sequences", "2"]) == 0
    report = json.loads((tmp_path / "gltm" / "conversion_report.json").read_text())
    assert report["mixer_options"]["gltm_pattern"] == "pow2_ce"
    assert cli_main(["convert", teachers["qwen2"], "--mixer", "vort", "--option", "window=8", "--option",
                     "feature_map=favor_pos", "--out", str(tmp_path / "vort"), "--sequence-length", "48",
                     "--calibration-sequences", "4", "--heldout-sequences", "2"]) == 0
    report = json.loads((tmp_path / "vort" / "conversion_report.json").read_text())
    assert report["mixer_options"]["vort_window"] == 8 and report["mixer_options"]["vort_feature_map"] == "favor_pos"
    capsys.readouterr()
    assert cli_main(["convert", teachers["llama"], "--mixer", "sessa", "--out", str(tmp_path / "x"),
                     "--keep-attention", "7"]) == 2
    assert "out of range" in capsys.readouterr().err
