"""VORT's per-token write weights as one Triton launch forward and one backward.

kernels/soe.py ``write_weights`` is the math, the CPU path and the reference. For N tokens of order alpha, a keep
factor m (0: padding, which writes nothing), the S SOE slots (log scale L_s, exponent E_s of kernels/soe.py) plus
the DC slot, and a delay of ``lag`` steps (a token written late was already that old: r_s = e^{l_s lag}):

    b = 1 - alpha,  s = sin(pi b)
    w_s  = m r_s s exp(L_s - alpha E_s)                    the S slots
    w_S  = m r_S sinc(b) exp(b log lambda_min)             the DC slot
    skip = m s exp(-alpha lambda_max) / (pi alpha)         the lag-0 term (the GL kernel; 0 for the power law)

The backward maps (dw, dskip) to d alpha, with s' = ds/dalpha = -pi cos(pi b):

    dw_s / dalpha  = m r_s exp(L_s - alpha E_s) (s' - s E_s)
    dw_S / dalpha  = -m r_S exp(b log lambda_min) (sinc'(b) + sinc(b) log lambda_min),
                     sinc'(b) = (cos(pi b) - sinc(b)) / b  (0 at b = 0)
    dskip / dalpha = m h (s' - s (lambda_max + 1 / alpha)),  h = exp(-alpha lambda_max) / (pi alpha)

Eager PyTorch spends a launch on each elementwise op of these, forward and backward (VORT computes them for every
token of every layer); here each way is one. A program takes ``TOKENS`` tokens and every slot (a (TOKENS, slots)
tile). A token with keep 0 is evaluated at alpha = 1 (padding may carry alpha = 0, where the skip weight divides by
0), so its weights and gradient are exactly 0. Scope: fp32 and fp64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# A try block on purpose (see rsa_chunk_triton.py): imported only once a Triton path was chosen.
try:
    import triton
    import triton.language as tl
finally:
    pass

from .conventions import kernel_op, tile_edge

# a program's tokens: (32, 16 slots) tiles of a few elementwise values, so that one sequence's 2K tokens of a few
# heads are 100s of programs (an H100 has 132 SMs)
TOKENS, WARPS = 32, 4


@triton.jit
def _weights_fwd(alpha_ptr, keep_ptr, log_rate_ptr, log_scale_ptr, exponent_ptr, weights_ptr, skip_ptr, N, KEEP_N,
                 GROUPS_LENGTH, LENGTH, lag, log_lambda_min, lambda_max, SLOTS: tl.constexpr,
                 HAS_KEEP: tl.constexpr, GL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """Tokens block*BLOCK_N.. : their weights (N, SLOTS + 1) and skip (N,)."""
    pi: tl.constexpr = 3.141592653589793
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_ok = tokens < N
    alpha = tl.load(alpha_ptr + tokens, mask=token_ok, other=1.0)
    keep = alpha * 0 + 1
    if HAS_KEEP:  # keep is (B, T), the tokens (B, G, T)
        at = (tokens // GROUPS_LENGTH) * LENGTH + tokens % LENGTH
        keep = tl.load(keep_ptr + at, mask=token_ok & (at < KEEP_N), other=0.0).to(alpha.dtype)
        alpha = tl.where(keep != 0, alpha, 1.0)  # a token that writes nothing (its alpha may be 0): exactly 0
    below = 1 - alpha
    sin_pi = tl.sin(pi * below)
    safe = tl.where(below == 0, 1.0, below)
    sinc = tl.where(below == 0, 1.0, sin_pi / (pi * safe))
    slots = tl.arange(0, BLOCK_S)
    is_slot, is_dc = slots < SLOTS, slots == SLOTS
    log_rate = tl.load(log_rate_ptr + slots, mask=slots <= SLOTS, other=0.0)
    log_scale = tl.load(log_scale_ptr + slots, mask=is_slot, other=0.0)
    exponent = tl.load(exponent_ptr + slots, mask=is_slot, other=0.0)
    per_slot = sin_pi[:, None] * tl.exp(log_scale[None, :] - alpha[:, None] * exponent[None, :])
    dc = sinc * tl.exp(below * log_lambda_min)
    weight = tl.where(is_dc[None, :], dc[:, None], per_slot) * tl.exp(log_rate * lag)[None, :] * keep[:, None]
    tl.store(weights_ptr + tokens[:, None] * (SLOTS + 1) + slots[None, :], weight,
             mask=token_ok[:, None] & (slots <= SLOTS)[None, :])
    skip = alpha * 0
    if GL:
        skip = keep * sin_pi * tl.exp(-alpha * lambda_max) / (pi * alpha)
    tl.store(skip_ptr + tokens, skip, mask=token_ok)


@triton.jit
def _weights_bwd(alpha_ptr, keep_ptr, log_rate_ptr, log_scale_ptr, exponent_ptr, g_weights_ptr, g_skip_ptr,
                 d_alpha_ptr, N, KEEP_N, GROUPS_LENGTH, LENGTH, lag, log_lambda_min, lambda_max,
                 SLOTS: tl.constexpr, HAS_KEEP: tl.constexpr, GL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Tokens block*BLOCK_N.. : d alpha from the gradients of their weights and skip."""
    pi: tl.constexpr = 3.141592653589793
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_ok = tokens < N
    alpha = tl.load(alpha_ptr + tokens, mask=token_ok, other=1.0)
    keep = alpha * 0 + 1
    if HAS_KEEP:
        at = (tokens // GROUPS_LENGTH) * LENGTH + tokens % LENGTH
        keep = tl.load(keep_ptr + at, mask=token_ok & (at < KEEP_N), other=0.0).to(alpha.dtype)
        alpha = tl.where(keep != 0, alpha, 1.0)  # a token that writes nothing (its alpha may be 0): exactly 0
    below = 1 - alpha
    sin_pi, cos_pi = tl.sin(pi * below), tl.cos(pi * below)
    d_sin = -pi * cos_pi
    safe = tl.where(below == 0, 1.0, below)
    sinc = tl.where(below == 0, 1.0, sin_pi / (pi * safe))
    d_sinc = tl.where(below == 0, 0.0, (cos_pi - sinc) / safe)  # d sinc / d b
    slots = tl.arange(0, BLOCK_S)
    is_slot, is_dc = slots < SLOTS, slots == SLOTS
    log_rate = tl.load(log_rate_ptr + slots, mask=slots <= SLOTS, other=0.0)
    log_scale = tl.load(log_scale_ptr + slots, mask=is_slot, other=0.0)
    exponent = tl.load(exponent_ptr + slots, mask=is_slot, other=0.0)
    g = tl.load(g_weights_ptr + tokens[:, None] * (SLOTS + 1) + slots[None, :],
                mask=token_ok[:, None] & (slots <= SLOTS)[None, :], other=0.0)
    g = g * tl.exp(log_rate * lag)[None, :] * keep[:, None]
    per_slot = tl.exp(log_scale[None, :] - alpha[:, None] * exponent[None, :]) \
        * (d_sin[:, None] - sin_pi[:, None] * exponent[None, :])
    dc = -tl.exp(below * log_lambda_min) * (d_sinc + sinc * log_lambda_min)
    d_alpha = tl.sum(g * tl.where(is_dc[None, :], dc[:, None], per_slot), axis=1)
    if GL:
        h = tl.exp(-alpha * lambda_max) / (pi * alpha)
        g_skip = tl.load(g_skip_ptr + tokens, mask=token_ok, other=0.0)
        d_alpha += g_skip * keep * h * (d_sin - sin_pi * (lambda_max + 1 / alpha))
    tl.store(d_alpha_ptr + tokens, d_alpha, mask=token_ok)


def _launch_arguments(alpha: Tensor, keep: Tensor | None, lag: int, log_lambda_min: float, lambda_max: float,
                      slots: int) -> tuple[tuple, dict]:
    """The scalar arguments and constexprs both kernels share: alpha (B, G, T) contiguous, keep (B, T) or None."""
    batch, groups, length = alpha.shape
    keep_n = 0 if keep is None else keep.numel()
    scalars = (alpha.numel(), keep_n, groups * length, length, lag, log_lambda_min, lambda_max)
    constexprs = dict(SLOTS=slots, HAS_KEEP=keep is not None, BLOCK_N=TOKENS, BLOCK_S=tile_edge(slots + 1),
                      num_warps=WARPS)
    return scalars, constexprs


@kernel_op(__name__, "write_weights_forward")
def _write_weights_forward(alpha: Tensor, keep: Tensor | None, log_rates: Tensor, log_scale: Tensor,
                           exponent: Tensor, lag: int, log_lambda_min: float, lambda_max: float,
                           gl: bool) -> list[Tensor]:
    """[weights (B, G, T, S + 1), skip (B, G, T)] for alpha (B, G, T) contiguous."""
    slots = log_scale.shape[0]
    weights = alpha.new_empty(*alpha.shape, slots + 1)
    skip = torch.empty_like(alpha)
    if alpha.numel():
        scalars, constexprs = _launch_arguments(alpha, keep, lag, log_lambda_min, lambda_max, slots)
        _weights_fwd[(triton.cdiv(alpha.numel(), TOKENS),)](alpha, keep, log_rates, log_scale, exponent, weights, skip,
                                                            *scalars, GL=gl, **constexprs)
    return [weights, skip]


@_write_weights_forward.register_fake
def _(alpha, keep, log_rates, log_scale, exponent, lag, log_lambda_min, lambda_max, gl):
    return [alpha.new_empty(*alpha.shape, log_scale.shape[0] + 1), torch.empty_like(alpha)]


@kernel_op(__name__, "write_weights_backward")
def _write_weights_backward(alpha: Tensor, keep: Tensor | None, log_rates: Tensor, log_scale: Tensor,
                            exponent: Tensor, g_weights: Tensor, g_skip: Tensor, lag: int, log_lambda_min: float,
                            lambda_max: float, gl: bool) -> Tensor:
    """d alpha (B, G, T)."""
    d_alpha = torch.empty_like(alpha)
    if alpha.numel():
        scalars, constexprs = _launch_arguments(alpha, keep, lag, log_lambda_min, lambda_max, log_scale.shape[0])
        _weights_bwd[(triton.cdiv(alpha.numel(), TOKENS),)](alpha, keep, log_rates, log_scale, exponent, g_weights,
                                                            g_skip, d_alpha, *scalars, GL=gl, **constexprs)
    return d_alpha


@_write_weights_backward.register_fake
def _(alpha, keep, log_rates, log_scale, exponent, g_weights, g_skip, lag, log_lambda_min, lambda_max, gl):
    return torch.empty_like(alpha)


def _save_inputs(ctx, inputs, output):
    alpha, keep, log_rates, log_scale, exponent, *ctx.scalars = inputs
    ctx.save_for_backward(alpha, keep, log_rates, log_scale, exponent)


def _gradients(ctx, grads):
    alpha, keep, log_rates, log_scale, exponent = ctx.saved_tensors
    g_weights, g_skip = grads  # materialised: an output without a gradient gets zeros
    d_alpha = _write_weights_backward(alpha, keep, log_rates, log_scale, exponent, g_weights.contiguous(),
                                      g_skip.contiguous(), *ctx.scalars)
    return d_alpha, None, None, None, None, None, None, None, None


_write_weights_forward.register_autograd(_gradients, setup_context=_save_inputs)


def write_weights_triton(alpha: Tensor, keep: Tensor | None, lag: int, log_rates: Tensor, log_scale: Tensor,
                         exponent: Tensor, lambda_min: float, lambda_max: float, gl: bool) -> tuple[Tensor, Tensor]:
    """``soe.write_weights``' result on the kernels: alpha (B, G, T), keep (B, T) or None, the node tensors of
    kernels/soe.py (log rates (S + 1,), log scales and the kernel's exponents (S,)) in alpha's dtype."""
    weights, skip = _write_weights_forward(alpha.contiguous(), None if keep is None else keep.contiguous(),
                                           log_rates, log_scale, exponent, int(lag), math.log(lambda_min),
                                           float(lambda_max), bool(gl))
    return weights, skip
