"""VORT: variable-order power-law retention with keyed linear-attention retrieval and a local window
(docs/mixers/vort.md).

Mlaiki, "VORT: Adaptive Power-Law Memory for NLP Transformers" (arXiv 2605.08966), with the paper's errata resolved
(the corrected sum-of-exponentials, collapsed banks, eq. 16's causality). Per KV head, x (B, T, D):

    q, k, v = q_proj, k_proj, v_proj (Qwen biases and q/k norms kept); RoPE on the window branch (and on the global
        branch with vort_global_rope)
    alpha_t = delta + (1 - delta) sigmoid(W_a x_t + u H_t + b)   H_t: the entropy of token t's window softmax row
        (normalised, averaged over the group's query heads)
    global  o_t = sum_i (phi(q_t) . phi(k_i)) w_{t-i}(alpha_i) v_i / (sum_i (phi(q_t) . phi(k_i)) w_{t-i}(alpha_i) + eps0)
        w: the Grünwald-Letnikov power law as a sum of exponentials (kernels/soe.py) held in S + 1 fp32 slots
        (kernels/retention.py), or the pure power law, one learned exponential, a learned mixture
    window  exact softmax attention over the last w tokens (core/window.py)
    y = o_proj(window + global)             ("sum", eq. 17: the global branch reads every token)
      = o_proj(window + sigmoid(g) global)  ("gated_sum": tokens enter the memory when they leave the window)
      = o_proj(one softmax over both)       ("shared_normalizer": likewise)

Conversion: q/k/v/o copied and shared by both branches, the window exact with the teacher's RoPE, alpha started at
0.95 (alpha = 1 is no decay), Hedgehog features (trained in stage 1) on the rotated q, k, one shared normaliser, so
on sequences no longer than the window the layer is its teacher.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..core.attention import FullAttention
from ..core.cache import RecurrentStateLayer
from ..core.mixer import RecurrentMixer
from ..core.registry import (MixerOption, MixerSpec, boolean, non_negative_int, non_negative_number, number,
                             one_of, open_unit_interval, positive_int, positive_number, register_mixer)
from ..core.window import windowed
from ..kernels.conventions import compute_dtype, outside_autocast
from ..kernels.hedgehog import hedgehog, hedgehog_pair
from ..kernels.retention import (lag_kernel, normalised_read, retention, retention_chunked, retention_quadratic,
                                 retention_recurrent)
from ..kernels.rope import apply_rope
from ..kernels.soe import KERNELS, gl_weights, power_weights, soe_log_rates, soe_weights, write_weights

FEATURE_MAPS = ("favor_pos", "hedgehog", "elu1", "identity")
COMBINES = {"sum": "sum", "gated_sum": "gated_sum", "shared_normalizer": "shared"}  # option -> core.window name
GATED_SUM_INIT = -4.0  # gated_sum: the global branch starts at sigmoid(-4) = 1.8% of the window's scale


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


class VORTMixer(RecurrentMixer, FullAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        c = config
        groups, width, features = self.num_key_value_heads, self.head_dim, c.vort_feature_dim
        self.window, self.features = c.vort_window, features
        if c.vort_feature_map == "favor_pos":  # a fixed random projection, saved with the weights
            self.register_buffer("feature_projection", torch.zeros(features, width))
        elif c.vort_feature_map == "hedgehog":  # learned: softmax([x W, -x W]) per KV head, q and k maps apart
            self.hedgehog_q = nn.Parameter(torch.zeros(groups, width, features // 2))
            self.hedgehog_k = nn.Parameter(torch.zeros(groups, width, features // 2))
        self.uses_alpha = c.vort_kernel in KERNELS
        if self.uses_alpha and c.vort_alpha_mode == "routed":
            self.alpha_proj = nn.Linear(c.hidden_size, groups)  # W_a, b: one order per token and KV head
            self.alpha_entropy = nn.Parameter(torch.zeros(groups)) if c.vort_entropy_source == "local_attention" \
                else None
        if c.vort_kernel == "exp":
            self.log_rate = nn.Parameter(torch.zeros(groups, 1))  # log xi: decay exp(-xi) per step
        elif c.vort_kernel == "mixture":
            self.log_rate = nn.Parameter(torch.zeros(groups, c.vort_mixture_components))
            self.mixture_logit = nn.Parameter(torch.zeros(groups, c.vort_mixture_components))  # softplus -> pi_m
        self.window_gate = nn.Parameter(torch.zeros(self.num_heads)) \
            if c.vort_window and c.vort_combine == "gated_sum" else None

    # ----- initialisation

    def reset_parameters(self):
        """Scratch initialisation: FAVOR+ orthogonal Gaussian rows (seeded by the layer), Hedgehog at the identity,
        W_a = 0 and b at alpha_init, the exp rate at vort_exp_rate, mixture rates log-uniform in [1e-4, 1]."""
        c = self.config
        if hasattr(self, "feature_projection"):
            init.copy_(self.feature_projection, _orthogonal_gaussian(self.features, self.head_dim, self.layer_idx))
        if hasattr(self, "hedgehog_q"):
            eye = torch.eye(self.head_dim, self.features // 2).expand_as(self.hedgehog_q)
            init.copy_(self.hedgehog_q, eye)
            init.copy_(self.hedgehog_k, eye)
        if hasattr(self, "alpha_proj"):
            init.zeros_(self.alpha_proj.weight)
            init.constant_(self.alpha_proj.bias, _logit((c.vort_alpha_init - c.vort_delta) / (1 - c.vort_delta)))
            if self.alpha_entropy is not None:
                init.zeros_(self.alpha_entropy)
        if c.vort_kernel == "exp":
            init.constant_(self.log_rate, math.log(c.vort_exp_rate))
        elif c.vort_kernel == "mixture":
            m = c.vort_mixture_components
            rates = torch.logspace(-4, 0, m) if m > 1 else torch.tensor([c.vort_exp_rate])
            init.copy_(self.log_rate, torch.log(rates).expand_as(self.log_rate))
            init.constant_(self.mixture_logit, math.log(math.expm1(1.0 / m)))  # softplus^-1(1 / M)
        if self.window_gate is not None:
            init.constant_(self.window_gate, GATED_SUM_INIT)

    # ----- the pieces

    @outside_autocast  # its exp in fp32: in fp16 it overflows
    def feature_map(self, x, side: str):
        """phi(x) for x (..., G, [g,] T, d) (KV-head axis 1) -> (features, log offset or None): phi(x) = features *
        exp(offset). FAVOR+ (Performer): exp(Omega x~ - |x~|^2 / 2) / sqrt(m), x~ = x d^-1/4, so phi(q) . phi(k)
        estimates exp(q.k / sqrt(d)); the query side is divided by its largest feature (the offset keeps the absolute
        scale for the shared normaliser). Hedgehog: [softmax(x W), softmax(-x W)] (kernels/hedgehog.py). The other
        maps are their own scale (offset None)."""
        name = self.config.vort_feature_map
        if name == "favor_pos":
            scaled = x * self.head_dim ** -0.25
            exponent = scaled @ self.feature_projection.to(x.dtype).T - scaled.pow(2).sum(-1, keepdim=True) / 2 \
                - math.log(self.features) / 2
            if side == "k":
                return torch.exp(exponent), None
            offset = exponent.amax(-1, keepdim=True).detach()
            return torch.exp(exponent - offset), offset[..., 0]
        if name == "hedgehog":
            return hedgehog(x, self.hedgehog_q if side == "q" else self.hedgehog_k), None
        return (F.elu(x) + 1 if name == "elu1" else x), None

    @outside_autocast
    def feature_maps(self, q, k):
        """(phi(q), q's log offset or None, phi(k)) as ``feature_map`` gives them; Hedgehog's two maps through one
        kernel launch each way on the GPU path (kernels/hedgehog.py ``hedgehog_pair``)."""
        if self.config.vort_feature_map == "hedgehog":
            q_feat, k_feat = hedgehog_pair(q, self.hedgehog_q, k, self.hedgehog_k, backend=self.config.kernel_backend)
            return q_feat, None, k_feat
        return *self.feature_map(q, "q"), self.feature_map(k, "k")[0]

    def orders(self, hidden_states, entropy=None):
        """alpha (B, G, T) in the compute dtype from the block input and the window entropy (B, G, g, T) or None."""
        c, cd = self.config, compute_dtype(hidden_states.dtype)
        batch, length = hidden_states.shape[:2]
        if c.vort_alpha_mode == "fixed":
            return torch.full((batch, self.num_key_value_heads, length), c.vort_alpha_fixed, dtype=cd,
                              device=hidden_states.device)
        logits = self.alpha_proj(hidden_states).to(cd).transpose(1, 2)  # (B, G, T)
        if self.alpha_entropy is not None and entropy is not None:
            logits = logits + self.alpha_entropy.to(cd)[:, None] * entropy.to(cd).mean(2)
        return c.vort_delta + (1 - c.vort_delta) * torch.sigmoid(logits)

    def log_rates(self, dtype, device):
        """(1 or G, slots): the SOE's -xi_s then 0 (DC), or the learned -xi of the exp / mixture kernels."""
        c = self.config
        if self.uses_alpha:
            return soe_log_rates(c.vort_soe_terms, c.vort_soe_horizon, c.vort_soe_eps, dtype=dtype, device=device)[None]
        return -torch.exp(self.log_rate.to(dtype))

    def slot_weights(self, alpha, like, keep=None, lag: int = 0):
        """Per-token write weights (B, G, T, slots) and the lag-0 skip weight (B, G, T) or None, times ``keep``
        (B, T) (0: padding; None: 1) and, per slot, the decay over a delay of ``lag`` steps; ``like`` (B, G, T) gives
        shape and dtype when the kernel has no alpha. nearest_bank: the paper's K orders with a straight-through
        estimator (c(alpha) + stop_grad(c(alpha_k) - c(alpha)))."""
        c = self.config
        skip = None
        if self.uses_alpha and c.vort_alpha_quantization == "none":  # one fused launch each way on the GPU path
            weights, skip = write_weights(alpha, keep, lag, c.vort_soe_terms, c.vort_soe_horizon, c.vort_soe_eps,
                                          c.vort_kernel, backend=c.kernel_backend)
            return weights, (skip if c.vort_kernel == "gl" else None)
        if self.uses_alpha:
            weights, skip = soe_weights(alpha, c.vort_soe_terms, c.vort_soe_horizon, c.vort_soe_eps, c.vort_kernel)
            banked_w, banked_s = soe_weights(nearest_bank(alpha, c.vort_delta, c.vort_num_banks),
                                             c.vort_soe_terms, c.vort_soe_horizon, c.vort_soe_eps, c.vort_kernel)
            weights, skip = weights + (banked_w - weights).detach(), skip + (banked_s - skip).detach()
            skip = skip if c.vort_kernel == "gl" else None
        elif c.vort_kernel == "exp":
            weights = torch.ones_like(like)[..., None]
        else:
            weights = F.softplus(self.mixture_logit.to(like.dtype))[None, :, None, :].expand(*like.shape, -1)
        if keep is not None:
            keep = keep[:, None].to(like.dtype)
            weights, skip = weights * keep[..., None], None if skip is None else skip * keep
        if lag:
            weights = weights * torch.exp(self.log_rates(like.dtype, like.device) * lag)[None, :, None, :]
        return weights, skip

    @outside_autocast  # the memory's sums in fp32 (fp16 overflows them)
    def retain(self, q_feat, q_offset, k_feat, values, writing, alpha, state, lag: int = 0, method: str = "auto"):
        """The global branch over the tokens written by this call (``writing`` (B, T) marks real ones; ``q_offset``
        the query features' log scale or None), ``lag``
        steps behind the queries (the window's delay) -> (output (B, G, g, T, dv), log weight (B, G, g, T), state).
        State: (slots state (B, G, S, F, dv + 1), undecayed-normaliser state (B, G, 1, F, 1) or None)."""
        c = self.config
        cd = q_feat.dtype
        like = values[..., 0]
        keep = None if writing is None else writing.to(cd)
        # a token written `lag` steps late was already `lag` steps old
        weights, skip = self.slot_weights(alpha, like, keep, lag)
        log_rates = self.log_rates(cd, q_feat.device)
        # a delayed write is read in the same step (its lag is already `lag` >= 1, so no skip term)
        include = bool(lag) or c.vort_include_current
        skip = skip if include and not lag else None
        decayed = c.vort_normalizer == "decayed"
        main, plain = state if state is not None else (None, None)
        v = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1) if decayed else values
        run = {"auto": lambda *a, **k: retention(*a, **k, chunk_size=c.vort_chunk_size, backend=c.kernel_backend),
               "recurrent": retention_recurrent, "quadratic": retention_quadratic,
               "chunked": lambda *a, **k: retention_chunked(*a, **k, chunk_size=c.vort_chunk_size)}[method]
        read, main = run(q_feat, k_feat, v, log_rates, weights, skip, main, include_current=include)
        if not decayed:  # eq. 13's normaliser: the same scores without the retention weights (one rate-1 slot)
            zero = torch.zeros(1, 1, dtype=cd, device=q_feat.device)
            ones = (torch.ones_like(like) if keep is None else keep[:, None].expand_as(like))[..., None]
            den, plain = run(q_feat, k_feat, ones, zero, ones, None, plain, include_current=include)
            read = torch.cat([read, den], dim=-1)
        output, log_weight = normalised_read(read, c.vort_eps0, q_offset, backend=c.kernel_backend)
        return output, log_weight, (main, plain)

    def projections(self, hidden_states, position_embeddings):
        """Queries (B, G, g, T, d) and keys, values (B, G, T, d) in the compute dtype: the window's (rotated) and the
        global branch's (rotated with vort_global_rope, else not)."""
        batch, length, _ = hidden_states.shape
        cd = compute_dtype(hidden_states.dtype)
        shape = (batch, length, -1, self.head_dim)
        query, key, value = (x.view(shape) for x in self.linear_qkv(hidden_states))
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2).to(cd), key.transpose(1, 2).to(cd)  # (B, H, T, d), (B, G, T, d)
        value = value.transpose(1, 2).to(cd)
        cos, sin = position_embeddings
        rotated_q, rotated_k = apply_rope(query, key, cos.to(cd), sin.to(cd), self.config.kernel_backend)
        global_q, global_k = (rotated_q, rotated_k) if self.config.vort_global_rope else (query, key)
        grouped = (self.num_key_value_heads, self.num_key_value_groups)
        return rotated_q.unflatten(1, grouped), rotated_k, global_q.unflatten(1, grouped), global_k, value

    # ----- the layer

    def mix(self, hidden_states, position_embeddings=None, token_mask=None, state=None, history=None):
        """(B, T, D) -> output (B, T, D), the new state (a WindowState around the global state when windowed)."""
        batch, length, _ = hidden_states.shape
        q_win, k_win, q_glob, k_glob, value = self.projections(hidden_states, position_embeddings)
        q_feat, q_offset, k_feat = self.feature_maps(q_glob, k_glob)
        valid = None if token_mask is None else token_mask[:, -length:]
        if not self.window:
            alpha = self.orders(hidden_states) if self.uses_alpha else None
            out, _, state = self.retain(q_feat, q_offset, k_feat, value, valid, alpha, state)
        else:
            combine = COMBINES[self.config.vort_combine]
            lag = 0 if combine == "sum" else self.window  # sum (eq. 17): the global branch reads every token

            def memory(query, keys, values, writing, extras, memory_state):
                return self.retain(q_feat, q_offset, extras[0], values, writing,
                                   extras[1] if self.uses_alpha else None, memory_state, lag=lag)

            def write_inputs(entropy):  # the key features and, for alpha kernels, the order: delayed with the token
                return (k_feat,) + ((self.orders(hidden_states, entropy),) if self.uses_alpha else ())

            gate = None if self.window_gate is None else self.window_gate.view(self.num_key_value_heads, -1)
            out, state = windowed(q_win, k_win, value, valid, write_inputs, state, self.window, self.scaling, memory,
                                  gate=gate, combine=combine, backend=self.config.kernel_backend)
        out = out.flatten(1, 2).transpose(1, 2).reshape(batch, length, -1)  # (B, T, H * d)
        return self.o_proj(out.to(hidden_states.dtype)), state, history

    # the token step: the recurrent one, with the teacher's q/k/v stacked into one product before it
    token_step = replace(RecurrentMixer.token_step, prepare=FullAttention.keep_qkv_fused)

    # ----- the definition, for tests: one quadratic pass, no cache, no chunks, no delayed writes

    @torch.no_grad()
    def reference(self, hidden_states, position_embeddings, scores: str = "features", lags: str = "soe"):
        """The layer's output (B, T, D) through (T, T) matrices. ``scores``: "features" (phi(q) . phi(k), what the
        layer computes) or "exact" (exp(q.k / sqrt(d)), the kernel FAVOR+ estimates); ``lags``: "soe" or "exact"
        (the lgamma power law the SOE approximates; gl and power kernels). No padding."""
        c = self.config
        batch, length, _ = hidden_states.shape
        q_win, k_win, q_glob, k_glob, value = self.projections(hidden_states, position_embeddings)
        cd = value.dtype
        t = torch.arange(length, device=value.device)
        lag = t[:, None] - t[None, :]  # (T, T)
        local, log_z, entropy = self.quadratic_window(q_win, k_win, value) if self.window else (None, None, None)
        alpha = self.orders(hidden_states, entropy) if self.uses_alpha else None
        q_feat, q_offset = self.feature_map(q_glob, "q")
        k_feat, _ = self.feature_map(k_glob, "k")
        if q_offset is None:
            q_offset = torch.zeros_like(q_feat[..., 0])
        combine = COMBINES[c.vort_combine] if self.window else "none"
        delayed = combine in ("shared", "gated_sum")
        if scores == "exact":
            glob = torch.einsum("bgjtd,bgid->bgjti", q_glob, k_glob) * self.scaling
            global_scores, q_offset = torch.exp(glob - glob.amax(-1, keepdim=True)), glob.amax(-1)
        else:
            global_scores = torch.einsum("bgjtf,bgif->bgjti", q_feat, k_feat)
        weights, skip = self.slot_weights(alpha, value[..., 0])
        log_rates = self.log_rates(cd, value.device)
        include = c.vort_include_current and not delayed
        kernel = lag_kernel(log_rates, weights, length)  # (B, G, T, T)
        if lags == "exact":
            exact = gl_weights if c.vort_kernel == "gl" else power_weights
            kernel = exact(alpha[..., None, :], lag.clamp(min=0))  # (B, G, T, T): w_{t-i}(alpha_i)
        keep = (lag >= self.window) if delayed else ((lag >= 0) if include else (lag > 0))
        kernel = kernel * keep
        if skip is not None and include and lags == "soe":
            kernel = kernel + torch.diag_embed(skip)
        numerator = torch.einsum("bgjti,bgti,bgid->bgjtd", global_scores, kernel, value)
        if c.vort_normalizer == "decayed":
            denominator = torch.einsum("bgjti,bgti->bgjt", global_scores, kernel)
        else:
            denominator = (global_scores * keep).sum(-1)
        remote = numerator / (denominator + c.vort_eps0 * torch.exp(-q_offset).clamp(max=1e30)).clamp(
            min=torch.finfo(cd).tiny)[..., None]
        if combine == "none":
            out = remote
        elif combine == "sum":
            out = local + remote
        elif combine == "gated_sum":
            gate = torch.sigmoid(self.window_gate.view(self.num_key_value_heads, -1).to(cd))[None, :, :, None]
            out = local + (gate * (denominator > 0))[..., None] * remote
        else:
            share = torch.sigmoid(torch.log(denominator) + q_offset - log_z)
            out = local + share[..., None] * (remote - local)
        out = out.flatten(1, 2).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out.to(hidden_states.dtype))

    def quadratic_window(self, q_win, k_win, value):
        """Window attention through (T, T) matrices: output (B, G, g, T, d), log normaliser and normalised entropy
        (B, G, g, T)."""
        length = q_win.shape[3]
        t = torch.arange(length, device=q_win.device)
        lag = t[:, None] - t[None, :]
        in_window = (lag >= 0) & (lag < self.window)
        masked = (torch.einsum("bgjtd,bgid->bgjti", q_win, k_win) * self.scaling).masked_fill(~in_window,
                                                                                             float("-inf"))
        log_z = torch.logsumexp(masked, dim=-1)
        p = torch.exp(masked - log_z[..., None])
        seen = in_window.sum(-1).to(value.dtype)
        h = log_z - (p * masked.masked_fill(~in_window, 0)).sum(-1)
        entropy = torch.where(seen > 1, h / torch.log(seen.clamp(min=2)), torch.zeros((), dtype=value.dtype))
        return p @ value[:, :, None], log_z, entropy

    # ----- the retrieval (plasticity) loss of the paper's §5, an optional stage-1 auxiliary

    def auxiliary_loss(self, hidden_states, position_embeddings):
        weight = self.config.vort_plasticity_weight
        if not weight or not self.uses_alpha:
            return None
        return weight * self.plasticity_loss(hidden_states, position_embeddings)

    def plasticity_loss(self, hidden_states, position_embeddings, source=None):
        """Eq. 24: -mean_t log p(i*(t) | t), p(i | t) proportional to exp(q_t.k_i / sqrt(d)) w_{t-i}(alpha_i) over
        i < t, with the window's (the teacher's, rotated) q and k and the SOE weights. ``source`` (B, T) long: i*(t)
        (-1: no target); default: the token the teacher attends to most outside the window (i <= t - w). Its
        gradient reaches alpha's router through c_s(alpha_i)."""
        q_win, k_win, _, _, value = self.projections(hidden_states, position_embeddings)
        length, cd = q_win.shape[3], value.dtype
        t = torch.arange(length, device=value.device)
        lag = t[:, None] - t[None, :]
        scores = torch.einsum("bgjtd,bgid->bgjti", q_win, k_win) * self.scaling  # (B, G, g, T, T)
        entropy = self.quadratic_window(q_win, k_win, value)[2] if self.window else None
        weights, _ = self.slot_weights(self.orders(hidden_states, entropy), value[..., 0])  # (B, G, T, S)
        kernel = lag_kernel(self.log_rates(cd, value.device), weights, length)  # (B, G, T, T): w_{t-i}(alpha_i)
        past = lag > 0
        log_r = (scores + torch.log(kernel.clamp(min=torch.finfo(cd).tiny))[:, :, None]).masked_fill(
            ~past, float("-inf"))
        if source is None:
            candidates = lag >= max(self.window, 1)
            source = scores.detach().masked_fill(~candidates, float("-inf")).argmax(-1)  # (B, G, g, T)
            source = torch.where(candidates.any(-1), source, -1)
        else:
            source = source[:, None, None].expand(scores.shape[:4])
        target = source >= 0
        if not bool(target.any()):
            return value.new_zeros(())
        log_p = torch.log_softmax(log_r.masked_fill(~past.any(-1)[:, None], 0), dim=-1)
        picked = log_p.gather(-1, source.clamp(min=0)[..., None])[..., 0]
        return -(picked * target).sum() / target.sum()

    # ----- conversion

    def init_new_parameters(self):
        """Conversion init: the scratch init (alpha_init is 0.95 through the conversion options)."""
        self.reset_parameters()


def nearest_bank(alpha, delta: float, banks: int):
    """The paper's bank order nearest to alpha: delta + (1 - delta) k / K, k = 1..K (the grid includes 1)."""
    k = torch.round((alpha - delta) / (1 - delta) * banks).clamp(1, banks)
    return delta + (1 - delta) * k / banks


def _orthogonal_gaussian(rows: int, width: int, seed: int) -> torch.Tensor:
    """Performer's orthogonal random features: blocks of orthogonal rows, each scaled to a Gaussian vector's norm."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(-(-rows // width)):
        q, _ = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))
        blocks.append(q.T)
    norms = torch.randn(rows, width, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (torch.cat(blocks)[:rows] * norms).float()


class VORTCacheLayer(RecurrentStateLayer):
    """The global branch's fp32 slot state (B, G, S + 1, F, dv + 1) (and the undecayed normaliser's), plus with a
    window the last w keys / values / key features / orders (core.window.WindowState)."""

    _layer_type = "vort"


def _derived_defaults(config) -> dict:
    feature_map = config.vort_feature_map
    width = config.head_dim  # None when the heads do not divide the width: the backbone check names that
    return {"vort_feature_dim": {"favor_pos": 64, "hedgehog": width and 2 * width}.get(feature_map, width),
            "vort_soe_horizon": config.max_position_embeddings,
            "vort_include_current": config.vort_kernel != "power",
            "vort_entropy_source": "local_attention" if config.vort_window else "none",
            "vort_alpha_init": 0.5}


def _validate(config) -> str | None:
    c = config
    if not c.vort_delta < c.vort_alpha_init < 1:
        return f"vort_alpha_init must lie in (vort_delta, 1) = ({c.vort_delta}, 1), got {c.vort_alpha_init}"
    if not 0 < c.vort_alpha_fixed <= 1:
        return f"vort_alpha_fixed must lie in (0, 1], got {c.vort_alpha_fixed}"
    if c.vort_kernel == "power" and c.vort_include_current:
        return "vort_kernel='power' is undefined at lag 0: it needs vort_include_current=false (strict i < t)"
    if c.vort_entropy_source == "local_attention" and not c.vort_window:
        return "vort_entropy_source='local_attention' reads the window's softmax: it needs vort_window > 0"
    if c.vort_feature_map in ("elu1", "identity") and c.vort_feature_dim != c.head_dim:
        return (f"vort_feature_map={c.vort_feature_map!r} keeps the head width: vort_feature_dim must be head_dim "
                f"({c.head_dim}), got {c.vort_feature_dim}")
    if c.vort_feature_map == "hedgehog" and c.vort_feature_dim % 2:
        return f"vort_feature_map='hedgehog' concatenates two softmaxes: vort_feature_dim must be even, got " \
               f"{c.vort_feature_dim}"
    if c.vort_soe_horizon < 2:
        return f"vort_soe_horizon must be >= 2, got {c.vort_soe_horizon}"
    return None


@torch.no_grad()
def vort_lag_theory(mixer, inputs, position_embeddings=None) -> dict | None:
    if not mixer.uses_alpha:
        return None
    # the kernel w_l ~ l^(alpha-1) is read through a normaliser: divided by sum_{j<=l} w_j ~ l^alpha (decayed)
    # a fixed source weighs ~ alpha / l; divided by the undecayed count ~ l, ~ l^(alpha-2)
    alpha = mixer.orders(inputs).mean().item()
    decayed = mixer.config.vort_normalizer == "decayed"
    return {"law": "power", "exponent": -1.0 if decayed else alpha - 2, "alpha": alpha,
            "source": "w_l(alpha) ~ l^(alpha-1) over the " + ("decayed normaliser ~ l^alpha" if decayed else
                                                              "undecayed normaliser ~ l")
                      + ", the layer's mean alpha (no window entropy)"}


VORT = register_mixer(MixerSpec(
    name="vort", mixer_class=VORTMixer, title="VORT",
    summary="variable-order power-law retention: keyed linear attention whose per-token lag kernel is a learned "
            "power law (a sum of exponentials in S + 1 fp32 slots), plus exact attention over a local window",
    paper="VORT: Adaptive Power-Law Memory for NLP Transformers (Mlaiki, arXiv 2605.08966)",
    options=(
        MixerOption("vort_kernel", "gl", "the lag kernel: 'gl' (Grünwald-Letnikov power law), 'power' (j^(alpha-1) "
                    "/ Gamma(alpha), strict), 'exp' (one learned rate), 'mixture' (learned rates and weights)",
                    one_of(*KERNELS, "exp", "mixture")),
        MixerOption("vort_alpha_mode", "routed", "'routed' (alpha per token and KV head from x and the window "
                    "entropy) or 'fixed' (vort_alpha_fixed)", one_of("routed", "fixed")),
        MixerOption("vort_alpha_fixed", 0.7, "alpha of the fixed mode (1: no decay)", number),
        MixerOption("vort_delta", 0.1, "the smallest order delta", open_unit_interval),
        MixerOption("vort_alpha_init", None, "the order the router starts at (None: 0.5; conversion: 0.95)", number),
        MixerOption("vort_alpha_quantization", "none", "'none' (continuous alpha) or 'nearest_bank' (the paper's K "
                    "orders, straight-through gradients)", one_of("none", "nearest_bank")),
        MixerOption("vort_num_banks", 10, "K orders of nearest_bank", positive_int),
        MixerOption("vort_soe_terms", 15, "S quadrature slots (plus the DC slot): max error ~1e-3 at 15, ~1e-5 at 30",
                    positive_int),
        MixerOption("vort_soe_horizon", None, "the longest lag the SOE is built for (None: max_position_embeddings)",
                    positive_int),
        MixerOption("vort_soe_eps", 1e-3, "the SOE's tolerance eps", open_unit_interval),
        MixerOption("vort_feature_map", "favor_pos", "phi: 'favor_pos' (Performer positive random features), "
                    "'hedgehog' (learned softmax features), 'elu1', 'identity'", one_of(*FEATURE_MAPS)),
        MixerOption("vort_feature_dim", None, "feature width (None: 64 for favor_pos, 2 head_dim for hedgehog, "
                    "head_dim otherwise)", positive_int),
        MixerOption("vort_normalizer", "decayed", "'decayed' (eq. 16: the retention weights in the denominator too) "
                    "or 'undecayed' (eq. 13)", one_of("decayed", "undecayed")),
        MixerOption("vort_include_current", None, "token t reads itself (eq. 16; None: true, false for 'power')",
                    boolean),
        MixerOption("vort_eps0", 1e-6, "the denominator's smoothing eps0", non_negative_number),
        MixerOption("vort_window", 64, "local window w: exact softmax attention over the last w tokens (0: off)",
                    non_negative_int, at_most="max_position_embeddings"),
        MixerOption("vort_combine", "sum", "window + global: 'sum' (eq. 17: the global branch reads every "
                    "token), 'gated_sum' (window + sigmoid(g) global) or 'shared_normalizer' (one softmax over both; "
                    "in these two a token enters the memory when it leaves the window)", one_of(*COMBINES)),
        MixerOption("vort_entropy_source", None, "the router's entropy feature: 'local_attention' or 'none' (None: "
                    "local_attention with a window)", one_of("local_attention", "none")),
        MixerOption("vort_global_rope", False, "RoPE on the global branch's q, k too (conversion: on)", boolean),
        MixerOption("vort_plasticity_weight", 0.0, "weight of the retrieval (plasticity) loss in stage 1",
                    non_negative_number),
        MixerOption("vort_mixture_components", 5, "M components of the mixture kernel", positive_int),
        MixerOption("vort_exp_rate", 1e-2, "the initial rate xi of the exp kernel (decay exp(-xi) per token)",
                    positive_number),
        MixerOption("vort_chunk_size", 64, "chunk length of the chunked global branch (training, prefill)",
                    positive_int),
    ),
    derived_defaults=_derived_defaults, validate=_validate, cache_layer=VORTCacheLayer,
    # Hedgehog, not FAVOR+, for conversion: nearer the teacher at init (docs/benchmarks.md, "VORT"), and stage 1
    # has a feature map to train
    conversion_options={"vort_alpha_init": 0.95, "vort_combine": "shared_normalizer", "vort_global_rope": True,
                        "vort_feature_map": "hedgehog"},
    limitations=("VORT layers keep exact attention over the last w tokens only; older tokens are read through "
                 "random-feature linear attention with power-law retention, so recall beyond the window is "
                 "approximate. The decode state is constant in the context length.",),
    tiny_options={"vort_chunk_size": 4, "vort_window": 3, "vort_soe_terms": 4, "vort_soe_horizon": 64,
                  "vort_feature_dim": 8},
    tiny_variants={"shared": {"vort_combine": "shared_normalizer"},
                   "gated": {"vort_combine": "gated_sum"},
                   "no_window": {"vort_window": 0},
                   "strict_undecayed": {"vort_window": 0, "vort_include_current": False,
                                        "vort_normalizer": "undecayed"},
                   "power_banks": {"vort_kernel": "power", "vort_alpha_quantization": "nearest_bank"},
                   "exp": {"vort_kernel": "exp"},
                   "mixture_hedgehog": {"vort_kernel": "mixture", "vort_feature_map": "hedgehog",
                                        "vort_combine": "shared_normalizer"}}, lag_theory=vort_lag_theory))
