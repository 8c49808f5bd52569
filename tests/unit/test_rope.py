"""RoPE (kernels/rope.py ``apply_rope``): Liger-Kernel's fused kernel against transformers' PyTorch form, values and
gradients, and the dispatch between them.

Liger's kernel is Triton: on CUDA here, or under the Triton CPU interpreter in a subprocess (triton_interpreter.py).
Shapes are small and ragged: 7 tokens, GQA (4 query heads over 2 key heads), head widths 16 and 12 (not a power of
two: the kernel pads it).
"""

import logging

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from triton_interpreter import DEVICE, INTERPRETED, needs_kernels, run_under_interpreter

from hf_mixers.kernels import dispatch, rope

pytest.importorskip("liger_kernel")
DEV = DEVICE or "cpu"


@pytest.fixture(autouse=True)
def interpret_liger(monkeypatch):
    monkeypatch.setattr(rope, "INTERPRET_LIGER", True)  # kernels/rope.py: here its kernel is what is tested


@pytest.mark.variant  # a subprocess of interpreted kernels (8 s, most of it imports): the full tier (make test) only
@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def _inputs(dtype, cos_dtype, width, cos_batch, seed=0):
    """Queries (B, H, T, hd) and keys (B, Hkv, T, hd) as the projections hand them over (views of (B, T, H, hd)),
    asking for gradients, and cos / sin of the rotate-half form."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 7, 4, width, generator=g).to(DEV, dtype).transpose(1, 2).requires_grad_()
    key = torch.randn(2, 7, 2, width, generator=g).to(DEV, dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(cos_batch, 7, width // 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEV, cos_dtype) for f in (torch.cos, torch.sin))
    return query, key, cos, sin


@needs_kernels
@pytest.mark.parametrize("dtype, cos_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="CUDA only: the interpreter's bf16 arithmetic gives NaN (kernels/rope.py takes the "
        "PyTorch form there)"))])
@pytest.mark.parametrize("width, cos_batch", [(16, 1), (12, 2)])
def test_liger_rope_equals_the_pytorch_form(dtype, cos_dtype, width, cos_batch, monkeypatch):
    """The kernel's results and the gradients of q and k equal transformers' form in fp32, in its result dtype (bf16
    queries with fp32 cos: fp32, as the PyTorch form promotes); in bf16 they are as close to the fp64 rotation as the
    PyTorch form's (which rounds each product where the kernel rounds once). The projections' outputs are left as
    they were."""
    query, key, cos, sin = _inputs(dtype, cos_dtype, width, cos_batch)
    before = (query.detach().clone(), key.detach().clone())
    probes = None

    def step(q, k, c, s, fn):  # the rotated q, k and the gradients of a fixed probe of them
        nonlocal probes
        outs = fn(q, k, c, s)
        if probes is None:
            probes = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(DEV, torch.float64)
                      for i, t in enumerate(outs)]
        loss = sum((out.double() * probe).sum() for out, probe in zip(outs, probes))
        return [*outs, *torch.autograd.grad(loss, [q, k])]

    calls, liger = [], rope._rope_forward
    monkeypatch.setattr(rope, "_rope_forward", lambda *a: calls.append(1) or liger(*a))
    fused = step(query, key, cos, sin, lambda *a: rope.apply_rope(*a, backend="triton"))
    assert calls == [1]  # Liger's kernel took the call
    reference = step(query, key, cos, sin, apply_rotary_pos_emb)
    leaves = [t.detach().double().requires_grad_() for t in (query, key)]
    exact = step(*leaves, cos.double(), sin.double(), apply_rotary_pos_emb)
    for got, want, true, name in zip(fused, reference, exact, ("q", "k", "dq", "dk")):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        else:  # a half-precision result or gradient: as accurate as the PyTorch form's
            error, bound = ((t.double() - true).norm() / true.norm() for t in (got, want))
            assert error <= 1.25 * bound + 1e-7, (name, float(error), float(bound))
    assert torch.equal(query.detach(), before[0]) and torch.equal(key.detach(), before[1])


@needs_kernels
def test_under_torch_compile_the_pytorch_form_runs(monkeypatch):
    """Compiled, the PyTorch form stays (Inductor fuses it with its neighbours): the library op is never called."""
    query, key, cos, sin = _inputs(torch.float32, torch.float32, 16, 1)

    def refuse(*args):
        raise AssertionError("the library op ran under torch.compile")

    monkeypatch.setattr(rope, "_rope_forward", refuse)
    compiled = torch.compile(lambda q, k: rope.apply_rope(q, k, cos, sin), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(query, key), apply_rotary_pos_emb(query, key, cos, sin)):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(INTERPRETED or DEVICE is not None, reason="the CPU dispatch, outside the interpreter")
def test_the_dispatch_keeps_the_pytorch_form_on_cpu_and_for_fp64_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_announced", set())
    with caplog.at_level(logging.INFO, logger="hf_mixers.kernels"):
        for dtype in (torch.float32, torch.float64):
            query, key, cos, sin = _inputs(dtype, dtype, 16, 1)
            for got, want in zip(rope.apply_rope(query, key, cos, sin), apply_rotary_pos_emb(query, key, cos, sin)):
                assert torch.equal(got, want)
    assert any("RoPE (Liger-Kernel)" in record.message and "PyTorch path" in record.message
               for record in caplog.records), caplog.text
    assert rope._unsupported(*_inputs(torch.float64, torch.float64, 16, 1)).startswith("queries and keys in")


@needs_kernels
def test_a_forced_triton_backend_falls_back_where_liger_cannot_run(monkeypatch):
    """RoPE's kernel is an option, not a mixer's own: with ``kernel_backend="triton"`` (which forces a mixer's kernels)
    a call Liger cannot take keeps the PyTorch form instead of failing (here: the interpreter with Liger off)."""
    monkeypatch.setattr(rope, "INTERPRET_LIGER", False)
    query, key, cos, sin = _inputs(torch.float32, torch.float32, 16, 1)
    for got, want in zip(rope.apply_rope(query, key, cos, sin, backend="triton"),
                         apply_rotary_pos_emb(query, key, cos, sin)):
        assert torch.equal(got, want)
