"""Selective state-space mixers, one configurable layer: S6 (Mamba), S4D, Mamba-2 and Mamba-Δᵀ (docs/mixers/selective_ssm.md).

Huang et al., "Understanding Input Selectivity in Mamba: Impact on Approximation Power, Memorization, and Associative
Recall Capacity", ICML 2025 (arXiv 2506.11891), Table 2 and eq. 15; Mamba (Gu & Dao, arXiv 2312.00752), Mamba-2
(Dao & Gu, arXiv 2405.21060). H heads of P channels, a state of N slots per channel, x (B, T, D):

    u = v_proj(x) (B, T, G, P)      B = k_proj(.) (B, T, G, N)      C = q_proj(.) (B, T, H, N)    (s4d: B, C constant)
    conv_mode "independent": one causal depthwise conv over [u, B, C] (Mamba-2); "shared": over u only, then B, C
        and Δ from its output û (the paper's S6); "none". The conv activation follows the conv.
    Δ = softplus(dt_proj(.) + dt_bias): per channel (s6), per head from the raw x (mamba2), per state slot (delta_t);
        1 for s4d
    h_t = exp(A Δ_t) h_{t-1} + (Δ_t û_t) ⊗ B_t       (delta_t: û_t ⊗ B_t, no Δ in the write; "zoh": (e^{AΔ}-1)/A)
    y_t = h_t C_t + D û_t;  y = RMSNorm(y ⊙ silu(z_proj(x)))  (norm and gate optional);  out = o_proj(y)

The scan is kernels/selective_scan.py (recurrence, chunked form, decode step; equal in fp64). A = -exp(A_log): A_log
= -inf is exactly zero decay, dt bias -inf exactly Δ = 0 (a no-op step), so the paper's constructions are weights of
this layer. Padded tokens are exact no-ops (zero conv input, Δ = 0, zero write).

Conversion (spec §9.2, after MambaInLlama): C <- q_proj, B <- k_proj (GQA groups), u <- v_proj, o_proj copied (biases
and Qwen3 q/k norms too; RoPE dropped); identity conv without activation, D = 0, a transparent gate, Mamba's Δ and A
init. The converted layer starts as decayed, unnormalised linear attention and needs distillation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..core.attention import TEACHER_MODULES, FullAttention
from ..core.cache import RecurrentStateLayer
from ..core.mixer import RecurrentMixer
from ..core.registry import (MixerOption, MixerSpec, boolean, non_negative_int, one_of, positive_int,
                             register_mixer)
from ..core.short_conv import causal_conv
from ..core.window import window_option, windowed
from ..kernels.conventions import compute_dtype
from ..kernels.mamba_ops import ssd_scan
from ..kernels.rope import apply_rope
from ..kernels.selective_scan import ssm_scan

VARIANTS = ("s6", "s4d", "mamba2", "delta_t")
A_SHAPES = {"channel_state": lambda h, p, n: (h, p, n), "state": lambda h, p, n: (h, 1, n),
            "head": lambda h, p, n: (h, 1, 1)}
ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "identity": lambda x: x}
GATE_BIAS = 1.2784645427610737  # the root of silu(z) = 1: a gate that starts exactly transparent
WINDOW_GATE_INIT = -4.0  # converted with a window: the memory starts at sigmoid(-4) = 1.8% of the output (a larger
# share of an untrained memory only adds noise: docs/local-window.md)


class ScanInputs(NamedTuple):
    """What the scan of one call reads (kernels/selective_scan.py's layout) and what the rest of the layer needs."""

    write: torch.Tensor  # (B, T, H, P): û, times Δ for Euler, zero at padding
    delta: torch.Tensor  # (B, T, H, Pd, Nd): Δ, zero at padding; the log decay is A Δ (never materialised: for
    A: torch.Tensor  # (H, Pa, Na)                 S6 / S4D it would be (B, T, H, P, N), see ssm_scan)
    write_keys: torch.Tensor  # (B, T, G, N), or (B, T, H, N) when Δ scales B per slot
    queries: torch.Tensor  # (B, T, H, N): C
    u_hat: torch.Tensor  # (B, T, H, P): the conv output (the D skip reads it)
    history: torch.Tensor | None  # the conv's decode history
    projected: tuple  # q, k, v projections before the conv: the local window attends with them
    ssd: tuple | None  # (x, Δ, A, B) for Mamba-2's SSD form, when the variant has it


class SelectiveSSMMixer(RecurrentMixer):
    teacher_modules = TEACHER_MODULES

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.variant, self.conv_mode = config.selective_ssm_variant, config.selective_ssm_conv_mode
        heads, groups, width, size = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                      config.selective_ssm_state_size)
        self.heads, self.groups, self.head_dim, self.state_size = heads, groups, width, size
        hidden, bias = config.hidden_size, config.attention_bias
        self.v_proj = nn.Linear(hidden, groups * width, bias=bias)
        features = groups * width if self.conv_mode == "shared" else hidden  # what B, C (and Δ, not mamba2) read
        if self.variant == "s4d":  # linear time-invariant: B and C are parameters
            self.B = nn.Parameter(torch.zeros(groups, size))
            self.C = nn.Parameter(torch.zeros(heads, size))
        else:
            self.k_proj = nn.Linear(features, groups * size, bias=bias)
            self.q_proj = nn.Linear(features, heads * size, bias=bias)
            if config.qk_norm:  # Qwen3's per-head q/k norms, carried onto C and B
                self.q_norm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
                self.k_norm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(heads * width, hidden, bias=config.attention_out_bias)
        if self.conv_mode != "none":
            channels = groups * width + (groups * size + heads * size
                                         if self.conv_mode == "independent" and self.variant != "s4d" else 0)
            self.conv_weight = nn.Parameter(torch.zeros(channels, config.selective_ssm_conv_width))
            self.conv_bias = nn.Parameter(torch.zeros(channels))
        self.delta_width = {"s6": heads * width, "mamba2": heads, "delta_t": heads * size, "s4d": 0}[self.variant]
        if self.delta_width:
            delta_in = hidden if self.variant == "mamba2" or self.conv_mode != "shared" else groups * width
            rank = config.selective_ssm_dt_rank
            self.dt_down = nn.Linear(delta_in, rank, bias=False) if rank else None
            self.dt_proj = nn.Linear(rank or delta_in, self.delta_width)  # its bias is dt_bias
        self.A_log = nn.Parameter(torch.zeros(A_SHAPES[config.selective_ssm_a_shape](heads, width, size)))
        self.D = nn.Parameter(torch.zeros(heads, 1 if self.variant == "mamba2" else width)) \
            if config.selective_ssm_use_d else None
        self.z_proj = nn.Linear(hidden, heads * width) if config.selective_ssm_gate else None
        self.norm_weight = nn.Parameter(torch.ones(heads, width)) if config.selective_ssm_rmsnorm else None
        # the local window's merge: out = window + sigmoid(gate) (memory - window), one gate per head
        self.window_gate = nn.Parameter(torch.zeros(heads)) if config.selective_ssm_window else None

    def reset_parameters(self):
        """Scratch initialisation (Mamba's): conv uniform, Δ log-uniform in [1e-3, 1e-1], S4D-real A (1..N per slot)
        or U[1, 16] per head, D = 1. transformers.initialization skips tensors loaded from a checkpoint."""
        config = self.config
        if self.conv_mode != "none":
            bound = self.conv_weight.shape[1] ** -0.5
            init.uniform_(self.conv_weight, -bound, bound)
            init.zeros_(self.conv_bias)
        if self.delta_width:
            generator = torch.Generator().manual_seed(self.layer_idx)
            delta = torch.exp(torch.rand(self.delta_width, generator=generator) * math.log(100.0) + math.log(1e-3))
            init.copy_(self.dt_proj.bias, delta + torch.log(-torch.expm1(-delta)))  # softplus^-1(delta)
        if config.selective_ssm_a_shape == "head":
            generator = torch.Generator().manual_seed(10_000 + self.layer_idx)
            rates = 1.0 + 15.0 * torch.rand(self.A_log.shape, generator=generator)
        else:
            rates = torch.arange(1, self.state_size + 1, dtype=torch.float32).expand(self.A_log.shape)
        init.copy_(self.A_log, torch.log(rates))
        if self.D is not None:
            init.ones_(self.D)
        if self.variant == "s4d":
            init.normal_(self.B, 0.0, 1.0)
            init.normal_(self.C, 0.0, self.state_size ** -0.5)
        if self.norm_weight is not None:
            init.ones_(self.norm_weight)
        if self.window_gate is not None:
            init.zeros_(self.window_gate)

    def init_new_parameters(self):
        """Conversion: identity conv (the projections pass through), D = 0 (attention has no skip), a transparent
        gate; Δ and A keep Mamba's init (a slow decay)."""
        self.reset_parameters()
        with torch.no_grad():
            if self.conv_mode != "none":
                self.conv_weight.zero_()
                self.conv_weight[:, -1] = 1.0  # the last tap is the current token
            if self.D is not None:
                self.D.zero_()
            if self.z_proj is not None:
                self.z_proj.weight.zero_()
                self.z_proj.bias.fill_(GATE_BIAS)
            if self.window_gate is not None:
                self.window_gate.fill_(WINDOW_GATE_INIT)

    @classmethod
    def teacher_state(cls, attention, config) -> dict:
        if config.selective_ssm_conv_mode == "shared":
            raise ValueError("selective_ssm_conv_mode='shared' computes B and C from the conv output, so they cannot "
                             "start as the teacher's k/q projections; convert with conv_mode 'independent' or 'none'")
        state = attention.state_dict()
        if config.selective_ssm_variant == "s4d":  # constant B and C: only the values and the output are shared
            state = {key: value for key, value in state.items() if key.split(".")[0] in ("v_proj", "o_proj")}
        return state

    @classmethod
    def from_attention(cls, attention, config, layer_idx: int, calibration_hidden_states=None,
                       calibration_position_embeddings=None, **unused):
        """The teacher's projections copied (``teacher_state``), the new parameters at their conversion init; with
        calibration inputs and the output RMSNorm on, the norm's weight starts at the RMS of each channel of the
        teacher's attention output (before o_proj), so the layer's output starts at the teacher's scale."""
        mixer = super().from_attention(attention, config, layer_idx)
        if calibration_hidden_states is not None and mixer.norm_weight is not None:
            mixer.match_output_scale(attention, calibration_hidden_states, calibration_position_embeddings)
        return mixer

    @torch.no_grad()
    def match_output_scale(self, attention, hidden_states, position_embeddings):
        """norm_weight <- per-channel RMS of the teacher attention's output before o_proj on ``hidden_states``
        (computed by our exact copy of the teacher layer, so hooks on the teacher module do not fire)."""
        teacher = FullAttention.from_attention(attention, self.config, self.layer_idx)
        output = teacher.attend(hidden_states.to(teacher.o_proj.weight.dtype), position_embeddings, None, None)
        rms = output.float().pow(2).mean(dim=(0, 1)).sqrt().view(self.heads, self.head_dim)
        self.norm_weight.copy_(rms.to(self.norm_weight.dtype))

    def _delta(self, source, dtype):
        """softplus(dt_proj(source)) in ``dtype``: (B, T, delta_width)."""
        raw = self.dt_proj(self.dt_down(source)) if self.dt_down is not None else self.dt_proj(source)
        return F.softplus(raw.to(dtype))

    def scan_inputs(self, hidden_states, token_mask=None, history=None) -> "ScanInputs":
        """Everything the scan reads, from the block input (B, T, D): conv, Δ, decay, the write; padding made exact
        no-ops (Δ = 0 and a zero write)."""
        batch, length, _ = hidden_states.shape
        heads, groups, width, size = self.heads, self.groups, self.head_dim, self.state_size
        cd = compute_dtype(hidden_states.dtype)
        activation = ACTIVATIONS[self.config.selective_ssm_conv_activation]
        u = projected_u = self.v_proj(hidden_states)  # (B, T, G P)
        keys = queries = None
        if self.variant != "s4d" and self.conv_mode != "shared":
            keys, queries = self._project_bc(hidden_states)
        projected = (queries, keys, projected_u)  # before the conv: what the local window attends with
        if self.conv_mode == "independent":
            parts = [u] if keys is None else [u, keys, queries]
            mixed, history = causal_conv(torch.cat(parts, dim=-1), self.conv_weight, self.conv_bias, token_mask,
                                         history)
            mixed = activation(mixed)
            u = mixed[..., :groups * width]
            if keys is not None:
                keys, queries = mixed[..., groups * width:].split([groups * size, heads * size], dim=-1)
        elif self.conv_mode == "shared":
            u, history = causal_conv(u, self.conv_weight, self.conv_bias, token_mask, history)
            u = activation(u)
            if self.variant != "s4d":
                keys, queries = self._project_bc(u)
        if self.variant == "s4d":
            keys = self.B.expand(batch, length, groups, size)
            queries = self.C.expand(batch, length, heads, size)
        keys = keys.reshape(batch, length, groups, size).to(cd)
        queries = queries.reshape(batch, length, heads, size).to(cd)
        u_hat = u.reshape(batch, length, groups, width).to(cd).repeat_interleave(heads // groups, dim=2)  # (B,T,H,P)
        keep = torch.ones(batch, length, dtype=cd, device=u.device) if token_mask is None \
            else token_mask[:, -length:].to(cd)  # (B, T)
        # Δ, shaped to broadcast against the state (H, P, N): per channel (P, 1), head (1, 1), slot (1, N)
        if self.variant == "s4d":
            delta = keep[:, :, None, None, None].expand(batch, length, heads, 1, 1)
        else:
            source = hidden_states if self.variant == "mamba2" or self.conv_mode != "shared" else u
            delta = self._delta(source, cd) * keep[..., None]  # padded steps: Δ = 0, no decay
            delta = delta.view(batch, length, heads, *{"s6": (width, 1), "mamba2": (1, 1),
                                                        "delta_t": (1, size)}[self.variant])
        A = -torch.exp(self.A_log.to(cd))  # (H, Pa, Na)
        masked = u_hat * keep[..., None, None]  # padded tokens write nothing
        write, write_keys = masked, keys
        scaling = self.config.selective_ssm_input_scaling
        if scaling != "none":
            factor = delta if scaling == "euler" else _zoh(A, delta)  # (B, T, H, Pd or 1, Nd or 1)
            if factor.shape[-1] == 1:
                write = write * factor[..., 0]
            else:  # a per-slot scale: on B (groups expanded to heads first)
                write_keys = keys.repeat_interleave(heads // groups, dim=2) * factor[..., 0, :]
        ssd = A.shape[1:] == delta.shape[3:] == (1, 1) and scaling == "euler"  # Mamba-2: mamba_ssm's SSD on CUDA
        return ScanInputs(write, delta, A, write_keys, queries, u_hat, history, projected,
                          (masked, delta[..., 0, 0], A[:, 0, 0], keys) if ssd else None)

    def scan(self, inputs: "ScanInputs", state=None):
        """The SSM over ``inputs`` from ``state`` -> y (B, T, H, P), final state (B, H, P, N)."""
        length, chunk = inputs.write.shape[1], self.config.selective_ssm_chunk_size
        if length > 1 and inputs.ssd is not None:
            x, delta, A, keys = inputs.ssd
            return ssd_scan(x, delta, A, keys, inputs.queries, chunk, initial_states=state, return_final_states=True,
                            backend=self.config.kernel_backend)
        return ssm_scan(inputs.write, inputs.delta, inputs.A, inputs.write_keys, inputs.queries, state,
                        chunk_size=chunk)

    def finish(self, y, u_hat, hidden_states):
        """The D skip, the silu(z) gate and the per-head RMSNorm: (B, T, H, P) -> (B, T, H, P)."""
        batch, length = y.shape[:2]
        if self.D is not None:
            y = y + self.D.to(y.dtype) * u_hat
        if self.z_proj is not None:
            y = y * F.silu(self.z_proj(hidden_states).to(y.dtype).view(batch, length, self.heads, self.head_dim))
        if self.norm_weight is not None:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self.norm_weight.to(
                y.dtype)
        return y

    def mix(self, hidden_states, position_embeddings=None, token_mask=None, state=None, history=None):
        """(B, T, D) -> output (B, T, D), the new state (SSM state (B, H, P, N), or a WindowState around it) and the
        conv history."""
        inputs = self.scan_inputs(hidden_states, token_mask, history)
        if self.config.selective_ssm_window:
            y, state = self.windowed(inputs, hidden_states, position_embeddings, token_mask, state)
        else:
            y, state = self.scan(inputs, state)
            y = self.finish(y, inputs.u_hat, hidden_states)
        return self.o_proj(y.flatten(2).to(hidden_states.dtype)), state, inputs.history

    def windowed(self, inputs: "ScanInputs", hidden_states, position_embeddings, token_mask, state):
        """Exact softmax attention over the last w tokens (the teacher's q, k, v and RoPE, before the conv), the SSM
        over the tokens that have left the window, merged through a learned per-head gate (core/window.py)."""
        batch, length, _ = hidden_states.shape
        heads, groups, cd = self.heads, self.groups, inputs.write.dtype
        per_group = heads // groups
        queries, keys, values = inputs.projected
        queries = queries.view(batch, length, heads, -1).transpose(1, 2)
        keys = keys.view(batch, length, groups, -1).transpose(1, 2)
        cos, sin = position_embeddings
        queries, keys = apply_rope(queries, keys, cos, sin, self.config.kernel_backend)  # (B, H, T, d), (B, G, T, d)
        values = values.view(batch, length, groups, -1).transpose(1, 2)

        def by_group(x):  # (B, T, H, ...) -> (B, G, T, g, ...): the window's extras layout
            return x.unflatten(2, (groups, per_group)).transpose(1, 2)

        write_keys = inputs.write_keys
        extras = (by_group(inputs.write), by_group(inputs.delta),
                  write_keys.transpose(1, 2) if write_keys.shape[2] == groups else by_group(write_keys))

        def memory(query, key, value, leaving, extras, memory_state):
            keep = leaving.to(cd)[:, None, :, None]  # the delayed token's write happens only if it is real
            write, delta, keys_w = (extras[0] * keep[..., None], extras[1] * keep[..., None, None], extras[2])
            write, delta = write.transpose(1, 2).flatten(2, 3), delta.transpose(1, 2).flatten(2, 3)
            keys_w = keys_w.transpose(1, 2) if keys_w.dim() == 4 else keys_w.transpose(1, 2).flatten(2, 3)
            y, memory_state = ssm_scan(write, delta, inputs.A, keys_w, inputs.queries, memory_state,
                                       chunk_size=self.config.selective_ssm_chunk_size)
            y = self.finish(y, inputs.u_hat, hidden_states)  # (B, T, H, P)
            return by_group(y).permute(0, 1, 3, 2, 4), None, memory_state  # (B, G, g, T, P)

        valid = None if token_mask is None else token_mask[:, -length:]
        out, state = windowed(queries.unflatten(1, (groups, per_group)).to(cd), keys.to(cd), values.to(cd), valid,
                              extras, state, self.config.selective_ssm_window, self.head_dim ** -0.5, memory,
                              gate=self.window_gate.view(groups, per_group), backend=self.config.kernel_backend)
        return out.flatten(1, 2).transpose(1, 2), state  # (B, T, H, P)

    def _project_bc(self, source):
        """B and C from ``source`` (the block input, or û in shared mode), with Qwen3's q/k norms."""
        keys, queries = self.k_proj(source), self.q_proj(source)
        if self.config.qk_norm:
            keys = self.k_norm(keys.unflatten(-1, (-1, self.state_size))).flatten(-2)
            queries = self.q_norm(queries.unflatten(-1, (-1, self.state_size))).flatten(-2)
        return keys, queries


def _zoh(A, delta):
    """Zero-order hold's write scale (e^{AΔ} - 1) / A, Δ where A = 0 (its limit); A Δ varies along the channels or the
    slots, not both (_validate), so this stays small."""
    safe = torch.where(A == 0, torch.ones_like(A), A)
    return torch.where(A == 0, delta, torch.expm1(A * delta) / safe)


class SelectiveSSMCacheLayer(RecurrentStateLayer):
    """The SSM state (B, H, P, N) in fp32, the conv history (B, K - 1, channels) and the token count."""

    _layer_type = "selective_ssm"


def _derived_defaults(config) -> dict:
    variant = config.selective_ssm_variant
    return {"selective_ssm_state_size": config.head_dim,
            "selective_ssm_a_shape": "head" if variant == "mamba2" else "channel_state",
            "selective_ssm_input_scaling": "none" if variant == "delta_t" else "euler",
            "selective_ssm_dt_rank": math.ceil(config.hidden_size / 16) if variant in ("s6", "delta_t") else 0,
            "selective_ssm_conv_mode": "independent" if variant == "mamba2" else "shared",
            "selective_ssm_rmsnorm": variant == "mamba2"}


def _validate(config) -> str | None:
    if config.selective_ssm_window:
        if config.selective_ssm_variant == "s4d" or config.selective_ssm_conv_mode == "shared":
            return ("selective_ssm_window attends with the q/k projections of the block input: it needs B and C "
                    "from projections (not s4d) and selective_ssm_conv_mode 'independent' or 'none'")
        if config.selective_ssm_state_size != config.head_dim:
            return (f"selective_ssm_window attends with B and C's projections as keys and queries: "
                    f"selective_ssm_state_size ({config.selective_ssm_state_size}) must equal head_dim "
                    f"({config.head_dim})")
    if config.selective_ssm_input_scaling == "zoh" and config.selective_ssm_state_size > 1:
        shape, variant = config.selective_ssm_a_shape, config.selective_ssm_variant
        if (variant == "s6" or shape == "channel_state") and (variant == "delta_t" or shape != "head"):
            return ("selective_ssm_input_scaling='zoh' needs a decay that varies along the channels or the state "
                    "slots, not both (choose selective_ssm_a_shape 'head' or 'state', or state_size 1)")
    return None


@torch.no_grad()
def ssm_lag_theory(mixer, inputs, position_embeddings=None) -> dict:
    scan = mixer.scan_inputs(inputs)
    rate = (-scan.A * scan.delta[0].mean(0)).min().item()  # (H, P or 1, N or 1): the slowest mode
    return {"law": "exponential", "rate": rate,
            "source": "exp(-|A| sum Delta) of the slowest mode (mean Delta on these inputs)"}


SELECTIVE_SSM = register_mixer(MixerSpec(
    name="selective_ssm", mixer_class=SelectiveSSMMixer, title="SelectiveSSM",
    summary="selective state-space layer (S6 / Mamba, S4D, Mamba-2 or Mamba-Δᵀ): a constant-size recurrent state "
            "with an input-dependent step size",
    paper="Understanding Input Selectivity in Mamba: Impact on Approximation Power, Memorization, and Associative "
          "Recall Capacity (Huang et al., ICML 2025, arXiv 2506.11891)",
    options=(
        MixerOption("selective_ssm_variant", "mamba2", "'s6' (Mamba: Δ per channel), 's4d' (Δ = 1, constant B and "
                    "C), 'mamba2' (Δ and A per head) or 'delta_t' (Mamba-Δᵀ: Δ per state slot, no Δ in the write)",
                    one_of(*VARIANTS)),
        MixerOption("selective_ssm_state_size", None, "state slots N per channel (None: head_dim, what a conversion "
                    "needs since B and C start as k and q)", positive_int),
        MixerOption("selective_ssm_a_shape", None, "A per 'channel_state' (H, P, N), per 'state' (H, N) or per "
                    "'head' (None: 'head' for mamba2, else 'channel_state')",
                    one_of(*A_SHAPES)),
        MixerOption("selective_ssm_input_scaling", None, "the write's discretisation: 'euler' (Δ B), 'zoh' "
                    "((e^{AΔ} - 1) / A B) or 'none' (None: 'none' for delta_t, else 'euler')",
                    one_of("euler", "zoh", "none")),
        MixerOption("selective_ssm_dt_rank", None, "rank of the Δ projection (0: full; None: ceil(hidden / 16) for "
                    "s6 and delta_t, full for mamba2)", non_negative_int),
        MixerOption("selective_ssm_conv_mode", None, "'independent' (one depthwise conv over u, B and C, Mamba-2), "
                    "'shared' (conv over u, then B, C, Δ from its output, the paper's S6) or 'none' (None: "
                    "independent for mamba2, else shared)", one_of("independent", "shared", "none")),
        MixerOption("selective_ssm_conv_width", 4, "causal conv kernel width K (the paper's constructions: 2)",
                    positive_int),
        MixerOption("selective_ssm_conv_activation", "silu", "activation after the conv",
                    one_of(*ACTIVATIONS)),
        MixerOption("selective_ssm_gate", True, "output gate silu(z_proj(x))", boolean),
        MixerOption("selective_ssm_use_d", True, "the D skip, y += D û", boolean),
        MixerOption("selective_ssm_rmsnorm", None, "per-head RMSNorm of the (gated) output, Mamba-2's gated norm "
                    "(None: on for mamba2)", boolean),
        MixerOption("selective_ssm_chunk_size", 64, "chunk length of the chunked scan (training, prefill)",
                    positive_int),
        window_option("selective_ssm"),
    ),
    derived_defaults=_derived_defaults, validate=_validate, cache_layer=SelectiveSSMCacheLayer,
    keep_in_fp32=("A_log",),
    # identity conv: the projections pass through; the output norm, started at the teacher's scale, for every variant
    conversion_options={"selective_ssm_conv_mode": "independent", "selective_ssm_conv_activation": "identity",
                        "selective_ssm_rmsnorm": True},
    limitations=("Selective-SSM layers compress the whole past into a fixed state: exact recall of long-past tokens "
                 "is lossy, in exchange for a decoding state that does not grow with the context.",),
    tiny_options={"selective_ssm_chunk_size": 4, "selective_ssm_conv_width": 3},
    tiny_variants={"s6": {"selective_ssm_variant": "s6"}, "s4d": {"selective_ssm_variant": "s4d"},
                   "delta_t": {"selective_ssm_variant": "delta_t"},
                   "delta_t_state": {"selective_ssm_variant": "delta_t", "selective_ssm_a_shape": "state"},
                   "window": {"selective_ssm_window": 3, "selective_ssm_conv_mode": "independent"},
                   "s6_window": {"selective_ssm_variant": "s6", "selective_ssm_window": 3,
                                 "selective_ssm_conv_mode": "independent"}}, lag_theory=ssm_lag_theory))
