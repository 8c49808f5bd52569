"""Decoder blocks around a mixer.

    LlamaBlock ("llama"):  x + mixer(RMSNorm(x)), then + MLP(RMSNorm(.))   a converted teacher keeps its norms and MLP
    SessaBlock ("sessa"):  x + W_out(mixer(GELU(a)) * g), [a | g] = W_in(LayerNorm(x))   the Sessa paper's native
                           block: no MLP, a linear gate, exact erf GELU, LayerNorm eps 1e-5

A block's ``around(x, mix)`` runs its own layers around ``mix`` (normed input -> mixer output); ``forward`` calls
it with the mixer, or hands a decode token to the compiled step of the block around the mixer's ``token_step``
(hf_mixers/decode) when the switch asks for it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from ..decode.engine import decode_compiled
from ..decode.switch import compiles


class MixerBlock(GradientCheckpointingLayer):
    def around(self, hidden_states, mix):
        raise NotImplementedError

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        if compiles(self.mixer, hidden_states, past_key_values):
            output = decode_compiled([self], hidden_states, position_embeddings, token_mask, past_key_values)
            if output is not None:  # None: the step cannot be compiled here, the token runs eagerly
                return output
        return self.around(hidden_states, lambda x: self.mixer(x, position_embeddings, attention_mask, token_mask,
                                                              past_key_values, **kwargs))


class LlamaBlock(MixerBlock):
    """The Llama decoder layer with its attention replaced by the layer's mixer (names kept: input_layernorm, ...)."""

    def __init__(self, config, layer_idx: int, mixer_class):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = mixer_class(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def around(self, hidden_states, mix):
        hidden_states = hidden_states + mix(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SessaBlock(MixerBlock):
    """The Sessa paper's native layer: y = x + W_out(mixer(GELU(a)) * g), [a | g] = W_in(LN(x)), with any mixer."""

    def __init__(self, config, layer_idx: int, mixer_class):
        super().__init__()
        size = config.hidden_size
        self.norm = nn.LayerNorm(size, eps=1e-5)
        self.in_proj = nn.Linear(size, 2 * size, bias=True)
        self.mixer = mixer_class(config, layer_idx)
        self.out_proj = nn.Linear(size, size, bias=True)

    def around(self, hidden_states, mix):
        value, gate = self.in_proj(self.norm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.out_proj(mix(F.gelu(value)) * gate)


BLOCK_CLASSES = {"llama": LlamaBlock, "sessa": SessaBlock}
