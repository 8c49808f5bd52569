"""The Sessa mixer and model: spec identities at model level, the official layer, dtypes, checkpointing."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import TINY, compile_decode_without_inductor, tiny_config, tiny_sessa_model
from hf_mixers import MixerForCausalLM, SessaForCausalLM
from hf_mixers.core.attention import FullAttention
from hf_mixers.kernels.feedback_solve import feedback_solve_dense
from hf_mixers.conversion.official_sessa import from_official_layer
from hf_mixers.mixers.sessa import SessaMixer


def load_teacher_weights(student, teacher):
    """Copy a Llama-family teacher into a student whose attention modules are named ``mixer``."""
    state = {name.replace(".self_attn.", ".mixer."): value for name, value in teacher.state_dict().items()}
    missing, unexpected = student.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(any(part in name for part in ("feedback_proj", "gamma_")) for name in missing)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TEACHERS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}, {}),
    "llama3_rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE),
                    dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}, dict(attention_bias=True, attention_out_bias=False)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32), dict(qk_norm=True, head_dim=32)),
}


@pytest.mark.parametrize("family", sorted(TEACHERS))
@pytest.mark.parametrize("mixer", ["full_attention", "sessa"])
def test_gamma_zero_equals_teacher_bit_for_bit(family, mixer):
    teacher_config_class, teacher_class, teacher_extra, student_extra = TEACHERS[family]
    kwargs = {k: v for k, v in TINY.items() if k != "pad_token_id"}
    teacher = teacher_class(teacher_config_class(**kwargs, **teacher_extra)).eval()
    if family == "qwen2":  # make the q/k/v biases matter
        for layer in teacher.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)
    student = SessaForCausalLM(tiny_config(layer_types=[mixer] * 2, **student_extra)).eval()
    load_teacher_weights(student, teacher)
    ids = torch.randint(1, TINY["vocab_size"], (2, 24))
    with torch.no_grad():
        assert torch.equal(student(ids).logits, teacher(ids).logits)


def test_gamma_zero_training_grads_reach_only_gamma():
    """Spec §6 #9: with gamma == 0 the feedback q/k get exactly zero gradient, the gain does not."""
    model = tiny_sessa_model(feedback=False).train()
    ids = torch.randint(1, 101, (2, 16))
    model(ids, labels=ids).loss.backward()
    mixer = model.model.layers[0].mixer
    assert torch.count_nonzero(mixer.feedback_proj.weight.grad) == 0
    assert mixer.gamma_proj.weight.grad.abs().sum() > 0 and mixer.gamma_bias.grad.abs() > 0


@pytest.mark.parametrize("dtype", [torch.float64])
def test_chunked_equals_dense_model(dtype):
    ids = torch.randint(1, 101, (2, 40))
    chunked = tiny_sessa_model(dtype=dtype, sessa_chunk_size=7)
    dense = tiny_sessa_model(dtype=dtype, sessa_solver="dense")
    with torch.no_grad():
        torch.testing.assert_close(chunked(ids).logits, dense(ids).logits, rtol=0, atol=1e-10)


def test_model_gradients_chunked_equal_dense():
    ids = torch.randint(1, 101, (2, 20))
    grads = []
    for solver in ("chunked", "dense"):
        model = tiny_sessa_model(dtype=torch.float64, sessa_solver=solver, sessa_chunk_size=6).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-10, msg=name)


def test_bf16_forward_close_to_fp32():
    ids = torch.randint(1, 101, (2, 48))
    model = tiny_sessa_model()
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)(ids).logits.float()
    assert ((low - reference).norm() / reference.norm()).item() < 3e-2


def test_gradient_checkpointing_matches():
    ids = torch.randint(1, 101, (2, 20))
    grads = []
    for checkpointing in (False, True):
        model = tiny_sessa_model().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hybrid_model_mixes_layer_kinds():
    model = tiny_sessa_model(layer_types=["full_attention", "sessa"])
    assert type(model.model.layers[0].mixer).__name__ == "FullAttention"
    assert isinstance(model.model.layers[1].mixer, SessaMixer)
    assert model(torch.randint(1, 101, (1, 9))).logits.shape == (1, 9, 101)


def test_positional_writer_sequence():
    """Spec §8.6: uniform feedback (q = 0) and constant f give c_t = 1 + (gamma / t) sum_{j<t} c_j."""
    config = tiny_config(num_hidden_layers=1, sessa_solver="dense")
    config._attn_implementation = "sdpa"  # standalone mixer: no model sets the attention backend
    mixer = SessaMixer(config, 0).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.zero_()
        mixer.gamma_bias.fill_(torch.atanh(torch.tensor(0.5 / config.sessa_gamma_max, dtype=torch.float64)).item())
        mixer.o_proj.weight.copy_(torch.eye(64))
        mixer.v_proj.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64))
        mixer.v_proj.bias[0] = 1.0
    x = torch.zeros(1, 6, 64, dtype=torch.float64)
    cos = torch.ones(1, 6, 16, dtype=torch.float64)
    s = mixer(x, (cos, torch.zeros_like(cos)))[0, :, 0]
    assert s.tolist() == pytest.approx([1, 1.5, 1.625, 1.6875, 1.7265625, 1.75390625], abs=1e-12)


# --- the official SessaLayer, written independently from shared/specs/sessa.md §2-§3 ------------------------

def official_state_dict(hidden, heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = hidden // heads * kv_heads

    def u(*shape):
        return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * hidden**-0.5

    state = {"ln.weight": 1 + 0.1 * u(hidden), "ln.bias": 0.1 * u(hidden), "W_in.weight": u(2 * hidden, hidden),
             "W_in.bias": u(2 * hidden), "W_out.weight": u(hidden, hidden), "W_out.bias": u(hidden),
             "mixer.q_proj.weight": u(hidden, hidden), "mixer.q_proj.bias": u(hidden),
             "mixer.k_proj.weight": u(kv, hidden), "mixer.k_proj.bias": u(kv),
             "mixer.v_proj.weight": u(kv, hidden), "mixer.v_proj.bias": u(kv),
             "mixer.proj_fb.weight": u(2 * hidden, hidden), "mixer.proj_fb.bias": u(2 * hidden),
             "mixer.gamma_ctx.weight": u(1, hidden), "mixer.gamma_bias": torch.tensor(1.0, dtype=torch.float64),
             "mixer.rope_inv_freq": torch.zeros(hidden // heads // 2)}
    if heads > 1:
        state["mixer.out_proj.weight"] = u(hidden, hidden)
    return state


def official_forward(state, x, heads, kv_heads, gamma_max=0.999, rope=True):
    batch, length, hidden = x.shape
    d = hidden // heads
    h = F.layer_norm(x, (hidden,), state["ln.weight"], state["ln.bias"], eps=1e-5)
    a, gate = F.linear(h, state["W_in.weight"], state["W_in.bias"]).chunk(2, dim=-1)
    a = F.gelu(a)
    q = F.linear(a, state["mixer.q_proj.weight"], state["mixer.q_proj.bias"]).view(batch, length, heads, d)
    k = F.linear(a, state["mixer.k_proj.weight"], state["mixer.k_proj.bias"]).view(batch, length, kv_heads, d)
    v = F.linear(a, state["mixer.v_proj.weight"], state["mixer.v_proj.bias"]).view(batch, length, kv_heads, d)
    if rope:  # interleaved pairs (2i, 2i+1), base 10000, fp32 angles as in the official code
        freq = 10000.0 ** (-2 * torch.arange(d // 2, dtype=torch.float32) / d)
        angle = (torch.arange(length, dtype=torch.float32)[:, None] * freq[None, :]).double()
        cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]

        def rotate(z):
            even, odd = z[..., 0::2], z[..., 1::2]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

        q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv_heads, dim=2), v.repeat_interleave(heads // kv_heads, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    o = torch.einsum("bhts,bshd->bthd", logits.masked_fill(causal, float("-inf")).softmax(-1), v).reshape(
        batch, length, hidden)
    f = F.linear(o, state["mixer.out_proj.weight"]) if heads > 1 else o
    qb, kb = F.linear(a, state["mixer.proj_fb.weight"], state["mixer.proj_fb.bias"]).chunk(2, dim=-1)
    strict = torch.ones(length, length, dtype=torch.bool).triu(0)
    fb_logits = (qb @ kb.transpose(1, 2) * hidden**-0.5).masked_fill(strict, float("-inf"))
    fb_logits[:, 0, 0] = 0.0
    alpha = fb_logits.softmax(-1).masked_fill(strict, 0.0)
    alpha[:, 0, :] = 0.0
    gamma = gamma_max * torch.tanh(state["mixer.gamma_bias"] + F.linear(a, state["mixer.gamma_ctx.weight"]))
    s = torch.linalg.solve_triangular(-(gamma * alpha), f, upper=False, unitriangular=True)
    return x + F.linear(s * gate, state["W_out.weight"], state["W_out.bias"])


@pytest.mark.parametrize("heads, kv_heads, rope", [(4, 2, True), (4, 4, False), (1, 1, True)])
def test_from_official_layer_matches_official_math(heads, kv_heads, rope):
    state = official_state_dict(32, heads, kv_heads)
    block = from_official_layer(state, n_heads=heads, n_kv_heads=kv_heads, use_forward_rope=rope)
    assert block.block.in_proj.weight.dtype == torch.float64
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    # Without RoPE the two agree to fp64 round-off. With RoPE ours takes cos/sin of the fp32 angles in fp32
    # (transformers' rotary embedding), the official code in the activation dtype: ~1e-7 apart.
    with torch.no_grad():
        torch.testing.assert_close(block(x), official_forward(state, x, heads, kv_heads, rope=rope),
                                   rtol=0, atol=1e-6 if rope else 1e-10)
    assert (heads == 1) == isinstance(block.block.mixer.o_proj, torch.nn.Identity)


def test_from_official_layer_rejects_mismatched_state():
    state = official_state_dict(32, 4, 2)
    with pytest.raises(ValueError, match="missing \\['mixer.out_proj.weight'\\]"):
        from_official_layer({k: v for k, v in state.items() if k != "mixer.out_proj.weight"}, n_heads=4,
                            n_kv_heads=2)
    with pytest.raises(ValueError, match="no 'W_in.weight'"):
        from_official_layer({"foo": torch.zeros(1)}, n_heads=4)


def test_native_block_model_trains_and_generates():
    model = tiny_sessa_model(block="sessa", feedback=False, attention_bias=True)
    assert model.model.layers[0].mixer.gamma_bias.item() == 1.0  # official init: feedback on from step 0
    ids = torch.randint(1, 101, (2, 12))
    model.train()(ids, labels=ids).loss.backward()
    assert model.model.layers[0].mixer.feedback_proj.weight.grad.abs().sum() > 0
    out = model.eval().generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)


def test_all_attention_mixer_model_equals_llama():
    teacher = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).eval()
    student = MixerForCausalLM(tiny_config(cls=type(tiny_config()).__mro__[1])).eval()
    load_teacher_weights(student, teacher)
    ids = torch.randint(1, 101, (2, 16))
    with torch.no_grad():
        assert torch.equal(student(ids).logits, teacher(ids).logits)


def _mixer(**overrides):
    config = tiny_config(num_hidden_layers=1, **overrides)
    config._attn_implementation = "sdpa"  # standalone mixer: no model sets the attention backend
    mixer = SessaMixer(config, 0).double()
    with torch.no_grad():
        torch.nn.init.normal_(mixer.gamma_proj.weight, std=0.3)
        mixer.gamma_bias.fill_(0.3)
    return mixer


def _rope(length, head_dim=16):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    x = torch.zeros(1, length, 1, dtype=torch.float64)
    return LlamaRotaryEmbedding(tiny_config())(x, torch.arange(length)[None])


def test_feedback_heads_route_channel_groups_independently():
    mixer = _mixer(sessa_feedback_heads=4, sessa_feedback_dim=32)
    x = torch.randn(2, 15, 64, dtype=torch.float64)
    with torch.no_grad():
        out = mixer(x, _rope(15))
        f = FullAttention.forward(mixer, x, _rope(15))
        query, key = mixer.feedback_proj(x).split(32, dim=-1)
        gamma = mixer.gain(x)
        for h in range(4):  # head h: channels 16h..16h+15 of f, feedback q/k channels 8h..8h+7
            expected = feedback_solve_dense(f[..., 16 * h:16 * h + 16], query[..., 8 * h:8 * h + 8],
                                            key[..., 8 * h:8 * h + 8], gamma, scale=8**-0.5)
            torch.testing.assert_close(out[..., 16 * h:16 * h + 16], expected, rtol=0, atol=1e-12)


def test_whole_mixer_gradcheck_fp64():
    mixer = _mixer(sessa_chunk_size=3, sessa_feedback_heads=2)
    x = torch.randn(1, 7, 64, dtype=torch.float64, requires_grad=True)
    rope = _rope(7)
    assert torch.autograd.gradcheck(lambda inputs: mixer(inputs, rope), (x,))


def test_lean_cache_keeps_outputs_in_the_activation_dtype():
    """``sessa_outputs_cache="activation"`` stores s in bf16 for a bf16 model (the default keeps fp32), halving those
    bytes; decoding from that cache stays within bf16 rounding of the fp32-cached decode."""
    from transformers import DynamicCache

    from hf_mixers.core.cache import cache_nbytes

    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    caches, logits = {}, {}
    for mode in ("compute", "activation"):
        model = tiny_sessa_model(torch.bfloat16, sessa_outputs_cache=mode, sessa_feedback_dim=8)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            logits[mode] = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                                      for t in range(8, 12)], 1).float()
        caches[mode] = cache
    assert caches["compute"].layers[0].outputs.dtype == torch.float32
    assert caches["activation"].layers[0].outputs.dtype == torch.bfloat16
    outputs = sum(layer.outputs.numel() for layer in caches["compute"].layers)
    used = {mode: cache_nbytes(cache, spare=False) for mode, cache in caches.items()}  # the cached tokens' bytes
    assert used["compute"] - used["activation"] == 2 * outputs  # 4 -> 2 bytes each
    assert (logits["activation"] - logits["compute"]).abs().max() < 0.1 * logits["compute"].abs().max()


@pytest.mark.parametrize("options", [dict(sessa_feedback_heads=2), dict(block="sessa", sessa_forward_rope=False),
                                     dict(qk_norm=True, attention_bias=True, sessa_outputs_cache="activation")],
                         ids=["two-feedback-heads", "native-block-nope", "qk-norm-bias-lean-cache"])
def test_the_compiled_token_step_equals_the_eager_step_for_every_layout(options, monkeypatch):
    """config.compile_decode on Sessa (one graph with symbolic shapes, the cache read where it lies): equal to the
    eager decode and one forward on a left-padded batch, for the layouts the contract's tiny config does not take.
    Traced without Inductor's code (as the contract's variants: its sessa case and the growing-cache test below
    compile with Inductor)."""
    from hf_mixers.testing import _close, _decode, _inputs, _logits, tiny_model

    compile_decode_without_inductor(monkeypatch)
    eager, compiled = tiny_model("sessa", **options), tiny_model("sessa", compile_decode=True, **options)
    ids, mask = _inputs()
    valid = mask.bool()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stepped = _decode(compiled, ids, mask)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    _close(stepped[valid], _decode(eager, ids, mask)[valid], "compiled vs eager decode", torch.float32)
    _close(stepped[valid], _logits(eager, ids, mask)[valid], "compiled decode vs one forward", torch.float32)


def test_the_compiled_token_step_is_one_graph_while_the_cache_grows():
    """80 tokens after a 5-token prompt: the cache's buffers grow past their first spare room (64 tokens) and the
    cached views change length and strides every step, and the step is still the graph of the first step."""
    from transformers import DynamicCache

    from hf_mixers.testing import _close, _logits, tiny_model

    model = tiny_model("sessa", dtype=torch.float32, compile_decode=True, max_position_embeddings=128)
    eager = tiny_model("sessa", dtype=torch.float32, max_position_embeddings=128)
    ids = torch.randint(3, model.config.vocab_size, (1, 85), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :5], past_key_values=cache, use_cache=True).logits]
        buffer = cache.layers[0].buffers["outputs"][0]
        for t in range(5, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert cache.layers[0].buffers["outputs"][0].data_ptr() != buffer.data_ptr()  # the buffer did grow
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    _close(torch.cat(steps, 1), _logits(eager, ids, torch.ones_like(ids)), "compiled decode vs one forward",
           torch.float32)


def test_a_step_of_growing_shapes_is_never_replayed_as_a_cuda_graph():
    """A CUDA graph has fixed shapes: Sessa's compiled step would record one per context length, so its
    "reduce-overhead" runs compiled without one (RSA's, of fixed shapes, replays one)."""
    from hf_mixers.decode.engine import block_step, compile_step

    assert compile_step(block_step, "cuda", "reduce-overhead", dynamic=True)[1] is False
    assert compile_step(block_step, "cuda", "reduce-overhead")[1] is True


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_generate_through_the_compiled_step_equals_the_eager_one(monkeypatch):
    """generate() greedy and with beam search (whose cache reordering hands the step whole tensors instead of buffer
    views) writes the same tokens with config.compile_decode as without (traced without Inductor's code)."""
    from hf_mixers.testing import _inputs, tiny_model

    compile_decode_without_inductor(monkeypatch)
    eager = tiny_model("sessa", dtype=torch.float32)
    compiled = tiny_model("sessa", dtype=torch.float32, compile_decode=True)
    ids, mask = _inputs(length=6, pad=2)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=2)):
        expected, got = (model.generate(ids, attention_mask=mask, max_new_tokens=10, **options)
                         for model in (eager, compiled))
        assert torch.equal(got, expected), options
