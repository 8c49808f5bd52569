"""The gathered softmax of kernels/sparse_attention.py as one Triton launch forward and one backward.

``gathered_softmax`` is the entry and ``gathered_softmax_reference`` the reference. For query row t of batch row b,
its K key rows j_k = support[b, t, k] (-1: none) and each of its g query heads h (GQA: the heads of one key head),

    p[h, k] = softmax_k(scale <q[t, h], keys[j_k]>)   over the real entries (all 0 on a row with none)
    w[h, k] = gain[t, h] p[h, k]                       (gain 1 when none is given)

and backward, from dw,

    dgain[t, h] = sum_k dw[h, k] p[h, k]
    dl[h, k] = p[h, k] (gain dw[h, k] - sum_k' p[h, k'] gain dw[h, k'])
    dq[t, h] = scale sum_k dl[h, k] keys[j_k],     dkeys[j_k] += scale sum_h dl[h, k] q[t, h]   (atomic adds)

One program per (batch row, query row) gathers the K key rows once for all g heads. The weights are written as
(B, g, T, K), returned as the (B, T, g, K) view of it: with GLTM's batch rows (sequence, key head), that memory is
already the (sequence, query head, T, K) layout its solve reads. Scope: fp32 and fp64, d up to 256, any K and g.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A try block on purpose (see rsa_chunk_triton.py): imported only once a Triton path was chosen.
try:
    import triton
    import triton.language as tl
finally:
    pass

from .conventions import kernel_op, readable_in_place, table_with_contiguous_rows, tile_edge

WARPS = 4


@triton.jit
def _row(q_ptr, keys_ptr, idx_ptr, b, t, K, D, sq_b, sq_t, si_b, sk_b, sk_n, BLOCK_K: tl.constexpr,
         BLOCK_D: tl.constexpr):
    """Row t of batch row b: its slots and features, which entries are real, where its key rows sit (their offsets
    in keys, and in the keys' gradient, which is laid out alike), the gathered keys (BLOCK_K, BLOCK_D), and the
    offset of its first query head."""
    slots = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_D)
    index = tl.load(idx_ptr + b * si_b + t * K + slots, mask=slots < K, other=-1)
    real = index >= 0
    rows = b * sk_b + tl.maximum(index, 0)[:, None] * sk_n + cols[None, :]
    keys = tl.load(keys_ptr + rows, mask=real[:, None] & (cols < D)[None, :], other=0.0)
    return slots, cols, real, rows, keys, b * sq_b + t * sq_t


@triton.jit
def _probabilities(q, keys, real, scale):
    """The softmax over the real entries of <q, keys_k> scale (all 0 when none is real)."""
    logits = tl.where(real, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
    top = tl.max(logits, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    mass = tl.where(real, tl.exp(logits - top), 0.0)
    total = tl.sum(mass, axis=0)
    return mass / tl.where(total > 0, total, 1.0)


@triton.jit
def _softmax_fwd(q_ptr, keys_ptr, idx_ptr, gain_ptr, w_ptr, T, K, D, G, scale, sq_b, sq_t, sq_h, si_b, sk_b, sk_n,
                 sg_b, sg_t, sg_h, HAS_GAIN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    b, t = tl.program_id(0), tl.program_id(1)
    slots, cols, real, _, keys, q_at = _row(q_ptr, keys_ptr, idx_ptr, b, t, K, D, sq_b, sq_t, si_b, sk_b, sk_n,
                                            BLOCK_K, BLOCK_D)
    for h in range(G):
        q = tl.load(q_ptr + q_at + h * sq_h + cols, mask=cols < D, other=0.0)
        weights = _probabilities(q, keys, real, scale)
        if HAS_GAIN:
            weights = weights * tl.load(gain_ptr + b * sg_b + t * sg_t + h * sg_h)
        tl.store(w_ptr + ((b * G + h) * T + t) * K + slots, weights, mask=slots < K)


@triton.jit
def _softmax_bwd(q_ptr, keys_ptr, idx_ptr, gain_ptr, dw_ptr, dq_ptr, dk_ptr, dgain_ptr, T, K, D, G, scale, sq_b,
                 sq_t, sq_h, si_b, sk_b, sk_n, sg_b, sg_t, sg_h, HAS_GAIN: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    b, t = tl.program_id(0), tl.program_id(1)
    slots, cols, real, rows, keys, q_at = _row(q_ptr, keys_ptr, idx_ptr, b, t, K, D, sq_b, sq_t, si_b, sk_b, sk_n,
                                               BLOCK_K, BLOCK_D)
    d_keys = tl.zeros((BLOCK_K, BLOCK_D), dtype=keys.dtype)
    for h in range(G):
        q = tl.load(q_ptr + q_at + h * sq_h + cols, mask=cols < D, other=0.0)
        p = _probabilities(q, keys, real, scale)
        d_w = tl.load(dw_ptr + ((b * G + h) * T + t) * K + slots, mask=slots < K, other=0.0)
        if HAS_GAIN:
            tl.store(dgain_ptr + (b * T + t) * G + h, tl.sum(d_w * p, axis=0))
            d_w = d_w * tl.load(gain_ptr + b * sg_b + t * sg_t + h * sg_h)
        d_logits = p * (d_w - tl.sum(p * d_w, axis=0)) * scale
        tl.store(dq_ptr + ((b * T + t) * G + h) * D + cols, tl.sum(d_logits[:, None] * keys, axis=0), mask=cols < D)
        d_keys += d_logits[:, None] * q[None, :]
    # a key row the table names twice gets both contributions, as it should
    tl.atomic_add(dk_ptr + rows, d_keys, mask=real[:, None] & (cols < D)[None, :])


def _layout(q: Tensor, keys: Tensor, support: Tensor, gain: Tensor | None) -> tuple:
    """The strides the kernels take: q's (batch, row, head), support's batch (0: one table for every batch row),
    the keys' (batch, row), gain's (batch, row, head) (zeros when none)."""
    gain_strides = (0, 0, 0) if gain is None else gain.stride()
    return (*q.stride()[:3], support.stride(0), *keys.stride()[:2], *gain_strides)


def _options(q: Tensor, support: Tensor) -> dict:
    return dict(BLOCK_K=tile_edge(max(support.shape[-1], 1)), BLOCK_D=tile_edge(q.shape[-1]), num_warps=WARPS)


@kernel_op(__name__, "gathered_softmax_forward")
def _gathered_softmax_forward(q: Tensor, keys: Tensor, support: Tensor, gain: Tensor | None, scale: float) -> Tensor:
    """Weights (B, g, T, K) for q (B, T, g, d) and keys (B, N, d) with contiguous features, support (B, T, K) with
    contiguous rows, gain (B, T, g)."""
    batch, length, heads, width = q.shape
    weights = q.new_empty(batch, heads, length, support.shape[-1])
    if weights.numel():
        _softmax_fwd[(batch, length)](q, keys, support, q if gain is None else gain, weights, length,
                                      support.shape[-1], width, heads, scale, *_layout(q, keys, support, gain),
                                      HAS_GAIN=gain is not None, **_options(q, support))
    return weights


@_gathered_softmax_forward.register_fake
def _(q, keys, support, gain, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], support.shape[-1])


@kernel_op(__name__, "gathered_softmax_backward")
def _gathered_softmax_backward(grad: Tensor, q: Tensor, keys: Tensor, support: Tensor, gain: Tensor | None,
                               scale: float) -> list[Tensor]:
    """[dq (B, T, g, d), dkeys (B, N, d), dgain (B, T, g)] from the weights' gradient (B, g, T, K), contiguous."""
    batch, length, heads, width = q.shape
    d_q = q.new_empty(batch, length, heads, width)
    d_keys = torch.zeros_like(keys)  # laid out as keys (dense: the callers' keys are)
    d_gain = q.new_empty(batch, length, heads)
    if grad.numel():
        _softmax_bwd[(batch, length)](q, keys, support, q if gain is None else gain, grad, d_q, d_keys, d_gain,
                                      length, support.shape[-1], width, heads, scale,
                                      *_layout(q, keys, support, gain), HAS_GAIN=gain is not None,
                                      **_options(q, support))
    return [d_q, d_keys, d_gain]


@_gathered_softmax_backward.register_fake
def _(grad, q, keys, support, gain, scale):
    return [q.new_empty(q.shape), torch.empty_like(keys), q.new_empty(q.shape[:3])]


def _save(ctx, inputs, output):
    q, keys, support, gain, scale = inputs
    ctx.scale, ctx.has_gain = scale, gain is not None
    ctx.save_for_backward(q, keys, support, gain)


def _gradients(ctx, grad):
    q, keys, support, gain = ctx.saved_tensors
    d_q, d_keys, d_gain = _gathered_softmax_backward(grad.contiguous(), q, keys, support, gain, ctx.scale)
    return d_q, d_keys, None, (d_gain if ctx.has_gain else None), None


_gathered_softmax_forward.register_autograd(_gradients, setup_context=_save)


def gathered_softmax_triton(q: Tensor, keys: Tensor, support: Tensor, scale: float, gain: Tensor | None = None):
    """``sparse_attention.gathered_softmax``'s result on the kernels: q (B, T, g, d) and keys (B, N, d) (read in
    place when their features are contiguous), support (B, T, K) (its batch may be a broadcast), gain (B, T, g) or
    None; fp32 or fp64 -> weights (B, T, g, K), a view of (B, g, T, K) memory."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if readable_in_place(keys) else keys.contiguous()
    weights = _gathered_softmax_forward(q, keys, table_with_contiguous_rows(support), gain, scale)
    return weights.transpose(1, 2)
