"""hf_mixers/apps/reproduce/rsa.py: both RSA claims run at the smoke scale, one row per compared model (and length),
accuracies are fractions, no verdict; the recall batches share one vocabulary across kappa."""

import json

import torch

from hf_mixers.apps.reproduce import reproduce
from hf_mixers.apps.reproduce.rsa import MODELS, PASSKEY_SCALES, RECALL_SCALES, recall_batch, state_sizes
from hf_mixers.tasks.checks import IGNORE
from hf_mixers.tasks.selective_ssm import mqar

MIXERS = ["rsa", "rsa (RoPE)", "linear attention", "full attention"]


def test_rsa_recall_smoke_has_a_row_per_model_and_an_accuracy_per_kappa(tmp_path):
    result = reproduce("rsa-recall", str(tmp_path), "smoke")["rsa-recall"]
    assert result["holds"] is None and result["scale"] == "smoke"
    assert [row["mixer"] for row in result["table"]] == MIXERS
    columns = [f"κ = {kappa}" for kappa in RECALL_SCALES["smoke"]["pairs"]]
    for row in result["table"]:
        assert all(0.0 <= row[column] <= 1.0 for column in columns) and row["parameters"] > 0
    # same width, depth and heads: the parameter counts differ only by RSA's memory weights
    rsa, rsa_rope, linear, full = (row["parameters"] for row in result["table"])
    assert abs(linear - full) < 10 and rsa == rsa_rope > full
    assert json.loads((tmp_path / "rsa-recall.json").read_text())["table"] == result["table"]
    assert (tmp_path / "rsa-recall.md").read_text().startswith("# rsa-recall: partly")


def test_rsa_passkey_smoke_has_a_row_per_model_and_length(tmp_path):
    result = reproduce("rsa-passkey", str(tmp_path), "smoke")["rsa-passkey"]
    size = PASSKEY_SCALES["smoke"]
    assert result["holds"] is None
    expected = [(mixer, factor * max(size["lengths"]), factor) for mixer in MIXERS for factor in size["factors"]]
    assert [(r["mixer"], r["context"], r["x training length"]) for r in result["table"]] == expected
    for row in result["table"]:
        assert 0.0 <= row["passkey accuracy"] <= row["digit accuracy"] <= 1.0  # a whole key needs every digit
    assert "1L / 2L" in result["ours"]


def test_recall_batches_move_the_values_above_the_most_keys():
    pairs, most, values = 4, 16, 8
    tokens, targets = recall_batch(3, pairs, most, values, 30, seed=1)
    plain_tokens, plain_targets = mqar(3, pairs, values, length=30, seed=1)
    keys = plain_tokens < pairs
    assert torch.equal(tokens[keys], plain_tokens[keys])  # keys keep their ids
    assert torch.equal(tokens[~keys], plain_tokens[~keys] + most - pairs)
    scored = plain_targets != IGNORE
    assert torch.equal(targets[scored], plain_targets[scored] + most - pairs) and (targets[~scored] == IGNORE).all()
    assert int(tokens.max()) < most + values


def test_the_cpu_scale_compares_equal_backbones_and_states_the_state_sizes():
    assert MODELS["cpu"]["rsa"] == {"rsa_num_levels": 4, "rsa_num_slots": 16}
    assert "RSA 4 x 16 slots, 4928 floats; linear attention 1056 floats" in state_sizes("cpu")
