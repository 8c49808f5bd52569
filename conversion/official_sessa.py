"""The Sessa paper's official layer in this toolkit: ``from_official_layer`` maps an official ``sessa.SessaLayer``
state dict onto the native Sessa block, so our implementation can be checked against the authors' code.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..mixers.sessa import SessaMixer
from ..model.blocks import SessaBlock
from ..model.config import config_class


class StandaloneSessaBlock(nn.Module):
    """A SessaBlock with its own rotary embedding: ``forward(x (B, T, D)) -> (B, T, D)`` at positions 0..T-1."""

    def __init__(self, config):
        super().__init__()
        config._attn_implementation = "sdpa"  # no model sets it here; SDPA applies the causal mask by itself
        self.config = config
        self.block = SessaBlock(config, 0, SessaMixer)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)[None]
        return self.block(x, position_embeddings=self.rotary_emb(x, positions))


def _interleaved_to_half(weight, heads, head_dim):
    """Reorder each head's output channels (0,1,2,3,...) -> (0,2,4,...,1,3,5,...).

    The official code rotates interleaved pairs (2i, 2i+1); transformers rotates (i, i + d/2) with the same
    frequencies. Permuting q and k identically makes the two conventions give identical attention scores.
    """
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    index = (torch.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    return weight[index]


def from_official_layer(state_dict, n_heads, n_kv_heads=None, gamma_max=0.999, use_forward_rope=True):
    """Build a native Sessa block carrying the weights of an official ``sessa.SessaLayer`` state dict.

    Mapping (official -> ours): ln -> block.norm; W_in -> block.in_proj; W_out -> block.out_proj;
    mixer.{q,k,v}_proj -> block.mixer.{q,k,v}_proj (q/k rows permuted per head, interleaved -> rotate-half RoPE);
    mixer.proj_fb -> block.mixer.feedback_proj; mixer.gamma_ctx -> block.mixer.gamma_proj;
    mixer.gamma_bias -> block.mixer.gamma_bias; mixer.out_proj (only when n_heads > 1) -> block.mixer.o_proj.
    Buffers (rope_inv_freq, causal masks) are recomputed, not copied. One deliberate difference: RoPE cos/sin
    are computed in fp32 (the official code casts the angles to the activation dtype first).

    Returns a ``StandaloneSessaBlock`` (forward(x: (B, T, D)) -> (B, T, D)) in the state dict's dtype.
    """

    if "W_in.weight" not in state_dict:
        raise ValueError("from_official_layer: state_dict has no 'W_in.weight'; expected the state dict of an "
                         f"official sessa.SessaLayer, got keys {sorted(state_dict)[:8]}...")
    hidden = state_dict["W_in.weight"].shape[1]
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    config = config_class("sessa")(
        vocab_size=1, bos_token_id=None, eos_token_id=None, hidden_size=hidden, num_hidden_layers=1,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads, block="sessa", attention_bias=True, attention_out_bias=False,
        sessa_feedback_dim=hidden, sessa_feedback_bias=True, sessa_gamma_max=gamma_max,
        sessa_forward_rope=use_forward_rope, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sessa_solver="dense")
    head_dim = config.head_dim
    mapping = {"ln.weight": "norm.weight", "ln.bias": "norm.bias", "W_in.weight": "in_proj.weight",
               "W_in.bias": "in_proj.bias", "W_out.weight": "out_proj.weight", "W_out.bias": "out_proj.bias",
               "mixer.v_proj.weight": "mixer.v_proj.weight", "mixer.v_proj.bias": "mixer.v_proj.bias",
               "mixer.proj_fb.weight": "mixer.feedback_proj.weight", "mixer.proj_fb.bias": "mixer.feedback_proj.bias",
               "mixer.gamma_ctx.weight": "mixer.gamma_proj.weight", "mixer.gamma_bias": "mixer.gamma_bias"}
    for name in ("q_proj", "k_proj"):
        for kind in ("weight", "bias"):
            mapping[f"mixer.{name}.{kind}"] = f"mixer.{name}.{kind}"
    if n_heads > 1:
        mapping["mixer.out_proj.weight"] = "mixer.o_proj.weight"
    ignored = {"mixer.rope_inv_freq", "mixer.causal_mask_f_full", "mixer.causal_mask_fb_full"}
    unknown = sorted(set(state_dict) - set(mapping) - ignored)
    missing = sorted(set(mapping) - set(state_dict))
    if unknown or missing:
        raise ValueError(f"from_official_layer: state dict does not match an official SessaLayer with n_heads="
                         f"{n_heads}, n_kv_heads={n_kv_heads}: missing {missing}, unexpected {unknown}")
    converted = {}
    for source, target in mapping.items():
        tensor = state_dict[source].detach()
        if use_forward_rope and source.startswith(("mixer.q_proj", "mixer.k_proj")):
            heads = n_heads if "q_proj" in source else n_kv_heads
            tensor = _interleaved_to_half(tensor, heads, head_dim)
        converted[target] = tensor
    module = StandaloneSessaBlock(config).to(state_dict["W_in.weight"].dtype)
    module.block.load_state_dict(converted, strict=True)
    return module.eval()
