"""GLTM's sparse feedback solve ``(I - B) s = f`` as one Triton launch forward and one backward, a chunk pipeline.

kernels/feedback_solve.py ``sparse_solve`` is the entry, and its chunked PyTorch form (``_SparseFeedbackSolve``) the
reference. Row t of B has ``weights`` (K) on the rows ``support`` (K) of [past, new] (-1: none; each strictly
before t), so forward substitution would be

    s_t = f_t + sum_k w[t, k] s[support[t, k]]                                  t = 0 .. T-1, in turn

and the backward, with the adjoint lam = (I - B)^-T g,

    lam = g + B^T lam,   dw[t, k] = lam_t . s[support[t, k]],   df = lam (new rows),   d past_s = lam (past rows)

Instead of a walk over the rows, the rows are solved CHUNK at a time. For a chunk's rows R = c0 .. c0 + C - 1 the
entries split into old ones (rows before c0: the past and earlier chunks, already solved) and the chunk's own, a
strictly lower C x C matrix W (a repeated entry adds up). Then

    (I - W) s_R = f_R + sum_{old entries} w s[support]

solved exactly by doubling: W is nilpotent (W^C = 0), so (I - W)^-1 = (I + W)(I + W^2)(I + W^4)... with
log2(C) factors, 2 log2(C) - 1 small ``tl.dot``s instead of C dependent row steps. The backward runs the chunks last
first: lam_R = (I - W)^-T (g_R + what later chunks scattered onto R), the transposed doubling, then dw of the
chunk's entries and lam's scatter onto its old entries' rows (atomic adds, the past's included: d past_s).

Programs: one per (batch row, block of FEATURE_BLOCK feature columns, chunk), all launched at once as a pipeline
(kernels/pipeline_triton.py): a chunk waits for the chunks before it (forward; after it, backward) to be published
before it reads them, so the chain of dependent steps is one chunk solve a chunk, not one row step a row, and a
(sequence, head) at 2K tokens is 128 programs, not 1. Scope: fp32 and fp64 (fp32 dots fp32-accurate), any D, any K.
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

from .conventions import dot_precision, kernel_op, table_with_contiguous_rows, tile_edge
from .pipeline_triton import claim, publish, ticket_and_progress, wait_for, zeroed_counters

WARPS = 4
CHUNK = 16  # rows a program solves at once (tl.dot's least edge; log2 C doublings)
FEATURE_BLOCK = 64  # feature columns a program takes: (C, 64) tiles, any width


@triton.jit
def _chunk_entries(idx_ptr, w_ptr, b, rows, row_ok, k, T, P, K, c0, si_b):
    """Entry k of the chunk's rows: its row of [past, new] (clamped to 0 where none), weight (0 where none), whether
    it is an old row (before the chunk: past or an earlier chunk) and its column of the chunk's own W (-1: none)."""
    index = tl.load(idx_ptr + b * si_b + rows * K + k, mask=row_ok, other=-1)
    weight = tl.load(w_ptr + (b * T + rows) * K + k, mask=row_ok & (index >= 0), other=0.0)
    old = (index >= 0) & (index < P + c0)
    return tl.maximum(index, 0), weight, old, tl.where(index >= P + c0, index - P - c0, -1)


@triton.jit(do_not_specialize=["T", "P", "N_CHUNKS"])
def _solve_fwd(f_ptr, w_ptr, idx_ptr, s_ptr, ticket_ptr, progress_ptr, T, P, K, D, si_b, N_CHUNKS, BLOCKS,
               CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, LOG_C: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c of batch row b, one block of columns: s rows P + c0 .. of s (B, P + T, D), its past rows in place."""
    b, block, chunk, progress_ptr = claim(ticket_ptr, progress_ptr, N_CHUNKS, BLOCKS)
    c0 = chunk * CHUNK
    rows = c0 + tl.arange(0, CHUNK)
    row_ok = rows < T
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    own = tl.arange(0, CHUNK)
    base = b * (P + T)
    w_own = tl.zeros((CHUNK, CHUNK), s_ptr.dtype.element_ty)  # W, strictly lower: built before the wait
    for k in range(K):
        _, weight, _, column = _chunk_entries(idx_ptr, w_ptr, b, rows, row_ok, k, T, P, K, c0, si_b)
        w_own += tl.where(column[:, None] == own[None, :], weight[:, None], 0.0)
    solved = tl.load(f_ptr + (b * T + rows)[:, None] * D + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                     other=0.0)
    stalled = wait_for(progress_ptr, chunk)  # every earlier chunk's rows (the old entries' reads)
    for k in range(K):  # the entries read again, not held: gathered in W's loop, ptxas spilled 8 bytes
        index, weight, old, _ = _chunk_entries(idx_ptr, w_ptr, b, rows, row_ok, k, T, P, K, c0, si_b)
        solved += weight[:, None] * tl.load(s_ptr + (base + index)[:, None] * D + cols[None, :],
                                            mask=old[:, None] & col_ok[None, :], other=0.0)
    for i in tl.static_range(LOG_C):  # (I - W)^-1 = prod_i (I + W^(2^i))
        solved += tl.dot(w_own, solved, input_precision=PRECISION)
        if i + 1 < LOG_C:
            w_own = tl.dot(w_own, w_own, input_precision=PRECISION)
    solved = tl.where(stalled == 0, solved, float("nan"))
    tl.store(s_ptr + (base + P + rows)[:, None] * D + cols[None, :], solved, mask=row_ok[:, None] & col_ok[None, :])
    publish(progress_ptr)  # the later chunks read these rows


@triton.jit(do_not_specialize=["T", "P", "N_CHUNKS"])
def _solve_bwd(g_ptr, w_ptr, idx_ptr, s_ptr, lam_ptr, dw_ptr, ticket_ptr, progress_ptr, T, P, K, D, si_b, N_CHUNKS,
               BLOCKS, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, LOG_C: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c of batch row b (the last chunk's ticket first), one block of columns: lam (B, P + T, D), zero-filled,
    ends as d [past_s, f]; dw (B, T, K), zero-filled, gets this block's share of each entry's gradient."""
    b, block, step, progress_ptr = claim(ticket_ptr, progress_ptr, N_CHUNKS, BLOCKS)
    chunk = N_CHUNKS - 1 - step
    c0 = chunk * CHUNK
    rows = c0 + tl.arange(0, CHUNK)
    row_ok = rows < T
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    own = tl.arange(0, CHUNK)
    base = b * (P + T)
    w_own = tl.zeros((CHUNK, CHUNK), s_ptr.dtype.element_ty)  # W, built before the wait
    for k in range(K):
        _, weight, _, column = _chunk_entries(idx_ptr, w_ptr, b, rows, row_ok, k, T, P, K, c0, si_b)
        w_own += tl.where(column[:, None] == own[None, :], weight[:, None], 0.0)
    stalled = wait_for(progress_ptr, step)  # every later chunk has scattered onto these rows
    at = (base + P + rows)[:, None] * D + cols[None, :]
    lam = tl.load(g_ptr + (b * T + rows)[:, None] * D + cols[None, :], mask=ok, other=0.0) \
        + tl.load(lam_ptr + at, mask=ok, other=0.0)
    for i in tl.static_range(LOG_C):  # (I - W)^-T = prod_i (I + (W^(2^i))^T)
        lam += tl.dot(tl.trans(w_own), lam, input_precision=PRECISION)
        if i + 1 < LOG_C:
            w_own = tl.dot(w_own, w_own, input_precision=PRECISION)
    lam = tl.where(stalled == 0, lam, float("nan"))
    tl.store(lam_ptr + at, lam, mask=ok)
    for k in range(K):
        index, weight, old, column = _chunk_entries(idx_ptr, w_ptr, b, rows, row_ok, k, T, P, K, c0, si_b)
        real = row_ok & ((column >= 0) | old)
        rows_k = (base + index)[:, None] * D + cols[None, :]
        read = tl.load(s_ptr + rows_k, mask=real[:, None] & col_ok[None, :], other=0.0)
        tl.atomic_add(dw_ptr + (b * T + rows) * K + k, tl.sum(read * lam, axis=1), mask=real)  # summed over blocks
        tl.atomic_add(lam_ptr + rows_k, weight[:, None] * lam, mask=old[:, None] & col_ok[None, :])
    publish(progress_ptr)  # the earlier chunks read what this one scattered


def _pipeline(batch: int, length: int, width: int, dtype: torch.dtype) -> tuple[tuple, tuple, dict, int]:
    """Either launch's grid, its (chunks, column blocks) arguments, constexprs, and its pipeline rows (batch row,
    column block): a program per (batch row, column block, chunk)."""
    block = tile_edge(width, FEATURE_BLOCK)
    chunks, blocks = triton.cdiv(length, CHUNK), triton.cdiv(width, block)
    constexprs = dict(CHUNK=CHUNK, BLOCK_D=block, LOG_C=(CHUNK - 1).bit_length(), PRECISION=dot_precision(dtype),
                      num_warps=WARPS)
    return (batch * blocks * chunks,), (chunks, blocks), constexprs, batch * blocks


@kernel_op(__name__, "sparse_solve_forward")
def _sparse_solve_forward(f: Tensor, weights: Tensor, support: Tensor, past_s: Tensor | None) -> Tensor:
    """s over [past, new] (B, P + T, D) for contiguous f (B, T, D), weights / support (B, T, K), past_s (B, P, D)."""
    batch, length, width = f.shape
    past = 0 if past_s is None else past_s.shape[1]
    solved = f.new_empty(batch, past + length, width)
    if past:
        solved[:, :past] = past_s
    if f.numel():
        grid, pipeline, constexprs, rows = _pipeline(batch, length, width, f.dtype)
        _solve_fwd[grid](f, weights, support, solved, *ticket_and_progress(zeroed_counters(rows, f.device)), length,
                         past, weights.shape[-1], width, support.stride(0), *pipeline, **constexprs)
    return solved


@_sparse_solve_forward.register_fake
def _(f, weights, support, past_s):
    return f.new_empty(f.shape[0], (0 if past_s is None else past_s.shape[1]) + f.shape[1], f.shape[2])


@kernel_op(__name__, "sparse_solve_backward")
def _sparse_solve_backward(grad: Tensor, weights: Tensor, support: Tensor, solved: Tensor) -> list[Tensor]:
    """[lam (B, P + T, D): the gradient of [past_s, f]; d weights (B, T, K)]."""
    batch, length, width = grad.shape
    lam = torch.zeros_like(solved)
    d_weights = torch.zeros_like(weights)  # summed over the column blocks
    if grad.numel():
        grid, pipeline, constexprs, rows = _pipeline(batch, length, width, grad.dtype)
        _solve_bwd[grid](grad, weights, support, solved, lam, d_weights,
                         *ticket_and_progress(zeroed_counters(rows, grad.device)), length, solved.shape[1] - length,
                         weights.shape[-1], width, support.stride(0), *pipeline, **constexprs)
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
