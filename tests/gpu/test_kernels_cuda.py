"""The Triton kernels on the GPU at realistic shapes, values and gradients, against the PyTorch reference in fp64.

Each kernel runs in fp32 and in bf16 (inputs rounded to bf16; the reference takes the same rounded values in fp64,
so the error measured is the kernel's own arithmetic). Bounds: ||out - ref|| / ||ref||, fp32 below 2e-3 (TF32-class
dots inside the kernels), bf16 below 2e-2.
"""

import functools
from dataclasses import replace

import pytest
import torch

from gpu_setup import DEVICE, DRY, LENGTHS, ON_DEVICE, SHAPES, record, relative_error  # noqa: F401 (record: a fixture)

from hf_mixers.apps.bench.harness import build_mixer
from hf_mixers.apps.bench.kernels import _unsupported
from hf_mixers.kernels.feedback_solve import feedback_solve, sparse_solve
from hf_mixers.kernels.rsa_memory import initial_state, rsa_memory
from hf_mixers.kernels.token_patterns import support_rows

pytestmark = ON_DEVICE
BOUND = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = [(shape, length, dtype) for shape in SHAPES for length in LENGTHS for dtype in DTYPES]


def _random(generator, *size, dtype, scale=1.0, shift=0.0, uniform=False):
    x = torch.rand(*size, generator=generator) if uniform else torch.randn(*size, generator=generator)
    return (x * scale + shift).to(DEVICE).to(dtype)  # rounded to dtype once: kernel and reference see one value


def _check(record, what, outputs, references, dtype):
    errors = {name: relative_error(outputs[name], references[name]) for name in references}
    record(kernel=what, dtype=str(dtype).split(".")[-1], errors=errors, bound=BOUND[dtype])
    bad = {name: error for name, error in errors.items() if not error < BOUND[dtype]}
    assert not bad, f"{what}: relative errors over {BOUND[dtype]:g}: {bad}"


# ---- Sessa's feedback solve -------------------------------------------------------------------------------------

def _solve_inputs(shape, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = shape["feedback_heads"]
    width = shape["heads"] * shape["head_dim"] // rows
    key_dim = shape.get("feedback_key_dim", width)
    inputs = {"f": _random(g, rows, length, width, dtype=dtype),
              **{name: _random(g, rows, length, key_dim, dtype=dtype) for name in ("q", "k")}}
    inputs["gain"] = _random(g, rows, length, dtype=dtype, scale=1.8, shift=-0.9, uniform=True)
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[0, :length // 8] = False  # left padding on the first row
    return inputs, mask.to(DEVICE)


def _solve(inputs, mask, backend, dtype):
    leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items()}
    out = feedback_solve(**leaves, key_mask=mask, chunk_size=64, backend=backend)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), list(leaves.values()))
    return {"s": out, **{f"d{name}": grad for name, grad in zip(leaves, grads)}}


@functools.lru_cache(maxsize=2)
def _solve_reference(shape_name, length, dtype):
    inputs, mask = _solve_inputs(SOLVE_SHAPES[shape_name], length, dtype)
    return _solve(inputs, mask, "torch", torch.float64)


# Sessa's official conversion: one feedback head, its row and keys as wide as the model (576 for SmolLM2); the lean
# one: that row with narrow keys (64). The kernels take keys and value columns 128 at a time. At the shorter length
# only: the blocks are what these layouts add, and the 8K references are the slow part of a GPU run.
ONE_HEAD = {**{f"{name}-one-head": dict(shape, feedback_heads=1) for name, shape in SHAPES.items()
               if name != "llama3-8b"},
            **{f"{name}-one-head-lean": dict(shape, feedback_heads=1, feedback_key_dim=shape["head_dim"])
               for name, shape in SHAPES.items() if name != "llama3-8b"}}
SOLVE_SHAPES = {**SHAPES, **ONE_HEAD}


@pytest.mark.parametrize("shape_name,length,dtype_name",
                         CASES + [(shape, LENGTHS[0], dtype) for shape in ONE_HEAD for dtype in DTYPES])
def test_feedback_solve_kernel_matches_reference(shape_name, length, dtype_name, record):
    dtype = DTYPES[dtype_name]
    inputs, mask = _solve_inputs(SOLVE_SHAPES[shape_name], length, dtype)
    outputs = _solve(inputs, mask, "triton", dtype)
    _check(record, f"feedback solve {shape_name} T={length}", outputs,
           _solve_reference(shape_name, length, dtype), dtype)


# ---- RSA's memory read ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _rsa_layer(shape_name):
    """An RSA layer of this head layout with the conversion defaults (4 levels x 64 slots), scratch-initialised."""
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    module, _ = build_mixer("rsa", {}, shape["heads"] * shape["head_dim"], shape["heads"], shape["kv_heads"],
                            DEVICE, torch.float32)
    return module


def _rsa_inputs(shape_name, length, dtype, compute):
    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(2)
    kv, group, d = shape["kv_heads"], shape["heads"] // shape["kv_heads"], shape["head_dim"]
    q = _random(g, 1, kv, group, length, d, dtype=dtype).to(compute).requires_grad_()
    k = _random(g, 1, kv, length, d, dtype=dtype).to(compute).requires_grad_()
    v = _random(g, 1, kv, length, d, dtype=dtype).to(compute).requires_grad_()
    return q, k, v


def _rsa(shape_name, length, dtype, backend, compute, compile_write=False):
    module = _rsa_layer(shape_name)
    q, k, v = _rsa_inputs(shape_name, length, dtype, compute)
    weights = [p for p in module.parameters() if p.requires_grad]
    params = replace(module.memory_params(compute), compile_write=compile_write)
    out, _ = rsa_memory(q, k, v, None, initial_state(params, 1, v.shape[-1], compute), params, backend=backend)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), [q, k, v, *weights], allow_unused=True)
    names = ["dq", "dk", "dv"] + [f"d[{name}]" for name, p in module.named_parameters() if p.requires_grad]
    return {"o": out, **{name: grad for name, grad in zip(names, grads) if grad is not None}}


@functools.lru_cache(maxsize=2)
def _rsa_reference(shape_name, length, dtype):
    return _rsa(shape_name, length, dtype, "torch", torch.float64)


@pytest.mark.parametrize("shape_name,length,dtype_name", CASES)
def test_rsa_memory_kernel_matches_reference(shape_name, length, dtype_name, record):
    dtype = DTYPES[dtype_name]
    reason = _unsupported(SHAPES[shape_name]).get("rsa_triton")
    if reason:  # a head wider than the kernel's tiles: forced, an error naming why; auto: the PyTorch path
        with pytest.raises(RuntimeError, match="cannot run"):
            _rsa(shape_name, 64, dtype, "triton", torch.float32)
        record(kernel=f"rsa memory {shape_name}", not_run=reason)
        return
    outputs = _rsa(shape_name, length, dtype, "triton", torch.float32)
    reference = _rsa_reference(shape_name, length, dtype)
    assert outputs.keys() == reference.keys(), "the Triton path gives gradients to other parameters"
    _check(record, f"rsa memory {shape_name} T={length}", outputs, reference, dtype)


def _rsa_inference(shape_name, length, dtype, backend, compute):
    """A prefill's memory without autograd: the output and the state it leaves (the write side's results)."""
    q, k, v = _rsa_inputs(shape_name, length, dtype, compute)
    params = _rsa_layer(shape_name).memory_params(compute)
    with torch.no_grad():
        out, state = rsa_memory(q, k, v, None, initial_state(params, 1, v.shape[-1], compute), params,
                                backend=backend)
    return {"o": out, **{name: getattr(state, name) for name in ("key_sum", "value_sum", "mass", "relation_sum",
                                                                 "key_ref", "value_ref")}}


@pytest.mark.parametrize("shape_name,length,dtype_name", CASES)
def test_rsa_memory_inference_write_kernel_matches_reference(shape_name, length, dtype_name, record):
    """Without autograd (a prefill): the chain kernel (kernels/rsa_chain_triton.py) and the read's forward, the
    output and the state it leaves against the fp64 reference."""
    dtype = DTYPES[dtype_name]
    reason = _unsupported(SHAPES[shape_name]).get("rsa_triton")
    if reason:
        record(kernel=f"rsa memory inference {shape_name}", not_run=reason)
        return
    outputs = _rsa_inference(shape_name, length, dtype, "triton", torch.float32)
    reference = _rsa_inference(shape_name, length, dtype, "torch", torch.float64)
    _check(record, f"rsa memory inference {shape_name} T={length}", outputs, reference, dtype)


# the dry run: that the named mode runs (on a CPU "reduce-overhead" compiles the default mode's graph, which
# tests/unit/test_rsa_memory.py checks in fp64)
@pytest.mark.parametrize("mode", [True, "reduce-overhead"] if not DRY else ["reduce-overhead"])
def test_rsa_compiled_write_matches_reference(mode, record):
    """Training with ``rsa_compile_write``: each chunk's write side one torch.compile graph (with "reduce-overhead",
    its forward and backward replayed as CUDA graphs, every chunk a node of cudagraph trees), the read the Triton
    kernel. Two steps, so that the second runs what the first compiled (and, with CUDA graphs, recorded): the output
    and every gradient against the fp64 reference each time. SmolLM2's layout at the shorter length, fp32."""
    shape_name, length = next(iter(SHAPES)), LENGTHS[0]
    reference = _rsa_reference(shape_name, length, torch.float32)
    for step in range(2):
        outputs = _rsa(shape_name, length, torch.float32, "auto", torch.float32, compile_write=mode)
        _check(record, f"rsa compiled write ({mode}) {shape_name} T={length}, step {step}", outputs, reference,
               torch.float32)


# ---- GLTM's sparse solve ----------------------------------------------------------------------------------------

def _sparse(shape_name, length, dtype, backend, compute):
    """GLTM's sparse feedback solve at this head layout, a (sequence, head) row each, pow2_ce's support table shared
    by the rows (a broadcast, as the layer passes it); entries in [0, 0.9 / K) so that a row's sum stays below 1 (a
    stable solve at 8K). s and the gradients of f and the weights."""
    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(4)
    support = (support_rows("pow2_ce", torch.arange(1, length + 1)[None]) - 1).to(DEVICE)  # (1, T, K); -1: none
    rows, entries = shape["heads"], support.shape[-1]
    f = _random(g, rows, length, shape["head_dim"], dtype=dtype).to(compute).requires_grad_()
    weights = (_random(g, rows, length, entries, dtype=dtype, scale=0.9 / entries, uniform=True).to(compute)
               * (support >= 0)).requires_grad_()
    s = sparse_solve(f, weights, support.expand(rows, -1, -1), backend=backend)
    probe = torch.randn(s.shape, generator=torch.Generator().manual_seed(5)).to(s.device, torch.float64)
    d_f, d_weights = torch.autograd.grad((s.double() * probe).sum(), [f, weights])
    return {"s": s, "df": d_f, "dweights": d_weights}


@functools.lru_cache(maxsize=2)
def _sparse_reference(shape_name, length, dtype):
    return _sparse(shape_name, length, dtype, "torch", torch.float64)


@pytest.mark.parametrize("shape_name,length,dtype_name", CASES)
def test_gltm_sparse_solve_kernel_matches_reference(shape_name, length, dtype_name, record):
    """The chunk pipeline (kernels/sparse_solve_triton.py: programs waiting on the blocks before them, the adjoint
    scattered by atomic adds) on the GPU, forward and backward, against the block form in fp64."""
    dtype = DTYPES[dtype_name]
    _check(record, f"gltm sparse solve {shape_name} T={length}", _sparse(shape_name, length, dtype, "triton",
                                                                         torch.float32),
           _sparse_reference(shape_name, length, dtype), dtype)
