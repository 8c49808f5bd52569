"""Liger-Kernel's fused linear JSD (beta 0) and cross-entropy as the distillation loss (kernels/distill_loss.py
``liger_distillation_loss``) against the chunked PyTorch path: values and the gradients of the student's hidden states
and head, with a temperature, a CE term, ignored targets, fp32 and bf16; and the dispatch that picks it.

Liger's kernels are Triton: on CUDA here, or under the Triton CPU interpreter in a subprocess (triton_interpreter.py).
Shapes are small and ragged: 24 rows, hidden 16 / 12 (student / teacher), a vocabulary of 70.
"""

import logging

import pytest
import torch

from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

from hf_mixers.kernels import dispatch
from hf_mixers.kernels.distill_loss import IGNORE, chunked_distillation_loss, distillation_loss

pytest.importorskip("liger_kernel")
DEV = DEVICE or "cpu"


@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def _inputs(dtype, seed=0, rows=24, hidden=16, teacher_hidden=12, vocab=70):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(rows, hidden, generator=g).to(DEV, dtype).requires_grad_()
    w_s = (0.3 * torch.randn(vocab, hidden, generator=g)).to(DEV, dtype).requires_grad_()
    h_t = torch.randn(rows, teacher_hidden, generator=g).to(DEV, dtype)
    w_t = (0.3 * torch.randn(vocab, teacher_hidden, generator=g)).to(DEV, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[-3:] = IGNORE  # the last position of each sequence, padding
    return h_s, w_s, h_t, w_t, targets.to(DEV)


def _run(loss_fn, h_s, w_s, *rest):
    h_s.grad = w_s.grad = None
    loss, kl, ce = loss_fn(h_s, w_s, *rest)
    loss.backward()
    return [loss.detach().float(), kl.float(), ce.float(), h_s.grad.float(), w_s.grad.float()]


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("temperature, ce_weight", [(1.0, 0.0), (2.0, 0.5)])
def test_the_liger_path_equals_the_chunked_path(dtype, tolerance, temperature, ce_weight):
    from hf_mixers.kernels.distill_loss import liger_distillation_loss

    inputs = _inputs(dtype)
    liger = _run(lambda *a: liger_distillation_loss(*a, temperature, ce_weight), *inputs)
    chunked = _run(lambda *a: chunked_distillation_loss(*a, temperature, ce_weight, 8), *inputs)
    for name, got, want in zip(("loss", "kl", "ce", "grad h_s", "grad w_s"), liger, chunked):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=name)
    assert liger[0] > 0 and liger[3].abs().sum() > 0


def test_the_dispatch_takes_the_chunked_path_off_cuda_and_says_so(caplog):
    """On CPU tensors the entry runs the chunked PyTorch path (Liger's kernels need CUDA), with one log line."""
    dispatch._announced.clear()
    inputs = [t.detach().cpu() for t in _inputs(torch.float32)]
    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        got = distillation_loss(*inputs, 2.0, 0.5, 8)
    want = chunked_distillation_loss(*inputs, 2.0, 0.5, 8)
    assert [g.item() for g in got] == [w.item() for w in want]
    assert "distillation_loss runs on the PyTorch path (tensors on cpu (the liger_kernel kernel needs CUDA))" \
        in caplog.text
