"""What the PyTorch references and their Triton kernels share: the dtype that recurrent states, solves and softmax
normalisers accumulate in (and ``outside_autocast``, which keeps it so in a mixed-precision run), the argument
checks of the feedback solve, and the Triton kernels' tile edges."""

from __future__ import annotations

import functools
import math
import os
import re
import types

import torch


# Issue 67's register budget for a Triton kernel on sm_90 at 4 warps, passed as ``maxnreg`` where a kernel would
# otherwise take more (ptxas then keeps within it; tests/unit/test_kernel_resources.py checks there is no spill).
MAX_REGISTERS = 168

# The operand precision of the kernels' ``tl.dot`` (they accumulate in fp32 whatever it is). fp32 inputs get
# fp32-accurate dots ("tf32x3": three tf32 products), and so does any kernel where plain tf32 was measured too coarse
# (RSA's read). bf16 / fp16 inputs take plain tf32 where issue 67's emulated check (`hf-mixers bench precision`,
# docs/benchmarks.md) keeps the step within the bf16 bound, an error a bf16 run makes anyway: one product a dot
# instead of three, a third of the tensor-core work and fewer registers.
FP32_DOTS = "tf32x3"


def dot_precision(dtype: torch.dtype) -> str:
    """The dots' input precision for a call whose inputs came as ``dtype`` (the comment above): only half-precision
    inputs take plain tf32; fp64 (the interpreter tests' reference dtype) takes exact FMA dots."""
    if dtype == torch.float64:
        return "ieee"
    return "tf32" if dtype in (torch.float16, torch.bfloat16) else FP32_DOTS


def tile_edge(n: int, cap: int | None = None) -> int:
    """A Triton kernel's tile edge for ``n``: the power of two >= max(n, 16) (``tl.dot`` needs >= 16 on GPUs),
    at most ``cap`` when given (a dimension then taken in blocks)."""
    size = max(16, 1 << (max(n, 1) - 1).bit_length())
    return size if cap is None else min(size, cap)


def data_checks() -> bool:
    """Whether kernels check what only the data can show (e.g. a support entry in its row's future): each such check
    reads a value back to the host, which stalls a GPU's queue of launches, so they run only when
    ``HF_MIXERS_DEBUG=1`` (the tests that prove the messages set it). Shape checks always run: they read nothing."""
    return os.environ.get("HF_MIXERS_DEBUG") == "1" and not torch.compiler.is_compiling()


_shape_constants: dict = {}  # key -> a tensor built from shapes and options only (``shape_constant``)


def shape_constant(key: tuple, build):
    """``build()``, a value that depends only on shapes and options (a pattern's index table, a block mask): built
    once per ``key`` (which names the device) and kept, the 64 newest; inside a compiled graph built in place, as
    part of the graph (a kept tensor would be a global for dynamo to guard on)."""
    if torch.compiler.is_compiling():
        return build()
    if key not in _shape_constants:
        if len(_shape_constants) >= 64:
            _shape_constants.pop(next(iter(_shape_constants)))
        _shape_constants[key] = build()
    return _shape_constants[key]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Solves and softmax normalisers run in fp32 whatever the activation dtype (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def outside_autocast(function):
    """Run a kernel in the dtype of the tensors it is given, also inside torch.autocast (a bf16 / fp16 training run):
    autocast would turn its fp32 matmuls and einsums into bf16 / fp16 ones, losing the fp32 accumulation the mixers
    ask for (0.7% error in a bf16 retention) and, in fp16, overflowing the memories' sums. The mixers' projections
    stay under autocast; what they hand a kernel is already in ``compute_dtype``."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        for device in ("cuda", "cpu"):  # off for each device where it is on (a plain `with`: dynamo traces it)
            if torch.is_autocast_enabled(device):
                with torch.autocast(device, enabled=False):
                    return run(*args, **kwargs)
        return function(*args, **kwargs)

    return run


def _packed_starts(shapes) -> tuple[list[int], int]:
    """Where each of ``shapes`` starts in one packed buffer (each start a multiple of 4 elements: 16-byte aligned in
    fp32, as Triton's pointer specialisation expects), and the buffer's length."""
    starts, end = [], 0
    for shape in shapes:
        starts.append(end)
        end += -(-math.prod(shape) // 4) * 4
    return starts, end


def readable_in_place(x: torch.Tensor) -> bool:
    """Whether a kernel can read x as it lies (and write its gradient in a tensor allocated like it): unit stride on
    the last axis, and ``empty_like`` keeps x's strides (dense, no overlap)."""
    return x.stride(-1) == 1 and torch.empty_like(x).stride() == x.stride()


def kept_by_state(part: torch.Tensor) -> torch.Tensor:
    """``part`` (a slice of a call's tensor) as a returned state keeps it. Without autograd (a prefill: its cache
    keeps the state) a dense copy that owns its storage: a view would hold the whole tensor alive until the next
    step replaced it, and a compiled decode step sees the strides it was built for. Under autograd the view itself:
    a training step drops its state, and the copy would be a launch a step for nothing."""
    return part if torch.is_grad_enabled() else part.clone(memory_format=torch.contiguous_format)


def table_with_contiguous_rows(table: torch.Tensor) -> torch.Tensor:
    """A support table (B, T, K) as a kernel reads it: each batch's (T, K) rows contiguous, the batch stride free (0
    for one table broadcast over the batch); copied only where its rows lie otherwise."""
    if table.stride(-1) == 1 and table.stride(-2) == table.shape[-1]:
        return table
    return table.contiguous()


def packed_zeros(shapes, device, dtype=torch.float32) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Zero-filled tensors of ``shapes`` as views of one buffer (kernels accumulate into them; a fresh state starts
    from them): one fill launch instead of one a tensor. Returns (the buffer, the views). A torch.library op returns
    the buffer (an op's results may not alias each other) and its caller takes the views again with ``unpacked``."""
    starts, length = _packed_starts(shapes)
    buffer = torch.zeros(length, dtype=dtype, device=device)
    return buffer, unpacked(buffer, shapes)


def unpacked(buffer: torch.Tensor, shapes) -> list[torch.Tensor]:
    """The views of ``packed_zeros``' buffer, by shape (no copy)."""
    starts, _ = _packed_starts(shapes)
    return [buffer[start:start + math.prod(shape)].view(shape) for start, shape in zip(starts, shapes)]


KERNEL_OPS: dict = {}  # "namespace::name" -> each kernel op's Python function (op_count runs it, counted)


def kernel_op(module_name: str, name: str):
    """``torch.library.custom_op`` for a kernel module's launches (no argument mutated): torch.compile keeps the op
    as one call and never traces a launch. The namespace comes from the module's import name, so a Hub folder's copy
    of the module (imported under transformers_modules...) registers its own ops beside the installed package's,
    where one shared name would be registered twice; the function is kept in ``KERNEL_OPS``."""
    qualified = re.sub(r"\W", "_", module_name) + "::" + name

    def register(function):
        KERNEL_OPS[qualified] = function
        return torch.library.custom_op(qualified, mutates_args=())(function)

    return register


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
COMPILE_CHOICES = (False, True, *COMPILE_MODES)  # a compile switch: off, torch.compile's default mode, or a mode


def own_code(function):
    """``function`` with a code object of its own, to hand torch.compile: dynamo keeps its graphs, and its limit of 8
    recompiles before it silently falls back to eager, per code object, so two compiles of one function (another
    mode, another batch size) would otherwise evict each other's graphs and share that limit."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s) -> int:
    """Raise ValueError naming the argument whose shape does not fit f (B, T, D); returns P, the cached tokens."""
    batch, length, _ = f.shape
    if q.shape[:2] != (batch, length) or k.shape != q.shape:
        raise ValueError(f"feedback_solve: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, T, d) with "
                         f"(B, T) = {(batch, length)} from f {tuple(f.shape)}")
    if gain.shape != (batch, length):
        raise ValueError(f"feedback_solve: gain has shape {tuple(gain.shape)}, expected {(batch, length)}")
    if (past_k is None) != (past_s is None):
        raise ValueError("feedback_solve: past_k and past_s must be given together")
    past = 0 if past_k is None else past_k.shape[1]
    if past_k is not None and (past_s.shape[:2] != (batch, past) or past_s.shape[2] != f.shape[2]):
        raise ValueError(f"feedback_solve: past_s {tuple(past_s.shape)} does not match past_k "
                         f"{tuple(past_k.shape)} and f {tuple(f.shape)}")
    if key_mask is not None and key_mask.shape != (batch, past + length):
        raise ValueError(f"feedback_solve: key_mask has shape {tuple(key_mask.shape)}, expected "
                         f"{(batch, past + length)} (past {past} + new {length} tokens)")
    return past
