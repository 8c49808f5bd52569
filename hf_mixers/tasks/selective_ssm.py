"""The synthetic tasks of the selective-SSM paper (Huang et al. 2025, §4.1, §5, App. D), as exact generators.

Each returns ``tokens`` (count, T) and ``targets`` (count, T), a LongTensor with -100 where nothing is scored.
Ambiguities are resolved as docs/mixers/selective_ssm.md says: MQAR keys are a permutation of the κ keys and each is
queried exactly once, at random positions of the query section, with noise drawn from the values; induction heads
score every position, with a blank class for a token not seen before; KEEP n-TH scores t >= n.
"""

from __future__ import annotations

import torch

from .checks import IGNORE



def mqar(count: int, pairs: int, values: int, length: int = 100, seed: int = 0):
    """Multi-query associative recall: [k_1 v_1 ... k_κ v_κ | query section]. Token ids: keys 0..κ-1, values
    κ..κ+|V|-1. The target at the query of k_i is the value token that followed k_i."""
    if length < 3 * pairs:
        raise ValueError(f"mqar: length {length} must be at least 3 x pairs ({3 * pairs}) to query every key once")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(pairs, pairs + values, (count, length), generator=generator)  # noise from the values
    targets = torch.full((count, length), IGNORE)
    section = length - 2 * pairs
    for row in range(count):
        keys = torch.randperm(pairs, generator=generator)
        tokens[row, 0:2 * pairs:2] = keys
        paired = tokens[row, 1:2 * pairs:2]  # each key's value (already random values)
        value_of = torch.empty(pairs, dtype=torch.long)
        value_of[keys] = paired
        positions = 2 * pairs + torch.randperm(section, generator=generator)[:pairs]
        asked = torch.randperm(pairs, generator=generator)
        tokens[row, positions] = asked
        targets[row, positions] = value_of[asked]
    return tokens, targets


def induction_heads(count: int, vocab: int, length: int = 100, hard_probability: float = 0.75,
                    special_range: float = 0.1, seed: int = 0):
    """y_t = x_{j+1} for the last earlier j with x_j = x_t, else the blank class ``vocab``. Hard cases (probability
    p): a special token v* appears exactly twice, at 1-indexed positions r and T - r, r ~ U{1..γT}."""
    if length <= 2 * vocab + 1:
        raise ValueError(f"induction_heads: length {length} must exceed 2 x vocab + 1 ({2 * vocab + 1})")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (count, length), generator=generator)
    for row in range(count):
        if torch.rand((), generator=generator) < hard_probability:
            special = int(torch.randint(vocab, (), generator=generator))
            others = torch.randint(vocab - 1, (length,), generator=generator)
            tokens[row] = others + (others >= special).long()  # uniform over V \ {v*}
            r = int(torch.randint(1, max(1, int(special_range * length)) + 1, (), generator=generator))
            tokens[row, r - 1] = tokens[row, length - r - 1] = special
    return tokens, induction_targets(tokens, vocab)


def induction_targets(tokens, vocab: int):
    """(count, T) tokens -> the token after the last earlier occurrence of each token, or the blank ``vocab``."""
    targets = torch.full_like(tokens, vocab)
    for row in range(tokens.shape[0]):
        last = {}
        for t, token in enumerate(tokens[row].tolist()):
            if token in last:
                targets[row, t] = tokens[row, last[token] + 1]
            last[token] = t
    return targets


def keep_nth(count: int, vocab: int, length: int, n: int = 5, seed: int = 0):
    """KEEP n-TH: y_t = x_n for every t >= n (1-indexed), nothing scored before."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (count, length), generator=generator)
    targets = torch.full((count, length), IGNORE)
    targets[:, n - 1:] = tokens[:, n - 1:n]
    return tokens, targets
