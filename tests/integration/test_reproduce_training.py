"""The loop every trained reproduction shares (hf_mixers/apps/reproduce/training.py): accuracy is counted at the
scored positions only and per group, training actually learns, and the bare one-layer models carry the position."""

import pytest
import torch

from hf_mixers.apps.reproduce.training import BareMixerModel, scored_accuracy, tiny_model, train
from hf_mixers.tasks.checks import IGNORE
from hf_mixers.tasks.selective_ssm import keep_nth


class FixedLogits(torch.nn.Module):
    """Predicts token ``t % vocab`` at position t, whatever the input."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens):
        return torch.nn.functional.one_hot(torch.arange(tokens.shape[1]) % self.vocab, self.vocab).float().expand(
            tokens.shape[0], -1, -1)


def test_scored_accuracy_counts_scored_positions_per_group():
    targets = torch.tensor([[0, 1, 9, IGNORE], [IGNORE, 1, 2, 0]])  # position t is right when target == t
    groups = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    accuracy, counts = scored_accuracy(FixedLogits(10), torch.zeros_like(targets), targets, groups, 2, batch_size=1)
    assert counts == [2, 4]  # the IGNORE positions are not counted
    assert accuracy == [1.0, 0.5]  # group 0: (0 at t=0), (1 at t=1); group 1: 1 and 2 right, 9 and 0 wrong


def test_train_learns_keep_nth_with_attention():
    """One attention layer with learned positions learns KEEP 2ND at T = 8 in a few hundred small steps."""
    model = BareMixerModel("full_attention", 16, 16, heads=2, positions="learned", length=8)
    tokens, targets = keep_nth(256, 16, 8, n=2, seed=1_000)
    before = scored_accuracy(model, tokens, targets)[0][0]
    losses = train(model, lambda step: keep_nth(32, 16, 8, n=2, seed=step), 300, lr=1e-2, progress=False)
    after = scored_accuracy(model, tokens, targets)[0][0]
    assert before < 0.3 and after > 0.95 and losses[-1] < losses[0] / 10


def test_bare_model_position_channel_and_tiny_model():
    model = BareMixerModel("selective_ssm", 12, 8, positions="channel", selective_ssm_variant="s6",
                           selective_ssm_state_size=4, selective_ssm_conv_mode="none", selective_ssm_gate=False)
    assert model.embed.weight.shape == (12, 7)  # the last of the 8 coordinates is the position, not learned
    seen = {}
    model.mixer.register_forward_hook(lambda module, args, kwargs_out=None: seen.setdefault("input", args[0]))
    assert model(torch.randint(12, (3, 5))).shape == (3, 5, 12)
    assert torch.equal(seen["input"][..., -1], torch.arange(1.0, 6.0).expand(3, 5))  # raw 1-indexed t
    with pytest.raises(ValueError, match="positions must be"):
        BareMixerModel("full_attention", 12, 8, heads=2, positions="learned")  # no length for the table
    lm = tiny_model("vort", 20, 16, width=16, layers=1, heads=2, vort_window=0)
    assert lm.config.vort_window == 0 and lm(torch.randint(20, (1, 16))).logits.shape == (1, 16, 20)
