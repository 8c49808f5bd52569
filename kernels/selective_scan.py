"""The selective state-space recurrence of S6, S4D, Mamba-2 and Mamba-Δᵀ, in its three forms (one definition).

    h_t = exp(L_t) ⊙ h_{t-1} + u_t ⊗ B_t          y_t = h_t C_t          (h: (H, P, N) per sequence)

Shapes (the canonical layout every caller converts to):
    u          (B, T, H, P)       the write input, already scaled by Δ where the variant says so (Euler: Δ x)
    log_decay  (B, T, H, Pd, Nd)  log of the per-step decay, A Δ <= 0; Pd in {1, P}, Nd in {1, N}, broadcast over
                                  the state: Mamba-2 (1, 1), Mamba-Δᵀ with per-state A (1, N), S6 / S4D (P, N)
    B, C       (B, T, G, N)       G groups of heads (G divides H; head h reads group h // (H / G))
    state      (B, H, P, N)       the state before token 0 (None: zeros)

Forms, equal in fp64 (tests/unit/test_selective_scan.py):
    ssm_recurrent   token by token; the definition, and the decode step (``ssm_step``)
    ssm_chunked     chunks of ``chunk_size`` tokens: the contribution of tokens inside a chunk (intra), the chunk's
                    own state (write), and the state passed between chunks (one cheap step per chunk), read back
                    through the decay since the chunk start. Intra-chunk is a masked matmul, as in SSD (Dao & Gu,
                    2024), when the decay is one scalar per head ("ssd") or one per state slot ("gated": a
                    (chunk, chunk, N) decay tensor); a decay per channel and slot (S6, S4D) would need a
                    (chunk, chunk, P, N) tensor, so there the chunk's tokens are scanned in a loop vectorised over all
                    chunks at once ("scan"): chunk_size + T / chunk_size steps instead of T.
    ssm_factored    the recurrence for log_decay = delta * A given as its factors, with a backward that recomputes
                    states segment by segment: for large per-channel decays, where no form saves work and the
                    (T, H, P, N) tensors autograd would keep are the cost.
    ssm_scan        picks one of them (the layers call it).

States and outputs are computed in fp32 whatever the input dtype (fp64 stays fp64); the output is in that dtype.
Padding is the caller's: a step with u = 0 and log_decay = 0 is an exact no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conventions import compute_dtype, outside_autocast

GATED_CHUNK = 16  # the longest chunk of the per-slot matmul form (fastest on CPU at SmolLM2's shapes)


def _prepare(u, log_decay, B, C, state):
    """Shape checks, heads expanded from groups, compute dtype, zero state."""
    if u.dim() != 4:
        raise ValueError(f"selective scan: u must be (batch, length, heads, head_dim), got {tuple(u.shape)}")
    batch, length, heads, width = u.shape
    for name, x in (("B", B), ("C", C)):
        if x.dim() != 4 or x.shape[:2] != (batch, length) or heads % x.shape[2]:
            raise ValueError(f"selective scan: {name} must be (batch, length, groups, state) with groups dividing "
                             f"{heads} heads, got {tuple(x.shape)} for u {tuple(u.shape)}")
    size = B.shape[-1]
    if C.shape[-1] != size:
        raise ValueError(f"selective scan: B and C state sizes differ: {B.shape[-1]} vs {C.shape[-1]}")
    if log_decay.dim() != 5 or log_decay.shape[:3] != (batch, length, heads) \
            or log_decay.shape[3] not in (1, width) or log_decay.shape[4] not in (1, size):
        raise ValueError(f"selective scan: log_decay must be (batch, length, heads, 1 or {width}, 1 or {size}), got "
                         f"{tuple(log_decay.shape)}")
    if state is not None and tuple(state.shape) != (batch, heads, width, size):
        raise ValueError(f"selective scan: state must be {(batch, heads, width, size)}, got {tuple(state.shape)}")
    dtype = compute_dtype(u.dtype)
    B = B.repeat_interleave(heads // B.shape[2], dim=2) if B.shape[2] != heads else B
    C = C.repeat_interleave(heads // C.shape[2], dim=2) if C.shape[2] != heads else C
    if state is None:
        state = u.new_zeros(batch, heads, width, size, dtype=dtype)
    return u.to(dtype), log_decay.to(dtype), B.to(dtype), C.to(dtype), state.to(dtype)


def ssm_step(state, u, log_decay, B, C):
    """One token: state (B, H, P, N), u (B, H, P), log_decay (B, H, Pd, Nd), B / C (B, H, N) -> y (B, H, P), state."""
    state = torch.exp(log_decay) * state + u[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C), state


def ssm_recurrent(u, log_decay, B, C, state=None):
    """The recurrence token by token -> y (B, T, H, P), final state (B, H, P, N)."""
    u, log_decay, B, C, state = _prepare(u, log_decay, B, C, state)
    outputs = []
    for step in zip(u.unbind(1), log_decay.unbind(1), B.unbind(1), C.unbind(1)):  # unbound once (see _intra_scan)
        y, state = ssm_step(state, *step)
        outputs.append(y)
    return torch.stack(outputs, dim=1), state


def _chunks(x, chunk_size):
    """(B, T, ...) zero-padded to whole chunks -> (B, T / chunk, chunk, ...). Zero u and log decay are no-op steps."""
    pad = (-x.shape[1]) % chunk_size
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.unflatten(1, (-1, chunk_size))


def _causal_decay(cumulative):
    """exp(L_i + ... + L_{j+1}) for j <= i, 0 above: (B, c, L, H, ...) cumulative log decay -> (B, c, L, S, H, ...)."""
    length = cumulative.shape[2]
    gap = cumulative[:, :, :, None] - cumulative[:, :, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=cumulative.device).tril()
    causal = causal.view(1, 1, length, length, *([1] * (gap.dim() - 4)))
    return torch.exp(gap.masked_fill(~causal, float("-inf")))


def _intra_matmul(u, cumulative, B, C):
    """Tokens of the same chunk, as a masked matmul: decay per head (Pd = Nd = 1) or per state slot (Pd = 1)."""
    decay = _causal_decay(cumulative[..., 0, :])  # (B, c, L, S, H, Nd)
    if decay.shape[-1] == 1:
        scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay[..., 0]
    else:
        scores = torch.einsum("bclhn,bcshn,bclshn->bclsh", C, B, decay)
    return torch.einsum("bclsh,bcshp->bclhp", scores, u), None


def _intra_scan(u, log_decay, B, C):
    """Tokens of the same chunk, scanned step by step from a zero state in every chunk at once; returns the chunk
    states too (the scan ends on them). Inputs are unbound once: indexing them per step would make the backward
    fill a full-size zero gradient per step."""
    batch, chunks, length, heads, width = u.shape
    state = u.new_zeros(batch, chunks, heads, width, B.shape[-1])
    outputs = []
    for u_i, decay_i, B_i, C_i in zip(u.unbind(2), torch.exp(log_decay).unbind(2), B.unbind(2), C.unbind(2)):
        state = decay_i * state + u_i[..., None] * B_i[:, :, :, None, :]
        outputs.append(torch.einsum("bchpn,bchn->bchp", state, C_i))
    return torch.stack(outputs, dim=2), state


def _chunk_write(u, B, tail):
    """A chunk's own state, sum_i tail_i * (u_i outer B_i): (B, c, L, ...) -> (B, c, H, P, N)."""
    if tail.shape[-2] == 1:  # the decay folds into B
        return torch.einsum("bclhp,bclhn->bchpn", u, B * tail[..., 0, :])
    return torch.einsum("bclhp,bclhn,bclhpn->bchpn", u, B, tail)


def ssm_chunked(u, log_decay, B, C, state=None, chunk_size: int = 64, intra: str = "auto"):
    """The same recurrence chunk by chunk -> y (B, T, H, P), final state (B, H, P, N).

    ``intra``: "auto" (matmul when the decay is per head, or per slot with P > 1; else the scan), "matmul", "scan".
    """
    u, log_decay, B, C, state = _prepare(u, log_decay, B, C, state)
    length, width = u.shape[1], u.shape[-1]
    if intra == "auto":
        intra = "matmul" if log_decay.shape[3] == 1 and (log_decay.shape[4] == 1 or width > 1) else "scan"
    if intra == "matmul" and log_decay.shape[3] != 1:
        raise ValueError("selective scan: the matmul form needs a decay shared by the head's channels (Pd = 1)")
    if intra == "matmul" and log_decay.shape[4] > 1:
        chunk_size = min(chunk_size, GATED_CHUNK)  # the (chunk, chunk, N) decay tensor grows with the chunk
    u, log_decay, B, C = (_chunks(x, chunk_size) for x in (u, log_decay, B, C))  # (B, c, L, ...)
    cumulative = log_decay.cumsum(2)  # log decay from the chunk start through token i: (B, c, L, H, Pd, Nd)
    total = cumulative[:, :, -1]  # over the whole chunk: (B, c, H, Pd, Nd)
    if intra == "matmul":
        outputs, local = _intra_matmul(u, cumulative, B, C)
        tail = torch.exp(total[:, :, None] - cumulative)  # decay from after token i to the chunk end
        local = _chunk_write(u, B, tail)  # the chunk's own state: (B, c, H, P, N)
    elif intra == "scan":
        outputs, local = _intra_scan(u, log_decay, B, C)
    else:
        raise ValueError(f"selective scan: intra must be 'auto', 'matmul' or 'scan', got {intra!r}")
    starts = []  # the state entering each chunk: one step per chunk (unbound once: a select per chunk would cost a
    for chunk_decay, chunk_write in zip(torch.exp(total).unbind(1), local.unbind(1)):  # full-size gradient each)
        starts.append(state)
        state = chunk_decay * state + chunk_write
    starts = torch.stack(starts, dim=1)  # (B, c, H, P, N)
    decay = torch.exp(cumulative)  # chunk start -> token i
    if decay.shape[3] == 1:
        outputs = outputs + torch.einsum("bclhn,bchpn->bclhp", C * decay[..., 0, :], starts)
    else:
        outputs = outputs + torch.einsum("bclhn,bclhpn,bchpn->bclhp", C, decay, starts)
    return outputs.flatten(1, 2)[:, :length], state


class _FactoredRecurrence(torch.autograd.Function):
    """The recurrence with log_decay = delta * A given as its factors, and a hand-written backward that keeps only
    the state entering each segment of ``segment`` tokens and recomputes the segment's states when it gets there.
    Autograd through ``ssm_recurrent`` keeps every step's (H, P, N) state and decay, T H P N numbers per layer and
    as many for the decay tensor, which is what made S6 / S4D cost gigabytes a layer at long T; this keeps
    T / segment + segment states.

    Gradients, with g_t = dL/dh_t (from y_t, the final state and h_{t+1}) and a_t = exp(delta_t A):
        g_t    = a_{t+1} g_{t+1} + dy_t ⊗ C_t        dC_t = h_t^T dy_t        du_t = g_t B_t        dB_t = g_t^T u_t
        dlog_t = g_t ⊙ h_{t-1} ⊙ a_t  ->  ddelta_t = sum(dlog_t A),  dA = sum_t sum(dlog_t delta_t)  (over broadcasts)
    """

    @staticmethod
    def forward(ctx, u, delta, A, B, C, state, segment):
        outputs, entries = [], []
        for t, step in enumerate(zip(u.unbind(1), delta.unbind(1), B.unbind(1), C.unbind(1))):
            if t % segment == 0:
                entries.append(state)
            u_t, delta_t, B_t, C_t = step
            state = torch.exp(delta_t * A) * state + u_t[..., None] * B_t[:, :, None, :]
            outputs.append(torch.einsum("bhpn,bhn->bhp", state, C_t))
        ctx.save_for_backward(u, delta, A, B, C, *entries)
        ctx.segment = segment
        return torch.stack(outputs, dim=1), state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y, grad_state):
        u, delta, A, B, C, *entries = ctx.saved_tensors
        segment, length = ctx.segment, u.shape[1]
        grads = {name: [None] * length for name in ("u", "delta", "B", "C")}
        grad_A = torch.zeros_like(entries[0])  # sum over t of dlog_t * delta_t, reduced to A's shape at the end
        g = grad_state.clone()
        for index in reversed(range(len(entries))):
            start, stop = index * segment, min(length, (index + 1) * segment)
            states, decays = [entries[index]], []  # h_{start-1} .. h_{stop-1}, and a_start .. a_{stop-1}
            for t in range(start, stop):
                decays.append(torch.exp(delta[:, t] * A))
                states.append(decays[-1] * states[-1] + u[:, t, ..., None] * B[:, t, :, None, :])
            for t in reversed(range(start, stop)):
                here, before, decay = states[t - start + 1], states[t - start], decays[t - start]
                g = g + grad_y[:, t, ..., None] * C[:, t, :, None, :]
                grads["C"][t] = torch.einsum("bhpn,bhp->bhn", here, grad_y[:, t])
                grads["u"][t] = torch.einsum("bhpn,bhn->bhp", g, B[:, t])
                grads["B"][t] = torch.einsum("bhpn,bhp->bhn", g, u[:, t])
                log_grad = g * before * decay
                grads["delta"][t] = (log_grad * A).sum_to_size(delta[:, t].shape)
                grad_A.addcmul_(log_grad, delta[:, t])
                g = decay * g
        stacked = {name: torch.stack(values, dim=1) for name, values in grads.items()}
        return (stacked["u"], stacked["delta"], grad_A.sum_to_size(A.shape), stacked["B"], stacked["C"], g, None)


def ssm_factored(u, delta, A, B, C, state=None, segment: int = 64):
    """The recurrence for log_decay = delta * A without materialising it: delta (B, T, H, Pd, Nd), A (H, Pa, Na)
    broadcasting to the state (H, P, N); other shapes as above -> y (B, T, H, P), final state (B, H, P, N)."""
    if delta.dim() != 5 or A.dim() != 3 or delta.shape[2] != u.shape[2] or A.shape[0] != u.shape[2]:
        raise ValueError(f"selective scan: delta must be (batch, length, heads, Pd, Nd) and A (heads, Pa, Na), got "
                         f"{tuple(delta.shape)} and {tuple(A.shape)} for u {tuple(u.shape)}")
    # checks the shapes of everything else against the decay's broadcast shape (a (1, ..)-strided view, no copy)
    u, _, B, C, state = _prepare(u, torch.broadcast_to(delta[..., :1, :1], delta.shape[:3] + (1, 1)), B, C, state)
    dtype = u.dtype
    delta, A = delta.to(dtype), A.to(dtype)
    sizes = zip(delta.shape[3:], A.shape[1:], state.shape[2:])
    if any(d not in (1, full) or a not in (1, full) for d, a, full in sizes):
        raise ValueError(f"selective scan: delta {tuple(delta.shape)} and A {tuple(A.shape)} do not broadcast to the "
                         f"state {tuple(state.shape)}")
    return _FactoredRecurrence.apply(u, delta, A, B, C, state, segment)


@outside_autocast
def ssm_scan(u, delta, A, B, C, state=None, method: str = "auto", chunk_size: int = 64):
    """The scan for log_decay = delta * A (delta (B, T, H, Pd, Nd), A (H, Pa, Na)), by ``method``: "chunked",
    "recurrent" (the definition), "factored" (the recurrence with a recomputing backward, no (T, H, P, N) tensor), or
    "auto": the recurrence for one token; ``ssm_factored`` for a decay per channel and slot (S6, S4D, Δᵀ with a full
    A) once the state of one step is large (B H P N >= 2^14), where the work is T H P N whatever the form and the
    memory is what matters (docs/benchmarks.md); else the chunked form (over ten times the recurrence's speed at
    the paper's per-channel 32 x 8 state and for Mamba-2)."""
    if method == "auto":
        batch, length, heads, width = u.shape
        decay = torch.broadcast_shapes(delta.shape[3:], A.shape[1:])
        large = batch * heads * width * B.shape[-1] >= 2 ** 14
        method = "recurrent" if length == 1 else "factored" if min(decay) > 1 and large else "chunked"
    if method == "factored":
        return ssm_factored(u, delta, A, B, C, state, segment=chunk_size)
    if method == "recurrent":
        return ssm_recurrent(u, delta * A, B, C, state)
    if method == "chunked":
        return ssm_chunked(u, delta * A, B, C, state, chunk_size)
    raise ValueError(f"selective scan: unknown method {method!r} (auto, chunked, recurrent, factored)")
