"""Training text -> fixed-length token blocks (the held-out split itself is ``corpus.split_texts``).

Tokenising and packing go through ``datasets``: a batched map over paragraphs, then concatenate-and-cut into
``sequence_length`` blocks, the usual causal-LM packing.
"""

from __future__ import annotations

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
