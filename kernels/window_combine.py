"""How a local window's read and a memory's read of the older tokens are combined (core/window.py).

Per query, with the window's output o_w and log normaliser log Z_w, and the memory's output o_m and log weight
log Z_m (the total weight its tokens would have had in the softmax):

    "shared"     o = o_w + s (o_m - o_w),  s = sigmoid(log Z_m - log Z_w) = Z_m / (Z_w + Z_m): one softmax over both
    "convex"     o = o_w + s (o_m - o_w),  s = sigmoid(g_head)
    "gated_sum"  o = o_w + s o_m,          s = sigmoid(g_head)

with s = 0 for a query whose memory has seen nothing (``seen`` False). Shapes: o_w, o_m (B, G, g, T, dv); log
weights (B, G, g, T); seen (B, T) bool; gate (G, g) logits.

    combine_reads   the entry: "shared" through one Triton launch forward and one backward where kernels/dispatch.py
                    takes Triton (kernels/window_combine_triton.py), for fp32 and fp64 reads; else the PyTorch form
                    here, which is the kernel's reference
"""

from __future__ import annotations

import torch

from .dispatch import use_triton

COMBINES = ("shared", "convex", "sum", "gated_sum")


def combine_reads(local, local_log, remote, remote_log, seen, combine: str, gate=None, backend: str = "auto"):
    """The combined output (B, G, g, T, dv) in the window's dtype (module docstring)."""
    if combine not in ("shared", "convex", "gated_sum"):
        raise ValueError(f"windowed: combine must be one of {COMBINES}, got {combine!r}")
    if combine == "shared" and remote_log is None:
        raise ValueError("windowed: combine='shared' needs a memory that returns its log weight")
    if combine == "shared" and use_triton("window combine", local.device, backend, check=lambda: _unsupported(
            local, remote)):
        from .window_combine_triton import shared_combine_triton

        return shared_combine_triton(local, local_log, remote, remote_log, seen)
    if combine == "shared":
        share = torch.sigmoid(remote_log - local_log)  # Z_memory / (Z_window + Z_memory)
    else:
        share = torch.sigmoid(gate.to(local.dtype))[None, :, :, None].expand_as(local_log)
    share = torch.where(seen[:, None, None], share.to(local.dtype),
                        torch.zeros((), dtype=local.dtype, device=local.device))
    remote = remote.to(local.dtype)
    return local + share[..., None] * (remote if combine == "gated_sum" else remote - local)


def _unsupported(local, remote) -> str | None:
    if {local.dtype, remote.dtype} - {torch.float32, torch.float64} or local.dtype != remote.dtype:
        return f"{local.dtype} / {remote.dtype} reads (the kernel takes fp32 or fp64, both the same)"
    return None
