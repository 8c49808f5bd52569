"""Sessa: attention inside a feedback loop (shared/specs/sessa.md).

    f = o_proj(CausalAttention(q, k, v))             the teacher's attention, unchanged (forward branch)
    alpha[t, j] = softmax_{j<t}(<qb_t, kb_j> / sqrt(d_fb))   feedback attention over the strict past, no positions
    gamma_t = gamma_max * tanh(b + w . x_t)           signed gain, |gamma| < gamma_max < 1
    (I - gamma * alpha) s = f                          s_t = f_t + gamma_t sum_{j<t} alpha[t, j] s_j

With w = b = 0 (the llama-block default) gamma == 0 and s == f bit for bit, so a converted layer starts as its
teacher. The solve itself lives in ``kernels/feedback_solve.py`` (shared with GLTM). With several feedback
heads, head h routes channel group h of f with its own alpha_h (the official code has one head for all channels);
heads are folded into the batch so the kernel stays single-head.

Cache per layer: the attention K/V, plus the feedback keys kb and the solved outputs s (kept in fp32), so a
prefill onto a non-empty cache and token-by-token decoding continue exactly (spec §5.3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import FullAttention
from .kernels.dispatch import use_triton
from .kernels.feedback_solve import compute_dtype, feedback_solve
from .rsa import decode_compiled


class SessaMixer(FullAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.feedback_dim = config.sessa_feedback_dim
        self.feedback_heads = config.sessa_feedback_heads
        self.gamma_max = float(config.sessa_gamma_max)
        self.solver = config.sessa_solver
        self.chunk_size = config.sessa_chunk_size
        # [qb | kb]: first feedback_dim channels are queries, last feedback_dim are keys (official proj_fb layout)
        self.feedback_proj = nn.Linear(config.hidden_size, 2 * self.feedback_dim, bias=config.sessa_feedback_bias)
        self.gamma_proj = nn.Linear(config.hidden_size, 1, bias=False)  # w_gamma (official gamma_ctx)
        self.gamma_bias = nn.Parameter(torch.tensor(float(config.sessa_gamma_bias_init)))  # b_gamma, a scalar

    def reset_sessa_parameters(self):
        """The gain's init, called from the model's _init_weights and by ``from_attention``.

        gamma_bias_init = 0 (llama block): w = b = 0, so gamma == 0 and the layer equals its attention (spec §9.2).
        Otherwise the official init: b = gamma_bias_init and PyTorch's default U(-1/sqrt(D), 1/sqrt(D)) for w.
        """
        bias = self.config.sessa_gamma_bias_init
        init.constant_(self.gamma_bias, bias)
        if bias == 0.0:
            init.zeros_(self.gamma_proj.weight)
        else:
            bound = self.config.hidden_size**-0.5
            init.uniform_(self.gamma_proj.weight, -bound, bound)

    def init_new_parameters(self):
        """Conversion init: N(0, initializer_range) feedback q/k (they get gradient once gamma moves), then the gain."""
        init.normal_(self.feedback_proj.weight, 0.0, self.config.initializer_range)
        if self.feedback_proj.bias is not None:
            init.zeros_(self.feedback_proj.bias)
        self.reset_sessa_parameters()

    def gain(self, hidden_states):
        """gamma_t = gamma_max * tanh(b + w . x_t), in fp32 (fp64 stays fp64): (B, T, D) -> (B, T)."""
        dtype = compute_dtype(hidden_states.dtype)
        logit = self.gamma_proj(hidden_states).squeeze(-1).to(dtype) + self.gamma_bias.to(dtype)
        return self.gamma_max * torch.tanh(logit)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        length = hidden_states.shape[1]
        f = super().forward(hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values,
                            **kwargs)  # (B, T, D): the attention output; K/V appended to the cache
        if token_mask is not None:  # padded rows carry no signal (and no NaN) into anyone's feedback
            f = f.masked_fill(~token_mask[:, -length:, None], 0.0)
        query, key = self.feedback_proj(hidden_states).split(self.feedback_dim, dim=-1)  # (B, T, d_fb) each
        gamma = self.gain(hidden_states)
        layer_cache = None if past_key_values is None else past_key_values.layers[self.layer_idx]
        past_keys, past_outputs = (None, None) if layer_cache is None else layer_cache.feedback_state()
        if not torch.is_grad_enabled() and not gamma.any():
            s = f.to(compute_dtype(f.dtype))  # gamma == 0: s = f exactly, no solve needed
        else:
            s = self.solve(f, query, key, gamma, token_mask, past_keys, past_outputs)
        if layer_cache is not None:
            layer_cache.update_feedback(key, s)
        return s.to(f.dtype)

    def solve(self, f, query, key, gamma, token_mask, past_keys, past_outputs):
        """(I - B) s = f, one routing matrix per feedback head; returns s (B, T, D) in fp32 (fp64 for fp64)."""
        heads = self.feedback_heads
        scale = (self.feedback_dim // heads) ** -0.5
        method = self.solver  # "dense" is the reference, asked for by name; "chunked" has a Triton twin
        if method == "chunked" and use_triton("Sessa feedback solve", f.device, self.config.kernel_backend):
            method = "triton"
        if heads == 1:
            return feedback_solve(f, query, key, gamma, key_mask=token_mask, past_k=past_keys, past_s=past_outputs,
                                  scale=scale, method=method, chunk_size=self.chunk_size)

        def fold(x):  # (B, T, heads * w) -> (B * heads, T, w): each head is its own sequence
            return None if x is None else x.unflatten(-1, (heads, -1)).transpose(1, 2).flatten(0, 1)

        def repeat(x):  # per-token tensors are shared by the heads
            return None if x is None else x.repeat_interleave(heads, dim=0)

        s = feedback_solve(fold(f), fold(query), fold(key), repeat(gamma), key_mask=repeat(token_mask),
                           past_k=fold(past_keys), past_s=fold(past_outputs), scale=scale, method=method,
                           chunk_size=self.chunk_size)
        return s.unflatten(0, (-1, heads)).transpose(1, 2).flatten(2)


class SessaBlock(GradientCheckpointingLayer):
    """The paper's native Sessa layer (spec §2): y = x + W_out((Mixer(GELU(a))) * g), [a | g] = W_in(LN(x)).

    No MLP, a linear gate, exact erf GELU, LayerNorm with eps 1e-5. ``mixer_class`` is SessaMixer for Sessa layers
    (or FullAttention for attention layers of a native-block hybrid).
    """

    def __init__(self, config, layer_idx: int, mixer_class=SessaMixer):
        super().__init__()
        size = config.hidden_size
        self.norm = nn.LayerNorm(size, eps=1e-5)
        self.in_proj = nn.Linear(size, 2 * size, bias=True)
        self.mixer = mixer_class(config, layer_idx)
        self.out_proj = nn.Linear(size, size, bias=True)

    def around(self, hidden_states, mix):
        """The block's own layers around ``mix`` (gated input -> mixer output)."""
        value, gate = self.in_proj(self.norm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.out_proj(mix(F.gelu(value)) * gate)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        if self.mixer.compiles_decode(hidden_states, past_key_values):  # an RSA layer in a native-block model
            return decode_compiled(self, hidden_states, position_embeddings, token_mask, past_key_values)
        return self.around(hidden_states, lambda x: self.mixer(x, position_embeddings, attention_mask, token_mask,
                                                              past_key_values, **kwargs))


class StandaloneSessaBlock(nn.Module):
    """A SessaBlock with its own rotary embedding: ``forward(x (B, T, D)) -> (B, T, D)`` at positions 0..T-1."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config._attn_implementation = "sdpa"  # no model sets it here; SDPA applies the causal mask by itself
        self.config = config
        self.block = SessaBlock(config, 0)
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
    are computed in fp32 (the official code casts the angles to the activation dtype first, spec §3.2).

    Returns a ``StandaloneSessaBlock`` (forward(x: (B, T, D)) -> (B, T, D)) in the state dict's dtype.
    """
    from .config import SessaConfig

    if "W_in.weight" not in state_dict:
        raise ValueError("from_official_layer: state_dict has no 'W_in.weight'; expected the state dict of an "
                         f"official sessa.SessaLayer, got keys {sorted(state_dict)[:8]}...")
    hidden = state_dict["W_in.weight"].shape[1]
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    config = SessaConfig(
        vocab_size=1, bos_token_id=None, eos_token_id=None, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=n_heads,
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
