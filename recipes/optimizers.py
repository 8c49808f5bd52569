"""The optimizer a stage steps (``train.optimizer``), and what its states weigh (for the memory plan).

    adamw       torch's AdamW, with its fused kernel on CUDA: two fp32 states per trained value
    adafactor   transformers' Adafactor at the recipe's rate (``relative_step=False``): factored second moments, one
                row and one column per matrix instead of a full tensor, and no first moment
    adamw_8bit  bitsandbytes' AdamW8bit: both states in 8 bits (bitsandbytes installed, a CUDA device)

DeepSpeed and FSDP step AdamW only: ZeRO partitions AdamW's states and gathers them as such for the checkpoints, and
FSDP's parameters are DTensor shards, whose rows and columns Adafactor would factor shard by shard.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "adafactor", "adamw_8bit")


def make_optimizer(parameters: list, train, lr: float) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``parameters`` at rate ``lr`` with ``train.weight_decay``."""
    if train.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(parameters, lr=lr, weight_decay=train.weight_decay, scale_parameter=False,
                         relative_step=False, warmup_init=False)
    if train.optimizer == "adamw_8bit":
        return bitsandbytes_module(parameters).optim.AdamW8bit(parameters, lr=lr, weight_decay=train.weight_decay)
    fused = bool(parameters) and all(p.device.type == "cuda" and type(p.data) is torch.Tensor for p in parameters)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=train.weight_decay, fused=fused or None)


def check_optimizer(train) -> None:
    """Fail before any work when ``train.optimizer`` cannot run here (its library, its device)."""
    if train.optimizer == "adamw_8bit":
        bitsandbytes_module([])


def bitsandbytes_module(parameters: list):
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError("train.optimizer=adamw_8bit needs bitsandbytes (pip install bitsandbytes), which is not "
                         "installed; use adamw, or adafactor for states smaller than AdamW's") from None
    if not torch.cuda.is_available() or any(p.device.type != "cuda" for p in parameters):
        raise ValueError("train.optimizer=adamw_8bit runs on a CUDA device (bitsandbytes' 8-bit states); here there "
                         "is none: use adamw, or adafactor for states smaller than AdamW's")
    return bitsandbytes


def state_bytes(optimizer: str, shapes: list[tuple[int, ...]]) -> int:
    """Bytes of ``optimizer``'s states for trained tensors of ``shapes`` (fp32 masters)."""
    if optimizer == "adamw_8bit":
        return sum(2 * math.prod(shape) for shape in shapes)
    if optimizer == "adafactor":  # a matrix keeps its rows' and columns' means (over its last two dimensions)
        return sum(4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if len(shape) >= 2
                   else 4 * math.prod(shape) for shape in shapes)
    return sum(8 * math.prod(shape) for shape in shapes)
