"""The flex path's epilogue of a local window read with its entropy, as one Triton launch forward and one backward.

kernels/local_attention.py ``flex_read_entropy`` is the math, the CPU path and the reference. flex_attention ran
over the values with the keys appended, so a query's output row is [o (dv), m (d)] with m = sum_c p_c k_c; with its
log normaliser lse (fp32, -inf where it sees no key) and s, the valid keys among its window:

    log Z = max(lse, lse's dtype's min)
    H = (log Z - scale q . m) / log max(s, 2)   where s > 1, else 0         (the row's normalised entropy)

Backward, with f = 1 / log max(s, 2) where s > 1 (else 0):

    d lse = [lse >= min] (g_logZ + f g_H),   d m = -scale f g_H q,   d q = -scale f g_H m,   d o = g_o

Eager PyTorch spends a launch on each op and gradient of it (the count of keys, the split of the row, the
clamp, the dot and the division); here each way is one. The window's key count is summed from ``valid`` in the
kernel (``WINDOW_BLOCK`` positions at a time). A program takes a block of queries and every feature.
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

from .conventions import kernel_op, readable_in_place, tile_edge

# (rows, features) tiles of at most 2,048 elements a tensor, at 4 warps (as kernels/window_combine_triton.py)
TILE_ELEMENTS, WARPS = 2048, 4
WINDOW_BLOCK = 64  # valid flags a step of the key count reads


@triton.jit
def _block(out_ptr, lse_ptr, q_ptr, valid_ptr, N, HEADS, LENGTH, SPAN, WINDOW, QB, QH, QT, DV, D, lse_min,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's queries (B, heads, T flattened): (queries, mask, lse, the clamp's mask, f, the (query, key
    feature) mask, q's offsets, q, m)."""
    queries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    query_ok = queries < N
    batch, head, position = queries // (HEADS * LENGTH), (queries // LENGTH) % HEADS, queries % LENGTH
    seen = tl.zeros((BLOCK_N,), dtype=tl.int32)  # valid keys among positions t + 1 .. t + w of the w + T
    for w0 in range(0, WINDOW, BLOCK_W):
        steps = w0 + tl.arange(0, BLOCK_W)
        ok = query_ok[:, None] & (steps < WINDOW)[None, :]
        flags = tl.load(valid_ptr + batch[:, None] * SPAN + position[:, None] + 1 + steps[None, :], mask=ok, other=0)
        seen += tl.sum((flags != 0).to(tl.int32), axis=1)
    lse = tl.load(lse_ptr + queries, mask=query_ok, other=0.0)
    factor = tl.where(seen > 1, 1 / tl.log(tl.maximum(seen, 2).to(lse.dtype)), 0.0)
    cols = tl.arange(0, BLOCK_D)
    ok = query_ok[:, None] & (cols < D)[None, :]
    at_q = (batch * QB + head * QH + position * QT)[:, None] + cols[None, :]
    q = tl.load(q_ptr + at_q, mask=ok, other=0.0)
    m = tl.load(out_ptr + queries[:, None] * (DV + D) + DV + cols[None, :], mask=ok, other=0.0)
    return queries, query_ok, lse, lse >= lse_min, factor, ok, at_q, q, m


@triton.jit
def _entropy_fwd(out_ptr, lse_ptr, q_ptr, valid_ptr, values_ptr, log_z_ptr, entropy_ptr, N, HEADS, LENGTH, SPAN,
                 WINDOW, QB, QH, QT, DV, D, lse_min, scale, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    queries, query_ok, lse, _, factor, _, _, q, m = _block(out_ptr, lse_ptr, q_ptr, valid_ptr, N, HEADS, LENGTH, SPAN,
                                                           WINDOW, QB, QH, QT, DV, D, lse_min, BLOCK_N, BLOCK_D,
                                                           BLOCK_W)
    log_z = tl.maximum(lse, lse_min)
    entropy = (log_z - scale * tl.sum(q.to(lse.dtype) * m.to(lse.dtype), axis=1)) * factor
    tl.store(log_z_ptr + queries, log_z, mask=query_ok)
    tl.store(entropy_ptr + queries, entropy, mask=query_ok)
    cols = tl.arange(0, BLOCK_V)
    ok = query_ok[:, None] & (cols < DV)[None, :]
    tl.store(values_ptr + queries[:, None] * DV + cols[None, :],
             tl.load(out_ptr + queries[:, None] * (DV + D) + cols[None, :], mask=ok, other=0.0), mask=ok)


@triton.jit
def _entropy_bwd(out_ptr, lse_ptr, q_ptr, valid_ptr, g_values_ptr, g_log_z_ptr, g_entropy_ptr, d_out_ptr, d_lse_ptr,
                 d_q_ptr, N, HEADS, LENGTH, SPAN, WINDOW, QB, QH, QT, DV, D, lse_min, scale, BLOCK_N: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    queries, query_ok, lse, unclamped, factor, ok, at_q, q, m = _block(
        out_ptr, lse_ptr, q_ptr, valid_ptr, N, HEADS, LENGTH, SPAN, WINDOW, QB, QH, QT, DV, D, lse_min, BLOCK_N,
        BLOCK_D, BLOCK_W)
    g_entropy = tl.load(g_entropy_ptr + queries, mask=query_ok, other=0.0) * factor
    g_log_z = tl.load(g_log_z_ptr + queries, mask=query_ok, other=0.0)
    tl.store(d_lse_ptr + queries, tl.where(unclamped, g_log_z + g_entropy, 0.0), mask=query_ok)
    g_dot = (-scale * g_entropy)[:, None]
    cols = tl.arange(0, BLOCK_D)
    tl.store(d_out_ptr + queries[:, None] * (DV + D) + DV + cols[None, :], g_dot * q, mask=ok)
    tl.store(d_q_ptr + at_q, g_dot * m, mask=ok)
    cols = tl.arange(0, BLOCK_V)
    ok = query_ok[:, None] & (cols < DV)[None, :]
    tl.store(d_out_ptr + queries[:, None] * (DV + D) + cols[None, :],
             tl.load(g_values_ptr + queries[:, None] * DV + cols[None, :], mask=ok, other=0.0), mask=ok)


def _launch(out: Tensor, lse: Tensor, query: Tensor, valid: Tensor, window: int, value_dim: int) -> tuple:
    """(grid, the sizes both kernels take, constexprs) for out (B, G, g, T, dv + d), query (B, G, g, T, d)."""
    batch, groups, per_group, length, width = query.shape
    block_v, block_d = tile_edge(value_dim), tile_edge(width)
    block_n = max(16, TILE_ELEMENTS // max(block_v, block_d))
    queries = batch * groups * per_group * length
    sizes = (queries, groups * per_group, length, valid.shape[1], window, query.stride(0), query.stride(2),
             query.stride(3), value_dim, width, torch.finfo(lse.dtype).min)
    return (triton.cdiv(queries, block_n),), sizes, dict(BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d,
                                                         BLOCK_W=min(WINDOW_BLOCK, tile_edge(window)),
                                                         num_warps=WARPS)


@kernel_op(__name__, "read_entropy_forward")
def _read_entropy_forward(out: Tensor, lse: Tensor, query: Tensor, valid: Tensor, window: int, value_dim: int,
                          scale: float) -> list[Tensor]:
    """[o (B, G, g, T, dv), log Z (B, G, g, T) in lse's dtype, H (B, G, g, T) in lse's dtype]."""
    values = out.new_empty(*out.shape[:-1], value_dim)
    log_z, entropy = torch.empty_like(lse), torch.empty_like(lse)
    if out.numel():
        grid, sizes, constexprs = _launch(out, lse, query, valid, window, value_dim)
        _entropy_fwd[grid](out, lse, query, valid, values, log_z, entropy, *sizes, scale, **constexprs)
    return [values, log_z, entropy]


@_read_entropy_forward.register_fake
def _(out, lse, query, valid, window, value_dim, scale):
    return [out.new_empty(*out.shape[:-1], value_dim), torch.empty_like(lse), torch.empty_like(lse)]


@kernel_op(__name__, "read_entropy_backward")
def _read_entropy_backward(out: Tensor, lse: Tensor, query: Tensor, valid: Tensor, g_values: Tensor, g_log_z: Tensor,
                           g_entropy: Tensor, window: int, value_dim: int, scale: float) -> list[Tensor]:
    """[d out, d lse, d query (query's strides)]."""
    d_out, d_lse, d_query = torch.empty_like(out), torch.empty_like(lse), torch.empty_like(query)
    if out.numel():
        grid, sizes, constexprs = _launch(out, lse, query, valid, window, value_dim)
        _entropy_bwd[grid](out, lse, query, valid, g_values, g_log_z, g_entropy, d_out, d_lse, d_query, *sizes, scale,
                           **constexprs)
    return [d_out, d_lse, d_query]


@_read_entropy_backward.register_fake
def _(out, lse, query, valid, g_values, g_log_z, g_entropy, window, value_dim, scale):
    return [torch.empty_like(out), torch.empty_like(lse), torch.empty_like(query)]


def _save(ctx, inputs, output):
    out, lse, query, valid, *ctx.scalars = inputs
    ctx.save_for_backward(out, lse, query, valid)


def _gradients(ctx, grads):
    g_values, g_log_z, g_entropy = (g.contiguous() for g in grads)  # materialised: a missing gradient is zeros
    d_out, d_lse, d_query = _read_entropy_backward(*ctx.saved_tensors, g_values, g_log_z, g_entropy, *ctx.scalars)
    return d_out, d_lse, d_query, None, None, None, None


_read_entropy_forward.register_autograd(_gradients, setup_context=_save)


def read_entropy_triton(out: Tensor, lse: Tensor, query: Tensor, valid: Tensor, window: int, value_dim: int,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``local_attention.flex_read_entropy``'s result on the kernels (log Z and H cast to the queries' dtype)."""
    if not readable_in_place(query) or query.stride(1) != query.stride(2) * query.shape[2]:  # (G, g) as one axis
        query = query.contiguous()
    values, log_z, entropy = _read_entropy_forward(out.contiguous(), lse.contiguous(), query, valid.contiguous(),
                                                   int(window), int(value_dim), float(scale))
    return values, log_z.to(query.dtype), entropy.to(query.dtype)
