"""hf_mixers/tasks/sessa.py: SymbolSoup is the authors' generator; Diffuse MQAR is solvable and shaped as documented."""

import re

import numpy as np
import pytest
import torch

from hf_mixers.tasks.sessa import (
    CLASS_OFFSET, IGNORE, LABEL, NEWLINE, SEP, SEP1, SEP2, SOUP_PAD, SPACE, SYMBOL_SOUP_VOCAB_SIZE, diffuse_mqar,
    diffuse_mqar_lags, diffuse_mqar_vocab, symbol_soup, symbol_soup_styles, symbol_soup_text, symbol_soup_vocab,
)

# The official script's style tables as published (left L0..L3, then right R0..R4): primaries, secondaries, others.
SPEC_STYLES = [
    ("jdif", "chkl", "anogmpeb"), ("bjmk", "pnhg", "acdloife"), ("ngpf", "edio", "jcmabhlk"),
    ("gpck", "njao", "ldhifemb"), ("fmpe", "ldcb", "ijakngho"), ("lfpo", "akjh", "igmdnceb"),
    ("kbje", "gaip", "lhocmfdn"), ("opfm", "edbk", "anjilhgc"), ("lnag", "obhf", "cikjedmp"),
]
SPECIALS = ["<label>", "[MASK]", "<sep1>", "<sep2>", "<bos>", "<eos>", "<sep>"]  # the script's, longest first
TEXT = re.compile(r"<bos>\n(L)\n<sep1>\n(L)\n<sep2>\n(L)\n<sep1>\n(L)\n<sep2>\n(L)\n<sep> <label>".replace(
    "L", "[a-p](?: [a-p])*"))


def script_tokens(text):
    """The script's tokenizer: a special string is one token, every other character is one token."""
    out, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), text[i])
        out.append(special)
        i += len(special)
    return out


def sections(row):
    """A SymbolSoup row -> its five letter blocks [noise0, first, noise1, second, noise2] (letter ids)."""
    blocks, current = [], []
    for token in row:
        if token < 16:
            current.append(token)
        elif token in (SEP1, SEP2, SEP):
            blocks.append(current)
            current = []
    return blocks


# --- an exact Bayes classifier for SymbolSoup, built from the published tables and the script's algorithm ---------

def style_models(bigram_strength=3.0):
    """Per style (9): log start (16,), log transition (16, 16), log motif weight by length {n: (17 - n,)}."""
    ids = lambda s: [ord(c) - ord("a") for c in s]  # noqa: E731
    start, trans, motif = [], [], {3: [], 4: [], 5: []}
    for p, s, o in SPEC_STYLES:
        p, s, o = ids(p), ids(s), ids(o)
        unigram = np.zeros(16)
        unigram[p], unigram[s], unigram[o] = 3, 2, 1
        preferred = np.zeros((16, 16))
        for i in range(4):
            for a, b in ((p[i], p[(i + 1) % 4]), (p[i], p[i]), (s[i], s[i]), (p[i], s[i]), (s[i], p[i])):
                preferred[a, b] = 1
        weights = unigram[None] * (1 + bigram_strength * preferred)
        start.append(np.log(unigram / unigram.sum()))
        trans.append(np.log(weights / weights.sum(1, keepdims=True)))
        for n in motif:  # the motif of length n starting at letter a
            motif[n].append([1 + 0.9 * len(set(range(a, a + n)) & set(p)) + 0.5 * len(set(range(a, a + n)) & set(s))
                             for a in range(17 - n)])
    motif = {n: np.array(w) for n, w in motif.items()}  # (9, 17 - n)
    total = {cap: np.log(sum(motif[n].sum(1) for n in motif if n <= cap)) for cap in motif}  # (9,)
    return np.stack(start), np.stack(trans), {n: np.log(w) for n, w in motif.items()}, total


def block_loglik(obs, models, motif_prob=0.3, flip_prob=0.03):
    """log P(block | style) for the 9 styles: a forward pass over every motif / Markov segmentation and every flip."""
    start, trans, log_motif, total = models
    n_obs = len(obs)
    with np.errstate(divide="ignore"):
        emit = np.where(np.array(obs)[:, None] == np.arange(16), np.log1p(-flip_prob), np.log(flip_prob / 15))
        log_markov, log_motif_prob = np.log1p(-motif_prob), np.log(motif_prob)
    run = {n: sum(emit[t:t + n_obs - n + 1, t:t + 17 - n] for t in range(n)) for n in (3, 4, 5) if n <= n_obs}
    alpha = np.full((n_obs + 1, 9, 16), -np.inf)  # alpha[j, style, last letter]: the first j letters made
    for j in range(n_obs):
        remaining = n_obs - j
        step = start if j == 0 else np.logaddexp.reduce(alpha[j][:, :, None] + trans, axis=1)
        alpha[j + 1] = np.logaddexp(alpha[j + 1], step + emit[j] + (log_markov if remaining >= 3 else 0.0))
        if remaining >= 3:
            mass = np.zeros(9) if j == 0 else np.logaddexp.reduce(alpha[j], axis=1)
            for n in (3, 4, 5):
                if n <= remaining:
                    lp = (mass - total[min(remaining, 5)])[:, None] + log_motif_prob + log_motif[n] + run[n][j]
                    alpha[j + n, :, n - 1:] = np.logaddexp(alpha[j + n, :, n - 1:], lp)
    return np.logaddexp.reduce(alpha[n_obs], axis=1)


def bayes_class(row, models, **noise):
    """The most likely class k = 5 l + r, summing over which block (left or right style) came first."""
    _, first, _, second, _ = sections(row)
    a, b = block_loglik(first, models, **noise), block_loglik(second, models, **noise)
    scores = [np.logaddexp(a[k // 5] + b[4 + k % 5], a[4 + k % 5] + b[k // 5]) for k in range(20)]
    return int(np.argmax(scores)), min(len(first), len(second))


# --- SymbolSoup -----------------------------------------------------------------------------------------------------

def test_generators_are_deterministic_in_the_seed():
    for make in (lambda seed: symbol_soup(4, seed=seed), lambda seed: diffuse_mqar(4, seed=seed)):
        a, b, c = make(3), make(3), make(4)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert not torch.equal(a.tokens, c.tokens)


def test_symbol_soup_style_tables_are_the_scripts():
    left, right = symbol_soup_styles()
    assert [tuple(style) for style in left + right] == SPEC_STYLES


def test_symbol_soup_rows_are_the_scripts_text_with_its_counts_and_ranges():
    count = 60
    batch = symbol_soup(count, seed=1)
    vocab = symbol_soup_vocab()
    assert len(vocab) == SYMBOL_SOUP_VOCAB_SIZE == 46 and batch.tokens.shape == (count, 600)
    assert batch.tokens.min() >= 0 and batch.tokens.max() < SYMBOL_SOUP_VOCAB_SIZE
    assert (torch.bincount(batch.labels, minlength=20) == 3).all()  # exactly balanced
    noise_letters = []
    for row in range(count):
        n = int(batch.lengths[row])
        ids = batch.tokens[row].tolist()
        assert SOUP_PAD not in ids[:n] and all(t == SOUP_PAD for t in ids[n:])
        text = symbol_soup_text(batch.tokens[row])
        assert TEXT.fullmatch(text), text[:80]
        assert [vocab.index(t) for t in script_tokens(text)] == ids[:n]  # the script's tokenization, id for id
        blocks = sections(ids)
        letters, noise = sum(map(len, blocks)), len(blocks[0]) + len(blocks[2]) + len(blocks[4])
        assert n == 2 * letters + 13 and 400 <= n <= 600 and 194 <= letters <= 293
        low = max(3, int(0.3 * letters))
        assert max(3, min(low, letters - 2)) <= noise <= min(max(low, int(0.6 * letters)), letters - 2)
        assert all(len(block) >= 1 for block in blocks)
        # only the <label> (the last token) is scored, with the class token
        scored = (batch.targets[row] != IGNORE).nonzero().flatten().tolist()
        assert scored == [n - 1] and ids[n - 1] == LABEL
        assert batch.targets[row, n - 1] == CLASS_OFFSET + batch.labels[row]
        noise_letters += blocks[0] + blocks[2] + blocks[4]
    # the noise blocks are i.i.d. uniform letters (~13,000 of them here: 6 standard errors is about 0.013)
    frequency = np.bincount(noise_letters, minlength=16) / len(noise_letters)
    assert np.abs(frequency - 1 / 16).max() < 0.013
    # without whitespace: the same draws, the spaces and newlines dropped
    compact = symbol_soup(count, whitespace=False, seed=1)
    assert compact.tokens.shape == (count, 293 + 7) and torch.equal(compact.labels, batch.labels)
    for row in range(count):
        spaced = [t for t in batch.tokens[row].tolist() if t not in (SPACE, NEWLINE, SOUP_PAD)]
        assert compact.tokens[row, :len(spaced)].tolist() == spaced and compact.lengths[row] == len(spaced)
        assert compact.targets[row, len(spaced) - 1] == CLASS_OFFSET + batch.labels[row]


def test_symbol_soup_markov_steps_follow_the_preferred_bigrams_and_motifs_are_letter_runs():
    # Markov letters only, no flips, bigram strength 1e9: from a letter with preferred successors (under the class's
    # style for that block), every step takes one of them; left_first_prob decides which style's block comes first
    for left_first_prob in (1.0, 0.0):
        batch = symbol_soup(20, motif_insert_prob=0.0, noise_flip_prob=0.0, bigram_strength=1e9,
                            left_first_prob=left_first_prob, seed=2)
        for row in range(20):
            _, first, _, second, _ = sections(batch.tokens[row].tolist())
            left, right = divmod(int(batch.labels[row]), 5)
            styles = (left, 4 + right) if left_first_prob else (4 + right, left)
            assert follows(first, styles[0]) and follows(second, styles[1]), row
    # motifs always (while >= 3 letters remain), no flips: a block is runs of 3..5 consecutive letters + < 3 letters
    batch = symbol_soup(40, motif_insert_prob=1.0, noise_flip_prob=0.0, seed=3)
    for row in range(40):
        blocks = sections(batch.tokens[row].tolist())
        for block in (blocks[1], blocks[3]):
            assert runs_then_tail(block), (row, block)


def test_symbol_soup_flips_touch_only_the_stylized_letters_at_their_rate():
    # the same seed draws the same letters whatever the flip probability; flips change stylized letters only
    clean, flipped = symbol_soup(30, noise_flip_prob=0.0, seed=9), symbol_soup(30, noise_flip_prob=0.3, seed=9)
    assert torch.equal(clean.lengths, flipped.lengths) and torch.equal(clean.labels, flipped.labels)
    changed = total = 0
    for row in range(30):
        a, b = sections(clean.tokens[row].tolist()), sections(flipped.tokens[row].tolist())
        assert [a[i] for i in (0, 2, 4)] == [b[i] for i in (0, 2, 4)]
        for i in (1, 3):
            changed += sum(x != y for x, y in zip(a[i], b[i]))
            total += len(a[i])
    assert abs(changed / total - 0.3) < 0.04  # ~4,000 letters: 0.04 is about 5 standard errors
    # the noise total follows noise_fraction: here exactly int(0.5 M)
    for row in symbol_soup(10, noise_fraction=(0.5, 0.5), seed=10).tokens.tolist():
        blocks = sections(row)
        assert len(blocks[0]) + len(blocks[2]) + len(blocks[4]) == int(0.5 * sum(map(len, blocks)))


def follows(block, style):
    successors = preferred_successors(style)
    return all(b in successors.get(a, [b]) for a, b in zip(block, block[1:]))


def preferred_successors(style):
    p, s, _ = ([ord(c) - ord("a") for c in part] for part in SPEC_STYLES[style])
    out = {}
    for i in range(4):
        for a, b in ((p[i], p[(i + 1) % 4]), (p[i], p[i]), (s[i], s[i]), (p[i], s[i]), (s[i], p[i])):
            out.setdefault(a, []).append(b)
    return out


def runs_then_tail(block):
    """Whether ``block`` splits into runs of 3..5 consecutive letters followed by at most 2 other letters."""
    if len(block) < 3:
        return True
    return any(len(block) >= n and all(block[i + 1] == block[i] + 1 for i in range(n - 1))
               and runs_then_tail(block[n:]) for n in (3, 4, 5))


def test_symbol_soup_labels_are_what_an_exact_bayes_classifier_from_the_published_tables_reads():
    # With no flips, no motifs and near-deterministic bigrams, every example with two blocks of >= 8 letters is
    # identifiable: the classifier must recover each such label.
    sharp = symbol_soup(40, min_tokens=200, max_tokens=300, motif_insert_prob=0.0, noise_flip_prob=0.0,
                        bigram_strength=1e6, seed=4)
    models = style_models(bigram_strength=1e6)
    checked = 0
    for row in range(40):
        guess, shortest = bayes_class(sharp.tokens[row].tolist(), models, motif_prob=0.0, flip_prob=0.0)
        if shortest >= 8:
            assert guess == sharp.labels[row] and sharp.targets[row, sharp.lengths[row] - 1] == CLASS_OFFSET + guess
            checked += 1
    assert checked >= 25
    # At the paper's settings the task is noisy (a block can be one letter): the Bayes-optimal accuracy is about 0.82
    # (chance 0.05); a generator with other distributions or tables would fall far below it.
    batch = symbol_soup(40, seed=5)
    models = style_models()
    right = sum(bayes_class(batch.tokens[row].tolist(), models)[0] == batch.labels[row] for row in range(40))
    assert right >= 28


def test_symbol_soup_rejects_bad_arguments():
    for kwargs, name in [(dict(count=0), "count"), (dict(max_tokens=20), "max_tokens"),
                         (dict(min_tokens=500, max_tokens=400), r"min_tokens, max_tokens"),
                         (dict(min_tokens=400, max_tokens=400), r"min_tokens, max_tokens"),
                         (dict(noise_flip_prob=1.5), "noise_flip_prob"),
                         (dict(motif_insert_prob=-0.1), "motif_insert_prob"),
                         (dict(left_first_prob=2), "left_first_prob"), (dict(bigram_strength=-1), "bigram_strength"),
                         (dict(noise_fraction=(0.6, 0.3)), "noise_fraction"), (dict(style_seeds=(1,)), "style_seeds")]:
        with pytest.raises(ValueError, match=name):
            symbol_soup(**{"count": 2, **kwargs})


# --- Diffuse MQAR ---------------------------------------------------------------------------------------------------

def test_diffuse_mqar_every_target_is_the_value_after_the_one_earlier_occurrence_of_the_query_key():
    k, pairs = 3, 8
    batch = diffuse_mqar(16, pairs=pairs, key_length=k, key_vocab=6, value_vocab=10, distractors=(0, 12), seed=6)
    vocab = diffuse_mqar_vocab(6, 10)
    for row in range(16):
        x = batch.tokens[row].tolist()
        scored = (batch.targets[row] != IGNORE).nonzero().flatten().tolist()
        assert len(scored) == pairs
        for t in scored:
            prefix = x[:t + 1]  # a causal solver: the query key ends at t
            key = prefix[t - k + 1:]
            found = [s + k for s in range(t - 2 * k + 1) if prefix[s:s + k] == key and prefix[s + k] in vocab.values]
            assert len(found) == 1, (row, t, found)
            assert batch.targets[row, t] == x[found[0]] and batch.lags[row, t] == t - found[0]
            assert found[0] < (k + 1) * pairs  # the one occurrence is in the memory block
    assert (batch.lags[batch.targets == IGNORE] == 0).all()


def test_diffuse_mqar_blocks_distractors_lags_and_vocabulary():
    k, pairs, queries, kv, vv, low, high = 4, 6, 5, 5, 7, 2, 9
    batch = diffuse_mqar(64, pairs=pairs, key_length=k, key_vocab=kv, value_vocab=vv, distractors=(low, high),
                         queries=queries, seed=7)
    vocab = diffuse_mqar_vocab(kv, vv)
    w = k + 1
    assert vocab.size == kv + vv + 1 and vocab.pad == kv + vv
    assert batch.tokens.shape == (64, w * (pairs + high + queries))
    assert batch.tokens.min() >= 0 and batch.tokens.max() < vocab.size
    smallest, largest = diffuse_mqar_lags(pairs, k, (low, high), queries)
    gaps, prefixes = set(), set()
    for row in range(64):
        n = int(batch.lengths[row])
        x = batch.tokens[row].tolist()
        assert all(t == vocab.pad for t in x[n:]) and vocab.pad not in x[:n] and n % w == 0
        patterns = [x[i:i + w] for i in range(0, n, w)]  # every block is made of (key, value) patterns
        assert all(all(t in vocab.keys for t in p[:k]) and p[k] in vocab.values for p in patterns)
        gap = len(patterns) - pairs - queries
        gaps.add(gap)
        memory, noise, query = patterns[:pairs], patterns[pairs:pairs + gap], patterns[pairs + gap:]
        keys = [tuple(p[:k]) for p in memory]
        value_of = {tuple(p[:k]): p[k] for p in memory}
        assert len(set(keys)) == pairs
        for p in noise:  # shares a proper prefix with some memory key, then differs; never a memory key
            shared = max(next(i for i in range(k + 1) if i == k or p[i] != key[i]) for key in keys)
            assert 1 <= shared <= k - 1
            prefixes.add(shared)
        asked = [tuple(p[:k]) for p in query]
        assert len(set(asked)) == queries and set(asked) <= set(keys)
        assert all(p[k] == value_of[key] for p, key in zip(query, asked))  # the query block shows each value after
        scored = (batch.targets[row] != IGNORE).nonzero().flatten().tolist()
        expected = [w * (pairs + gap + b) + k - 1 for b in range(queries)]
        assert scored == expected and batch.targets[row, scored].tolist() == [value_of[key] for key in asked]
        for t, key in zip(scored, asked):
            a = keys.index(key)
            assert batch.lags[row, t] == t - (w * a + k) and smallest <= batch.lags[row, t] <= largest
    assert gaps == set(range(low, high + 1)) and prefixes == set(range(1, k))
    fixed = diffuse_mqar(3, pairs=pairs, key_length=k, key_vocab=kv, value_vocab=vv, distractors=4, seed=8)
    assert (fixed.lengths == w * (2 * pairs + 4)).all() and fixed.tokens.shape[1] == w * (2 * pairs + 4)
    assert diffuse_mqar_lags() == (67, 379) and diffuse_mqar_lags(distractors=(16, 349))[1] >= 4 * 379


def test_diffuse_mqar_rejects_bad_arguments():
    for kwargs, name in [(dict(count=0), "count"), (dict(key_length=1), "key_length"), (dict(key_vocab=1), "key_vocab"),
                         (dict(value_vocab=0), "value_vocab"), (dict(pairs=0), "pairs"),
                         (dict(pairs=16, key_vocab=4, key_length=3), "pairs"), (dict(queries=17), "queries"),
                         (dict(queries=0), "queries"), (dict(distractors=(5, 2)), "distractors"),
                         (dict(distractors=-1), "distractors"), (dict(distractors=(1, 2, 3)), "distractors")]:
        with pytest.raises(ValueError, match=name):
            diffuse_mqar(**{"count": 2, **kwargs})


def test_diffuse_mqar_default_size():
    batch = diffuse_mqar(8)
    assert batch.tokens.shape == (8, 4 * (16 + 64 + 16)) and ((batch.targets != IGNORE).sum(1) == 16).all()
    assert diffuse_mqar_vocab().size == 97 and batch.tokens.max() < 97
    gaps = batch.lengths // 4 - 32
    assert (batch.lengths % 4 == 0).all() and (gaps >= 16).all() and (gaps <= 64).all()
