"""Selective scans with the argument layout of mamba_ssm's functional ops, runnable on CPU (public: hf_mixers.ops).

    selective_scan   mamba_ssm.ops.selective_scan_interface.selective_scan_fn (Mamba / S6)
    ssd_scan         mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined (Mamba-2)
    delta_t_scan     Mamba-Δᵀ (Huang et al. 2025, eq. 15): a step size per state slot, no Δ in the write

Code written for mamba_ssm runs with ``from hf_mixers.ops import selective_scan, ssd_scan``. On CUDA, where the
maintained kernel is installed (mamba_ssm; else for SSD flash-linear-attention's ``chunk_simple_gla``; its
``chunk_gla`` for Mamba-Δᵀ with A per state slot), the call goes to it (kernels/dispatch.py, logged once);
otherwise to the PyTorch chunked scan of kernels/selective_scan.py, which is also the reference the tests compare
every path with. Mamba-Δᵀ with a full A (one rate per channel and slot) has no maintained kernel: it always runs
on the PyTorch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conventions import compute_dtype, outside_autocast
from .dispatch import installed, library_kernel
from .selective_scan import ssm_chunked


def _step_size(delta, bias, softplus, dtype):
    delta = delta.to(dtype)
    if bias is not None:
        delta = delta + bias.to(dtype)
    return F.softplus(delta) if softplus else delta


def _finish(y, x, D, z, dtype):
    """The D skip and the silu(z) gate, mamba_ssm's order; back to the input dtype."""
    if D is not None:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(dtype)


def _library_dtype(x) -> str | None:
    """Why the libraries' CUDA kernels cannot take ``x`` (None: they can): they compute in fp32 at most."""
    return None if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else f"{x.dtype} inputs"


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, backend="auto"):
    """Mamba's selective scan. u, delta, z: (batch, dim, L); A: (dim, N) real; B, C: (dim, N) constant, or
    (batch, N, L) / (batch, groups, N, L) per token; D: (dim,); delta_bias: (dim,).

    out = scan + D u, times silu(z); with ``return_last_state`` also the state (batch, dim, N). ``backend``: as
    ``config.kernel_backend`` (kernels/dispatch.py).
    """
    fast = library_kernel("selective_scan", "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn", u.device,
                          backend, check=lambda: _library_dtype(u))
    if fast is not None:
        return fast(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    if A.is_complex():
        raise NotImplementedError("selective_scan: complex A (S4D-Lin) is not supported on the PyTorch path")
    batch, dim, length = u.shape
    cd = compute_dtype(u.dtype)
    delta = _step_size(delta, None if delta_bias is None else delta_bias[:, None], delta_softplus, cd)

    def per_token(x, name):  # -> (batch, L, groups, N); every channel its own head, so constant B is per head
        if x.dim() == 2:
            return x.to(cd)[None, None].expand(batch, length, dim, x.shape[1])
        if x.dim() == 3:
            return x.to(cd).transpose(1, 2)[:, :, None]
        if x.dim() == 4:
            return x.to(cd).permute(0, 3, 1, 2)
        raise ValueError(f"selective_scan: {name} must be (dim, N), (batch, N, L) or (batch, groups, N, L), got "
                         f"{tuple(x.shape)}")

    write = (delta * u.to(cd)).transpose(1, 2)[..., None]  # (batch, L, dim, 1): dim heads of one channel
    log_decay = (delta.transpose(1, 2)[..., None] * A.to(cd))[:, :, :, None, :]  # (batch, L, dim, 1, N)
    y, state = ssm_chunked(write, log_decay, per_token(B, "B"), per_token(C, "C"))
    out = _finish(y[..., 0].transpose(1, 2), u, None if D is None else D[:, None], z, u.dtype)
    return (out, state[:, :, 0]) if return_last_state else out


@outside_autocast
def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, initial_states=None,
             return_final_states=False, dt_limit=(0.0, float("inf")), backend="auto"):
    """Mamba-2's chunked scan (SSD). x: (batch, L, heads, P); dt: (batch, L, heads); A: (heads,); B, C:
    (batch, L, groups, N); D: (heads,) or (heads, P); z: like x; initial_states: (batch, heads, P, N).

    Δ = clamp(softplus(dt + dt_bias)) per head; y = scan + D x, times silu(z); with ``return_final_states`` also the
    state (batch, heads, P, N) after the last token. ``backend``: as ``config.kernel_backend`` (kernels/dispatch.py).
    """
    mamba_ssm = installed("mamba_ssm")
    if mamba_ssm:  # mamba_ssm's own kernel, where it is installed (it has no wheels)
        fast = library_kernel("ssd_scan", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined",
                              x.device, backend, check=lambda: _library_dtype(x))
        if fast is not None:
            return fast(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                        dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states)
    cd = compute_dtype(x.dtype)
    dt = _step_size(dt, dt_bias, dt_softplus, cd)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    write = x.to(cd) * dt[..., None]
    log_decay = dt * A.to(cd)  # (batch, L, heads)
    # else SSD is gated linear attention with one scalar forget gate a head (q = C, k = B, v = Δ x, g = Δ A):
    # flash-linear-attention's chunk_simple_gla on CUDA
    fast = None if mamba_ssm else library_kernel("ssd_scan", "fla.ops.simple_gla", "chunk_simple_gla", x.device,
                                                 backend, check=lambda: _library_dtype(x))
    if fast is not None:
        heads = x.shape[2]
        state = None if initial_states is None else initial_states.transpose(-1, -2).to(cd)  # fla: (B, H, N, P)
        y, state = fast(q=C.to(cd).repeat_interleave(heads // C.shape[2], dim=2),
                        k=B.to(cd).repeat_interleave(heads // B.shape[2], dim=2), v=write, g=log_decay, scale=1.0,
                        initial_state=state, output_final_state=return_final_states)
        state = None if state is None else state.transpose(-1, -2)
    else:
        y, state = ssm_chunked(write, log_decay[..., None, None], B, C, initial_states, chunk_size)
    out = _finish(y, x, None if D is None else (D[:, None] if D.dim() == 1 else D), z, x.dtype)
    return (out, state) if return_final_states else out


def delta_t_scan(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, dt_softplus=False,
                 initial_states=None, return_final_states=False, input_scaling="none", backend="auto"):
    """Mamba-Δᵀ's scan, in ``ssd_scan``'s layout. x: (batch, L, heads, P); dt: (batch, L, heads, N), one step size
    per state slot; A: (heads, N) per slot or (heads, P, N) per channel and slot; B, C: (batch, L, groups, N).

    h_t = exp(A Δ_t) h_{t-1} + x_t ⊗ B_t (``input_scaling="state"``: x_t ⊗ (Δ_t B_t)); y = h_t C_t + D x, times
    silu(z). With A per slot this is gated linear attention with a key-dimension forget gate (q = C, k = B, v = x),
    which is flash-linear-attention's ``chunk_gla`` on CUDA. ``backend``: as ``config.kernel_backend``.
    """
    if input_scaling not in ("none", "state"):
        raise ValueError(f"delta_t_scan: input_scaling must be 'none' or 'state', got {input_scaling!r}")
    cd = compute_dtype(x.dtype)
    dt = _step_size(dt, dt_bias, dt_softplus, cd)
    heads = x.shape[2]
    B = B.to(cd).repeat_interleave(heads // B.shape[2], dim=2)
    if input_scaling == "state":
        B = B * dt
    A = A.to(cd)
    log_decay = dt[:, :, :, None, :] * (A[:, None, :] if A.dim() == 2 else A)  # (batch, L, heads, 1 or P, N)
    fast = library_kernel("delta_t_scan", "fla.ops.gla", "chunk_gla", x.device, backend,
                          check=lambda: _library_dtype(x) or (None if A.dim() == 2 else "A per channel and slot "
                                                              "(chunk_gla takes a forget gate per key slot only)"))
    if fast is not None:
        state = None if initial_states is None else initial_states.transpose(-1, -2)  # fla: (batch, heads, N, P)
        y, state = fast(q=C.repeat_interleave(heads // C.shape[2], dim=2), k=B, v=x, g=log_decay[:, :, :, 0],
                        scale=1.0, initial_state=state, output_final_state=return_final_states)
        state = None if state is None else state.transpose(-1, -2)
    else:
        y, state = ssm_chunked(x, log_decay, B, C, initial_states, chunk_size)
    out = _finish(y, x, None if D is None else (D[:, None] if D.dim() == 1 else D), z, x.dtype)
    return (out, state) if return_final_states else out
