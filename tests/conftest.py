"""Shared fixtures (offline, deterministic, tiny models built from configs) and the test tiers.

A test's tier is the folder it lives in, added as a marker:

    tests/unit/         unit         one module's behaviour, seconds each       make test-fast
    tests/contract/     contract     every registered mixer through the one     make test-fast (base configs);
                                     contract suite (hf_mixers/testing.py)      tiny variants carry `variant`
    tests/integration/  integration  whole commands and recipes end to end      make test
    any folder          variant      a further case of a fast test (a slower    make test only
                                     Triton-interpreter case, a mixer variant)
    any folder          slow         over a minute with real weights            pytest -m slow (never in CI)

A test marked with another tier explicitly keeps that marker (e.g. an end-to-end test in a contract file).
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Inductor's CPU code without SIMD in the tests (child processes too): the same graphs, lowerings and fusions, each
# kernel a scalar C++ loop. A cold compile of a decode step takes a third less (27 compiled-decode cases on 2 cores:
# 185 -> 123 s with empty caches, as CI has them); what the tests prove -- one graph, no recompiles, equal to eager --
# holds either way, and the benchmarks and users compile with SIMD (set TORCHINDUCTOR_VEC_ISA_OK=1 to test that).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
if "PYTEST_XDIST_WORKER" in os.environ:  # one worker per core: one thread each, child processes included
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_mixers  # noqa: E402,F401
from hf_mixers import MixerConfig, SessaConfig, SessaForCausalLM  # noqa: E402  (loads the model core)
from hf_mixers.conversion.families import SUPPORTED_FAMILIES  # noqa: E402

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)


def tiny_config(cls=SessaConfig, **overrides):
    return cls(**{**TINY, **overrides})


def turn_on_feedback(model, std=0.5, bias=0.4, seed=0):
    """Give every Sessa layer a non-zero, token-dependent gain (the converted-at-init model has gamma == 0)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "gamma_proj"):
            with torch.no_grad():
                module.gamma_proj.weight.copy_(torch.randn(module.gamma_proj.weight.shape, generator=generator) * std)
                module.gamma_bias.fill_(bias)
    return model


def tiny_sessa_model(dtype=torch.float32, seed=0, feedback=True, **overrides):
    torch.manual_seed(seed)
    model = SessaForCausalLM(tiny_config(**overrides)).eval()
    if feedback:
        turn_on_feedback(model, seed=seed)
    return model.to(dtype)


def step_through(model, ids, mask, prefill):
    """Prefill ``prefill`` tokens, then decode the rest one at a time (on the model's device); returns the
    concatenated logits and cache."""
    from transformers import DynamicCache

    ids, mask = ids.to(model.device), mask.to(model.device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache,
                        use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                                use_cache=True).logits)
    return torch.cat(logits, dim=1), cache


def cache_bytes_in_two_calls(model, ids, split):
    """Feed ids[:, :split], then the rest, through one cache: (cache, bytes after the first call, after both)."""
    from transformers import DynamicCache

    from hf_mixers.core.cache import cache_nbytes

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :split], past_key_values=cache, use_cache=True)
        first = cache_nbytes(cache, spare=False)
        model(ids[:, split:], past_key_values=cache, use_cache=True)
    return cache, first, cache_nbytes(cache, spare=False)


TEACHER_FAMILIES = tuple(SUPPORTED_FAMILIES)


def tiny_tokenizer(vocab_size=384):
    """A byte-level BPE tokenizer trained on a little Shakespeare, offline, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_mixers.common.corpus import shakespeare

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([shakespeare("train")[:100_000]], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    wrapped.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return wrapped


def tiny_teacher(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A random causal LM of 3 layers of a supported family (GQA; Llama tied, the others untied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, tie_word_embeddings=family == "llama")
    if family == "qwen3":
        fields["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**fields, **overrides})).eval()
    with torch.no_grad():  # trained-looking weights: non-zero biases and norms that matter
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def save_tiny_teacher(folder, family: str = "llama", card: str | None = None):
    """A tiny teacher of ``family`` and its tokenizer saved in ``folder`` (+ a README.md ``card``); returns the
    tokenizer."""
    tokenizer = tiny_tokenizer()
    tiny_teacher(family, len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if card is not None:
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)
    return tokenizer


def torchrun_distill(settings, timeout=900, launcher="torchrun") -> str:
    """``hf-mixers distill --set S ...`` on 2 CPU processes under torchrun (gloo), or the ``deepspeed`` launcher;
    returns rank 0's stdout. The rendezvous takes a free port, so parallel test workers never collide."""
    import socket
    import subprocess
    import sys

    bin_dir = os.path.dirname(sys.executable)
    if launcher == "deepspeed":  # its documented form: no --local_rank argument, the package as a module
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [os.path.join(bin_dir, "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                   "--no_local_rank", "--module", "hf_mixers", "distill"]
    else:
        command = [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "hf_mixers",
                   "distill"]
    for item in settings:
        command += ["--set", item]
    result = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                          "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def compile_decode_without_inductor(monkeypatch):
    """From here on in this test, the compiled decode steps (decode/engine.py) are torch.compile'd with the "aot_eager"
    backend: dynamo's capture (one graph, no graph break, no recompile: what the checks count) and AOTAutograd's
    functionalisation of the steps' in-place writes, without Inductor's code generation, 10-25 s of C++ compilation
    a graph on 2 cores. For the tiny variants: each mixer's base configuration compiles with Inductor."""
    from hf_mixers.decode import engine

    monkeypatch.setattr(engine, "COMPILE_BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny Llama teacher and its tokenizer saved in a folder, once per test module."""
    folder = str(tmp_path_factory.mktemp("teacher"))
    save_tiny_teacher(folder)
    return folder


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TIERS = ("unit", "contract", "integration", "gpu")


def first_in_fast(*cases):
    """Parametrize cases of which only the first runs in make test-fast; the others are marked ``variant`` (the
    full tier). A case is a value, or a tuple of values for several argument names."""
    return [cases[0], *(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.variant)
                        for case in cases[1:])]


def fast_then_full(fast, full):
    """Two cases of which the second covers the first (a superset, e.g. more mixers in one stack): make test-fast runs
    the first (marked ``fast_only``), make test the second only (marked ``variant``)."""
    return [pytest.param(fast, marks=pytest.mark.fast_only), pytest.param(full, marks=pytest.mark.variant)]


class _Shard:
    """Share ``index`` of ``count`` of the selected tests: every count-th from the index-th (parametrisations of one
    test land in different shares). Asked for by an interpreter subprocess (``run_under_interpreter(shard=...)``)
    so that a long kernel file runs as several subprocesses side by side."""

    def __init__(self, spec: str):
        self.index, self.count = (int(part) for part in spec.split("/"))

    @pytest.hookimpl(trylast=True)  # after -m has deselected (the tier markers above are added before it)
    def pytest_collection_modifyitems(self, config, items):
        kept = items[self.index::self.count]
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept


def pytest_configure(config):
    # the interpreter subprocesses of the Triton tests (triton_interpreter.py) select the same tests as this run
    os.environ["HF_MIXERS_TEST_MARKEXPR"] = config.option.markexpr or ""
    if os.environ.get("HF_MIXERS_TEST_SHARD"):
        config.pluginmanager.register(_Shard(os.environ["HF_MIXERS_TEST_SHARD"]), "hf-mixers-shard")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.path)).parent.name
        if tier in TIERS and not any(item.get_closest_marker(name) for name in TIERS):
            item.add_marker(tier)


__all__ = ["cache_bytes_in_two_calls", "save_tiny_teacher", "TEACHER_FAMILIES", "tiny_teacher", "tiny_tokenizer", "TINY", "tiny_config", "tiny_sessa_model", "turn_on_feedback", "step_through", "MixerConfig", "SessaConfig"]
