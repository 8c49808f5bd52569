"""Passkey retrieval (the RSA paper's Table 4), as a seeded generator of token sequences for tiny models.

What the paper states: models fine-tuned at 8K tokens are asked for a passkey hidden in a long context of 1K to 32K
tokens; the score is the fraction of prompts whose key is retrieved (0.0-1.0). The paper gives no prompt, key
format, number of trials or depth. The usual passkey prompt, which we assume it used (Mohtashami & Jaggi 2023,
"Landmark Attention"), hides "The pass key is 71432. Remember it. 71432 is the pass key." at a random depth in
repeated filler sentences ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back
again."), ends with "What is the pass key? The pass key is" and checks the generated number (up to 5 digits).

What is our reconstruction, in tokens instead of text:
    [filler ... KEY d_1 .. d_n filler ... QUERY d_1 .. d_n]
    - the key: n = ``digits`` digits (default 5), each uniform over 0-9 (repeats allowed);
    - the filler: iid uniform over ``filler`` ids (not a repeated sentence), so every filler token is fresh noise for
      the memory;
    - the key block ``KEY d_1 .. d_n`` starts at a uniform position of the context before the query (or at the
      fraction ``depth`` of it), the query block ``QUERY d_1 .. d_n`` closes the sequence;
    - targets are next-token: QUERY -> d_1, d_1 -> d_2, ..., d_{n-1} -> d_n (teacher forcing), IGNORE elsewhere,
      so n positions are scored per sequence; a passkey is retrieved when all n are right, which is exactly when
      greedy generation after QUERY produces the key.

Token ids: digits 0-9 | KEY 10 | QUERY 11 | filler 12 .. 12 + F - 1; vocabulary size 12 + F (``passkey_vocab_size``).
"""

from __future__ import annotations

import torch

from .checks import IGNORE, check_int, check_probability

DIGITS = 10  # ids 0-9 are the digits
KEY, QUERY = 10, 11  # the markers before the hidden key and before the answer
FIRST_FILLER = 12


def passkey_vocab_size(filler: int = 64) -> int:
    """Vocabulary of ``passkey``: 10 digits, the two markers, then ``filler`` filler ids."""
    return FIRST_FILLER + filler


def passkey(count: int, length: int, digits: int = 5, filler: int = 64, depth: float | None = None, seed: int = 0):
    """Passkey retrieval. Returns (tokens, targets), each (count, length) LongTensor.

    tokens: filler with ``KEY d_1 .. d_n`` at a random position (or at the fraction ``depth`` of the room before the
    query: 0 = first token, 1 = right before the query), ending in ``QUERY d_1 .. d_n``. targets: d_1 .. d_n at the
    positions of QUERY .. d_{n-1}, IGNORE elsewhere (see the module docstring for the ids)."""
    check_int("count", count, 1, "passkey")
    check_int("digits", digits, 1, "passkey")
    check_int("filler", filler, 1, "passkey")
    block = digits + 1  # a marker and the key
    check_int("length", length, 2 * block, "passkey", "the key block and the query block take 2 x (digits + 1)")
    if depth is not None:
        check_probability("depth", depth, "passkey")
    generator = torch.Generator().manual_seed(seed)
    tokens = FIRST_FILLER + torch.randint(filler, (count, length), generator=generator)  # (count, T) iid filler
    keys = torch.randint(DIGITS, (count, digits), generator=generator)  # (count, n)
    room = length - 2 * block  # the last key-block start that leaves the query block free
    if depth is None:
        starts = torch.randint(room + 1, (count,), generator=generator)  # (count,) uniform over 0 .. room
    else:
        starts = torch.full((count,), round(depth * room))
    rows = torch.arange(count)[:, None]  # (count, 1)
    key_block = starts[:, None] + torch.arange(block)  # (count, n + 1) positions of KEY d_1 .. d_n
    tokens[rows, key_block[:, :1]] = KEY
    tokens[rows, key_block[:, 1:]] = keys
    tokens[:, length - block] = QUERY
    tokens[:, length - digits:] = keys
    targets = torch.full((count, length), IGNORE)
    targets[:, length - block:length - 1] = keys  # next token: QUERY -> d_1, ..., d_{n-1} -> d_n
    return tokens, targets
