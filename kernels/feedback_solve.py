"""The triangular feedback solve shared by Sessa (and GLTM): ``(I - B) s = f``.

B is scalar, strictly lower-triangular and shared by every feature:

    B[t, j] = gain[t] * alpha[t, j],   alpha[t, :] = softmax_{j < t, key j real}(scale * <q_t, k_j>)

so ``s_t = f_t + gain_t * sum_{j<t} alpha[t, j] s_j`` (forward substitution). A row with no admissible key
(t = 0, or only padding in its past) is all zeros, giving ``s_t = f_t``.

Every function here can continue from a cache: ``past_k`` (B, P, d) and ``past_s`` (B, P, D) hold the keys and
solved outputs of P earlier tokens, and the new rows are absolute positions P..P+T-1. ``key_mask`` (B, P+T) marks
real tokens (True) and padding (False); padded keys are never attended to.

Three implementations of one function:
- ``feedback_solve_dense``: the reference (dense masked softmax + ``solve_triangular``), O(T^2) memory.
- ``feedback_solve_recurrent``: the token-by-token recurrence, a second independent oracle for tests.
- ``feedback_solve_chunked``: query chunks of size C against all earlier keys, an intra-chunk C x C solve, and a
  hand-written backward that recomputes the softmax chunk by chunk: O(T*C + T*D) memory, never a T x T matrix.
``feedback_solve`` is the op's entry point: it checks the arguments and picks the path, the fused Triton kernel
(kernels/feedback_solve_triton.py, the same function as the chunked form) included.

GLTM restricts row t of B to a sparse support P(t) (kernels/token_patterns.py). The dense reference and the
recurrence take it as a boolean ``support`` mask; ``feedback_solve_sparse`` takes it as an index table (B, T, K) and
does block forward substitution with work proportional to the nonzeros: the softmax over the K gathered keys, the
entries in earlier chunks gathered, the entries inside the chunk scattered into the same C x C unit-triangular
solve (``solve_block`` / ``adjoint_block``, shared with the chunked dense solve above).

All accumulate in fp32 (fp64 stays fp64) and return s in that compute dtype: callers cast the layer output
to the activation dtype but keep (and cache) the fp32 s, so a decode step sees exactly the values a full
forward would have used.
"""

from __future__ import annotations

import torch

from .conventions import check_feedback_shapes, compute_dtype, data_checks, outside_autocast
from .dispatch import use_triton
from .sparse_attention import gather_rows, gathered_softmax_reference


def strict_past_softmax(
    logits: torch.Tensor, row_offset: int, key_mask: torch.Tensor | None, support: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax of ``logits`` (B, R, N) for absolute rows ``row_offset..row_offset+R-1`` over keys ``j < row``
    (and, with ``support`` (B, R, N) bool, only where it is True).

    Masked entries (the diagonal, the future, padded keys) are exactly 0; rows with no admissible key are all 0.
    """
    rows, n_keys = logits.shape[-2], logits.shape[-1]
    row_pos = torch.arange(row_offset, row_offset + rows, device=logits.device)
    allowed = torch.arange(n_keys, device=logits.device)[None, :] < row_pos[:, None]  # (R, N)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :n_keys]  # (B, R, N)
    if support is not None:
        allowed = allowed & support
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits = logits.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # empty rows: avoid NaN, zeroed below
    return torch.softmax(logits, dim=-1).masked_fill(~allowed, 0.0)


def feedback_weights(q, keys, gain, row_offset, key_mask, scale, support=None):
    """Rows of B = gain * alpha for queries ``q`` (B, R, d) at absolute rows ``row_offset..`` over ``keys`` (B, N, d)."""
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
    return gain[..., None] * strict_past_softmax(logits, row_offset, key_mask, support)


def solve_block(weights, rhs):
    """(I - W) s = rhs for a strictly lower-triangular block W (B, C, C): forward substitution as one LAPACK call.
    unitriangular=True: the diagonal of -W is taken as 1 and never read."""
    return torch.linalg.solve_triangular(-weights, rhs, upper=False, left=True, unitriangular=True)


def adjoint_block(weights, rhs):
    """(I - W)^T lam = rhs: the same block's adjoint (a backward substitution), for the backward passes."""
    return torch.linalg.solve_triangular(-weights.transpose(-1, -2), rhs, upper=True, left=True, unitriangular=True)


def feedback_solve_dense(f, q, k, gain, key_mask=None, past_k=None, past_s=None, scale=None, support=None):
    """Reference: the official algorithm (dense masked softmax, unit-lower ``solve_triangular``), cache-aware.
    ``support`` (B, T, P+T) bool restricts each row's keys further (GLTM's patterns)."""
    past = check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cd = compute_dtype(f.dtype)
    keys = k if past_k is None else torch.cat([past_k, k], dim=1)
    weights = feedback_weights(q.to(cd), keys.to(cd), gain.to(cd), past, key_mask, scale, support)  # (B, T, P+T)
    rhs = f.to(cd)
    if past:
        rhs = rhs + torch.matmul(weights[..., :past], past_s.to(cd))  # B_{n,<} s_<
    return solve_block(weights[..., past:], rhs)


def feedback_solve_recurrent(f, q, k, gain, key_mask=None, past_k=None, past_s=None, scale=None, support=None):
    """Oracle: s_t = f_t + gain_t * sum_{j<t} alpha[t, j] s_j, one token at a time."""
    past = check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cd = compute_dtype(f.dtype)
    keys = (k if past_k is None else torch.cat([past_k, k], dim=1)).to(cd)
    outputs = [] if past_s is None else list(past_s.to(cd).unbind(1))
    for t in range(f.shape[1]):
        row = feedback_weights(q[:, t : t + 1].to(cd), keys[:, : past + t], gain[:, t : t + 1].to(cd),
                               past + t, None if key_mask is None else key_mask[:, : past + t], scale,
                               None if support is None else support[:, t : t + 1, : past + t])
        s_t = f[:, t].to(cd)
        if past + t:
            s_t = s_t + torch.matmul(row, torch.stack(outputs, dim=1))[:, 0]
        outputs.append(s_t)
    return torch.stack(outputs[past:], dim=1)


class _ChunkedFeedbackSolve(torch.autograd.Function):
    """Forward substitution by query chunks; the backward recomputes each chunk's softmax (flash-attention style).

    Backward, with lam = (I - B)^-T g (a reverse chunk sweep):
      df = lam;  dB[t, j] = lam_t . s_j;  dgain_t = sum_j alpha[t, j] (lam_t . s_j) = lam_t . h_t;
      dlogits[t, j] = gain_t * alpha[t, j] * (lam_t . s_j - dgain_t)   (softmax backward);
      dq = scale * dlogits @ k;  dk = scale * dlogits^T @ q.
    """

    @staticmethod
    def forward(ctx, f, q, k, gain, key_mask, past_k, past_s, scale, chunk_size):
        cd = compute_dtype(f.dtype)
        batch, length, width = f.shape
        past = 0 if past_k is None else past_k.shape[1]
        q_cd, k_cd, gain_cd = q.to(cd), k.to(cd), gain.to(cd)
        past_k_cd, past_s_cd = (None, None) if not past else (past_k.to(cd), past_s.to(cd))
        s = torch.empty(batch, length, width, dtype=cd, device=f.device)  # the new rows' solved outputs (B, T, D)
        # The cached keys and outputs are read where they are, never copied beside the new ones: a decode step
        # (T = 1 after P cached tokens) reads P rows once instead of copying them (what dominated its time).
        for c0 in range(0, length, chunk_size):
            c1 = min(c0 + chunk_size, length)
            r0, r1 = past + c0, past + c1  # absolute rows of this chunk
            logits = torch.matmul(q_cd[:, c0:c1], k_cd[:, :c1].transpose(-1, -2))  # (B, C, c1) over the new keys
            if past:
                logits = torch.cat([torch.matmul(q_cd[:, c0:c1], past_k_cd.transpose(-1, -2)), logits], dim=-1)
            weights = gain_cd[:, c0:c1, None] * strict_past_softmax(logits * scale, r0, key_mask)  # (B, C, r1)
            rhs = f[:, c0:c1].to(cd)
            if past:  # f + B_old s_old, the add fused into the GEMM
                rhs = torch.baddbmm(rhs, weights[..., :past], past_s_cd)
            if c0:
                rhs = torch.baddbmm(rhs, weights[..., past:r0], s[:, :c0])
            s[:, c0:c1] = solve_block(weights[..., r0:r1], rhs)
        if any(ctx.needs_input_grad):  # the backward's (B, N, .) keys and outputs, past and new together
            keys, s_all = (k_cd, s) if not past else (torch.cat([past_k_cd, k_cd], 1), torch.cat([past_s_cd, s], 1))
            ctx.save_for_backward(q_cd, keys, gain_cd, key_mask, s_all)
        ctx.meta = (past, scale, chunk_size, f.dtype, q.dtype, k.dtype, gain.dtype,
                    None if past_k is None else (past_k.dtype, past_s.dtype))
        return s

    @staticmethod
    def backward(ctx, grad_s):
        q, keys, gain, key_mask, s_all = ctx.saved_tensors
        past, scale, chunk_size, f_dtype, q_dtype, k_dtype, gain_dtype, past_dtypes = ctx.meta
        length = q.shape[1]
        adjoint = torch.zeros_like(s_all)  # sum over later rows t of B[t, j] lam_t, accumulated per key row j
        adjoint[:, past:] = grad_s.to(s_all.dtype)
        d_q = torch.zeros_like(q)
        d_keys = torch.zeros_like(keys)
        d_gain = torch.zeros_like(gain)
        first_chunk = ((length - 1) // chunk_size) * chunk_size if length else 0
        for c0 in range(first_chunk, -1, -chunk_size):
            c1 = min(c0 + chunk_size, length)
            r0, r1 = past + c0, past + c1
            q_c, gain_c = q[:, c0:c1], gain[:, c0:c1]
            alpha = strict_past_softmax(torch.matmul(q_c, keys[:, :r1].transpose(-1, -2)) * scale, r0, key_mask)
            weights = gain_c[..., None] * alpha  # (B, C, r1)
            # (I - B_cc)^T lam = g_c + contributions of later rows; an upper unit-triangular solve.
            lam = adjoint_block(weights[..., r0:r1], adjoint[:, r0:r1])
            adjoint[:, r0:r1] = lam  # the rows of this chunk now hold df
            if r0:
                adjoint[:, :r0].baddbmm_(weights[..., :r0].transpose(-1, -2), lam)
            lam_dot_s = torch.matmul(lam, s_all[:, :r1].transpose(-1, -2))  # (B, C, r1)
            d_gain_c = (alpha * lam_dot_s).sum(-1)  # lam_t . h_t, without forming h = alpha @ s
            d_logits = gain_c[..., None] * alpha * (lam_dot_s - d_gain_c[..., None]) * scale
            d_q[:, c0:c1] = torch.matmul(d_logits, keys[:, :r1])
            d_keys[:, :r1].baddbmm_(d_logits.transpose(-1, -2), q_c)
            d_gain[:, c0:c1] = d_gain_c
        d_f = adjoint[:, past:].to(f_dtype)
        d_past_k = d_past_s = None
        if past_dtypes is not None:
            d_past_k, d_past_s = d_keys[:, :past].to(past_dtypes[0]), adjoint[:, :past].to(past_dtypes[1])
        return (d_f, d_q.to(q_dtype), d_keys[:, past:].to(k_dtype), d_gain.to(gain_dtype), None,
                d_past_k, d_past_s, None, None)


def feedback_solve_chunked(f, q, k, gain, key_mask=None, past_k=None, past_s=None, scale=None, chunk_size=128):
    """Exact chunked solve: equal to ``feedback_solve_dense`` to float tolerance, O(T*C) memory."""
    check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s)
    if chunk_size < 1:
        raise ValueError(f"feedback_solve: chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkedFeedbackSolve.apply(f, q, k, gain, key_mask, past_k, past_s, scale, chunk_size)


class _SparseFeedbackSolve(torch.autograd.Function):
    """(I - B) s = f with row t of B given as weights (B, T, K) on rows support (B, T, K) of [past, new] (-1: none),
    by chunks of C rows: entries in earlier chunks gathered into the right-hand side, entries inside the chunk
    scattered into a C x C block for ``solve_block``. Work O(T K D + T C D), memory O(T K + (P + T) D).

    Backward, with lam = (I - B)^-T g by chunks in reverse (``adjoint_block``, entries of later chunks scattered back
    onto the rows they read): df = lam, dweights[t, k] = lam_t . s_{support[t, k]}, dpast_s = the adjoint's past rows.
    """

    @staticmethod
    def forward(ctx, f, weights, support, past_s, chunk_size):
        batch, length, width = f.shape
        past = 0 if past_s is None else past_s.shape[1]
        s_all = f.new_zeros(batch, past + length, width)  # zeros: rows not solved yet are gathered with weight 0
        if past:
            s_all[:, :past] = past_s
        for c0 in range(0, length, chunk_size):
            c1 = min(c0 + chunk_size, length)
            earlier, inside, index, local = _split_chunk(weights, support, past + c0, past + c1, c0, c1)
            rhs = f[:, c0:c1] + torch.einsum("bck,bckd->bcd", earlier, gather_rows(s_all, index))
            s_all[:, past + c0:past + c1] = solve_block(_block(inside, local, c1 - c0), rhs)
        ctx.save_for_backward(weights, support, s_all)
        ctx.meta = (past, chunk_size)
        return s_all[:, past:].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_s):
        weights, support, s_all = ctx.saved_tensors
        past, chunk_size = ctx.meta
        length = weights.shape[1]
        adjoint = torch.zeros_like(s_all)
        adjoint[:, past:] = grad_s
        d_weights = torch.zeros_like(weights)
        for c0 in reversed(range(0, length, chunk_size)):
            c1 = min(c0 + chunk_size, length)
            earlier, inside, index, local = _split_chunk(weights, support, past + c0, past + c1, c0, c1)
            lam = adjoint_block(_block(inside, local, c1 - c0), adjoint[:, past + c0:past + c1])
            adjoint[:, past + c0:past + c1] = lam
            contribution = earlier[..., None] * lam[:, :, None, :]  # (B, C, K, D) onto the earlier rows it read
            adjoint.scatter_add_(1, index.flatten(1)[..., None].expand(-1, -1, lam.shape[-1]),
                                 contribution.flatten(1, 2))
            read = torch.einsum("bcd,bckd->bck", lam, gather_rows(s_all, index))  # lam_t . s_j
            d_weights[:, c0:c1] = read * (support[:, c0:c1] >= 0)
        return adjoint[:, past:], d_weights, None, (adjoint[:, :past] if past else None), None


def _split_chunk(weights, support, r0, r1, c0, c1):
    """A chunk's entries: weights on rows before the chunk, weights inside it, the (clamped) row indices, and the
    in-chunk column of each entry."""
    rows, w = support[:, c0:c1], weights[:, c0:c1]
    earlier = w * ((rows >= 0) & (rows < r0))
    inside = w * (rows >= r0)
    return earlier, inside, rows.clamp(min=0), (rows - r0).clamp(min=0)


def _block(inside, local, size):
    """The chunk's strictly lower-triangular block (B, C, C) from its in-chunk entries."""
    return inside.new_zeros(*inside.shape[:2], size).scatter_add_(2, local, inside)


@outside_autocast
def feedback_solve_sparse(f, q, k, gain, support, past_k=None, past_s=None, scale=None, chunk_size=64,
                          method="chunked"):
    """(I - B) s = f with B[t, j] = gain_t * softmax_{j in support[t]}(scale <q_t, k_j>): f (B, T, D), q / k (B, T, d),
    gain (B, T), support (B, T, K) indices into the P + T rows [past, new] (each < P + t: strictly past; -1: none).
    Equal to ``feedback_solve_dense`` with the same support as a mask (``method="dense"`` runs that, the
    reference); the chunked form never forms a T x T tensor."""
    if method == "dense":
        rows = (0 if past_k is None else past_k.shape[1]) + f.shape[1]
        mask = (support[..., None] == torch.arange(rows, device=support.device)).any(-2)  # (B, T, P + T)
        return feedback_solve_dense(f, q, k, gain, past_k=past_k, past_s=past_s, scale=scale, support=mask)
    if method != "chunked":
        raise ValueError(f"feedback_solve_sparse: method must be 'chunked' or 'dense', got {method!r}")
    batch, length, _ = f.shape
    if support.dim() != 3 or support.shape[:2] != (batch, length):
        raise ValueError(f"feedback_solve_sparse: support must be (batch, length, K) = ({batch}, {length}, K), got "
                         f"{tuple(support.shape)}")
    if chunk_size < 1:
        raise ValueError(f"feedback_solve: chunk_size must be >= 1, got {chunk_size}")
    check_feedback_shapes(f, q, k, gain, None, past_k, past_s)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cd = compute_dtype(f.dtype)
    keys = (k if past_k is None else torch.cat([past_k, k], dim=1)).to(cd)
    weights = gathered_softmax_reference(q.to(cd)[:, :, None], keys, support, scale, gain.to(cd)[..., None])[:, :, 0]
    return sparse_solve(f, weights, support, past_s, chunk_size)


def sparse_solve(f, weights, support, past_s=None, chunk_size=64, backend="auto"):
    """The solve of ``feedback_solve_sparse`` from B's entries: row t of B has ``weights`` (B, T, K) on the rows
    ``support`` (B, T, K) of [past, new] (-1: none, each strictly past). For callers that compute the weights
    themselves (GLTM gathers keys once per KV head). One Triton launch each way where kernels/dispatch.py takes
    Triton for ``backend`` (kernels/sparse_solve_triton.py: fp32 / fp64, any width), else the chunked form."""
    past, length = (0 if past_s is None else past_s.shape[1]), f.shape[1]
    if weights.shape != support.shape or support.shape[:2] != f.shape[:2]:
        raise ValueError(f"sparse_solve: weights {tuple(weights.shape)} and support {tuple(support.shape)} must both "
                         f"be (batch, length, K) with (batch, length) = {tuple(f.shape[:2])}")
    if data_checks() and bool((support >= past + torch.arange(length, device=support.device)[:, None]).any()):
        raise ValueError("feedback_solve_sparse: a support entry is not strictly in the past of its row")
    cd = compute_dtype(f.dtype)
    f, weights, past_s = f.to(cd), weights.to(cd), None if past_s is None else past_s.to(cd)
    if use_triton("GLTM sparse solve", f.device, backend):
        from .sparse_solve_triton import sparse_solve_triton

        return sparse_solve_triton(f, weights, support, past_s)
    return _SparseFeedbackSolve.apply(f, weights, support, past_s, chunk_size)


SOLVERS = {"dense": feedback_solve_dense, "chunked": feedback_solve_chunked, "recurrent": feedback_solve_recurrent}


@outside_autocast
def feedback_solve(f, q, k, gain, *, key_mask=None, past_k=None, past_s=None, scale=None, method="chunked",
                   chunk_size=128, backend="auto"):
    """Solve ``(I - B) s = f``; every path gives the same result to float tolerance. The one entry point of the op:
    every choice of path is made here.

    method: "chunked" (training and prefill), "dense" (the reference, asked for by name) or "recurrent" (the token
    recurrence). "chunked" runs the fused Triton kernel (kernels/feedback_solve_triton.py) instead where
    kernels/dispatch.py allows it for ``backend`` ("auto" | "triton" | "torch", e.g. ``config.kernel_backend``):
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1, in fp32 / bf16 / fp16 (the kernels compute in fp32,
    so fp64 stays on the PyTorch path, or is an error when "triton" is forced).
    """
    if method not in SOLVERS:
        raise ValueError(f"feedback_solve: unknown method {method!r}; choose one of {sorted(SOLVERS)}")
    check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s)
    if method == "chunked" and use_triton("Sessa feedback solve", f.device, backend,
                                          check=lambda: _triton_unsupported(f)):
        from .feedback_solve_triton import feedback_solve_triton  # needs triton: imported only when chosen

        return feedback_solve_triton(f, q, k, gain, key_mask=key_mask, past_k=past_k, past_s=past_s, scale=scale,
                                     chunk_size=chunk_size)
    kwargs = {"chunk_size": chunk_size} if method == "chunked" else {}
    return SOLVERS[method](f, q, k, gain, key_mask=key_mask, past_k=past_k, past_s=past_s, scale=scale, **kwargs)


def _triton_unsupported(f) -> str | None:
    """Why the Triton solve cannot take this call (None: it can): only fp64 (the kernels take keys and rows of any
    width, in blocks)."""
    if compute_dtype(f.dtype) != torch.float32:
        return f"{f.dtype} inputs (the kernels compute in fp32)"
    return None
