"""Token blocks on disk (recipes/token_blocks.py): written once, memory-mapped, read a batch at a time."""

import json
import os

import pytest
import torch

from conftest import tiny_tokenizer

from hf_mixers.recipes.dataset_sources import source_blocks
from hf_mixers.recipes.token_blocks import BlockWriter, cut_blocks, read_blocks
from hf_mixers.recipes.trainer import batch_at

pytestmark = pytest.mark.unit


def private_mib() -> float:
    """This process's own (anonymous) resident memory; a mapped file's pages are the page cache's, shared by the
    processes that map it and dropped under pressure."""
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith("RssAnon:")).split()[1]) / 1024


def test_blocks_written_then_mapped_equal_the_blocks_in_memory(tmp_path):
    rows = torch.randint(0, 50_000, (2_500, 8))  # more than one flush of rows
    path = str(tmp_path / "data" / "train.int32")
    writer = BlockWriter(8, path)
    for row in rows[:100]:
        writer.add(row.tolist())
    writer.extend(rows[100:].numpy())
    mapped = writer.finish()
    assert mapped.dtype == torch.int32 and torch.equal(mapped.long(), rows)
    assert torch.equal(read_blocks(path).long(), rows)
    assert json.loads(open(path + ".json").read()) == {"length": 8, "blocks": 2_500, "dtype": "int32"}
    assert sorted(os.listdir(tmp_path / "data")) == ["train.int32", "train.int32.json"]  # nothing partial left
    in_memory = BlockWriter(8)
    in_memory.extend(rows.numpy())
    assert torch.equal(in_memory.finish().long(), rows)


def test_a_failed_write_leaves_nothing_and_bad_files_are_named(tmp_path):
    path = str(tmp_path / "train.int32")
    writer = BlockWriter(4, path)
    writer.add([1, 2, 3, 4])
    with pytest.raises(ValueError, match="a block holds 4 tokens, got blocks of shape \\(1, 3\\)"):
        writer.add([1, 2, 3])
    writer.abandon()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="train.int32.json: not the description of a token-block file"):
        read_blocks(path)
    cut_blocks([[1] * 5, [1] * 7], 4, path=path)
    with open(path, "ab") as handle:  # a torn file: not a whole number of blocks
        handle.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match="13 tokens, not a whole number of 4-token blocks"):
        read_blocks(path)


def test_rows_are_cut_into_blocks_as_they_come_and_read_only_as_far_as_needed(tmp_path):
    rows = [list(range(n * 10, n * 10 + n)) for n in range(1, 9)]  # rows of 1..8 tokens
    stream = [token for row in rows for token in row]
    blocks, used = cut_blocks(iter(rows), 5)
    assert blocks.tolist() == [stream[i:i + 5] for i in range(0, len(stream) // 5 * 5, 5)] and used == len(rows)
    blocks, used = cut_blocks(iter(rows), 5, wanted=2, path=str(tmp_path / "two.int32"))
    assert blocks.tolist() == [stream[:5], stream[5:10]] and used == 4  # 1+2+3+4 tokens cover two blocks
    assert read_blocks(str(tmp_path / "two.int32")).tolist() == blocks.tolist()
    with pytest.raises(ValueError, match="too few tokens"):
        cut_blocks(iter([[1, 2], [3]]), 4, path=str(tmp_path / "short.int32"), too_short="too few tokens")
    assert sorted(os.listdir(tmp_path)) == ["two.int32", "two.int32.json"]  # nothing left of the failed one


def test_batches_read_only_their_rows_of_a_mapped_file(tmp_path):
    """A 128 MiB block file costs a process the rows it trains on, not a private copy of the file."""
    path = str(tmp_path / "big.int32")
    length, count = 1024, 32 * 1024
    writer = BlockWriter(length, path)
    for start in range(0, count, 4096):
        writer.extend(torch.arange(start, start + 4096, dtype=torch.int32)[:, None].expand(-1, length).numpy())
    writer.finish()
    before = private_mib()
    blocks = read_blocks(path)
    batches = [batch_at(blocks, index, 8, seed=0).long() for index in range(16)]
    assert private_mib() - before < 16, "mapping the file read more than the batches' rows"
    assert all((batch == batch[:, :1]).all() for batch in batches)  # every row is one block, whole
    assert len({int(row) for batch in batches for row in batch[:, 0]}) == 128  # distinct blocks, one epoch


def test_a_dataset_is_packed_into_the_file_once_and_mapped_by_the_other_processes(tmp_path, monkeypatch):
    """source_blocks(train_path=...) writes the training blocks as it cuts them; with read_train (the other
    processes) it packs only the held-out blocks and maps the main process's file."""
    import hf_mixers.recipes.dataset_sources as dataset_sources

    tokenizer = tiny_tokenizer()
    docs = [f"Document {i}: " + " ".join(["to be or not to be"] * (3 + i % 5)) for i in range(40)]
    files = tmp_path / "train.jsonl"
    files.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    source = [{"path": "json", "data_files": str(files)}, {"path": "json", "data_files": str(files), "weight": 3}]
    in_memory = source_blocks(source[0], tokenizer, length=16, heldout_count=2)
    path = str(tmp_path / "out" / "data" / "train.int32")
    main = source_blocks(source[0], tokenizer, length=16, heldout_count=2, train_path=path)
    assert torch.equal(main.train, in_memory.train) and os.path.exists(path + ".json")

    packed = []
    real = dataset_sources.pack_documents
    monkeypatch.setattr(dataset_sources, "pack_documents", lambda *a, **k: packed.append(a[5]) or real(*a, **k))
    other = source_blocks(source[0], tokenizer, length=16, heldout_count=2, train_path=path, read_train=True)
    assert packed == ["the held-out text of " + str(files)]
    assert torch.equal(other.train, main.train) and torch.equal(other.heldout, main.heldout)

    mixed = source_blocks(source, tokenizer, length=16, max_train=8, heldout_count=2, train_path=path)
    assert mixed.train.shape == (8, 16) and torch.equal(read_blocks(path), mixed.train)
    assert sorted(os.listdir(tmp_path / "out" / "data")) == ["train.int32", "train.int32.json"]  # parts removed
