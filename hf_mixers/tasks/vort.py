"""The two synthetic tasks of the VORT paper (N. Mlaiki, "VORT: Adaptive Power-Law Memory for NLP Transformers",
arXiv 2605.08966, §6), as seeded generators.

Each returns ``tokens`` (count, T) and ``targets`` (count, T), a LongTensor with ``IGNORE`` (-100) where nothing is
scored, plus a (count, T) LongTensor of the distance each scored position looks back (-1 elsewhere), so accuracy can
be bucketed as the paper's tables are.

What the paper states:
    Zipf-lag retrieval: sequences of length n = 10,000; an anchor carrying a label y in {0..C-1}, C = 16, is planted
        at lag d before a position, P(D = d) proportional to d^-beta, beta in {1.0, 1.5, 2.0}; the task is to
        classify the anchor's label; 5,000 train / 1,000 test sequences; accuracy averaged over the three betas in
        lag buckets <= 100, 100-1000, > 1000.
    Entity label copy: n = 8,000, E = 20 entity names, each given a class label at its first mention; later mentions
        fall uniformly over the sequence; predict the label of the entity mentioned; buckets by distance from the
        first mention <= 200, 200-2000, > 2000.

What is our reconstruction (the paper publishes no generator, and "an anchor at every position" cannot be built as
written, since every position would need its own anchor):
    Zipf-lag retrieval: Q query positions per sequence (default 64), each asking for one key; the key (fresh, distinct
        within the sequence, out of ``keys`` = 512) is planted as an anchor token at t - d together with a uniform
        label, d ~ Zipf(beta) truncated to [1, t] (0-indexed t; 1-indexed that is [1, t - 1]) and to ``max_lag`` if
        given. A draw whose anchor would land on a query position or on another anchor is redrawn (first query in
        position order keeps a contested slot); after a few vectorised rounds the rare leftovers are drawn exactly
        from the truncated law restricted to the free slots, which is what redrawing forever converges to. Query
        positions are uniform without replacement over [2Q - 1, n - 1] (0-indexed): starting there guarantees every
        query at least 2Q - 1 earlier slots, more than the 2Q - 2 the other queries and anchors can take, so an anchor
        always fits. Everything else is iid filler (256 ids). Only query positions are scored.
    Entity label copy: C = 16 labels (as for the Zipf task); M = 10 mentions per entity, i.e. 20 x 9 = 180 scored
        queries per sequence; all E x M mention positions are distinct and uniform; per entity the earliest is the
        labelled mention (one token joining entity and label) and the rest are query mentions (the entity token) whose
        target is the label; filler (256 ids) elsewhere; the same 5,000 / 1,000 split as the Zipf task.

Token ids (F = ``filler``, K = ``keys``, C = ``classes``, E = ``entities``):
    zipf_lag_retrieval   filler 0..F-1 | anchor (key k, label y): F + k*C + y | query for key k: F + K*C + k
                         vocabulary size F + K*C + K  (``zipf_vocab_size``)
    entity_copy          filler 0..F-1 | query mention of entity e: F + e | labelled mention (e, y): F + E + e*C + y
                         vocabulary size F + E + E*C  (``entity_vocab_size``)
"""

from __future__ import annotations

import torch

from .checks import IGNORE


ZIPF_BETAS = (1.0, 1.5, 2.0)       # the paper averages Table 1 over these
ZIPF_BUCKETS = (100, 1000)         # lag buckets <= 100, 101..1000, > 1000
ENTITY_BUCKETS = (200, 2000)       # distance buckets <= 200, 201..2000, > 2000
TRAIN_SEQUENCES, TEST_SEQUENCES = 5_000, 1_000

_ROUNDS = 32  # vectorised redraw rounds before the exact fallback takes the (rare) leftovers


def zipf_vocab_size(keys: int = 512, classes: int = 16, filler: int = 256) -> int:
    """Vocabulary of ``zipf_lag_retrieval``: filler, then K*C anchor ids, then K query ids."""
    return filler + keys * classes + keys


def entity_vocab_size(entities: int = 20, classes: int = 16, filler: int = 256) -> int:
    """Vocabulary of ``entity_copy``: filler, then E query-mention ids, then E*C labelled-mention ids."""
    return filler + entities + entities * classes


def zipf_weights(max_lag: int, beta: float) -> torch.Tensor:
    """(max_lag,) float64 unnormalised Zipf weights d^-beta for d = 1..max_lag."""
    return torch.arange(1, max_lag + 1, dtype=torch.float64) ** -beta


def zipf_lags(upper: torch.Tensor, beta: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """One lag per entry of ``upper`` (any shape, LongTensor >= 1): d ~ P(d) proportional to d^-beta on [1, upper].
    Inverse-CDF sampling, so one uniform draw per lag whatever the truncation."""
    if beta <= 0:
        raise ValueError(f"zipf_lags: beta {beta} must be > 0")
    if upper.numel() == 0:
        return upper.clone()
    if int(upper.min()) < 1:
        raise ValueError(f"zipf_lags: every upper bound must be >= 1, got {int(upper.min())}")
    cdf = zipf_weights(int(upper.max()), beta).cumsum(0)                       # cdf[i] = P-mass of d <= i + 1
    u = torch.rand(upper.shape, dtype=torch.float64, generator=generator) * cdf[upper - 1]
    return (torch.searchsorted(cdf, u.reshape(-1), right=True).reshape(upper.shape) + 1).minimum(upper)


def lag_buckets(distances: torch.Tensor, edges=ZIPF_BUCKETS) -> torch.Tensor:
    """Bucket index per position: 0 for d <= edges[0], 1 for edges[0] < d <= edges[1], ...; -1 where unscored."""
    buckets = torch.bucketize(distances, torch.tensor(edges, dtype=distances.dtype))
    return torch.where(distances > 0, buckets, torch.full_like(buckets, -1))


def _check(name: str, value, ok: bool, rule: str):
    if not ok:
        raise ValueError(f"{name}: {rule} (got {value})")


def zipf_lag_retrieval(count: int, length: int = 10_000, beta: float = 1.0, classes: int = 16, keys: int = 512,
                       queries: int = 64, filler: int = 256, max_lag: int | None = None, seed: int = 0):
    """Zipf-lag retrieval. Returns (tokens, targets, lags), each (count, length) LongTensor.

    Each sequence holds ``queries`` query tokens, each naming a distinct key; the anchor token joining that key with
    a uniform label sits ``d`` positions earlier, d ~ Zipf(beta) truncated to the sequence start (and to ``max_lag``).
    targets: the label at each query position, IGNORE elsewhere. lags: d at each query position, -1 elsewhere.
    Token ids: filler 0..F-1, anchor F + key*C + label, query F + K*C + key (see the module docstring)."""
    _check("count", count, count >= 1, "count must be >= 1")
    _check("beta", beta, beta > 0, "beta must be > 0")
    _check("classes", classes, classes >= 2, "classes must be >= 2")
    _check("queries", queries, queries >= 1, "queries must be >= 1")
    _check("keys", keys, keys >= queries, f"keys must be >= queries ({queries}) so every query gets a fresh key")
    _check("filler", filler, filler >= 1, "filler must be >= 1")
    first = 2 * queries - 1  # earliest query position (0-indexed): it leaves room for an anchor whatever the others do
    _check("length", length, length >= first + queries,
           f"length must be >= 3 x queries - 1 ({first + queries}) to fit {queries} queries and their anchors")
    if max_lag is not None:
        _check("max_lag", max_lag, max_lag >= first,
               f"max_lag must be >= 2 x queries - 1 ({first}) so every query can place its anchor")
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(count)[:, None]                                                    # (count, 1)
    order = torch.arange(queries).expand(count, queries)                                   # (count, Q)

    tokens = torch.randint(filler, (count, length), generator=generator)                   # (count, T) iid filler
    positions = torch.rand(count, length - first, generator=generator).topk(queries, dim=1).indices
    positions = positions.sort(dim=1).values + first                                       # (count, Q) ascending
    key = torch.rand(count, keys, generator=generator).topk(queries, dim=1).indices        # (count, Q) distinct
    label = torch.randint(classes, (count, queries), generator=generator)                  # (count, Q)
    upper = positions if max_lag is None else positions.clamp(max=max_lag)                 # (count, Q) largest lag

    # place the anchors: draw every pending lag, keep the draws that hit a free slot (lowest query wins a tie)
    occupied = torch.zeros(count, length, dtype=torch.bool)
    occupied[rows, positions] = True
    lag = torch.zeros(count, queries, dtype=torch.long)                                    # (count, Q), 0 = pending
    for _ in range(_ROUNDS):
        pending = lag == 0
        if not pending.any():
            break
        draw = zipf_lags(upper, beta, generator)                                           # (count, Q)
        slot = positions - draw                                                            # (count, Q) >= 0
        free = pending & ~occupied.gather(1, slot)
        claim = torch.full((count, length), queries).scatter_reduce(
            1, slot, torch.where(free, order, queries), reduce="amin")                     # lowest free claimant
        won = free & (claim.gather(1, slot) == order)
        lag = torch.where(won, draw, lag)
        occupied[rows.expand_as(slot)[won], slot[won]] = True
    weights = zipf_weights(int(upper.max()), beta)
    for row, q in (lag == 0).nonzero().tolist():  # exact: the truncated law restricted to free slots
        d = torch.arange(1, int(upper[row, q]) + 1)
        w = weights[:len(d)] * ~occupied[row, positions[row, q] - d]
        lag[row, q] = int(torch.multinomial(w, 1, generator=generator)) + 1
        occupied[row, positions[row, q] - lag[row, q]] = True

    tokens[rows, positions] = filler + keys * classes + key                                # query tokens
    tokens[rows, positions - lag] = filler + key * classes + label                         # anchor tokens
    targets = torch.full((count, length), IGNORE)
    targets[rows, positions] = label
    lags = torch.full((count, length), -1)
    lags[rows, positions] = lag
    return tokens, targets, lags


def entity_copy(count: int, length: int = 8_000, entities: int = 20, classes: int = 16, mentions: int = 10,
                filler: int = 256, seed: int = 0):
    """Entity label copy. Returns (tokens, targets, distances), each (count, length) LongTensor.

    Each entity gets ``mentions`` distinct uniform positions (distinct across entities too); the earliest is its
    labelled mention (token joining entity and a uniform label), the others are query mentions scored with the label.
    distances: query position minus the entity's first-mention position at query positions, -1 elsewhere.
    Token ids: filler 0..F-1, query mention F + entity, labelled mention F + E + entity*C + label."""
    _check("count", count, count >= 1, "count must be >= 1")
    _check("entities", entities, entities >= 1, "entities must be >= 1")
    _check("classes", classes, classes >= 2, "classes must be >= 2")
    _check("mentions", mentions, mentions >= 2, "mentions must be >= 2 (one labelled mention plus queries)")
    _check("filler", filler, filler >= 1, "filler must be >= 1")
    _check("length", length, length >= entities * mentions,
           f"length must be >= entities x mentions ({entities * mentions}) to fit every mention")
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(count)[:, None, None]                                               # (count, 1, 1)
    entity = torch.arange(entities)[None, :, None]                                          # (1, E, 1)

    tokens = torch.randint(filler, (count, length), generator=generator)                    # (count, T) iid filler
    where = torch.rand(count, length, generator=generator).topk(entities * mentions, dim=1).indices
    where = where.view(count, entities, mentions).sort(dim=2).values                        # (count, E, M) ascending
    label = torch.randint(classes, (count, entities, 1), generator=generator)               # (count, E, 1)
    first, later = where[:, :, :1], where[:, :, 1:]                                         # (count, E, 1), (.., M-1)

    tokens[rows, first] = filler + entities + entity * classes + label                      # labelled mentions
    tokens[rows, later] = filler + entity                                                   # query mentions
    targets = torch.full((count, length), IGNORE)
    targets[rows, later] = label.expand_as(later)
    distances = torch.full((count, length), -1)
    distances[rows, later] = later - first
    return tokens, targets, distances
