"""Caching and generation: prefill + decode == one forward, padding invariance, generate() cached == uncached."""

import logging
import weakref

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_bytes_in_two_calls, compile_decode_without_inductor, step_through, tiny_sessa_model
from hf_mixers.core.cache import cache_nbytes
from hf_mixers.mixers.sessa import SessaCacheLayer

F64 = torch.float64


@pytest.mark.parametrize("layer_types, feedback_heads", [(["sessa", "sessa"], 1), (["full_attention", "sessa"], 1),
                                                    (["sessa", "sessa"], 4)])
@pytest.mark.parametrize("prefill", [1, 9])
def test_prefill_then_decode_equals_full_forward(layer_types, feedback_heads, prefill):
    model = tiny_sessa_model(dtype=F64, layer_types=layer_types, sessa_chunk_size=4,
                             sessa_feedback_heads=feedback_heads)
    ids = torch.randint(1, 101, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in row 1
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        stepped, cache = step_through(model, ids, mask, prefill)
    real = mask.bool()
    torch.testing.assert_close(stepped[real], full[real], rtol=0, atol=1e-10)
    assert isinstance(cache.layers[-1], SessaCacheLayer) and cache.get_seq_length() == 21
    assert cache.layers[-1].outputs.dtype == F64 and cache.layers[-1].outputs.shape[1] == 21


def test_chunked_prefill_onto_non_empty_cache():
    """Spec §5.3: several multi-token prefills in a row equal one forward."""
    model = tiny_sessa_model(dtype=F64, sessa_chunk_size=3)
    ids = torch.randint(1, 101, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        pieces = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                  for a, b in ((0, 7), (7, 8), (8, 19), (19, 30))]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)


def test_fp32_cached_outputs_keep_bf16_decode_close():
    model = tiny_sessa_model(dtype=torch.bfloat16)
    ids = torch.randint(1, 101, (1, 24))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(ids).logits.float()
        stepped, cache = step_through(model, ids, mask, 8)
    assert cache.layers[0].outputs.dtype == torch.float32
    assert ((stepped.float() - full).norm() / full.norm()).item() < 2e-2


def test_left_padded_batch_equals_each_sequence_alone():
    model = tiny_sessa_model(dtype=F64)
    lengths = [13, 7, 10]
    rows = [torch.randint(1, 101, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batched[i, width - len(row):], alone, rtol=0, atol=1e-10)


def test_right_padding_does_not_leak_into_real_tokens():
    model = tiny_sessa_model(dtype=F64)
    ids = torch.randint(1, 101, (1, 12))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 5)], 1).long()
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :12], model(ids).logits,
                                   rtol=0, atol=1e-10)


def test_generate_greedy_cached_equals_uncached_with_left_padding():
    model = tiny_sessa_model()
    ids = torch.randint(1, 101, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    ids[mask == 0] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    for i in range(3):  # each row generates what it would generate alone
        alone = model.generate(ids[i:i + 1, mask[i].bool()], max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(cached[i, -12:], alone[0, -12:])


def test_generate_sampling_cached_equals_uncached():
    model = tiny_sessa_model()
    ids = torch.randint(1, 101, (2, 6))
    outputs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outputs.append(model.generate(ids, do_sample=True, top_k=20, max_new_tokens=10, use_cache=use_cache,
                                      pad_token_id=0))
    assert torch.equal(*outputs)


def test_generate_with_default_arguments_and_beam_search():
    model = tiny_sessa_model()
    ids = torch.randint(1, 101, (2, 5))
    assert model.generate(ids, pad_token_id=0).shape[0] == 2
    beams = model.generate(ids, num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
    no_cache = model.generate(ids, num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(beams, no_cache)  # reorder_cache keeps the feedback state aligned with the beams


def test_transformers_fixed_size_caches_are_refused_in_words_and_the_dynamic_ones_work():
    """cache_implementation="static" (transformers' fixed-length K/V layers) has no layer for a mixer: a clear error
    naming what to do instead, not a bare KeyError; "dynamic" and "offloaded" generate as the default cache does."""
    from hf_mixers.testing import tiny_model

    model = tiny_model("rsa", dtype=torch.float32)
    ids = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    for implementation in ("static", "offloaded_static"):
        with pytest.raises(ValueError, match=r"fixed-size caches hold attention K/V only, not this model's 'rsa' "
                                             r"layers.*compile_decode = True"):
            model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=implementation)
    for implementation in ("dynamic", "offloaded"):
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False,
                                          cache_implementation=implementation), expected), implementation


def test_cache_bytes_grow_with_context():
    model = tiny_sessa_model()
    _, small, full = cache_bytes_in_two_calls(model, torch.randint(1, 101, (1, 16)), 8)
    # per token and layer: K and V (2 kv heads x 16) fp32, feedback keys 64 fp32, outputs 64 fp32
    assert full == 2 * small == 2 * 2 * 8 * (2 * 32 + 64 + 64) * 4


def test_decode_steps_write_into_the_cache_in_place_and_the_memory_held_is_counted():
    """A KVPlusLayer (Sessa's) keeps each cached tensor as the front of a buffer with spare room: decode steps write
    their token into it (the same storage step after step, no copy of the cache), the values are what torch.cat
    would give, a replaced tensor (beam reordering) starts a new buffer, and cache_nbytes counts the buffers whole
    (spare=False: the cached tokens alone)."""
    model = tiny_sessa_model()
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        layer = cache.layers[0]
        before = {name: getattr(layer, name).clone() for name in ("keys", "values", "feedback_keys", "outputs")}
        storages = {name: getattr(layer, name).untyped_storage().data_ptr() for name in before}
        for t in range(8, 12):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    for name, old in before.items():
        tensor = getattr(layer, name)
        assert tensor.untyped_storage().data_ptr() == storages[name], name  # written in place, 4 steps running
        dim = 2 if name in ("keys", "values") else 1
        assert tensor.shape[dim] == 12 and torch.equal(tensor.narrow(dim, 0, 8), old), name
    # spare room: 12 cached tokens in buffers of 8 + max(8 // 8, 64) = 72
    assert layer.buffers["outputs"][0].shape[1] == 72
    assert cache_nbytes(cache) == 72 / 12 * cache_nbytes(cache, spare=False)
    layer.reorder_cache(torch.tensor([1, 0]))
    model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert layer.outputs.untyped_storage().data_ptr() != storages["outputs"] and layer.outputs.shape[1] == 13


def test_a_cached_tensor_of_zero_width_still_counts_its_tokens():
    """GLTM's attention pattern keeps no feedback keys or outputs (zero-width entries) and a diagonal A no K/V: those
    tensors still grow a token per step, so that every cached tensor has the length of the positions (a compiled
    step with symbolic shapes ties them together)."""
    from hf_mixers.core.cache import KVPlusLayer

    class Layer(KVPlusLayer):
        extra_names = ("empty", "positions")

    layer = Layer()
    layer.update(torch.zeros(2, 1, 3, 0), torch.zeros(2, 1, 3, 0))
    layer.append_extras(torch.zeros(2, 3, 0), torch.ones(2, 3, dtype=torch.long))
    for _ in range(2):
        layer.update(torch.zeros(2, 1, 1, 0), torch.zeros(2, 1, 1, 0))
        layer.append_extras(torch.zeros(2, 1, 0), torch.ones(2, 1, dtype=torch.long))
    assert layer.keys.shape == layer.values.shape == (2, 1, 5, 0)
    assert layer.empty.shape == (2, 5, 0) and layer.positions.shape == (2, 5)


def test_a_cache_inside_an_autograd_graph_appends_without_writing_in_place():
    """With gradients on (training through a chunked prefill), the cache concatenates instead of writing into its
    buffers: an in-place write would change tensors the first chunk saved for backward. The gradients equal one
    full forward's."""
    model = tiny_sessa_model(dtype=F64)
    ids = torch.randint(1, 101, (1, 12), generator=torch.Generator().manual_seed(0))
    weight = model.model.embed_tokens.weight
    full = torch.autograd.grad(model(ids).logits.pow(2).sum(), weight)[0]
    cache = DynamicCache(config=model.config)
    chunks = [model(ids[:, :7], past_key_values=cache, use_cache=True).logits,
              model(ids[:, 7:], past_key_values=cache, use_cache=True).logits]
    assert not cache.layers[0].buffers  # nothing written in place
    chunked = torch.autograd.grad(torch.cat(chunks, 1).pow(2).sum(), weight)[0]
    torch.testing.assert_close(chunked, full, rtol=1e-7, atol=1e-9)


def test_mask_that_does_not_cover_the_cache_is_refused():
    model = tiny_sessa_model()
    ids = torch.randint(1, 101, (1, 8))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="attention_mask has shape \\(1, 2\\) but expected \\(1, 8\\)"):
            model(ids[:, 6:], attention_mask=torch.ones(1, 2, dtype=torch.long), past_key_values=cache)


def test_compiled_decode_serves_more_batch_sizes_than_dynamos_recompile_limit(monkeypatch):
    """config.compile_decode at ten batch sizes (dynamo falls back to eager, silently, after 8 recompiles of one
    code object): every batch size gets one compiled graph (also across prefill -> decode: the conv history a
    prefill leaves is strided), and generate equals the eager model's. Dynamo's own eager backend stands in for
    inductor: the limit and the graph count are dynamo's, and it compiles in milliseconds."""
    from hf_mixers.decode import engine
    from hf_mixers.testing import tiny_model

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, options=None, **kwargs: compile_(fn, backend="eager",
                                                                                                 **kwargs))
    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "EXPORT_DEVICES", ())  # dynamo's own limits and graphs: torch.compile's step
    eager = tiny_model("selective_ssm", dtype=torch.float32)
    compiled = tiny_model("selective_ssm", dtype=torch.float32, compile_decode=True)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for batch in range(1, 11):
        ids = torch.randint(3, 61, (batch, 4), generator=torch.Generator().manual_seed(batch))
        outputs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                  pad_token_id=0) for model in (eager, compiled)]
        assert torch.equal(*outputs), f"batch {batch}: compiled decode generated other tokens"
    assert counters["stats"]["unique_graphs"] == 10 and not counters["recompile_limit_hit"], dict(counters["stats"])


def test_generate_without_padding_reuses_the_graph_of_masked_steps(monkeypatch):
    """transformers' generate drops an attention mask of all ones, so its steps reach the compiled step without a
    mask; given one of ones (and positions per row), they run the graph that steps with a mask built: a padded batch
    and an unpadded generate share one graph, and generate equals the eager model's tokens."""
    from hf_mixers.decode import engine
    from hf_mixers.testing import tiny_model

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, options=None, **kwargs: compile_(fn, backend="eager",
                                                                                                 **kwargs))
    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "EXPORT_DEVICES", ())  # dynamo's own limits and graphs: torch.compile's step
    eager = tiny_model("rsa", dtype=torch.float32)
    compiled = tiny_model("rsa", dtype=torch.float32, compile_decode=True)
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)  # masked steps
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    outputs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              pad_token_id=0) for model in (eager, compiled)]
    assert torch.equal(*outputs), "compiled decode generated other tokens"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_generate_compile_config_decodes_through_the_compiled_token_step(monkeypatch):
    """transformers' generation compile switch, ``generate(compile_config=CompileConfig(...))``, runs the decode steps
    through the blocks' compiled token step in the CompileConfig's mode, on CPU too: the eager model's tokens on a
    left-padded batch, one graph, ``config.compile_decode`` unchanged after; ``disable_compile`` and no
    compile_config stay eager, and a mode the step cannot take is refused in words."""
    from transformers import CompileConfig

    from hf_mixers.decode import engine
    from hf_mixers.model import modeling
    from hf_mixers.testing import tiny_model

    compile_decode_without_inductor(monkeypatch)
    monkeypatch.setattr(engine, "_compiled_steps", {})
    model = tiny_model("rsa", dtype=torch.float32, compile_decode=False)
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    def generate(**kwargs):
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, **kwargs)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    expected = generate()
    assert not counters["stats"]["unique_graphs"]
    mode = "max-autotune-no-cudagraphs"
    assert torch.equal(generate(compile_config=CompileConfig(mode=mode)), expected)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [key[3] for key in engine._compiled_steps] == [mode] and model.config.compile_decode is False
    assert torch.equal(generate(compile_config=CompileConfig(mode=mode), disable_compile=True), expected)
    assert torch.equal(generate(), expected) and counters["stats"]["unique_graphs"] == 1  # nothing compiled again
    with pytest.raises(ValueError, match=r"compile_config=.*mode 'fast' is not a torch.compile mode"):
        generate(compile_config=CompileConfig(mode="fast"))
    messages = []
    monkeypatch.setattr(modeling.logger, "warning", lambda message, *args: messages.append(message % args))
    assert torch.equal(generate(compile_config=CompileConfig(mode=mode, options={})), expected) and not messages
    assert torch.equal(generate(compile_config=CompileConfig(mode=mode, backend="aot_eager")), expected)
    assert messages == ["generate(compile_config=...): {'backend': 'aot_eager'} not used; the compiled token step "
                        "takes the mode only (Inductor, one graph per mixer class and batch size)"]
    assert model.config.compile_decode is False


def test_plain_generate_decodes_through_the_compiled_step_by_default_where_it_pays(monkeypatch):
    """``compile_decode = "auto"`` (the default): a plain ``generate`` of at least AUTO_NEW_TOKENS tokens on a CPU in
    fp32 runs its decode steps through the compiled step, with the eager model's tokens, and says so once; a shorter
    one stays eager until the step has run in the process, then takes it too; ``compile_decode = False``,
    HF_MIXERS_COMPILE_DECODE=0, a step with symbolic shapes (Sessa) and any other call than generate's are eager."""
    from hf_mixers.decode import engine
    from hf_mixers.model import blocks
    from hf_mixers.testing import tiny_model

    compile_decode_without_inductor(monkeypatch)
    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "_auto_announced", set())
    monkeypatch.setattr(engine, "_stepped", weakref.WeakKeyDictionary())
    steps = []
    compiled = engine.decode_compiled
    monkeypatch.setattr(blocks, "decode_compiled", lambda *args: steps.append(1) or compiled(*args))
    messages = []
    monkeypatch.setattr(engine.logger, "warning", lambda message, *args: messages.append(message % args))
    model = tiny_model("rsa", dtype=torch.float32)
    assert model.config.compile_decode == "auto"
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))

    def generate(tokens):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0)

    long = engine.AUTO_NEW_TOKENS
    generate(long - 1)
    assert not steps  # too short to win back the step's set-up
    got = generate(long)
    said = [message for message in messages if "compile_decode='auto'" in message]
    assert len(steps) == (long - 1) * len(model.model.layers) and len(said) == 1, messages
    assert "compile_decode = False or HF_MIXERS_COMPILE_DECODE=0" in said[0]
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True)  # a forward of its own: eager
    assert len(steps) == (long - 1) * len(model.model.layers)
    generate(4)  # the step is loaded in this process now: a short generate takes it too
    assert len(steps) == (long - 1 + 3) * len(model.model.layers)
    steps.clear()
    other = tiny_model("rsa", dtype=torch.float32, hidden_size=48)  # another model: its own step to build
    other.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert not steps
    model.config.compile_decode = False
    assert torch.equal(generate(long), got) and not steps
    model.config.compile_decode = "auto"
    monkeypatch.setenv("HF_MIXERS_COMPILE_DECODE", "0")
    assert torch.equal(generate(long), got) and not steps
    monkeypatch.delenv("HF_MIXERS_COMPILE_DECODE")
    sessa = tiny_model("sessa", dtype=torch.float32)
    sessa.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=long, do_sample=False, pad_token_id=0)
    assert not steps


def test_auto_names_why_it_stays_eager():
    from hf_mixers.decode.engine import AUTO_NEW_TOKENS, auto_decode_refusal
    from hf_mixers.testing import tiny_model

    model = tiny_model("vort", dtype=torch.float32)
    layers, weight = model.model.layers, model.lm_head.weight
    assert auto_decode_refusal(layers, weight, AUTO_NEW_TOKENS) is None
    assert auto_decode_refusal(layers, weight, None) is None  # a generate that does not say: long by default
    assert "3 new tokens" in auto_decode_refusal(layers, weight, 3, 1)
    assert "torch.bfloat16 on cpu" in auto_decode_refusal(layers, weight.bfloat16(), AUTO_NEW_TOKENS)
    sessa = tiny_model("sessa", dtype=torch.float32)
    assert "grows with the context" in auto_decode_refusal(sessa.model.layers, sessa.lm_head.weight, AUTO_NEW_TOKENS)
    teacher = tiny_model("full_attention", dtype=torch.float32)
    assert "no layer" in auto_decode_refusal(teacher.model.layers, teacher.lm_head.weight, AUTO_NEW_TOKENS)


def test_the_cpu_step_computes_its_small_products_in_fused_loops(monkeypatch):
    """A CPU step of fixed shapes asks Inductor for its decompose_mm_pass with the step's sizes (the memories' small
    products as loops fused with their neighbours, not a BLAS call each) and for its C++ launcher; a step of growing
    shapes, and a CUDA one, do not. That the compiled step equals the eager one with the pass on is the contract's
    (each mixer's base case compiles with Inductor)."""
    from torch._inductor.fx_passes import decompose_mem_bound_mm

    from hf_mixers.decode import engine

    asked = []
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: asked.append(kwargs) or function)
    for device, dynamic in (("cpu", False), ("cpu", True), ("cuda", False)):
        engine.compile_step(engine.block_step, device, None, dynamic)
    fixed, growing, cuda = (kwargs["options"] for kwargs in asked)
    assert fixed == {"cpp_wrapper": True, "post_grad_fusion_options": {"decompose_mm_pass": {}}}
    assert growing == {"cpp_wrapper": True} and cuda is None
    assert decompose_mem_bound_mm.cpu_max_first_dimension_decomposition == engine.SMALL_PRODUCT_ROWS
    assert decompose_mem_bound_mm.cpu_max_other_dimension_decomposition == engine.SMALL_PRODUCT_WIDTH


def test_a_step_that_cannot_be_built_here_decodes_eagerly_and_says_so_once(monkeypatch, caplog):
    """Where the compiled step cannot be built (no C++ compiler, a backend error: what a Hub user's machine may lack),
    ``generate`` still runs, eagerly, with the eager model's tokens, and the log says why once; a failure of a step
    that has run before is its own error and is raised."""
    from hf_mixers.decode import engine
    from hf_mixers.testing import tiny_model

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    for name, value in (("COMPILE_BACKEND", broken_backend), ("EXPORT_DEVICES", ()), ("_compiled_steps", {}),
                        ("_eager_keys", set()), ("_ran", set())):
        monkeypatch.setattr(engine, name, value)
    eager = tiny_model("rsa", dtype=torch.float32)
    compiled = tiny_model("rsa", dtype=torch.float32, compile_decode=True)
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger=engine.logger.name):
        outputs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                  pad_token_id=0) for model in (eager, compiled, compiled)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    said = [record.getMessage() for record in caplog.records if "could not be built here" in record.getMessage()]
    assert len(said) == 1 and "RSAMixer" in said[0] and "no C++ compiler here" in said[0], said
    assert [key[1] for key in engine._eager_keys] == [(type(compiled.model.layers[0].mixer),)]

    key = next(iter(engine._eager_keys))
    engine._eager_keys.clear()
    engine._ran.add(key)  # a step that ran here before and now fails: not hidden behind the eager path
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no C"):
        compiled.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_compile_decode_takes_a_torch_compile_mode(monkeypatch):
    """compile_decode: true, false or one of torch.compile's modes ("reduce-overhead" is a CUDA graph on CUDA and
    the default mode on CPU, with its C++ launcher: no graph to replay there)."""
    from hf_mixers.decode.switch import compile_mode
    from hf_mixers.kernels.conventions import COMPILE_MODES
    from hf_mixers.testing import tiny_model

    eager = tiny_model("selective_ssm", dtype=torch.float32)
    compiled = tiny_model("selective_ssm", dtype=torch.float32, compile_decode="reduce-overhead")
    assert compile_mode(compiled.config) == "reduce-overhead"
    ids = torch.randint(3, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    outputs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              pad_token_id=0) for model in (eager, compiled)]
    assert torch.equal(*outputs)
    with pytest.raises(ValueError, match=r"compile_decode must be 'auto', true, false or a torch.compile mode .*'fast"):
        tiny_model("selective_ssm", compile_decode="fast")
    assert "default" in COMPILE_MODES and compile_mode(tiny_model("rsa", rsa_compile_decode=True).config) == "default"
    monkeypatch.setenv("HF_MIXERS_COMPILE_DECODE", "0")  # the environment's veto holds for the older switch too
    assert compile_mode(tiny_model("rsa", rsa_compile_decode=True).config) is None


def test_tensors_of_walks_what_map_tensors_meets():
    """``tensors_of`` (the compiled step's stride check, ``first_tensor``: RecurrentStateLayer's device) walks a state
    without rebuilding it: the same tensors, in the same order, as ``map_tensors`` visits, in tuples, dataclass
    states (a window around an RSA memory) and objects with a ``map`` of their own; none where map_tensors meets
    none."""
    from hf_mixers.core.cache import first_tensor, map_tensors, tensors_of
    from hf_mixers.core.window import WindowState
    from hf_mixers.kernels.rsa_state import RSAState

    class Mapped:  # not a dataclass: its own map
        def __init__(self, *tensors):
            self.tensors = tensors

        def map(self, fn):
            return Mapped(*map(fn, self.tensors))

    memory = RSAState(*(torch.full((1,), float(index)) for index in range(7)))
    window = WindowState(keys=None, values=None, valid=torch.ones(1, 2), extras=(), memory=memory, written=None,
                         oldest=None)
    for value in (None, (None, window), (None, (), memory), [Mapped(torch.ones(2)), memory], Mapped(), object(),
                  (window, None)):
        met = []
        map_tensors(value, lambda tensor: met.append(tensor) or tensor)
        walked = tensors_of(value)
        assert len(walked) == len(met) and all(a is b for a, b in zip(walked, met)), value
        assert first_tensor(value) is (met[0] if met else None), value


def test_last_token_mask_is_made_once_per_mask():
    """Every recurrent layer of a decode step reads the token mask's last column: ``last_token_mask`` makes it once
    per mask, with a new tensor's strides (a slice's would make the compiled step copy it, layer by layer), and again
    for another mask or the same one modified in place (for an inference tensor, which has no version, after the
    next model forward forgets it)."""
    from hf_mixers.core.mixer import forget_token_mask, last_token_mask

    assert last_token_mask(None) is None
    mask = torch.tensor([[False, True, True], [True, True, False]])
    column = last_token_mask(mask)
    assert torch.equal(column, mask[:, -1:]) and column.stride() == (1, 1)
    assert last_token_mask(mask) is column
    mask[1, -1] = True  # in place: a new version
    assert torch.equal(last_token_mask(mask), torch.tensor([[True], [True]]))
    single = torch.ones(1, 5, dtype=torch.bool)
    assert last_token_mask(single).stride() == (1, 1) and last_token_mask(single) is not column
    with torch.inference_mode():  # no version counter: kept until the next model forward forgets it
        frozen = torch.tensor([[True, False]])
        column = last_token_mask(frozen)
        assert torch.equal(column, frozen[:, -1:]) and last_token_mask(frozen) is column
        frozen[0, -1] = True
        forget_token_mask()
        assert torch.equal(last_token_mask(frozen), torch.tensor([[True]]))


def test_compiled_generate_under_inference_mode(monkeypatch):
    """``generate`` inside ``torch.inference_mode()`` (inference tensors have no version counter, which the token
    mask's shared last column is otherwise kept by) gives the eager tokens through the compiled step, a left-padded
    batch included."""
    from hf_mixers.decode import engine
    from hf_mixers.testing import tiny_model

    compile_decode_without_inductor(monkeypatch)
    monkeypatch.setattr(engine, "_compiled_steps", {})
    model = tiny_model("rsa", dtype=torch.float32, rsa_window=3)
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    def generate():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)

    expected = generate()
    model.config.compile_decode = True
    with torch.inference_mode():
        assert torch.equal(generate(), expected)


def test_dense_inputs_are_kept_and_strided_ones_copied():
    """The compiled step's inputs: a state whose tensors all have a new tensor's strides is passed as it is (no
    rebuild); one with a strided slice in it is rebuilt with that tensor copied dense, the others kept."""
    from hf_mixers.core.window import WindowState
    from hf_mixers.decode.engine import _dense_all

    dense = torch.zeros(1, 2, 3)
    window = WindowState(keys=dense, values=dense + 1, valid=torch.ones(1, 3, dtype=torch.bool), extras=(),
                         memory=None, written=torch.zeros(1, dtype=torch.long),
                         oldest=torch.zeros(1, dtype=torch.long))
    inputs = (torch.ones(1, 1, dtype=torch.bool), window, None)
    assert _dense_all(inputs) is inputs
    strided = torch.ones(1, 4, dtype=torch.bool)[:, -1:]  # (1, 1) with strides (4, 1)
    rebuilt = _dense_all((strided, window, None))
    assert rebuilt[0].stride() == (1, 1) and torch.equal(rebuilt[0], strided)
    assert rebuilt[1].keys is dense and rebuilt[2] is None
