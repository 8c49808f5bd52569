"""Training text -> fixed-length token blocks (the held-out split itself is ``corpus.split_texts``), and text the
teacher writes itself (``data.source: teacher:N``).

Tokenising and packing go through ``datasets``: a batched map over paragraphs, then concatenate-and-cut into
``sequence_length`` blocks, the usual causal-LM packing.
"""

from __future__ import annotations

import os
import re

import torch


def pack(tokenizer, text: str, length: int, max_sequences: int | None = None, what: str = "text") -> torch.Tensor:
    """Token blocks (N, length) of ``text``: tokenised by paragraphs with ``datasets``, concatenated, cut."""
    import datasets

    if max_sequences is not None:  # tokenise only what is needed (~4 characters per token; 2x margin)
        text = text[: 8 * length * max_sequences]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError(f"{what} is empty: no sequence of {length} tokens can be cut from it")
    table = datasets.Dataset.from_dict({"text": [p + "\n\n" for p in paragraphs]})
    tokens = table.map(lambda batch: {"ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]},
                       batched=True, remove_columns=["text"], desc=f"tokenising {what}")

    def cut(batch):
        flat = [token for ids in batch["ids"] for token in ids]
        usable = len(flat) // length * length
        return {"input_ids": [flat[i:i + length] for i in range(0, usable, length)]}

    blocks = tokens.map(cut, batched=True, batch_size=len(tokens) or 1, remove_columns=["ids"],
                        desc=f"packing {what}")
    if len(blocks) == 0:
        raise ValueError(f"{what} is shorter than one sequence of {length} tokens")
    ids = torch.tensor(blocks["input_ids"], dtype=torch.long)
    return ids if max_sequences is None else ids[:max_sequences]


TEACHER_SOURCE = re.compile(r"teacher:(\d+)")  # data.source "teacher:N": N tokens the teacher writes itself


@torch.no_grad()
def teacher_text(teacher, tokens: int, folder: str, seed: int = 0, length: int = 256, batch: int = 8,
                 progress: bool = True) -> str:
    """Path of a text file the teacher wrote itself: rows of ``length`` tokens sampled from its own distribution
    (temperature 1, no truncation, cached decoding through ``generate``) from its first token, ``tokens`` tokens in
    all. The data closest to what the teacher knows, for distilling it: the student is asked to match the teacher
    where the teacher is at home. Written once into ``folder`` (keyed by the count, length and seed) and reused."""
    from tqdm.auto import tqdm

    from ..common.files import write_atomically

    path = os.path.join(folder, f"teacher-{tokens}tok-{length}len-seed{seed}.txt")
    if os.path.exists(path):
        return path
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
    write_atomically(path, "\n\n".join(text for text in texts if text) + "\n")
    return path


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
