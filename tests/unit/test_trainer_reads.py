"""The training loop reads the device only on the steps whose values it needs (recipes/trainer.py ``PendingSteps``):
a step's loss and metrics stay tensors, and a metric that costs work (the CE at ce_weight 0) is left out elsewhere."""

import json
from pathlib import Path

import torch

from hf_mixers.apps.bench.op_count import count_ops
from hf_mixers.recipes.config import load_recipe
from hf_mixers.recipes.processes import Processes
from hf_mixers.recipes.run_plan import plan_training
from hf_mixers.recipes.trainer import PendingSteps, run_stage

PROJECT = tuple(str(Path(__file__).resolve().parents[2] / folder) for folder in ("hf_mixers", "recipes", "kernels"))


def test_only_logged_checkpointed_and_last_steps_are_read(tmp_path, monkeypatch):
    train = load_recipe([], ["train.precision=fp32", f"output.dir={tmp_path}"]).train
    weight = torch.nn.Parameter(torch.ones(4, 4))
    asked, losses, batches = [], [], []

    def loss_fn(batch, metrics):
        asked.append(metrics)
        batches.append(batch[:, 0].tolist())
        loss = (batch.float() @ weight).pow(2).mean() / 1e4
        losses.append(loss.detach().clone())
        return loss, ({"twice": 2 * loss.detach()} if metrics else {})

    read_at, read = [], PendingSteps.read
    monkeypatch.setattr(PendingSteps, "read", lambda self, last: read_at.append(len(self.steps)) or read(self, last))
    count, history = count_ops(run_stage, "stage2", loss_fn, {"weight": weight}, torch.arange(64).view(16, 4), 8,
                               plan_training(train, torch.device("cpu")), 1e-3, str(tmp_path), checkpoint_every=4,
                               log_every=3, progress=False, processes=Processes())
    # no line of the project read the device (torch's CPU AdamW reads its step count: not ours, and fused on CUDA)
    assert not [site for site in count.read_sites if site.startswith(PROJECT)], count.read_sites
    assert asked == [step in (3, 4, 6, 8) for step in range(1, 9)]
    assert read_at == [3, 1, 2, 2]  # steps 1-3 at the log step 3, 4 (checkpoint), 5-6 (log), 7-8 (last)
    assert [row["step"] for row in history] == list(range(1, 9))
    for row, loss in zip(history, losses):
        assert row["loss"] == float(loss) and row["tokens_per_s"] > 0
        assert ("twice" in row) == (row["step"] in (3, 4, 6, 8))
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [3, 6, 8]
    assert logged[0]["first_tokens_per_rank"] == [batches[2]]


def test_the_distillation_losses_metrics_are_tensors_and_the_ce_is_left_out_unless_read():
    from conftest import tiny_teacher
    from hf_mixers.recipes.stages import distillation_loss

    teacher, student = tiny_teacher("llama", 320), tiny_teacher("llama", 320, seed=1).train()
    batch = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for chunk_rows in (7, 0):  # the chunked loss and the dense one
        for ce_weight, metrics in ((0.0, True), (0.0, False), (0.5, False)):
            loss_fn = distillation_loss(student, teacher, 2.0, ce_weight, chunk_rows=chunk_rows)
            count, (loss, values) = count_ops(loss_fn, batch, metrics)
            assert not [site for site in count.read_sites if site.startswith(PROJECT)], count.read_sites
            assert set(values) == ({"kl", "ce"} if metrics or ce_weight else {"kl"}), (chunk_rows, ce_weight)
            assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in values.values())
            assert loss.requires_grad
