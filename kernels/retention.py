"""Multi-rate retention: linear attention whose lag kernel is a per-token sum of exponentials (VORT's global branch).

Token i is written with weights c_s(i) into S slots of fixed log-rates l_s <= 0 (the SOE of kernels/soe.py, or
learned rates), so the read at t weighs it by a_{t,i} = (q_t . k_i) * sum_s c_s(i) exp(l_s (t - i)):

    out_t = sum_{i <= t} a_{t,i} v_i  +  skip_t (q_t . k_t) v_t          (include_current; strict: i < t, no skip)

q and k are already feature maps (phi(q), phi(k) >= 0 for a positive map); the normaliser is the caller's: it
appends a column of ones to v and divides. Per slot this is RetNet-style fixed-decay linear attention; summed over
the slots the state is (S, F, V) per KV head, the same at any context length.

Shapes: q (B, G, g, T, F) (G KV heads of g query heads), k (B, G, T, F), v (B, G, T, V), log_rates (G or 1, S),
weights (B, G, T, S) (zero for padding: such a token writes nothing), skip (B, G, T) or None, state (B, G, S, F, V)
before token 0 (None: zeros).

Forms, equal in fp64 (tests/unit/test_retention.py; ``retention`` is the entry that picks one):
    retention_quadratic   the (T, T) matrix a_{t,i}: the definition (the paper's parallel form); ``scores`` may
                          replace q . k (e.g. the exact exp(q . k / sqrt(d)) of the identity checks)
    retention_recurrent   token by token: decay, (strict: read), write, (read): the decode path
    retention_chunked     chunks of C tokens: intra-chunk a masked matmul with the (C, C) kernel summed over the
                          slots, inter-chunk the state read through exp(l_s (r + 1)); memory linear in T, and a
                          long input a segment of chunks at a time (the state carried)
    retention_simple_gla  through flash-linear-attention's chunk_simple_gla (CUDA): each (KV head, slot) pair is a
                          linear attention of constant decay l_s (its ``g_gamma``) over the keys c_s(i) k_i; fla's
                          heads carry one query each, so the pair runs once per query head of its KV head
States are fp32 (fp64 stays fp64): 1 - e^{l_s} can be 5.6e-7, below bf16's resolution. ``normalised_read``
divides a read by its normaliser (one Triton launch each way on the GPU path).
"""

from __future__ import annotations

import torch

from .conventions import compute_dtype, outside_autocast
from .dispatch import library_kernel, use_triton


def _check(q, k, v, log_rates, weights, skip, state):
    if q.dim() != 5 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"retention: q must be (B, G, g, T, F), k (B, G, T, F), v (B, G, T, V); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, groups, _, length, features = q.shape
    if tuple(k.shape) != (batch, groups, length, features) or tuple(v.shape[:3]) != (batch, groups, length):
        raise ValueError(f"retention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    slots = log_rates.shape[-1]
    if log_rates.dim() != 2 or log_rates.shape[0] not in (1, groups):
        raise ValueError(f"retention: log_rates must be (1 or {groups}, slots), got {tuple(log_rates.shape)}")
    if tuple(weights.shape) != (batch, groups, length, slots):
        raise ValueError(f"retention: weights must be {(batch, groups, length, slots)}, got {tuple(weights.shape)}")
    if skip is not None and tuple(skip.shape) != (batch, groups, length):
        raise ValueError(f"retention: skip must be {(batch, groups, length)}, got {tuple(skip.shape)}")
    if state is not None and tuple(state.shape) != (batch, groups, slots, features, v.shape[-1]):
        raise ValueError(f"retention: state must be {(batch, groups, slots, features, v.shape[-1])}, got "
                         f"{tuple(state.shape)}")


def _cast(*tensors):
    dtype = compute_dtype(tensors[0].dtype)
    return [None if t is None else t.to(dtype) for t in tensors]


def lag_kernel(log_rates, weights, length: int):
    """The (T, T) lag kernel of the definition, k[t, i] = sum_s weights[i, s] exp(l_s (t - i)) for t >= i (0 above
    the diagonal): log_rates (G or 1, S), weights (B, G, T, S) -> (B, G, T, T)."""
    t = torch.arange(length, device=weights.device)
    lag = t[:, None] - t[None, :]
    decay = torch.exp(log_rates[:, :, None, None] * lag.clamp(min=0).to(weights.dtype))  # (G, S, T, T)
    return torch.einsum("gsti,bgis->bgti", decay, weights) * (lag >= 0)


# Elements of the chunk form's largest intermediates, (B, G, S, V) x max(g C, F) per chunk (each chunk's writes and
# its per-slot read), that one call holds: longer inputs go a segment at a time. All at once they reached hundreds
# of MB each at 16K for the converted SmolLM2, every one a fresh mapping faulted in page by page.
SEGMENT_ELEMENTS = 1 << 22


@outside_autocast
def retention_quadratic(q, k, v, log_rates, weights, skip=None, state=None, include_current: bool = True,
                        scores=None):
    """The definition through the (T, T) matrix. ``scores`` (B, G, g, T, T) replaces q . k when given (q and k are
    then only used to read ``state``). Returns (out (B, G, g, T, V), final state (B, G, S, F, V))."""
    _check(q, k, v, log_rates, weights, skip, state)
    q, k, v, log_rates, weights, skip, state = _cast(q, k, v, log_rates, weights, skip, state)
    length = q.shape[3]
    t = torch.arange(length, device=q.device)
    kernel = lag_kernel(log_rates, weights, length)  # (B, G, T, T): sum_s c_s(i) e^{l_s (t-i)}
    if not include_current:
        kernel = kernel * (t[:, None] > t[None, :])
    if skip is not None and include_current:
        kernel = kernel + torch.diag_embed(skip)
    if scores is None:
        scores = torch.einsum("bgjtf,bgif->bgjti", q, k)
    out = torch.einsum("bgjti,bgti,bgiv->bgjtv", scores.to(q.dtype), kernel, v)
    if state is not None:  # the state before token 0, decayed t + 1 steps
        read = torch.exp(log_rates[:, :, None] * (t + 1).to(q.dtype))  # (G, S, T)
        out = out + torch.einsum("bgjtf,gst,bgsfv->bgjtv", q, read, state)
    end = torch.exp(log_rates[:, :, None] * (length - 1 - t).to(q.dtype))  # (G, S, T): decay to the last token
    final = torch.einsum("gsi,bgis,bgif,bgiv->bgsfv", end, weights, k, v)
    if state is not None:
        final = final + torch.exp(log_rates * length)[None, :, :, None, None] * state
    return out, final


@outside_autocast
def retention_step(q, k, v, log_rates, weights, skip, state, include_current: bool = True):
    """One token: q (B, G, g, F), k (B, G, F), v (B, G, V), weights (B, G, S), skip (B, G) or None, state
    (B, G, S, F, V) -> out (B, G, g, V), new state. Decay to t, (strict: read), write token t, (read + skip)."""
    state = torch.exp(log_rates)[None, :, :, None, None] * state
    if not include_current:
        return torch.einsum("bgjf,bgfv->bgjv", q, state.sum(2)), \
            state + torch.einsum("bgs,bgf,bgv->bgsfv", weights, k, v)
    state = state + torch.einsum("bgs,bgf,bgv->bgsfv", weights, k, v)
    out = torch.einsum("bgjf,bgfv->bgjv", q, state.sum(2))
    if skip is not None:
        out = out + (skip[:, :, None] * torch.einsum("bgjf,bgf->bgj", q, k))[..., None] * v[:, :, None]
    return out, state


@outside_autocast
def retention_recurrent(q, k, v, log_rates, weights, skip=None, state=None, include_current: bool = True):
    """Token by token (``retention_step``): the decode path. Same signature and result as retention_quadratic."""
    _check(q, k, v, log_rates, weights, skip, state)
    q, k, v, log_rates, weights, skip, state = _cast(q, k, v, log_rates, weights, skip, state)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[1], log_rates.shape[-1], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[3]):
        out, state = retention_step(q[:, :, :, t], k[:, :, t], v[:, :, t], log_rates, weights[:, :, t],
                                    None if skip is None else skip[:, :, t], state, include_current)
        outs.append(out)
    return torch.stack(outs, dim=3), state


@outside_autocast
def retention_chunked(q, k, v, log_rates, weights, skip=None, state=None, include_current: bool = True,
                      chunk_size: int = 64):
    """Chunks of ``chunk_size`` tokens; memory linear in T. Same signature and result as retention_quadratic.
    A long input goes a segment of chunks at a time (``SEGMENT_ELEMENTS``), the state carried between them."""
    _check(q, k, v, log_rates, weights, skip, state)
    q, k, v, log_rates, weights, skip, state = _cast(q, k, v, log_rates, weights, skip, state)
    batch, groups, per_group, length, features = q.shape
    slots, width, size = log_rates.shape[-1], v.shape[-1], min(chunk_size, length)
    per_chunk = batch * groups * slots * width * max(per_group * size, features)  # the read's and the writes' tensors
    segment = size * max(1, SEGMENT_ELEMENTS // per_chunk)
    if length > segment:
        outs = []
        for start in range(0, length, segment):
            rows = slice(start, start + segment)
            out, state = retention_chunked(q[:, :, :, rows], k[:, :, rows], v[:, :, rows], log_rates,
                                           weights[:, :, rows], None if skip is None else skip[:, :, rows], state,
                                           include_current, chunk_size)
            outs.append(out)
        return torch.cat(outs, dim=3), state
    chunks = -(-length // size)
    pad = chunks * size - length
    if pad:  # padded tokens: zero query, key and weights, so they neither read nor write
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        k, v = torch.nn.functional.pad(k, (0, 0, 0, pad)), torch.nn.functional.pad(v, (0, 0, 0, pad))
        weights = torch.nn.functional.pad(weights, (0, 0, 0, pad))
        skip = None if skip is None else torch.nn.functional.pad(skip, (0, pad))
    qc = q.unflatten(3, (chunks, size))  # (B, G, g, N, C, F)
    kc, vc = k.unflatten(2, (chunks, size)), v.unflatten(2, (chunks, size))  # (B, G, N, C, F / V)
    wc = weights.unflatten(2, (chunks, size))  # (B, G, N, C, S)
    r = torch.arange(size, device=q.device)
    lag = (r[:, None] - r[None, :]).to(q.dtype)
    causal = r[:, None] > r[None, :] if not include_current else r[:, None] >= r[None, :]
    rates = log_rates[:, :, None, None]  # (G, S, 1, 1)
    decay = torch.exp(rates * lag.clamp(min=0)) * causal  # (G, S, C, C)
    kernel = torch.einsum("gsrc,bgncs->bgnrc", decay, wc)  # (B, G, N, C, C)
    if skip is not None and include_current:
        kernel = kernel + torch.diag_embed(skip.unflatten(2, (chunks, size)))
    scores = torch.einsum("bgjnrf,bgncf->bgjnrc", qc, kc)
    out = torch.einsum("bgjnrc,bgnrc,bgncv->bgjnrv", scores, kernel, vc)
    # each chunk's own write, decayed to its last token: (B, G, N, S, F, V)
    to_end = torch.exp(log_rates[:, :, None] * (size - 1 - r).to(q.dtype))  # (G, S, C)
    # as one product per chunk, (S F, C) @ (C, V), its left side built in that layout (the four-operand einsum
    # copied the same tensor into it, twice as slow, the same values)
    weighed = (wc.transpose(-1, -2) * to_end[None, :, None])[..., :, None, :]  # (B, G, N, S, 1, C)
    writes = (weighed * kc.transpose(-1, -2)[..., None, :, :]).flatten(3, 4) @ vc  # (B, G, N, S F, V)
    writes = writes.unflatten(3, (slots, features))
    step = torch.exp(log_rates * size)[None, :, :, None, None]  # (1, G, S, 1, 1): a whole chunk of decay
    current = state if state is not None else q.new_zeros(batch, groups, slots, features, width)
    before = []  # the state before each chunk
    for write in writes.unbind(2):  # unbind, not writes[:, :, n]: one backward for all chunks, not N full-size ones
        before.append(current)
        current = step * current + write
    before = torch.stack(before, dim=2)  # (B, G, N, S, F, V)
    read = torch.exp(log_rates[:, :, None] * (r + 1).to(q.dtype))  # (G, S, C)
    first = 0 if state is not None else 1  # without a carried state the first chunk reads zeros: skip it
    if chunks > first:  # the inter-chunk read, S F V per query: the form's main cost
        # per chunk one matmul of its queries (g C, F) with every slot's state (F, S V), then each slot's read weighed
        # by its decay to the row and summed over the slots: faster on CPU than decaying the queries per slot
        # first (a (g, C, S F) tensor, copied again for the einsum's matmul)
        queries = qc[:, :, :, first:].transpose(2, 3).flatten(3, 4)  # (B, G, N', g C, F)
        states = before[:, :, first:].transpose(3, 4).flatten(4, 5)  # (B, G, N', F, S V)
        per_slot = (queries @ states).unflatten(-1, (slots, width))  # (B, G, N', g C, S, V)
        per_slot = per_slot.unflatten(3, (per_group, size))  # (B, G, N', g, C, S, V)
        weigh = read.transpose(1, 2)[None, :, None, None, :, None, :]  # (1, G, 1, 1, C, 1, S)
        inter = (weigh @ per_slot).squeeze(-2).transpose(2, 3)  # (B, G, g, N', C, V)
        out = torch.cat([out[:, :, :, :first], out[:, :, :, first:] + inter], dim=3)
    if pad:  # the final state at the last real token: the last chunk's state and writes decayed size - pad steps
        real = size - pad
        to_last = torch.exp(log_rates[:, :, None] * (real - 1 - r).clamp(min=0).to(q.dtype))  # padded: weight 0
        current = torch.exp(log_rates * real)[None, :, :, None, None] * before[:, :, -1] + torch.einsum(
            "gsc,bgcs,bgcf,bgcv->bgsfv", to_last, wc[:, :, -1], kc[:, :, -1], vc[:, :, -1])
    return out.flatten(3, 4)[:, :, :, :length], current


@outside_autocast
def retention_simple_gla(q, k, v, log_rates, weights, skip=None, state=None, include_current: bool = True, *,
                         kernel):
    """The chunked form's result through ``kernel``, flash-linear-attention's ``chunk_simple_gla`` (or a stand-in
    with its signature). Its heads are the (KV head, slot, query head) triples; the slots' outputs are summed. fla
    reads the current token too, so the current token's own term is corrected outside: + skip_t (q_t . k_t) v_t,
    or, for a strict read, - sum_s c_s(t) (q_t . k_t) v_t."""
    _check(q, k, v, log_rates, weights, skip, state)
    q, k, v, log_rates, weights, skip, state = _cast(q, k, v, log_rates, weights, skip, state)
    batch, groups, per_group, length, features = q.shape
    slots, width = log_rates.shape[-1], v.shape[-1]
    heads = (batch, length, groups, slots, per_group)  # fla's (B, T, H) with H = G S g
    queries = q.permute(0, 3, 1, 2, 4)[:, :, :, None].expand(*heads, features)
    keys = (weights.transpose(1, 2)[..., None] * k.transpose(1, 2)[:, :, :, None])[:, :, :, :, None]
    values = v.transpose(1, 2)[:, :, :, None, None].expand(*heads, width)
    gamma = log_rates.expand(groups, slots)[:, :, None].expand(groups, slots, per_group)
    initial = None if state is None else state[:, :, :, None].expand(batch, groups, slots, per_group, features, width)
    out, final = kernel(q=queries.flatten(2, 4), k=keys.expand(*heads, features).flatten(2, 4),
                        v=values.flatten(2, 4), g_gamma=gamma.flatten(), scale=1.0,
                        initial_state=None if initial is None else initial.flatten(1, 3), output_final_state=True)
    out = out.unflatten(2, (groups, slots, per_group)).sum(3).permute(0, 2, 3, 1, 4)  # (B, G, g, T, V)
    final = final.unflatten(1, (groups, slots, per_group))[:, :, :, 0]  # every query head's copy is the same
    current = skip if include_current else -weights.sum(-1)  # (B, G, T) or None
    if current is not None:
        out = out + (current[:, :, None] * (q * k[:, :, None]).sum(-1))[..., None] * v[:, :, None]
    return out.to(q.dtype), final.to(q.dtype)


def normalised_read(read, eps0: float, offset=None, backend: str = "auto"):
    """A linear attention's read divided by its normaliser: ``read`` (B, G, g, T, dv + 1) holds the numerator, then
    the denominator d (the retention of a column of ones) -> (numerator / max(d + eps, tiny), log max(d, tiny)
    (+ offset)), eps = eps0 or, with the query features' log scale ``offset`` (B, G, g, T) (detached), eps0 e^-offset
    (at most 1e30 eps0): eps0 in the features' unshifted units. ``tiny``: the dtype's smallest normal, so an empty
    memory reads 0, also with eps0 = 0. One Triton launch each way where kernels/dispatch.py takes Triton
    (kernels/retention_triton.py), for fp32 and fp64; else this math, which is the kernel's reference."""
    if use_triton("normalised retention read", read.device, backend, check=lambda: None if read.dtype in (
            torch.float32, torch.float64) else f"{read.dtype} reads (the kernel takes fp32 or fp64)"):
        from .retention_triton import normalised_read_triton

        return normalised_read_triton(read, eps0, offset)
    numerator, denominator = read[..., :-1], read[..., -1]
    eps = eps0 if offset is None else eps0 * torch.exp(-offset).clamp(max=1e30)
    tiny = torch.finfo(read.dtype).tiny
    output = numerator / (denominator + eps).clamp(min=tiny)[..., None]
    log_weight = torch.log(denominator.clamp(min=tiny))
    return output, (log_weight if offset is None else log_weight + offset)


def retention(q, k, v, log_rates, weights, skip=None, state=None, include_current: bool = True, chunk_size: int = 64,
              backend: str = "auto"):
    """The entry (same signature and result as the forms): one token -> ``retention_recurrent``; on CUDA where
    kernels/dispatch.py takes flash-linear-attention -> ``retention_simple_gla``; else ``retention_chunked``.
    ``backend``: as ``config.kernel_backend``."""
    if q.shape[3] == 1:
        return retention_recurrent(q, k, v, log_rates, weights, skip, state, include_current)
    kernel = library_kernel("VORT retention", "fla.ops.simple_gla", "chunk_simple_gla", q.device, backend,
                            check=lambda: None if q.dtype != torch.float64 else "fp64 inputs (fla computes in fp32)")
    if kernel is not None:
        return retention_simple_gla(q, k, v, log_rates, weights, skip, state, include_current, kernel=kernel)
    return retention_chunked(q, k, v, log_rates, weights, skip, state, include_current, chunk_size)
