"""The selective_ssm mixer beyond the shared contract: what conversion copies and how, its config errors, its
constant fp32 state. (The scan forms: test_selective_scan.py; the paper's constructions: test_ssm_constructions.py.)"""

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import TEACHER_FAMILIES, cache_bytes_in_two_calls, tiny_teacher
from hf_mixers import SelectiveSSMConfig, SelectiveSSMForCausalLM, config_class
from hf_mixers.conversion.families import backbone_fields
from hf_mixers.core.attention import FullAttention
from hf_mixers.mixers.selective_ssm import SelectiveSSMMixer

F64 = torch.float64


def converted(family, variant="mamba2", **options):
    """Layer 0 of a tiny ``family`` teacher, its selective_ssm conversion (fp64), calibration inputs, config."""
    teacher = tiny_teacher(family, vocab_size=64).double()
    options = {"conv_mode": "independent", "conv_activation": "identity", **options}  # what convert sets
    config = config_class("selective_ssm")(**backbone_fields(teacher.config), layer_types=["selective_ssm"] * 3,
                                           selective_ssm_variant=variant,
                                           **{f"selective_ssm_{key}": value for key, value in options.items()})
    config._attn_implementation = "sdpa"
    hidden = torch.randn(2, 9, config.hidden_size, dtype=F64)
    positions = teacher.model.rotary_emb(hidden, torch.arange(9)[None])
    attention = teacher.model.layers[0].self_attn
    mixer = SelectiveSSMMixer.from_attention(attention, config, 0, calibration_hidden_states=hidden,
                                             calibration_position_embeddings=positions)
    return attention, mixer, hidden, positions, config


@pytest.mark.parametrize("family", TEACHER_FAMILIES)
def test_conversion_is_decayed_linear_attention_on_the_teachers_q_k_v_and_o(family):
    """C <- q, B <- k (GQA groups), u <- v, out <- o (biases and Qwen3's q/k norms carried, RoPE dropped), identity
    conv, D = 0, a transparent gate: with Δ = 1 and A = 0 the layer is exactly o(sum_{s<=t} v_s <k_s, q_t>)."""
    attention, mixer, hidden, positions, config = converted(family, rmsnorm=False)
    with torch.no_grad():
        mixer.dt_proj.weight.zero_()
        mixer.dt_proj.bias.fill_(math.log(math.e - 1.0))  # Δ = 1
        mixer.A_log.fill_(float("-inf"))  # A = 0
        output = mixer.mix(hidden)[0]
        exact = FullAttention.from_attention(attention, config, 0).double()
        exact.use_rope = False
        query, key, value = exact.project(hidden, positions)  # (B, H, T, d), (B, G, T, d): the teacher's, no RoPE
        groups = exact.num_key_value_groups
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = (query @ key.transpose(-1, -2)).tril()  # <k_s, q_t>, s <= t, unnormalised
        expected = attention.o_proj((scores @ value).transpose(1, 2).flatten(2))
    # 1e-8: the gate's bias is the fp32 root of silu(z) = 1 (the mixer is built in fp32, then cast to the teacher's)
    torch.testing.assert_close(output, expected, rtol=1e-7, atol=1e-9)
    assert (mixer.D == 0).all() and (mixer.z_proj.weight == 0).all()


def test_conversion_starts_the_output_norm_at_the_teachers_scale():
    attention, mixer, hidden, positions, config = converted("llama")
    exact = FullAttention.from_attention(attention, config, 0).double()
    teacher_output = exact.attend(hidden, positions, None, None)  # before o_proj
    rms = teacher_output.pow(2).mean(dim=(0, 1)).sqrt().view(mixer.heads, mixer.head_dim)
    torch.testing.assert_close(mixer.norm_weight, rms)


def test_s4d_conversion_shares_only_the_values_and_the_output():
    attention, mixer, *_ = converted("qwen2", variant="s4d")
    assert not hasattr(mixer, "q_proj") and not hasattr(mixer, "k_proj")
    torch.testing.assert_close(mixer.v_proj.weight, attention.v_proj.weight)
    torch.testing.assert_close(mixer.v_proj.bias, attention.v_proj.bias)
    torch.testing.assert_close(mixer.o_proj.weight, attention.o_proj.weight)


def test_a_shared_conv_cannot_start_from_the_teachers_projections():
    with pytest.raises(ValueError, match="selective_ssm_conv_mode='shared' computes B and C from the conv output"):
        converted("llama", variant="s6", conv_mode="shared")


@pytest.mark.parametrize("fields,message", [
    (dict(selective_ssm_variant="s4d", selective_ssm_window=8), "selective_ssm_window attends with the q/k "
                                                                 "projections"),
    (dict(selective_ssm_window=8, selective_ssm_state_size=4), r"selective_ssm_state_size \(4\) must equal head_dim"),
    (dict(selective_ssm_variant="s6", selective_ssm_input_scaling="zoh"), "needs a decay that varies along the "
                                                                          "channels or the state slots, not both"),
    (dict(selective_ssm_variant="mamba"), "selective_ssm_variant"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SelectiveSSMConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                           num_hidden_layers=1, vocab_size=61, **fields)


@pytest.mark.parametrize("variant", ["s6", "s4d", "mamba2", "delta_t"])
def test_the_decode_state_is_constant_and_fp32_in_a_bf16_model(variant):
    config = SelectiveSSMConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                num_hidden_layers=2, vocab_size=61, selective_ssm_variant=variant,
                                selective_ssm_chunk_size=8)
    model = SelectiveSSMForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, 61, (2, 40))
    cache, first, both = cache_bytes_in_two_calls(model, ids, 10)
    assert first == both  # 10 tokens or 40: the same bytes
    layer = cache.layers[0]
    assert layer.state.dtype == torch.float32 and layer.state.shape == (2, 4, 8, 8)
    assert layer.conv_history.shape[1] == config.selective_ssm_conv_width - 1


def test_the_windowed_cache_is_constant_too():
    config = SelectiveSSMConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                num_hidden_layers=1, vocab_size=61, selective_ssm_window=4,
                                selective_ssm_chunk_size=8)
    model = SelectiveSSMForCausalLM(config).eval()
    _, first, both = cache_bytes_in_two_calls(model, torch.randint(3, 61, (1, 60)), 12)
    assert first == both
    with torch.no_grad():
        cache = DynamicCache(config=config)
        model(torch.randint(3, 61, (1, 6)), past_key_values=cache, use_cache=True)
    assert cache.layers[0].state.keys.shape[2] == 4 and cache.layers[0].state.memory.dtype == torch.float32
