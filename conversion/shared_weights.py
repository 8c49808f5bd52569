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
teacher, and keep it so for as long as one tensor still points into the mapping. The comparison reads the teacher's
memory-mapped tensors whole too; their pages are handed back after it, so that the embedding, of which a step reads
only its tokens' rows, is not held whole for the run.
"""

from __future__ import annotations

import contextlib
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
        if stored is not None:  # the comparison read all of the teacher's tensor: what a step uses maps back in
            release_file_pages(source)  # (an embedding only its tokens' rows)
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


def _storages(model) -> set:
    """Where ``model``'s parameters lie (their data pointers): a student parameter found there shares it."""
    return {parameter.data_ptr() for parameter in model.parameters()}


def _own_storage(student, teacher_model) -> None:
    """A copy of its own for every student tensor not shared with the teacher: none of them is then a view into the
    files it was read from, so their mappings close."""
    teacher = _storages(teacher_model)
    for parameter in student.parameters():
        if parameter.data_ptr() not in teacher:
            parameter.data = parameter.data.clone()
    for module in student.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.clone()


def unshare_weights(student, teacher_model, only=(), release_teacher_pages: bool = False) -> int:
    """Give every student parameter that shares storage with the teacher (and whose name contains one of ``only``,
    when given) a copy of its own; returns the bytes copied. ``release_teacher_pages``: the teacher will not read
    these tensors again (or may read them back from its files), so each one's memory-mapped pages leave the
    process's resident memory as its copy is made, and the copies never stand beside both (``release_file_pages``)."""
    teacher = _storages(teacher_model)
    copied = 0
    for name, parameter in student.named_parameters():
        if parameter.data_ptr() in teacher and (not only or any(fragment in name for fragment in only)):
            original = parameter.data
            parameter.data = original.clone()
            copied += parameter.numel() * parameter.element_size()
            if release_teacher_pages:
                release_file_pages(original)
    return copied


MADV_DONTNEED = 4
PAGEMAP_FILE = 1 << 61  # /proc/self/pagemap: a file page or shared (bit 63: the page is in memory)


def release_file_pages(tensor) -> int:
    """Drop from this process's resident memory the pages that lie wholly inside ``tensor`` when every one of them
    is a page of a file mapping (a memory-mapped safetensors weight): the data stays in the file and the page cache,
    and the next read maps it back, so the tensor keeps its values. Anything else (anonymous memory, a page copied on
    write, a tensor not on the CPU) is left alone: dropping it would lose data. Linux only (elsewhere a no-op);
    returns the bytes released."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first, end = -(-start // page) * page, (start + tensor.numel() * tensor.element_size()) // page * page
    if end <= first or _LIBC is None:
        return 0
    try:  # one 64-bit entry a page, read as int64: "present" is bit 63, the sign (an untied embedding's hook runs
        with open("/proc/self/pagemap", "rb") as pagemap:  # this at every lookup: one tensor test, not a Python loop)
            pagemap.seek(first // page * 8)
            entries = torch.frombuffer(bytearray(pagemap.read((end - first) // page * 8)), dtype=torch.int64)
    except (OSError, ValueError):
        return 0
    present = entries < 0
    if bool((present & ((entries & PAGEMAP_FILE) == 0)).any()) or _LIBC.madvise(first, end - first, MADV_DONTNEED):
        return 0
    return int(present.sum()) * page


def shared_bytes(student, teacher_model) -> int:
    """Bytes of the student's parameters that are the teacher's tensors (held once for both)."""
    teacher = _storages(teacher_model)
    return sum(parameter.numel() * parameter.element_size() for parameter in student.parameters()
               if parameter.data_ptr() in teacher)


def release_freed_memory(*_) -> None:
    """Hand memory freed by glibc's allocator back to the OS (Linux; elsewhere a no-op): after the student's copies
    of the teacher's weights are dropped, or a forward's activations freed, the process's resident size shows it.
    Takes and ignores any arguments, so that it serves as a module or tensor hook."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.malloc_trim  # noqa: B018  both or neither
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()  # opened once: madvise and malloc_trim run at every block boundary and lookup
_MALLOC_TRIM = None if _LIBC is None else _LIBC.malloc_trim


@contextlib.contextmanager
def freed_memory_released_per_block(blocks, embedding=None):
    """Within it, ``release_freed_memory`` at each block's boundaries, forward and backward (``train.
    release_host_memory``). On a CPU host the transients a block frees stay resident in glibc's heap, between the
    tensors kept for the backward pass, and the heap grows block by block; ZeRO-3, which gathers and frees each
    block's weights, fragments it further (docs/benchmarks.md, "Memory plan"). Released pages are faulted back in
    when reused, so steps take longer. A checkpointed block's recomputation
    calls its ``forward`` directly (transformers' GradientCheckpointingLayer), past the module hooks: a hook on the
    gradient of each block's output marks its boundary in the backward pass.

    ``embedding``: the input embedding, when it is a frozen memory-mapped weight (the teacher's, shared) that nothing
    else reads whole (not tied to the head): after each lookup its pages are handed back, so that the process holds
    the rows of the batch at hand, not every row a run has looked up so far (which, over a run, is all of them)."""
    def after_forward(block, inputs, output):
        release_freed_memory()
        for tensor in output if isinstance(output, tuple) else (output,):
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(release_freed_memory)
                break

    handles = [handle for block in blocks for handle in (block.register_forward_pre_hook(release_freed_memory),
                                                         block.register_forward_hook(after_forward))]
    if embedding is not None:
        def after_lookup(module, inputs, output):
            if type(module.weight.data) is torch.Tensor:  # not a DTensor shard (FSDP): those are never mapped
                release_file_pages(module.weight)

        handles.append(embedding.register_forward_hook(after_lookup))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
