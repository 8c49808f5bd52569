"""kernels/token_patterns.py: GLTM's sparsity patterns against the paper's definitions, its closed form, its slot
recursion and the exact statistics of spec §3.2 (Fagnou et al., §4 and App. D)."""

import math

import pytest

from hf_mixers.kernels.token_patterns import (ce_slots_step, lattice_steps, longest_shortest_path, offsets_below,
                                              parse_offsets, pattern_support, support_table)
from hf_mixers.apps.reproduce.gltm import EXPECTED
from hf_mixers.ops import pattern_support as public_pattern_support

F = {"pow2": lambda k: 2 ** k, "quad": lambda k: k * k + 1}

# the exact table (max |P(i)| / nnz(B) / longest shortest path at T = 128, 256, 1024, 2048; paths for the first two),
# transcribed once, in the reproduction that prints it
STATS = EXPECTED


@pytest.mark.parametrize("pattern", list(STATS))
def test_the_exact_pattern_statistics_of_the_spec(pattern):
    for length, expected in zip((128, 256, 1024, 2048), STATS[pattern]):
        supports = pattern_support(pattern, length)
        assert max(len(row) for row in supports) == expected[0], length
        assert sum(len(row) for row in supports) == expected[1], length
        if len(expected) == 3:
            assert longest_shortest_path(supports) == expected[2], length


def test_the_paper_definitions_of_the_translation_invariant_patterns():
    length = 300
    for name in ("pow2", "quad"):
        for i, row in enumerate(pattern_support(name, length), start=1):
            assert row == sorted(i - F[name](k) for k in range(i) if F[name](k) < i), (name, i)
    for i, row in enumerate(pattern_support("pow2", 2048), start=1):  # |P(i)| = ceil(log2 i)
        assert len(row) == math.ceil(math.log2(i)), i
    for i, row in enumerate(pattern_support("quad", 2048), start=1):  # |P(i)| = ceil(sqrt(i - 1))
        assert len(row) == math.isqrt(i - 1) + (math.isqrt(i - 1) ** 2 < i - 1), i
    window = 5
    for i, (ssm, banded, dense) in enumerate(zip(pattern_support("ssm", 40), pattern_support("banded", 40, window),
                                                 pattern_support("dense", 40)), start=1):
        assert ssm == ([i - 1] if i > 1 else [])
        assert banded == list(range(max(1, i - window), i))
        assert dense == list(range(1, i))
    assert all(row == [] for name in ("attention", "local") for row in pattern_support(name, 20))


@pytest.mark.parametrize("name", ["pow2", "quad"])
def test_the_cache_efficient_closed_form_equals_the_rounding_definition_and_the_slot_recursion(name):
    """Eq. 12 against the corrected Definition 4.10 (round i - f(k) up into S_{i-1} ∪ {i-1}, S_1 = ∅) and against
    the decoder's slot recursion (Eq. 42), for i <= 600; and the eviction invariant S_{i+1} ⊆ S_i ∪ {i}."""
    length = 600
    closed = pattern_support(f"{name}_ce", length)
    offsets = offsets_below(F[name], length + 1)
    previous = set()  # S_1 = ∅
    slots = [None] * len(offsets)
    for i in range(1, length + 1):
        if i > 1:
            available = previous | {i - 1}
            rounded = {min(p for p in available if p >= i - f) for f in offsets if f < i}
            slots = ce_slots_step(slots, i - 1, offsets)
            from_slots = {p for p in slots if p is not None}
        else:
            rounded = from_slots = set()
        assert set(closed[i - 1]) == rounded == from_slots, i
        assert rounded <= previous | ({i - 1} if i > 1 else set()), i  # evicted positions never come back
        previous = rounded


def test_pow2_ce_never_collides_and_quad_ce_caches_what_the_spec_counts():
    table = support_table("pow2_ce", 65536)
    counts = (table > 0).sum(1)
    expected = [math.ceil(math.log2(i)) for i in range(1, 65537)]
    assert counts.tolist() == expected  # ceil(log2 i) distinct positions: the scales never share one
    quad = (support_table("quad_ce", 32768) > 0).sum(1)
    for length, cache in zip((128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
                             (10, 13, 19, 25, 36, 48, 69, 93, 136)):
        assert int(quad[:length].max()) == cache, length
    assert lattice_steps(offsets_below(F["pow2"], 300)) == [1, 1, 2, 4, 8, 16, 32, 64, 128]
    assert lattice_steps(offsets_below(F["quad"], 200))[:10] == [1, 1, 3, 6, 12, 12, 12, 24, 24, 24]


def test_shortest_paths_are_popcounts_for_pow2_and_at_most_four_hops_for_quad():
    supports = pattern_support("pow2", 200)
    hops = {1: 0}  # BFS from position 1: for a translation-invariant pattern d(i, j) depends on i - j only
    for i, row in enumerate(supports, start=1):
        reachable = [hops[j] for j in row if j in hops]
        if i > 1 and reachable:
            hops[i] = min(reachable) + 1
    assert all(hops[1 + m] == bin(m).count("1") for m in range(1, 199))
    quad_hops = {1: 0}
    for i, row in enumerate(pattern_support("quad", 200), start=1):
        if i > 1:
            quad_hops[i] = min(quad_hops[j] for j in row) + 1
    assert max(quad_hops.values()) == 4 and min(m for m in range(1, 199) if quad_hops[1 + m] == 4) == 58


def test_custom_offsets_are_validated_and_match_the_named_patterns():
    assert pattern_support("custom", 100, offsets="pow:2") == pattern_support("pow2", 100)
    assert pattern_support("custom_ce", 100, offsets="poly:2,1") == pattern_support("quad_ce", 100)
    assert pattern_support("custom", 50, offsets=lambda k: 3 ** k) == [
        sorted(i - 3 ** k for k in range(5) if 3 ** k < i) for i in range(1, 51)]
    assert public_pattern_support("pow2_ce", 12)[11] == [4, 8, 10, 11]
    with pytest.raises(ValueError, match="f\\(0\\) must be 1"):
        pattern_support("custom", 10, offsets="poly:2,2")  # f(0) = 2
    with pytest.raises(ValueError, match="strictly increasing"):
        pattern_support("custom", 10, offsets=lambda k: 1 if k < 2 else k)
    with pytest.raises(ValueError, match="not an integer"):
        pattern_support("custom", 10, offsets=lambda k: 1.5 ** k)
    with pytest.raises(ValueError, match="'pow:b'"):
        parse_offsets("exp:2")
    for spec, message in (("poly:-1,2", "the power p of 'poly:p,c' must be >= 1"),  # 0 ** -1 once divided by zero
                          ("pow:1", "the base b of 'pow:b' must be >= 2")):
        with pytest.raises(ValueError, match=message):
            parse_offsets(spec)
    with pytest.raises(ValueError, match="needs an offset function"):
        pattern_support("custom_ce", 10)
    with pytest.raises(ValueError, match="unknown pattern 'pow3'"):
        pattern_support("pow3", 10)
