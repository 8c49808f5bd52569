"""RSA's residual MLPs between levels as Triton kernels: a level's key MLP and value MLP in one launch each way.

    out = x + silu(x W1^T + b1) W2^T + b2        x (N, d), W1 (h, d), b1 (h,), W2 (d, h), b2 (d,)

``rsa_state.ResidualMLPWeights.__call__`` is the math, the CPU path and the reference. The backward recomputes the
hidden layer from x (nothing is saved but the inputs):

    a = x W1^T + b1,  s = silu(a),  da = (g W2) * silu'(a),  silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a)))
    dx = g + da W1,   dW1 = da^T x,   db1 = sum_rows da,   dW2 = g^T s,   db2 = sum_rows g

Eager PyTorch spends 4 launches forward and 8 backward on each MLP (two linears, the activation, the residual add
and their gradients), 24 a level for the key and value MLPs; here a level takes 3. The grid is (programs, 2): axis
1 picks the key or the value MLP, which may differ in width. Forward, a program per block of rows. Backward, at
most ``MAX_PROGRAMS`` programs, each taking the row blocks program, program + P, ...: it writes its rows' dx and
sums its partial weight gradients in its own slot of a scratch buffer (not in registers), and one sum over the
programs reduces them (no atomics, so the gradients are deterministic). Hidden units go ``HIDDEN_BLOCK`` and
features ``FEATURE_BLOCK`` at a time: a program holds (rows, block) and (block, block) tiles only, whatever the
width.

Scope: fp32 (the caller's dot precision: tf32 for a bf16 / fp16 call, fp32-accurate tf32x3 otherwise, as the chain
and level kernels) and fp64 (IEEE dots, for the tests), any widths. Used by the Triton write path
(kernels/rsa_chunk_triton.py), with and without autograd.
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

from .conventions import FP32_DOTS, kernel_op, tile_edge
from .rsa_chain_triton import _add_into
from .rsa_state import ResidualMLPWeights

# Tiles and warps, read from sm_90 cubins (scripts/kernel_resources.py): within issue 67's register budget at 4
# warps, whatever d, since every tile is (rows or hidden block) x feature block.
FORWARD_ROWS, FORWARD_WARPS = 16, 4  # a forward program's rows
BACKWARD_ROWS, BACKWARD_WARPS = 16, 4  # a backward row block
HIDDEN_BLOCK = 32  # hidden units an iteration takes: (rows, 32) tiles of a, s, da
FEATURE_BLOCK = 32  # features an iteration takes: (rows, 32) tiles of x, g, dx; (32, 32) of W1 and W2
MAX_PROGRAMS = 512  # the backward's programs: enough to fill an H100's 132 SMs, few partial slots to sum


@triton.jit
def _forward_rows(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, block, N, D, H, BLOCK_N: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """BLOCK_N rows: out = x + b2 first, then each hidden block's s W2^T added, BLOCK_F features at a time."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    for f0 in range(0, D, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        ok, at = row_ok[:, None] & (cols < D)[None, :], rows[:, None] * D + cols[None, :]
        tl.store(out_ptr + at, tl.load(x_ptr + at, mask=ok, other=0.0)
                 + tl.load(b2_ptr + cols, mask=cols < D, other=0.0)[None, :], mask=ok)
    tl.debug_barrier()
    for h0 in range(0, H, BLOCK_H):
        hidden = h0 + tl.arange(0, BLOCK_H)
        a = tl.zeros((BLOCK_N, BLOCK_H), dtype=x_ptr.dtype.element_ty) \
            + tl.load(b1_ptr + hidden, mask=hidden < H, other=0.0)[None, :]
        for f0 in range(0, D, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=row_ok[:, None] & (cols < D)[None, :],
                        other=0.0)
            w_ok = (hidden < H)[:, None] & (cols < D)[None, :]
            w1 = tl.load(w1_ptr + hidden[:, None] * D + cols[None, :], mask=w_ok, other=0.0)
            a += tl.dot(x, tl.trans(w1), input_precision=PRECISION)
        s = a * tl.sigmoid(a)  # padded hidden units: a = 0, s = 0
        for f0 in range(0, D, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            ok, at = row_ok[:, None] & (cols < D)[None, :], rows[:, None] * D + cols[None, :]
            w_ok = (hidden < H)[:, None] & (cols < D)[None, :]
            w2t = tl.load(w2_ptr + cols[None, :] * H + hidden[:, None], mask=w_ok, other=0.0)  # W2^T block
            tl.store(out_ptr + at, tl.load(out_ptr + at, mask=ok, other=0.0)
                     + tl.dot(s, w2t, input_precision=PRECISION), mask=ok)
        tl.debug_barrier()  # the next hidden block reads what this one stored


@triton.jit
def _mlp_fwd(xk_ptr, wk1_ptr, bk1_ptr, wk2_ptr, bk2_ptr, outk_ptr, xv_ptr, wv1_ptr, bv1_ptr, wv2_ptr, bv2_ptr,
             outv_ptr, N, DK, HK, DV, HV, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr,
             PRECISION: tl.constexpr):
    """Program (row block, MLP): out = x + silu(x W1^T + b1) W2^T + b2 for BLOCK_N rows of the key (axis 1 = 0) or
    value (1) MLP."""
    if tl.program_id(1) == 0:
        _forward_rows(xk_ptr, wk1_ptr, bk1_ptr, wk2_ptr, bk2_ptr, outk_ptr, tl.program_id(0), N, DK, HK, BLOCK_N,
                      BLOCK_F, BLOCK_H, PRECISION)
    else:
        _forward_rows(xv_ptr, wv1_ptr, bv1_ptr, wv2_ptr, bv2_ptr, outv_ptr, tl.program_id(0), N, DV, HV, BLOCK_N,
                      BLOCK_F, BLOCK_H, PRECISION)


@triton.jit
def _accumulate(ptr, value, ok, first):
    """ptr <- value on a program's first row block, ptr + value after: a partial kept in its slot, not registers."""
    if first:
        tl.store(ptr, value, mask=ok)
    else:
        _add_into(ptr, value, ok)


@triton.jit
def _backward_rows(x_ptr, g_ptr, w1_ptr, b1_ptr, w2_ptr, dx_ptr, slot_ptr, program, programs, N, D, H,
                   BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """This program's rows (blocks program, program + programs, ...): their dx, and the partial weight gradients
    over them summed in ``slot_ptr``: dW1 (H, D), db1 (H), dW2 (D, H), db2 (D), in that order. Per row block and
    hidden block, a and g W2 are summed over feature blocks first, then each feature block's products follow."""
    blocks = tl.cdiv(N, BLOCK_N)
    for block in range(program, blocks, programs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        first = block == program
        for h0 in range(0, H, BLOCK_H):
            hidden = h0 + tl.arange(0, BLOCK_H)
            hidden_ok = hidden < H
            a = tl.zeros((BLOCK_N, BLOCK_H), dtype=x_ptr.dtype.element_ty) \
                + tl.load(b1_ptr + hidden, mask=hidden_ok, other=0.0)[None, :]
            g_w2 = tl.zeros((BLOCK_N, BLOCK_H), dtype=x_ptr.dtype.element_ty)
            for f0 in range(0, D, BLOCK_F):
                cols = f0 + tl.arange(0, BLOCK_F)
                ok, at = row_ok[:, None] & (cols < D)[None, :], rows[:, None] * D + cols[None, :]
                w_ok = hidden_ok[:, None] & (cols < D)[None, :]
                w1 = tl.load(w1_ptr + hidden[:, None] * D + cols[None, :], mask=w_ok, other=0.0)
                w2t = tl.load(w2_ptr + cols[None, :] * H + hidden[:, None], mask=w_ok, other=0.0)  # W2^T block
                a += tl.dot(tl.load(x_ptr + at, mask=ok, other=0.0), tl.trans(w1), input_precision=PRECISION)
                g_w2 += tl.dot(tl.load(g_ptr + at, mask=ok, other=0.0), tl.trans(w2t), input_precision=PRECISION)
            gate = tl.sigmoid(a)
            d_a = g_w2 * gate * (1.0 + a * (1.0 - gate))  # padded rows: g = 0, so they add nothing
            _accumulate(slot_ptr + H * D + hidden, tl.sum(d_a, 0), hidden_ok, first)  # db1
            for f0 in range(0, D, BLOCK_F):
                cols = f0 + tl.arange(0, BLOCK_F)
                col_ok = cols < D
                ok, at = row_ok[:, None] & col_ok[None, :], rows[:, None] * D + cols[None, :]
                w_ok = hidden_ok[:, None] & col_ok[None, :]
                x = tl.load(x_ptr + at, mask=ok, other=0.0)
                g = tl.load(g_ptr + at, mask=ok, other=0.0)
                w1 = tl.load(w1_ptr + hidden[:, None] * D + cols[None, :], mask=w_ok, other=0.0)
                _accumulate(slot_ptr + hidden[:, None] * D + cols[None, :],
                            tl.dot(tl.trans(d_a), x, input_precision=PRECISION), w_ok, first)  # dW1
                _accumulate(slot_ptr + H * D + H + cols[None, :] * H + hidden[:, None],
                            tl.dot(tl.trans(a * gate), g, input_precision=PRECISION), w_ok, first)  # dW2 (as W2^T)
                if h0 == 0:  # the residual's share, and b2's
                    _accumulate(slot_ptr + 2 * H * D + H + cols, tl.sum(g, 0), col_ok, first)
                    d_x = g
                else:
                    d_x = tl.load(dx_ptr + at, mask=ok, other=0.0)
                tl.store(dx_ptr + at, d_x + tl.dot(d_a, w1, input_precision=PRECISION), mask=ok)
            tl.debug_barrier()  # the next hidden block (or row block) reads what this one stored


@triton.jit
def _mlp_bwd(xk_ptr, gk_ptr, wk1_ptr, bk1_ptr, wk2_ptr, dxk_ptr, xv_ptr, gv_ptr, wv1_ptr, bv1_ptr, wv2_ptr, dxv_ptr,
             partial_ptr, N, DK, HK, DV, HV, SLOT, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
             BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """Program (p, MLP): dx of its row blocks and its partial weight gradients, into slot (p, MLP) of ``partial``
    (P, 2, SLOT)."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    slot_ptr = partial_ptr + (program * 2 + tl.program_id(1)) * SLOT
    if tl.program_id(1) == 0:
        _backward_rows(xk_ptr, gk_ptr, wk1_ptr, bk1_ptr, wk2_ptr, dxk_ptr, slot_ptr, program, programs, N, DK, HK,
                       BLOCK_N, BLOCK_F, BLOCK_H, PRECISION)
    else:
        _backward_rows(xv_ptr, gv_ptr, wv1_ptr, bv1_ptr, wv2_ptr, dxv_ptr, slot_ptr, program, programs, N, DV, HV,
                       BLOCK_N, BLOCK_F, BLOCK_H, PRECISION)


def scope_reason(x: Tensor, y: Tensor, key_mlp: ResidualMLPWeights, value_mlp: ResidualMLPWeights) -> str | None:
    """Why the kernels cannot take this pair of MLPs (None: they can)."""
    dtypes = {t.dtype for t in (x, y, *vars(key_mlp).values(), *vars(value_mlp).values())}
    if len(dtypes) > 1 or dtypes.pop() not in (torch.float32, torch.float64):
        return f"inputs {x.dtype} / {y.dtype} and weights {key_mlp.up_weight.dtype}: the kernels take fp32 or fp64"
    return None


def _widths(x, y, wk1, wv1) -> tuple:
    """(dk, hk, dv, hv): each MLP's width and hidden width."""
    return x.shape[-1], wk1.shape[0], y.shape[-1], wv1.shape[0]


def _launch_options(x, widths, rows: int, warps: int, precision: str) -> dict:
    dk, hk, dv, hv = widths
    return dict(BLOCK_N=rows, BLOCK_F=tile_edge(max(dk, dv), FEATURE_BLOCK),
                BLOCK_H=tile_edge(max(hk, hv), HIDDEN_BLOCK),
                PRECISION="ieee" if x.dtype == torch.float64 else precision, num_warps=warps, num_stages=1)


def _slot(dk, hk, dv, hv) -> int:
    """Elements of one program's partial gradients, the wider MLP's: dW1, db1, dW2, db2."""
    return max(2 * h * d + h + d for d, h in ((dk, hk), (dv, hv)))


@kernel_op(__name__, "residual_mlps_forward")
def _residual_mlps_forward(x: Tensor, wk1: Tensor, bk1: Tensor, wk2: Tensor, bk2: Tensor, y: Tensor, wv1: Tensor,
                           bv1: Tensor, wv2: Tensor, bv2: Tensor, precision: str) -> list[Tensor]:
    """[key MLP(x), value MLP(y)] for x (N, dk), y (N, dv), contiguous."""
    rows = x.shape[0]
    out_x, out_y = torch.empty_like(x), torch.empty_like(y)
    if rows:
        widths = _widths(x, y, wk1, wv1)
        _mlp_fwd[(triton.cdiv(rows, FORWARD_ROWS), 2)](x, wk1, bk1, wk2, bk2, out_x, y, wv1, bv1, wv2, bv2, out_y,
                                                       rows, *widths, **_launch_options(x, widths, FORWARD_ROWS,
                                                                                        FORWARD_WARPS, precision))
    return [out_x, out_y]


@_residual_mlps_forward.register_fake
def _(x, wk1, bk1, wk2, bk2, y, wv1, bv1, wv2, bv2, precision):
    return [torch.empty_like(x), torch.empty_like(y)]


@kernel_op(__name__, "residual_mlps_backward")
def _residual_mlps_backward(x: Tensor, wk1: Tensor, bk1: Tensor, wk2: Tensor, y: Tensor, wv1: Tensor, bv1: Tensor,
                            wv2: Tensor, g_x: Tensor, g_y: Tensor, precision: str) -> list[Tensor]:
    """[dx, dy, the weight gradients (2, SLOT): per MLP dW1, db1, dW2, db2 flat, summed over the programs]."""
    rows = x.shape[0]
    widths = _widths(x, y, wk1, wv1)
    d_x, d_y = torch.empty_like(x), torch.empty_like(y)
    if not rows:
        return [d_x, d_y, x.new_zeros(2, _slot(*widths))]
    programs = min(triton.cdiv(rows, BACKWARD_ROWS), MAX_PROGRAMS)
    partial = x.new_empty(programs, 2, _slot(*widths))  # every element written by its program
    _mlp_bwd[(programs, 2)](x, g_x, wk1, bk1, wk2, d_x, y, g_y, wv1, bv1, wv2, d_y, partial, rows, *widths,
                            partial.shape[-1], **_launch_options(x, widths, BACKWARD_ROWS, BACKWARD_WARPS, precision))
    return [d_x, d_y, partial.sum(0)]


@_residual_mlps_backward.register_fake
def _(x, wk1, bk1, wk2, y, wv1, bv1, wv2, g_x, g_y, precision):
    return [torch.empty_like(x), torch.empty_like(y), x.new_empty(2, _slot(*_widths(x, y, wk1, wv1)))]


def _save_inputs(ctx, inputs, output):
    x, wk1, bk1, wk2, _, y, wv1, bv1, wv2, _, precision = inputs
    ctx.save_for_backward(x, wk1, bk1, wk2, y, wv1, bv1, wv2)
    ctx.precision = precision


def _gradients(ctx, grads):
    x, wk1, bk1, wk2, y, wv1, bv1, wv2 = ctx.saved_tensors
    g_x, g_y = grads  # materialised: an output without a gradient gets zeros
    d_x, d_y, weights = _residual_mlps_backward(x, wk1, bk1, wk2, y, wv1, bv1, wv2, g_x.contiguous(),
                                                g_y.contiguous(), ctx.precision)
    grads = []
    for flat, (d, h) in zip(weights, ((x.shape[-1], wk1.shape[0]), (y.shape[-1], wv1.shape[0]))):
        grads += [flat[:h * d].view(h, d), flat[h * d:h * d + h], flat[h * d + h:2 * h * d + h].view(d, h),
                  flat[2 * h * d + h:2 * h * d + h + d]]
    return (d_x, *grads[:4], d_y, *grads[4:], None)


_residual_mlps_forward.register_autograd(_gradients, setup_context=_save_inputs)


def residual_mlps_triton(key_mlp: ResidualMLPWeights, value_mlp: ResidualMLPWeights, x: Tensor, y: Tensor,
                         precision: str = FP32_DOTS) -> tuple[Tensor, Tensor]:
    """(key_mlp(x), value_mlp(y)) on the kernels, x (..., dk) and y (..., dv) with the same leading shape; where
    ``scope_reason`` says they cannot, the PyTorch MLPs. ``precision``: the dots' operands for fp32 inputs."""
    if scope_reason(x, y, key_mlp, value_mlp) is not None:
        return key_mlp(x), value_mlp(y)
    out_x, out_y = _residual_mlps_forward(
        x.reshape(-1, x.shape[-1]).contiguous(), *(t.contiguous() for t in (key_mlp.up_weight, key_mlp.up_bias,
                                                                         key_mlp.down_weight, key_mlp.down_bias)),
        y.reshape(-1, y.shape[-1]).contiguous(), *(t.contiguous() for t in (value_mlp.up_weight, value_mlp.up_bias,
                                                                         value_mlp.down_weight, value_mlp.down_bias)),
        precision)
    return out_x.view(x.shape), out_y.view(y.shape)
