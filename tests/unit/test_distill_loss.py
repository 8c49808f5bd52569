"""The chunked distillation loss (kernels/distill_loss.py) against the dense reference: values and gradients in fp64,
every chunking (one row, ragged, all rows), ignored targets, temperature, the CE weight, a frozen or trained head;
and the loss from cached teacher targets (``stage2.teacher_top_k``: the teacher's top k log-probabilities) against
its autograd reference and, at k = V, the online loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import first_in_fast
from hf_mixers.kernels.distill_loss import (IGNORE, chunked_distillation_loss, distillation_loss_dense, teacher_top_k,
                                            top_k_distillation_loss, top_k_kl)


def _inputs(rows=13, hidden=8, teacher_hidden=6, vocab=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(rows, hidden, generator=g, dtype=dtype).requires_grad_()
    w_s = (torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5).requires_grad_()
    h_t = torch.randn(rows, teacher_hidden, generator=g, dtype=dtype)
    w_t = torch.randn(vocab, teacher_hidden, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[2, 7, rows - 1]] = IGNORE  # padding and the last position have no next token
    return h_s, w_s, h_t, w_t, targets


@pytest.mark.parametrize("chunk_rows, temperature, ce_weight", first_in_fast((4, 1.0, 0.5), (1, 2.0, 0.0),
                                                                              (13, 0.7, 1.0), (100, 1.0, 0.5)))
def test_chunked_loss_equals_the_dense_reference(chunk_rows, temperature, ce_weight):
    h_s, w_s, h_t, w_t, targets = _inputs()
    expected = distillation_loss_dense(h_s, w_s, h_t, w_t, targets, temperature, ce_weight)
    expected_grads = torch.autograd.grad(expected[0], [h_s, w_s])
    got = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, temperature, ce_weight, chunk_rows)
    got_grads = torch.autograd.grad(got[0] * 3.0, [h_s, w_s])  # an upstream factor reaches both gradients
    for name, a, b in zip(("loss", "kl", "ce"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    for name, a, b in zip(("h_s", "w_s"), got_grads, expected_grads):
        torch.testing.assert_close(a, 3.0 * b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


def test_the_ce_metric_is_left_out_on_request_at_ce_weight_zero_only():
    """``with_ce=False`` (a step whose metrics are not read): at ce_weight 0 the CE is not computed, and the loss and
    its gradients are unchanged; with a CE weight it is part of the loss and always computed."""
    h_s, w_s, h_t, w_t, targets = _inputs()
    full = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, 2.0, 0.0, 4)
    bare = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, 2.0, 0.0, 4, with_ce=False)
    assert bare[2] is None and full[2] > 0
    torch.testing.assert_close(bare[0], full[0], rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(bare[0], [h_s, w_s]), torch.autograd.grad(full[0], [h_s, w_s])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    weighted = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, 2.0, 0.5, 4, with_ce=False)
    torch.testing.assert_close(weighted[2], full[2], rtol=1e-12, atol=1e-12)


def test_a_frozen_head_gets_no_gradient_and_fp32_inputs_stay_close():
    h_s, w_s, h_t, w_t, targets = _inputs(dtype=torch.float32)
    w_s = w_s.detach()  # the lm_head is frozen under LoRA: no (V, H) gradient is accumulated
    loss, kl, ce = chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, 1.0, 0.5, chunk_rows=5)
    assert not kl.requires_grad and not ce.requires_grad
    (grad,) = torch.autograd.grad(loss, [h_s])
    reference = distillation_loss_dense(h_s, w_s, h_t, w_t, targets, 1.0, 0.5)
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(reference[0], [h_s])[0], rtol=1e-4, atol=1e-6)


def test_bad_shapes_are_named():
    h_s, w_s, h_t, w_t, targets = _inputs()
    with pytest.raises(ValueError, match="must share the vocabulary"):
        chunked_distillation_loss(h_s, w_s[:-1], h_t, w_t, targets)
    with pytest.raises(ValueError, match=r"targets \(12,\)"):
        chunked_distillation_loss(h_s, w_s, h_t, w_t, targets[:-1])
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        chunked_distillation_loss(h_s, w_s, h_t, w_t, targets, chunk_rows=0)


def test_stage2_loss_chunked_equals_dense_through_lora(tmp_path):
    """recipes.stages.distillation_loss on a converted student under LoRA: the chunked loss (hidden states through
    the heads) and the dense one (full logits) give the same loss and the same gradients to every trained tensor."""
    from conftest import save_tiny_teacher
    from hf_mixers.conversion import convert, load_teacher
    from hf_mixers.recipes.config import DistillSection
    from hf_mixers.recipes.stages import add_lora, distillation_loss

    save_tiny_teacher(tmp_path / "teacher")
    teacher = load_teacher(str(tmp_path / "teacher"))
    student, _ = convert(teacher, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, sequence_length=32,
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    student = add_lora(student.train(), DistillSection(), seed=0)
    batch = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for chunk_rows in (0, 7):
        student.zero_grad(set_to_none=True)
        loss, metrics = distillation_loss(student, teacher.model, 2.0, 0.5, chunk_rows)(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
        results.append((loss.detach(), {name: float(value) for name, value in metrics.items()}, grads))
    (dense, dense_metrics, dense_grads), (chunked, chunked_metrics, chunked_grads) = results
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-6)
    assert chunked_metrics == pytest.approx(dense_metrics, rel=1e-5, abs=1e-6)  # the KL at init is ~2e-6
    assert dense_grads.keys() == chunked_grads.keys() and any("lora" in name for name in dense_grads)
    for name in dense_grads:
        torch.testing.assert_close(chunked_grads[name], dense_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_sharded_student_head_shared_with_the_teacher_still_runs_the_chunked_loss(tmp_path, monkeypatch):
    """Under FSDP or ZeRO-3 the student's head is sharded, readable only in its module's forward. When it is the
    teacher's frozen tensor (one copy of the frozen weights) the loss reads the teacher's, never sharded, and stays
    chunked: no (B, T, V) logits. A head of the student's own (trained, or a copy) still takes the dense form; and
    FSDP's root is then the decoder, the only part of the student the chunked loss calls (``sharding_for``)."""
    import hf_mixers.recipes.stages as stages
    from conftest import save_tiny_teacher
    from hf_mixers.conversion import convert, load_teacher
    from hf_mixers.recipes.config import DistillSection

    save_tiny_teacher(tmp_path / "teacher", family="qwen2")  # an untied head
    teacher = load_teacher(str(tmp_path / "teacher"))
    options = dict(mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, sequence_length=32,
                   calibration_sequences=2, heldout_sequences=1, progress=False)
    shared, _ = convert(teacher, "rsa", share_teacher_weights=True, **options)
    copied, _ = convert(teacher, "rsa", **options)
    batch = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    dense = []
    monkeypatch.setattr(stages, "_dense_distillation_loss", lambda *args: dense.append(1) or (torch.zeros(()), {}))
    for student, expected_dense in ((shared, 0), (copied, 1)):
        model = stages.add_lora(student.train(), DistillSection(), seed=0)
        loss_fn = stages.distillation_loss(model, teacher.model, 2.0, 0.5, chunk_rows=7)
        model.get_output_embeddings().weight.ds_id = 0  # as ZeRO-3 leaves it: partitioned, empty at rest
        dense.clear()
        loss_fn(batch)
        assert len(dense) == expected_dense
        sharding = stages.sharding_for(model, teacher_model=teacher.model)
        base = model.get_base_model()
        assert sharding.root is (base.model if student is shared else base)


# ------------------------------------------------------------------------------------- cached teacher targets


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
