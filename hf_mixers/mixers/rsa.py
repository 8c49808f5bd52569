"""RSA: recursive sparse attention over a deep-shallow slot memory (docs/mixers/rsa.md).

The teacher's q/k/v/o projections and RoPE are kept (``FullAttention.project``); softmax attention over all past
keys is replaced by a constant-size memory per KV head: L levels of m slots, written by online soft k-means (each
slot is the assignment-weighted mean of the keys/values routed to it), deeper levels storing MLP-transformed
residuals, read by a sparse thresholded score chained down the levels. The math lives in
``kernels/rsa_memory.py`` (token recurrence = decode path, chunk form = training path, equal in fp64).

Conversion (``from_attention``): copied projections, identity residual MLPs, prototypes from
k-means of the caller's calibration keys (level 0 on rotated keys, deeper levels on residuals), W = I, W_r = I at
level 0 and 0 below, theta = 0, RSA-q off: the converted layer starts as level-0 cluster attention.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..core.attention import FullAttention
from ..core.cache import RecurrentStateLayer
from ..core.mixer import RecurrentMixer
from ..core.registry import MixerOption, MixerSpec, boolean, number, one_of, positive_int, register_mixer
from ..core.short_conv import causal_conv
from ..core.window import WindowState, window_option, windowed
from ..kernels.conventions import COMPILE_CHOICES, compute_dtype
from ..kernels.rope import apply_rope
from ..kernels.rsa_memory import ResidualMLPWeights, RSAParams, initial_state, refresh_references, rsa_memory

logger = logging.getLogger(__name__)


class ResidualMLP(nn.Module):
    """x + W2 silu(W1 x); W2 starts at zero, so the map starts as the identity."""

    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(size, hidden)
        self.down = nn.Linear(hidden, size)

    def forward(self, x):
        return x + self.down(F.silu(self.up(x)))

    def weights(self, dtype) -> ResidualMLPWeights:
        """The same map as plain tensors in ``dtype`` (the memory's compute dtype: fp32 for bf16 models)."""
        return ResidualMLPWeights(self.up.weight.to(dtype), self.up.bias.to(dtype), self.down.weight.to(dtype),
                                  self.down.bias.to(dtype))


class RSAMixer(RecurrentMixer, FullAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        levels, slots, head_dim = config.rsa_num_levels, config.rsa_num_slots, self.head_dim
        groups, heads = self.num_key_value_heads, self.num_heads
        self.levels, self.slots = levels, slots
        # write side, per KV head
        self.prototypes = nn.Parameter(torch.zeros(groups, levels, slots, head_dim))  # P: initial key slots
        self.kappa_raw = nn.Parameter(torch.zeros(groups, levels))  # softplus -> pseudo-count of P
        self.beta = nn.Parameter(torch.ones(groups, levels))  # assignment inverse temperature
        self.key_mlps = nn.ModuleList(ResidualMLP(head_dim, config.rsa_mlp_hidden) for _ in range(levels - 1))
        self.value_mlps = nn.ModuleList(ResidualMLP(head_dim, config.rsa_mlp_hidden) for _ in range(levels - 1))
        # read side, per query head
        self.read_proj = nn.Parameter(torch.zeros(heads, levels, slots, slots))  # W
        self.mix_proj = nn.Parameter(torch.zeros(heads, levels, slots, slots))  # W_r
        self.threshold = nn.Parameter(torch.zeros(heads, levels))  # theta = 1/z
        self.read_scale = nn.Parameter(torch.ones(heads, levels))  # w_a
        self.query_read = nn.Parameter(torch.zeros(heads, levels, head_dim, slots)) if config.rsa_query_read else None
        # optional GLA-style decay, one gate per KV head: log lambda = logsigmoid(x W + b) / 16
        self.decay_proj = nn.Linear(config.hidden_size, groups) if config.rsa_decay else None
        # optional causal depthwise convolution over the mixer input (kernel K, identity at init)
        self.short_conv = nn.Parameter(torch.zeros(config.hidden_size, config.rsa_short_conv)) \
            if config.rsa_short_conv else None
        if config.rsa_state_init == "zeros":
            logger.warning("RSA layer %d: rsa_state_init='zeros' (paper-literal) makes every slot receive the same "
                           "assignment forever, so the slots can never separate; use 'prototypes'.", layer_idx)

    def reset_parameters(self):
        """Scratch initialisation, called from the model's _init_weights.

        transformers.initialization functions skip tensors loaded from a checkpoint, so from_pretrained never
        overwrites trained RSA parameters.
        """
        config = self.config
        if config.rsa_state_init == "zeros":
            init.zeros_(self.prototypes)
            init.constant_(self.kappa_raw, -30.0)  # softplus(-30) ~ 1e-13: no prior mass
        else:
            init.normal_(self.prototypes, 0.0, 1.0)
            init.constant_(self.kappa_raw, math.log(math.e - 1.0))  # softplus^-1(1): pseudo-count 1
        init.ones_(self.beta)
        eye = torch.eye(self.slots, dtype=self.read_proj.dtype, device=self.read_proj.device)
        init.copy_(self.read_proj, eye.expand_as(self.read_proj))
        init.copy_(self.mix_proj, eye.expand_as(self.mix_proj))
        init.constant_(self.threshold, config.rsa_threshold_init)
        init.ones_(self.read_scale)
        if self.query_read is not None:
            init.normal_(self.query_read, 0.0, config.initializer_range)
        if self.decay_proj is not None:
            init.zeros_(self.decay_proj.weight)
            init.constant_(self.decay_proj.bias, 4.0)  # lambda ~ 0.9989: a long memory at init
        if self.short_conv is not None:
            identity = torch.zeros_like(self.short_conv)
            identity[:, -1] = 1.0  # the last tap is the current token
            init.copy_(self.short_conv, identity)
        for mlp in (*self.key_mlps, *self.value_mlps):
            init.normal_(mlp.up.weight, 0.0, config.initializer_range)
            init.zeros_(mlp.up.bias)
            init.zeros_(mlp.down.weight)
            init.zeros_(mlp.down.bias)

    def memory_params(self, dtype, refresh_in_step: bool = True) -> RSAParams:
        config = self.config
        cast = (lambda t: None if t is None else t.to(dtype))
        return RSAParams(
            prototypes=cast(self.prototypes), kappa=F.softplus(cast(self.kappa_raw)), beta=cast(self.beta),
            key_mlps=[mlp.weights(dtype) for mlp in self.key_mlps],
            value_mlps=[mlp.weights(dtype) for mlp in self.value_mlps],
            read_proj=cast(self.read_proj), mix_proj=cast(self.mix_proj),
            threshold=cast(self.threshold), threshold_max=config.rsa_threshold_max, read_scale=cast(self.read_scale),
            query_read=cast(self.query_read), assign_fn=config.rsa_assign_fn, readout=config.rsa_readout,
            routing=config.rsa_routing, chunk_size=config.rsa_chunk_size, eps=config.rsa_eps,
            recompute=config.rsa_recompute_chunks, log_weight=config.rsa_window > 0, refresh_in_step=refresh_in_step,
            compile_write=config.rsa_compile_write)

    def projections(self, hidden_states, position_embeddings):
        """The window's queries (B, H, T, hd) and keys (B, Hkv, T, hd) (rotated), the memory's (rotated unless
        ``rsa_memory_rope`` is off) and the values."""
        if self.config.rsa_memory_rope:
            query, key, value = self.project(hidden_states, position_embeddings)
            return query, key, query, key, value
        plain_query, plain_key, value = self.project(hidden_states, position_embeddings, rotate=False)
        if not self.config.rsa_window:  # no window: nothing reads the rotated ones
            return plain_query, plain_key, plain_query, plain_key, value
        query, key = apply_rope(plain_query, plain_key, *position_embeddings, self.config.kernel_backend)
        return query, key, plain_query, plain_key, value

    def memory_read(self, hidden_states, position_embeddings, token_mask=None, state=None, method="chunked",
                    refresh_in_step=True):
        """(B, T, D) -> memory output (B, T, H * hd) before o_proj, and the new state (an RSAState, or with
        ``rsa_window`` a core.window.WindowState around one)."""
        batch, length = hidden_states.shape[:2]
        query, key, memory_query, memory_key, value = self.projections(hidden_states, position_embeddings)
        cd = compute_dtype(hidden_states.dtype)
        params = self.memory_params(cd, refresh_in_step)
        grouped = (self.num_key_value_heads, self.num_key_value_groups)
        query, memory_query = query.unflatten(1, grouped), memory_query.unflatten(1, grouped)  # (B, G, g, T, hd)
        valid = None if token_mask is None else token_mask[:, -length:]
        # per-token write inputs, delayed with their token into the memory: the decay, if any, then the memory's own
        # (unrotated) key when it differs from the window's
        extras = ()
        if self.decay_proj is not None:  # (B, T, G) -> (B, G, T)
            extras = ((F.logsigmoid(self.decay_proj(hidden_states).to(cd)) / 16).transpose(1, 2),)
        separate_keys = memory_key is not key
        if separate_keys:
            extras = extras + (memory_key.to(cd),)
        # a first call no longer than the window: no token leaves it, so the memory stays empty and is not run (known
        # from the shapes; its parameters then take no part in the loss, which the trainer reports)
        nothing_leaves = state is None and 0 < length <= self.config.rsa_window
        # a first call without padding: the window's delay leaves the memory's first w positions empty in every row
        # (known from the shapes), so the memory runs on the others alone, in the static chunk layout of an unpadded
        # sequence instead of one packed by a mask, and reads zeros at the first w, as the masked form does
        empty_lead = self.config.rsa_window if state is None and valid is None and not nothing_leaves else 0

        def memory(q, k, v, written, extras, memory_state):
            if separate_keys:  # the memory reads with its own queries (this call's) and writes its own keys
                q, k, extras = memory_query.to(q.dtype), extras[-1], extras[:-1]
            if empty_lead:
                q, k, v, written = q[..., empty_lead:, :], k[..., empty_lead:, :], v[..., empty_lead:, :], None
                extras = tuple(extra[:, :, empty_lead:] for extra in extras)
            log_decay = extras[0] if extras else None
            fresh = memory_state is None
            if fresh:
                memory_state = initial_state(params, batch, self.head_dim, cd)
            if nothing_leaves:  # what the window's combine reads for a query that saw no memory: its share is 0
                empty = q.new_zeros(*q.shape[:-1], v.shape[-1])
                return empty, empty[..., 0], memory_state
            out, memory_state = rsa_memory(q, k, v, written, memory_state, params, method=method, log_decay=log_decay,
                                           backend=self.config.kernel_backend, fresh=fresh)
            if empty_lead:
                out = F.pad(out, (0, 0, empty_lead, 0))
            if params.log_weight:
                return out[..., :-1], out[..., -1], memory_state
            return out, None, memory_state

        if self.config.rsa_window:
            out, state = windowed(query.to(cd), key.to(cd), value.to(cd), valid, extras, state,
                                  self.config.rsa_window, self.scaling, memory, backend=self.config.kernel_backend)
        else:
            out, _, state = memory(query, key, value, valid, extras, state)
        out = out.flatten(1, 2).transpose(1, 2).reshape(batch, length, -1)  # (B, T, H * hd)
        return out.to(hidden_states.dtype), state

    def convolve(self, hidden_states, token_mask=None, history=None):
        """The causal depthwise convolution (core/short_conv.py): (B, T, D) -> (B, T, D) and the decode history."""
        return causal_conv(hidden_states, self.short_conv, None, token_mask, history)

    def mix(self, hidden_states, position_embeddings, token_mask=None, state=None, conv_history=None,
            refresh_in_step=True):
        """The layer without its cache object: (B, T, D) -> output (B, T, D), new memory state, new conv history."""
        if self.short_conv is not None:
            hidden_states, conv_history = self.convolve(hidden_states, token_mask, conv_history)
        out, state = self.memory_read(hidden_states, position_embeddings, token_mask, state,
                                      refresh_in_step=refresh_in_step)
        return self.o_proj(out), state, conv_history

    # The compiled token step on CPU leaves the references' refresh (at one token in C) to ``store_step``,
    # eagerly, where a host check costs nothing: in the graph they were recomputed and rewritten every token, which
    # measured slower. On CUDA they stay in the graph (no host synchronisation inside a CUDA graph).
    def step(self, hidden_states, position_embeddings, token_mask, state, history):
        output, state, history = self.mix(hidden_states, position_embeddings, token_mask, state, history,
                                          refresh_in_step=hidden_states.device.type != "cpu")
        return output, (state, history)

    def store_step(self, layer_cache, state) -> None:
        memory, history = state
        RecurrentMixer.store_step(self, layer_cache, (self.references_refreshed(memory), history))

    token_step = replace(RecurrentMixer.token_step, step=step, store=store_step, prepare=FullAttention.keep_qkv_fused)

    def references_refreshed(self, state):
        """``state`` (an RSAState, or a WindowState around one) with the references of the CPU rows whose count has
        just reached a chunk boundary refreshed (what the token step does in its graph elsewhere). Exact: a row
        refreshed again without a write in between gets the same references."""
        memory = state.memory if isinstance(state, WindowState) else state
        if memory is None or memory.count.device.type != "cpu":
            return state
        counts = memory.count.tolist()  # one host read (cheaper than the tensor test it replaced)
        if not any(count and count % self.config.rsa_chunk_size == 0 for count in counts):
            return state
        rows = (memory.count % self.config.rsa_chunk_size == 0) & (memory.count > 0)
        memory = refresh_references(memory, self.memory_params(memory.mass.dtype), rows)
        return replace(state, memory=memory) if isinstance(state, WindowState) else memory

    def init_new_parameters(self):
        """Conversion init: the scratch init, then W_r = I at level 0 and 0 below (deeper levels silent),
        theta = 0 (sparse read off, learnable) and RSA-q off, so the layer starts as level-0 cluster attention."""
        self.reset_parameters()
        with torch.no_grad():
            self.mix_proj[:, 1:].zero_()
            self.threshold.zero_()
            if self.query_read is not None:
                self.query_read.zero_()

    @classmethod
    def from_attention(cls, attention: nn.Module, config, layer_idx: int, calibration_hidden_states=None,
                       calibration_position_embeddings=None, kmeans_iterations: int = 20, seed: int = 0):
        """An RSA mixer initialised from a teacher attention layer (Llama/Mistral/Qwen2/Qwen3 names).

        ``calibration_hidden_states`` (N, T, D) are the normed inputs of that attention layer on calibration text,
        with their ``calibration_position_embeddings`` (cos, sin); they seed the prototypes by k-means. Without them
        the prototypes keep their random scratch init.
        """
        mixer = super().from_attention(attention, config, layer_idx)
        if calibration_hidden_states is not None:
            dtype = mixer.q_proj.weight.dtype  # fit in fp32 even for a bf16 teacher
            mixer.float().fit_prototypes(calibration_hidden_states, calibration_position_embeddings,
                                         kmeans_iterations, seed)
            mixer.to(dtype)
        return mixer

    @torch.no_grad()
    def fit_prototypes(self, hidden_states, position_embeddings, iterations=20, seed=0):
        """k-means per KV head: level 0 on the memory's keys (rotated unless ``rsa_memory_rope`` is off), level i+1
        on the residual keys of level i."""
        dtype = self.q_proj.weight.dtype  # calibration activations may come in another dtype
        position_embeddings = tuple(t.to(dtype) for t in position_embeddings)
        *_, keys, _ = self.projections(hidden_states.to(dtype), position_embeddings)  # (N, G, T, hd)
        keys = keys.float().transpose(0, 1).flatten(1, 2)  # (G, N*T, hd)
        generator = torch.Generator(device=keys.device).manual_seed(seed)
        tau = self.head_dim**-0.5
        for level in range(self.levels):
            centres = torch.stack([kmeans(head_keys, self.slots, iterations, generator) for head_keys in keys])
            self.prototypes[:, level] = centres.to(self.prototypes.dtype)
            if level < self.levels - 1:
                weights = torch.softmax(tau * keys @ centres.transpose(-1, -2), dim=-1)  # SA over the prototypes
                keys = self.key_mlps[level](keys - weights @ centres)


def kmeans(points: torch.Tensor, clusters: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means with k-means++ seeding on (N, d) points; returns (clusters, d) centres."""
    count = points.shape[0]
    if count == 0:
        raise ValueError("kmeans: no calibration points")
    centres = [points[torch.randint(count, (1,), generator=generator, device=points.device)].squeeze(0)]
    distance = (points - centres[0]).pow(2).sum(-1)
    for _ in range(1, clusters):
        total = distance.sum()
        if total <= 0:  # fewer distinct points than clusters: repeat one
            pick = torch.randint(count, (1,), generator=generator, device=points.device)
        else:
            pick = torch.multinomial(distance / total, 1, generator=generator)
        centres.append(points[pick].squeeze(0))
        distance = torch.minimum(distance, (points - centres[-1]).pow(2).sum(-1))
    centres = torch.stack(centres)
    for _ in range(iterations):
        assignment = torch.cdist(points, centres).argmin(-1)
        sums = torch.zeros_like(centres).index_add_(0, assignment, points)
        sizes = torch.bincount(assignment, minlength=clusters).to(points.dtype)[:, None]
        centres = torch.where(sizes > 0, sums / sizes.clamp_min(1), centres)  # empty clusters keep their centre
    return centres


class RSACacheLayer(RecurrentStateLayer):
    """RSA's constant-size memory (kernels.rsa_memory.RSAState), the short-conv history and the token count."""

    _layer_type = "rsa"


def _derived_defaults(config) -> dict:
    return {"rsa_threshold_init": 0.5 if config.rsa_readout == "sigmoid" else 0.0, "rsa_mlp_hidden": config.head_dim}


def _validate(config) -> str | None:
    if not 0.0 <= config.rsa_threshold_init <= config.rsa_threshold_max < 1.0:
        return (f"rsa_threshold_init ({config.rsa_threshold_init}) must lie in [0, rsa_threshold_max] and "
                f"rsa_threshold_max ({config.rsa_threshold_max}) below 1")
    return None


def _short_conv(value) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value == 0 or value >= 2)
    return None if ok else "must be 0 (off) or a kernel size >= 2"


RSA = register_mixer(MixerSpec(
    name="rsa", mixer_class=RSAMixer, title="RSA",
    summary="recursive sparse attention: a fixed-size deep-shallow memory of slots read sparsely, so the decoding "
            "state does not grow with the context",
    paper="RSA: Recursive Sparse Attention with Hierarchical Deep-Shallow Memory and Sparse Activation "
          "(anonymous ICML submission, no arXiv id)",
    options=(
        MixerOption("rsa_num_levels", 4, "memory levels L (paper: 4)", positive_int),
        MixerOption("rsa_num_slots", 64, "slots m per level and KV head (paper: 64)", positive_int),
        MixerOption("rsa_assign_fn", "softmax", "slot assignment: 'softmax' over slots or 'sigmoid'",
                    one_of("softmax", "sigmoid")),
        MixerOption("rsa_readout", "sigmoid", "'sigmoid' (the paper's sigma(q.S)W) or 'softmax_count' (count-aware "
                    "softmax: level-0 cluster attention, the conversion choice)", one_of("sigmoid", "softmax_count")),
        MixerOption("rsa_routing", "relation", "how scores chain down the levels: 'relation' (through the relation "
                    "matrices), 'elementwise' (the paper's literal product) or 'none'",
                    one_of("relation", "elementwise", "none")),
        MixerOption("rsa_threshold_init", None, "initial theta = 1/z of the sparse read (None: 0.5 for the sigmoid "
                    "readout, 0.0 for softmax_count); learned, clamped to [0, rsa_threshold_max]", number),
        MixerOption("rsa_threshold_max", 0.99, "upper clamp of theta", number),
        MixerOption("rsa_chunk_size", 64, "chunk size C; assignment references refresh every C real tokens",
                    positive_int),
        MixerOption("rsa_state_init", "prototypes", "'prototypes' (learned initial key slots with a pseudo-count) or "
                    "'zeros' (paper-literal; slots can never separate)", one_of("prototypes", "zeros")),
        MixerOption("rsa_query_read", False, "the RSA-q branch, sum_i (q W_qr_i / 16) @ SV_i", boolean),
        MixerOption("rsa_mlp_hidden", None, "hidden width of the residual inter-level MLPs (None: head_dim)",
                    positive_int),
        MixerOption("rsa_eps", 1e-6, "floor of the slot masses", number),
        MixerOption("rsa_short_conv", 0, "kernel size K of a causal depthwise convolution before the q/k/v "
                    "projections (0: off; identity at init)", _short_conv),
        MixerOption("rsa_decay", False, "data-dependent decay of the memory, exp(logsigmoid(x W + b) / 16) per KV "
                    "head before each write (b starts at 4, a half-life of ~600 tokens)", boolean),
        MixerOption("rsa_recompute_chunks", False, "recompute each chunk's intermediates in the backward pass (about "
                    "10x less activation memory, 2-2.7x the time at T = 8192 on CPU)", boolean),
        MixerOption("rsa_compile_write", False, "write each chunk of the chunk form (training, prefill) through one "
                    "torch.compile graph shared by all RSA layers: its ~300 small operator calls a chunk fuse into "
                    "a few kernels, for GPUs where the eager step is launch-bound; the first chunk compiles for "
                    "tens of seconds per batch shape. True (torch.compile's default mode) or a mode name: "
                    "'reduce-overhead' also replays each chunk as a CUDA graph on CUDA",
                    one_of(*COMPILE_CHOICES)),
        window_option("rsa"),
        MixerOption("rsa_memory_rope", True, "RoPE on the memory's queries and keys (False: only the window's are "
                    "rotated; the memory's slot assignments then do not depend on absolute positions, which it "
                    "would otherwise meet untrained past its training length)", boolean),
        MixerOption("rsa_compile_decode", False, "the older name of compile_decode = True: every one-token decode "
                    "step of a block around a mixer that has one runs as one compiled graph", boolean),
    ),
    derived_defaults=_derived_defaults, validate=_validate, cache_layer=RSACacheLayer,
    conversion_options={"rsa_readout": "softmax_count"},  # count-aware softmax: the layer starts as cluster attention
    limitations=("RSA layers keep a fixed number of memory slots: exact recall of long-past tokens is lossy by "
                 "design, in exchange for a decoding state that does not grow with the context.",),
    tiny_options={"rsa_num_levels": 2, "rsa_num_slots": 4, "rsa_chunk_size": 4, "rsa_short_conv": 3,
                  "rsa_decay": True, "rsa_query_read": True},
    tiny_variants={"window": {"rsa_window": 3}, "memory_nope": {"rsa_window": 3, "rsa_memory_rope": False}}))
