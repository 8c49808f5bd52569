"""The window's and the memory's reads under one softmax normaliser, as one Triton launch forward and one backward.

kernels/window_combine.py ``combine_reads`` ("shared") is the math, the CPU path and the reference. Per query, with
s = sigmoid(log Z_m - log Z_w) where its memory has seen a token and 0 elsewhere:

    o = o_w + s (o_m - o_w)
    do_w = g (1 - s),  do_m = g s,  d log Z_m = -d log Z_w = s (1 - s) sum_v g_v (o_m - o_w)_v

Eager PyTorch spends a launch on each of its elementwise ops and their gradients; here each way is one. A program
takes a block of queries and every value feature. Inputs are contiguous (B, G, g, T, dv) and (B, G, g, T); seen (B,
T) bool.
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

# A program's queries: (rows, dv) tiles of 2,048 elements at 4 warps, within issue 67's register budget on sm_90
# (docs/benchmarks.md); (32, 128) tiles were over it in the backward.
TILE_ELEMENTS, WARPS = 2048, 4


@triton.jit
def _block(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, N, HEADS_LENGTH, LENGTH, V,
           BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's queries: (queries, their mask, s, the (query, feature) mask and offsets, o_w, o_m), where
    s = sigmoid(log Z_m - log Z_w), 0 where the query's memory has seen nothing."""
    queries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    query_ok = queries < N
    seen = tl.load(seen_ptr + (queries // HEADS_LENGTH) * LENGTH + queries % LENGTH, mask=query_ok, other=0) != 0
    z = tl.load(remote_log_ptr + queries, mask=query_ok, other=0.0) - tl.load(local_log_ptr + queries,
                                                                              mask=query_ok, other=0.0)
    e = tl.exp(-tl.abs(z))  # a sigmoid that overflows nowhere: an empty memory's log weight is about -700 (fp64)
    share = tl.where(seen, tl.where(z >= 0, 1 / (1 + e), e / (1 + e)), 0.0)
    cols = tl.arange(0, BLOCK_V)
    ok, at = query_ok[:, None] & (cols < V)[None, :], queries[:, None] * V + cols[None, :]
    local = tl.load(local_ptr + at, mask=ok, other=0.0)
    remote = tl.load(remote_ptr + at, mask=ok, other=0.0)
    return queries, query_ok, share, ok, at, local, remote


@triton.jit
def _combine_fwd(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, out_ptr, N, HEADS_LENGTH, LENGTH, V,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    _, _, share, ok, at, local, remote = _block(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, N,
                                                HEADS_LENGTH, LENGTH, V, BLOCK_N, BLOCK_V)
    tl.store(out_ptr + at, local + share[:, None] * (remote - local), mask=ok)


@triton.jit
def _combine_bwd(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, g_ptr, d_local_ptr, d_local_log_ptr,
                 d_remote_ptr, d_remote_log_ptr, N, HEADS_LENGTH, LENGTH, V, BLOCK_N: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    queries, query_ok, share, ok, at, local, remote = _block(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr,
                                                             seen_ptr, N, HEADS_LENGTH, LENGTH, V, BLOCK_N, BLOCK_V)
    g = tl.load(g_ptr + at, mask=ok, other=0.0)
    tl.store(d_local_ptr + at, g * (1 - share[:, None]), mask=ok)
    tl.store(d_remote_ptr + at, g * share[:, None], mask=ok)
    d_z = share * (1 - share) * tl.sum(g * (remote - local), axis=1)  # 0 where unseen: share = 0
    tl.store(d_remote_log_ptr + queries, d_z, mask=query_ok)
    tl.store(d_local_log_ptr + queries, -d_z, mask=query_ok)


def _launch(local: Tensor) -> tuple[tuple, dict]:
    """The grid and the sizes both kernels take: (grid, (N, heads * T, T, dv)), constexprs."""
    batch, groups, per_group, length, width = local.shape
    queries = batch * groups * per_group * length
    block_v = tile_edge(width)
    block_n = max(16, TILE_ELEMENTS // block_v)
    return ((triton.cdiv(queries, block_n),), (queries, groups * per_group * length, length, width)), \
        dict(BLOCK_N=block_n, BLOCK_V=block_v, num_warps=WARPS)


@kernel_op(__name__, "shared_combine_forward")
def _shared_combine_forward(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor,
                            seen: Tensor) -> Tensor:
    """o (B, G, g, T, dv) for contiguous inputs (module docstring)."""
    out = torch.empty_like(local)
    if local.numel():
        (grid, sizes), constexprs = _launch(local)
        _combine_fwd[grid](local, local_log, remote, remote_log, seen, out, *sizes, **constexprs)
    return out


@_shared_combine_forward.register_fake
def _(local, local_log, remote, remote_log, seen):
    return torch.empty_like(local)


@kernel_op(__name__, "shared_combine_backward")
def _shared_combine_backward(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor, seen: Tensor,
                             g: Tensor) -> list[Tensor]:
    """[d o_w, d log Z_w, d o_m, d log Z_m]."""
    grads = [torch.empty_like(local), torch.empty_like(local_log), torch.empty_like(remote),
             torch.empty_like(remote_log)]
    if local.numel():
        (grid, sizes), constexprs = _launch(local)
        _combine_bwd[grid](local, local_log, remote, remote_log, seen, g, *grads, *sizes, **constexprs)
    return grads


@_shared_combine_backward.register_fake
def _(local, local_log, remote, remote_log, seen, g):
    return [torch.empty_like(local), torch.empty_like(local_log), torch.empty_like(remote),
            torch.empty_like(remote_log)]


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gradients(ctx, g):
    return (*_shared_combine_backward(*ctx.saved_tensors, g.contiguous()), None)


_shared_combine_forward.register_autograd(_gradients, setup_context=_save)


def shared_combine_triton(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor,
                          seen: Tensor) -> Tensor:
    """``window_combine.combine_reads(..., "shared")`` on the kernels: reads (B, G, g, T, dv) of one dtype, their
    log weights (B, G, g, T), seen (B, T) bool."""
    return _shared_combine_forward(local.contiguous(), local_log.to(local.dtype).contiguous(), remote.contiguous(),
                                   remote_log.to(local.dtype).contiguous(), seen.contiguous())
