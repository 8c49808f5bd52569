"""The RSA mixer in the model: caching, padding, generation, GQA state, conversion init, config."""

import logging

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from conftest import TINY, cache_bytes_in_two_calls, compile_decode_without_inductor, first_in_fast, step_through, \
    tiny_config
from hf_mixers import RSAConfig, RSAForCausalLM
from hf_mixers.mixers.rsa import RSACacheLayer
from hf_mixers.core.attention import attention_output_error
from hf_mixers.mixers.rsa import RSAMixer
from hf_mixers.testing import graphs_built, reset_compiled_steps

F64 = torch.float64
RSA_SMALL = dict(rsa_num_levels=3, rsa_num_slots=8, rsa_chunk_size=4)


def tiny_rsa_model(dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    return RSAForCausalLM(tiny_config(RSAConfig, **{**RSA_SMALL, **overrides})).eval().to(dtype)


def test_rsa_registration_and_defaults():
    config = tiny_config(RSAConfig)
    assert config.model_type == "rsa" and config.layer_types == ["rsa", "rsa"]
    assert config.rsa_num_levels == 4 and config.rsa_num_slots == 64 and config.rsa_threshold_init == 0.5
    assert tiny_config(RSAConfig, rsa_readout="softmax_count").rsa_threshold_init == 0.0


@pytest.mark.parametrize("overrides, message", [
    (dict(rsa_routing="chain"), "rsa_routing must be one of"),
    (dict(rsa_num_slots=0), "rsa_num_slots must be a positive integer"),
    (dict(rsa_threshold_init=1.5), "rsa_threshold_init \\(1.5\\) must lie in"),
    (dict(rsa_assign_fn="relu"), "rsa_assign_fn must be one of"),
])
def test_invalid_rsa_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(RSAConfig, **overrides)


@pytest.mark.parametrize("layer_types", [["rsa", "rsa"], ["full_attention", "rsa"], ["rsa", "sessa"]])
@pytest.mark.parametrize("prefill", [1, 6])
def test_prefill_then_decode_equals_full_forward(layer_types, prefill):
    model = tiny_rsa_model(F64, layer_types=layer_types, rsa_query_read=True)
    ids = torch.randint(1, 101, (2, 19))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    stepped, cache = step_through(model, ids, mask, prefill)
    torch.testing.assert_close(stepped[mask.bool()], full[mask.bool()], rtol=0, atol=1e-10)
    assert cache.get_seq_length() == 19


def test_left_padded_batch_equals_each_sequence_alone():
    model = tiny_rsa_model(F64)
    rows = [torch.randint(1, 101, (n,)) for n in (11, 6, 9)]
    ids = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 11 - len(row):], mask[i, 11 - len(row):] = row, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(batched[i, 11 - len(row):], model(row[None]).logits[0], rtol=0, atol=1e-10)


def test_generate_cached_equals_uncached_greedy_sampling_and_beams():
    model = tiny_rsa_model()
    ids = torch.randint(1, 101, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(model.generate(ids, do_sample=False, **kwargs),
                       model.generate(ids, do_sample=False, use_cache=False, **kwargs))
    assert torch.equal(model.generate(ids, num_beams=3, do_sample=False, **kwargs),
                       model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **kwargs))
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        sampled.append(model.generate(ids, do_sample=True, top_k=20, use_cache=use_cache, **kwargs))
    assert torch.equal(*sampled)


def test_state_is_per_kv_head_and_constant_in_context_length():
    model = tiny_rsa_model()
    cache, small, full = cache_bytes_in_two_calls(model, torch.randint(1, 101, (1, 40)), 8)
    layer = cache.layers[0]
    assert isinstance(layer, RSACacheLayer)
    assert layer.state.key_sum.shape == (1, 2, 3, 8, 16)  # (B, KV heads, levels, slots, head_dim): shared by GQA
    assert full == small  # constant-size state


def test_query_heads_of_one_kv_head_share_its_memory():
    """Changing the queries of KV group 1 changes only group 1's outputs, and never the state."""
    config = tiny_config(RSAConfig, num_hidden_layers=1, **RSA_SMALL)
    config._attn_implementation = "sdpa"
    mixer = RSAMixer(config, 0).double()
    mixer.reset_parameters()
    x = torch.randn(1, 9, 64, dtype=F64)
    cos = torch.ones(1, 9, 16, dtype=F64)
    rope = (cos, torch.zeros_like(cos))
    base, state = mixer.memory_read(x, rope)
    with torch.no_grad():
        mixer.q_proj.weight[32:] += 1.0  # query heads 2, 3 = KV group 1
    changed, changed_state = mixer.memory_read(x, rope)
    assert torch.equal(changed[..., :32], base[..., :32]) and not torch.equal(changed[..., 32:], base[..., 32:])
    assert torch.equal(changed_state.key_sum, state.key_sum)


@pytest.mark.parametrize("window", [0, 3])
def test_memory_without_rope_reads_the_same_at_any_absolute_position(window):
    """rsa_memory_rope=False: shifting every position by 50 leaves the layer's output unchanged (the window's RoPE is
    relative, the memory sees no positions); with RoPE in the memory the slot assignments move, and so does the
    output. The model the memory would meet past its training length is the shifted one."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    outputs = {}
    for memory_rope in (True, False):
        config = tiny_config(RSAConfig, num_hidden_layers=1, rsa_window=window, rsa_memory_rope=memory_rope,
                             rsa_readout="softmax_count", **RSA_SMALL)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        mixer = RSAMixer(config, 0).double()
        mixer.reset_parameters()
        x = torch.randn(2, 13, 64, dtype=F64)
        rotary = LlamaRotaryEmbedding(config)
        outputs[memory_rope] = [mixer.memory_read(x, rotary(x, torch.arange(13)[None] + shift))[0]
                                for shift in (0, 50)]
    # 1e-6: the rotary tables are computed in fp32, so the window's relative invariance holds to fp32 rounding
    torch.testing.assert_close(*outputs[False], rtol=0, atol=1e-10 if window == 0 else 1e-6)
    assert (outputs[True][0] - outputs[True][1]).abs().max() > 1e-3


@pytest.mark.parametrize("options", first_in_fast(
    dict(rsa_window=4),  # 13 - 4 = 9 tokens written: two whole chunks of 4 and one row of a third
    dict(rsa_window=5, rsa_memory_rope=False, rsa_decay=True, rsa_query_read=True),  # the extras sliced too
    dict(rsa_window=13), dict(rsa_window=16)))  # nothing leaves the window: the memory is not run, no slicing
def test_a_first_unpadded_call_runs_the_memory_on_what_left_the_window_alone(options):
    """Without padding, a first call's memory receives nothing at its first w positions in every row (the window
    delays the writes): it runs on the other positions in the static layout of an unpadded sequence, where an
    all-ones mask takes the masked (packed) layout. In fp64, the two agree: the output, every gradient and the
    state handed to the next call."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config(RSAConfig, num_hidden_layers=1, rsa_readout="softmax_count", **{**RSA_SMALL, **options})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    mixer = RSAMixer(config, 0).double()
    mixer.reset_parameters()
    with torch.no_grad():  # the MLPs, decay and query read away from their identity / zero init
        for parameter in mixer.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    x = torch.randn(2, 13, 64, dtype=F64, requires_grad=True)
    rotary = LlamaRotaryEmbedding(config)(x, torch.arange(13)[None])
    results = []
    for token_mask in (None, torch.ones(2, 13, dtype=torch.bool)):
        out, state = mixer.memory_read(x, rotary, token_mask)
        grads = torch.autograd.grad(out.pow(2).sum(), [x, *mixer.parameters()], allow_unused=True)
        results.append((out, state.memory, grads))
    (out, memory, grads), (masked_out, masked_memory, masked_grads) = results
    torch.testing.assert_close(out, masked_out, rtol=0, atol=1e-12)
    for grad, masked in zip(grads, masked_grads, strict=True):
        assert (grad is None) == (masked is None)
        if grad is not None:
            torch.testing.assert_close(grad, masked, rtol=0, atol=1e-12)
    for name in ("key_sum", "value_sum", "mass", "relation_sum", "key_ref", "value_ref", "count"):
        torch.testing.assert_close(getattr(memory, name), getattr(masked_memory, name), rtol=0, atol=1e-12)


def test_memory_without_rope_converts_on_unrotated_keys():
    """The prototypes are k-means of the keys the memory writes: unrotated when rsa_memory_rope is off."""
    teacher = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).eval()
    ids = torch.randint(1, 101, (2, 24))
    with torch.no_grad():
        hidden = teacher.model.layers[0].input_layernorm(teacher.model.embed_tokens(ids))
        rope = teacher.model.rotary_emb(hidden, torch.arange(24)[None])
    prototypes = {}
    for memory_rope in (True, False):
        config = tiny_config(RSAConfig, rsa_readout="softmax_count", rsa_num_levels=1, rsa_num_slots=4,
                             rsa_memory_rope=memory_rope)
        config._attn_implementation = "sdpa"
        mixer = RSAMixer.from_attention(teacher.model.layers[0].self_attn, config, 0, hidden, rope)
        prototypes[memory_rope] = mixer.prototypes[:, 0].detach()  # (G, m, hd)
    _, plain_keys, _ = mixer.project(hidden, rope, rotate=False)  # (N, G, T, hd)
    plain_keys = plain_keys.transpose(0, 1).flatten(1, 2)  # (G, N*T, hd)
    # the unrotated keys sit closer to their own centres than to the centres of the rotated keys
    assert torch.cdist(plain_keys, prototypes[False]).amin(-1).mean() < \
        torch.cdist(plain_keys, prototypes[True]).amin(-1).mean()


def test_zero_state_init_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_mixers.mixers.rsa"):
        tiny_rsa_model(rsa_state_init="zeros")
    assert "can never separate" in caplog.text


def test_from_attention_starts_closer_to_the_teacher_than_random_init():
    teacher = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).eval()
    attention = teacher.model.layers[0].self_attn
    ids = torch.randint(1, 101, (4, 48))
    with torch.no_grad():
        hidden = teacher.model.layers[0].input_layernorm(teacher.model.embed_tokens(ids))
        rope = teacher.model.rotary_emb(hidden, torch.arange(48)[None])
    config = tiny_config(RSAConfig, rsa_readout="softmax_count", rsa_num_levels=2, rsa_num_slots=16,
                         rsa_chunk_size=16)
    config._attn_implementation = "sdpa"
    converted = RSAMixer.from_attention(attention, config, 0, hidden[:2], rope).eval()  # rope: batch 1
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(converted, name).weight, getattr(attention, name).weight)
    scratch = RSAMixer(tiny_config(RSAConfig, rsa_num_levels=2, rsa_num_slots=16, rsa_chunk_size=16), 0).eval()
    scratch.config._attn_implementation = "sdpa"
    scratch.reset_parameters()
    scratch.load_state_dict(attention.state_dict(), strict=False)
    held_out = (hidden[2:], rope)
    converted_error = attention_output_error(converted, attention, *held_out)
    scratch_error = attention_output_error(scratch, attention, *held_out)
    assert converted_error < scratch_error, (converted_error, scratch_error)
    assert converted_error < 0.9


def test_from_attention_rejects_modules_that_are_not_attention():
    config = tiny_config(RSAConfig, **RSA_SMALL)
    with pytest.raises(ValueError, match="has parameters RSAMixer does not: \\['weight'\\]"):
        RSAMixer.from_attention(torch.nn.Linear(4, 4, bias=False), config, 0)
    only_queries = torch.nn.Module()
    only_queries.q_proj = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(ValueError, match="lacks \\['k_proj.weight', 'v_proj.weight', 'o_proj.weight'\\]"):
        RSAMixer.from_attention(only_queries, config, 0)


def test_bf16_model_runs_with_fp32_state():
    model = tiny_rsa_model(torch.bfloat16)
    ids = torch.randint(1, 101, (1, 12))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        reference = tiny_rsa_model()(ids).logits
    assert cache.layers[0].state.key_sum.dtype == torch.float32
    assert ((logits.float() - reference).norm() / reference.norm()).item() < 5e-2


def test_from_attention_is_exact_on_the_first_token():
    """Level-0 cluster attention with exact value means: at t = 1 every slot holds v_1, so the output is o_proj(v_1)."""
    teacher = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).eval()
    attention = teacher.model.layers[1].self_attn
    hidden = torch.randn(3, 1, 64)
    rope = teacher.model.rotary_emb(hidden, torch.zeros(1, 1, dtype=torch.long))
    config = tiny_config(RSAConfig, rsa_readout="softmax_count", **RSA_SMALL)
    config._attn_implementation = "sdpa"
    converted = RSAMixer.from_attention(attention, config, 1, torch.randn(2, 10, 64),
                                        teacher.model.rotary_emb(hidden, torch.arange(10)[None])).eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(hidden, rope), attention(hidden, rope, None)[0], rtol=1e-5, atol=1e-6)


def test_short_conv_is_identity_at_init_and_decodes_exactly():
    ids = torch.randint(1, 101, (2, 15))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    plain, convolved = tiny_rsa_model(F64), tiny_rsa_model(F64, rsa_short_conv=4)
    convolved.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(convolved(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   rtol=0, atol=1e-12)
        for layer in convolved.model.layers:
            layer.mixer.short_conv.normal_()  # a trained-looking kernel
        full = convolved(ids, attention_mask=mask).logits
        stepped, cache = step_through(convolved, ids, mask, 5)
        torch.testing.assert_close(stepped[mask.bool()], full[mask.bool()], rtol=0, atol=1e-10)
        alone = convolved(ids[:1, 3:]).logits  # row 0 without its padding
        torch.testing.assert_close(full[0, 3:], alone[0], rtol=0, atol=1e-10)
    assert cache.layers[0].conv_history.shape == (2, 3, 64)


def test_short_conv_of_one_is_refused():
    with pytest.raises(ValueError, match="rsa_short_conv must be 0 \\(off\\) or a kernel size >= 2"):
        tiny_config(RSAConfig, rsa_short_conv=1)


def test_decay_option_decodes_exactly():
    model = tiny_rsa_model(F64, rsa_decay=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mixer.decay_proj.weight.normal_(0, 0.5)  # token-dependent decay
    ids = torch.randint(1, 101, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    stepped, _ = step_through(model, ids, mask, 6)
    torch.testing.assert_close(stepped[mask.bool()], full[mask.bool()], rtol=0, atol=1e-10)
    assert tiny_config(RSAConfig).rsa_decay is False  # off by default


def test_from_attention_with_a_bf16_teacher():
    teacher = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).eval()
    teacher = teacher.to(torch.bfloat16)
    hidden = torch.randn(2, 12, 64, dtype=torch.bfloat16)
    rope = teacher.model.rotary_emb(hidden, torch.arange(12)[None])
    config = tiny_config(RSAConfig, rsa_readout="softmax_count", **RSA_SMALL)
    config._attn_implementation = "sdpa"
    mixer = RSAMixer.from_attention(teacher.model.layers[0].self_attn, config, 0, hidden, rope)
    assert mixer.prototypes.dtype == torch.bfloat16 and torch.isfinite(mixer.prototypes.float()).all()
    assert mixer(hidden, rope).shape == (2, 12, 64)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = torch.randint(1, 101, (2, 13))
    grads = []
    for checkpointing in (False, True):
        model = tiny_rsa_model(rsa_decay=True, rsa_short_conv=3, rsa_query_read=True).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("prototypes" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_rsa_cache_refuses_to_crop():
    model = tiny_rsa_model()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(1, 101, (1, 6)), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot drop tokens"):
        cache.layers[0].crop(-2)
    assert not cache.layers[0].is_croppable


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
@pytest.mark.parametrize("block, window", first_in_fast(("llama", 4), ("llama", 0), ("sessa", 0)))
def test_compiled_decode_step_equals_the_eager_step(block, window, monkeypatch):
    """rsa_compile_decode: the torch.compile'd block step (one graph shared by every layer) = the reference, with the
    local window too. The first case through Inductor, the others traced without its code (as the contract's
    variants)."""
    if (block, window) != ("llama", 4):
        compile_decode_without_inductor(monkeypatch)
    torch._dynamo.reset()
    ids = torch.randint(1, 101, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # padded rows must not write, compiled or not
    options = dict(layer_types=["rsa", "rsa"], rsa_query_read=True, rsa_decay=True, rsa_short_conv=3, block=block,
                   rsa_window=window)
    eager = tiny_rsa_model(**options)
    compiled = tiny_rsa_model(**options, rsa_compile_decode=True)
    compiled.load_state_dict(eager.state_dict())
    reference, _ = step_through(eager, ids, mask, prefill=5)
    reset_compiled_steps()
    stepped, _ = step_through(compiled, ids, mask, prefill=5)
    torch.testing.assert_close(stepped[mask.bool()], reference[mask.bool()], rtol=1e-5, atol=1e-5)
    assert graphs_built() == 1  # one graph (or exported program) for both layers and every step: no recompiles


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_a_step_replayed_into_reused_buffers_is_copied_out(monkeypatch):
    """decode_compiled with a CUDA-graph step (one graph for every block, each replay writing into the same output
    memory): stood in for on the CPU by the eager block step writing into fixed buffers. Without the copy, the
    second layer's replay would overwrite the first layer's cached state; with it, decoding equals eager."""
    from hf_mixers.core.cache import map_tensors
    from hf_mixers.decode import engine

    def tensors(value) -> list:
        found = []
        map_tensors(value, lambda tensor: found.append(tensor) or tensor)
        return found

    buffers = {}

    def replayed(*args):  # every call returns the same tensors, refilled, as a CUDA graph's replay does
        outputs = engine.block_step(*args)
        if "out" not in buffers:
            buffers["out"] = map_tensors(outputs, torch.Tensor.clone)
        for held, fresh in zip(tensors(buffers["out"]), tensors(outputs), strict=True):
            held.copy_(fresh)
        return buffers["out"]

    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "compile_step", lambda function, device, mode=None, dynamic=False: (replayed, True))
    ids = torch.randint(1, 101, (2, 10))
    mask = torch.ones_like(ids)
    options = dict(layer_types=["rsa", "rsa"], rsa_window=4)
    eager = tiny_rsa_model(**options)
    stepped_model = tiny_rsa_model(**options, rsa_compile_decode=True)
    stepped_model.load_state_dict(eager.state_dict())
    reference, _ = step_through(eager, ids, mask, prefill=4)
    stepped, _ = step_through(stepped_model, ids, mask, prefill=4)
    torch.testing.assert_close(stepped, reference, rtol=1e-5, atol=1e-5)
