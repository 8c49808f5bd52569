"""hf_mixers/tasks/passkey.py: the passkey sequences have the documented layout, next-token targets on the answer
only, and are deterministic per seed."""

import pytest
import torch

from hf_mixers.tasks.checks import IGNORE
from hf_mixers.tasks.passkey import FIRST_FILLER, KEY, QUERY, passkey, passkey_vocab_size


def test_same_seed_same_batch_and_different_seed_different_batch():
    first, again, other = passkey(8, 40, seed=3), passkey(8, 40, seed=3), passkey(8, 40, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_layout_is_filler_key_block_filler_query_block():
    digits, filler, length = 5, 7, 60
    tokens, targets = passkey(50, length, digits=digits, filler=filler, seed=1)
    assert tokens.shape == targets.shape == (50, length) and tokens.dtype == targets.dtype == torch.long
    assert int(tokens.max()) < passkey_vocab_size(filler) == FIRST_FILLER + filler
    for row in tokens:
        assert (row == KEY).sum() == 1 and (row == QUERY).sum() == 1
        start = int((row == KEY).nonzero())
        assert start <= length - 2 * (digits + 1)  # the key block never runs into the query block
        key = row[start + 1:start + 1 + digits]
        assert (key < 10).all() and row[length - digits - 1] == QUERY and torch.equal(row[length - digits:], key)
        rest = torch.ones(length, dtype=torch.bool)
        rest[start:start + digits + 1] = rest[length - digits - 1:] = False
        assert (row[rest] >= FIRST_FILLER).all()  # everything else is filler, no stray digit or marker
    starts = (tokens == KEY).nonzero()[:, 1]
    assert starts.min() < 10 and starts.max() > length - 22  # the depth spreads over the whole context


def test_targets_are_the_next_key_digit_from_the_query_marker_on():
    digits, length = 4, 30
    tokens, targets = passkey(20, length, digits=digits, seed=2)
    scored = targets != IGNORE
    assert (scored.sum(1) == digits).all() and scored[:, length - digits - 1:length - 1].all()
    assert torch.equal(targets[:, length - digits - 1:length - 1], tokens[:, length - digits:])


def test_depth_places_the_key_block_and_keeps_the_key():
    length, digits = 50, 5
    room = length - 2 * (digits + 1)
    for depth, start in ((0.0, 0), (0.5, round(0.5 * room)), (1.0, room)):
        tokens, _ = passkey(3, length, digits=digits, depth=depth, seed=5)
        assert ((tokens == KEY).nonzero()[:, 1] == start).all()
        assert torch.equal(tokens[:, start + 1:start + 1 + digits], tokens[:, -digits:])
    # the depth moves the block only: the key and the answer are the same at every depth
    shallow, deep = passkey(3, length, depth=0.0, seed=5), passkey(3, length, depth=1.0, seed=5)
    assert torch.equal(shallow[1], deep[1])


def test_the_shortest_sequence_is_two_blocks():
    tokens, targets = passkey(2, 4, digits=1, depth=0.0)
    assert tokens[:, :2].tolist() == [[KEY, tokens[0, 1]], [KEY, tokens[1, 1]]] and (tokens[:, 2] == QUERY).all()
    assert torch.equal(targets[:, 2], tokens[:, 1]) and (targets[:, [0, 1, 3]] == IGNORE).all()


@pytest.mark.parametrize("arguments, message", [
    ({"count": 0}, "passkey: count must be an integer >= 1"),
    ({"length": 11}, "passkey: length must be an integer >= 12 .*2 x \\(digits \\+ 1\\)"),
    ({"length": 20.0}, "passkey: length must be an integer"),
    ({"digits": 0}, "passkey: digits must be an integer >= 1"),
    ({"filler": 0}, "passkey: filler must be an integer >= 1"),
    ({"depth": 1.5}, "passkey: depth must be a probability in \\[0, 1\\]"),
    ({"depth": True}, "passkey: depth must be a probability"),
])
def test_bad_arguments_name_the_argument(arguments, message):
    call = {"count": 2, "length": 20, **arguments}
    with pytest.raises(ValueError, match=message):
        passkey(**call)
