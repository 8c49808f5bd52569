"""GLTM: generalized linear token mixing over a structured sparse pattern (docs/mixers/gltm.md).

Fagnou, Caillon, Delattre, Allauzen, "Trading Complexity for Expressivity Through Structured Generalized Linear
Token Mixing". Per head, for the token at 1-based sequence position i (kernels/token_patterns.py names the supports):

    Ã_i = softmax_{j in N(i)} <qA_i, kA_j> / sqrt(d)      the teacher's attention, restricted to the A-support
    B̃_i = softmax_{j in P(i)} <qB_i, kB_j> / sqrt(d)      a second attention, over strictly past outputs
    g_i in [0, 1] per token and head (0 where P(i) is empty: the first token, padding)
    y_i = (1 - g_i) sum_j Ã_ij v_j + g_i sum_j B̃_ij y_j,   i.e.   Y = (I - B)^-1 A V,  A = (1 - g) Ã,  B = g B̃

(A + B) 1 = 1 with nonnegative entries, so (I - B)^-1 A is row-stochastic: every output is a convex combination of
values. The solve is kernels/feedback_solve.py, shared with Sessa: its chunked dense solve for ``dense``, the
block forward substitution over an index table for the sparse patterns (work proportional to the nonzeros).

Gates (spec §4.1): "mamba2" g = exp(-softplus(dt_proj(x)) exp(A_log)), "sigmoid" g = sigmoid(gate_proj(x)), "fixed"
g = gltm_gate_value. RoPE on both branches, at the per-sequence positions (padding never shifts a lattice). Two other
parametrisations: weight sharing (A = B D + D', so z = (I - B)^-1 (d + d') x, y = z - d x: no A-branch attention)
and, for ``ssm``, the Mamba rule (y_t = exp(Δ a) y_{t-1} + Δ b x_t).

Cache per layer: for each kept position its kA, v, kB, y (fp32) and the position. ``attention``, ``dense`` and the
translation-invariant patterns keep every position; ``local``, ``banded``, ``ssm`` the last w (1 for ssm); the
cache-efficient patterns exactly the positions the next token reads (ceil(log2 t) for pow2_ce).

Conversion (spec §6.1): the A-branch is the teacher attention verbatim, the B-branch mirrors q/k; the gate starts
at the value of {off, 0.1, ..., 0.9} whose layer output is closest to the teacher's on calibration activations
("off" is g = 1e-6: with ``dense`` the layer then is its teacher to ~1e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, eager_attention_forward

from ..core.attention import FullAttention
from ..core.cache import KVPlusLayer
from ..core.mixer import TokenStep
from ..core.registry import MixerOption, MixerSpec, boolean, number, one_of, positive_int, register_mixer
from ..kernels.conventions import compute_dtype, shape_constant
from ..kernels.feedback_solve import feedback_solve, feedback_solve_sparse, sparse_solve, strict_past_softmax
from ..kernels.rope import apply_rope
from ..kernels.sparse_attention import gathered_softmax, sparse_attention
from ..kernels.token_patterns import PATTERNS, RECURRENT, offset_function, offsets_below, support_rows

GATES = ("mamba2", "sigmoid", "fixed")
GATE_OFF = 1e-6  # the "off" gate of conversion: finite, so the optimiser can still open it
CALIBRATION_GATES = (GATE_OFF, 0.1, 0.3, 0.5, 0.7, 0.9)
EVICTING = ("local", "banded", "ssm", "pow2_ce", "quad_ce", "custom_ce")  # caches that drop old positions
FULL_A = ("attention", "dense")  # the A-branch is causal attention over every past token


class GLTMMixer(FullAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.pattern, self.window = config.gltm_pattern, config.gltm_bandwidth
        self.offsets = offset_function(self.pattern, config.gltm_offsets)
        self.mamba_rule = config.gltm_ssm_rule == "mamba"  # the paper's Table 2: y = e^{Δa} y_prev + Δ b x
        self.weight_sharing = config.gltm_weight_sharing  # A = B D + D' (spec §4.3): no A-branch attention
        self.decode_length = self.slots = None  # the compiled step's cache: slots enough up to decode_length
        self.gate_kind = "mamba2" if self.mamba_rule else config.gltm_gate
        self.recurrent = self.pattern in RECURRENT
        self.diagonal_a = self.pattern == "ssm" or self.weight_sharing  # A reads only the current input
        hidden, heads, kv_heads, head_dim = config.hidden_size, self.num_heads, self.num_key_value_heads, self.head_dim
        if self.diagonal_a:  # no A-branch queries or keys
            for name in ("q_proj", "k_proj", "q_norm", "k_norm"):
                if hasattr(self, name):
                    delattr(self, name)
        if self.recurrent and self.pattern != "ssm":  # the B-branch: its own queries and keys (spec X7)
            self.qb_proj = nn.Linear(hidden, heads * head_dim, bias=config.attention_bias)
            self.kb_proj = nn.Linear(hidden, kv_heads * head_dim, bias=config.attention_bias)
            if config.qk_norm:
                self.qb_norm = LlamaRMSNorm(head_dim, eps=config.rms_norm_eps)
                self.kb_norm = LlamaRMSNorm(head_dim, eps=config.rms_norm_eps)
        if self.recurrent:
            if self.gate_kind == "mamba2":
                self.dt_proj = nn.Linear(hidden, heads)  # its bias is dt_bias
                self.A_log = nn.Parameter(torch.zeros(heads))
            elif self.gate_kind == "sigmoid":
                self.gate_proj = nn.Linear(hidden, heads)
        if self.mamba_rule:
            self.b_proj = nn.Linear(hidden, heads)  # the write's scalar b_t per head
        if self.weight_sharing:
            self.share_proj = nn.Linear(hidden, 2 * heads)  # [d | d'] per token and head

    def reset_parameters(self):
        """Mamba-2's gate init (spec §4.1): A_log = log U[1, 16], Δ = exp(U[log 1e-3, log 1e-1]) through the bias;
        the sigmoid gate starts at g = 0.5."""
        if not self.recurrent:
            return
        heads = self.num_heads
        if self.gate_kind == "mamba2":
            generator = torch.Generator().manual_seed(self.layer_idx)
            init.copy_(self.A_log, torch.log(1.0 + 15.0 * torch.rand(heads, generator=generator)))
            delta = torch.exp(torch.rand(heads, generator=generator) * math.log(100.0) + math.log(1e-3))
            init.copy_(self.dt_proj.bias, delta.clamp(min=1e-4) + torch.log(-torch.expm1(-delta.clamp(min=1e-4))))
        elif self.gate_kind == "sigmoid":
            init.zeros_(self.gate_proj.weight)
            init.zeros_(self.gate_proj.bias)
        if self.mamba_rule:  # b = 1: y = e^{Δa} y_prev + Δ x
            init.zeros_(self.b_proj.weight)
            init.ones_(self.b_proj.bias)
        if self.weight_sharing:  # d = 0, d' = 1: A = I, so y = (I - B)^-1 x
            init.zeros_(self.share_proj.weight)
            init.copy_(self.share_proj.bias, torch.cat([torch.zeros(heads), torch.ones(heads)]))

    def init_new_parameters(self):
        """Conversion: the gate starts "off" (set_gate), the B-branch mirrors the teacher's q/k (teacher_state)."""
        self.reset_parameters()
        if self.recurrent and not self.mamba_rule:
            self.set_gate(GATE_OFF)

    @torch.no_grad()
    def set_gate(self, value: float):
        """An input-independent gate g = ``value`` (0 < value < 1): zero input weights, the bias solved for it."""
        if self.gate_kind == "mamba2":  # exp(-softplus(b) e^0) = value  ->  softplus(b) = -log(value)
            self.dt_proj.weight.zero_()
            self.A_log.zero_()
            rate = -math.log(value)
            self.dt_proj.bias.fill_(rate + math.log(-math.expm1(-rate)))
        elif self.gate_kind == "sigmoid":
            self.gate_proj.weight.zero_()
            self.gate_proj.bias.fill_(math.log(value / (1.0 - value)))

    @classmethod
    def teacher_state(cls, attention, config) -> dict:
        """The teacher's tensors, and the B-branch's mirror copies of q_proj / k_proj (and their norms)."""
        state = dict(attention.state_dict())
        if config.gltm_pattern == "ssm":  # no queries or keys (diagonal A, one past output per row)
            return {key: value for key, value in state.items() if key.split(".")[0] in ("v_proj", "o_proj")}
        if config.gltm_pattern in RECURRENT:
            for source, target in (("q_proj", "qb_proj"), ("k_proj", "kb_proj"), ("q_norm", "qb_norm"),
                                   ("k_norm", "kb_norm")):
                state.update({key.replace(source, target, 1): value.clone() for key, value in list(state.items())
                              if key.split(".")[0] == source})
        if config.gltm_weight_sharing:  # the A-branch has no queries or keys: only the B-branch keeps them
            state = {key: value for key, value in state.items()
                     if key.split(".")[0] not in ("q_proj", "k_proj", "q_norm", "k_norm")}
        return state

    @classmethod
    def from_attention(cls, attention, config, layer_idx: int, calibration_hidden_states=None,
                       calibration_position_embeddings=None, **unused):
        """The teacher's projections copied, the B-branch mirrored; with calibration activations and a learnable
        gate, the gate starts at the calibration value whose output is closest to the teacher's (spec §6.1)."""
        mixer = super().from_attention(attention, config, layer_idx)
        if calibration_hidden_states is not None and mixer.recurrent and mixer.gate_kind != "fixed" \
                and not mixer.mamba_rule:
            mixer.calibrate_gate(attention, calibration_hidden_states, calibration_position_embeddings)
        return mixer

    @torch.no_grad()
    def calibrate_gate(self, attention, hidden_states, position_embeddings) -> dict:
        """Try every CALIBRATION_GATES value, keep the one with the smallest relative error against the teacher
        attention's output on ``hidden_states``; returns {gate value: error}."""
        teacher = FullAttention.from_attention(attention, self.config, self.layer_idx)
        hidden_states = hidden_states.to(teacher.o_proj.weight.dtype)
        reference = teacher(hidden_states, position_embeddings).float()
        errors = {}
        for value in CALIBRATION_GATES:
            self.set_gate(value)
            output = self(hidden_states, position_embeddings).float()
            errors[value] = ((output - reference).norm() / reference.norm()).item()
        best = min(errors, key=errors.get)
        self.set_gate(best)
        self.conversion_note = f"gate {best:g} (calibrated: error {errors[best]:.3f}, gate off {errors[GATE_OFF]:.3f})"
        return errors

    def gate(self, hidden_states):
        """g (B, T, H) in [0, 1], in the compute dtype."""
        cd = compute_dtype(hidden_states.dtype)
        if self.gate_kind == "fixed":
            return hidden_states.new_full((*hidden_states.shape[:2], self.num_heads), self.config.gltm_gate_value,
                                          dtype=cd)
        if self.gate_kind == "sigmoid":
            return torch.sigmoid(self.gate_proj(hidden_states).to(cd))
        rate = F.softplus(self.dt_proj(hidden_states).to(cd)) * torch.exp(self.A_log.to(cd))
        return torch.exp(-rate)

    def project(self, hidden_states, position_embeddings):
        """The A-branch's queries, keys and values; with a diagonal A (``ssm``, weight sharing) only the values
        (empty queries and keys)."""
        if not self.diagonal_a:
            return super().project(hidden_states, position_embeddings)
        value = self.v_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        query = value.new_zeros(*value.shape[:2], value.shape[2], 0).repeat_interleave(self.num_key_value_groups, 1)
        return query, value[..., :0], value

    def project_feedback(self, hidden_states, position_embeddings):
        """B-branch queries (B, H, T, d) and keys (B, Hkv, T, d), with q/k norms and RoPE (empty for ``ssm``)."""
        if self.pattern == "ssm":
            empty = hidden_states.new_zeros(hidden_states.shape[0], self.num_heads, hidden_states.shape[1], 0)
            return empty, empty[:, :self.num_key_value_heads]
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key = self.qb_proj(hidden_states).view(shape), self.kb_proj(hidden_states).view(shape)
        if self.config.qk_norm:
            query, key = self.qb_norm(query), self.kb_norm(key)
        cos, sin = position_embeddings
        return apply_rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin, self.config.kernel_backend)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        batch, length, _ = hidden_states.shape
        heads, kv_heads, groups = self.num_heads, self.num_key_value_heads, self.num_key_value_groups
        cd = compute_dtype(hidden_states.dtype)
        layer = None if past_key_values is None else past_key_values.layers[self.layer_idx]
        old = None if layer is None or not layer.is_initialized else layer
        seen = 0 if layer is None else layer.get_seq_length()
        if token_mask is not None:  # 1-based positions of the real tokens, 0 at padding
            positions = (token_mask.long().cumsum(-1) * token_mask)[:, -length:]
        else:
            positions = (torch.arange(length, device=hidden_states.device) + seen + 1).expand(batch, length)
        # no position exceeds this: the supports and the lookup are sized from the shapes, with no host read
        longest = seen + length if token_mask is None else token_mask.shape[1]
        query, key, value = self.project(hidden_states, position_embeddings)  # (B, H, T, d), (B, Hkv, T, d) x 2
        # every sequence at positions 1..T (no padding, no past: a training step, a first prefill) reads the same
        # rows, built once a length; otherwise 1-based positions -> rows of [kept positions, new tokens] per call
        shared = token_mask is None and old is None and self.pattern not in FULL_A
        a_rows = b_rows = None  # FULL_A: attention over every position, and dense's solve takes no table
        if shared:
            a_rows, b_rows = self.shared_rows(length, hidden_states.device)  # (1, T, Ka), (1, T, K)
        elif self.pattern not in FULL_A:
            index = _Lookup(positions if old is None else torch.cat([old.positions, positions], dim=1), longest)
            a_rows = None if self.diagonal_a else index(self.a_support(positions, longest))  # (B, T, Ka)
            b_rows = index(support_rows(self.pattern, positions, self.window, self.offsets, longest)) \
                if self.recurrent else None  # (B, T, K)
        if self.diagonal_a:  # A reads x_i itself
            direct = value.repeat_interleave(groups, dim=1)  # (B, H, T, d)
        elif self.pattern in FULL_A:
            if layer is not None:
                key_all, value_all = past_key_values.update(key, value, self.layer_idx)
            else:
                key_all, value_all = key, value
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                              eager_attention_forward)
            direct, _ = attention(self, query, key_all, value_all, attention_mask, dropout=0.0, scaling=self.scaling,
                                  **kwargs)  # (B, T, H, d)
            direct = direct.transpose(1, 2).to(cd)
        else:  # the A-support gathered from [kept positions, new tokens], appended to the cache (in place) first
            key_all, value_all = (key, value) if layer is None else layer.update(key, value)
            direct = sparse_attention(_by_kv_head(query, groups), key_all.flatten(0, 1), value_all.flatten(0, 1),
                                      _per_head(a_rows, batch, kv_heads, shared), self.scaling,
                                      shared=self.rows_name(length) if shared else None,
                                      backend=self.config.kernel_backend)
            direct = _from_kv_head(direct, batch)  # (B, H, T, d)
        direct = direct.to(cd)
        if token_mask is not None:  # padded rows carry nothing (and no NaN) into anyone's solve
            direct = direct.masked_fill(~token_mask[:, None, -length:, None], 0.0)
        feedback_keys = outputs = None
        if self.recurrent:
            q_b, feedback_keys = self.project_feedback(hidden_states, position_embeddings)
            gate = self.gate(hidden_states).transpose(1, 2) * (positions >= 2)[:, None]  # (B, H, T): 0 with no past
            scale, skip = self.input_scale(hidden_states, gate)
            y = self.solve_feedback(scale[..., None] * direct, q_b, feedback_keys, gate, b_rows, shared, old,
                                    token_mask)  # (I - B)^-1 A V
            outputs = y.view(batch, heads, length, -1)  # what later tokens read (z under weight sharing)
            y = outputs if skip is None else outputs - skip[..., None] * direct  # weight sharing: y = z - d x
        else:
            y = outputs = direct
        if layer is not None:
            self.update_cache(layer, key, value[..., :0] if self.diagonal_a else value, feedback_keys, outputs,
                              positions)
        return self.o_proj(y.transpose(1, 2).flatten(2).to(hidden_states.dtype))  # (B, T, H d) -> (B, T, D)

    # The token step (core/mixer.py TokenStep; ``config.compile_decode`` compiles it). The evicting patterns' cache
    # holds exactly the positions the next token reads, at most ``decode_slots`` of them, so it is kept at that many
    # slots (empty ones have position 0) and one token is: attention over the slots and itself, the feedback read of the
    # slots, then the slots the token after it reads kept, all at shapes fixed for the whole run. The other patterns'
    # cache keeps every position and grows: their step is compiled with symbolic shapes (as Sessa's), reads the cache
    # where it lies through a mask of the positions the token reads, and appends its entry.
    @classmethod
    def constant_state(cls, config) -> bool:
        return config.gltm_pattern in EVICTING

    def step_ready(self, layer_cache) -> bool:
        return layer_cache.is_initialized

    def decode_slots(self, length: int) -> int:
        """Slots enough for every position up to ``length``: the number of offsets below it for the cache-efficient
        patterns (ceil(log2) for pow2_ce), w for banded and local, 1 for ssm."""
        return self.read_by(torch.tensor([[length]]), length).shape[-1]

    def step_inputs(self, layer_cache, token_mask) -> tuple:
        """This token's 1-based position (B, 1; 0 for padding) and the cache at a fixed number of slots: K/V
        (B, Hkv, S, d), feedback keys (B, S, Hkv, d), outputs (B, S, H, d), positions (B, S). The slots cover
        every position up to ``decode_length``: the model's max_position_embeddings, or beyond it the next power of
        two past the token after this one (so a run past that length recompiles the step once per doubling)."""
        length = layer_cache.seen_tokens + 1
        if token_mask is None:
            position = torch.full((layer_cache.positions.shape[0], 1), length, device=layer_cache.positions.device)
        else:
            position = token_mask.long().sum(-1, keepdim=True) * token_mask[:, -1:]
        decode_length = max(self.config.max_position_embeddings, 1 << length.bit_length())
        if decode_length != self.decode_length:  # rarely: the slots are worked out once per length
            evicting = self.pattern in EVICTING  # a growing cache has no fixed slots
            self.decode_length, self.slots = decode_length, self.decode_slots(decode_length) if evicting else None
        if self.slots is not None:
            layer_cache.reserve(self.slots)
        return (position, layer_cache.keys, layer_cache.values, layer_cache.feedback_keys, layer_cache.outputs,
                layer_cache.positions)

    def step(self, hidden_states, position_embeddings, position, keys, values, feedback_keys, outputs, slots):
        """``forward`` for one token on the cache (``step_inputs``: fixed slots, or every position so far): the
        same math, no lookup table, no host synchronisation."""
        batch, groups, kv_heads = hidden_states.shape[0], self.num_key_value_groups, self.num_key_value_heads
        cd = compute_dtype(hidden_states.dtype)
        query, key, value = self.project(hidden_states, position_embeddings)  # (B, H, 1, d), (B, Hkv, 1, d) x 2
        everything = self.pattern in FULL_A  # A (and B for dense) read every cached position, where it lies
        if not everything and self.pattern not in EVICTING:  # a growing cache: the entries of P(i) gathered
            keys, values, feedback_keys, outputs, slots = self.support_entries(position, keys, values, feedback_keys,
                                                                               outputs, slots)
        entries = torch.cat([slots, position], dim=1)  # (B, S + 1): the positions read, then this token
        rows = torch.arange(entries.shape[1], device=entries.device).where(entries > 0, -1)[:, None]  # (B, 1, S+1)
        if self.diagonal_a:  # A reads x_i itself; the cache keeps no A-branch keys or values
            direct, value = value.repeat_interleave(groups, dim=1), value[..., :0]
        elif everything:  # causal attention over the cache and the token
            direct = self.attend_one(query, key, value, keys, values, entries > 0)  # (B, 1, H d)
            direct = direct.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, H, 1, d)
        else:  # N(i): the slots (exactly P(i), or the window) and the token itself
            keys_read, values_read = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
            direct = sparse_attention(_by_kv_head(query, groups), keys_read.flatten(0, 1), values_read.flatten(0, 1),
                                      rows.repeat_interleave(kv_heads, 0), self.scaling,
                                      backend=self.config.kernel_backend)
            direct = _from_kv_head(direct, batch)  # (B, H, 1, d)
        direct = direct.to(cd).masked_fill((position == 0)[:, None, :, None], 0.0)
        if self.recurrent:  # B reads the outputs of P(i): the slots, or every cached position (dense)
            q_b, feedback_key = self.project_feedback(hidden_states, position_embeddings)  # (B, H | Hkv, 1, d)
            gate = self.gate(hidden_states).transpose(1, 2) * (position >= 2)[:, None]  # (B, H, 1)
            scale, skip = self.input_scale(hidden_states, gate)
            if everything:  # the solve's own softmax, one row per head at row M, over the keys where they lie
                logits = torch.einsum("bkgd,bmkd->bkgm", q_b.to(cd).view(batch, kv_heads, groups, -1),
                                      feedback_keys.to(cd)).flatten(1, 2) * self.scaling  # (B, H, M)
                weights = strict_past_softmax(logits, slots.shape[1], slots > 0)[:, :, None]  # (B, H, 1, M)
            else:
                weights = gathered_softmax(_by_kv_head(q_b, groups).to(cd), feedback_keys.transpose(1, 2)
                                           .flatten(0, 1).to(cd), rows[..., :-1].repeat_interleave(kv_heads, 0),
                                           self.scaling, backend=self.config.kernel_backend)
                weights = _from_kv_head(weights, batch)  # (B, H, 1, S)
            output = scale[..., None] * direct + torch.einsum("bhts,bshd->bhtd", weights * gate[..., None],
                                                              outputs.to(cd))
            y = output if skip is None else output - skip[..., None] * direct
            feedback_key, output = feedback_key.transpose(1, 2), output.transpose(1, 2)  # (B, 1, heads, d)
        else:  # B = 0: no past output is ever read (the cache's entries are empty)
            y, feedback_key, output = direct, feedback_keys[:, :1], outputs[:, :1]
        feedback_key, output = feedback_key.to(feedback_keys.dtype), output.to(outputs.dtype)
        y = self.o_proj(y.transpose(1, 2).flatten(2).to(hidden_states.dtype))
        if self.pattern not in EVICTING:  # the token's entry, appended to the cache
            return y, (key, value, feedback_key, output, position)
        keys, values = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)  # (B, Hkv, S + 1, d)
        feedback_keys, outputs = torch.cat([feedback_keys, feedback_key], dim=1), torch.cat([outputs, output], dim=1)
        keep = self.still_read(entries, self.decode_length)  # at most S of the S + 1 entries
        return y, _compact(keep, slots.shape[1], ((keys, 2), (values, 2), (feedback_keys, 1), (outputs, 1),
                                                  (entries, 1)))

    def support_entries(self, position, keys, values, feedback_keys, outputs, cached):
        """The cache entries of P(i), the positions the token at ``position`` (B, 1) reads, out of a cache that keeps
        every position (B, M): K/V (B, Hkv, K, d), feedback keys (B, K, Hkv, d), outputs (B, K, H, d), positions
        (B, K; 0 where the row has no such position yet). K: the offsets below ``decode_length``."""
        needed = support_rows(self.pattern, position, self.window, self.offsets, self.decode_length)[:, 0]  # (B, K)
        match = (cached[:, :, None] == needed[:, None, :]) & (needed > 0)[:, None, :]  # (B, M, K)
        index, found = match.long().argmax(1), match.any(1)  # (B, K): where each one sits in the cache
        return (_entries(keys, 2, index), _entries(values, 2, index), _entries(feedback_keys, 1, index),
                _entries(outputs, 1, index), torch.where(found, needed, 0))

    def replaced_by_step(self, inputs):
        """The fixed slots the evicting patterns' step rewrites (K/V, feedback keys, outputs, positions); a growing
        cache appends instead."""
        return inputs[1:] if self.pattern in EVICTING else None

    def store_step(self, layer_cache, state) -> None:
        if self.pattern in EVICTING:
            layer_cache.keys, layer_cache.values, layer_cache.feedback_keys, layer_cache.outputs, \
                layer_cache.positions = state
        else:
            layer_cache.update(*state[:2])
            layer_cache.append_extras(*state[2:])
        layer_cache.seen_tokens += 1

    token_step = TokenStep(ready=step_ready, inputs=step_inputs, step=step, store=store_step,
                           replaced=replaced_by_step, prepare=FullAttention.keep_qkv_fused)

    def mix(self, hidden_states, position_embeddings=None, token_mask=None, state=None, history=None):
        """``forward`` on an evicting pattern's cache held as a constant state (``constant_state``; what a serving
        engine keeps per sequence, hf_mixers/serving): -> (output, state, None). ``state``: None (nothing seen) or a
        ``GLTMState``, each row's kept entries at ``decode_slots(max_position_embeddings)`` slots and its count of
        real tokens; ``token_mask`` (B, T): which new tokens are real (left padding), None for all. The rows' pasts
        may differ in length: a mask of [past, new] tokens, each past right-aligned, gives each token its position."""
        if not self.constant_state(self.config):
            raise ValueError(f"GLTM layer {self.layer_idx}: pattern {self.pattern!r} keeps every position, so its "
                             "cache is no constant state")
        batch, length = hidden_states.shape[:2]
        new = hidden_states.new_ones(batch, length, dtype=torch.bool) if token_mask is None else token_mask.bool()
        layer, mask = GLTMCacheLayer(), new
        seen = new.new_zeros(batch, 1, dtype=torch.long) if state is None else state.seen
        if state is not None:
            width = int(seen.max())  # a host read: serving only, where the engine reads its metadata anyway
            mask = torch.cat([torch.arange(width, device=seen.device) >= width - seen, new], dim=1)
            layer.lazy_initialization(state.keys, state.values)
            layer.keys, layer.values, layer.feedback_keys, layer.outputs, layer.positions = (
                state.keys, state.values, state.feedback_keys, state.outputs, state.positions)
        output = self.forward(hidden_states, position_embeddings, token_mask=mask,
                              past_key_values=SimpleNamespace(layers={self.layer_idx: layer}))
        slots = self.decode_slots(self.config.max_position_embeddings)
        if layer.positions.shape[1] > slots:
            raise ValueError(f"GLTM layer {self.layer_idx}: {layer.positions.shape[1]} kept positions, more than "
                             f"the {slots} a sequence of max_position_embeddings="
                             f"{self.config.max_position_embeddings} needs")
        layer.reserve(slots)
        return output, GLTMState(layer.keys, layer.values, layer.feedback_keys, layer.outputs, layer.positions,
                                 seen + new.sum(-1, keepdim=True)), None

    def solve_feedback(self, f, q_b, feedback_keys, gate, b_rows, shared, old, token_mask):
        """(I - B) y = f for the new tokens, f = A V (B, H, T, d): B's rows from the B-branch queries (B, H, T, d),
        the keys of the new and the cached positions, the gate (B, H, T) and the support rows (``shared``: one table
        for every sequence); the past outputs from the cache ``old``. Returns y (B H, T, d) in the compute dtype."""
        batch, heads, groups, kv_heads = f.shape[0], self.num_heads, self.num_key_value_groups, self.num_key_value_heads
        cd = f.dtype
        past_keys = None if old is None else old.feedback_keys.transpose(1, 2)  # (B, Hkv, M, d)
        past_outputs = None if old is None else old.outputs.transpose(1, 2)  # (B, H, M, d)
        fold_past = (lambda x, g: None if x is None else _fold(x, g))
        if self.pattern == "dense":
            key_mask = None if token_mask is None else token_mask.repeat_interleave(heads, 0)
            return feedback_solve(_fold(f, 1), _fold(q_b, 1).to(cd), _fold(feedback_keys, groups).to(cd),
                                  gate.flatten(0, 1), key_mask=key_mask, past_k=fold_past(past_keys, groups),
                                  past_s=fold_past(past_outputs, 1), scale=self.scaling,
                                  method=self.config.gltm_solver, chunk_size=self.config.gltm_chunk_size,
                                  backend=self.config.kernel_backend)
        if self.config.gltm_solver == "dense":  # the reference: masked T x T matrices, one solve
            return feedback_solve_sparse(_fold(f, 1), _fold(q_b, 1).to(cd), _fold(feedback_keys, groups).to(cd),
                                         gate.flatten(0, 1), _per_head(b_rows, batch, heads, shared),
                                         past_k=fold_past(past_keys, groups), past_s=fold_past(past_outputs, 1),
                                         scale=self.scaling, method="dense")
        # B's entries from keys gathered once per KV head, gated, then the block substitution
        keys_all = feedback_keys if past_keys is None else torch.cat([past_keys, feedback_keys], dim=2)
        gain = gate.unflatten(1, (kv_heads, groups)).transpose(2, 3).flatten(0, 1)
        weights = gathered_softmax(_by_kv_head(q_b, groups), keys_all.flatten(0, 1),
                                   _per_head(b_rows, batch, kv_heads, shared), self.scaling, gain=gain,
                                   backend=self.config.kernel_backend)  # (B Hkv, T, g, K)
        return sparse_solve(_fold(f, 1), _from_kv_head(weights, batch).flatten(0, 1),
                            _per_head(b_rows, batch, heads, shared), fold_past(past_outputs, 1),
                            self.config.gltm_chunk_size, self.config.kernel_backend)

    def input_scale(self, hidden_states, gate):
        """The diagonal factor on the A-branch output, and what weight sharing subtracts afterwards: (1 - g, None);
        the Mamba rule's (Δ b, None); weight sharing's (d + d', d) (Eq. 26: z = (I - B)^-1 (d + d') x, y = z - d x).
        All (B, H, T)."""
        cd = gate.dtype
        if self.mamba_rule:
            delta = F.softplus(self.dt_proj(hidden_states).to(cd))
            return (delta * self.b_proj(hidden_states).to(cd)).transpose(1, 2), None
        if self.weight_sharing:
            d, d_prime = self.share_proj(hidden_states).to(cd).transpose(1, 2).chunk(2, dim=1)
            return d + d_prime, d
        return 1.0 - gate, None

    def rows_name(self, length: int) -> tuple:
        """What ``shared_rows`` depends on: the pattern, its options, whether A is diagonal (no A rows) and the
        length."""
        return ("gltm", self.pattern, self.window, self.config.gltm_offsets, self.diagonal_a, length)

    def shared_rows(self, length: int, device) -> tuple:
        """The A- and B-support of positions 1..T as rows of the T tokens (-1: none), (1, T, Ka) and (1, T, K) (the
        A rows None with a diagonal A): the same for every call of that length, so built once (shape_constant)."""
        def build():
            positions = torch.arange(1, length + 1, device=device)[None]
            b_rows = support_rows(self.pattern, positions, self.window, self.offsets, length) - 1
            return None if self.diagonal_a else self.a_support(positions, length) - 1, b_rows

        return shape_constant((*self.rows_name(length), str(device)), build)

    def a_support(self, positions, longest=None):
        """1-based positions of each token's A-support (B, T, Ka), 0 for none: {i} ∪ P(i), the window for local, {i}
        for ssm (spec X1, X9, X10); ``longest`` bounds the positions (``support_rows``)."""
        if self.pattern == "local":
            rows = positions[..., None] - torch.arange(self.window, device=positions.device)
            return rows.where((rows > 0) & (positions[..., None] > 0), 0)
        if self.pattern == "ssm":
            return positions[..., None]
        return torch.cat([positions[..., None], support_rows(self.pattern, positions, self.window, self.offsets,
                                                             longest)], -1)

    def update_cache(self, layer, key, value, feedback_keys, outputs, positions):
        """Append the new tokens' entries (their K/V only with a diagonal A: the attention paths appended theirs
        before attending); evict what no future token reads (the patterns in EVICTING)."""
        if self.diagonal_a:
            layer.update(key, value)
        if self.recurrent:  # (B, heads, T, d) -> (B, T, heads, d); y kept in the compute dtype (fp32 for bf16)
            layer.append_extras(feedback_keys.transpose(1, 2), outputs.transpose(1, 2), positions)
        else:  # B = 0: no past output is ever read
            empty = key.new_zeros(*positions.shape, 0)
            layer.append_extras(empty, empty.to(outputs.dtype), positions)
        layer.seen_tokens += positions.shape[1]
        if self.pattern in EVICTING:
            layer.keep(self.still_read(layer.positions))

    def still_read(self, positions, longest=None):
        """Which cached 1-based ``positions`` (B, M) the next token of each row reads (B, M): its A-support but
        itself for ``local``, its B-support for the recurrent patterns; what is not read is never read again."""
        following = positions.max(dim=1).values[:, None] + 1  # (B, 1): the next token of each row
        needed = self.read_by(following, longest)  # (B, K)
        return (positions[..., None] == needed[:, None, :]).any(-1) & (positions > 0)

    def read_by(self, following, longest=None):
        """The cached 1-based positions (B, K; 0: none) that the token at ``following`` (B, 1) reads: its A-support
        but itself for ``local``, its B-support for the recurrent patterns."""
        if not self.recurrent:
            return self.a_support(following, longest)[:, 0]
        return support_rows(self.pattern, following, self.window, self.offsets, longest)[:, 0]


def _by_kv_head(x, groups):
    """Queries (B, H, T, d) -> (B Hkv, T, g, d): the g query heads that share a KV head side by side."""
    batch, heads, length, width = x.shape
    return x.view(batch, heads // groups, groups, length, width).permute(0, 1, 3, 2, 4).flatten(0, 1)


def _from_kv_head(x, batch):
    """(B Hkv, T, g, ...) -> (B, H, T, ...), the inverse of ``_by_kv_head``."""
    x = x.unflatten(0, (batch, -1)).transpose(2, 3)  # (B, Hkv, g, T, ...)
    return x.flatten(1, 2)


def _per_head(rows, batch, heads, shared):
    """Support rows (B, T, K) -> (B heads, T, K), each sequence's rows for each of its heads; ``shared`` rows
    (1, T, K), the same for every sequence, as a broadcast view."""
    return rows.expand(batch * heads, -1, -1) if shared else rows.repeat_interleave(heads, 0)


def _fold(x, groups):
    """(B, heads, T, d) -> (B H, T, d), KV heads repeated ``groups`` times to the query heads."""
    if groups > 1:
        x = x.repeat_interleave(groups, dim=1)
    return x.flatten(0, 1)


class _Lookup:
    """1-based positions -> row indices into the [kept, new] rows of each batch row (-1 for none)."""

    def __init__(self, all_positions, longest):
        """``longest`` >= every position: the table's size comes from the shapes, not from a host read."""
        batch = all_positions.shape[0]
        self.table = all_positions.new_full((batch, longest + 2), -1)
        rows = torch.arange(all_positions.shape[1], device=all_positions.device).expand(batch, -1)
        real = all_positions > 0
        self.table.scatter_(1, all_positions.where(real, self.table.shape[1] - 1), rows.where(real, -1))
        self.table[:, -1] = -1  # the dump slot of padding

    def __call__(self, rows):
        """rows (B, T, K) of 1-based positions (0: none) -> (B, T, K) indices (-1: none)."""
        found = self.table.gather(1, rows.flatten(1).clamp(max=self.table.shape[1] - 1)).view(rows.shape)
        return found.where(rows > 0, -1)


def _compact(keep, count, tensors):
    """The entries where ``keep`` (B, M) is True, in order, at ``count`` per row (at least the most a row keeps):
    rows with fewer get empty entries in front, zeros (position 0). ``tensors``: (x, the dimension of M in x)."""
    order = torch.where(keep, torch.arange(keep.shape[1], device=keep.device), -1).sort(dim=1).values
    index = order[:, keep.shape[1] - count:]  # (B, count), -1 where the row has fewer
    empty = index < 0
    index = index.clamp(min=0)
    return tuple(_entries(x, dim, index).masked_fill(_per_entry(empty, x, dim), 0) for x, dim in tensors)


def _per_entry(index, x, dim):
    """``index`` (B, K) viewed to broadcast over ``x`` with its entries on ``dim``."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    return index.view(shape)


def _entries(x, dim, index):
    """The entries of ``x`` (B, ..., M on ``dim``, ...) at ``index`` (B, K) of each row: (B, ..., K, ...)."""
    return x.gather(dim, _per_entry(index, x, dim).expand(*[s if d != dim else index.shape[1]
                                                             for d, s in enumerate(x.shape)]))


@dataclass
class GLTMState:
    """An evicting pattern's cache at a fixed number of slots S (``GLTMMixer.mix``): kA, v (B, Hkv, S, d), kB
    (B, S, Hkv, d), y (B, S, H, d), the entries' 1-based positions (B, S; 0 = empty) and the real tokens seen (B, 1)."""

    keys: torch.Tensor
    values: torch.Tensor
    feedback_keys: torch.Tensor
    outputs: torch.Tensor
    positions: torch.Tensor
    seen: torch.Tensor


class GLTMCacheLayer(KVPlusLayer):
    """For each kept position: kA, v (B, Hkv, M, d) as the K/V, kB (B, M, Hkv, d), y (B, M, H, d) fp32 and the
    1-based position (B, M; 0 = an empty slot of a shorter row). Counts every token seen, kept or not."""

    _layer_type = "gltm"
    extra_names = ("feedback_keys", "outputs", "positions")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen_tokens = 0

    def keep(self, keep):
        """Keep the entries where ``keep`` (B, M) is True, in order; rows with fewer get empty slots in front."""
        self.keys, self.values, self.feedback_keys, self.outputs, self.positions = _compact(
            keep, int(keep.sum(1).max()), ((self.keys, 2), (self.values, 2), (self.feedback_keys, 1),
                                           (self.outputs, 1), (self.positions, 1)))
        self.buffers = {}  # the appends' buffers, now replaced

    def reserve(self, slots: int) -> None:
        """At least ``slots`` entries, empty ones (position 0) in front: the fixed shape of a compiled decode step."""
        missing = slots - self.positions.shape[1]
        if missing > 0:
            def pad(x, dim):
                shape = list(x.shape)
                shape[dim] = missing
                return torch.cat([x.new_zeros(shape), x], dim=dim)

            self.keys, self.values = pad(self.keys, 2), pad(self.values, 2)
            self.feedback_keys, self.outputs = pad(self.feedback_keys, 1), pad(self.outputs, 1)
            self.positions = pad(self.positions, 1)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove and self.keys is not None and self.keys.shape[-2] != self.seen_tokens:
            raise ValueError("GLTM cache: this pattern evicted positions, so the cache cannot drop tokens (crop)")
        super().crop(tokens_to_remove)
        self.seen_tokens = self.keys.shape[-2] if self.keys is not None else 0


def _validate(config) -> str | None:
    pattern = config.gltm_pattern
    if pattern.startswith("custom"):
        try:
            offsets_below(offset_function(pattern, config.gltm_offsets), 64)
        except ValueError as error:
            return f"gltm_offsets: {error}"
    elif config.gltm_offsets is not None:
        return f"gltm_offsets is only read by the custom patterns, not {pattern!r}"
    if config.gltm_ssm_rule == "mamba" and pattern != "ssm":
        return f"gltm_ssm_rule='mamba' is the ssm pattern's alternative parametrisation, not {pattern!r}'s"
    if config.gltm_weight_sharing and pattern not in RECURRENT:
        return f"gltm_weight_sharing ties A to B, and the {pattern!r} pattern has no B"
    if config.gltm_weight_sharing and config.gltm_ssm_rule == "mamba":
        return "gltm_weight_sharing and gltm_ssm_rule='mamba' are two different parametrisations: choose one"
    if config.gltm_gate == "fixed" and not 0.0 <= config.gltm_gate_value <= 1.0:
        return f"gltm_gate_value must lie in [0, 1], got {config.gltm_gate_value}"
    return None


def _offsets_spec(value) -> str | None:
    return None if value is None or isinstance(value, str) else "must be 'pow:b' or 'poly:p,c' (or None)"


GLTM = register_mixer(MixerSpec(
    name="gltm", mixer_class=GLTMMixer, title="GLTM",
    summary="generalized linear token mixing: attention over a sparse pattern plus a second attention over past "
            "outputs, solved as Y = (I - B)^-1 A V; log-size decode caches with the cache-efficient patterns",
    paper="Trading Complexity for Expressivity Through Structured Generalized Linear Token Mixing (Fagnou, Caillon, "
          "Delattre, Allauzen)",
    options=(
        MixerOption("gltm_pattern", "pow2_ce", "the sparsity pattern: " + ", ".join(PATTERNS), one_of(*PATTERNS)),
        MixerOption("gltm_bandwidth", 8, "w of the local and banded patterns (local: w tokens including the current "
                    "one; banded: w past outputs)", positive_int),
        MixerOption("gltm_offsets", None, "the offset function of custom / custom_ce: 'pow:b' (b^k) or 'poly:p,c' "
                    "(k^p + c); f(0) must be 1 and f strictly increasing", _offsets_spec),
        MixerOption("gltm_gate", "mamba2", "the gate g: 'mamba2' (exp(-softplus(dt) exp(A_log))), 'sigmoid', or "
                    "'fixed' (gltm_gate_value)", one_of(*GATES)),
        MixerOption("gltm_gate_value", 0.5, "g of the fixed gate", number),
        MixerOption("gltm_weight_sharing", False, "tie A to B (A = B D + D', the paper's §B.3): no A-branch "
                    "attention, the cache keeps kB and z only; d, d' per token and head", boolean),
        MixerOption("gltm_ssm_rule", "attention", "the ssm pattern's parametrisation: 'attention' (the gate) or "
                    "'mamba' (y = exp(Δ a) y_prev + Δ b x, the paper's Table 2)", one_of("attention", "mamba")),
        MixerOption("gltm_solver", "chunked", "'chunked' (block forward substitution) or 'dense' (the reference: "
                    "masked T x T matrices and one triangular solve)", one_of("chunked", "dense")),
        MixerOption("gltm_chunk_size", 64, "rows per block of the chunked solve", positive_int),
    ),
    validate=_validate, cache_layer=GLTMCacheLayer, attention_mask="causal",
    keep_in_fp32=("A_log",),
    limitations=("GLTM layers read a sparse set of past positions: the translation-invariant and dense patterns "
                 "keep a cache that grows with the context; the cache-efficient ones keep O(log T) (pow2_ce) or "
                 "O(sqrt T) (quad_ce) positions.",),
    sliding_note="the mixer's pattern replaces the window (identical up to that length only for dense)",
    tiny_options={"gltm_chunk_size": 4, "gltm_bandwidth": 3},
    tiny_variants={pattern: {"gltm_pattern": pattern} for pattern in PATTERNS if pattern not in ("pow2_ce",)
                   and not pattern.startswith("custom")} | {
        "custom_ce": {"gltm_pattern": "custom_ce", "gltm_offsets": "pow:3"},
        "custom": {"gltm_pattern": "custom", "gltm_offsets": "poly:2,1"},
        "sigmoid": {"gltm_gate": "sigmoid"}, "fixed": {"gltm_gate": "fixed", "gltm_gate_value": 0.3},
        "weight_sharing": {"gltm_weight_sharing": True},
        "dense_weight_sharing": {"gltm_pattern": "dense", "gltm_weight_sharing": True},
        "ssm_mamba": {"gltm_pattern": "ssm", "gltm_ssm_rule": "mamba"}}))
