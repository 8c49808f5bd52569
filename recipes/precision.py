"""Training precision (``train.precision``): which dtype holds the frozen weights, and the autocast around the work.

    fp32   everything in fp32 (the CPU default)
    bf16   the teacher and the student's frozen weights in bf16 (half the memory); the tensors a stage trains (LoRA,
           the mixers' new parameters) stay fp32 masters, and so do AdamW's states; every forward runs under
           torch.autocast(bf16), CUDA or CPU. Scans, recurrent states and the feedback solve accumulate in fp32
           whatever the activations (the kernels' rule).
    auto   bf16 on a CUDA device that has it, else fp32

fp16 is refused: it needs loss scaling, which the trainer does not do.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "bf16", "fp32")


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the frozen weights for ``train.precision`` on ``device``."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def autocast(dtype: torch.dtype, device: torch.device):
    """torch.autocast to ``dtype`` on ``device`` for a low-precision run; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def fp32_masters(parameters) -> None:
    """The trained tensors in fp32 (in place: the modules keep the same Parameter objects)."""
    for parameter in parameters:
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
