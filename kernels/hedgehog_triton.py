"""A layer's Hedgehog feature maps, queries and keys, as one Triton launch forward and one backward.

kernels/hedgehog.py ``hedgehog`` is the math, the CPU path and the reference. Per row x (d) of KV head G, with
p = x W_G (H = F / 2 columns), each half its own softmax:

    phi = [phi+, phi-] = [softmax(p), softmax(-p)]

Backward, from the output phi (saved) and its gradient [g+, g-]:

    c+ = sum_j phi+_j g+_j,  c- = sum_j phi-_j g-_j,   dp = phi+ (g+ - c+) - phi- (g- - c-)
    dx = dp W_G^T,   dW_G = sum over the rows of KV head G of x^T dp

Eager PyTorch spends a launch on each of the two maps' matmul, stacked softmax and their gradients; here each
way is one, plus one sum of the weight gradients' partials. Grid axis 2 picks the
queries (0) or the keys (1), which have different row counts. The forward takes a block of ``ROWS`` rows a
program, the columns ``COLUMN_BLOCK`` at a time in two passes (each half's max and normaliser, then the features). The
backward runs ``PROGRAMS`` programs per KV head and side, each over the row blocks program, program + P, ... of
every batch row; it sums its rows' x^T dp into its own slot of a partial buffer (no atomics: deterministic), and
one sum over the programs reduces them. Scope: fp32 (tf32x3 dots, as the RSA kernels) and fp64 (IEEE dots).
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

from .conventions import FP32_DOTS, kernel_op, readable_in_place, tile_edge

# Tiles and warps chosen from sm_90 cubins (scripts/kernel_resources.py --kernel vort; docs/benchmarks.md): within
# issue 67's register budget at 4 warps, whatever d and F, since every tile is (rows or feature block) x column
# block; 32-wide blocks were over it in the backward.
ROWS, WARPS = 16, 4  # a program's row block
FEATURE_BLOCK = 16  # input features a step takes: (16, 16) tiles of x and dx
COLUMN_BLOCK = 16  # feature-map columns a step takes: (16, 16) tiles of W, p and dp
PROGRAMS = 64  # backward programs per KV head and side: 64 x G x 2 fill an H100's 132 SMs from G = 2


@triton.jit
def _row_block(x_ptr, block, R, BLOCKS, BLOCK_R: tl.constexpr):
    """Block ``block`` of the B * ceil(R / BLOCK_R) row blocks of one KV head: its batch row and its rows."""
    batch = block // BLOCKS
    rows = (block % BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
    return batch, rows, rows < R


@triton.jit
def _x_offsets(batch, group, rows, SB, SG, SJ, ST, T):
    """Where rows r of KV head ``group`` start in x, strided (B, G, J, T, d): head j = r // T, position t = r % T."""
    return batch * SB + group * SG + (rows // T) * SJ + (rows % T) * ST


@triton.jit
def _projection(x_ptr, at_x, row_ok, w_base, cols, D, H, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """p = x W for the rows at ``at_x`` and the columns ``cols``, summed over BLOCK_D features at a time."""
    p = tl.zeros((BLOCK_R, BLOCK_H), dtype=x_ptr.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + at_x[:, None] + dims[None, :], mask=row_ok[:, None] & (dims < D)[None, :], other=0.0)
        w = tl.load(w_base + dims[:, None] * H + cols[None, :], mask=(dims < D)[:, None] & (cols < H)[None, :],
                    other=0.0)
        p += tl.dot(x, w, input_precision=PRECISION)
    return p


@triton.jit
def _forward_side(x_ptr, w_ptr, out_ptr, group, block, B, G, R, D, H, SB, SG, SJ, ST, T, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    blocks = tl.cdiv(R, BLOCK_R)
    if block < B * blocks:
        batch, rows, row_ok = _row_block(x_ptr, block, R, blocks, BLOCK_R)
        base = (batch * G + group) * R
        at_x = _x_offsets(batch, group, rows, SB, SG, SJ, ST, T)
        w_base = w_ptr + group * D * H
        dtype = x_ptr.dtype.element_ty
        high = tl.full((BLOCK_R,), -float("inf"), dtype=dtype)  # max p, for the positive half
        low = tl.full((BLOCK_R,), float("inf"), dtype=dtype)  # min p: -max(-p), for the negative half
        plus = tl.zeros((BLOCK_R,), dtype=dtype)  # sum e^(p - high)
        minus = tl.zeros((BLOCK_R,), dtype=dtype)  # sum e^(low - p)
        for h0 in range(0, H, BLOCK_H):  # pass 1: each half's max and normaliser, online
            cols = h0 + tl.arange(0, BLOCK_H)
            p = _projection(x_ptr, at_x, row_ok, w_base, cols, D, H, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)
            col_ok = (cols < H)[None, :]
            new_high = tl.maximum(high, tl.max(tl.where(col_ok, p, -float("inf")), axis=1))
            new_low = tl.minimum(low, tl.min(tl.where(col_ok, p, float("inf")), axis=1))
            plus = plus * tl.exp(high - new_high) + tl.sum(tl.where(col_ok, tl.exp(p - new_high[:, None]), 0.0), 1)
            minus = minus * tl.exp(new_low - low) + tl.sum(tl.where(col_ok, tl.exp(new_low[:, None] - p), 0.0), 1)
            high, low = new_high, new_low
        for h0 in range(0, H, BLOCK_H):  # pass 2: the features
            cols = h0 + tl.arange(0, BLOCK_H)
            p = _projection(x_ptr, at_x, row_ok, w_base, cols, D, H, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)
            ok = row_ok[:, None] & (cols < H)[None, :]
            at = out_ptr + (base + rows[:, None]) * (2 * H) + cols[None, :]
            tl.store(at, tl.exp(p - high[:, None]) / plus[:, None], mask=ok)
            tl.store(at + H, tl.exp(low[:, None] - p) / minus[:, None], mask=ok)


@triton.jit
def _hedgehog_fwd(q_ptr, k_ptr, wq_ptr, wk_ptr, out_q_ptr, out_k_ptr, B, G, RQ, RK, D, H, QB, QG, QJ, QT, KB, KG, KT, T,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, KV head, side): the features of BLOCK_R rows of the queries (side 0) or keys (1)."""
    if tl.program_id(2) == 0:
        _forward_side(q_ptr, wq_ptr, out_q_ptr, tl.program_id(1), tl.program_id(0), B, G, RQ, D, H, QB, QG, QJ, QT,
                      T, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)
    else:
        _forward_side(k_ptr, wk_ptr, out_k_ptr, tl.program_id(1), tl.program_id(0), B, G, RK, D, H, KB, KG, 0, KT,
                      T, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)


@triton.jit
def _backward_side(x_ptr, w_ptr, phi_ptr, g_ptr, dx_ptr, slot_ptr, group, program, programs, B, G, R, D, H, SB, SG,
                   SJ, ST, T, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                   PRECISION: tl.constexpr):
    blocks = tl.cdiv(R, BLOCK_R)
    w_base = w_ptr + group * D * H
    for block in range(program, B * blocks, programs):
        batch, rows, row_ok = _row_block(x_ptr, block, R, blocks, BLOCK_R)
        base = (batch * G + group) * R
        c_plus = tl.zeros((BLOCK_R,), dtype=x_ptr.dtype.element_ty)
        c_minus = tl.zeros((BLOCK_R,), dtype=x_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):  # c+- = sum_j phi+-_j g+-_j, each half's
            cols = h0 + tl.arange(0, BLOCK_H)
            ok = row_ok[:, None] & (cols < H)[None, :]
            at = (base + rows[:, None]) * (2 * H) + cols[None, :]
            c_plus += tl.sum(tl.load(phi_ptr + at, mask=ok, other=0.0) * tl.load(g_ptr + at, mask=ok, other=0.0), 1)
            c_minus += tl.sum(tl.load(phi_ptr + at + H, mask=ok, other=0.0)
                              * tl.load(g_ptr + at + H, mask=ok, other=0.0), 1)
        at_x = _x_offsets(batch, group, rows, SB, SG, SJ, ST, T)
        for d0 in range(0, D, BLOCK_D):  # a block of features: its dx, and its rows of dW
            dims = d0 + tl.arange(0, BLOCK_D)
            dim_ok = dims < D
            x = tl.load(x_ptr + at_x[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            dx = tl.zeros((BLOCK_R, BLOCK_D), dtype=x.dtype)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                ok = row_ok[:, None] & (cols < H)[None, :]
                at = (base + rows[:, None]) * (2 * H) + cols[None, :]
                plus = tl.load(phi_ptr + at, mask=ok, other=0.0)
                minus = tl.load(phi_ptr + at + H, mask=ok, other=0.0)
                d_p = plus * (tl.load(g_ptr + at, mask=ok, other=0.0) - c_plus[:, None]) \
                    - minus * (tl.load(g_ptr + at + H, mask=ok, other=0.0) - c_minus[:, None])  # padded rows: 0
                w_ok = dim_ok[:, None] & (cols < H)[None, :]
                w = tl.load(w_base + dims[:, None] * H + cols[None, :], mask=w_ok, other=0.0)
                dx += tl.dot(d_p, tl.trans(w), input_precision=PRECISION)
                slot = slot_ptr + dims[:, None] * H + cols[None, :]
                tl.store(slot, tl.load(slot, mask=w_ok, other=0.0)
                         + tl.dot(tl.trans(x), d_p, input_precision=PRECISION), mask=w_ok)
            tl.store(dx_ptr + at_x[:, None] + dims[None, :], dx, mask=row_ok[:, None] & dim_ok[None, :])  # x's strides


@triton.jit
def _hedgehog_bwd(q_ptr, k_ptr, wq_ptr, wk_ptr, phi_q_ptr, phi_k_ptr, g_q_ptr, g_k_ptr, dq_ptr, dk_ptr, partial_ptr,
                  B, G, RQ, RK, D, H, QB, QG, QJ, QT, KB, KG, KT, T, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, KV head, side): dx of its row blocks, and x^T dp over them in slot (p, KV head, side) of
    ``partial`` (P, 2, G, d, H), zero-filled."""
    program, programs, group, side = tl.program_id(0), tl.num_programs(0), tl.program_id(1), tl.program_id(2)
    slot_ptr = partial_ptr + ((program * 2 + side) * G + group) * D * H
    if side == 0:
        _backward_side(q_ptr, wq_ptr, phi_q_ptr, g_q_ptr, dq_ptr, slot_ptr, group, program, programs, B, G, RQ, D,
                       H, QB, QG, QJ, QT, T, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)
    else:
        _backward_side(k_ptr, wk_ptr, phi_k_ptr, g_k_ptr, dk_ptr, slot_ptr, group, program, programs, B, G, RK, D,
                       H, KB, KG, 0, KT, T, BLOCK_R, BLOCK_D, BLOCK_H, PRECISION)


def _options(x: Tensor, d: int, h: int) -> dict:
    return dict(BLOCK_R=ROWS, BLOCK_D=tile_edge(d, FEATURE_BLOCK), BLOCK_H=tile_edge(h, COLUMN_BLOCK),
                PRECISION="ieee" if x.dtype == torch.float64 else FP32_DOTS, num_warps=WARPS, num_stages=1)


def _sizes(q: Tensor, k: Tensor, w: Tensor) -> tuple:
    """(B, G, RQ, RK, d, H) and the element strides q (B, G, J, T, d) and k (B, G, T, d) are read with:
    (QB, QG, QJ, QT, KB, KG, KT, T)."""
    batch, groups, heads, length, width = q.shape
    sizes = (batch, groups, heads * length, k.shape[2], width, w.shape[2])
    return sizes, (*q.stride()[:4], *k.stride()[:3], length)


@kernel_op(__name__, "hedgehog_forward")
def _hedgehog_forward(q: Tensor, wq: Tensor, k: Tensor, wk: Tensor) -> list[Tensor]:
    """[phi(q) (B, G, J T, 2H), phi(k) (B, G, T, 2H)] for q (B, G, J, T, d), k (B, G, T, d) (any strides, the last
    1), w (G, d, H) contiguous."""
    (batch, groups, rq, rk, d, h), strides = _sizes(q, k, wq)
    out_q, out_k = q.new_empty(batch, groups, rq, 2 * h), k.new_empty(batch, groups, rk, 2 * h)
    if q.numel() and k.numel():
        grid = (batch * triton.cdiv(max(rq, rk), ROWS), groups, 2)
        _hedgehog_fwd[grid](q, k, wq, wk, out_q, out_k, batch, groups, rq, rk, d, h, *strides, **_options(q, d, h))
    return [out_q, out_k]


@_hedgehog_forward.register_fake
def _(q, wq, k, wk):
    h = wq.shape[2]
    return [q.new_empty(*q.shape[:2], q.shape[2] * q.shape[3], 2 * h), k.new_empty(*k.shape[:3], 2 * h)]


@kernel_op(__name__, "hedgehog_backward")
def _hedgehog_backward(q: Tensor, wq: Tensor, k: Tensor, wk: Tensor, phi_q: Tensor, phi_k: Tensor, g_q: Tensor,
                       g_k: Tensor) -> list[Tensor]:
    """[dq, dk (with q's and k's strides), the weight gradients (2, G, d, H): the queries' map, then the keys'; summed
    over the programs]."""
    (batch, groups, rq, rk, d, h), strides = _sizes(q, k, wq)
    d_q, d_k = torch.empty_like(q), torch.empty_like(k)  # preserve_format: x's strides, which the kernel writes in
    partial = q.new_zeros(PROGRAMS, 2, groups, d, h)
    if q.numel() and k.numel():
        _hedgehog_bwd[(PROGRAMS, groups, 2)](q, k, wq, wk, phi_q, phi_k, g_q, g_k, d_q, d_k, partial, batch, groups,
                                             rq, rk, d, h, *strides, **_options(q, d, h))
    return [d_q, d_k, partial.sum(0)]


@_hedgehog_backward.register_fake
def _(q, wq, k, wk, phi_q, phi_k, g_q, g_k):
    return [torch.empty_like(q), torch.empty_like(k), q.new_empty(2, *wq.shape)]


def _save(ctx, inputs, output):
    q, wq, k, wk = inputs
    ctx.save_for_backward(q, wq, k, wk, *output)


def _gradients(ctx, grads):
    q, wq, k, wk, phi_q, phi_k = ctx.saved_tensors
    g_q, g_k = grads  # materialised: an output without a gradient gets zeros
    d_q, d_k, d_w = _hedgehog_backward(q, wq, k, wk, phi_q, phi_k, g_q.contiguous(), g_k.contiguous())
    return d_q, d_w[0], d_k, d_w[1]


_hedgehog_forward.register_autograd(_gradients, setup_context=_save)


def hedgehog_pair_triton(q: Tensor, q_weight: Tensor, k: Tensor, k_weight: Tensor) -> tuple[Tensor, Tensor]:
    """``hedgehog.hedgehog_pair``'s result on the kernels: q (B, G, g, T, d) or (B, G, T, d), k (B, G, T, d), any
    strides (a transposed projection is read in place), weights (G, d, F / 2) in q's dtype."""
    queries = q if q.dim() == 5 else q.unsqueeze(2)
    queries = queries if readable_in_place(queries) else queries.contiguous()
    keys = k if readable_in_place(k) else k.contiguous()
    phi_q, phi_k = _hedgehog_forward(queries, q_weight.contiguous(), keys, k_weight.contiguous())
    return phi_q.view(*q.shape[:-1], -1), phi_k

