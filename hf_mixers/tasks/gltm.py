"""The synthetic tasks of the GLTM paper (its Table 1): copy, associative recall and multi-hop recall, as generators.

The paper is "Trading Complexity for Expressivity Through Structured Generalized Linear Token Mixing" (Fagnou,
Caillon, Delattre, Allauzen). It compares token mixers of different per-token cost on three synthetic tasks, with a
2-block model of width 256 and a vocabulary of 8192.

What the paper states (and the defaults here follow):
    - copy: copy an input sequence of up to 128 tokens; special tokens mark where it begins and ends;
    - associative recall: adapted from Zoology's MQAR; up to 64 key-value pairs in sequences of up to 256 tokens;
      key and value positions are randomised more than usual; a queried key must be answered with its value;
    - multi-hop recall: associative recall in which each value is replaced, with probability 0.5, by a preceding key
      that must then be looked up in turn; labels on the intermediary keys help learning;
    - the data is drawn on the fly, sequence lengths are randomised per batch, and a Mamba-2-style curriculum of 4
      phases divides the sequence length (and the task's size) by 8, 4, 2 and 1.

What is reconstructed here (the paper gives no generator details):
    - the vocabulary layout below, one layout for all three tasks;
    - copy: ``[BOS] c_1 .. c_L [SEP] c_1 .. c_L`` with uniform content tokens, so T = 2L + 2 (258 at L = 128: the
      sequence is not truncated to 256); scored on the next-token predictions of the second copy;
    - associative recall: N distinct keys (from the key half of the content ids) with uniform values (from the value
      half, repeats allowed); N "bind" events ``k v`` and N "query" events ``k v`` of two tokens each, interleaved
      uniformly at random among the arrangements where each query follows its bind (this is the "randomised more
      than usual": binds and queries mix, instead of all binds first); T = 4N, no BOS; the target at a query's key
      is its value (which is also the next token there);
    - multi-hop recall: walking the binds in order of appearance, every bind but the first has its value replaced,
      with probability p, by the key of a uniformly chosen earlier bind; r(k) follows the chain of bindings back to
      a genuine value; a query event is ``k r(k)`` and its target is r(k); the "labels on intermediary keys" are
      auxiliary targets r(k') at each bind value slot that holds a key k';
    - one size (L or N) is drawn uniformly from 1 .. max per call: a call is one batch;
    - the curriculum's 4 phases have equal length (``curriculum_divisor``);
    - the metric is token accuracy (%) on the scored positions (query targets only for multi-hop), evaluated on
      fresh final-phase data, e.g. 10 x 1024 sequences.

Vocabulary layout (``vocab_layout(vocab)``; ``vocab`` is an argument of every generator, 8192 by default, and is the
vocabulary size for any other arguments; a generator raises ValueError when it is too small for them):
    0 PAD (reserved; never emitted, lengths are fixed within a call), 1 BOS, 2 SEP,
    3 .. vocab-1 content: copy draws from all of it; the recall tasks split it into keys, the first
    floor((vocab-3)/2) ids, and values, the rest (8192: keys 3..4096, values 4097..8191).

Every generator returns ``tokens`` (count, T) and ``targets`` (count, T), LongTensors with IGNORE (-100) where nothing
is scored; ``multi_hop_recall`` also returns the auxiliary targets and the hop count of each query.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import NamedTuple

import torch

from .checks import IGNORE, check_int

VOCAB = 8192
PAD, BOS, SEP = 0, 1, 2
SPECIALS = 3
CURRICULUM = (8, 4, 2, 1)


class VocabLayout(NamedTuple):
    """Token ids of the three tasks for a vocabulary of ``vocab`` ids (see the module docstring)."""

    vocab: int
    pad: int
    bos: int
    sep: int
    content: range  # copy's tokens
    keys: range  # recall keys: the first half of ``content``
    values: range  # recall values: the second half


def vocab_layout(vocab: int = VOCAB) -> VocabLayout:
    """The id layout for a vocabulary of ``vocab`` ids; ``vocab`` needs at least one content id (>= 4)."""
    check_int("vocab", vocab, SPECIALS + 1, "vocab_layout")
    half = SPECIALS + (vocab - SPECIALS) // 2
    return VocabLayout(vocab, PAD, BOS, SEP, range(SPECIALS, vocab), range(SPECIALS, half), range(half, vocab))


def curriculum_divisor(step: int, total_steps: int = 20_000, divisors: tuple = CURRICULUM) -> int:
    """The divisor of the curriculum phase that ``step`` (0-based) falls in: ``len(divisors)`` equal phases.

    Use it as ``copy_task(count, max_length=max(1, 128 // d))`` or ``..._recall(count, max_pairs=max(1, 64 // d))``.
    """
    check_int("total_steps", total_steps, 1, "curriculum_divisor")
    if not divisors:
        raise ValueError("curriculum_divisor: divisors must not be empty")
    if isinstance(step, bool) or not isinstance(step, Integral) or not 0 <= step < total_steps:
        raise ValueError(f"curriculum_divisor: step {step!r} must be an integer in [0, total_steps={total_steps})")
    return divisors[step * len(divisors) // total_steps]


def copy_task(count: int, max_length: int = 128, length: int | None = None, vocab: int = VOCAB, seed: int = 0):
    """Copy: ``[BOS] c_1 .. c_L [SEP] c_1 .. c_L``, T = 2L + 2, L ~ U{1..max_length} (or ``length`` if given).

    Position t is scored with the next token, on the predictions of the second copy: the SEP at t = L + 1 has target
    c_1, and the second copy's i-th token (t = L + 1 + i) has target c_{i+1}; its last token is not scored. So the
    target at the i-th scored position is the i-th input token.
    """
    check_int("count", count, 1, "copy_task")
    check_int("max_length", max_length, 1, "copy_task")
    if length is not None:
        check_int("length", length, 1, "copy_task")
    layout = vocab_layout(vocab)
    generator = torch.Generator().manual_seed(seed)
    n = length if length is not None else _draw_size(max_length, generator)
    content = torch.randint(layout.content.start, layout.content.stop, (count, n), generator=generator)  # (count, L)
    bos = torch.full((count, 1), BOS)
    sep = torch.full((count, 1), SEP)
    tokens = torch.cat([bos, content, sep, content], dim=1)  # (count, 2L + 2)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, n + 1:2 * n + 1] = content  # (count, L): predicted at SEP .. the second copy's c_{L-1}
    return tokens, targets


def associative_recall(count: int, max_pairs: int = 64, pairs: int | None = None, vocab: int = VOCAB,
                       seed: int = 0):
    """Associative recall: N bind and N query events ``k v``, interleaved with each query after its bind; T = 4N.

    N ~ U{1..max_pairs} (or ``pairs`` if given); keys distinct within a sequence. The target at a query's key
    position is the value bound to that key (the next token); nothing else is scored. Identical to
    ``multi_hop_recall(..., replace_probability=0.0)[:2]`` with the same arguments.
    """
    tokens, targets, _, _ = _recall(count, max_pairs, pairs, vocab, 0.0, seed, "associative_recall")
    return tokens, targets


def multi_hop_recall(count: int, max_pairs: int = 64, pairs: int | None = None, vocab: int = VOCAB,
                     replace_probability: float = 0.5, seed: int = 0):
    """Multi-hop recall: associative recall where every bind but the first (in order of appearance) holds, with
    probability ``replace_probability``, the key of a uniformly chosen earlier bind instead of a value.

    Returns ``(tokens, targets, aux_targets, hops)``, each (count, T = 4N):
        targets      r(k) at each query's key position (the metric; the query event is ``k r(k)``), IGNORE elsewhere;
        aux_targets  r(k') at each bind value slot holding a key k' (the paper's labels on intermediary keys, for
                     the training loss only), IGNORE elsewhere; never overlaps ``targets``;
        hops         at each query's key position, the number of bindings followed from k to a genuine value
                     (1 = plain recall), 0 elsewhere; for bucketing accuracy.
    """
    return _recall(count, max_pairs, pairs, vocab, replace_probability, seed, "multi_hop_recall")


def _recall(count, max_pairs, pairs, vocab, replace_probability, seed, caller):
    check_int("count", count, 1, caller)
    check_int("max_pairs", max_pairs, 1, caller)
    if pairs is not None:
        check_int("pairs", pairs, 1, caller)
    if not isinstance(replace_probability, Real) or not 0.0 <= replace_probability <= 1.0:
        raise ValueError(f"{caller}: replace_probability {replace_probability!r} must lie in [0, 1]")
    layout = vocab_layout(vocab)
    most = pairs if pairs is not None else max_pairs
    if len(layout.keys) < most:
        raise ValueError(f"{caller}: vocab {vocab} has {len(layout.keys)} key ids, fewer than the {most} distinct "
                         f"keys a sequence may need (vocab must be >= {SPECIALS + 2 * most})")
    generator = torch.Generator().manual_seed(seed)
    n = pairs if pairs is not None else _draw_size(max_pairs, generator)
    keys = layout.keys.start + torch.rand(count, len(layout.keys), generator=generator).topk(n, dim=1).indices
    values = torch.randint(layout.values.start, layout.values.stop, (count, n), generator=generator)  # (count, N)

    # Events: a uniform arrangement of the multiset {0, 0, 1, 1, .., N-1, N-1}; a pair's first event is its bind.
    slot_of = torch.rand(count, 2 * n, generator=generator).argsort(dim=1)  # (count, 2N): event slot of ids m, m + N
    bind_slot = torch.minimum(slot_of[:, :n], slot_of[:, n:])  # (count, N)
    query_slot = torch.maximum(slot_of[:, :n], slot_of[:, n:])  # (count, N)
    order = bind_slot.argsort(dim=1)  # relabel pairs in order of appearance of their binds
    bind_slot, query_slot = bind_slot.gather(1, order), query_slot.gather(1, order)  # (count, N), binds ascending

    held = values.clone()  # (count, N): the token in each bind's value slot
    resolved = values.clone()  # (count, N): r(k) of each pair's key
    hops = torch.ones(count, n, dtype=torch.long)  # (count, N)
    aux = torch.full((count, n), IGNORE)  # (count, N): label at each bind's value slot
    if replace_probability > 0.0 and n > 1:
        replace = torch.rand(count, n, generator=generator) < replace_probability  # (count, N); column 0 unused
        earlier = torch.arange(n).clamp(min=1)  # (N,): how many earlier binds there are
        source = (torch.rand(count, n, generator=generator) * earlier).long().clamp(max=earlier - 1)  # (count, N)
        rows = torch.arange(count)
        for r in range(1, n):  # a chain only points backwards, so r(k) of earlier binds is known
            swap, src = replace[:, r], source[:, r]
            held[:, r] = torch.where(swap, keys[rows, src], values[:, r])
            resolved[:, r] = torch.where(swap, resolved[rows, src], values[:, r])
            hops[:, r] = torch.where(swap, hops[rows, src] + 1, hops[:, r])
            aux[:, r] = torch.where(swap, resolved[rows, src], aux[:, r])

    rows = torch.arange(count)[:, None]  # (count, 1)
    tokens = torch.empty(count, 4 * n, dtype=torch.long)  # (count, T = 4N): event e fills positions 2e, 2e + 1
    tokens[rows, 2 * bind_slot] = keys
    tokens[rows, 2 * bind_slot + 1] = held
    tokens[rows, 2 * query_slot] = keys
    tokens[rows, 2 * query_slot + 1] = resolved
    targets = torch.full_like(tokens, IGNORE)
    targets[rows, 2 * query_slot] = resolved
    aux_targets = torch.full_like(tokens, IGNORE)
    aux_targets[rows, 2 * bind_slot + 1] = aux
    hop_map = torch.zeros_like(tokens)
    hop_map[rows, 2 * query_slot] = hops
    return tokens, targets, aux_targets, hop_map


def _draw_size(most: int, generator: torch.Generator) -> int:
    """One size, uniform on 1..most (per call, i.e. per batch)."""
    return int(torch.randint(1, most + 1, (), generator=generator))


