"""One copy of the weights a converted student took over from its teacher unchanged.

A converted student starts as a copy of the teacher: embeddings, norms, MLPs, the lm_head, and the attention
projections its mixers are built from. Distillation trains none of them (LoRA adapts the projections beside them,
the optimizer holds only the new tensors), so while both models are held the student's tensors can be the teacher's:
half the memory of those weights. ``share_frozen_weights`` points each equal student tensor at the teacher's storage
(``param.data``, not the Parameter object: FSDP and ZeRO-3 replace a student parameter's data without touching the
teacher's); ``unshare_weights`` gives them their own storage again before anything writes into them (merging LoRA).
"""

from __future__ import annotations

import ctypes

import torch

TEACHER_ATTENTION_NAME = ".self_attn."  # where the teacher families keep attention; the student's is ".mixer."


def share_frozen_weights(student, teacher_model, keep_separate=()) -> int:
    """Point every student parameter equal to the teacher's same-named one (the student's ``.mixer.`` is the teacher's
    ``.self_attn.``) at the teacher's storage: same shape, dtype, device and values. Names containing any of
    ``keep_separate`` (weights a stage trains) are skipped. Returns the bytes no longer held twice."""
    teacher = dict(teacher_model.named_parameters())
    freed = 0
    for name, parameter in student.named_parameters():
        if any(fragment in name for fragment in keep_separate):
            continue
        source = teacher.get(name, teacher.get(name.replace(".mixer.", TEACHER_ATTENTION_NAME)))
        if (source is None or source.shape != parameter.shape or source.dtype != parameter.dtype
                or source.device != parameter.device or source.data_ptr() == parameter.data_ptr()):
            continue
        if torch.equal(source, parameter):
            parameter.data = source.data
            freed += parameter.numel() * parameter.element_size()
    return freed


def unshare_weights(student, teacher_model, only=()) -> int:
    """Give every student parameter that shares storage with the teacher (and whose name contains one of ``only``,
    when given) a copy of its own; returns the bytes copied."""
    teacher = {parameter.data_ptr() for parameter in teacher_model.parameters()}
    copied = 0
    for name, parameter in student.named_parameters():
        if parameter.data_ptr() in teacher and (not only or any(fragment in name for fragment in only)):
            parameter.data = parameter.data.clone()
            copied += parameter.numel() * parameter.element_size()
    return copied


def release_freed_memory() -> None:
    """Hand memory freed by glibc's allocator back to the OS (Linux; elsewhere a no-op): after the student's copies
    of the teacher's weights are dropped, or a forward's activations freed, the process's resident size shows it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
