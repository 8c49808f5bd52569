"""Training precision (``train.precision``): which dtype holds the frozen weights, and the autocast around the work.

    fp32   everything in fp32 (the CPU default)
    bf16   the teacher and the student's frozen weights in bf16 (half the memory); the tensors a stage trains (LoRA,
           the mixers' new parameters) stay fp32 masters, and so do AdamW's states; every forward runs under
           torch.autocast(bf16), CUDA or CPU. Scans, recurrent states and the feedback solve accumulate in fp32
           whatever the activations (the kernels' rule).
    auto   bf16 on a CUDA device that has it, else fp32; or what ``accelerate launch --mixed_precision`` asked for

An accelerate launch passes its ``mixed_precision`` to the processes as ACCELERATE_MIXED_PRECISION: ``bf16`` is
honoured by ``auto`` and refused beside ``fp32`` (``check_launch_precision``), fp16 and fp8 are refused; ``no`` is
accelerate's default and leaves the recipe's choice alone. fp16 is refused in recipes too: it needs loss scaling,
which the trainer does not do.
"""

from __future__ import annotations

import contextlib
import os

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRECISIONS = ("auto", *DTYPES)  # train.precision
OUTPUT_DTYPES = ("auto", *DTYPES)  # output.dtype: auto = the dtype the model came in
ACCELERATE_PRECISION = "ACCELERATE_MIXED_PRECISION"  # set by `accelerate launch` from its config or flag


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the frozen weights for ``train.precision`` on ``device``."""
    if precision == "auto":
        if os.environ.get(ACCELERATE_PRECISION, "no").lower() == "bf16":
            return torch.bfloat16
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return DTYPES[precision]


def check_launch_precision(precision: str) -> None:
    """Refuse, in one line, an accelerate launch whose mixed_precision disagrees with ``train.precision``."""
    launched = os.environ.get(ACCELERATE_PRECISION, "no").lower()
    if launched in ("no", "", "bf16") and not (launched == "bf16" and precision == "fp32"):
        return
    if launched == "bf16":
        reason = "but the recipe has train.precision=fp32: set train.precision=bf16 (or auto), or launch without it"
    else:
        reason = (f"which the trainer does not do (it needs loss scaling): use --mixed_precision bf16 or no, with "
                  f"train.precision={precision}")
    raise ValueError(f"this accelerate launch asks for mixed_precision={launched} ({ACCELERATE_PRECISION}), {reason}")


def autocast(dtype: torch.dtype, device: torch.device):
    """torch.autocast to ``dtype`` on ``device`` for a low-precision run; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def output_dtype(choice: str, original: torch.dtype) -> torch.dtype:
    """The saved folder's dtype for ``output.dtype``: ``auto`` keeps ``original`` (the teacher's stored dtype)."""
    return original if choice == "auto" else DTYPES[choice]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how summaries, plans and ``convert(dtype=...)`` name a dtype."""
    return str(dtype).removeprefix("torch.")


def fp32_masters(parameters) -> None:
    """The trained tensors in fp32 (in place: the modules keep the same Parameter objects)."""
    for parameter in parameters:
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
