"""An example mixer defined outside hf_mixers: a causal exponential moving average of the teacher's values.

    v_t = v_proj(x_t)                          per KV head, (B, Hkv, hd), the teacher's value projection
    s_t = a * s_{t-1} + (1 - a) * v_t          a = sigmoid(decay_logit) per KV head; padding leaves s unchanged
    y_t = o_proj(s_t repeated over the query heads of each KV group)

Constant decode state (B, Hkv, hd); from_attention copies the teacher's v_proj and o_proj. docs/adding-a-mixer.md
walks through it; tests/contract/test_adding_a_mixer.py runs it through the contract suite, conversion, distillation and
remote code.
"""

import torch
from torch import nn
from transformers import initialization as init

from hf_mixers import MixerOption, MixerSpec, SequenceMixer, register_mixer
from hf_mixers.core.cache import RecurrentStateLayer
from hf_mixers.core.registry import number
from hf_mixers.kernels.common import compute_dtype


class EMAMixer(SequenceMixer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.head_dim = config.head_dim
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim,
                                bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                bias=config.attention_out_bias)
        self.decay_logit = nn.Parameter(torch.zeros(config.num_key_value_heads))

    def reset_parameters(self):
        init.constant_(self.decay_logit, self.config.ema_decay_init)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        batch, length, _ = hidden_states.shape
        dtype = compute_dtype(hidden_states.dtype)  # the state accumulates in fp32 (fp64 stays fp64)
        values = self.v_proj(hidden_states).unflatten(-1, (-1, self.head_dim)).to(dtype)  # (B, T, Hkv, hd)
        layer = None if past_key_values is None else past_key_values.layers[self.layer_idx]
        state = None if layer is None else layer.state
        if state is None:
            state = values.new_zeros(batch, values.shape[2], self.head_dim)  # (B, Hkv, hd)
        decay = torch.sigmoid(self.decay_logit.to(dtype))[:, None]  # (Hkv, 1)
        real = torch.ones(batch, length, dtype=torch.bool, device=values.device) if token_mask is None \
            else token_mask[:, -length:]
        outputs = []
        for t in range(length):  # the reference recurrence: clear, and fast enough for an example
            updated = decay * state + (1 - decay) * values[:, t]
            state = torch.where(real[:, t, None, None], updated, state)
            outputs.append(state)
        out = torch.stack(outputs, dim=1).repeat_interleave(self.groups, dim=2)  # (B, T, H, hd)
        if layer is not None:
            layer.update_state(state, length)
        return self.o_proj(out.flatten(2).to(hidden_states.dtype))


class EMACacheLayer(RecurrentStateLayer):
    _layer_type = "ema"


EMA = register_mixer(MixerSpec(
    name="ema", mixer_class=EMAMixer, title="EMA",
    summary="a causal exponential moving average of the teacher's values (an example mixer)",
    options=(MixerOption("ema_decay_init", 2.0, "initial logit of the per-head decay a = sigmoid(logit)",
                         number),),
    cache_layer=EMACacheLayer, constant_state=True,
    limitations=("EMA layers average the past with one decay per head: they cannot retrieve a specific token.",)))
