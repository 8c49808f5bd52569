"""RSA's residual MLP kernels (kernels/rsa_mlp_triton.py) against the PyTorch MLPs (``ResidualMLPWeights``).

Kernel tests run on CUDA, or here under the Triton CPU interpreter in a subprocess (see triton_interpreter.py).
Widths are ragged on purpose: the key and value MLPs differ (12 -> 20 and 10 -> 7), and rows are not a multiple of
the row block.
"""

import pytest
import torch

from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

from hf_mixers.kernels.rsa_state import ResidualMLPWeights, residual_mlps

DEV = DEVICE or "cpu"


@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def mlp(width, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5).to(DEV, dtype)  # noqa: E731
    return ResidualMLPWeights(*(rand(*shape).requires_grad_() for shape in ((hidden, width), (hidden,),
                                                                           (width, hidden), (width,))))


def leaves(key_mlp, value_mlp, x, y):
    return [x, *vars(key_mlp).values(), y, *vars(value_mlp).values()]


def run(fn, key_mlp, value_mlp, x, y, weights):
    """Both outputs, and the gradients of every leaf from one weighted sum of them."""
    out_x, out_y = fn(key_mlp, value_mlp, x, y)
    grads = torch.autograd.grad((out_x * weights[0]).sum() + (out_y * weights[1]).sum(),
                                leaves(key_mlp, value_mlp, x, y))
    return (out_x, out_y), grads


NAMES = ["x", "key up_weight", "key up_bias", "key down_weight", "key down_bias", "y", "value up_weight",
         "value up_bias", "value down_weight", "value down_bias"]


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("rows", [1, 45, 97])
def test_values_and_gradients_equal_the_pytorch_mlps(dtype, tolerance, rows):
    """Outputs and all ten gradients (inputs, weights, biases) equal the PyTorch MLPs, over leading dimensions
    (B, G, T) flattened into rows: one ragged row block, and several."""
    from hf_mixers.kernels.rsa_mlp_triton import residual_mlps_triton

    key_mlp, value_mlp = mlp(12, 20, dtype, 0), mlp(10, 7, dtype, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, rows, 12, generator=g, dtype=torch.float64).to(DEV, dtype).requires_grad_()
    y = torch.randn(1, 1, rows, 10, generator=g, dtype=torch.float64).to(DEV, dtype).requires_grad_()
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEV, dtype) for t in (x, y)]
    (want_x, want_y), want = run(residual_mlps, key_mlp, value_mlp, x, y, weights)
    (got_x, got_y), got = run(residual_mlps_triton, key_mlp, value_mlp, x, y, weights)
    torch.testing.assert_close(got_x, want_x, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_y, want_y, rtol=tolerance, atol=tolerance)
    for name, actual, expected in zip(NAMES, got, want):
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance, msg=name)


@needs_kernels
def test_many_row_blocks_per_program_feature_and_hidden_blocks(monkeypatch):
    """The backward with fewer programs than row blocks (each program sums its own blocks' weight gradients before
    the sum over programs), features and hidden units in several blocks, the last ones ragged (dx and the output
    accumulated block by block): still the PyTorch MLPs' values and gradients."""
    from hf_mixers.kernels import rsa_mlp_triton

    monkeypatch.setattr(rsa_mlp_triton, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(rsa_mlp_triton, "HIDDEN_BLOCK", 16)
    monkeypatch.setattr(rsa_mlp_triton, "FEATURE_BLOCK", 16)
    key_mlp, value_mlp = mlp(40, 40, torch.float64, 3), mlp(21, 17, torch.float64, 4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 29, 40, generator=g, dtype=torch.float64).to(DEV).requires_grad_()  # 174 rows: 6 blocks
    y = torch.randn(2, 3, 29, 21, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(DEV) for t in (x, y)]
    want_out, want = run(residual_mlps, key_mlp, value_mlp, x, y, weights)
    got_out, got = run(rsa_mlp_triton.residual_mlps_triton, key_mlp, value_mlp, x, y, weights)
    for name, actual, expected in zip(["key output", "value output", *NAMES], [*got_out, *got], [*want_out, *want]):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=name)


@needs_kernels
def test_no_rows_and_no_grad():
    """An empty call returns empty outputs and zero weight gradients; without autograd (a prefill) the forward alone
    gives the same values."""
    from hf_mixers.kernels.rsa_mlp_triton import residual_mlps_triton

    key_mlp, value_mlp = mlp(12, 20, torch.float64, 0), mlp(10, 7, torch.float64, 1)
    x = torch.zeros(2, 0, 12, dtype=torch.float64, device=DEV, requires_grad=True)
    y = torch.zeros(2, 0, 10, dtype=torch.float64, device=DEV, requires_grad=True)
    (out_x, out_y), grads = run(residual_mlps_triton, key_mlp, value_mlp, x, y,
                                [torch.zeros_like(x), torch.zeros_like(y)])
    assert out_x.shape == x.shape and out_y.shape == y.shape
    assert all(torch.count_nonzero(grad) == 0 for grad in grads)
    x = torch.randn(3, 5, 12, dtype=torch.float64, device=DEV)
    y = torch.randn(3, 5, 10, dtype=torch.float64, device=DEV)
    with torch.no_grad():
        for got, want in zip(residual_mlps_triton(key_mlp, value_mlp, x, y), residual_mlps(key_mlp, value_mlp, x, y)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_kernels
def test_half_precision_takes_the_pytorch_mlps():
    """bf16 inputs (or weights of another dtype than the inputs) are the PyTorch MLPs' (the same function, no
    launch)."""
    from hf_mixers.kernels import rsa_mlp_triton

    key_mlp, value_mlp = mlp(12, 8, torch.bfloat16, 0), mlp(10, 8, torch.bfloat16, 1)
    x, y = torch.randn(4, 12, device=DEV, dtype=torch.bfloat16), torch.randn(4, 10, device=DEV, dtype=torch.bfloat16)
    assert "fp32 or fp64" in rsa_mlp_triton.scope_reason(x, y, key_mlp, value_mlp)
    assert "fp32 or fp64" in rsa_mlp_triton.scope_reason(x.float(), y.float(), key_mlp, value_mlp)
    with torch.no_grad():
        for got, want in zip(rsa_mlp_triton.residual_mlps_triton(key_mlp, value_mlp, x, y),
                             residual_mlps(key_mlp, value_mlp, x, y)):
            assert torch.equal(got, want)


@needs_kernels
def test_the_mlps_are_one_graph_for_torch_compile():
    """The kernels are torch.library ops: a function calling them compiles with fullgraph=True and gives the eager
    values and gradients."""
    from hf_mixers.kernels.rsa_mlp_triton import residual_mlps_triton

    key_mlp, value_mlp = mlp(12, 20, torch.float32, 0), mlp(10, 7, torch.float32, 1)
    x = torch.randn(2, 9, 12, device=DEV, requires_grad=True)
    y = torch.randn(2, 9, 10, device=DEV, requires_grad=True)

    def step(x, y):
        out_x, out_y = residual_mlps_triton(key_mlp, value_mlp, x, y)
        return out_x.pow(2).sum() + out_y.pow(2).sum()

    want = torch.autograd.grad(step(x, y), (x, y, key_mlp.up_weight, value_mlp.down_bias))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager_decomp_partition")(x, y),
                              (x, y, key_mlp.up_weight, value_mlp.down_bias))
    torch._dynamo.reset()
    for actual, expected in zip(got, want):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
