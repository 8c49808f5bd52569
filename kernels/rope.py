"""Rotary position embedding of queries and keys: transformers' rotate-half form (``apply_rotary_pos_emb``), or
Liger-Kernel's fused Triton kernel of it (``liger_kernel.ops.rope``).

The PyTorch form issues ten elementwise ops forward and fourteen backward per layer and step; Liger's kernel rotates
the queries and keys of a row of tokens in one launch each way (issue 67: an eager step is launch-bound). It runs
where Triton kernels run (CUDA, or the CPU interpreter of the tests) in eager execution. Under torch.compile the
PyTorch form stays: Inductor fuses it with its neighbours, which an opaque library call would prevent.

Liger rotates in place, in the projections' (B, T, H, hd) layout; the op here rotates copies, so a projection's
output is never changed (RSA reads its unrotated queries and keys as well). Its results keep that layout: (B, H, T,
hd) views of (B, T, H, hd) tensors, as the projections hand over the values. Their dtype is the PyTorch form's:
queries and keys promoted with cos and sin (bf16 queries under autocast, fp32 cos: fp32 results).
"""

from __future__ import annotations

import os

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .conventions import kernel_op
from .dispatch import installed, use_triton


# Under the Triton interpreter (CPU tests) Liger's kernel, a program a token, is slow to interpret: there it runs only
# where asked for, in its own tests and in the op counter (apps/bench/op_count.py), which counts what a GPU runs.
INTERPRET_LIGER = False


def apply_rope(query, key, cos, sin, backend: str = "auto"):
    """query (B, H, T, hd), key (B, Hkv, T, hd), cos and sin (B | 1, T, hd) -> the rotated query and key.
    ``backend``: as ``config.kernel_backend`` (kernels/dispatch.py); "torch" keeps the PyTorch form, "triton" takes
    Liger's kernel where it can run (a mixer's forced kernels do not fail for want of this one)."""
    if torch.compiler.is_compiling() or not use_triton("RoPE (Liger-Kernel)", query.device, backend, required=False,
                                                       check=lambda: _unsupported(query, key, cos, sin)):
        return apply_rotary_pos_emb(query, key, cos, sin)
    rotated_query, rotated_key = _rope_forward(query, key, cos, sin)
    return rotated_query.transpose(1, 2), rotated_key.transpose(1, 2)


def _unsupported(query, key, cos, sin) -> str | None:
    """Why Liger's kernel cannot take this call (None: it can)."""
    if not installed("liger_kernel"):
        return "liger_kernel is not installed"
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16) or key.dtype != query.dtype:
        return f"queries and keys in {query.dtype} / {key.dtype} (fp64 is the reference's dtype)"
    if cos.requires_grad or sin.requires_grad:
        return "cos / sin ask for gradients (the kernel gives none)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        if not INTERPRET_LIGER:
            return "the Triton interpreter (INTERPRET_LIGER off: a program a token is slow to interpret)"
        if torch.promote_types(query.dtype, cos.dtype).itemsize < 4:
            return "half-precision rotation under the Triton interpreter (whose bf16 arithmetic gives NaN; CUDA's not)"
    return None


def _liger_rope():
    # imported at the first call (Liger's package takes seconds to import); a try block: transformers' remote-code
    # check takes every import outside one for a requirement of the saved folder
    try:
        from liger_kernel.ops import rope
    except ImportError as error:
        raise RuntimeError("RoPE: the Liger-Kernel path was chosen but liger_kernel cannot be imported") from error
    return rope


def _rows_copy(t, cos):
    """(B, H, T, hd) -> a copy in the (B, T, H, hd) layout, which Liger's kernel rotates in place, in the dtype the
    PyTorch form computes in (``t`` promoted with cos)."""
    dtype = torch.promote_types(t.dtype, cos.dtype)
    return t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format, copy=True)


@kernel_op(__name__, "rope_forward")
def _rope_forward(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """[query, key] rotated, (B, T, H | Hkv, hd)."""
    rotated_query, rotated_key = _rows_copy(query, cos), _rows_copy(key, cos)
    _liger_rope().rope_forward(rotated_query.transpose(1, 2), rotated_key.transpose(1, 2), cos, sin)  # in place
    return [rotated_query, rotated_key]


@_rope_forward.register_fake
def _(query, key, cos, sin):
    return [_rows_copy(query, cos), _rows_copy(key, cos)]


@kernel_op(__name__, "rope_backward")
def _rope_backward(d_query: torch.Tensor, d_key: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``_rope_forward``'s inputs, (B, T, H | Hkv, hd), from those of its results (the same
    layout): the rotation by -sin."""
    rows_query, rows_key = (t.clone(memory_format=torch.contiguous_format) for t in (d_query, d_key))
    _liger_rope().rope_backward(rows_query.transpose(1, 2), rows_key.transpose(1, 2), cos, sin)  # in place
    return [rows_query, rows_key]


@_rope_backward.register_fake
def _(d_query, d_key, cos, sin):
    return [d_query.clone(memory_format=torch.contiguous_format), d_key.clone(memory_format=torch.contiguous_format)]


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)


def _gradients(ctx, grads):
    cos, sin = ctx.saved_tensors
    rows_query, rows_key = _rope_backward(*grads, cos, sin)  # (a result without a gradient: zeros, materialised)
    return (rows_query.transpose(1, 2).to(ctx.dtypes[0]), rows_key.transpose(1, 2).to(ctx.dtypes[1]), None,
            None)


_rope_forward.register_autograd(_gradients, setup_context=_save)
