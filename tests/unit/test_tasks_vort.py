"""hf_mixers/tasks/vort.py: the Zipf-lag retrieval and entity label-copy generators build the tasks they document."""

import pytest
import torch

from hf_mixers.tasks import vort
from hf_mixers.tasks.vort import (IGNORE, entity_copy, entity_vocab_size, lag_buckets, zipf_lag_retrieval, zipf_lags,
                                  zipf_vocab_size, zipf_weights)

SMALL = dict(length=600, beta=1.0, classes=5, keys=40, queries=16, filler=7)


def test_generators_are_deterministic_in_the_seed():
    for make, kwargs in ((zipf_lag_retrieval, SMALL), (entity_copy, dict(length=500, entities=6, mentions=4))):
        first, again, other = make(3, seed=5, **kwargs), make(3, seed=5, **kwargs), make(3, seed=6, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert all(not torch.equal(a, b) for a, b in zip(first, other))
        assert all(a.dtype == torch.long and a.shape == (3, kwargs["length"]) for a in first)


def check_zipf_batch(tokens, targets, lags, length, classes, keys, queries, filler, max_lag=None, **_):
    """Decode every row by the documented layout and recover every scored target from the tokens alone."""
    anchor_base, query_base = filler, filler + keys * classes
    assert tokens.min() >= 0 and tokens.max() < zipf_vocab_size(keys, classes, filler)
    for row in range(tokens.shape[0]):
        x, y, d = tokens[row].tolist(), targets[row].tolist(), lags[row].tolist()
        anchors = {t: divmod(v - anchor_base, classes) for t, v in enumerate(x) if anchor_base <= v < query_base}
        asked = {t: v - query_base for t, v in enumerate(x) if v >= query_base}
        scored = [t for t in range(length) if y[t] != IGNORE]
        # Q queries and Q anchors survived, so no planted token overwrote another; keys distinct on both sides
        assert len(asked) == len(anchors) == queries and sorted(asked) == scored
        assert len(set(asked.values())) == len({k for k, _ in anchors.values()}) == queries
        assert all(d[t] == -1 for t in range(length) if t not in asked)
        for t, key in asked.items():
            holders = [s for s, (k, _) in anchors.items() if k == key]
            assert holders == [t - d[t]], f"row {row}, query at {t}: anchor of key {key} at {holders}, lag {d[t]}"
            assert 1 <= d[t] <= (max_lag or length) and 0 <= y[t] < classes
            assert anchors[t - d[t]][1] == y[t]


def test_zipf_every_scored_target_is_the_label_of_the_anchor_exactly_lag_earlier():
    check_zipf_batch(*zipf_lag_retrieval(8, seed=1, **SMALL), **SMALL)
    tight = dict(length=3 * 16 - 1, beta=2.0, classes=3, keys=16, queries=16, filler=2)  # every slot contested
    check_zipf_batch(*zipf_lag_retrieval(20, seed=2, **tight), **tight)
    capped = dict(SMALL, max_lag=40)
    tokens, targets, lags = zipf_lag_retrieval(8, seed=3, **capped)
    check_zipf_batch(tokens, targets, lags, **capped)
    assert lags.max() <= 40


def test_zipf_exact_fallback_alone_also_builds_valid_sequences(monkeypatch):
    monkeypatch.setattr(vort, "_ROUNDS", 0)  # no redraw rounds: every anchor drawn from the restricted law
    tight = dict(length=3 * 16 - 1, beta=1.0, classes=3, keys=20, queries=16, filler=2)
    check_zipf_batch(*zipf_lag_retrieval(10, seed=4, **tight), **tight)
    check_zipf_batch(*zipf_lag_retrieval(4, seed=4, **SMALL), **SMALL)


def test_entity_copy_labelled_first_mention_precedes_every_query_with_its_label_and_distance():
    E, C, M, F, length = 6, 5, 4, 9, 300
    tokens, targets, distances = entity_copy(10, length=length, entities=E, classes=C, mentions=M, filler=F, seed=7)
    assert tokens.min() >= 0 and tokens.max() < entity_vocab_size(E, C, F)
    for row in range(10):
        x, y, d = tokens[row].tolist(), targets[row].tolist(), distances[row].tolist()
        labelled = {}
        for t, v in enumerate(x):
            if v >= F + E:
                entity, label = divmod(v - F - E, C)
                assert entity not in labelled, f"row {row}: entity {entity} labelled twice"
                labelled[entity] = (t, label)
        assert sorted(labelled) == list(range(E))
        queries = [(t, v - F) for t, v in enumerate(x) if F <= v < F + E]
        assert len(queries) == E * (M - 1) and [t for t, _ in queries] == [t for t in range(length) if y[t] != IGNORE]
        for t, entity in queries:
            first, label = labelled[entity]
            assert first < t and y[t] == label and d[t] == t - first
        assert all(d[t] == -1 for t in range(length) if y[t] == IGNORE)
        per_entity = [sum(e == entity for _, e in queries) for entity in range(E)]
        assert per_entity == [M - 1] * E


def zipf_probabilities(upper, beta):
    w = zipf_weights(upper, beta)
    return w / w.sum()


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_lags_follow_truncated_zipf(beta):
    generator = torch.Generator().manual_seed(11)
    draws = zipf_lags(torch.full((200_000,), 5000), beta, generator)
    assert draws.min() >= 1 and draws.max() <= 5000
    counts = torch.bincount(draws, minlength=5001).double()
    assert abs(counts[1] / counts[2] - 2 ** beta) < 0.08 * 2 ** beta
    expected = zipf_probabilities(5000, beta)
    for lag in (1, 2, 3, 10):
        assert abs(counts[lag] / len(draws) - expected[lag - 1]) < 5 * (expected[lag - 1] / len(draws)) ** 0.5 + 1e-4
    # the same law inside the full generator (collision redraws perturb it only slightly)
    tokens, targets, lags = zipf_lag_retrieval(200, length=2000, beta=beta, seed=12)
    sample = lags[targets != IGNORE]
    ratio = (sample == 1).sum().item() / (sample == 2).sum().item()
    assert abs(ratio - 2 ** beta) < 0.15 * 2 ** beta


def test_fraction_of_long_lags_matches_the_truncated_law_at_length_10000():
    # truncated at 10^4 alone, P(d > 1000) = (H_9999 - H_1000) / H_9999, about 0.235 for beta = 1
    p = zipf_probabilities(9999, 1.0)
    tail = p[1000:].sum().item()
    assert abs(tail - 0.235) < 0.002
    draws = zipf_lags(torch.full((100_000,), 9999), 1.0, torch.Generator().manual_seed(13))
    assert abs((draws > 1000).double().mean().item() - tail) < 0.006
    # the generator truncates at each query's own position t (uniform over [2Q - 1, n - 1]): average that tail
    length, queries = 10_000, 64
    cdf = zipf_weights(length - 1, 1.0).cumsum(0)
    t = torch.arange(2 * queries - 1, length)
    expected = torch.where(t > 1000, (cdf[t - 1] - cdf[999]) / cdf[t - 1], torch.zeros((), dtype=torch.float64))
    expected = expected.mean().item()  # about 0.154, below 0.235 since early queries cannot look 1000 back
    tokens, targets, lags = zipf_lag_retrieval(100, length=length, beta=1.0, queries=queries, seed=14)
    empirical = (lags[targets != IGNORE] > 1000).double().mean().item()
    assert abs(empirical - expected) < 0.02
    assert tokens.max() < zipf_vocab_size() and zipf_vocab_size() == 256 + 512 * 16 + 512


def test_lag_buckets_follow_the_papers_edges():
    d = torch.tensor([-1, 1, 100, 101, 1000, 1001, 9999])
    assert lag_buckets(d).tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert lag_buckets(torch.tensor([200, 201, 2001]), vort.ENTITY_BUCKETS).tolist() == [0, 1, 2]


@pytest.mark.parametrize("kwargs, name", [
    (dict(length=100, queries=64), "length"),
    (dict(length=1000, beta=0.0), "beta"),
    (dict(length=1000, beta=-1.0), "beta"),
    (dict(length=1000, classes=1), "classes"),
    (dict(length=1000, keys=10), "keys"),
    (dict(length=1000, max_lag=50), "max_lag"),
    (dict(length=1000, queries=0), "queries"),
])
def test_zipf_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        zipf_lag_retrieval(1, **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(length=100), "length"),
    (dict(classes=1), "classes"),
    (dict(mentions=1), "mentions"),
    (dict(entities=0), "entities"),
])
def test_entity_copy_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        entity_copy(1, **kwargs)
