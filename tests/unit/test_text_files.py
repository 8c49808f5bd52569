"""Text files as data.source (recipes/text_files.py): a document per file, EOS-separated, read as a stream."""

import json
import tracemalloc

import pytest
import torch

from conftest import tiny_tokenizer

import hf_mixers.recipes.text_files as text_files
from hf_mixers.recipes.dataset_sources import DatasetSource, parse_sources, source_blocks
from hf_mixers.recipes.text_files import TextFiles

pytestmark = pytest.mark.unit

PLAYS = {  # three documents of short paragraphs, with the blank-line quirks of real files
    "a.txt": "".join(f"First file, paragraph {i}: to be or not to be.\n\n" for i in range(30)),
    "b.md": "\n\n\n".join(f"Second file {i}, that is the question" for i in range(30)) + "\n",
    "sub/c.txt": "  \n\n" + "\n\n".join(f"Third file {i}: whether 'tis nobler" for i in range(30)),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def write(folder, files=PLAYS):
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return str(folder)


def expected_tokens(tokenizer, texts, ends):
    """The oracle: each paragraph (split at blank lines) tokenised alone with its blank line, EOS after a whole
    file; ``ends[i]``: whether text i runs to its file's end."""
    eos, ids = tokenizer.eos_token_id, []
    for text, end in zip(texts, ends):
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        ids += [t for p in paragraphs for t in tokenizer(p + "\n\n", add_special_tokens=False)["input_ids"]]
        ids += [eos] if end and paragraphs else []
    return ids


def test_each_file_is_a_document_followed_by_eos_and_the_last_fifth_of_the_text_is_held_out(tokenizer, tmp_path):
    folder = write(tmp_path / "plays")
    data = source_blocks(folder, tokenizer, length=16, heldout_count=3)
    texts = [PLAYS[name] for name in ("a.txt", "b.md", "sub/c.txt")]  # sorted paths
    cut = int(sum(map(len, texts)) * 0.8) - len(texts[0]) - len(texts[1])  # inside the third file
    train = expected_tokens(tokenizer, [texts[0], texts[1], texts[2][:cut]], [True, True, False])
    heldout = expected_tokens(tokenizer, [texts[2][cut:]], [True])
    assert data.train.flatten().tolist() == train[:len(train) // 16 * 16]
    assert data.heldout.flatten().tolist() == heldout[:48]
    assert (data.train == tokenizer.eos_token_id).sum() == 2  # the two whole files, not the one cut
    assert data.name == f"{folder} (held out: the last 20% of its text)"
    assert data.heldout_at(32, 1).flatten().tolist() == heldout[:32]  # the wider evaluation at another length

    single = source_blocks(str(tmp_path / "plays" / "a.txt"), tokenizer, length=16, heldout_count=1, max_train=2)
    cut = int(len(texts[0]) * 0.8)
    assert single.train.flatten().tolist() == expected_tokens(tokenizer, [texts[0][:cut]], [False])[:32]
    assert single.heldout.flatten().tolist() == expected_tokens(tokenizer, [texts[0][cut:]], [True])[:16]


def test_reading_a_chunk_at_a_time_gives_the_same_pieces(tokenizer, tmp_path, monkeypatch):
    folder = write(tmp_path / "plays")
    whole = source_blocks(folder, tokenizer, length=16, heldout_count=2)
    monkeypatch.setattr(text_files, "CHUNK", 64)  # blank lines straddle chunk boundaries
    chunked = source_blocks(folder, tokenizer, length=16, heldout_count=2)
    assert torch.equal(chunked.train, whole.train) and torch.equal(chunked.heldout, whole.heldout)
    # a paragraph longer than a chunk is read in parts cut after a line, nothing lost
    long = "".join(f"line {i} of one long speech\n" for i in range(40))
    files = parse_sources(write(tmp_path / "long", {"speech.txt": long}))[0]
    sizes = files.characters()
    pieces = list(files.pieces(0, sum(sizes), sizes))
    assert pieces[-1] is None and "".join(pieces[:-1]) == long + "\n\n" and len(pieces) > 10
    assert all(piece.endswith("\n") and len(piece) <= 2 * 64 for piece in pieces[:-2])


def test_a_large_file_is_never_held_whole(tokenizer, tmp_path):
    path = tmp_path / "big.txt"
    paragraph = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n\n"
    path.write_text(paragraph * (24 * 2**20 // len(paragraph)))  # 24 MiB
    tracemalloc.start()
    data = source_blocks(str(path), tokenizer, length=64, max_train=4, heldout_count=2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert data.train.shape == (4, 64) and data.heldout.shape == (2, 64)
    assert peak < 8 * 2**20, f"packing held {peak / 2**20:.1f} MiB of Python objects"


def test_bad_text_files_are_named(tokenizer, tmp_path, monkeypatch):
    blank = write(tmp_path / "blank", {"a.txt": "  \n\n", "b.txt": "\n"})
    with pytest.raises(ValueError, match=f"{blank}: no text in it"):
        source_blocks(blank, tokenizer, length=16)
    monkeypatch.setattr(text_files, "CHUNK", 64)
    binary = tmp_path / "notes.txt"
    binary.write_bytes(b"hello there\n\n" * 20 + b"\xff more")  # the bad byte lies in the fifth chunk
    with pytest.raises(ValueError, match=f"{binary}: not UTF-8 text \\(byte 260: invalid start byte\\)"):
        source_blocks(str(binary), tokenizer, length=16)
    mixed = write(tmp_path / "mixed", {"a.txt": "text", "b.jsonl": json.dumps({"text": "a row"}) + "\n"})
    with pytest.raises(ValueError, match=r"data.source\[1\]: .*mixed holds .jsonl and .txt files"):
        parse_sources(["shakespeare", mixed])
    with pytest.raises(FileNotFoundError, match=r"data.source: .*absent.txt: no such file or folder"):
        parse_sources(str(tmp_path / "absent.txt"))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.source: .*table.csv: unsupported text file"):
        parse_sources(str(tmp_path / "table.csv"))
    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(FileNotFoundError, match="empty-folder: no .jsonl/.parquet/.txt/.md files in this folder"):
        parse_sources(str(tmp_path / "empty-folder"))


def test_short_forms_become_what_reads_them(tmp_path):
    rows = write(tmp_path / "rows", {"a.jsonl": json.dumps({"text": "one"}) + "\n",
                                     "b.jsonl": json.dumps({"text": "two"}) + "\n"})
    folder, text = parse_sources([rows, "owner/dataset", "shakespeare", "teacher:100"]), write(tmp_path / "t")
    assert folder[0] == DatasetSource("json", data_files=[f"{rows}/a.jsonl", f"{rows}/b.jsonl"])
    assert folder[1] == DatasetSource("owner/dataset") and folder[2:] == ["shakespeare", "teacher:100"]
    assert parse_sources(text) == [TextFiles(text, (f"{text}/a.txt", f"{text}/b.md", f"{text}/sub/c.txt"))]


def test_the_main_process_counts_the_characters_once_and_the_others_read_its_counts(tokenizer, tmp_path,
                                                                                    monkeypatch):
    """Every process needs the held-out cut (the last fifth of the characters); the main one packs the training
    blocks first (recipes/stages.py) and leaves the files' character counts beside them, so the others do not read
    the whole corpus once more to find the cut. A changed file is counted again."""
    folder = write(tmp_path / "plays")
    train_path = str(tmp_path / "data" / "train.int32")
    main = source_blocks(folder, tokenizer, length=16, heldout_count=2, train_path=train_path)
    saved = json.loads((tmp_path / "data" / "train.int32.characters.json").read_text())
    assert saved["characters"] == [len(PLAYS[name]) for name in ("a.txt", "b.md", "sub/c.txt")]

    read, real = [], text_files._chunks
    monkeypatch.setattr(text_files, "_chunks", lambda path, *a, **k: (read.append(path), real(path, *a, **k))[1])
    other = source_blocks(folder, tokenizer, length=16, heldout_count=2, train_path=train_path, read_train=True)
    assert torch.equal(other.heldout, main.heldout) and torch.equal(other.train, main.train)
    assert read == [str(tmp_path / "plays" / "sub" / "c.txt")]  # only the file the held-out part lies in

    (tmp_path / "plays" / "a.txt").write_text(PLAYS["a.txt"] + "One more line.\n\n", encoding="utf-8")
    read.clear()
    source_blocks(folder, tokenizer, length=16, heldout_count=2, train_path=train_path, read_train=True)
    assert str(tmp_path / "plays" / "a.txt") in read  # the stale counts were not trusted
    assert json.loads((tmp_path / "data" / "train.int32.characters.json").read_text())["characters"][0] == \
        len(PLAYS["a.txt"]) + len("One more line.\n\n")
