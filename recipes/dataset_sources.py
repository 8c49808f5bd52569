"""``data.source`` entries as ``datasets`` gives them: a mapping names a dataset the way ``load_dataset`` does.

    data:
      source:
        - {path: HuggingFaceFW/fineweb-edu, name: sample-10BT, split: train, streaming: true, weight: 3}
        - {path: json, data_files: {train: notes/*.jsonl, validation: notes/dev.jsonl}, text_field: body}
        - {path: ./saved_dataset_dict}          # DatasetDict.save_to_disk: its train / validation splits

Keys: ``path`` (a Hub id, a builder such as json / parquet / csv / text with ``data_files``, a folder of data
files, or a folder written by ``save_to_disk``), ``name`` (the config), ``split`` (default train),
``heldout_split`` (default: the dataset's validation split when it has one, else the last ``data.heldout_fraction``
of its documents, or with ``streaming`` its first documents), ``revision``, ``data_files``, ``text_field``
(default text), ``streaming`` and ``weight`` (a mixture's share of the training sequences); ``finetune.source``
takes the same mapping, with ``messages_field`` for chat rows (recipes/sft.py).

Each document is tokenised alone, followed by the tokenizer's EOS, and the token stream is cut into
``sequence_length`` blocks: no document is ever joined into one Python string with the others. Documents are
tokenised lazily and only as many as the requested sequences need; without ``data.max_train_sequences`` a
file-backed dataset is tokenised with ``Dataset.map``, which ``datasets`` caches on disk by fingerprint (the
tokenizer included), so a second run or process reads it back.

Short forms: a JSONL or parquet file (or a folder of them) is read the same way (its rows are documents, its
"text" field the text), a hub id as ``{path: id}``, ``teacher:N`` is the JSONL file the teacher writes (a sample a
document), and a .txt / .md file or folder is a stream of documents, one per file (recipes/text_files.py). Only
the embedded corpora (``shakespeare``, ``python-docs``) are texts in memory, packed by paragraphs without EOS, a
list of them interleaved by paragraphs: the demo's figures were measured so. Any other list is mixed by weight at
the level of token blocks (short forms weigh 1).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, fields

import torch

from .text_files import TEXT_FILES, TextFiles
from .token_blocks import BlockWriter, cut_blocks, read_blocks

HELDOUT_SPLITS = ("validation",)  # looked for, in order, when heldout_split is not given
BUILDERS = ("json", "parquet", "csv", "text")  # datasets' packaged builders that read data_files
DOCUMENT_FILES = {".jsonl": "json", ".parquet": "parquet"}  # short-form files whose rows are documents


@dataclass(frozen=True)
class DatasetSource:
    path: str
    name: str | None = None
    split: str = "train"
    heldout_split: str | None = None
    revision: str | None = None
    data_files: str | list | dict | None = None
    text_field: str = "text"
    messages_field: str | None = None  # chat data (finetune.source): the column of message lists
    streaming: bool = False
    weight: float = 1.0

    @classmethod
    def parse(cls, entry: dict, where: str = "data.source") -> "DatasetSource":
        """The mapping of a recipe, checked: an unknown key, a missing path or a value of the wrong type is a
        ValueError that names ``where`` and the key."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(entry) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a dataset source takes "
                             f"{', '.join(known)}")
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ValueError(f"{where}: 'path' (a dataset id, builder or folder) is required, got "
                             f"{entry.get('path')!r}")
        for key in ("name", "split", "heldout_split", "revision", "text_field", "messages_field"):
            if key in entry and entry[key] is not None and not isinstance(entry[key], str):
                raise ValueError(f"{where}: '{key}' must be a string, got {entry[key]!r}")
        if "streaming" in entry and not isinstance(entry["streaming"], bool):
            raise ValueError(f"{where}: 'streaming' must be true or false, got {entry['streaming']!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}: 'weight' must be a positive number, got {weight!r}")
        files = entry.get("data_files")
        if files is not None and not isinstance(files, (str, list, dict)):
            raise ValueError(f"{where}: 'data_files' must be a path, a list or a {{split: paths}} mapping, got "
                             f"{files!r}")
        return cls(**{**entry, "weight": float(weight)})

    @property
    def label(self) -> str:
        """How reports and errors name it: path (config), or a builder's one data file."""
        named = self.data_files if self.path in BUILDERS and isinstance(self.data_files, str) else self.path
        return named + (f" ({self.name})" if self.name else "")

    @property
    def saved(self) -> bool:
        """A folder written by ``Dataset(Dict).save_to_disk`` (read with ``load_from_disk``)."""
        return os.path.isdir(self.path) and any(os.path.exists(os.path.join(self.path, marker))
                                                 for marker in ("dataset_dict.json", "state.json"))


def _short_form(item, where: str):
    """A short-form string as what reads it: a JSONL / parquet file (or a folder of them) as the mapping that reads
    its rows as documents, a .txt / .md file or folder as ``TextFiles``, a ``save_to_disk`` folder or a hub id as
    ``{path: ...}``; the embedded
    corpora, ``teacher:N`` (written later) and anything that is not a string as they are. A path that is none of
    these is a FileNotFoundError naming ``where``."""
    from ..common.corpus import EMBEDDED, HUB_ID
    from .data import TEACHER_SOURCE

    if not isinstance(item, str) or item in EMBEDDED or TEACHER_SOURCE.fullmatch(item):
        return item
    suffix = os.path.splitext(item)[1]
    if os.path.isfile(item) and suffix in DOCUMENT_FILES:
        return {"path": DOCUMENT_FILES[suffix], "data_files": item}
    if os.path.isfile(item) and suffix in TEXT_FILES:
        return TextFiles(item, (item,))
    if DatasetSource(path=item).saved:  # a save_to_disk folder: its "text" field, as {path: FOLDER} reads it
        return {"path": item}
    if os.path.isdir(item):  # one walk of the folder, its files by kind
        files = sorted(path for path in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                       if os.path.isfile(path))
        found = {kind: [path for path in files if path.endswith(kind)] for kind in (*DOCUMENT_FILES, *TEXT_FILES)}
        kinds = [kind for kind, paths in found.items() if paths]
        if len(kinds) == 1 and kinds[0] in DOCUMENT_FILES:
            return {"path": DOCUMENT_FILES[kinds[0]], "data_files": found[kinds[0]]}
        if any(kind in DOCUMENT_FILES for kind in kinds):
            raise ValueError(f"{where}: {item} holds {' and '.join(kinds)} files; one kind of file per folder (give "
                             "each kind as its own entry of a list)")
        if not kinds:
            raise FileNotFoundError(f"{where}: {item}: no {'/'.join((*DOCUMENT_FILES, *TEXT_FILES))} files in this "
                                    "folder")
        return TextFiles(item, tuple(path for path in files if path.endswith(TEXT_FILES)))
    if os.path.isfile(item):
        raise ValueError(f"{where}: {item}: unsupported text file; use one of {(*TEXT_FILES, *DOCUMENT_FILES)}")
    if HUB_ID.fullmatch(item) and not _path_like(item):
        return {"path": item}
    raise FileNotFoundError(f"{where}: {item}: no such file or folder")


def _path_like(item: str) -> bool:
    """A string that names a file, not a Hub dataset: relative or absolute by its start, or ending in a data-file
    suffix ("data/train.jsonl" has the owner/name shape of a Hub id; a typo in it must say "no such file", not send
    the name to the Hub)."""
    return item.startswith((".", "/", "~")) or os.path.splitext(item)[1].lower() in (
        *DOCUMENT_FILES, *TEXT_FILES, ".json", ".csv", ".tsv", ".arrow", ".gz", ".zst")


def embedded_only(source) -> bool:
    """Whether ``data.source`` names only the embedded corpora (``shakespeare``, ``python-docs``; None is the
    first): text held in memory, packed by paragraphs without EOS, a list of them interleaved by paragraphs."""
    from ..common.corpus import EMBEDDED

    items = source if isinstance(source, (list, tuple)) else [source]
    return all(item is None or item in EMBEDDED for item in items)


def parse_sources(source, where: str = "data.source") -> list:
    """Every entry of ``data.source`` as what reads it: mappings parsed into ``DatasetSource``, short forms as
    ``_short_form`` gives them (the embedded corpora and ``teacher:N`` as they are). Fails early, by name."""
    items = source if isinstance(source, (list, tuple)) else [source]
    entries = []
    for i, item in enumerate(items):
        named = f"{where}[{i}]" if isinstance(source, (list, tuple)) else where
        item = _short_form(item, named)
        entries.append(DatasetSource.parse(item, named) if isinstance(item, dict) else item)
    return entries


def _unreadable(source: DatasetSource, split: str | None, error: Exception) -> ValueError:
    """A ``datasets`` error as one line naming the dataset and split, with its root cause (an empty file, a JSON
    parse error in row N, a missing file...) rather than datasets' generic wrapper."""
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    where = source.label + (f", split {split!r}" if split else "")
    bad_line = _first_bad_json_line(source) if source.path == "json" else None
    if bad_line is not None:  # pandas' "Trailing data at position 305" names no row: find the line itself
        return ValueError(f"{where}: {bad_line}")
    detail = str(error) if cause is error else f"{error} ({type(cause).__name__}: {cause})" if str(cause) else \
        f"{error} (no row could be read: an empty file?)"
    return ValueError(f"{where}: {detail}")


def _first_bad_json_line(source: DatasetSource) -> str | None:
    """"FILE line N is not one JSON object (its error): TEXT" for the first line of the source's local JSONL files that
    does not parse, read only once ``datasets`` has failed on them; None when every line parses (another cause)."""
    files = source.data_files
    files = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else \
        list(files or [])
    for path in (path for entry in files for path in ([entry] if isinstance(entry, str) else entry)):
        if not os.path.isfile(path) or not path.endswith(".jsonl"):  # a .json file may be one array over many lines
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as problem:
                    text = line.strip()
                    return (f"{path} line {number} is not one JSON object ({problem.msg} at column {problem.colno}): "
                            f"{text[:80]}{'...' if len(text) > 80 else ''}")
                if not isinstance(row, dict):
                    return f"{path} line {number} is a JSON {type(row).__name__}, not an object with the text field"
    return None


def split_names(source: DatasetSource) -> list[str]:
    """The splits the dataset has."""
    import datasets
    from datasets.exceptions import DatasetsError

    if source.saved:
        loaded = datasets.load_from_disk(source.path)
        return list(loaded) if isinstance(loaded, datasets.DatasetDict) else ["train"]
    try:
        return datasets.get_dataset_split_names(source.path, source.name, revision=source.revision,
                                                data_files=source.data_files)
    except (ValueError, DatasetsError) as error:  # e.g. an empty data file: no split can be read from it
        raise _unreadable(source, None, error) from None


def load_split(source: DatasetSource, split: str, fields=None):
    """One split as a ``Dataset`` (an ``IterableDataset`` with ``streaming``), ``fields`` checked (default: the text
    field; a callable takes the column names and returns the missing ones' message or None)."""
    import datasets
    from datasets.exceptions import DatasetsError

    if source.saved:
        loaded = datasets.load_from_disk(source.path)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{source.label}: no split {split!r} (splits: {', '.join(loaded)})")
            loaded = loaded[split]
        elif split != "train":
            raise ValueError(f"{source.label}: a single saved Dataset has no split {split!r}")
        dataset = loaded.to_iterable_dataset() if source.streaming else loaded
    else:
        try:
            dataset = datasets.load_dataset(source.path, source.name, split=split, revision=source.revision,
                                            data_files=source.data_files, streaming=source.streaming)
        except (ValueError, DatasetsError) as error:  # an unknown split, a row that is not JSON...: say where
            raise _unreadable(source, split, error) from None
    columns = dataset.column_names
    if columns is None:  # a stream that does not know its columns: look at its first row
        columns = list(next(iter(dataset), {}))
    problem = fields(columns) if fields is not None else (
        None if source.text_field in columns else f"no field {source.text_field!r}")
    if problem:
        hint = "set messages_field" if fields is not None else "set text_field"
        raise ValueError(f"{source.label}, split {split!r}: {problem} (fields: {', '.join(columns)}); {hint}")
    return dataset


def document_splits(source: DatasetSource, heldout_fraction: float, fields=None):
    """(training documents, held-out documents or None, how the held-out part was chosen). None: a stream without
    a validation split, whose first documents ``source_blocks`` holds out. ``fields``: as ``load_split``'s."""
    names = None if source.heldout_split else split_names(source)
    heldout_split = source.heldout_split or next((name for name in HELDOUT_SPLITS if name in names), None)
    if heldout_split == source.split:
        raise ValueError(f"{source.label}: heldout_split {heldout_split!r} is the training split")
    train = load_split(source, source.split, fields)
    if heldout_split is not None:
        return train, load_split(source, heldout_split, fields), f"its {heldout_split} split"
    if source.streaming:
        return train, None, "the first documents of its stream"
    cut = int(len(train) * (1.0 - heldout_fraction))
    if cut == len(train) or cut == 0:
        raise ValueError(f"{source.label}: {len(train)} document(s) in split {source.split!r}, too few to hold "
                         f"out {heldout_fraction:.0%} of them; give it a validation split or heldout_split")
    return (train.select(range(cut)), train.select(range(cut, len(train))),
            f"the last {heldout_fraction:.0%} of its {source.split} split")


def pack_documents(tokenizer, documents, source: DatasetSource, length: int, max_sequences: int | None,
                   what: str, path: str | None = None) -> tuple[torch.Tensor, int]:
    """(token blocks (N, length) int32, documents read): each document tokenised alone and followed by EOS, the
    stream cut into blocks, at most ``max_sequences`` of them (None: all), written to the token-block file ``path``
    as they are cut (recipes/token_blocks.py; None: kept in memory). A row whose text is not a string is an error
    naming the dataset and field; empty ones add nothing."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{what}: the tokenizer has no EOS token to separate documents with")
    field = source.text_field

    def tokenise(batch):
        texts = batch[field]
        for text in texts:
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{source.label}: field {field!r} of a row holds {type(text).__name__}, not text")
        ids = tokenizer([text or "" for text in texts], add_special_tokens=False)["input_ids"]
        return {"ids": [row + [eos] if text else [] for row, text in zip(ids, texts)]}  # one row per row

    import datasets

    columns = documents.column_names or [field]
    if max_sequences is not None and isinstance(documents, datasets.Dataset):
        documents = documents.to_iterable_dataset()  # tokenise lazily: only the documents the blocks need
    kwargs = {} if isinstance(documents, datasets.IterableDataset) else {"desc": f"tokenising {what}"}
    tokens = documents.map(tokenise, batched=True, remove_columns=columns, **kwargs)
    rows = (row for batch in tokens.iter(batch_size=64) for row in batch["ids"])  # an empty document adds nothing
    return cut_blocks(rows, length, max_sequences, path, f"{what}: fewer than {length} tokens in {source.label} "
                      f"(split {source.split!r}), not one sequence")


@dataclass
class DataBlocks:
    """What a run trains and evaluates on, as token blocks."""

    train: torch.Tensor  # (N, length) token ids (int32 when packed from documents; memory-mapped from a file)
    heldout: torch.Tensor  # (M, length)
    name: str  # for reports
    heldout_at: object = None  # (length, count) -> held-out blocks at another length (wider evaluations); or None


def mix_blocks(parts: list[torch.Tensor], weights: list[float], total: int | None,
               path: str | None = None) -> torch.Tensor:
    """Blocks of every part in the shares of ``weights``, spread evenly through the result: ``total`` blocks (None:
    as many as the scarcest part allows at its share), at least one of each part; written to ``path`` (a token-block
    file) or kept in memory."""
    shares = [weight / sum(weights) for weight in weights]
    if total is None:
        total = min(math.floor(len(part) / share) for part, share in zip(parts, shares))
    counts = [min(len(part), max(1, round(total * share))) for part, share in zip(parts, shares)]
    slots = sorted(((k + 0.5) / count, index) for index, count in enumerate(counts) for k in range(count))
    writer, taken = BlockWriter(parts[0].shape[1], path), [0] * len(parts)
    try:
        for _, index in slots:
            writer.add(parts[index][taken[index]])
            taken[index] += 1
    except BaseException:
        writer.abandon()
        raise
    return writer.finish()


def _dataset_blocks(entry: DatasetSource, tokenizer, length, max_train, heldout_count, heldout_fraction,
                    train_path=None, pack_train=True):
    train_docs, heldout_docs, how = document_splits(entry, heldout_fraction)
    if heldout_docs is None:  # a stream without a validation split: its first documents, training after them
        heldout, used = pack_documents(tokenizer, train_docs, entry, length, heldout_count,
                                       f"the held-out text of {entry.label}")
        heldout_docs, train_docs = train_docs.take(used), train_docs.skip(used)
    else:
        heldout, _ = pack_documents(tokenizer, heldout_docs, entry, length, heldout_count,
                                    f"the held-out text of {entry.label}")
    train = pack_documents(tokenizer, train_docs, entry, length, max_train, f"the training text of {entry.label}",
                           train_path)[0] if pack_train else None

    def heldout_at(size, count):
        return pack_documents(tokenizer, heldout_docs, entry, size, count, f"the held-out text of {entry.label}")[0]

    return DataBlocks(train, heldout, f"{entry.label} (held out: {how})", heldout_at)


def _text_blocks(source, tokenizer, length, max_train, heldout_count, heldout_fraction, train_path=None,
                 pack_train=True):
    """The embedded corpora (or a list of them): one text each in memory (corpus.split_texts), packed by paragraphs
    without EOS, as every documented figure of the demo was measured."""
    from ..common.corpus import split_texts
    from .data import pack

    train_text, heldout_text, name = split_texts(source, heldout_fraction)
    train = pack(tokenizer, train_text, length, max_train, f"the training text of {name}", train_path) \
        if pack_train else None
    heldout = pack(tokenizer, heldout_text, length, heldout_count, f"the held-out text of {name}")
    return DataBlocks(train, heldout, name, lambda size, count: pack(tokenizer, heldout_text, size, count, name))


def _text_file_blocks(files: TextFiles, tokenizer, length, max_train, heldout_count, heldout_fraction,
                      train_path=None, pack_train=True):
    """Text files (recipes/text_files.py): each file a document followed by EOS, read as a stream; the last
    ``heldout_fraction`` of the characters held out."""
    from .data import pack_pieces

    # counted once per run: the main process writes the counts beside the training blocks, the others read them
    sizes = files.characters(None if train_path is None else train_path + ".characters.json")
    total = sum(sizes)
    cut = int(total * (1.0 - heldout_fraction))

    def blocks(start, stop, size, count, what, path=None):
        return pack_pieces(tokenizer, files.pieces(start, stop, sizes), size, count, f"{what} of {files.label}",
                           path, stop - start)

    train = blocks(0, cut, length, max_train, "the training text", train_path) if pack_train else None
    heldout = blocks(cut, total, length, heldout_count, "the held-out text")
    return DataBlocks(train, heldout, f"{files.label} (held out: the last {heldout_fraction:.0%} of its text)",
                      lambda size, count: blocks(cut, total, size, count, "the held-out text"))


def source_blocks(source, tokenizer, length: int, max_train: int | None = None, heldout_count: int = 4,
                  heldout_fraction: float = 0.2, train_path: str | None = None, read_train: bool = False,
                  heldout_only: bool = False) -> DataBlocks:
    """Training and held-out token blocks of ``data.source`` (materialised: no ``teacher:N`` left).

    ``train_path``: the training blocks are written to this token-block file as they are packed and come back
    memory-mapped from it (None: in memory). ``read_train``: another process already wrote it; only the held-out
    blocks are packed here (they are few) and the training blocks are the file's. ``heldout_only``: no training
    blocks at all (``train`` is None: an evaluation)."""
    entries = parse_sources(source)
    pack_train = not (read_train or heldout_only)
    if embedded_only(source):
        data = _text_blocks(source, tokenizer, length, max_train, heldout_count, heldout_fraction, train_path,
                            pack_train)
    else:
        single = len(entries) == 1
        part_paths = [train_path if single or not train_path else f"{train_path}.part{i}"
                      for i in range(len(entries))]
        parts = [{DatasetSource: _dataset_blocks, TextFiles: _text_file_blocks}.get(type(entry), _text_blocks)(
            entry, tokenizer, length, max_train, heldout_count, heldout_fraction, part_path, pack_train)
            for entry, part_path in zip(entries, part_paths)]
        if single:
            data = parts[0]
        else:
            weights = [entry.weight if isinstance(entry, DatasetSource) else 1.0 for entry in entries]
            train = mix_blocks([part.train for part in parts], weights, max_train, train_path) if pack_train else None
            if pack_train and train_path:  # the parts are in the mixture now
                for part_path in part_paths:
                    for leftover in (part_path, part_path + ".json"):
                        os.remove(leftover)
            data = DataBlocks(train, mix_blocks([part.heldout for part in parts], weights,
                                                max(heldout_count, len(parts))),
                              " + ".join(part.name for part in parts))
    if read_train:
        data.train = read_blocks(train_path)
    return data
