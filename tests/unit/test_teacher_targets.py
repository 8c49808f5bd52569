"""Cached teacher targets (``stage2.teacher_top_k``): the teacher's top-k log-probabilities, computed once, and the
chunked top-k loss (kernels/distill_loss.py) against its autograd reference and, at k = V, the online loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import first_in_fast
from hf_mixers.kernels.distill_loss import (IGNORE, chunked_distillation_loss, teacher_top_k, top_k_distillation_loss,
                                            top_k_kl)


def _inputs(rows=13, hidden=8, teacher_hidden=6, vocab=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(rows, hidden, generator=g, dtype=dtype).requires_grad_()
    w_s = (torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5).requires_grad_()
    h_t = torch.randn(rows, teacher_hidden, generator=g, dtype=dtype)
    w_t = torch.randn(vocab, teacher_hidden, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[2, 7, rows - 1]] = IGNORE
    return h_s, w_s, h_t, w_t, targets


def _fp64_targets(h_t, w_t, k, temperature):
    """teacher_top_k with its log-probabilities kept in fp64 (the cache stores fp32), for 1e-12 comparisons."""
    index, _ = teacher_top_k(h_t, w_t, k, temperature)
    log_p = torch.log_softmax(h_t @ w_t.T / temperature, -1)
    return index, log_p.gather(1, index.long())


@pytest.mark.parametrize("temperature, ce_weight", first_in_fast((1.0, 0.5), (2.0, 0.0)))
def test_at_k_equal_to_the_vocabulary_the_cached_loss_is_the_online_loss(temperature, ce_weight):
    h_s, w_s, h_t, w_t, targets = _inputs()
    online = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature, ce_weight, chunk_rows=4)
    index, log_probs = _fp64_targets(h_t, w_t, w_t.shape[0], temperature)
    cached = top_k_distillation_loss(h_s, w_s, index, log_probs, targets, temperature, ce_weight, chunk_rows=5)
    for name, a, b in zip(("loss", "kl", "ce"), cached, online):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    for name, a, b in zip(("h_s", "w_s"), torch.autograd.grad(cached[0], [h_s, w_s]),
                          torch.autograd.grad(online[0], [h_s, w_s])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


@pytest.mark.parametrize("k, chunk_rows, temperature, ce_weight",
                         first_in_fast((5, 4, 1.0, 0.5), (1, 1, 2.0, 0.0), (36, 13, 0.7, 1.0), (12, 100, 1.0, 0.0)))
def test_the_chunked_top_k_loss_and_its_gradients_equal_the_autograd_reference(k, chunk_rows, temperature,
                                                                                ce_weight):
    """The loss computes its gradients in the forward (q - p on the top k, q (1 - r / Q) off it); autograd through
    ``top_k_kl`` + the CE is the reference, in fp64, under an upstream factor, for every chunking."""
    h_s, w_s, h_t, w_t, targets = _inputs()
    index, log_probs = _fp64_targets(h_t, w_t, k, temperature)
    z_s = h_s @ w_s.T
    expected = top_k_kl(z_s, index, log_probs, temperature) + ce_weight * F.cross_entropy(z_s, targets,
                                                                                          ignore_index=IGNORE)
    got = top_k_distillation_loss(h_s, w_s, index, log_probs, targets, temperature, ce_weight, chunk_rows)
    torch.testing.assert_close(got[0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], top_k_kl(z_s, index, log_probs, temperature).detach(), rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("h_s", "w_s"), torch.autograd.grad(got[0] * 3.0, [h_s, w_s]),
                          torch.autograd.grad(expected, [h_s, w_s])):
        torch.testing.assert_close(a, 3.0 * b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


def test_the_top_k_kl_grows_with_k_to_the_full_kl():
    """Grouping the tail into one bucket can only lose divergence (the log-sum inequality): KL_k rises with k and is
    the full KL at k = V. A fixed, known case: k = 1 against a uniform student."""
    h_s, w_s, h_t, w_t, _ = _inputs()
    z_s = (h_s @ w_s.T).detach()
    full = F.kl_div(F.log_softmax(z_s, -1), F.log_softmax(h_t @ w_t.T, -1), log_target=True, reduction="batchmean")
    values = [top_k_kl(z_s, *_fp64_targets(h_t, w_t, k, 1.0)) for k in (1, 2, 4, 8, 16, 32, 37)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:])) and values[0] < values[-2] < full
    torch.testing.assert_close(values[-1], full, rtol=1e-12, atol=1e-12)
    uniform = torch.zeros(1, 4, dtype=torch.float64)  # q = 1/4; p_top = 0.7, tail r = 0.3 against Q = 3/4
    value = top_k_kl(uniform, torch.tensor([[2]]), torch.tensor([[0.7]], dtype=torch.float64).log())
    assert value.item() == pytest.approx(0.7 * math.log(0.7 / 0.25) + 0.3 * math.log(0.3 / 0.75), rel=1e-12)


def test_teacher_top_k_keeps_the_most_likely_tokens_and_their_log_probabilities():
    _, _, h_t, w_t, _ = _inputs()
    log_p = torch.log_softmax(h_t @ w_t.T / 1.5, -1)
    index, log_probs = teacher_top_k(h_t, w_t, 6, 1.5, chunk_rows=4)
    assert index.dtype == torch.int32 and log_probs.dtype == torch.float32 and index.shape == (13, 6)
    torch.testing.assert_close(log_probs.double(), log_p.topk(6).values, rtol=1e-6, atol=1e-6)
    assert torch.equal(index.long(), log_p.topk(6).indices)
    assert [torch.equal(a, b) for a, b in zip((index, log_probs), teacher_top_k(h_t, w_t, 6, 1.5, chunk_rows=13))] \
        == [True, True]
    with pytest.raises(ValueError, match=r"k must be in \[1, 37\]"):
        teacher_top_k(h_t, w_t, 38)


def test_bad_target_shapes_are_named():
    h_s, w_s, h_t, w_t, targets = _inputs()
    index, log_probs = teacher_top_k(h_t, w_t, 4)
    with pytest.raises(ValueError, match=r"index \(12, 4\)"):
        top_k_distillation_loss(h_s, w_s, index[:-1], log_probs[:-1], targets)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        top_k_distillation_loss(h_s, w_s, index, log_probs, targets, chunk_rows=0)
