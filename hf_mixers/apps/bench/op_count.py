"""How many operator calls a step issues, and how many of them read a value back to the host.

On a GPU each eager aten call is a kernel launch (and ~40 us of host time on the lent H100), and each host read
(``.item()``, ``bool(tensor)``, ``nonzero``) waits for the queue to drain: a step's op count predicts its eager speed
when the work per op is small. The count is taken on CPU, where it is the same dispatch the GPU path would issue:

    counted = aten calls under a TorchDispatchMode, forward and backward, views and metadata excluded
              + one per Triton kernel launch (under TRITON_INTERPRET=1 the interpreter's own tensor copies inside a
              launch are not counted: on a GPU the launch is one)
    host reads = _local_scalar_dense (item, bool, int of a tensor), is_nonzero, nonzero / argwhere (a shape that
              depends on the data), each with the line that issued it (``read_sites``); ``tolist`` is not dispatched
              and not seen

Used by the launch-budget test (tests/unit/test_launch_budget.py) and by ``make gpu-check`` (ops per step beside the
step's time).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "argwhere", "equal"})
# Aliasing, allocation and metadata: no kernel on a GPU (views are caught by ``is_view`` too).
_NO_KERNEL = frozenset({"detach", "alias", "lift_fresh", "_unsafe_view", "view", "expand", "as_strided",
                        "t", "transpose", "permute", "squeeze", "unsqueeze", "select", "slice", "unbind", "split",
                        "split_with_sizes", "chunk", "unflatten", "reshape_alias", "_reshape_alias", "sym_size",
                        "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "empty_like",
                        "empty", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "size",
                        "stride", "dim", "numel", "is_contiguous", "_has_compatible_shallow_copy_type",
                        "_to_copy_if_needed", "record_stream", "promote_types", "result_type"})


def _is_free(func, args) -> bool:
    # ``contiguous`` is marked as a view (it returns its input when that is contiguous already) but copies otherwise
    if func.overloadpacket.__name__ == "contiguous":
        memory_format = args[1] if len(args) > 1 else torch.contiguous_format
        return args[0].is_contiguous(memory_format=memory_format)
    return func.is_view or func.overloadpacket.__name__ in _NO_KERNEL


@dataclass
class OpCount:
    """What one counted call issued: ``ops`` launches in all, of which ``host_reads`` read back to the host."""

    ops: int = 0
    host_reads: int = 0
    triton_launches: int = 0
    by_name: Counter = field(default_factory=Counter)
    by_site: Counter = field(default_factory=Counter)  # with ``sites``: "file:function:line" of the issuing code
    read_sites: Counter = field(default_factory=Counter)  # each host read's caller, "path:function:line" (always)

    def top(self, n: int = 12) -> list[tuple[str, int]]:
        return self.by_name.most_common(n)


def _package_folders() -> tuple[str, ...]:
    """Where the project's code lives: hf_mixers and the folders installed under its namespace (kernels, ...)."""
    import hf_mixers
    from hf_mixers import kernels

    return tuple(str(Path(module.__file__).parent) + os.sep for module in (hf_mixers, kernels))


# ``int(tensor)`` and ``bool(tensor)`` pass through torch's dynamo-disabling wrapper (torch/_compile.py) on the way
_DISPATCH_FRAMES = (os.sep + "op_count.py", os.sep + "_python_dispatch.py", os.sep + "_ops.py",
                    os.path.join("torch", "_compile.py"), os.path.join("torch", "_dynamo", "eval_frame.py"))


def _reader() -> str:
    """The innermost Python frame outside the dispatch machinery: the line that read the value back (an
    ``.item()`` in torch's own optimizer is sited there, not in the code that called the optimizer)."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.endswith(_DISPATCH_FRAMES):
            return f"{frame.filename}:{frame.name}:{frame.lineno}"
    return "unknown"


def _site(folders) -> str:
    """The innermost frame of the project's own code, or "autograd" for the backward pass, which autograd's engine
    runs without a Python frame of ours."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(folders) and not frame.filename.endswith("op_count.py"):
            return f"{Path(frame.filename).name}:{frame.name}:{frame.lineno}"
    return "autograd"


def _custom_op_function(func):
    """The Python function behind one of the kernels' torch.library ops (kernels/conventions.py ``kernel_op``), else
    None: the counter runs it under itself, so the op's allocations and launches count, not the op as one call."""
    from ...kernels.conventions import KERNEL_OPS

    return KERNEL_OPS.get(func.name())


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount, sites: bool):
        super().__init__()
        self.count = count
        self.sites = _package_folders() if sites else None
        self.inside_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kernels_op = _custom_op_function(func)
        if kernels_op is not None:  # our kernels' torch.library ops: count what they run, as on a GPU
            with self:
                return kernels_op(*args, **(kwargs or {}))
        if not self.inside_launch and not _is_free(func, args):
            name = func.overloadpacket.__name__
            self.count.ops += 1
            self.count.by_name[name] += 1
            if self.sites:
                self.count.by_site[_site(self.sites)] += 1
            if name in HOST_READS:
                self.count.host_reads += 1
                self.count.read_sites[_reader()] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_launches_as_one(mode: _Counter, run: bool = True):
    """Count each interpreted Triton launch once and none of the interpreter's own tensor traffic inside it;
    ``run=False``: count it without running it."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # no triton: no launches to count
        yield
        return
    launch = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        mode.count.ops += 1
        mode.count.triton_launches += 1
        mode.count.by_name[f"triton:{self.fn.__name__}"] += 1
        if mode.sites:
            mode.count.by_site[_site(mode.sites)] += 1
        if not run:
            return None
        mode.inside_launch += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.inside_launch -= 1

    GridExecutor.__call__ = counted
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


def _one_launch(mode: _Counter, name: str, function):
    """``function`` as one counted launch forward and one backward, what it runs inside uncounted (the counter is
    off inside; it is also the only way to run a higher-order op such as flex_attention under it): a CUDA library
    kernel (a fused forward and a fused backward) stood in for on CPU. Arguments and results may be any pytree; the
    backward recomputes the function and differentiates it."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_unflatten

    def launched():
        mode.count.ops += 1
        mode.count.by_name[f"library:{name}"] += 1
        if mode.sites:
            mode.count.by_site[_site(mode.sites)] += 1

    def call(*args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
        results = []

        def run(*tensors):
            leaves = list(flat)
            for i, tensor in zip(at, tensors):
                leaves[i] = tensor
            positional, named = tree_unflatten(leaves, spec)
            out, out_spec = tree_flatten(function(*positional, **named))
            results.append(out_spec)
            return out

        class Launch(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *tensors):
                launched()
                with _disable_current_modes():
                    out = run(*tensors)
                ctx.save_for_backward(*tensors)
                return tuple(out)

            @staticmethod
            def backward(ctx, *grads):
                launched()
                with _disable_current_modes(), torch.enable_grad():
                    inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
                    pairs = [(out, grad) for out, grad in zip(run(*inputs), grads)
                             if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
                    wanted = [t for t in inputs if t.requires_grad]
                    found = iter(torch.autograd.grad([p[0] for p in pairs], wanted, [p[1] for p in pairs],
                                                     allow_unused=True) if pairs and wanted else ())
                return tuple(next(found, None) if t.requires_grad else None for t in inputs)

        out = Launch.apply(*(flat[i] for i in at))
        return tree_unflatten(list(out), results[0])

    return call


def _flex_attention_with_cpu_backward(*args, **kwargs):
    """flex_attention on CPU with its backward: torch refuses one there (its CPU compile has none), and the eager
    dense backward that check guards is what a stand-in's recompute needs."""
    import torch.nn.attention.flex_attention as flex

    check = flex._validate_device
    flex._validate_device = lambda *_: None
    try:
        return flex.flex_attention(*args, **kwargs)
    finally:
        flex._validate_device = check


def _simple_gla_reference(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                          **_):
    """flash-linear-attention's ``chunk_simple_gla`` on CPU: its own naive recurrence (fla-core is pure Python; its
    kernels need CUDA). ``g_gamma`` (a constant log decay a head) becomes the per-token gate it stands for."""
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    if g is None:
        g = g_gamma.to(q.dtype).expand(*q.shape[:3])
    return naive_recurrent_simple_gla(q, k, v, g, scale, initial_state, output_final_state)


def _gla_reference(q, k, v, g, scale=None, initial_state=None, output_final_state=False, **_):
    """flash-linear-attention's ``chunk_gla`` on CPU: its naive recurrence, which always scales the queries by
    K^-1/2 (rescaled here to ``scale``)."""
    from fla.ops.gla.naive import naive_recurrent_gla

    features = q.shape[-1]
    if scale is not None:
        q = q * (scale * features ** 0.5)
    return naive_recurrent_gla(q, k, v, g, initial_state, output_final_state)


# The CUDA-only library kernels ``library_kernels`` stands in for on CPU: "module.attribute" -> (name, CPU function)
LIBRARY_KERNELS = {"torch.nn.attention.flex_attention.flex_attention": ("flex_attention",
                                                                        _flex_attention_with_cpu_backward),
                   "fla.ops.simple_gla.chunk_simple_gla": ("chunk_simple_gla", _simple_gla_reference),
                   "fla.ops.gla.chunk_gla": ("chunk_gla", _gla_reference)}


def count_ops(fn, *args, sites: bool = False, library_kernels: bool = False, run_kernels: bool = True,
              **kwargs) -> tuple[OpCount, object]:
    """Run ``fn(*args, **kwargs)`` once and count what it dispatched: (OpCount, fn's result). ``sites``: also count
    by the line of our code that issued each op (``OpCount.by_site``; slower: a stack walk an op).
    ``library_kernels``: the CUDA-only library kernels of ``LIBRARY_KERNELS`` run where a GPU would run them, each
    counted as one launch forward and one backward (kernels/dispatch.py ``library_stand_ins``). ``run_kernels=False``:
    each Triton launch is counted but not run, its outputs left as allocated (the same count, minutes sooner under
    the interpreter, where nothing reads a kernel's values back to decide what to launch; the values are garbage).
    RoPE takes Liger's kernel as on a GPU (kernels/rope.py ``INTERPRET_LIGER``)."""
    from ...kernels import rope
    from ...kernels.dispatch import library_stand_ins

    count = OpCount()
    mode = _Counter(count, sites)
    stand_ins = {path: _one_launch(mode, name, function) for path, (name, function) in LIBRARY_KERNELS.items()}
    interpret_liger, rope.INTERPRET_LIGER = rope.INTERPRET_LIGER, True
    try:
        with library_stand_ins(stand_ins if library_kernels else {}), _triton_launches_as_one(mode, run_kernels), mode:
            result = fn(*args, **kwargs)
    finally:
        rope.INTERPRET_LIGER = interpret_liger
    return count, result


def training_step_ops(module, hidden_states, position_embeddings, sites: bool = False,
                      library_kernels: bool = False, run_kernels: bool = True) -> OpCount:
    """One forward + backward of a standalone layer (``apps/bench/harness.build_mixer``) on ``hidden_states``: the
    count of the benchmarks' training step, the loss a sum of squares (``library_kernels``, ``run_kernels``: as
    ``count_ops``). A first step, not counted, does what a run does once: a library's import (Liger's), what a
    library kernel builds once a shape (flex's block mask)."""

    def step():
        module(hidden_states, position_embeddings).float().pow(2).mean().backward()

    count_ops(step, library_kernels=library_kernels, run_kernels=run_kernels)
    module.zero_grad(set_to_none=True)  # or the counted step would accumulate into the gradients
    hidden_states.grad = None
    return count_ops(step, sites=sites, library_kernels=library_kernels, run_kernels=run_kernels)[0]
