"""The shared feedback solve (I - B) s = f: every path against the dense reference (spec §4.4, §6)."""

import math

import pytest
import torch

from hf_mixers.apps.bench.op_count import count_ops
from hf_mixers.kernels.feedback_solve import (feedback_solve, feedback_solve_chunked, feedback_solve_dense,
                                              feedback_solve_recurrent, feedback_solve_sparse, feedback_weights,
                                              sparse_solve)
from hf_mixers.kernels.token_patterns import support_table

F64 = torch.float64


def make_inputs(batch=2, length=17, width=6, key_dim=5, past=0, padded=True, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    f, q, k = randn(batch, length, width), randn(batch, length, key_dim), randn(batch, length, key_dim)
    gain = ((torch.rand(batch, length, generator=g, dtype=dtype) * 2 - 1) * 0.95).requires_grad_()
    mask = torch.ones(batch, past + length, dtype=torch.bool)
    if padded:
        mask[0, :3] = False  # left padding
        mask[-1, past + length // 2] = False  # a hole
    past_k = randn(batch, past, key_dim) if past else None
    past_s = randn(batch, past, width) if past else None
    return dict(f=f, q=q, k=k, gain=gain, key_mask=mask, past_k=past_k, past_s=past_s)


def _call(fn, inputs, **kwargs):
    return fn(inputs["f"], inputs["q"], inputs["k"], inputs["gain"], key_mask=inputs["key_mask"],
              past_k=inputs["past_k"], past_s=inputs["past_s"], **kwargs)


@pytest.mark.parametrize("past", [0, 6])
def test_dense_equals_recurrence(past):
    inputs = make_inputs(past=past)
    torch.testing.assert_close(_call(feedback_solve_dense, inputs), _call(feedback_solve_recurrent, inputs),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("past", [0, 6])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 16, 64])
def test_chunked_equals_dense_values_and_gradients(past, chunk_size):
    inputs = make_inputs(past=past)
    dense = _call(feedback_solve_dense, inputs)
    chunked = _call(feedback_solve_chunked, inputs, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, dense, rtol=0, atol=1e-10)
    probe = torch.randn_like(dense)
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    grads_dense = torch.autograd.grad((dense * probe).sum(), leaves)
    grads_chunked = torch.autograd.grad((chunked * probe).sum(), leaves)
    for leaf_grad_dense, leaf_grad_chunked in zip(grads_dense, grads_chunked):
        torch.testing.assert_close(leaf_grad_chunked, leaf_grad_dense, rtol=0, atol=1e-10)


def test_chunked_gradcheck_fp64():
    inputs = make_inputs(batch=1, length=7, width=3, key_dim=2, past=2)
    names = ["f", "q", "k", "gain", "past_k", "past_s"]

    def fn(f, q, k, gain, past_k, past_s):
        return feedback_solve_chunked(f, q, k, gain, key_mask=inputs["key_mask"], past_k=past_k, past_s=past_s,
                                      chunk_size=3)

    assert torch.autograd.gradcheck(fn, tuple(inputs[n] for n in names))


def test_dense_gradcheck_fp64():
    inputs = make_inputs(batch=1, length=6, width=3, key_dim=2)
    assert torch.autograd.gradcheck(
        lambda f, q, k, gain: feedback_solve_dense(f, q, k, gain, key_mask=inputs["key_mask"]),
        (inputs["f"], inputs["q"], inputs["k"], inputs["gain"]))


def test_neumann_series_and_nilpotency():
    inputs = make_inputs(padded=False)
    f, q, k, gain = (inputs[n].detach() for n in ("f", "q", "k", "gain"))
    weights = feedback_weights(q, k, gain, 0, None, q.shape[-1] ** -0.5)  # B, (batch, T, T)
    length = f.shape[1]
    term, series = f, f.clone()
    for _ in range(length - 1):
        term = weights @ term
        series = series + term
    assert torch.count_nonzero(torch.linalg.matrix_power(weights, length)) == 0  # B^T = 0 exactly
    torch.testing.assert_close(feedback_solve_dense(f, q, k, gain), series, rtol=0, atol=1e-10)


def test_first_row_and_single_token_pass_f_through():
    inputs = make_inputs(padded=False)
    s = _call(feedback_solve_chunked, {**inputs, "key_mask": None}, chunk_size=4)
    assert torch.equal(s[:, 0], inputs["f"][:, 0])
    one = {n: (v[:, :1] if isinstance(v, torch.Tensor) else v) for n, v in inputs.items()}
    one["key_mask"] = None
    assert torch.equal(_call(feedback_solve_chunked, one), one["f"])


def test_zero_gain_returns_f_bitwise_in_fp32():
    inputs = make_inputs(dtype=torch.float32, padded=False)
    inputs["gain"] = torch.zeros_like(inputs["gain"])
    for fn in (feedback_solve_dense, feedback_solve_chunked):
        assert torch.equal(_call(fn, inputs), inputs["f"])


def test_causality():
    inputs = {n: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs().items()}
    base = _call(feedback_solve_chunked, inputs, chunk_size=4)
    for name in ("f", "q", "k", "gain"):
        bumped = dict(inputs)
        bumped[name] = inputs[name].clone()
        bumped[name][:, 10] += 1.0
        out = _call(feedback_solve_chunked, bumped, chunk_size=4)
        assert torch.equal(out[:, :10], base[:, :10]), name


def test_padded_keys_are_never_read():
    inputs = {n: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs().items()}
    base = _call(feedback_solve_chunked, inputs, chunk_size=4)
    poisoned = dict(inputs)
    for name in ("f", "k"):
        poisoned[name] = inputs[name].clone()
        poisoned[name][0, :3] = 1e6  # the left padding of row 0
    out = _call(feedback_solve_chunked, poisoned, chunk_size=4)
    torch.testing.assert_close(out[0, 3:], base[0, 3:], rtol=0, atol=1e-12)


def test_uniform_routing_closed_form():
    """q = 0 gives alpha = 1/t; with constant gamma the kernel is gamma Gamma(l+gamma) / (Gamma(1+gamma) Gamma(l+1))."""
    gamma, length = 0.5, 40
    f = torch.zeros(1, length, 1, dtype=F64)
    f[0, 0, 0] = 1.0  # impulse at tau = 0
    q = torch.zeros(1, length, 2, dtype=F64)
    k = torch.randn(1, length, 2, dtype=F64)
    s = feedback_solve_chunked(f, q, k, torch.full((1, length), gamma, dtype=F64), chunk_size=7)[0, :, 0]
    assert s[1:5].tolist() == pytest.approx([0.5, 0.375, 0.3125, 0.2734375], abs=1e-12)  # spec §6 numbers
    for lag in range(1, length):
        expected = gamma * math.exp(math.lgamma(lag + gamma) - math.lgamma(1 + gamma) - math.lgamma(lag + 1))
        assert s[lag].item() == pytest.approx(expected, rel=1e-12)


def test_bibo_bound():
    inputs = make_inputs(padded=False)
    s = _call(feedback_solve_dense, {**inputs, "key_mask": None}).detach()
    f, gain = inputs["f"].detach(), inputs["gain"].detach()
    assert s.norm(dim=-1).max() <= f.norm(dim=-1).max() / (1 - gain.abs().max()) + 1e-12


def test_fp32_accumulation_for_half_inputs():
    inputs = make_inputs(dtype=torch.float32, padded=False)
    half = {n: (v.detach().to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
            for n, v in inputs.items()}
    out = _call(feedback_solve_chunked, half, chunk_size=4)
    assert out.dtype == torch.float32
    reference = _call(feedback_solve_dense, {n: (v.float() if isinstance(v, torch.Tensor) and
                                                 v.dtype.is_floating_point else v) for n, v in half.items()})
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_method_are_named():
    inputs = make_inputs(past=2)
    with pytest.raises(ValueError, match="key_mask has shape"):
        _call(feedback_solve_chunked, {**inputs, "key_mask": inputs["key_mask"][:, 2:]})
    with pytest.raises(ValueError, match="gain has shape"):
        _call(feedback_solve_dense, {**inputs, "gain": inputs["gain"][:, :3]})
    with pytest.raises(ValueError, match="unknown method"):
        feedback_solve(inputs["f"], inputs["q"], inputs["k"], inputs["gain"], method="magic")


def test_long_sequence_fp32_chunked_matches_dense_and_stays_finite():
    inputs = make_inputs(batch=1, length=2048, width=32, key_dim=16, padded=True, dtype=torch.float32)
    inputs["gain"] = torch.full_like(inputs["gain"], 0.998).requires_grad_()  # near the stability bound
    dense = _call(feedback_solve_dense, inputs)
    chunked = _call(feedback_solve_chunked, inputs, chunk_size=128)
    torch.testing.assert_close(chunked, dense, rtol=1e-4, atol=1e-4)
    chunked.pow(2).mean().backward()
    assert all(torch.isfinite(inputs[n].grad).all() for n in ("f", "q", "k", "gain"))


# GLTM's sparse supports: the index-table solve against the dense reference with the same support as a mask
def sparse_support(pattern, batch, past, length, window=3):
    """Rows past..past+T-1 (1-based positions past+1..) of a pattern as indices (-1: none) and as a dense mask."""
    table = support_table(pattern, past + length, window)[past:] - 1  # (T, K) 0-based, -1 for none
    index = table.expand(batch, -1, -1).contiguous()
    mask = (index[..., None] == torch.arange(past + length)).any(-2)  # (B, T, P + T)
    return index, mask


SPARSE = ["ssm", "banded", "pow2", "pow2_ce", "quad", "quad_ce", "dense"]


@pytest.mark.parametrize("pattern", SPARSE)
@pytest.mark.parametrize("past", [0, 6])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_the_sparse_solve_equals_the_dense_reference_values_and_gradients(pattern, past, chunk_size):
    inputs = make_inputs(past=past, padded=False, length=23)
    index, mask = sparse_support(pattern, 2, past, 23)
    leaves = [t for t in (inputs["f"], inputs["q"], inputs["k"], inputs["gain"], inputs["past_k"], inputs["past_s"])
              if t is not None]
    results = []
    for solve in (lambda: feedback_solve_dense(*(inputs[n] for n in ("f", "q", "k", "gain")), past_k=inputs["past_k"],
                                               past_s=inputs["past_s"], support=mask),
                  lambda: feedback_solve_sparse(*(inputs[n] for n in ("f", "q", "k", "gain")), index,
                                                past_k=inputs["past_k"], past_s=inputs["past_s"],
                                                chunk_size=chunk_size)):
        s = solve()
        results.append((s, torch.autograd.grad((s * torch.linspace(-1, 1, s.numel(), dtype=F64).view_as(s)).sum()
                                               + s.pow(2).sum(), leaves)))
    (dense, dense_grads), (sparse, sparse_grads) = results
    torch.testing.assert_close(sparse, dense, rtol=1e-10, atol=1e-10)
    for got, expected in zip(sparse_grads, dense_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    recurrent = feedback_solve_recurrent(*(inputs[n] for n in ("f", "q", "k", "gain")), past_k=inputs["past_k"],
                                         past_s=inputs["past_s"], support=mask)
    torch.testing.assert_close(recurrent, dense, rtol=1e-10, atol=1e-10)


def test_the_sparse_solve_passes_gradcheck_and_refuses_a_support_that_reads_the_future(monkeypatch):
    """The future-reading check reads the data back to the host, so it runs in the debug mode only."""
    inputs = make_inputs(length=9, padded=False)
    index, _ = sparse_support("pow2_ce", 2, 0, 9)
    assert torch.autograd.gradcheck(
        lambda f, q, k, gain: feedback_solve_sparse(f, q, k, gain, index, chunk_size=4),
        (inputs["f"], inputs["q"], inputs["k"], inputs["gain"]))
    bad = index.clone()
    bad[0, 4, 0] = 4  # row 4 reading itself
    monkeypatch.setenv("HF_MIXERS_DEBUG", "1")
    with pytest.raises(ValueError, match="strictly in the past"):
        feedback_solve_sparse(inputs["f"], inputs["q"], inputs["k"], inputs["gain"], bad)
    monkeypatch.delenv("HF_MIXERS_DEBUG")
    reads, _ = count_ops(feedback_solve_sparse, inputs["f"], inputs["q"], inputs["k"], inputs["gain"], index)
    assert reads.host_reads == 0, reads.read_sites
    with pytest.raises(ValueError, match="support must be"):
        feedback_solve_sparse(inputs["f"], inputs["q"], inputs["k"], inputs["gain"], index[0])
    with pytest.raises(ValueError, match="sparse_solve: weights"):
        sparse_solve(inputs["f"], torch.zeros(2, 9, 1, dtype=F64), index)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_leaves_the_fp32_solve_alone(low):
    """Under a bf16 / fp16 run's torch.autocast the solve still computes in the dtype it is given (fp32), values and
    gradients, instead of autocast's low-precision matmuls."""
    inputs = {key: value.detach().float().requires_grad_() if value is not None and value.is_floating_point()
              else value for key, value in make_inputs(past=6).items()}
    expected = _call(feedback_solve, inputs)
    expected_grads = torch.autograd.grad(expected.square().sum(), [inputs["f"], inputs["q"]])
    with torch.autocast("cpu", dtype=low):
        got = _call(feedback_solve, inputs)
    grads = torch.autograd.grad(got.square().sum(), [inputs["f"], inputs["q"]])  # outside, as the trainer does
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)
