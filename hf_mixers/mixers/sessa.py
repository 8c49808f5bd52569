"""Sessa: attention inside a feedback loop (docs/mixers/sessa.md).

    f = o_proj(CausalAttention(q, k, v))             the teacher's attention, unchanged (forward branch)
    alpha[t, j] = softmax_{j<t}(<qb_t, kb_j> / sqrt(d_fb))   feedback attention over the strict past, no positions
    gamma_t = gamma_max * tanh(b + w . x_t)           signed gain, |gamma| < gamma_max < 1
    (I - gamma * alpha) s = f                          s_t = f_t + gamma_t sum_{j<t} alpha[t, j] s_j

With w = b = 0 (the llama-block default) gamma == 0 and s == f bit for bit, so a converted layer starts as its
teacher. The solve itself lives in ``kernels/feedback_solve.py`` (shared with GLTM). With several feedback
heads, head h routes channel group h of f with its own alpha_h (the official code has one head for all channels);
heads are folded into the batch so the kernel stays single-head.

Cache per layer: the attention K/V, plus the feedback keys kb and the solved outputs s. s is kept in the solve's
dtype (fp32) by default, so a prefill onto a non-empty cache and token-by-token decoding continue exactly;
``sessa_outputs_cache="activation"`` keeps it in the layer's dtype instead (half the bytes in bf16; the solve still
accumulates in fp32). With narrow feedback keys (``sessa_feedback_dim``) that is the lean conversion
(docs/mixers/sessa.md).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from ..core.attention import FullAttention
from ..core.cache import KVPlusLayer
from ..core.mixer import TokenStep
from ..core.registry import (MixerOption, MixerSpec, boolean, number, one_of, open_unit_interval, positive_int,
                             register_mixer)
from ..kernels.conventions import compute_dtype
from ..kernels.feedback_solve import feedback_solve, strict_past_softmax


class SessaMixer(FullAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.use_rope = config.block == "llama" or config.sessa_forward_rope  # the native block may run NoPE
        if config.block == "sessa" and self.num_heads == 1:
            self.o_proj = nn.Identity()  # the official Sessa mixer has no head merge for a single head
        self.feedback_dim = config.sessa_feedback_dim
        self.feedback_heads = config.sessa_feedback_heads
        self.gamma_max = float(config.sessa_gamma_max)
        self.solver = config.sessa_solver
        self.chunk_size = config.sessa_chunk_size
        self.outputs_in_activation_dtype = config.sessa_outputs_cache == "activation"
        # [qb | kb]: first feedback_dim channels are queries, last feedback_dim are keys (official proj_fb layout)
        self.feedback_proj = nn.Linear(config.hidden_size, 2 * self.feedback_dim, bias=config.sessa_feedback_bias)
        self.gamma_proj = nn.Linear(config.hidden_size, 1, bias=False)  # w_gamma (official gamma_ctx)
        self.gamma_bias = nn.Parameter(torch.tensor(float(config.sessa_gamma_bias_init)))  # b_gamma, a scalar

    def reset_parameters(self):
        """The gain's init, called from the model's _init_weights and by ``from_attention``.

        gamma_bias_init = 0 (llama block): w = b = 0, so gamma == 0 and the layer equals its attention.
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
        self.reset_parameters()

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
        past_keys, past_outputs = (None, None) if layer_cache is None else layer_cache.extras
        if not torch.is_grad_enabled() and not gamma.any():
            s = f.to(compute_dtype(f.dtype))  # gamma == 0: s = f exactly, no solve needed
        else:
            s = self.solve(f, query, key, gamma, token_mask, past_keys, past_outputs)
        if layer_cache is not None:
            layer_cache.append_extras(key, s.to(f.dtype) if self.outputs_in_activation_dtype else s)
        return s.to(f.dtype)

    def solve(self, f, query, key, gamma, token_mask, past_keys, past_outputs):
        """(I - B) s = f, one routing matrix per feedback head; returns s (B, T, D) in fp32 (fp64 for fp64)."""
        heads = self.feedback_heads
        scale = (self.feedback_dim // heads) ** -0.5
        # "dense" is the reference, asked for by name; feedback_solve picks the kernel that runs "chunked"
        options = dict(scale=scale, method=self.solver, chunk_size=self.chunk_size, backend=self.config.kernel_backend)
        if heads == 1:
            return feedback_solve(f, query, key, gamma, key_mask=token_mask, past_k=past_keys, past_s=past_outputs,
                                  **options)

        def fold(x):  # (B, T, heads * w) -> (B * heads, T, w): each head is its own sequence
            return None if x is None else x.unflatten(-1, (heads, -1)).transpose(1, 2).flatten(0, 1)

        def repeat(x):  # per-token tensors are shared by the heads
            return None if x is None else x.repeat_interleave(heads, dim=0)

        s = feedback_solve(fold(f), fold(query), fold(key), repeat(gamma), key_mask=repeat(token_mask),
                           past_k=fold(past_keys), past_s=fold(past_outputs), **options)
        return s.unflatten(0, (-1, heads)).transpose(1, 2).flatten(2)

    # The token step (core/mixer.py TokenStep): over a cache that grows (compiled with symbolic shapes), the cached
    # K/V, feedback keys and outputs read where they lie.
    def step_ready(self, layer_cache) -> bool:
        return self.kv_ready(layer_cache) and layer_cache.outputs is not None

    def step_inputs(self, layer_cache, token_mask) -> tuple:
        """The token mask (B, P + 1) or None, the cached K/V (B, Hkv, P, d), feedback keys (B, P, d_fb) and outputs
        (B, P, D): views of the cache's buffers, never copied."""
        return (*self.kv_inputs(layer_cache, token_mask), layer_cache.feedback_keys, layer_cache.outputs)

    def step(self, hidden_states, position_embeddings, token_mask, keys, values, feedback_keys, outputs):
        """``forward`` for one token (B, 1, D) after P cached ones: attention over the cache and the token, then
        s = f + gamma * sum_j alpha_j s_j over the P cached outputs (the solve of one new row). -> (the layer's
        output, (K, V, feedback key, s) to append)."""
        f, key, value = self.attend_step(hidden_states, position_embeddings, token_mask, keys, values)  # (B, 1, D)
        cd = compute_dtype(f.dtype)
        if token_mask is not None:
            f = f.masked_fill(~token_mask[:, -1:, None], 0.0)
        feedback_query, feedback_key = self.feedback_proj(hidden_states).split(self.feedback_dim, dim=-1)
        heads, past = self.feedback_heads, outputs.shape[1]

        def by_head(x):  # (B, t, heads * w) -> (B, heads, t, w): each head routes its own channel group
            return x.unflatten(-1, (heads, -1)).transpose(1, 2).to(cd)

        logits = torch.matmul(by_head(feedback_query), by_head(feedback_keys).transpose(-1, -2))  # (B, h, 1, P)
        # the solve's own softmax, one row per head at row P: every cached key is past, padded ones masked, a row
        # with none reads nothing
        alpha = strict_past_softmax(logits.flatten(1, 2) * (self.feedback_dim // heads) ** -0.5, past, token_mask)
        read = torch.matmul(alpha.unflatten(1, (heads, 1)), by_head(outputs)).transpose(1, 2).flatten(2)  # (B, 1, D)
        s = f.to(cd) + self.gain(hidden_states)[..., None] * read
        cached = s.to(f.dtype) if self.outputs_in_activation_dtype else s
        return s.to(f.dtype), (key, value, feedback_key, cached)

    def store_step(self, layer_cache, state) -> None:
        self.store_kv(layer_cache, state[:2])
        layer_cache.append_extras(*state[2:])

    token_step = TokenStep(ready=step_ready, inputs=step_inputs, step=step, store=store_step,
                           prepare=FullAttention.keep_qkv_fused)


class SessaCacheLayer(KVPlusLayer):
    """Attention K/V (B, Hkv, t, hd) plus the feedback keys (B, t, d_fb) and solved outputs s (B, t, D; fp32 unless
    ``sessa_outputs_cache="activation"``)."""

    _layer_type = "sessa"
    extra_names = ("feedback_keys", "outputs")


def _derived_defaults(config) -> dict:
    # b = 0 in a converted llama block (gamma == 0: exactly the teacher); the official init 1.0 in the native block
    return {"sessa_feedback_dim": config.hidden_size,
            "sessa_gamma_bias_init": 1.0 if config.block == "sessa" else 0.0}


def _validate(config) -> str | None:
    heads = config.sessa_feedback_heads
    if config.sessa_feedback_dim % heads or config.hidden_size % heads:
        return (f"sessa_feedback_heads ({heads}) must divide sessa_feedback_dim ({config.sessa_feedback_dim}) and "
                f"hidden_size ({config.hidden_size})")
    if config.block == "sessa" and config.sessa_forward_rope and config.head_dim % 2:
        return f"head_dim ({config.head_dim}) must be even for rotary embeddings (or set sessa_forward_rope=False)"
    return None


@torch.no_grad()
def sessa_lag_theory(mixer, inputs, position_embeddings=None) -> dict:
    gamma = mixer.gain(inputs).abs().mean().item()
    return {"law": "power", "exponent": -(1 - gamma), "gamma": gamma,
            "source": "Sessa's uniform-routing closed form with the layer's mean |gamma| on these inputs"}


SESSA = register_mixer(MixerSpec(
    name="sessa", mixer_class=SessaMixer, title="Sessa",
    summary="attention inside a feedback loop: each output feeds back into later ones through a triangular solve "
            "over the past, so information travels further than one attention hop",
    paper="Sessa: Selective State Space Attention (arXiv:2604.18580)",
    options=(
        MixerOption("sessa_feedback_dim", None, "total width of the feedback queries/keys (None: hidden_size, the "
                    "official choice)", positive_int),
        MixerOption("sessa_feedback_heads", 1, "feedback heads; head h routes channel group h of f with its own "
                    "routing matrix (official: 1)", positive_int),
        MixerOption("sessa_feedback_bias", True, "biases on the feedback q/k projection (official: true)", boolean),
        MixerOption("sessa_gamma_max", 0.999, "gain bound: gamma = gamma_max * tanh(b + w.x)", open_unit_interval),
        MixerOption("sessa_gamma_bias_init", None, "initial b (None: 0.0 in the llama block, so a converted layer is "
                    "exactly its teacher; 1.0 in the native block, the official init)", number),
        MixerOption("sessa_forward_rope", True, "RoPE on the attention branch of the native block (false: NoPE, the "
                    "official default)", boolean),
        MixerOption("sessa_solver", "chunked", "'chunked' (O(T*C) memory, Triton kernel on CUDA) or 'dense' (the "
                    "reference)", one_of("chunked", "dense")),
        MixerOption("sessa_chunk_size", 128, "query chunk size C of the chunked solve", positive_int),
        MixerOption("sessa_outputs_cache", "compute", "dtype of the cached past outputs s: 'compute' (the solve's "
                    "fp32: decoding continues exactly) or 'activation' (the layer's dtype: half the bytes in bf16)",
                    one_of("compute", "activation")),
    ),
    derived_defaults=_derived_defaults, validate=_validate, cache_layer=SessaCacheLayer, attention_mask="causal",
    keep_in_fp32=("gamma_bias",), exact_at_init=True,
    # gain 0: the converted layer is exactly its teacher; the lean cache (one head's width of feedback keys, past
    # outputs in the activation dtype): a smaller cache with the same quality after distillation (docs/mixers/sessa.md)
    conversion_options={"sessa_gamma_bias_init": 0.0, "sessa_feedback_dim": 64, "sessa_outputs_cache": "activation"},
    limitations=("Sessa layers solve a triangular system over the whole past: training and prefill cost grows with "
                 "the square of the sequence length, and decoding keeps a cache that grows with it.",),
    sliding_note="the mixer's attention branch is global (identical up to that length)",
    tiny_options={"sessa_chunk_size": 4, "sessa_gamma_bias_init": 0.4},
    tiny_variants={"lean": {"sessa_feedback_dim": 8, "sessa_outputs_cache": "activation"}},
    lag_theory=sessa_lag_theory))
