"""One copy of the weights a converted student took over from its teacher unchanged.

A converted student starts as a copy of the teacher: embeddings, norms, MLPs, the lm_head, and the attention
projections its mixers are built from. Distillation trains none of them (LoRA adapts the projections beside them,
the optimizer holds only the new tensors), so while both models are held the student's tensors can be the teacher's:
half the memory of those weights. ``share_frozen_weights`` points each equal student tensor at the teacher's storage
(``param.data``, not the Parameter object: FSDP and ZeRO-3 replace a student parameter's data without touching the
teacher's); ``unshare_weights`` gives them their own storage again before anything writes into them (merging LoRA).

A student read from a folder (``model.student``) is compared with the teacher tensor by tensor as stored in its
safetensors files, each read through a mapping closed straight after: ``from_pretrained`` maps the files and reads
nothing until a tensor is used, so comparing its tensors in place would make the whole file resident beside the
teacher, and keep it so for as long as one tensor still points into the mapping.
"""

from __future__ import annotations

import ctypes
import json
import os

import torch

TEACHER_ATTENTION_NAME = ".self_attn."  # where the teacher families keep attention; the student's is ".mixer."


def share_frozen_weights(student, teacher_model, keep_separate=(), stored_in: str | None = None) -> int:
    """Point every student parameter equal to the teacher's same-named one (the student's ``.mixer.`` is the teacher's
    ``.self_attn.``) at the teacher's storage: same shape, dtype, device and values. Names containing any of
    ``keep_separate`` (weights a stage trains) are skipped. ``stored_in``: the folder the student was just read from
    with ``from_pretrained`` in its stored dtype; its values are then read from the files one tensor at a time and
    compared in the teacher's dtype (the teacher may be on another device and in another dtype: a shared tensor
    becomes the teacher's), and what the student keeps gets storage of its own, out of the files' mappings. Returns
    the bytes no longer held twice (in the teacher's dtype)."""
    teacher = dict(teacher_model.named_parameters())
    stored = _stored_tensors(stored_in) if stored_in else None
    freed = 0
    for name, parameter in student.named_parameters():
        if any(fragment in name for fragment in keep_separate):
            continue
        source = teacher.get(name, teacher.get(name.replace(".mixer.", TEACHER_ATTENTION_NAME)))
        if source is None or source.shape != parameter.shape or source.data_ptr() == parameter.data_ptr():
            continue
        if stored is None:
            value = parameter if (source.device, source.dtype) == (parameter.device, parameter.dtype) else None
        else:
            value = stored(name)
            value = None if value is None else value.to(device=source.device, dtype=source.dtype)
        if value is not None and torch.equal(source, value):
            parameter.data = source.data
            freed += source.numel() * source.element_size()
    if stored is not None:
        _own_storage(student, teacher_model)
    return freed


def _stored_tensors(folder: str):
    """``read(name)``: the tensor ``name`` as stored in ``folder``'s safetensors files (None when it is not stored,
    e.g. a tied weight), each read through its own short-lived mapping."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            file_of = json.load(handle)["weight_map"]
    else:
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as stored:
            file_of = dict.fromkeys(stored.keys(), "model.safetensors")

    def read(name: str):
        if name not in file_of:
            return None
        with safe_open(os.path.join(folder, file_of[name]), "pt") as stored:
            return stored.get_tensor(name)

    return read


def _own_storage(student, teacher_model) -> None:
    """A copy of its own for every student tensor not shared with the teacher: none of them is then a view into the
    files it was read from, so their mappings close."""
    teacher = {parameter.data_ptr() for parameter in teacher_model.parameters()}
    for parameter in student.parameters():
        if parameter.data_ptr() not in teacher:
            parameter.data = parameter.data.clone()
    for module in student.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.clone()


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
