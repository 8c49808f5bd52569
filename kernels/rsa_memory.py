"""RSA memory (shared/specs/rsa.md §4.3, §5.2): the exact token recurrence and its chunk-parallel form.

Per KV head, ``L`` levels of ``m`` slots. The state is kept as mass-weighted sums and normalised only when read:

    key_sum   (B, G, L, m, d)   sum_t f_t k_t                 -> key slots   SK = (kappa P + key_sum) / (kappa + mass)
    value_sum (B, G, L, m, dv)  sum_t f_t v_t                 -> value slots SV = value_sum / mass
    mass      (B, G, L, m)      sum_t f_t
    relation_sum (B, G, L-1, m, m)  sum_t f_t^(i) f_t^(i+1)^T -> R = relation_sum / mass^(i)
    key_ref, value_ref (B, G, L, m, d|dv)   SK, SV at the last chunk boundary (assignments and residuals use them)
    count     (B,)              real tokens written; the references refresh whenever it reaches a multiple of C

Writing token t at level i: f = softmax(beta * tau * x_k . key_ref^T) (or sigmoid), zero for padding; the next
level gets x_k <- MLP_K(x_k - p @ key_ref), x_v <- MLP_V(x_v - p @ value_ref) with p = f (softmax) or the softmax
of the same scores (sigmoid). Reading with query q (per query head) against the inclusive state:
    act_i = sigmoid(tau q.SK_i) | softmax(tau q.SK_i [+ log mass_0 at level 0])      (readout "sigmoid" | "softmax_count")
    atil_i = w_a relu(act_i @ W_i - theta_i) + theta_i / m
    chain_i = atil_0 (i = 0) | (chain_{i-1} @ R_{i-1}) * atil_i (relation) | chain_{i-1} * atil_i | atil_i (none)
    a_i = chain_i @ W_r_i;   o = sum_i a_i @ SV_i / max(sum_i sum(|a_i|), eps)   [+ sum_i (q @ W_qr_i / 16) @ SV_i]

The normaliser is the total *absolute* read weight (spec §12 item 13: W and W_r are unconstrained, so a can turn
negative). With the signed sum it can pass through zero while the numerator does not, and the output explodes:
seen in a 200-step SmolLM2 distillation (a stage-1 relative MSE of 1.5e6 at one step, stage 2 diverging). With
|a| the output is bounded by the largest value slot; while a >= 0 (at init) the two are identical.

Optional decay (GLA-style, ``log_decay`` (B, G, T) <= 0): before token t writes, the data sums (key/value sums,
mass, relations) are multiplied by exp(log_decay_t); the prototype prior never decays, padding never decays.

Because the state is sums, the token recurrence (``rsa_recurrent``, also the decode step) and the chunk form
(``rsa_chunked``) compute the same function: assignments inside a chunk use the references, everything else is a
causal cumulative sum. Chunk boundaries count each row's real tokens, so a padded row equals the sequence alone.
Everything runs in fp32 (fp64 stays fp64).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .feedback_solve import compute_dtype

logger = logging.getLogger(__name__)


@dataclass
class ResidualMLPWeights:
    """x + down(silu(up(x))) from plain tensors, so a compiled step sees tensors (graph inputs), not modules."""

    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor

    def __call__(self, x):
        hidden = F.silu(F.linear(x, self.up_weight, self.up_bias))
        return x + F.linear(hidden, self.down_weight, self.down_bias)


@dataclass
class RSAParams:
    """The tensors and options one layer's memory needs (built by the mixer from its parameters)."""

    prototypes: torch.Tensor  # (G, L, m, d) initial key slots P
    kappa: torch.Tensor  # (G, L) pseudo-count of P, >= 0
    beta: torch.Tensor  # (G, L) assignment inverse temperature
    key_mlps: list[Callable]  # L - 1 maps d -> d
    value_mlps: list[Callable]  # L - 1 maps dv -> dv
    read_proj: torch.Tensor  # W   (H, L, m, m)
    mix_proj: torch.Tensor  # W_r (H, L, m, m)
    threshold: torch.Tensor  # theta = 1/z, (H, L), already clamped
    read_scale: torch.Tensor  # w_a (H, L)
    query_read: torch.Tensor | None  # W_qr (H, L, d, m), the RSA-q branch
    assign_fn: str = "softmax"  # softmax | sigmoid
    readout: str = "sigmoid"  # sigmoid | softmax_count
    routing: str = "relation"  # relation | elementwise | none
    chunk_size: int = 64
    eps: float = 1e-6
    recompute: bool = False  # training: keep only chunk inputs, recompute each chunk in the backward pass
    compile_step: bool = False  # decoding: run the token step through torch.compile (one fused graph)


@dataclass
class RSAState:
    key_sum: torch.Tensor
    value_sum: torch.Tensor
    mass: torch.Tensor
    relation_sum: torch.Tensor
    key_ref: torch.Tensor
    value_ref: torch.Tensor
    count: torch.Tensor

    def map(self, fn) -> "RSAState":
        """Apply ``fn`` to every tensor (batch selection, beam reordering, device moves)."""
        return RSAState(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in fields(self)))


def initial_state(params: RSAParams, batch: int, value_dim: int, dtype: torch.dtype) -> RSAState:
    groups, levels, slots, key_dim = params.prototypes.shape
    prototypes = params.prototypes.to(dtype).expand(batch, -1, -1, -1, -1)
    zeros = prototypes.new_zeros
    return RSAState(key_sum=torch.zeros_like(prototypes), value_sum=zeros(batch, groups, levels, slots, value_dim),
                    mass=zeros(batch, groups, levels, slots),
                    relation_sum=zeros(batch, groups, max(levels - 1, 0), slots, slots),
                    key_ref=prototypes, value_ref=zeros(batch, groups, levels, slots, value_dim),
                    count=torch.zeros(batch, dtype=torch.long, device=prototypes.device))


def _assign(x_k, key_ref, beta, params, tau):
    """Slot assignment f (written mass) and residual weights p, both (..., m). x_k (..., R, d), key_ref (..., m, d)."""
    scores = tau * torch.matmul(x_k, key_ref.transpose(-1, -2))
    if params.assign_fn == "softmax":
        f = torch.softmax(beta * scores, dim=-1)
        return f, f
    return torch.sigmoid(beta * scores), torch.softmax(scores, dim=-1)


def _activation(x, level, mass, params):
    """Readout activation of ``x = tau q.SK`` (..., m); ``mass`` broadcastable to it (level 0 count prior)."""
    if params.readout == "sigmoid":
        return torch.sigmoid(x)
    if level == 0:
        x = x + torch.log(mass.clamp_min(params.eps))
    return torch.softmax(x, dim=-1)


def _per_head(tensor, groups):
    """(H, ...) -> (G, g, ...) so that query head h reads KV head h // g."""
    return tensor.unflatten(0, (groups, -1))


def _prior(params: RSAParams, dtype):
    """kappa * P (1, G, L, m, d) and kappa (1, G, L, 1): the non-decaying pseudo-observations of the key slots."""
    kappa = params.kappa.to(dtype)[None, :, :, None]
    return kappa[..., None] * params.prototypes.to(dtype)[None], kappa


def _refresh(state: RSAState, params: RSAParams, rows) -> RSAState:
    """Set the references to the current slots for the batch rows in ``rows`` (bool (B,))."""
    if not torch.compiler.is_compiling() and not bool(rows.any()):
        return state  # most decode steps: no row is at a boundary (one host sync saves the work; not when compiled)
    prior, kappa = _prior(params, state.mass.dtype)
    key_now = (prior + state.key_sum) / (kappa + state.mass).clamp_min(params.eps)[..., None]
    value_now = state.value_sum / state.mass.clamp_min(params.eps)[..., None]
    where = rows[:, None, None, None, None]
    return replace(state, key_ref=torch.where(where, key_now, state.key_ref),
                   value_ref=torch.where(where, value_now, state.value_ref))


def rsa_step(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """One token: q (B, G, g, d), k (B, G, d), v (B, G, dv), valid (B,) bool, log_decay (B, G) or None
    -> o (B, G, g, dv), new state."""
    groups, levels, slots, key_dim = params.prototypes.shape
    tau = key_dim**-0.5
    eps = params.eps
    prior, kappa = _prior(params, k.dtype)  # (1, G, L, m, d), (1, G, L, 1)
    write = valid.to(k.dtype)[:, None, None]
    if log_decay is not None:  # decay the data sums before this token writes (never on padding)
        decay = torch.exp(log_decay.to(k.dtype) * write[..., 0])  # (B, G)
        state = replace(state, key_sum=state.key_sum * decay[:, :, None, None, None],
                        value_sum=state.value_sum * decay[:, :, None, None, None],
                        mass=state.mass * decay[:, :, None, None],
                        relation_sum=state.relation_sum * decay[:, :, None, None, None])
    x_k, x_v = k, v
    key_sum, value_sum, mass, assignments = [], [], [], []
    for i in range(levels):
        key_ref, value_ref = state.key_ref[:, :, i], state.value_ref[:, :, i]
        f, p = _assign(x_k[:, :, None], key_ref, params.beta[None, :, i, None, None].to(k.dtype), params, tau)
        f, p = f[:, :, 0] * write, p[:, :, 0]  # (B, G, m)
        assignments.append(f)
        mass.append(state.mass[:, :, i] + f)
        key_sum.append(state.key_sum[:, :, i] + f[..., None] * x_k[:, :, None])
        value_sum.append(state.value_sum[:, :, i] + f[..., None] * x_v[:, :, None])
        if i < levels - 1:
            x_k = params.key_mlps[i](x_k - torch.einsum("bgm,bgmd->bgd", p, key_ref))
            x_v = params.value_mlps[i](x_v - torch.einsum("bgm,bgmd->bgd", p, value_ref))
    relation = [state.relation_sum[:, :, i] + assignments[i][..., :, None] * assignments[i + 1][..., None, :]
                for i in range(levels - 1)]
    state = RSAState(key_sum=torch.stack(key_sum, 2), value_sum=torch.stack(value_sum, 2), mass=torch.stack(mass, 2),
                     relation_sum=torch.stack(relation, 2) if relation else state.relation_sum,
                     key_ref=state.key_ref, value_ref=state.value_ref, count=state.count + valid.long())
    state = _refresh(state, params, valid & (state.count % params.chunk_size == 0))

    # Read: every level at once (slots, scores, activation, W, sparse threshold), then the chain down the levels.
    slots_k = (prior + state.key_sum) / (kappa + state.mass).clamp_min(eps)[..., None]  # (B, G, L, m, d)
    slots_v = state.value_sum / state.mass.clamp_min(eps)[..., None]  # (B, G, L, m, dv)
    x = tau * torch.einsum("bghd,bglmd->bghlm", q, slots_k)
    if params.readout == "sigmoid":
        act = torch.sigmoid(x)
    else:  # count prior on level 0 only
        prior = torch.zeros_like(x[:1, :, :1])
        prior[..., 0, :] = 1.0
        act = torch.softmax(x + prior * torch.log(state.mass.clamp_min(eps))[:, :, None], dim=-1)
    threshold = _per_head(params.threshold, groups)[None, ..., None]  # (1, G, g, L, 1)
    sparse = _per_head(params.read_scale, groups)[None, ..., None] * torch.relu(
        torch.einsum("bghlm,ghlmn->bghln", act, _per_head(params.read_proj, groups)) - threshold) + threshold / slots
    chains = [sparse[:, :, :, 0]]
    for i in range(1, levels):
        if params.routing == "relation":
            relation_i = state.relation_sum[:, :, i - 1] / state.mass[:, :, i - 1].clamp_min(eps)[..., None]
            chains.append(torch.einsum("bghm,bgmn->bghn", chains[-1], relation_i) * sparse[:, :, :, i])
        elif params.routing == "elementwise":
            chains.append(chains[-1] * sparse[:, :, :, i])
        else:
            chains.append(sparse[:, :, :, i])
    a = torch.einsum("bghlm,ghlmn->bghln", torch.stack(chains, 3), _per_head(params.mix_proj, groups))
    out = torch.einsum("bghlm,bglmd->bghd", a, slots_v) / a.abs().sum((-1, -2)).clamp_min(eps)[..., None]
    if params.query_read is not None:
        weights = torch.einsum("bghd,ghldm->bghlm", q, _per_head(params.query_read, groups)) / 16
        out = out + torch.einsum("bghlm,bglmd->bghd", weights, slots_v)
    return out, state


def rsa_recurrent(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """Reference: the token recurrence over T steps. q (B, G, g, T, d), k (B, G, T, d), v (B, G, T, dv),
    log_decay (B, G, T) or None."""
    if valid is None:
        valid = torch.ones(q.shape[0], q.shape[3], dtype=torch.bool, device=q.device)
    outputs = []
    for t in range(q.shape[3]):
        out, state = rsa_step(q[:, :, :, t], k[:, :, t], v[:, :, t], valid[:, t], state, params,
                              None if log_decay is None else log_decay[:, :, t])
        outputs.append(out * valid[:, t, None, None, None])
    return torch.stack(outputs, 3), state


def _chunk(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """One aligned chunk (spec §5.2): q (B, G, g, C, d), k (B, G, C, d), v (B, G, C, dv), valid (B, C),
    log_decay (B, G, C) or None.

    ``carry[t, s]`` weighs what row s wrote as seen by row t: the inclusive causal mask, times the decay in between
    (exp(Lambda_t - Lambda_s)); ``start[t]`` is how much of the chunk-start state row t still sees.
    """
    groups, levels, slots, key_dim = params.prototypes.shape
    tau, eps, size = key_dim**-0.5, params.eps, q.shape[3]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # inclusive: token t reads itself
    prior, kappa = _prior(params, k.dtype)
    write = valid.to(k.dtype)[:, None, :, None]  # (B, 1, C, 1)
    if log_decay is None:
        carry, start = causal.to(k.dtype), torch.ones(1, 1, size, dtype=k.dtype, device=k.device)
    else:
        total = (log_decay.to(k.dtype) * write[..., 0]).cumsum(-1)  # Lambda_t (B, G, C), padding never decays
        gap = (total[..., :, None] - total[..., None, :]).masked_fill(~causal, float("-inf"))
        carry, start = torch.exp(gap), torch.exp(total)  # (B, G, C, C), (B, G, C)
    carry_q = carry if carry.dim() == 2 else carry[:, :, None]  # broadcast over the query heads of a KV group
    start_q = start[:, :, None, :, None]  # (B|1, G|1, 1, C, 1): per row, broadcast over query heads

    x_k, x_v = k, v
    assignments, keys, values, running_mass = [], [], [], []
    for i in range(levels):  # write side: assignments against the references, levels in order
        key_ref, value_ref = state.key_ref[:, :, i], state.value_ref[:, :, i]
        f, p = _assign(x_k, key_ref, params.beta[None, :, i, None, None].to(k.dtype), params, tau)
        f = f * write  # (B, G, C, m)
        assignments.append(f)
        keys.append(x_k)
        values.append(x_v)
        running_mass.append(start[..., None] * state.mass[:, :, i, None] + carry @ f)  # N: inclusive mass
        if i < levels - 1:
            x_k = params.key_mlps[i](x_k - p @ key_ref)
            x_v = params.value_mlps[i](x_v - p @ value_ref)

    def causal_read(weights, level):
        """weights (B, G, g, C, m) @ (sum-state_0 + causal sum f v) / mass: the value read of the inclusive slots."""
        scaled = weights / running_mass[level][:, :, None].clamp_min(eps)
        intra = (scaled @ assignments[level][:, :, None].transpose(-1, -2)) * carry_q
        return (scaled * start_q) @ state.value_sum[:, :, level, None] + intra @ values[level][:, :, None]

    read_proj, mix_proj = _per_head(params.read_proj, groups), _per_head(params.mix_proj, groups)
    threshold, read_scale = _per_head(params.threshold, groups), _per_head(params.read_scale, groups)
    numerator, denominator, chain = 0.0, 0.0, None
    for i in range(levels):
        f = assignments[i][:, :, None]  # (B, G, 1, C, m)
        q_dot_k = (q @ keys[i][:, :, None].transpose(-1, -2)) * carry_q  # (B, G, g, C, C)
        x = tau * (q @ prior[:, :, i, None].transpose(-1, -2) + start_q * (q @ state.key_sum[:, :, i, None]
                                                                          .transpose(-1, -2)) + q_dot_k @ f) \
            / (kappa[:, :, i, None, None] + running_mass[i][:, :, None]).clamp_min(eps)
        act = _activation(x, i, running_mass[i][:, :, None], params)
        sparse = read_scale[None, :, :, i, None, None] * torch.relu(
            act @ read_proj[None, :, :, i] - threshold[None, :, :, i, None, None]) \
            + threshold[None, :, :, i, None, None] / slots
        if i == 0 or params.routing == "none":
            chain = sparse
        elif params.routing == "relation":  # chain @ R_t with R_t the inclusive relation matrix of each row
            scaled = chain / running_mass[i - 1][:, :, None].clamp_min(eps)
            intra = (scaled @ assignments[i - 1][:, :, None].transpose(-1, -2)) * carry_q
            chain = ((scaled * start_q) @ state.relation_sum[:, :, i - 1, None] + intra @ f) * sparse
        else:
            chain = chain * sparse
        a = chain @ mix_proj[None, :, :, i]
        numerator = numerator + causal_read(a, i)
        denominator = denominator + a.abs().sum(-1)  # total absolute weight: bounded output (module docstring)
    out = numerator / denominator.clamp_min(eps)[..., None]
    if params.query_read is not None:
        query_read = _per_head(params.query_read, groups)
        for i in range(levels):
            out = out + causal_read(q @ query_read[None, :, :, i] / 16, i)

    end = carry[..., -1, :, None]  # (.., C, 1): what each row's write still weighs at the chunk end
    keep = start[..., -1].reshape(*start.shape[:-1], 1, 1, 1) if start.dim() == 3 else 1.0  # decay of the old state
    carried = RSAState(
        key_sum=keep * state.key_sum + torch.stack([(a * end).transpose(-1, -2) @ x
                                                    for a, x in zip(assignments, keys)], 2),
        value_sum=keep * state.value_sum + torch.stack([(a * end).transpose(-1, -2) @ x
                                                        for a, x in zip(assignments, values)], 2),
        mass=torch.stack([m[:, :, -1] for m in running_mass], 2),
        relation_sum=keep * state.relation_sum + torch.stack(
            [(assignments[i] * end).transpose(-1, -2) @ assignments[i + 1] for i in range(levels - 1)], 2)
        if levels > 1 else state.relation_sum,
        key_ref=state.key_ref, value_ref=state.value_ref, count=state.count)
    return out, carried


@dataclass
class ChunkLayout:
    """Each row's real tokens packed into an aligned buffer at offset ``count % C`` (the row's phase), so every
    row's chunk boundaries fall on multiples of C in the buffer whatever its padding or cached length. Shared by the
    PyTorch chunk form and the Triton one (kernels/rsa_chunk_triton.py)."""

    phase: torch.Tensor  # (B,) buffer offset of each row's first new token
    real: torch.Tensor  # (B,) real tokens of each row in this call
    padded: int  # buffer length, a multiple of C
    rows: torch.Tensor  # (N,) row and time of every real token ...
    times: torch.Tensor
    slots: torch.Tensor  # (N,) ... and its buffer position

    @classmethod
    def of(cls, valid: torch.Tensor, count: torch.Tensor, size: int) -> "ChunkLayout":
        phase, real = count % size, valid.sum(1)
        span = int((phase + real).max().item()) if valid.shape[1] else 0
        rows, times = valid.nonzero(as_tuple=True)
        slots = phase[rows] + valid.long().cumsum(1)[rows, times] - 1
        return cls(phase, real, math.ceil(span / size) * size, rows, times, slots)

    def pack(self, x: torch.Tensor, time_dim: int) -> torch.Tensor:
        """Scatter the real tokens of ``x`` (time on ``time_dim``) into the buffer; filler is 0."""
        moved = x.movedim(time_dim, 1)  # time next to batch
        buffer = moved.new_zeros(moved.shape[0], self.padded, *moved.shape[2:])
        return buffer.index_put((self.rows, self.slots), moved[self.rows, self.times]).movedim(1, time_dim)

    def valid(self, batch: int, device) -> torch.Tensor:
        """(B, buffer) True where a real token sits."""
        return torch.zeros(batch, self.padded, dtype=torch.bool, device=device).index_put(
            (self.rows, self.slots), torch.ones_like(self.rows, dtype=torch.bool))

    def unpack(self, out_b: torch.Tensor, length: int) -> torch.Tensor:
        """Buffer outputs (B, G, g, buffer, dv) back to (B, G, g, T, dv); padded positions get 0."""
        moved = out_b.movedim(3, 1)
        out = moved.new_zeros(moved.shape[0], length, *moved.shape[2:])
        return out.index_put((self.rows, self.times), moved[self.rows, self.slots]).movedim(1, 3)


def rsa_chunked(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """Chunk form, equal to ``rsa_recurrent``. Shapes as there; valid (B, T) bool or None.

    Each row's real tokens are packed into an aligned buffer at offset ``count % C`` (its phase), so every row's
    chunk boundaries fall on multiples of C in the buffer whatever its padding or cached length; outputs are
    scattered back (padded positions get 0).
    """
    batch, groups, group_size, length, key_dim = q.shape
    size = params.chunk_size
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=q.device)
    layout = ChunkLayout.of(valid, state.count, size)
    q_b, k_b, v_b = layout.pack(q, 3), layout.pack(k, 2), layout.pack(v, 2)
    decay_b = None if log_decay is None else layout.pack(log_decay[..., None], 2)[..., 0]  # (B, G, T_buffer)
    valid_b = layout.valid(batch, q.device)
    outputs = []
    for start in range(0, layout.padded, size):
        stop = start + size
        inputs = (q_b[:, :, :, start:stop], k_b[:, :, start:stop], v_b[:, :, start:stop], valid_b[:, start:stop],
                  state, params, None if decay_b is None else decay_b[:, :, start:stop])
        if params.recompute and torch.is_grad_enabled():  # memory O(T * state) instead of every intermediate
            out, state = checkpoint(_chunk, *inputs, use_reentrant=False)
        else:
            out, state = _chunk(*inputs)
        outputs.append(out)
        state = _refresh(state, params, layout.phase + layout.real >= stop)  # rows that reached this boundary
    state = replace(state, count=state.count + layout.real)
    out_b = torch.cat(outputs, 3) if outputs else q.new_zeros(batch, groups, group_size, 0, v.shape[-1])
    return layout.unpack(out_b, length), state


def triton_unsupported(params: RSAParams, q, v, log_decay) -> str | None:
    """Why the Triton chunk step cannot run this call (None: it can); imports the kernel module, so triton."""
    from .rsa_chunk_triton import rsa_chunk_triton_supports

    return rsa_chunk_triton_supports(params, q, v, log_decay)


def rsa_memory(q, k, v, valid, state: RSAState, params: RSAParams, method: str = "chunked", log_decay=None):
    """Dispatch: the chunk form for training and prefill, the token step for single-token decoding.

    "triton": the chunk form with its read side in Triton kernels (kernels/rsa_chunk_triton.py); kernels/dispatch.py
    decides when it runs. A single token always takes the token step.
    """
    cd = compute_dtype(q.dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if method == "triton" and q.shape[3] > 1:
        from .rsa_chunk_triton import rsa_chunked_triton  # needs triton: imported only when chosen

        return rsa_chunked_triton(q, k, v, valid, state, params, log_decay)
    method = "chunked" if method == "triton" else method
    if method == "chunked" and q.shape[3] == 1 and params.compile_step:
        valid = torch.ones(q.shape[0], 1, dtype=torch.bool, device=q.device) if valid is None else valid
        # token 0 of each input, contiguous: strides that change with the context length would recompile
        step = [x if x is None else x.select(-2 if x.dim() > 3 else -1, 0).contiguous()
                for x in (q, k, v, valid, log_decay)]
        out, state = compiled_rsa_step()(*step[:4], state, params, step[4])
        return (out * valid[:, 0, None, None, None]).unsqueeze(3), state
    if method == "recurrent" or (method == "chunked" and q.shape[3] == 1):
        return rsa_recurrent(q, k, v, valid, state, params, log_decay)
    if method != "chunked":
        raise ValueError(f"rsa_memory: unknown method {method!r}; choose 'chunked' or 'recurrent'")
    return rsa_chunked(q, k, v, valid, state, params, log_decay)


_compiled_step = None


def compiled_rsa_step():
    """``rsa_step`` through torch.compile (fullgraph, static shapes), built on first use.

    The eager step is ~100 small ops per token and dispatch-bound; compiled, they fuse into a few kernels. Every
    layer of a model shares the compiled graph (params are plain tensors, i.e. graph inputs); the first call
    compiles for 10-20 s on a CPU, so it is opt-in (``rsa_compile_decode``).
    """
    global _compiled_step
    if _compiled_step is None:
        logger.warning("RSA decoding: compiling the token step with torch.compile (rsa_compile_decode=True); "
                       "the first decode step takes 10-20 s")
        _compiled_step = torch.compile(rsa_step, dynamic=False, fullgraph=True)
    return _compiled_step
