"""Numerics shared by every op: the dtype that recurrent states, solves and softmax normalisers accumulate in."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Solves and softmax normalisers run in fp32 whatever the activation dtype (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
