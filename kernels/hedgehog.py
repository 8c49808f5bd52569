"""Hedgehog feature maps: phi(x) = [softmax(x W), softmax(-x W)] per KV head, the learned positive features of a linear
attention that mimics softmax (Zhang et al., "The Hedgehog & the Porcupine", arXiv 2402.04347; VORT's conversion
map). phi(q) . phi(k) > 0 for any q, k, and with W trained to imitate the teacher's attention rows it approximates
exp(q . k / sqrt(d)) up to a per-query scale.

Shapes: x (B, G, R, d) with R rows per KV head (a query head group's g T rows, or T keys), weight (G, d, F / 2) ->
phi (B, G, R, F), the positive half first.

    hedgehog          the definition in PyTorch: the CPU path and the reference
    hedgehog_pair     the entry for a layer's queries and keys: one Triton launch for both, forward and backward,
                      where kernels/dispatch.py takes Triton (kernels/hedgehog_triton.py), else ``hedgehog`` twice
"""

from __future__ import annotations

import torch

from .dispatch import use_triton


def hedgehog(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[softmax(x W_G), softmax(-x W_G)] for x (B, G, ..., d) (KV-head axis 1) and weight (G, d, F / 2) ->
    (B, G, ..., F)."""
    if x.dim() < 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"hedgehog: x must be (B, G, ..., d) and weight (G, d, F / 2); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    shape = (1, weight.shape[0]) + (1,) * (x.dim() - 4) + tuple(weight.shape[1:])
    projected = x @ weight.to(x.dtype).view(shape)
    return torch.stack([projected, -projected], -2).softmax(-1).flatten(-2)  # the two softmaxes in one call


def hedgehog_pair(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(hedgehog(q, q_weight), hedgehog(k, k_weight)) for q (B, G, g, T, d) (or (B, G, R, d)) and k (B, G, T, d)."""
    def unsupported():
        if q.dtype not in (torch.float32, torch.float64) or len({q.dtype, k.dtype}) > 1:
            return f"{q.dtype} / {k.dtype} inputs (the kernel takes fp32 or fp64)"
        if q_weight.shape != k_weight.shape:
            return f"query and key maps of different shapes {tuple(q_weight.shape)}, {tuple(k_weight.shape)}"
        return None

    if use_triton("Hedgehog feature maps", q.device, backend, check=unsupported):
        from .hedgehog_triton import hedgehog_pair_triton

        return hedgehog_pair_triton(q, q_weight.to(q.dtype), k, k_weight.to(q.dtype))
    return hedgehog(q, q_weight), hedgehog(k, k_weight)
