"""Stage 2 from cached teacher targets (``stage2.teacher_top_k``, recipes/teacher_targets.py): the cache is written
once, whole or not at all, and read back by key; at k = V a run trains exactly as the online run does, without the
teacher in its steps."""

import json
import os

import pytest
import torch

from conftest import save_tiny_teacher
from hf_mixers.recipes import distill, load_recipe
from hf_mixers.recipes.teacher_targets import cached_top_k, read_targets

RSA_SMALL = '{"rsa_num_slots": 8, "rsa_num_levels": 2}'


@pytest.fixture
def teacher(tmp_path, monkeypatch):
    from hf_mixers.conversion import load_teacher

    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path / "cache"))
    save_tiny_teacher(tmp_path / "teacher")
    return load_teacher(str(tmp_path / "teacher"))


def _blocks(rows=5, length=12, seed=0):
    return torch.randint(3, 300, (rows, length), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_the_targets_are_the_teachers_top_k_written_once_and_read_back_by_key(teacher, monkeypatch):
    from hf_mixers.kernels.distill_loss import teacher_top_k

    blocks = _blocks()
    targets = cached_top_k(teacher.model, blocks, 8, 2.0, "tiny", batch_rows=2, progress=False)
    assert targets.index.shape == targets.log_probs.shape == (5, 12, 8)
    with torch.no_grad():
        hidden = teacher.model.get_decoder()(blocks[3:4].long()).last_hidden_state[0]
    index, log_probs = teacher_top_k(hidden, teacher.model.get_output_embeddings().weight, 8, 2.0)
    assert torch.equal(targets.index[3], index)
    torch.testing.assert_close(targets.log_probs[3], log_probs, rtol=1e-5, atol=1e-5)  # batched vs one row
    assert json.load(open(os.path.join(targets.folder, "targets.json"))) == {"blocks": 5, "length": 12, "k": 8,
                                                                               "temperature": 2.0}

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran although its targets are cached")

    monkeypatch.setattr(teacher.model.model, "forward", no_teacher)
    again = cached_top_k(teacher.model, blocks, 8, 2.0, "tiny", progress=False)
    assert again.folder == targets.folder and torch.equal(again.log_probs, targets.log_probs)
    for changed in ((_blocks(seed=1), 8, 2.0, "tiny"), (blocks, 4, 2.0, "tiny"), (blocks, 8, 1.0, "tiny"),
                    (blocks, 8, 2.0, "other")):  # other tokens, k, temperature or teacher: other targets
        with pytest.raises(AssertionError, match="the teacher ran"):
            cached_top_k(teacher.model, *changed, progress=False)
    assert not [name for name in os.listdir(os.path.dirname(targets.folder)) if "partial" in name]
    with pytest.raises(FileNotFoundError, match="the main process computes them"):
        cached_top_k(teacher.model, blocks, 3, 2.0, "tiny", progress=False, compute=False)


def test_a_failed_write_leaves_nothing_and_a_bad_folder_is_named(teacher, monkeypatch, tmp_path):
    calls = []
    forward = teacher.model.model.forward

    def fails_on_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(teacher.model.model, "forward", fails_on_the_second_batch)
    with pytest.raises(RuntimeError, match="out of memory"):
        cached_top_k(teacher.model, _blocks(), 8, 1.0, "tiny", batch_rows=2, progress=False)
    assert os.listdir(tmp_path / "cache" / "teacher-targets") == []
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "targets.json").write_text(json.dumps({"blocks": 2, "length": 3, "k": 4}))
    (tmp_path / "bad" / "index.int32").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"index.int32: 8 bytes, not the 96 of \(2, 3, 4\) targets"):
        read_targets(str(tmp_path / "bad"))


@pytest.mark.parametrize("chunk_rows", [0, 7])
def test_the_stage2_loss_from_targets_at_k_equal_to_the_vocabulary_is_the_online_loss(teacher, chunk_rows):
    """recipes.stages' two stage-2 losses on a converted student under LoRA, chunked and dense (full logits, as
    under a sharded head): from the cached targets at k = V, the same loss, metrics and LoRA gradients as online."""
    from hf_mixers.conversion import convert
    from hf_mixers.recipes.config import DistillSection
    from hf_mixers.recipes.stages import add_lora, distillation_loss, top_k_distillation_loss

    student, _ = convert(teacher, "rsa", mixer_options=json.loads(RSA_SMALL), sequence_length=32,
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    student = add_lora(student.train(), DistillSection(), seed=0)
    blocks = _blocks(rows=3, length=24)
    vocab = teacher.model.get_output_embeddings().weight.shape[0]
    targets = cached_top_k(teacher.model, blocks, vocab, 2.0, "tiny", progress=False)
    loss_fn, batch_of = top_k_distillation_loss(student, blocks, targets, 2.0, 0.5, chunk_rows, torch.device("cpu"))
    results = []
    for loss, metrics in (distillation_loss(student, teacher.model, 2.0, 0.5, chunk_rows)(blocks[[2, 0]].long()),
                          loss_fn(batch_of(torch.tensor([[2], [0]])))):
        student.zero_grad(set_to_none=True)
        loss.backward()
        results.append((loss.detach(), {name: float(value) for name, value in metrics.items()},
                        {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}))
    (online, online_metrics, online_grads), (cached, cached_metrics, cached_grads) = results
    torch.testing.assert_close(cached, online, rtol=1e-5, atol=1e-6)
    assert cached_metrics == pytest.approx(online_metrics, rel=1e-4, abs=1e-6)
    assert cached_grads.keys() == online_grads.keys() and any("lora" in name for name in online_grads)
    for name in online_grads:
        torch.testing.assert_close(cached_grads[name], online_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_run_from_cached_targets_logs_the_online_runs_losses_at_k_equal_to_the_vocabulary(tmp_path, monkeypatch):
    """``distill`` with stage2.teacher_top_k = V draws the same batches and logs the online run's stage-2 losses to
    fp32 rounding; the targets are computed once, before stage 2, and the online loss (the teacher in every step) is
    never built."""
    from hf_mixers.conversion import load_teacher
    from hf_mixers.recipes import stages

    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path / "cache"))
    save_tiny_teacher(tmp_path / "teacher")
    vocab = load_teacher(str(tmp_path / "teacher")).model.get_output_embeddings().weight.shape[0]
    losses = {}
    for top_k in (0, vocab):
        if top_k:  # the online loss would run the teacher in every step
            monkeypatch.setattr(stages, "distillation_loss", None)
        out = tmp_path / f"k{top_k}"
        recipe = load_recipe([], [f"model.teacher={tmp_path / 'teacher'}", f"model.mixer_options={RSA_SMALL}",
                                  "data.sequence_length=32", "data.max_train_sequences=12", "data.heldout_sequences=2",
                                  "data.wider_evaluations=false", "stage1.enabled=false", "stage2.steps=3",
                                  "stage2.ce_weight=0.5", "train.lr=3e-3", f"output.dir={out}",
                                  f"stage2.teacher_top_k={top_k}"])
        distill(recipe, progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[top_k] = [(row["step"], row["loss"], row["ce"]) for row in rows if row.get("stage") == "stage2"]
    assert len(losses[0]) == 3 and [row[0] for row in losses[vocab]] == [1, 2, 3]
    for cached, online in zip(losses[vocab], losses[0]):
        assert cached[1:] == pytest.approx(online[1:], rel=1e-4, abs=1e-6)
    assert len(os.listdir(tmp_path / "cache" / "teacher-targets")) == 1
