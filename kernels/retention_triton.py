"""A linear attention's read divided by its normaliser, as one Triton launch forward and one backward.

kernels/retention.py ``normalised_read`` is the math, the CPU path and the reference. Per query, from its read
[n (dv), d] and eps (eps0, or eps0 min(e^-offset, 1e30) with the query features' log scale):

    o = n / D,  D = max(d + eps, tiny);    l = log max(d, tiny) (+ offset)
    dn = g_o / D,   dd = -[d + eps >= tiny] (g_o . n) / D / D + [d >= tiny] g_l / d   (D^2 underflows at tiny)

(the clamps pass the gradient where they do not bite, as torch's do). Eager PyTorch spends a launch on each
op and gradient (the read's two slices among them); here each way is one. The read may be any view with a unit
feature stride (fla returns it as a permutation); a program takes a block of queries and every feature.
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

from .conventions import kernel_op, tile_edge

# A program's queries: (rows, dv + 1) tiles of at most 2,048 elements, at 4 warps (as kernels/window_combine_triton.py)
TILE_ELEMENTS, WARPS = 2048, 4


@triton.jit
def _block(read_ptr, offset_ptr, N, HEADS, LENGTH, SB, SH, ST, V, eps0, tiny, HAS_OFFSET: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's queries (B, heads, T flattened): (queries, their mask, the (query, feature) mask, the read's
    offsets, n, d, eps, offset) with n's padded features 0."""
    queries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    query_ok = queries < N
    batch, head, position = queries // (HEADS * LENGTH), (queries // LENGTH) % HEADS, queries % LENGTH
    base = batch * SB + head * SH + position * ST
    cols = tl.arange(0, BLOCK_V)
    ok = query_ok[:, None] & (cols < V)[None, :]
    numerator = tl.load(read_ptr + base[:, None] + cols[None, :], mask=ok, other=0.0)
    denominator = tl.load(read_ptr + base + V, mask=query_ok, other=1.0)
    offset = denominator * 0
    eps = offset + eps0
    if HAS_OFFSET:
        offset = tl.load(offset_ptr + queries, mask=query_ok, other=0.0)
        eps = eps0 * tl.minimum(tl.exp(-offset), 1e30)
    return queries, query_ok, ok, cols, numerator, denominator, eps, offset


@triton.jit
def _read_fwd(read_ptr, offset_ptr, out_ptr, log_ptr, N, HEADS, LENGTH, SB, SH, ST, V, eps0, tiny,
              HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    queries, query_ok, ok, cols, numerator, denominator, eps, offset = _block(
        read_ptr, offset_ptr, N, HEADS, LENGTH, SB, SH, ST, V, eps0, tiny, HAS_OFFSET, BLOCK_N, BLOCK_V)
    scale = tl.maximum(denominator + eps, tiny)
    tl.store(out_ptr + queries[:, None] * V + cols[None, :], numerator / scale[:, None], mask=ok)
    tl.store(log_ptr + queries, tl.log(tl.maximum(denominator, tiny)) + offset, mask=query_ok)


@triton.jit
def _read_bwd(read_ptr, offset_ptr, g_out_ptr, g_log_ptr, d_read_ptr, N, HEADS, LENGTH, SB, SH, ST, V, eps0, tiny,
              HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    queries, query_ok, ok, cols, numerator, denominator, eps, _ = _block(
        read_ptr, offset_ptr, N, HEADS, LENGTH, SB, SH, ST, V, eps0, tiny, HAS_OFFSET, BLOCK_N, BLOCK_V)
    total = denominator + eps
    scale = tl.maximum(total, tiny)
    g_out = tl.load(g_out_ptr + queries[:, None] * V + cols[None, :], mask=ok, other=0.0)
    g_log = tl.load(g_log_ptr + queries, mask=query_ok, other=0.0)
    tl.store(d_read_ptr + queries[:, None] * (V + 1) + cols[None, :], g_out / scale[:, None], mask=ok)
    d_den = tl.where(total >= tiny, -tl.sum(g_out * numerator, axis=1) / scale / scale, 0.0) \
        + tl.where(denominator >= tiny, g_log / tl.maximum(denominator, tiny), 0.0)
    tl.store(d_read_ptr + queries * (V + 1) + V, d_den, mask=query_ok)


def _launch(read: Tensor, eps0: float, offset: Tensor | None) -> tuple:
    """(grid, the sizes and scalars both kernels take, constexprs) for read (B, G, g, T, dv + 1) whose head axes
    (G, g) are one strided axis (``normalised_read_triton`` makes them so)."""
    batch, groups, per_group, length, columns = read.shape
    block_v = tile_edge(columns)
    block_n = max(16, TILE_ELEMENTS // block_v)
    queries = batch * groups * per_group * length
    scalars = (queries, groups * per_group, length, read.stride(0), read.stride(2), read.stride(3), columns - 1,
               float(eps0), torch.finfo(read.dtype).tiny)
    return (triton.cdiv(queries, block_n),), scalars, dict(HAS_OFFSET=offset is not None, BLOCK_N=block_n,
                                                           BLOCK_V=block_v, num_warps=WARPS)


@kernel_op(__name__, "normalised_read_forward")
def _normalised_read_forward(read: Tensor, offset: Tensor | None, eps0: float) -> list[Tensor]:
    """[o (B, G, g, T, dv), log weight (B, G, g, T)], contiguous."""
    out = read.new_empty(*read.shape[:-1], read.shape[-1] - 1)
    log_weight = read.new_empty(read.shape[:-1])
    if read.numel():
        grid, scalars, constexprs = _launch(read, eps0, offset)
        _read_fwd[grid](read, offset, out, log_weight, *scalars, **constexprs)
    return [out, log_weight]


@_normalised_read_forward.register_fake
def _(read, offset, eps0):
    return [read.new_empty(*read.shape[:-1], read.shape[-1] - 1), read.new_empty(read.shape[:-1])]


@kernel_op(__name__, "normalised_read_backward")
def _normalised_read_backward(read: Tensor, offset: Tensor | None, g_out: Tensor, g_log: Tensor,
                              eps0: float) -> Tensor:
    """d read (B, G, g, T, dv + 1), contiguous."""
    d_read = read.new_empty(read.shape)
    if read.numel():
        grid, scalars, constexprs = _launch(read, eps0, offset)
        _read_bwd[grid](read, offset, g_out, g_log, d_read, *scalars, **constexprs)
    return d_read


@_normalised_read_backward.register_fake
def _(read, offset, g_out, g_log, eps0):
    return read.new_empty(read.shape)


def _save(ctx, inputs, output):
    read, offset, ctx.eps0 = inputs
    ctx.save_for_backward(read, offset)


def _gradients(ctx, grads):
    read, offset = ctx.saved_tensors
    g_out, g_log = grads  # materialised: an output without a gradient gets zeros
    return _normalised_read_backward(read, offset, g_out.contiguous(), g_log.contiguous(), ctx.eps0), None, None


_normalised_read_forward.register_autograd(_gradients, setup_context=_save)


def normalised_read_triton(read: Tensor, eps0: float, offset: Tensor | None) -> tuple[Tensor, Tensor]:
    """``retention.normalised_read``'s result on the kernels: read (B, G, g, T, dv + 1), offset (B, G, g, T) or
    None (detached: no gradient reaches it)."""
    if read.stride(-1) != 1 or read.stride(2) * read.shape[2] != read.stride(1):
        read = read.contiguous()
    out, log_weight = _normalised_read_forward(read, None if offset is None else offset.detach().contiguous(),
                                               float(eps0))
    return out, log_weight
