"""Training precision (``train.precision``): which dtype holds the frozen weights, and the autocast around the work.

    fp32   everything in fp32 (the CPU default)
    bf16   the teacher and the student's frozen weights in bf16 (half the memory); the tensors a stage trains (LoRA,
           the mixers' new parameters) stay fp32 masters, and so do AdamW's states; every forward runs under
           torch.autocast(bf16), CUDA or CPU. Scans, recurrent states and the feedback solve accumulate in fp32
           whatever the activations (the kernels' rule).
    fp16   as bf16, in fp16, with dynamic loss scaling (``loss_scaler``: the loss is multiplied by a scale before the
           backward so that small fp16 gradients do not flush to zero; a step whose gradients overflow is skipped and
           the scale halved, and it doubles after 2,000 clean steps). For GPUs without bf16 (V100, T4).
    auto   bf16 on a CUDA device that has it, else fp32; or what ``accelerate launch --mixed_precision`` asked for

An accelerate launch passes its ``mixed_precision`` to the processes as ACCELERATE_MIXED_PRECISION: ``bf16`` and
``fp16`` are honoured by ``auto`` and refused beside another precision (``check_launch_precision``), fp8 is refused;
``no`` is accelerate's default and leaves the recipe's choice alone.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..common.dtypes import ALIASES, NAMES, TORCH_NAMES, to_dtype

PRECISIONS = ("auto", *NAMES)  # train.precision (common/dtypes.py: bf16 or bfloat16 alike)
OUTPUT_DTYPES = ("auto", *NAMES)  # output.dtype: auto = the dtype the model came in
ACCELERATE_PRECISION = "ACCELERATE_MIXED_PRECISION"  # set by `accelerate launch` from its config or flag


def training_dtype(precision: str, device: torch.device, planned: bool = False) -> torch.dtype:
    """The dtype of the frozen weights for ``train.precision`` on ``device``; ``planned``: a device this process
    does not have (``hf-mixers distill --plan --device-memory``), a CUDA one then taken to have bf16."""
    if precision == "auto":
        launched = os.environ.get(ACCELERATE_PRECISION, "no").lower()
        if launched in TORCH_NAMES:
            return to_dtype(launched)
        bf16 = device.type == "cuda" and (planned or torch.cuda.is_bf16_supported())
        return torch.bfloat16 if bf16 else torch.float32
    return to_dtype(precision, "train.precision")


def check_launch_precision(precision: str) -> None:
    """Refuse, in one line, an accelerate launch whose mixed_precision disagrees with ``train.precision``."""
    launched = os.environ.get(ACCELERATE_PRECISION, "no").lower()
    if launched in ("no", "") or (launched in TORCH_NAMES and precision in ("auto", launched)) or \
            ALIASES.get(precision) == launched:
        return
    if launched in TORCH_NAMES:
        reason = (f"but the recipe has train.precision={precision}: set train.precision={launched} (or auto), or "
                  "launch without it")
    else:
        reason = (f"which the trainer does not run: use --mixed_precision bf16, fp16 or no, with "
                  f"train.precision={precision}")
    raise ValueError(f"this accelerate launch asks for mixed_precision={launched} ({ACCELERATE_PRECISION}), {reason}")


def autocast(dtype: torch.dtype, device: torch.device):
    """torch.autocast to ``dtype`` on ``device`` for a low-precision run; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def loss_scaler(dtype: torch.dtype, device: torch.device):
    """torch's dynamic loss scaler for an fp16 run (None otherwise: bf16 has fp32's range). One for every strategy
    but DeepSpeed (which scales by its own ``fp16`` block): under FSDP2 the gradients are DTensor shards, whose
    overflow check torch reduces over the ranks, so every rank skips the same steps."""
    if dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def output_dtype(choice: str, original: torch.dtype) -> torch.dtype:
    """The saved folder's dtype for ``output.dtype``: ``auto`` keeps ``original`` (the teacher's stored dtype)."""
    return original if choice == "auto" else to_dtype(choice, "output.dtype")


def fp32_masters(parameters) -> None:
    """The trained tensors in fp32 (in place: the modules keep the same Parameter objects)."""
    for parameter in parameters:
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
