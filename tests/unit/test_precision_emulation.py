"""hf_mixers/apps/bench/precision.py: operands rounded to tf32 / bf16 as a tensor core reads them, inside the matrix
products the emulation reaches (forward and backward, optionally only inside named functions), and the bench's
report."""

import json

import pytest
import torch

from hf_mixers.apps.bench.precision import EmulatedOperands, bench_precision, round_bf16, round_tf32


def test_tf32_keeps_ten_mantissa_bits_rounding_to_nearest_even():
    one = 1.0
    ulp = 2.0 ** -10  # tf32's spacing above 1
    values = torch.tensor([one, one + ulp, one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, -(one + 3 * ulp / 4),
                           float("inf"), 3.0e38])
    expected = torch.tensor([one, one + ulp, one, one + 2 * ulp, one, -(one + ulp), float("inf"), 3.0e38])
    rounded = round_tf32(values)
    assert torch.equal(rounded[:6], expected[:6]) and rounded[6] == float("inf")
    assert torch.isclose(rounded[7], expected[7], rtol=2 ** -10)
    assert torch.equal(round_tf32(rounded), rounded)  # idempotent
    assert torch.equal(round_bf16(torch.tensor([1 + 2 ** -8, 1 + 2 ** -7])), torch.tensor([1.0, 1 + 2 ** -7]))


def test_products_forward_and_backward_see_rounded_operands():
    a = torch.tensor([[1 + 2 ** -12]], requires_grad=True)  # below tf32's resolution at 1
    b = torch.tensor([[1.0]], requires_grad=True)
    with EmulatedOperands("tf32") as mode:
        out = a @ b
        out.backward(torch.tensor([[1 + 2 ** -12]]))
    assert out.item() == 1.0 and b.grad.item() == 1.0  # a rounded forward; a and the gradient rounded backward
    assert mode.rounded == 3  # the forward product and both gradients'
    assert (a.detach() @ b.detach()).item() == 1 + 2 ** -12  # outside: fp32 as before


def test_a_scope_rounds_only_the_products_issued_inside_it():
    a, b = torch.full((2, 2), 1 + 2 ** -12), torch.eye(2)

    def inside(x, y):
        return x @ y

    with EmulatedOperands("tf32", scope=["inside"]) as mode:
        outside, within = a @ b, inside(a, b)
    assert torch.equal(outside, a) and torch.equal(within, torch.ones(2, 2)) and mode.rounded == 1


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_a_kept_function_s_products_are_never_rounded_forward_or_backward():
    a, b = torch.full((2, 2), 1 + 2 ** -12, requires_grad=True), torch.eye(2)

    def kept(x, y):
        return x @ y

    def inside(x, y):
        return x @ y, kept(x, y)

    # (the backward places its products by the forward's traceback, which anomaly mode keeps)
    with EmulatedOperands("tf32", scope=["inside"], keep=["kept"]) as mode, \
            torch.autograd.detect_anomaly(check_nan=False):
        rounded, exact = inside(a, b)
        exact.backward(torch.full((2, 2), 1 + 2 ** -12))
    assert torch.equal(rounded, torch.ones(2, 2)) and torch.equal(exact, a.detach()) and mode.rounded == 1
    assert torch.equal(a.grad, torch.full((2, 2), 1 + 2 ** -12))  # kept backward: no rounding either


def test_the_bench_reports_errors_against_the_bf16_bound(tmp_path):
    report = bench_precision(str(tmp_path), "rsa", {"rsa_readout": "softmax_count"}, 32, 32, 4, 2)
    rows = {row["precision"]: row for row in report["rows"]}
    assert list(rows) == ["fp32", "tf32", "bf16"] and rows["fp32"]["products_rounded"] == 0
    assert rows["tf32"]["products_rounded"] == rows["bf16"]["products_rounded"] > 0
    assert rows["fp32"]["fits_bf16_bound"]  # fp32 is ~1e-7 off, far inside what bf16 inputs cost
    assert rows["fp32"]["errors"]["output"] < rows["tf32"]["errors"]["output"] < rows["bf16"]["errors"]["output"]
    assert 1e-4 < report["bf16_bound"]["output"] < 3e-2  # inputs and weights rounded to bf16 (8 bits)
    saved = json.loads((tmp_path / "bench_precision.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"])) and (tmp_path / "bench_precision.png").exists()
