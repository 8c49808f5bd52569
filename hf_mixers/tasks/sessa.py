"""The synthetic tasks of the Sessa paper: SymbolSoup and Diffuse MQAR, as seeded generators.

The paper is "Sessa: Selective State Space Attention" (Horbatko). It compares a Sessa decoder with a Transformer and a
Mamba2 decoder on two long-context synthetic tasks (its Table 1; mean of 2 seeds):

    model         SymbolSoup accuracy   Diffuse MQAR token accuracy
    Sessa         0.8601                0.1541
    Transformer   0.7921                0.1222
    Mamba2        0.0500 (chance)       0.0021

The paper gives no model sizes, sequence lengths, tokenizer or training settings for either task.

SymbolSoup: the authors' released generator (``datasets/SymbolSoup.py`` of the official Sessa repository)
-------------------------------------------------------------------------------------------------------------
``symbol_soup`` reproduces that script's algorithm and distributions exactly, with a torch generator instead of
Python's global ``random`` (so the draws, not the distributions, differ from the script's files). From the script:

    - a 20-way classification: class k = 5 l + r names a left style l (of 4) and a right style r (of 5);
    - 16 letters a..p; each style shuffles them (``random.Random(123)`` for the 4 left styles drawn in turn,
      ``random.Random(456)`` for the 5 right ones) into 4 primaries (unigram weight 3), 4 secondaries (2) and
      8 others (1); its 20 preferred bigrams are (p_i, p_{i+1 mod 4}), (p_i, p_i), (s_i, s_i), (p_i, s_i), (s_i, p_i);
    - 39 motifs, every run of 3, 4 or 5 consecutive letters, weighted 1 + 0.9 |m & P| + 0.5 |m & S|;
    - a stylized block of L letters: while letters are missing (rem of them), with probability 0.3 if rem >= 3 append
      a motif of length <= rem drawn by weight, else one Markov letter, drawn by unigram weight times
      (1 + 3 [(prev, x) is a preferred bigram]); then each letter is flipped, with probability 0.03, to a uniformly
      drawn different letter;
    - an example: M ~ U{M_min..M_max} letters, M_min = max(5, ceil((min_tokens - 13) / 2)),
      M_max = max(5, floor((max_tokens - 13) / 2)); noise N ~ U{max(3, int(0.3 M)) .. max(that, int(0.6 M))}
      clipped to [3, M - 2]; main m = M - N split as L_left ~ U{1..m-1}, L_right = m - L_left; the noise split as
      N0 ~ U{1..N-2}, N1 ~ U{1..N-N0-1}, N2 = N - N0 - N1, each noise block i.i.d. uniform letters; the left block
      comes first with probability 0.5;
    - the text (one string; ``\\n`` is a newline)
          ``<bos>\\n{noise0}\\n<sep1>\\n{first}\\n<sep2>\\n{noise1}\\n``
          ``<sep1>\\n{second}\\n<sep2>\\n{noise2}\\n<sep> <label>``
      with the letters of a block separated by single spaces, tokenized with every special string one token and
      every other character (letters, spaces, newlines) one token: 2 M + 13 tokens, 401..599 at the defaults
      min_tokens = 400, max_tokens = 600;
    - splits of 20000 / 2000 / 2000 examples, classes exactly balanced.

Choices of ours (the paper does not say how its models read the data): the example's tokens end at ``<label>``, whose
target is the class token ``CLASS_k`` (next-token prediction of the class; ``labels`` gives k for a classifier head);
the default tokenization is the script's (``whitespace=False`` drops the space and newline tokens); a batch whose
count is not a multiple of 20 is as balanced as it can be (class counts differ by at most one); sequences are padded on
the right, which never changes a causal model's output at the scored ``<label>``. The structural constants
(16 letters, 4 x 5 styles, the 3/2/1 unigram weights, the motif set and its 1/0.9/0.5 weights) are fixed: they
define the task; the script's tunable values (bigram strength, motif and flip probabilities, noise fraction,
block order, style-table seeds, token bounds) are arguments.

Measured with an exact likelihood (Bayes) classifier built from the published tables (ours): at the defaults the best
possible accuracy is about 0.82 (0.81 to 0.84 over samples of 1,000 to 3,000 examples, from this generator and from the
script alike), below the paper's 0.86 for Sessa, so the paper's (unstated) settings probably differed, e.g. in
the token bounds.

SymbolSoup vocabulary (``symbol_soup_vocab()``, the token strings by id; ``SYMBOL_SOUP_VOCAB_SIZE`` = 46):
    0..15 letters a..p, 16 space, 17 newline, 18 <bos>, 19 <sep1>, 20 <sep2>, 21 <sep>, 22 <label>,
    23 <eos> and 24 [MASK] (the script's, never emitted), 25..44 CLASS_0..CLASS_19 (targets only), 45 <pad>.
Joining the token strings of a row (``symbol_soup_text``) gives back the script's text exactly.

Diffuse MQAR: the paper's description only (no generator was released); everything concrete here is ours
---------------------------------------------------------------------------------------------------------
The paper's words: a variant of MQAR (Arora et al., 2024) with multi-token keys, structured distractors that share a
key's prefix but have a mismatched suffix, and explicit control of the source -> query lag; each example is a prefix
memory block of key-value pairs, then a noise block full of distractor KV-like patterns, then a terminal query block;
the test split includes retrieval lags up to 4x those seen in training; the metric is token accuracy.

Our reconstruction (every size is an argument; the defaults are ours, the paper gives none):

    memory   K_1 v_1 K_2 v_2 .. K_P v_P        P distinct keys of ``key_length`` key tokens, one uniform value each
    noise    D_1 u_1 .. D_G u_G                G ~ U{distractors} distractor keys, each a uniformly chosen memory key's
                                               first p tokens (p ~ U{1..key_length-1}), then a different token, then
                                               uniform tokens; never equal to a memory key; u_j uniform values
    query    K_q1 v_q1 .. K_qQ v_qQ            Q distinct memory keys in random order, each followed by its value

Every pattern is key_length + 1 tokens. The target at the last token of a query key is that key's value (the next
token, so the value is teacher-forced for the following queries; a causal model never sees it before predicting);
nothing else is scored. The lag of a scored position is its distance to the memory value it must recall; with memory
index a and query index b it is (key_length + 1)(P - a + b + G) - 1, and ``diffuse_mqar_lags`` gives a call's range.
The lag is controlled by G: for the paper's test split choose a wider distractor range, so that the largest lag is 4x
the training one (with the other defaults, training ``distractors=(16, 64)`` reaches 379; ``(16, 349)`` reaches 1519).

Diffuse MQAR vocabulary (``diffuse_mqar_vocab(key_vocab, value_vocab)``; size key_vocab + value_vocab + 1):
    0..key_vocab-1 key tokens, key_vocab..key_vocab+value_vocab-1 values, key_vocab+value_vocab <pad>.

Every generator returns a NamedTuple whose first two fields are ``tokens`` (count, T) and ``targets`` (count, T),
LongTensors with IGNORE (-100) where nothing is scored, and is deterministic for a given ``seed``.
"""

from __future__ import annotations

import bisect
import math
import random
from functools import lru_cache
from numbers import Integral, Real
from typing import NamedTuple

import torch

from .checks import IGNORE, check_int, check_probability


# ---------------------------------------------------------------------------------------------------------------------
# SymbolSoup
# ---------------------------------------------------------------------------------------------------------------------

LETTERS = "abcdefghijklmnop"
N_LETTERS = len(LETTERS)
N_LEFT_STYLES, N_RIGHT_STYLES = 4, 5
N_CLASSES = N_LEFT_STYLES * N_RIGHT_STYLES
UNIGRAM_WEIGHTS = (3.0, 2.0, 1.0)  # primaries, secondaries, others
MOTIF_LENGTHS = (3, 4, 5)
MOTIF_BASE, MOTIF_PRIMARY, MOTIF_SECONDARY = 1.0, 0.9, 0.5
# Every run of 3, 4 or 5 consecutive letters, as letter ids, in the script's order (abc .. nop, abcd .. lmnop).
MOTIFS = tuple(tuple(range(start, start + n)) for n in MOTIF_LENGTHS for start in range(N_LETTERS - n + 1))

SPACE, NEWLINE, BOS, SEP1, SEP2, SEP, LABEL, EOS, MASK = range(N_LETTERS, N_LETTERS + 9)
CLASS_OFFSET = N_LETTERS + 9  # CLASS_k is CLASS_OFFSET + k
SOUP_PAD = CLASS_OFFSET + N_CLASSES
SYMBOL_SOUP_VOCAB_SIZE = SOUP_PAD + 1
_SPECIAL_STRINGS = (" ", "\n", "<bos>", "<sep1>", "<sep2>", "<sep>", "<label>", "<eos>", "[MASK]")


def symbol_soup_vocab() -> tuple:
    """The SymbolSoup token strings by id (46): letters, space, newline, the script's 7 specials, 20 classes, pad."""
    return tuple(LETTERS) + _SPECIAL_STRINGS + tuple(f"CLASS_{k}" for k in range(N_CLASSES)) + ("<pad>",)


def symbol_soup_text(row) -> str:
    """One (T,) row of ``symbol_soup`` tokens back to the script's text (padding dropped)."""
    vocab = symbol_soup_vocab()
    return "".join(vocab[token] for token in row.tolist() if token != SOUP_PAD)


class Style(NamedTuple):
    """One style's letters: 4 primaries, 4 secondaries, 8 others (each in the order of the script's shuffle)."""

    primaries: str
    secondaries: str
    others: str


@lru_cache(maxsize=8)
def symbol_soup_styles(style_seeds: tuple = (123, 456)) -> tuple:
    """(left styles (4), right styles (5)) as the script builds them: one ``random.Random(seed)`` per family
    shuffles a copy of the letters once per style, in turn. They do not depend on an example's seed."""

    def family(count: int, table_seed: int) -> tuple:
        rng = random.Random(table_seed)
        styles = []
        for _ in range(count):
            letters = list(LETTERS)
            rng.shuffle(letters)
            styles.append(Style("".join(letters[:4]), "".join(letters[4:8]), "".join(letters[8:])))
        return tuple(styles)

    return family(N_LEFT_STYLES, style_seeds[0]), family(N_RIGHT_STYLES, style_seeds[1])


def preferred_bigrams(style: Style) -> frozenset:
    """The style's 20 preferred (previous, next) letter-id pairs."""
    p = [LETTERS.index(c) for c in style.primaries]
    s = [LETTERS.index(c) for c in style.secondaries]
    pairs = {(p[i], p[(i + 1) % 4]) for i in range(4)} | {(x, x) for x in p + s}
    return frozenset(pairs | {(a, b) for a, b in zip(p, s)} | {(b, a) for a, b in zip(p, s)})


class _Sampler(NamedTuple):
    """Cumulative weight lists of one style (sampled by one uniform and a 'first cum >= r' scan, as the script)."""

    unigram: list  # (16,) cumulative unigram weights
    markov: list  # (16, 16) row prev: cumulative unigram(x) (1 + strength [(prev, x) preferred])
    motifs: dict  # longest allowed motif length (3, 4, 5) -> (cumulative weights, motif indices)


@lru_cache(maxsize=64)
def _sampler(style: Style, bigram_strength: float) -> _Sampler:
    unigram = [0.0] * N_LETTERS
    for weight, letters in zip(UNIGRAM_WEIGHTS, style):
        for c in letters:
            unigram[LETTERS.index(c)] = weight
    bigrams = preferred_bigrams(style)
    markov = [_cumsum([unigram[x] * (1.0 + bigram_strength * ((prev, x) in bigrams)) for x in range(N_LETTERS)])
              for prev in range(N_LETTERS)]
    primary = {LETTERS.index(c) for c in style.primaries}
    secondary = {LETTERS.index(c) for c in style.secondaries}
    weights = [MOTIF_BASE + MOTIF_PRIMARY * len(set(m) & primary) + MOTIF_SECONDARY * len(set(m) & secondary)
               for m in MOTIFS]
    motifs = {}
    for longest in MOTIF_LENGTHS:
        allowed = [i for i, m in enumerate(MOTIFS) if len(m) <= longest]
        motifs[longest] = (_cumsum([weights[i] for i in allowed]), allowed)
    return _Sampler(_cumsum(unigram), markov, motifs)


def _cumsum(weights: list) -> list:
    out, total = [], 0.0
    for w in weights:
        total += w
        out.append(total)
    return out


def _draw(cumulative: list, uniform: float) -> int:
    """Index of the first cumulative weight >= uniform x total (the script's ``r <= cum`` scan)."""
    return min(bisect.bisect_left(cumulative, uniform * cumulative[-1]), len(cumulative) - 1)


def _stylized_block(length: int, sampler: _Sampler, motif_insert_prob: float, noise_flip_prob: float,
                    generator: torch.Generator) -> list:
    """``length`` letter ids of one style: motifs and Markov letters, then the per-letter flip noise."""
    decide = torch.rand(length, generator=generator).tolist()  # one decision and one pick per step (<= length steps)
    pick = torch.rand(length, generator=generator).tolist()
    letters, step = [], 0
    while len(letters) < length:
        remaining = length - len(letters)
        if remaining >= MOTIF_LENGTHS[0] and decide[step] < motif_insert_prob:
            cumulative, allowed = sampler.motifs[min(remaining, MOTIF_LENGTHS[-1])]
            letters.extend(MOTIFS[allowed[_draw(cumulative, pick[step])]])
        else:
            cumulative = sampler.markov[letters[-1]] if letters else sampler.unigram
            letters.append(_draw(cumulative, pick[step]))
        step += 1
    flip = (torch.rand(length, generator=generator) < noise_flip_prob).tolist()
    shift = torch.randint(1, N_LETTERS, (length,), generator=generator).tolist()  # uniform over the other 15
    return [(x + s) % N_LETTERS if f else x for x, f, s in zip(letters, flip, shift)]


def _layout(sections: list, whitespace: bool) -> list:
    """The script's text as token ids: sections = [noise0, first, noise1, second, noise2] (letter-id lists)."""
    if not whitespace:
        noise0, first, noise1, second, noise2 = sections
        return [BOS, *noise0, SEP1, *first, SEP2, *noise1, SEP1, *second, SEP2, *noise2, SEP, LABEL]

    def spaced(block):  # "a b c": letters separated by single spaces
        out = []
        for x in block:
            out += [x, SPACE]
        return out[:-1]

    noise0, first, noise1, second, noise2 = map(spaced, sections)
    return [BOS, NEWLINE, *noise0, NEWLINE, SEP1, NEWLINE, *first, NEWLINE, SEP2, NEWLINE, *noise1, NEWLINE, SEP1,
            NEWLINE, *second, NEWLINE, SEP2, NEWLINE, *noise2, NEWLINE, SEP, SPACE, LABEL]


def symbol_soup_letter_bounds(min_tokens: int = 400, max_tokens: int = 600) -> tuple:
    """(M_min, M_max): the range of an example's letter count M; its script token count is 2 M + 13."""
    check_int("min_tokens", min_tokens, 0, "symbol_soup")
    check_int("max_tokens", max_tokens, 23, "symbol_soup", "the shortest example (M = 5 letters) has 23 tokens")
    low, high = max(5, math.ceil((min_tokens - 13) / 2)), max(5, (max_tokens - 13) // 2)
    if low > high:
        raise ValueError(f"symbol_soup: no example length 2 M + 13 lies in [min_tokens, max_tokens] = "
                         f"[{min_tokens}, {max_tokens}]; widen the range")
    return low, high


class SymbolSoupBatch(NamedTuple):
    tokens: torch.Tensor  # (count, T) token ids, right-padded with SOUP_PAD
    targets: torch.Tensor  # (count, T) CLASS_OFFSET + k at the <label> position, IGNORE elsewhere
    labels: torch.Tensor  # (count,) class k = 5 l + r in 0..19
    lengths: torch.Tensor  # (count,) unpadded lengths; the <label> sits at lengths - 1


def symbol_soup(count: int, min_tokens: int = 400, max_tokens: int = 600, bigram_strength: float = 3.0,
                motif_insert_prob: float = 0.3, noise_flip_prob: float = 0.03, noise_fraction: tuple = (0.3, 0.6),
                left_first_prob: float = 0.5, style_seeds: tuple = (123, 456), whitespace: bool = True,
                seed: int = 0) -> SymbolSoupBatch:
    """``count`` SymbolSoup examples (the authors' generator; see the module docstring), classes balanced to within
    one. T = max_tokens with ``whitespace`` (the script's tokenization), else M_max + 7; ``min_tokens`` and
    ``max_tokens`` bound the script's token count 2 M + 13 in both cases."""
    fn = "symbol_soup"
    check_int("count", count, 1, fn)
    m_min, m_max = symbol_soup_letter_bounds(min_tokens, max_tokens)
    if not isinstance(bigram_strength, Real) or not bigram_strength > -1:
        raise ValueError(f"{fn}: bigram_strength must be a number > -1 (weights stay positive), "
                         f"got {bigram_strength!r}")
    for name, value in (("motif_insert_prob", motif_insert_prob), ("noise_flip_prob", noise_flip_prob),
                        ("left_first_prob", left_first_prob)):
        check_probability(name, value, fn)
    if (not isinstance(noise_fraction, (tuple, list)) or len(noise_fraction) != 2
            or not all(isinstance(f, Real) for f in noise_fraction)
            or not 0 <= noise_fraction[0] <= noise_fraction[1] <= 1):
        raise ValueError(f"{fn}: noise_fraction must be (low, high) with 0 <= low <= high <= 1, got {noise_fraction!r}")
    if (not isinstance(style_seeds, (tuple, list)) or len(style_seeds) != 2
            or not all(isinstance(s, Integral) for s in style_seeds)):
        raise ValueError(f"{fn}: style_seeds must be two integers (left, right), got {style_seeds!r}")
    left_styles, right_styles = symbol_soup_styles(tuple(int(s) for s in style_seeds))
    left_samplers = [_sampler(style, float(bigram_strength)) for style in left_styles]
    right_samplers = [_sampler(style, float(bigram_strength)) for style in right_styles]

    generator = torch.Generator().manual_seed(seed)
    labels = (torch.arange(count) % N_CLASSES)[torch.randperm(count, generator=generator)]  # (count,)
    length = max_tokens if whitespace else m_max + 7
    tokens = torch.full((count, length), SOUP_PAD, dtype=torch.long)  # (count, T)
    targets = torch.full((count, length), IGNORE, dtype=torch.long)  # (count, T)
    lengths = torch.empty(count, dtype=torch.long)  # (count,)

    def uniform_int(low: int, high: int) -> int:  # inclusive, like random.randint
        return int(torch.randint(low, high + 1, (), generator=generator))

    for row, k in enumerate(labels.tolist()):
        left, right = divmod(k, N_RIGHT_STYLES)
        letters = uniform_int(m_min, m_max)  # M
        noise_low = max(3, int(noise_fraction[0] * letters))
        noise = uniform_int(noise_low, max(noise_low, int(noise_fraction[1] * letters)))
        noise = max(3, min(noise, letters - 2))  # N in [3, M - 2], so the main letters m = M - N >= 2
        main = letters - noise
        left_length = uniform_int(1, main - 1)
        noise0 = uniform_int(1, noise - 2)
        noise1 = uniform_int(1, noise - noise0 - 1)
        noise2 = noise - noise0 - noise1
        left_block = _stylized_block(left_length, left_samplers[left], motif_insert_prob, noise_flip_prob, generator)
        right_block = _stylized_block(main - left_length, right_samplers[right], motif_insert_prob, noise_flip_prob,
                                      generator)
        first, second = ((left_block, right_block) if float(torch.rand((), generator=generator)) < left_first_prob
                         else (right_block, left_block))
        noise_blocks = [torch.randint(N_LETTERS, (n,), generator=generator).tolist() for n in (noise0, noise1, noise2)]
        ids = _layout([noise_blocks[0], first, noise_blocks[1], second, noise_blocks[2]], whitespace)
        tokens[row, :len(ids)] = torch.tensor(ids)
        targets[row, len(ids) - 1] = CLASS_OFFSET + k
        lengths[row] = len(ids)
    return SymbolSoupBatch(tokens, targets, labels, lengths)


# ---------------------------------------------------------------------------------------------------------------------
# Diffuse MQAR (reconstruction)
# ---------------------------------------------------------------------------------------------------------------------


class DiffuseMQARVocab(NamedTuple):
    """Token ids of Diffuse MQAR for ``key_vocab`` key tokens and ``value_vocab`` values."""

    size: int  # key_vocab + value_vocab + 1
    keys: range  # 0 .. key_vocab - 1
    values: range  # key_vocab .. key_vocab + value_vocab - 1
    pad: int  # key_vocab + value_vocab


def diffuse_mqar_vocab(key_vocab: int = 32, value_vocab: int = 64) -> DiffuseMQARVocab:
    """The id layout (see the module docstring)."""
    check_int("key_vocab", key_vocab, 2, "diffuse_mqar")
    check_int("value_vocab", value_vocab, 1, "diffuse_mqar")
    return DiffuseMQARVocab(key_vocab + value_vocab + 1, range(key_vocab), range(key_vocab, key_vocab + value_vocab),
                            key_vocab + value_vocab)


def _distractor_range(distractors) -> tuple:
    if isinstance(distractors, Integral) and not isinstance(distractors, bool):
        distractors = (distractors, distractors)
    if (not isinstance(distractors, (tuple, list)) or len(distractors) != 2
            or not all(isinstance(d, Integral) and not isinstance(d, bool) for d in distractors)
            or not 0 <= distractors[0] <= distractors[1]):
        raise ValueError(f"diffuse_mqar: distractors must be a count >= 0 or a range (low, high) with "
                         f"0 <= low <= high, got {distractors!r}")
    return int(distractors[0]), int(distractors[1])


def diffuse_mqar_lags(pairs: int = 16, key_length: int = 3, distractors=(16, 64), queries: int | None = None) -> tuple:
    """(smallest, largest) lag a call with these arguments can produce (see the module docstring)."""
    low, high = _distractor_range(distractors)
    queries = pairs if queries is None else queries
    return (key_length + 1) * (1 + low) - 1, (key_length + 1) * (pairs + queries - 1 + high) - 1


class DiffuseMQARBatch(NamedTuple):
    tokens: torch.Tensor  # (count, T) token ids, right-padded with the pad id
    targets: torch.Tensor  # (count, T) the value at the last token of each query key, IGNORE elsewhere
    lags: torch.Tensor  # (count, T) scored position - position of its memory value; 0 where nothing is scored
    lengths: torch.Tensor  # (count,) unpadded lengths, (key_length + 1)(pairs + G + queries)


def diffuse_mqar(count: int, pairs: int = 16, key_length: int = 3, key_vocab: int = 32, value_vocab: int = 64,
                 distractors=(16, 64), queries: int | None = None, seed: int = 0) -> DiffuseMQARBatch:
    """``count`` Diffuse MQAR examples (our reconstruction; see the module docstring). ``distractors``: the number G
    of distractor patterns, an int or an inclusive range drawn per example; ``queries``: Q (default ``pairs``).
    T = (key_length + 1)(pairs + max G + Q)."""
    fn = "diffuse_mqar"
    check_int("count", count, 1, fn)
    check_int("key_length", key_length, 2, fn, "keys are multi-token and distractors share a proper prefix")
    vocab = diffuse_mqar_vocab(key_vocab, value_vocab)
    check_int("pairs", pairs, 1, fn)
    if pairs >= key_vocab ** (key_length - 1):
        raise ValueError(f"{fn}: pairs {pairs} must be below key_vocab ** (key_length - 1) = "
                         f"{key_vocab ** (key_length - 1)}, so that every memory leaves room for distractors")
    queries = pairs if queries is None else queries
    check_int("queries", queries, 1, fn)
    if queries > pairs:
        raise ValueError(f"{fn}: queries {queries} must be at most pairs ({pairs}): each key is queried once")
    low, high = _distractor_range(distractors)

    generator = torch.Generator().manual_seed(seed)
    width = key_length + 1  # tokens per pattern
    length = width * (pairs + high + queries)
    tokens = torch.full((count, length), vocab.pad, dtype=torch.long)  # (count, T)
    targets = torch.full((count, length), IGNORE, dtype=torch.long)  # (count, T)
    lags = torch.zeros((count, length), dtype=torch.long)  # (count, T)
    lengths = torch.empty(count, dtype=torch.long)  # (count,)
    for row in range(count):
        keys = _distinct_keys(pairs, key_length, key_vocab, generator)  # (P, key_length)
        values = torch.randint(key_vocab, key_vocab + value_vocab, (pairs,), generator=generator)  # (P,)
        gap = int(torch.randint(low, high + 1, (), generator=generator))  # G
        fake = _distractor_keys(keys, gap, key_vocab, generator)  # (G, key_length)
        fake_values = torch.randint(key_vocab, key_vocab + value_vocab, (gap,), generator=generator)  # (G,)
        asked = torch.randperm(pairs, generator=generator)[:queries]  # (Q,) memory index of each query
        sequence = torch.cat([torch.cat([keys, values[:, None]], 1).flatten(),  # memory, P * width
                              torch.cat([fake, fake_values[:, None]], 1).flatten(),  # noise, G * width
                              torch.cat([keys[asked], values[asked, None]], 1).flatten()])  # query, Q * width
        n = sequence.numel()
        tokens[row, :n] = sequence
        scored = width * (pairs + gap) + width * torch.arange(queries) + key_length - 1  # (Q,) last query-key tokens
        targets[row, scored] = values[asked]
        lags[row, scored] = scored - (width * asked + key_length)  # minus each memory value's position
        lengths[row] = n
    return DiffuseMQARBatch(tokens, targets, lags, lengths)


def _distinct_keys(pairs: int, key_length: int, key_vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(pairs, key_length) uniform keys, redrawn until all rows differ."""
    keys, seen = [], set()
    while len(keys) < pairs:
        for key in torch.randint(key_vocab, (pairs - len(keys), key_length), generator=generator).tolist():
            if tuple(key) not in seen:
                seen.add(tuple(key))
                keys.append(key)
    return torch.tensor(keys, dtype=torch.long)


def _distractor_keys(keys: torch.Tensor, count: int, key_vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(count, key_length) keys that share a uniformly chosen memory key's first p tokens, p ~ U{1..key_length-1},
    differ from it at token p, are uniform after it, and equal no memory key (a proposal that does is redrawn)."""
    pairs, key_length = keys.shape
    real = {tuple(key) for key in keys.tolist()}
    out = []
    while len(out) < count:
        n = count - len(out)
        source = keys[torch.randint(pairs, (n,), generator=generator)]  # (n, key_length)
        prefix = torch.randint(1, key_length, (n,), generator=generator)  # (n,) shared prefix length p
        proposal = torch.randint(key_vocab, (n, key_length), generator=generator)  # (n, key_length)
        proposal = torch.where(torch.arange(key_length) < prefix[:, None], source, proposal)
        rows = torch.arange(n)
        shift = torch.randint(1, key_vocab, (n,), generator=generator)  # a different token at position p
        proposal[rows, prefix] = (source[rows, prefix] + shift) % key_vocab
        out += [key for key in proposal.tolist() if tuple(key) not in real]
    return torch.tensor(out, dtype=torch.long).reshape(count, key_length)


# ---------------------------------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------------------------------


