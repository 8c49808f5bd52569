"""Running Triton kernel tests on a CPU-only machine: the interpreter, in a fresh pytest process.

The Triton interpreter needs TRITON_INTERPRET=1 in the environment before ``import triton``: triton decorates its
own standard library (``tl.zeros``, ``tl.sum``, ...) and every ``@triton.jit`` kernel at import time. conftest.py's
``import hf_mixers`` already imports triton (through torch._dynamo), so setting the variable inside a test is too
late. A kernel test file therefore:

    from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter   # skips the file without triton

    @pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
    def test_under_interpreter_in_subprocess():
        run_under_interpreter(__file__)

    @needs_kernels
    def test_something(): ...      # on DEVICE: "cuda" on a GPU machine, "cpu" in the interpreter subprocess

On a GPU machine the kernel tests run in-process on CUDA and the subprocess test is skipped; on a CPU machine the
parent process skips them and re-runs the file with TRITON_INTERPRET=1, where DEVICE is "cpu".
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETED = isinstance(triton.language.zeros, InterpretedFunction)  # triton was imported with TRITON_INTERPRET=1


def patch_the_language_once_a_launch():
    """The interpreter swaps triton.language's builtins for interpreted ones (``_patch_lang``: inspect.getmembers
    over tl, tl.tensor, tl.math, for each of tl and tl.core a function's module holds) at a launch, and again at
    every call of a ``@triton.jit`` function inside it (ours, and tl.zeros and its kin), where the same module
    objects are mostly swapped already; a helper's swap is never undone (the launch's restore puts the originals
    back). Those repeats were a third of an interpreted RSA test's time; here a call inside a launch swaps only the
    modules not swapped yet in it. Also: the numpy dtype table cached, and the overflow checks dropped (below).
    Idempotent."""
    import dataclasses
    import inspect

    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "once_a_launch", False):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    languages = (triton.language, triton.language.core)
    swapped, modules_of = set(), {}

    def patch_once(fn):
        modules = modules_of.get(fn)
        if modules is None:
            modules = modules_of[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                                 if inspect.ismodule(value) and value in languages)
        if modules <= swapped:  # inside a launch that has swapped this function's language already
            return interpreter._LangPatchScope()
        swapped.update(modules)
        return patch_lang(fn)

    def launch_and_reset(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped.clear()

    numpy_dtypes = {}
    numpy_dtype = interpreter._get_np_dtype  # builds its table of 18 dtypes at each of its ~1e5 calls a test

    def cached_numpy_dtype(dtype):
        try:
            found = numpy_dtypes.get(dtype)
        except TypeError:  # a pointer type (unhashable)
            return numpy_dtype(dtype)
        if found is None:
            found = numpy_dtypes[dtype] = numpy_dtype(dtype)
        return found

    patch_once.once_a_launch = True
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_once, launch_and_reset
    interpreter._get_np_dtype = cached_numpy_dtype
    # The overflow check around every integer add / mul / sub computes in int64 and compares, then hands the result to
    # a device assert that the interpreter's options (debug off) drop: work for nothing, a quarter of a kernel's time.
    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def share_block_shapes():
    """Every interpreted op builds a ``tl.block_type`` for its result (its shape a ``tl.tuple`` of constexpr types,
    validated, named by a string) and a ``tl.tensor`` around it (the shape again, as constexprs): a third of an
    interpreted RSA test's time, for a handful of distinct shapes. Here each distinct shape is built once and shared
    (nothing writes to a block's shape), so that a broadcast of two blocks of one shape, the common case, is also
    seen at once to be none. Idempotent."""
    import builtins

    from triton.language import core
    from triton.runtime import interpreter

    if getattr(core.block_type.__init__, "shared", False):
        return
    block_type_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    shapes = {}  # sizes -> (a block's shape, its numel, its string, a tensor's shape and numel)

    def shared_block_type_init(self, element_ty, shape):
        try:
            sizes = builtins.tuple(d.value if isinstance(d, core.constexpr) else d for d in shape)
            known = shapes.get(sizes)
        except TypeError:  # not a sequence of hashable sizes: the original, and its error
            sizes = known = None
        if known is None:
            block_type_init(self, element_ty, shape)
            if sizes is None:
                return
            known = shapes[sizes] = (self.shape, self.numel, str(self.shape),
                                     (core.tuple([core.constexpr(s) for s in self.shape]), core.constexpr(self.numel)))
        self.element_ty, self.shape, self.numel, self.tensor_shape = element_ty, known[0], known[1], known[3]
        self.name = f"<{known[2]}, {element_ty}>"

    def shared_tensor_init(self, handle, type):
        shape = getattr(type, "tensor_shape", None)
        if shape is None:  # a scalar, or a block type built before
            return tensor_init(self, handle, type)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = shape

    semantic = interpreter.interpreter_semantic
    broadcast = semantic.broadcast_impl_value

    def broadcast_impl_value(lhs, rhs):
        if lhs.type.is_block() and rhs.type.is_block() and lhs.type.shape is rhs.type.shape:
            return lhs, rhs
        return broadcast(lhs, rhs)

    shared_block_type_init.shared = True
    core.block_type.__init__, core.tensor.__init__ = shared_block_type_init, shared_tensor_init
    semantic.broadcast_impl_value = broadcast_impl_value


if INTERPRETED:
    patch_the_language_once_a_launch()
    share_block_shapes()

DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)

needs_kernels = pytest.mark.skipif(DEVICE is None, reason="no GPU here: run by test_under_interpreter_in_subprocess")
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="interpreter only")


def compile_key(kernel, args, kwargs):
    """What Triton compiles a launch by: the kernel, each argument's kind (a tensor's dtype, a specialised scalar's
    value -- exact here, stricter than Triton's == 1 and % 16 -- a free scalar's type) and the constexprs. For the
    tests that a call's warmups (kernels/triton_compile.py) are exactly what it launches."""
    free = getattr(kernel, "kwargs", {}).get("do_not_specialize") or kernel.do_not_specialize
    free = {kernel.arg_names[n] if isinstance(n, int) else n for n in free}
    kinds = tuple(arg.dtype if isinstance(arg, torch.Tensor) else arg if isinstance(arg, torch.dtype) or name not in
                  free else type(arg) for name, arg in zip(kernel.arg_names, args))
    return kernel.fn.__name__, kinds, tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("grid", "warmup")))


class Launches(set):
    """The compile keys of the launches ``record_launches`` saw. Each launch runs while ``run`` is true; set it false
    to record launches without running them (their outputs left as allocated, garbage: for what a call launches, not
    what it computes; nothing on the host reads a kernel's values to decide what to launch next)."""

    run = True


def record_launches(monkeypatch, kernels) -> Launches:
    """The compile keys of every launch of ``kernels`` from now on."""
    launched = Launches()

    def launch(kernel, real, args, kwargs):
        launched.add(compile_key(kernel, args, kwargs))
        return real(*args, **kwargs) if launched.run else None

    for kernel in kernels:
        monkeypatch.setattr(kernel, "run", lambda *args, _kernel=kernel, _real=kernel.run, **kwargs: launch(
            _kernel, _real, args, kwargs))
    return launched


def tf32_dots(monkeypatch) -> None:
    """From now on, interpreted ``tl.dot``s asked for ``input_precision="tf32"`` round their fp32 operands to tf32
    (10 mantissa bits, to nearest even) first, as a tensor core reads them; the interpreter otherwise computes every
    dot in fp32, so a kernel's own tf32 error would go unseen on a CPU. Nothing changes on a GPU, where it is real."""
    if not INTERPRETED:
        return
    from triton.runtime import interpreter

    from hf_mixers.apps.bench.precision import round_tf32  # the rounding `bench precision` emulates, tested there

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if getattr(input_precision, "name", None) == "TF32":
            a, b = (interpreter.TensorHandle(round_tf32(torch.from_numpy(x.data)).numpy(), x.dtype.scalar)
                    if x.data.dtype == "float32" else x for x in (a, b))
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def run_under_interpreter(test_file, timeout=600, shard=None):
    """Run ``test_file`` in a fresh pytest process with TRITON_INTERPRET=1; fail with its output unless it passed.
    ``shard`` "i/n": only the i-th of n interleaved shares of its tests (conftest.py ``_Shard``; a file whose
    interpreted tests are the suite's longest item parametrises its subprocess test over the shares)."""
    root = Path(__file__).resolve().parents[1]
    markers = os.environ.get("HF_MIXERS_TEST_MARKEXPR")  # the parent's selection (make test-fast: no variants)
    env = {**os.environ, "TRITON_INTERPRET": "1", **({"HF_MIXERS_TEST_SHARD": shard} if shard else {})}
    result = subprocess.run([sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-p",
                             "no:cacheprovider", *(["-m", markers] if markers else [])], cwd=root, env=env,
                            capture_output=True, text=True, timeout=timeout)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "failed" not in summary, \
        result.stdout[-8000:] + result.stderr[-4000:]
    print("interpreter subprocess:", summary)


def padded_layer_step(mixer, options, width, length, dtype=torch.float32, padding=7):
    """A standalone ``mixer`` layer (4 heads, 2 KV heads; apps/bench/harness.build_mixer) on DEVICE and its step on
    a batch of 2 whose first row is left-padded by ``padding`` tokens -> (step, x asking for gradients, module)."""
    from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings

    module, config = build_mixer(mixer, options, width, 4, 2, DEVICE, dtype)
    x = torch.randn(2, length, width, device=DEVICE, dtype=dtype, requires_grad=True)
    embeddings = rotary_embeddings(config, x, length)
    token_mask = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    token_mask[0, :padding] = False
    return (lambda x: module(x, embeddings, None, token_mask)), x, module
