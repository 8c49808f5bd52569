"""hf_mixers/tasks/gltm.py: the generators produce the GLTM paper's copy, associative and multi-hop recall tasks."""

import time

import pytest
import torch

from hf_mixers.tasks.gltm import (BOS, IGNORE, PAD, SEP, associative_recall, copy_task, curriculum_divisor,
                                  multi_hop_recall, vocab_layout)

GENERATORS = [(copy_task, {"max_length": 12}), (associative_recall, {"max_pairs": 6}),
              (multi_hop_recall, {"max_pairs": 6})]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("generate, sizes", GENERATORS, ids=lambda g: getattr(g, "__name__", ""))
def test_same_seed_same_batch_and_different_seed_different_batch(generate, sizes):
    assert _same(generate(16, vocab=40, seed=5, **sizes), generate(16, vocab=40, seed=5, **sizes))
    assert not _same(generate(16, vocab=40, seed=5, **sizes), generate(16, vocab=40, seed=6, **sizes))
    fixed = {"length": 7} if generate is copy_task else {"pairs": 5}  # same shape, still different content
    assert not _same(generate(16, vocab=40, seed=5, **fixed), generate(16, vocab=40, seed=6, **fixed))


def test_vocab_layout_splits_content_into_keys_and_values():
    layout = vocab_layout()
    assert (layout.vocab, layout.pad, layout.bos, layout.sep) == (8192, PAD, BOS, SEP) == (8192, 0, 1, 2)
    assert layout.content == range(3, 8192) and layout.keys == range(3, 4097) and layout.values == range(4097, 8192)
    small = vocab_layout(10)
    assert list(small.keys) + list(small.values) == list(small.content) == list(range(3, 10))
    assert len(small.keys) == 3


def test_copy_targets_are_the_first_copy_and_the_layout_is_bos_content_sep_content():
    vocab = 30
    for seed in range(20):
        tokens, targets = copy_task(8, max_length=10, vocab=vocab, seed=seed)
        length = (tokens.shape[1] - 2) // 2
        assert tokens.shape[1] == 2 * length + 2 and 1 <= length <= 10 and targets.shape == tokens.shape
        for row in range(8):
            x, y = tokens[row].tolist(), targets[row].tolist()
            sep = x.index(SEP)  # brute force: the source is what lies between BOS and the (only) SEP
            source = x[1:sep]
            assert x[0] == BOS and x.count(BOS) == 1 and x.count(SEP) == 1 and PAD not in x
            assert all(3 <= token < vocab for token in source) and x[sep + 1:] == source
            scored = [t for t in range(len(x)) if y[t] != IGNORE]
            assert scored == list(range(sep, sep + len(source)))  # SEP .. the second copy's second-to-last token
            assert [y[t] for t in scored] == source  # the i-th scored target is the i-th input token
            assert all(y[t] == x[t + 1] for t in scored)  # and it is the next token (teacher forcing)
    tokens, targets = copy_task(3, length=128, seed=1)  # the paper's size: 258 tokens, not truncated to 256
    assert tokens.shape == targets.shape == (3, 258) and (targets != IGNORE).sum() == 3 * 128
    assert tokens.min() >= 0 and tokens.max() < 8192


def _solve_recall(x, layout):
    """Brute force: a key's first sighting binds the token after it, its second is the query, answered by
    following bindings until a non-key token. Returns {query position: (answer, hops)} and {slot: label}."""
    bound, answers, labels = {}, {}, {}

    def resolve(token):
        hops = 0
        while token in layout.keys:
            token, hops = bound[token], hops + 1  # KeyError if a chain points to a key not yet bound
        return token, hops

    for t in range(0, len(x), 2):
        key, slot = x[t], x[t + 1]
        assert key in layout.keys
        if key not in bound:
            if slot in layout.keys:
                labels[t + 1] = resolve(slot)[0]
            bound[key] = slot
        else:
            answers[t] = resolve(key)
    return answers, labels


def test_associative_recall_targets_are_the_value_bound_to_the_queried_key():
    vocab, seen_sizes, query_before_bind = 40, set(), False
    layout = vocab_layout(vocab)
    for seed in range(20):
        tokens, targets = associative_recall(8, max_pairs=6, vocab=vocab, seed=seed)
        pairs = tokens.shape[1] // 4
        seen_sizes.add(pairs)
        assert tokens.shape == targets.shape == (8, 4 * pairs) and 1 <= pairs <= 6
        for row in range(8):
            x, y = tokens[row].tolist(), targets[row].tolist()
            keys = x[0::2]
            assert all(keys.count(k) == 2 for k in keys)  # pairs distinct keys, each bound once and queried once
            assert len(set(keys)) == pairs and all(v in layout.values for v in x[1::2])
            answers, labels = _solve_recall(x, layout)
            assert not labels and set(t for t in range(len(y)) if y[t] != IGNORE) == set(answers)
            assert all(y[t] == answer and hops == 1 and x[t + 1] == answer for t, (answer, hops) in answers.items())
            first_query = min(answers)
            query_before_bind |= any(t > first_query and x[t] not in x[:t] for t in range(0, len(x), 2))
    assert seen_sizes == set(range(1, 7))  # N drawn per batch over 1..max_pairs
    assert query_before_bind  # binds and queries are interleaved, not all binds first
    tokens, targets = associative_recall(2, pairs=64, seed=0)  # the paper's size
    assert tokens.shape == (2, 256) and (targets != IGNORE).sum() == 128
    assert tokens.min() >= 3 and tokens.max() < 8192


def test_multi_hop_targets_follow_the_chain_and_aux_labels_resolve_the_intermediary_keys():
    vocab, layout, most_hops = 40, vocab_layout(40), 0
    for seed in range(20):
        tokens, targets, aux_targets, hops = multi_hop_recall(8, max_pairs=6, vocab=vocab, seed=seed)
        assert tokens.shape == targets.shape == aux_targets.shape == hops.shape and tokens.shape[1] % 4 == 0
        assert tokens.min() >= 3 and tokens.max() < vocab
        for row in range(8):
            x = tokens[row].tolist()
            keys = x[0::2]
            assert all(keys.count(k) == 2 for k in keys)  # distinct keys, each bound then queried once
            answers, labels = _solve_recall(x, layout)
            scored = {t for t in range(len(x)) if targets[row, t] != IGNORE}
            assert scored == set(answers) == {t for t in range(len(x)) if hops[row, t] > 0}
            for t, (answer, hop_count) in answers.items():
                assert targets[row, t] == answer and x[t + 1] == answer and answer in layout.values
                assert hops[row, t] == hop_count >= 1
                most_hops = max(most_hops, hop_count)
            assert {t for t in range(len(x)) if aux_targets[row, t] != IGNORE} == set(labels)
            assert all(aux_targets[row, t] == label for t, label in labels.items())
            first_bind_slot = 1
            assert x[first_bind_slot] in layout.values  # the first bind is never replaced
    assert most_hops >= 3


def test_multi_hop_replaces_about_p_of_the_binds_and_p_zero_is_associative_recall():
    tokens, _, aux_targets, hops = multi_hop_recall(256, pairs=16, vocab=64, replace_probability=0.5, seed=1)
    replaced = (aux_targets != IGNORE).sum().item() / (256 * 15)  # every bind but the first may be replaced
    assert 0.45 < replaced < 0.55
    assert (hops[hops > 0] == 1).float().mean() < 0.8  # many queries need more than one lookup
    every = multi_hop_recall(4, pairs=8, vocab=64, replace_probability=1.0, seed=2)
    assert (every[2] != IGNORE).sum() == 4 * 7
    assert _same(multi_hop_recall(8, max_pairs=6, vocab=40, replace_probability=0.0, seed=3)[:2],
                 associative_recall(8, max_pairs=6, vocab=40, seed=3))


def test_curriculum_has_four_equal_phases_dividing_by_8_4_2_1():
    assert [curriculum_divisor(s) for s in (0, 4_999, 5_000, 9_999, 10_000, 15_000, 19_999)] == [8, 8, 4, 4, 2, 1, 1]
    assert curriculum_divisor(3, total_steps=4, divisors=(2, 1)) == 1


def test_default_sizes_are_fast():
    start = time.perf_counter()
    copy_task(8, length=128)
    associative_recall(8, pairs=64)
    multi_hop_recall(8, pairs=64)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("call, message", [
    (lambda: copy_task(0), "count must be an integer >= .*, got 0"),
    (lambda: copy_task(2, max_length=0), "max_length must be an integer >= .*, got 0"),
    (lambda: copy_task(2, length=0), "length must be an integer >= .*, got 0"),
    (lambda: copy_task(2, vocab=3), "vocab must be an integer >= .*, got 3"),
    (lambda: associative_recall(2, max_pairs=0), "max_pairs must be an integer >= .*, got 0"),
    (lambda: associative_recall(2, pairs=2.5), "pairs must be an integer >= .*, got 2.5"),
    (lambda: associative_recall(2, max_pairs=8, vocab=18), "vocab 18 has 7 key ids.*vocab must be >= 19"),
    (lambda: multi_hop_recall(2, pairs=4, vocab=10), "vocab 10 has 3 key ids"),
    (lambda: multi_hop_recall(2, replace_probability=1.5), "replace_probability 1.5 must lie in"),
    (lambda: curriculum_divisor(20_000), "step 20000 must be"),
    (lambda: curriculum_divisor(0, total_steps=0), "total_steps must be an integer >= .*, got 0"),
])
def test_bad_arguments_raise_value_errors_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    associative_recall(2, max_pairs=8, vocab=19)  # the smallest vocab that fits 8 distinct keys
