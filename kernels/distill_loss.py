"""The distillation loss from final hidden states, in row chunks: never B x T x V logits at once.

    loss = T^2 KL(softmax(z_t / T) || softmax(z_s / T)) averaged over the N = B*T rows
           + ce_weight * CE(z_s, next token) averaged over the rows that have a target
    z_s = h_s W_s^T (the student's lm_head), z_t = h_t W_t^T (the teacher's, no gradient)

The dense form (``distillation_loss_dense``, the reference) holds z_s, z_t, both softmaxes and their gradient: at a
128K vocabulary and 2 x 2,048 tokens each is 2.1 GB in fp32. ``chunked_distillation_loss`` takes ``chunk_rows``
rows at a time, in fp32 only inside a chunk, and computes the gradients of h_s (and of W_s when it trains) in the
same pass, as Liger-Kernel's fused linear losses do: the backward only scales what the forward kept, so the logits
are computed once. Extra memory: one (chunk_rows, V) block of each side, plus a gradient the size of h_s (and W_s).

``distillation_loss`` is the entry: on CUDA, where Liger-Kernel is installed, its fused linear JSD (beta 0: the
forward KL(teacher || student)) and fused linear cross-entropy (kernels/dispatch.py ``library_kernel``, one log
line); otherwise the chunked PyTorch path, which is also the oracle of the Liger path's test.

Cached teacher targets (``stage2.teacher_top_k``): ``teacher_top_k`` keeps each token's k most likely next tokens
and their log-probabilities, computed once for a dataset; ``top_k_distillation_loss`` then needs no teacher. The
teacher's mass r beyond its top k K is one tail bucket matched against the student's mass Q off K:

    KL_k = sum_{j in K} p_j log(p_j / q_j) + r log(r / Q),   d KL_k / du_j = q_j - p_j (j in K), q_j (1 - r / Q) (not)

with u = z_s / T; KL_k <= KL (grouping the tail can only lose divergence), with equality at k = V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conventions import compute_dtype
from .dispatch import library_kernel

IGNORE = -100  # a target that counts for nothing (padding, the last position)


def distillation_loss_dense(h_s, w_s, h_t, w_t, targets, temperature: float = 1.0, ce_weight: float = 0.0):
    """The reference: the whole (N, V) logits. h_s (N, H), w_s (V, H), h_t (N, Ht), w_t (V, Ht), targets (N,) long
    (IGNORE: no CE term) -> (loss, kl, ce) scalars in fp32 (fp64 stays fp64)."""
    dtype = compute_dtype(h_s.dtype)
    z_s = (h_s @ w_s.T).to(dtype)
    with torch.no_grad():
        z_t = (h_t @ w_t.T).to(dtype)
    kl = F.kl_div(F.log_softmax(z_s / temperature, -1), F.log_softmax(z_t / temperature, -1), log_target=True,
                  reduction="batchmean") * temperature**2
    ce = F.cross_entropy(z_s, targets, ignore_index=IGNORE) if (targets != IGNORE).any() else z_s.new_zeros(())
    return kl + ce_weight * ce, kl.detach(), ce.detach()


def _dense_teacher_kl(log_p_s, h_t, w_t, temperature):
    """sum over the chunk's rows of KL(p_t || p_s), and d/du (u = z_s / T) of it, p_s - p_t, written over log_p_s
    (in place: a (c, V) block is 0.5 GB at c = 1024, V = 128K)."""
    log_p_t = torch.log_softmax((h_t @ w_t.T).to(log_p_s.dtype) / temperature, -1)
    p_t = log_p_t.exp()
    log_p_t.sub_(log_p_s).mul_(p_t)
    kl = log_p_t.sum()
    del log_p_t
    return kl, log_p_s.exp_().sub_(p_t)


def _top_k_teacher_kl(log_p_s, index, log_p_top):
    """The same against the teacher's top k log-probabilities (``teacher_top_k``), the rest of its mass r in one tail
    bucket: KL = sum_K p (log p - log q) + r (log r - log Q), Q = the student's mass off K; d/du = q - p on K and
    q - r q / Q off K. At k = V there is no tail and this is the full KL."""
    index = index.long()
    p_top = log_p_top.exp()
    log_q_top = log_p_s.gather(1, index)
    kl = (p_top * (log_p_top - log_q_top)).sum()
    grad = log_p_s.exp()
    if index.shape[1] < log_p_s.shape[1]:
        tail = (1 - p_top.sum(1)).clamp_min(0)
        log_q_tail = log_p_s.scatter(1, index, float("-inf")).logsumexp(1)
        kl = kl + (torch.xlogy(tail, tail) - tail * log_q_tail).sum()
        grad -= (log_p_s - log_q_tail[:, None]).exp_().mul_(tail[:, None])
    return kl, grad.scatter_(1, index, log_q_top.exp() - p_top)


class _ChunkedDistillationLoss(torch.autograd.Function):
    """The loss and its gradients in one pass over chunks of rows. ``teacher_kl(start, stop, log_p_s)`` gives the
    chunk's summed KL and its gradient in u = z_s / T (``_dense_teacher_kl`` from the teacher's hidden states,
    ``_top_k_teacher_kl`` from cached targets); the CE and the gradients of h_s and w_s are shared."""

    @staticmethod
    def forward(ctx, h_s, w_s, targets, teacher_kl, temperature, ce_weight, chunk_rows, with_ce):
        rows = h_s.shape[0]
        dtype = compute_dtype(h_s.dtype)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h_s) if want_h else None
        grad_w = torch.zeros(w_s.shape, dtype=dtype, device=w_s.device) if want_w else None
        kl = torch.zeros((), dtype=dtype, device=h_s.device)
        ce = torch.zeros((), dtype=dtype, device=h_s.device)
        n_ce = (targets != IGNORE).sum().clamp_min(1).to(dtype)  # a tensor: no host read
        for start in range(0, rows, chunk_rows):
            h = h_s[start:start + chunk_rows]
            z_s = (h @ w_s.T).to(dtype)  # (c, V): the matmul in the weights' dtype, the rest in fp32
            chunk_kl, grad_z = teacher_kl(start, start + h.shape[0], torch.log_softmax(z_s / temperature, -1))
            kl += chunk_kl
            grad_z.mul_(temperature / rows)  # d(T^2 KL / N) / dz_s = T (p_s - p_t) / N
            if with_ce or ce_weight:  # every row of the chunk, the ones without a target masked (no host read)
                target = targets[start:start + chunk_rows]
                real = (target != IGNORE).to(dtype)
                picked = target.clamp_min(0)[:, None]
                log_q = torch.log_softmax(z_s, -1)  # (c, V)
                ce -= (log_q.gather(1, picked)[:, 0] * real).sum()
                if ce_weight:  # d(ce_weight CE) / dz_s = ce_weight (softmax(z_s) - onehot) / n_ce
                    d_ce = log_q.exp_().scatter_add_(1, picked, -real[:, None]).mul_(real[:, None])
                    grad_z.add_(d_ce.mul_(ce_weight / n_ce))
                    del d_ce
                del log_q
            del z_s
            if want_h:
                grad_h[start:start + chunk_rows] = (grad_z.to(w_s.dtype) @ w_s).to(h_s.dtype)
            if want_w:
                grad_w += grad_z.T @ h.to(dtype)
            del grad_z
        kl = kl * temperature**2 / rows
        ce = ce / n_ce
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w_s.dtype
        ctx.mark_non_differentiable(kl, ce)
        return kl + ce_weight * ce, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        scale = lambda grad: None if grad is None else grad * grad_loss.to(grad.dtype)  # noqa: E731
        grad_w = None if grad_w is None else scale(grad_w).to(ctx.w_dtype)
        return scale(grad_h), grad_w, None, None, None, None, None, None


def distillation_loss(h_s, w_s, h_t, w_t, targets, temperature: float = 1.0, ce_weight: float = 0.0,
                      chunk_rows: int = 512, backend: str = "auto", with_ce: bool = True):
    """The loss from final hidden states (the arguments of ``chunked_distillation_loss``): Liger-Kernel's fused linear
    kernels on CUDA where installed, else the chunked PyTorch path. ``backend`` as in kernels/dispatch.py. No path
    reads the device (a step's losses stay tensors)."""
    _check_shapes(h_s, w_s, h_t, w_t, targets)
    if library_kernel("distillation_loss", "liger_kernel.ops.fused_linear_jsd", "LigerFusedLinearJSDFunction",
                      h_s.device, backend) is not None:  # the choice and its log line; the call imports both ops
        return liger_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature, ce_weight, with_ce)
    return chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature, ce_weight, chunk_rows, with_ce)


def liger_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature: float = 1.0, ce_weight: float = 0.0,
                            with_ce: bool = True):
    """The same loss through Liger-Kernel: its fused linear JSD at beta 0 is KL(teacher || student) per row, averaged
    over the rows (no labels given: every row counts), times T^2; its fused linear cross-entropy averages over the
    rows with a target. Both compute their gradients in the forward, a chunk of rows at a time. At ce_weight 0 the
    CE only reports: computed on detached inputs (no gradient work) where ``with_ce``, else not at all (None)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction

    kl = LigerFusedLinearJSDFunction.apply(h_s, w_s, h_t.detach(), w_t.detach(), None, 0.0, IGNORE,
                                           float(temperature)) * temperature**2
    trained = ce_weight != 0
    if not (trained or with_ce):
        return kl, kl.detach().float(), None
    ce = LigerFusedLinearCrossEntropyFunction.apply(h_s if trained else h_s.detach(), w_s if trained else w_s.detach(),
                                                    targets, None, None, IGNORE)[0]
    ce = ce * (targets != IGNORE).any()  # no row has a target: the CE counts for nothing (as the chunked path's)
    loss = kl + ce_weight * ce if trained else kl
    return loss, kl.detach().float(), ce.detach().float()


def _check_shapes(h_s, w_s, h_t, w_t, targets) -> None:
    if h_s.dim() != 2 or h_t.dim() != 2 or h_s.shape[0] != h_t.shape[0] or targets.shape != h_s.shape[:1]:
        raise ValueError(f"distillation loss: h_s {tuple(h_s.shape)}, h_t {tuple(h_t.shape)} and targets "
                         f"{tuple(targets.shape)} must be (N, H), (N, Ht) and (N,)")
    if w_s.shape[0] != w_t.shape[0] or w_s.shape[1] != h_s.shape[1] or w_t.shape[1] != h_t.shape[1]:
        raise ValueError(f"distillation loss: lm_head weights {tuple(w_s.shape)} (student) and {tuple(w_t.shape)} "
                         f"(teacher) must share the vocabulary and match the hidden sizes {h_s.shape[1]}, "
                         f"{h_t.shape[1]}")


def chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature: float = 1.0, ce_weight: float = 0.0,
                              chunk_rows: int = 512, with_ce: bool = True):
    """``distillation_loss_dense`` in chunks of ``chunk_rows`` rows (same arguments; the same values and gradients
    to float tolerance). Returns (loss, kl, ce): the loss takes gradients to h_s and w_s, kl and ce are for logs;
    at ce_weight 0 without ``with_ce`` the CE is not computed (None)."""
    _check_shapes(h_s, w_s, h_t, w_t, targets)
    h_t, w_t = h_t.detach(), w_t.detach()

    def teacher_kl(start, stop, log_p_s):
        return _dense_teacher_kl(log_p_s, h_t[start:stop], w_t, temperature)
    return _chunked(h_s, w_s, targets, teacher_kl, temperature, ce_weight, chunk_rows, with_ce)


def _chunked(h_s, w_s, targets, teacher_kl, temperature, ce_weight, chunk_rows, with_ce):
    if chunk_rows < 1:
        raise ValueError(f"distillation loss: chunk_rows must be >= 1, got {chunk_rows}")
    loss, kl, ce = _ChunkedDistillationLoss.apply(h_s, w_s, targets, teacher_kl, float(temperature), float(ce_weight),
                                                  int(chunk_rows), bool(with_ce))
    return loss, kl, ce if with_ce or ce_weight else None


@torch.no_grad()
def teacher_top_k(h_t, w_t, k: int, temperature: float = 1.0, chunk_rows: int = 512):
    """The teacher's ``k`` most likely next tokens per row and their log-probabilities at ``temperature`` (the logits'
    top k less the log-sum-exp of z_t / T), computed ``chunk_rows`` rows at a time: h_t (N, H), w_t (V, H) ->
    index (N, k) int32, log_probs (N, k) fp32. What ``top_k_distillation_loss`` reads instead of running the
    teacher; k = V keeps the whole distribution."""
    if not 1 <= k <= w_t.shape[0]:
        raise ValueError(f"teacher_top_k: k must be in [1, {w_t.shape[0]}] (the vocabulary), got {k}")
    index = torch.empty(h_t.shape[0], k, dtype=torch.int32, device=h_t.device)
    log_probs = torch.empty(h_t.shape[0], k, dtype=torch.float32, device=h_t.device)
    for start in range(0, h_t.shape[0], chunk_rows):
        z_t = (h_t[start:start + chunk_rows] @ w_t.T).to(compute_dtype(h_t.dtype)) / temperature
        top = z_t.topk(k, dim=-1)
        index[start:start + chunk_rows] = top.indices
        log_probs[start:start + chunk_rows] = top.values - z_t.logsumexp(-1, keepdim=True)
    return index, log_probs


def top_k_kl(z_s, index, log_probs, temperature: float = 1.0):
    """The reference of the top-k loss: T^2 KL(teacher || student) per row, averaged, from the student's logits
    z_s (N, V) and the teacher's top k (``teacher_top_k``), the teacher's remaining mass r = 1 - sum_K p against the
    student's off K in one tail bucket: sum_K p (log p - log q) + r log(r / Q). Gradients by autograd."""
    log_q = torch.log_softmax(z_s.to(compute_dtype(z_s.dtype)) / temperature, -1)
    index, p = index.long(), log_probs.exp()
    kl = (p * (log_probs - log_q.gather(1, index))).sum(-1)
    if index.shape[1] < z_s.shape[1]:
        tail = (1 - p.sum(-1)).clamp_min(0)
        in_top = torch.zeros_like(log_q, dtype=torch.bool).scatter_(1, index, True)
        kl = kl + torch.xlogy(tail, tail) - tail * log_q.masked_fill(in_top, float("-inf")).logsumexp(-1)
    return kl.mean() * temperature**2


def top_k_distillation_loss(h_s, w_s, index, log_probs, targets, temperature: float = 1.0, ce_weight: float = 0.0,
                            chunk_rows: int = 512, with_ce: bool = True):
    """``chunked_distillation_loss`` against cached teacher targets (``teacher_top_k``: index (N, k), log_probs
    (N, k)) instead of the teacher's hidden states and head: ``top_k_kl`` + ``ce_weight`` x CE, in chunks of rows,
    the gradients computed in the same pass. At k = V it equals the online loss. Returns (loss, kl, ce)."""
    if index.shape != log_probs.shape or index.dim() != 2 or index.shape[0] != h_s.shape[0] \
            or targets.shape != h_s.shape[:1] or w_s.shape[1] != h_s.shape[1]:
        raise ValueError(f"top-k distillation loss: h_s {tuple(h_s.shape)}, w_s {tuple(w_s.shape)}, index "
                         f"{tuple(index.shape)}, log_probs {tuple(log_probs.shape)} and targets {tuple(targets.shape)} "
                         "must be (N, H), (V, H), (N, k), (N, k) and (N,)")
    log_probs = log_probs.to(compute_dtype(h_s.dtype))

    def teacher_kl(start, stop, log_p_s):
        return _top_k_teacher_kl(log_p_s, index[start:stop], log_probs[start:stop])
    return _chunked(h_s, w_s, targets, teacher_kl, temperature, ce_weight, chunk_rows, with_ce)
