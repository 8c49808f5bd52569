"""The window's and the memory's reads under one softmax normaliser, as one Triton launch forward and one backward.

kernels/window_combine.py ``combine_reads`` ("shared") is the math, the CPU path and the reference. Per query, with
s = sigmoid(log Z_m - log Z_w) where its memory has seen a token and 0 elsewhere:

    o = o_w + s (o_m - o_w)
    do_w = g (1 - s),  do_m = g s,  d log Z_m = -d log Z_w = s (1 - s) sum_v g_v (o_m - o_w)_v

Eager PyTorch spends a launch on each of its elementwise ops and their gradients; here each way is one. A program
takes a block of queries and every value feature. Reads (B, G, g, T, dv) and log weights (B, G, g, T) are read by
their batch, head and time strides (views of (B, T, H, dv) tensors, channels of a wider one: no copy); seen (B, T)
bool.
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

# A program's queries: (rows, dv) tiles of 1,024 elements at 4 warps, within issue 67's register budget on sm_90
# (docs/benchmarks.md): each read is addressed by its own strides, and at 2,048 the backward took 218-254.
TILE_ELEMENTS, WARPS = 1024, 4


@triton.jit
def _rows(ptr, index, s_b, s_h, s_t):
    """Each query's row of a tensor of batch / head / time strides s_*: a pointer a query, ``index`` its (batch,
    head, time) (int64)."""
    batch, head, time = index
    return ptr + batch * s_b + head * s_h + time * s_t


@triton.jit
def _block(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, N, HEADS_LENGTH, LENGTH, V,
           lb, lh, lt, llb, llh, llt, rb, rh, rt, rlb, rlh, rlt, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's queries: (queries, their (batch, head, time), their mask, s, the (query, feature) mask and
    columns, o_w, o_m), where s = sigmoid(log Z_m - log Z_w), 0 where the query's memory has seen nothing."""
    queries = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    query_ok = queries < N
    batch = queries // HEADS_LENGTH
    index = (batch.to(tl.int64), ((queries % HEADS_LENGTH) // LENGTH).to(tl.int64), (queries % LENGTH).to(tl.int64))
    seen = tl.load(seen_ptr + batch * LENGTH + queries % LENGTH, mask=query_ok, other=0) != 0
    z = tl.load(_rows(remote_log_ptr, index, rlb, rlh, rlt), mask=query_ok, other=0.0) \
        - tl.load(_rows(local_log_ptr, index, llb, llh, llt), mask=query_ok, other=0.0)
    e = tl.exp(-tl.abs(z))  # a sigmoid that overflows nowhere: an empty memory's log weight is about -700 (fp64)
    share = tl.where(seen, tl.where(z >= 0, 1 / (1 + e), e / (1 + e)), 0.0)
    cols = tl.arange(0, BLOCK_V)
    ok = query_ok[:, None] & (cols < V)[None, :]
    local = tl.load(_rows(local_ptr, index, lb, lh, lt)[:, None] + cols[None, :], mask=ok, other=0.0)
    remote = tl.load(_rows(remote_ptr, index, rb, rh, rt)[:, None] + cols[None, :], mask=ok, other=0.0)
    return queries, index, query_ok, share, ok, cols, local, remote


# Strides (batch, head, time) of each tensor, in argument order: a read's features are dense (stride 1).
@triton.jit(do_not_specialize=["lb", "lh", "lt", "llb", "llh", "llt", "rb", "rh", "rt", "rlb", "rlh", "rlt", "ob",
                               "oh", "ot"])
def _combine_fwd(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, out_ptr, N, HEADS_LENGTH, LENGTH, V,
                 lb, lh, lt, llb, llh, llt, rb, rh, rt, rlb, rlh, rlt, ob, oh, ot,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    _, index, _, share, ok, cols, local, remote = _block(
        local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, N, HEADS_LENGTH, LENGTH, V,
        lb, lh, lt, llb, llh, llt, rb, rh, rt, rlb, rlh, rlt, BLOCK_N, BLOCK_V)
    tl.store(_rows(out_ptr, index, ob, oh, ot)[:, None] + cols[None, :], local + share[:, None] * (remote - local),
             mask=ok)


@triton.jit(do_not_specialize=["lb", "lh", "lt", "llb", "llh", "llt", "rb", "rh", "rt", "rlb", "rlh", "rlt", "gb",
                               "gh", "gt", "dlb", "dlh", "dlt", "drb", "drh", "drt"])
def _combine_bwd(local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, g_ptr, d_local_ptr, d_local_log_ptr,
                 d_remote_ptr, d_remote_log_ptr, N, HEADS_LENGTH, LENGTH, V,
                 lb, lh, lt, llb, llh, llt, rb, rh, rt, rlb, rlh, rlt, gb, gh, gt, dlb, dlh, dlt, drb, drh, drt,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The log weights' gradients are written dense ((B, G, g, T), contiguous), the reads' by their strides."""
    queries, index, query_ok, share, ok, cols, local, remote = _block(
        local_ptr, local_log_ptr, remote_ptr, remote_log_ptr, seen_ptr, N, HEADS_LENGTH, LENGTH, V,
        lb, lh, lt, llb, llh, llt, rb, rh, rt, rlb, rlh, rlt, BLOCK_N, BLOCK_V)
    g = tl.load(_rows(g_ptr, index, gb, gh, gt)[:, None] + cols[None, :], mask=ok, other=0.0)
    tl.store(_rows(d_local_ptr, index, dlb, dlh, dlt)[:, None] + cols[None, :], g * (1 - share[:, None]), mask=ok)
    tl.store(_rows(d_remote_ptr, index, drb, drh, drt)[:, None] + cols[None, :], g * share[:, None], mask=ok)
    d_z = share * (1 - share) * tl.sum(g * (remote - local), axis=1)  # 0 where unseen: share = 0
    tl.store(d_remote_log_ptr + queries, d_z, mask=query_ok)
    tl.store(d_local_log_ptr + queries, -d_z, mask=query_ok)


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, time) strides of a (B, G, g, T[, dv]) tensor read by ``_by_strides``' rule."""
    return t.stride(0), t.stride(2) if t.shape[2] > 1 else t.stride(1), t.stride(3)


def _by_strides(t: Tensor) -> Tensor:
    """``t`` itself where the kernels can read it by ``_strides`` (its G and g dims merge into one of heads, a
    read's features are dense), else a dense copy: the window's and the memory's reads arrive as views of (B, T, H,
    dv) tensors or as channels of a wider one."""
    merges = t.shape[1] == 1 or t.shape[2] == 1 or t.stride(1) == t.shape[2] * t.stride(2)
    dense_features = t.dim() == 4 or t.shape[-1] == 1 or t.stride(-1) == 1
    return t if merges and dense_features else t.contiguous()


def _launch(local: Tensor) -> tuple[tuple, dict]:
    """The grid and the sizes both kernels take: (grid, (N, heads * T, T, dv)), constexprs."""
    batch, groups, per_group, length, width = local.shape
    queries = batch * groups * per_group * length
    block_v = tile_edge(width)
    block_n = max(8, TILE_ELEMENTS // block_v)
    return ((triton.cdiv(queries, block_n),), (queries, groups * per_group * length, length, width)), \
        dict(BLOCK_N=block_n, BLOCK_V=block_v, num_warps=WARPS)


@kernel_op(__name__, "shared_combine_forward")
def _shared_combine_forward(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor,
                            seen: Tensor) -> Tensor:
    """o (B, G, g, T, dv), laid out as ``local`` (module docstring; inputs as ``_by_strides`` passes them)."""
    out = torch.empty_like(local)
    if local.numel():
        (grid, sizes), constexprs = _launch(local)
        _combine_fwd[grid](local, local_log, remote, remote_log, seen, out, *sizes,
                           *(stride for t in (local, local_log, remote, remote_log, out) for stride in _strides(t)),
                           **constexprs)
    return out


@_shared_combine_forward.register_fake
def _(local, local_log, remote, remote_log, seen):
    return torch.empty_like(local)


@kernel_op(__name__, "shared_combine_backward")
def _shared_combine_backward(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor, seen: Tensor,
                             g: Tensor) -> list[Tensor]:
    """[d o_w, d log Z_w, d o_m, d log Z_m]: the reads' gradients laid out as the reads (``empty_like``), the log
    weights' dense."""
    grads = [torch.empty_like(local), local_log.new_empty(local_log.shape), torch.empty_like(remote),
             remote_log.new_empty(remote_log.shape)]
    if local.numel():
        (grid, sizes), constexprs = _launch(local)
        _combine_bwd[grid](local, local_log, remote, remote_log, seen, g, *grads, *sizes,
                           *(stride for t in (local, local_log, remote, remote_log, g, grads[0], grads[2])
                             for stride in _strides(t)), **constexprs)
    return grads


@_shared_combine_backward.register_fake
def _(local, local_log, remote, remote_log, seen, g):
    return [torch.empty_like(local), local_log.new_empty(local_log.shape), torch.empty_like(remote),
            remote_log.new_empty(remote_log.shape)]


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gradients(ctx, g):
    return (*_shared_combine_backward(*ctx.saved_tensors, _by_strides(g)), None)


_shared_combine_forward.register_autograd(_gradients, setup_context=_save)


def shared_combine_triton(local: Tensor, local_log: Tensor, remote: Tensor, remote_log: Tensor,
                          seen: Tensor) -> Tensor:
    """``window_combine.combine_reads(..., "shared")`` on the kernels: reads (B, G, g, T, dv) of one dtype, their
    log weights (B, G, g, T), seen (B, T) bool; each read and log weight taken by its strides where it can be."""
    return _shared_combine_forward(_by_strides(local), _by_strides(local_log.to(local.dtype)), _by_strides(remote),
                                   _by_strides(remote_log.to(local.dtype)), seen.contiguous())
