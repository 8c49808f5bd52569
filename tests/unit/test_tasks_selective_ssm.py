"""hf_mixers/tasks/selective_ssm.py: the task generators produce exactly the tasks the paper defines."""

import pytest
import torch

from hf_mixers.tasks.selective_ssm import IGNORE, induction_heads, induction_targets, keep_nth, mqar


def test_mqar_context_is_a_permutation_and_every_key_is_queried_once_for_its_value():
    pairs, values = 8, 32
    tokens, targets = mqar(50, pairs, values, length=100, seed=1)
    for row in range(50):
        keys, paired = tokens[row, 0:2 * pairs:2], tokens[row, 1:2 * pairs:2]
        assert sorted(keys.tolist()) == list(range(pairs)) and (paired >= pairs).all()
        value_of = dict(zip(keys.tolist(), paired.tolist()))
        asked = targets[row] != IGNORE
        assert asked[:2 * pairs].sum() == 0 and asked.sum() == pairs
        assert sorted(tokens[row, asked].tolist()) == list(range(pairs))  # each key once, noise is values only
        assert (tokens[row, 2 * pairs:][~asked[2 * pairs:]] >= pairs).all()
        assert all(value_of[k] == v for k, v in zip(tokens[row, asked].tolist(), targets[row, asked].tolist()))
    with pytest.raises(ValueError, match="length 20 must be at least 3 x pairs"):
        mqar(1, 8, 8, length=20)


def test_induction_heads_targets_follow_the_last_occurrence_and_hard_cases_plant_two_specials():
    vocab, length = 5, 30
    tokens, targets = induction_heads(200, vocab, length=length, hard_probability=1.0, special_range=0.1, seed=2)
    for row in range(200):
        x = tokens[row].tolist()
        planted = [v for v in range(vocab) for r in (1, 2, 3)
                   if [t for t, token in enumerate(x) if token == v] == [r - 1, length - r - 1]]
        assert planted, f"row {row}: no token sits exactly at 1-indexed r and T - r, r <= 3"
        for t in range(length):
            earlier = [j for j in range(t) if x[j] == x[t]]
            assert targets[row, t] == (x[earlier[-1] + 1] if earlier else vocab)
    # the paper's worked example (spec §5.3), tokens 1..4 and blank 0 shifted to 0..3 and blank 4
    example = torch.tensor([[2, 1, 3, 2, 4, 3, 2, 4]]) - 1
    assert (induction_targets(example, 4) + 1).tolist() == [[5, 5, 5, 1, 5, 2, 4, 3]]


def test_keep_nth_scores_from_n_on():
    tokens, targets = keep_nth(10, 16, 12, n=5, seed=3)
    assert (targets[:, :4] == IGNORE).all() and (targets[:, 4:] == tokens[:, 4:5]).all()
