"""Text -> fixed-length token blocks (the held-out split itself is ``corpus.split_texts`` for the embedded corpora,
``dataset_sources._text_file_blocks`` for text files), and text the teacher writes itself (``data.source:
teacher:N``).

Text is a stream of pieces, paragraphs each followed by its blank line, with ``DOCUMENT_END`` where a document
ends: the pieces are tokenised a batch at a time, a document end becomes the tokenizer's EOS, and the token stream
is cut into ``sequence_length`` blocks as it comes (the usual causal-LM packing), never tokenised whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
from itertools import islice

import torch

from .token_blocks import cut_blocks

DOCUMENT_END = None  # in a stream of text pieces: the document ends here (the tokenizer's EOS follows it)
TOKENISE_BATCH = 256  # pieces per tokenizer call (a fast tokenizer works through a batch in parallel)


def paragraphs(text: str):
    """The pieces of one text: each paragraph (split at blank lines) with its blank line; blank ones left out."""
    return (paragraph + "\n\n" for paragraph in text.split("\n\n") if paragraph.strip())


def tokenised(tokenizer, pieces, what: str = "text", characters: int | None = None, progress: bool = True):
    """Token ids of each piece (no special tokens), ``TOKENISE_BATCH`` pieces per call, lazily; a ``DOCUMENT_END``
    is the tokenizer's EOS. A progress bar over ``characters`` (the pieces' total, when known)."""
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    pieces = iter(pieces)
    with tqdm(total=characters, desc=f"tokenising {what}", unit="char", unit_scale=True,
              disable=not progress) as bar:
        while batch := list(islice(pieces, TOKENISE_BATCH)):
            if DOCUMENT_END in batch and eos is None:
                raise ValueError(f"{what}: the tokenizer has no EOS token to separate documents with")
            texts = [piece for piece in batch if piece is not DOCUMENT_END]
            ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
            for piece in batch:
                yield [eos] if piece is DOCUMENT_END else next(ids)
            bar.update(sum(len(text) for text in texts))


def pack_pieces(tokenizer, pieces, length: int, max_sequences: int | None = None, what: str = "text",
                path: str | None = None, characters: int | None = None, progress: bool = True) -> torch.Tensor:
    """Token blocks (N, length) int32 of a stream of text pieces (``tokenised``), at most ``max_sequences`` of
    them, the stream read only as far as they need; written to the token-block file ``path`` (None: in memory)."""
    rows = tokenised(tokenizer, pieces, what, characters, progress)
    return cut_blocks(rows, length, max_sequences, path, f"{what} is shorter than one sequence of {length} tokens")[0]


def pack(tokenizer, text: str, length: int, max_sequences: int | None = None, what: str = "text",
         path: str | None = None, progress: bool = True) -> torch.Tensor:
    """Token blocks (N, length) int32 of one text, tokenised by paragraphs and packed without EOS (the embedded
    corpora: a text is one document)."""
    if not text.strip():
        raise ValueError(f"{what} is empty: no sequence of {length} tokens can be cut from it")
    return pack_pieces(tokenizer, paragraphs(text), length, max_sequences, what, path, len(text), progress)


TEACHER_SOURCE = re.compile(r"teacher:(\d+)")  # data.source "teacher:N": N tokens the teacher writes itself


@torch.no_grad()
def teacher_text(teacher, tokens: int, folder: str, seed: int = 0, length: int = 256, batch: int = 8,
                 progress: bool = True) -> str:
    """Path of a JSONL file the teacher wrote itself: samples of ``length`` tokens from its own distribution
    (temperature 1, no truncation, cached decoding through ``generate``) from its first token, ``tokens`` tokens in
    all, one sample a row (``{"text": ...}``: each a document, followed by EOS when packed). The data closest to what
    the teacher knows, for distilling it: the student is asked to match the teacher where the teacher is at home.
    Written once into ``folder`` (keyed by the count, length and seed) and reused."""
    from tqdm.auto import tqdm

    from ..common.files import write_atomically

    path = os.path.join(folder, f"teacher-{tokens}tok-{length}len-seed{seed}.jsonl")
    if os.path.exists(path):
        problem = _unusable_teacher_text(path, -(-tokens // length))
        if problem is None:
            return path
        logging.getLogger("hf_mixers").warning("hf_mixers: the cached teacher text %s cannot be used (%s); the "
                                               "teacher writes it again", path, problem)
        os.remove(path)
    tokenizer, model = teacher.tokenizer, teacher.model
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, texts = -(-tokens // length), []
    device = next(model.parameters()).device
    bar = tqdm(total=rows * length, desc="teacher writing its own text", unit="tok", disable=not progress)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for first in range(0, rows, batch):
            count = min(batch, rows - first)
            prompt = torch.full((count, 1), start, dtype=torch.long, device=device)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=length, min_new_tokens=length,
                                 pad_token_id=pad)
            texts += [tokenizer.decode(row[1:], skip_special_tokens=True).strip() for row in out]
            bar.update(count * length)
    bar.close()
    os.makedirs(folder, exist_ok=True)
    write_atomically(path, "".join(json.dumps({"text": text}) + "\n" for text in texts if text))
    return path


def _unusable_teacher_text(path: str, rows: int) -> str | None:
    """Why a cached ``teacher_text`` file cannot be reused (cut short, overwritten, empty), or None: it is written
    whole (``write_atomically``), one JSON object with a non-empty "text" a line, at most ``rows`` lines."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        lines = data.decode("utf-8").splitlines()
        if not lines or not data.endswith(b"\n") or len(lines) > rows:
            return f"{len(lines)} lines where 1 to {rows} whole ones were written"
        for number, line in enumerate(lines, 1):
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
                return f"line {number} is not a sample"
    except (OSError, ValueError) as error:  # UnicodeDecodeError and json's errors are ValueErrors
        return f"{type(error).__name__}: {error}"[:200]
    return None


def materialise_sources(source, teacher, folder: str, seed: int, length: int, progress: bool = True):
    """``data.source`` with every ``teacher:N`` replaced by the file ``teacher_text`` writes (or reuses)."""
    if isinstance(source, (list, tuple)):
        return [materialise_sources(item, teacher, folder, seed, length, progress) for item in source]
    match = TEACHER_SOURCE.fullmatch(source) if isinstance(source, str) else None
    if match is None:
        return source
    if int(match.group(1)) < 1:
        raise ValueError(f"data.source {source!r}: the teacher must write at least one token")
    return teacher_text(teacher, int(match.group(1)), folder, seed, length, progress=progress)
