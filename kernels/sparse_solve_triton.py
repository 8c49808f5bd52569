"""GLTM's sparse feedback solve ``(I - B) s = f`` as one Triton launch forward and one backward.

kernels/feedback_solve.py ``sparse_solve`` is the entry, and its chunked PyTorch form (``_SparseFeedbackSolve``) the
reference. Row t of B has ``weights`` (K) on the rows ``support`` (K) of [past, new] (-1: none; each strictly
before t), so forward substitution is

    s_t = f_t + sum_k w[t, k] s[support[t, k]]                                  t = 0 .. T-1, in turn

and the backward, with the adjoint lam = (I - B)^-T g swept in reverse,

    lam_t = g_t + (what the later rows scattered onto t),   then   lam[support[t, k]] += w[t, k] lam_t
    dw[t, k] = lam_t . s[support[t, k]],   df = lam (new rows),   d past_s = lam (past rows)

One program per batch row (a batch row is a (sequence, head) pair in GLTM) walks its rows in turn, each step one
gather of K rows of s (one scatter-add of K rows of lam backward) across all D features. The PyTorch form issues
launches per chunk of rows each way, so its count grows with T; this is one whatever T. The walk is sequential, so a
long sequence with few rows and heads leaves SMs idle: the launches, not the GPU's arithmetic, are what it removes.
Scope: fp32 and fp64, D up to 256 (one tile), any K.
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

from .conventions import kernel_op, table_with_contiguous_rows, tile_edge

WARPS = 4
MAX_WIDTH = 256  # D in one tile: (K, D) gathers


@triton.jit
def _row_entries(idx_ptr, w_ptr, b, t, T, K, si_b, BLOCK_K: tl.constexpr):
    """Row t of batch row b: where its weights sit, their rows of [past, new] (clamped: 0 where none), weights, and
    which are real (``si_b``: the support's batch stride, 0 for one table shared by every batch row)."""
    slots = tl.arange(0, BLOCK_K)
    entry = (b * T + t) * K + slots
    index = tl.load(idx_ptr + b * si_b + t * K + slots, mask=slots < K, other=-1)
    weight = tl.load(w_ptr + entry, mask=slots < K, other=0.0)
    return entry, tl.maximum(index, 0), weight, index >= 0


@triton.jit
def _solve_fwd(f_ptr, w_ptr, idx_ptr, s_ptr, T, P, K, D, si_b, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Batch row b: s rows P .. P + T - 1 of s (B, P + T, D), its past rows already in place."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    rows_base = b * (P + T)
    for t in range(T):
        _, index, weight, read = _row_entries(idx_ptr, w_ptr, b, t, T, K, si_b, BLOCK_K)
        gathered = tl.load(s_ptr + (rows_base + index)[:, None] * D + cols[None, :],
                           mask=read[:, None] & (cols < D)[None, :], other=0.0)
        solved = tl.load(f_ptr + (b * T + t) * D + cols, mask=cols < D, other=0.0) \
            + tl.sum(weight[:, None] * gathered, axis=0)
        tl.store(s_ptr + (rows_base + P + t) * D + cols, solved, mask=cols < D)
        tl.debug_barrier()  # the next rows read this one


@triton.jit
def _solve_bwd(g_ptr, w_ptr, idx_ptr, s_ptr, lam_ptr, dw_ptr, T, P, K, D, si_b, BLOCK_K: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Batch row b, rows T - 1 .. 0: lam (B, P + T, D), zero-filled, ends as d [past_s, f]; dw (B, T, K)."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    rows_base = b * (P + T)
    for step in range(T):
        t = T - 1 - step
        at = (rows_base + P + t) * D + cols
        lam = tl.load(g_ptr + (b * T + t) * D + cols, mask=cols < D, other=0.0) \
            + tl.load(lam_ptr + at, mask=cols < D, other=0.0)
        tl.store(lam_ptr + at, lam, mask=cols < D)
        entry, index, weight, read = _row_entries(idx_ptr, w_ptr, b, t, T, K, si_b, BLOCK_K)
        rows = (rows_base + index)[:, None] * D + cols[None, :]
        mask = read[:, None] & (cols < D)[None, :]
        gathered = tl.load(s_ptr + rows, mask=mask, other=0.0)
        tl.store(dw_ptr + entry, tl.sum(gathered * lam[None, :], axis=1), mask=tl.arange(0, BLOCK_K) < K)
        tl.atomic_add(lam_ptr + rows, weight[:, None] * lam[None, :], mask=mask)  # a repeated row adds twice
        tl.debug_barrier()  # the earlier rows read what this one scattered


def _options(weights: Tensor, width: int) -> dict:
    return dict(BLOCK_K=tile_edge(max(weights.shape[-1], 1)), BLOCK_D=tile_edge(width), num_warps=WARPS)


@kernel_op(__name__, "sparse_solve_forward")
def _sparse_solve_forward(f: Tensor, weights: Tensor, support: Tensor, past_s: Tensor | None) -> Tensor:
    """s over [past, new] (B, P + T, D) for contiguous f (B, T, D), weights / support (B, T, K), past_s (B, P, D)."""
    batch, length, width = f.shape
    past = 0 if past_s is None else past_s.shape[1]
    solved = f.new_empty(batch, past + length, width)
    if past:
        solved[:, :past] = past_s
    if f.numel():
        _solve_fwd[(batch,)](f, weights, support, solved, length, past, weights.shape[-1], width, support.stride(0),
                             **_options(weights, width))
    return solved


@_sparse_solve_forward.register_fake
def _(f, weights, support, past_s):
    return f.new_empty(f.shape[0], (0 if past_s is None else past_s.shape[1]) + f.shape[1], f.shape[2])


@kernel_op(__name__, "sparse_solve_backward")
def _sparse_solve_backward(grad: Tensor, weights: Tensor, support: Tensor, solved: Tensor) -> list[Tensor]:
    """[lam (B, P + T, D): the gradient of [past_s, f]; d weights (B, T, K)]."""
    batch, length, width = grad.shape
    lam = torch.zeros_like(solved)
    d_weights = torch.empty_like(weights)
    if grad.numel():
        _solve_bwd[(batch,)](grad, weights, support, solved, lam, d_weights, length, solved.shape[1] - length,
                             weights.shape[-1], width, support.stride(0), **_options(weights, width))
    return [lam, d_weights]


@_sparse_solve_backward.register_fake
def _(grad, weights, support, solved):
    return [torch.empty_like(solved), torch.empty_like(weights)]


def _save(ctx, inputs, output):
    f, weights, support, past_s = inputs
    ctx.past = 0 if past_s is None else past_s.shape[1]
    ctx.save_for_backward(weights, support, output)


def _gradients(ctx, grad):
    weights, support, solved = ctx.saved_tensors
    past = ctx.past
    lam, d_weights = _sparse_solve_backward(grad[:, past:].contiguous(), weights, support, solved)
    return (lam if not past else lam[:, past:]), d_weights, None, (lam[:, :past] if past else None)


_sparse_solve_forward.register_autograd(_gradients, setup_context=_save)


def sparse_solve_triton(f: Tensor, weights: Tensor, support: Tensor, past_s: Tensor | None = None) -> Tensor:
    """``feedback_solve.sparse_solve``'s result on the kernels: f (B, T, D), weights / support (B, T, K) (the
    support's batch may be a broadcast), past_s (B, P, D) or None, in f's dtype (fp32 or fp64)."""
    solved = _sparse_solve_forward(f.contiguous(), weights.contiguous(), table_with_contiguous_rows(support),
                                   None if past_s is None else past_s.contiguous())
    return solved if past_s is None or not past_s.shape[1] else solved[:, past_s.shape[1]:]
