"""Structured sparsity patterns of generalized linear token mixing (GLTM; Fagnou et al., "Trading Complexity for
Expressivity Through Structured Generalized Linear Token Mixing", §4 and App. D).

Positions are 1-based per sequence (padding never shifts a lattice). For token i:

    P(i)   the B-support: the strictly past outputs y_j that i reads (recurrent part)
    N(i)   the A-support: the inputs x_j that i reads, {i} ∪ P(i) for every recurrent pattern

Patterns (``window`` w, default 8; an offset function f with f(0) = 1, strictly increasing):

    attention   P = ∅, N = {1..i}                          local   P = ∅, N = {i-w+1..i}
    ssm         P = {i-1}, N = {i}                          banded  P = {i-w..i-1}
    dense       P = {1..i-1}                                 (a "full resolvent mixer")
    pow2, quad, custom            translation-invariant (Eq. 3): P = {i - f(k) : f(k) < i}; f = 2^k, k^2 + 1, yours
    pow2_ce, quad_ce, custom_ce   cache-efficient (Eq. 12): P = {a_k ceil((i - f(k)) / a_k) : f(k) < i} with
                                  a_0 = 1, a_{k+1} = a_k ceil((f(k+1) - f(k)) / a_k): each target rounded up onto a
                                  lattice, so a position once dropped is never read again and a decoder keeps only
                                  the next token's support: ceil(log2 i) positions for pow2_ce, at most
                                  ceil(sqrt(i - 1)) for quad_ce. ``ce_slots_step`` is the paper's slot recursion
                                  (Eq. 42), which yields the same sets (tested).

The paper's Definition 4.10 as printed contradicts its own Eq. 12 and proof (it would give S_3 = {1, 3}); this module
implements Eq. 12, which the tests check against the corrected rounding definition and the slot recursion.
Several quad_ce scales can land on one position: a position counts once (set semantics).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

TRANSLATION_INVARIANT = {"pow2": lambda k: 2 ** k, "quad": lambda k: k * k + 1}
PATTERNS = ("attention", "local", "ssm", "banded", "dense", "pow2", "pow2_ce", "quad", "quad_ce", "custom",
            "custom_ce")
RECURRENT = tuple(p for p in PATTERNS if p not in ("attention", "local"))  # patterns with a nonzero B


def parse_offsets(spec: str) -> Callable[[int], int]:
    """An offset function from its config string: "pow:b" (b^k) or "poly:p,c" (k^p + c)."""
    kind, _, args = spec.partition(":")
    try:
        numbers = [int(x) for x in args.split(",")] if args else []
    except ValueError:
        numbers = None
    if kind == "pow" and numbers and len(numbers) == 1:
        base = numbers[0]
        if base < 2:
            raise ValueError(f"offset function {spec!r}: the base b of 'pow:b' must be >= 2 (f must increase)")
        return lambda k: base ** k
    if kind == "poly" and numbers and len(numbers) == 2:
        power, constant = numbers
        if power < 1:
            raise ValueError(f"offset function {spec!r}: the power p of 'poly:p,c' must be >= 1 (f must increase)")
        return lambda k: k ** power + constant
    raise ValueError(f"offset function {spec!r}: expected 'pow:b' (f(k) = b^k) or 'poly:p,c' (f(k) = k^p + c)")


def offset_function(pattern: str, offsets=None) -> Callable[[int], int] | None:
    """f for the patterns that have one (None for the others); ``offsets``: a callable or a ``parse_offsets`` string."""
    base = pattern.removesuffix("_ce")
    if base in TRANSLATION_INVARIANT:
        return TRANSLATION_INVARIANT[base]
    if base != "custom":
        return None
    if offsets is None:
        raise ValueError(f"pattern {pattern!r} needs an offset function (e.g. 'pow:3' or 'poly:2,1')")
    return parse_offsets(offsets) if isinstance(offsets, str) else offsets


def offsets_below(f: Callable[[int], int], length: int, check_terms: int = 4) -> list[int]:
    """f(0), f(1), ... while f(k) < length, after checking f(0) = 1 and that f increases strictly (the lattice and
    the slot recursion rely on both); at least ``check_terms`` terms are checked even when the sequence is short."""
    values, k = [], 0
    while True:
        value = f(k)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"offset function: f({k}) = {value!r} is not an integer")
        if k == 0 and value != 1:
            raise ValueError(f"offset function: f(0) must be 1 (the newest token), got {value}")
        if values and value <= values[-1]:
            raise ValueError(f"offset function: must be strictly increasing, got f({k - 1}) = {values[-1]} and "
                             f"f({k}) = {value}")
        if value >= length and k >= check_terms:
            return [v for v in values if v < length]
        values.append(value)
        k += 1


def lattice_steps(offsets: list[int]) -> list[int]:
    """a_k of Eq. 12: a_0 = 1, a_{k+1} = a_k ceil((f(k+1) - f(k)) / a_k)."""
    steps = [1]
    for previous, current in zip(offsets, offsets[1:]):
        steps.append(steps[-1] * math.ceil((current - previous) / steps[-1]))
    return steps[: len(offsets)]


def support_rows(pattern: str, positions: torch.Tensor, window: int = 8, offsets=None,
                 longest: int | None = None) -> torch.Tensor:
    """The B-support of each 1-based position in ``positions`` (any shape; 0 = padding, no support) as rows (..., K)
    of 1-based positions, 0 where a row has fewer than K entries; each row sorted in decreasing order (newest
    first), no repeats. K is the largest |P(i)| up to ``longest``, by default the largest position (read from the
    tensor: a host synchronisation, which a compiled decode step avoids by naming a bound)."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    if window < 1:
        raise ValueError(f"pattern support: window must be >= 1, got {window}")
    last = longest if longest is not None else int(positions.max()) if positions.numel() else 0
    i = positions[..., None]  # (..., 1)
    device = positions.device
    if pattern in ("attention", "local"):
        return positions.new_zeros(*positions.shape, 0)
    if pattern in ("ssm", "banded", "dense"):
        reach = {"ssm": 1, "banded": window, "dense": max(last - 1, 1)}[pattern]
        table = i - torch.arange(1, reach + 1, device=device)
    else:
        values = offsets_below(offset_function(pattern, offsets), max(last, 1))
        if not values:
            return positions.new_zeros(*positions.shape, 0)
        table = i - torch.tensor(values, device=device)
        if pattern.endswith("_ce"):
            steps = torch.tensor(lattice_steps(values), device=device)
            table = torch.where(table > 0, steps * torch.div(table + steps - 1, steps, rounding_mode="floor"), table)
    table = table.clamp(min=0)
    if pattern.endswith("_ce"):  # quad_ce: several scales can land on one position, which counts once
        table = table.sort(dim=-1, descending=True).values
        repeated = torch.cat([torch.zeros_like(table[..., :1], dtype=torch.bool),
                              table[..., 1:] == table[..., :-1]], -1)
        table = table.masked_fill(repeated, 0).sort(dim=-1, descending=True).values
    return table


def support_table(pattern: str, length: int, window: int = 8, offsets=None) -> torch.Tensor:
    """``support_rows`` of the positions 1..length: (length, K)."""
    if length < 1:
        raise ValueError(f"support_table: length must be >= 1, got {length}")
    return support_rows(pattern, torch.arange(1, length + 1), window, offsets)


def pattern_support(pattern: str, length: int, window: int = 8, offsets=None) -> list[list[int]]:
    """For each 1-based position i = 1..length, the sorted B-support P(i) (the past outputs token i reads)."""
    table = support_table(pattern, length, window, offsets)
    return [sorted(j for j in row if j > 0) for row in table.tolist()]


def longest_shortest_path(supports: list[list[int]]) -> int:
    """The longest shortest information path of a pattern (1-based ``supports`` as ``pattern_support`` gives them):
    a BFS from every source at once over the communication graph (edge j -> i iff j in P(i)) as boolean matrix
    products; the number of hops after which nothing new is reached. O(T^3) per hop: for T up to a few hundred."""
    length = len(supports)
    edges = torch.zeros(length, length)
    for i, row in enumerate(supports):
        edges[[j - 1 for j in row], i] = 1.0
    reached = frontier = torch.eye(length, dtype=torch.bool)
    hops = 0
    while True:
        frontier = ((frontier.float() @ edges) > 0) & ~reached
        if not frontier.any():
            return hops
        reached, hops = reached | frontier, hops + 1


def ce_slots_step(slots: list[int | None], position: int, offsets: list[int]) -> list[int | None]:
    """The cache-efficient slot recursion (Eq. 42): the slots of token ``position`` (1-based) -> those of the next
    token. Slot 0 takes ``position`` (the newest token); slot k keeps its entry while it is still recent enough,
    (position + 1) - f(k) <= its position, else inherits slot k - 1's entry. Needs f(0) = 1."""
    following = position + 1
    new = [position] + [None] * (len(slots) - 1)
    for k in range(1, len(slots)):
        if offsets[k] >= following:
            continue  # scale k not active yet
        kept = slots[k]
        new[k] = kept if kept is not None and following - offsets[k] <= kept else slots[k - 1]
    return new
