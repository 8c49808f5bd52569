"""data.source as `datasets` gives it (recipes/dataset_sources.py): local datasets in the Hub's layouts, offline."""

import json

import pytest
import torch

from conftest import tiny_tokenizer

from hf_mixers.recipes.dataset_sources import DatasetSource, mix_blocks, parse_sources, source_blocks

pytestmark = pytest.mark.unit

DOCS = [f"Document {i}: " + " ".join(["to be or not to be"] * (3 + i % 5)) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return str(path)


def test_documents_are_tokenised_alone_and_separated_by_eos(tokenizer, tmp_path):
    files = write_jsonl(tmp_path / "train.jsonl", DOCS)
    data = source_blocks({"path": "json", "data_files": files}, tokenizer, length=16, heldout_count=2)
    eos = [tokenizer.eos_token_id]
    stream = [i for doc in DOCS for i in tokenizer(doc, add_special_tokens=False)["input_ids"] + eos]
    # no validation split: the last 20% of the documents are held out, the rest is training text, in order
    train_docs = int(len(DOCS) * 0.8)
    expected = [i for doc in DOCS[:train_docs] for i in tokenizer(doc, add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id]]
    blocks = len(expected) // 16
    assert torch.equal(data.train, torch.tensor(expected[:blocks * 16]).view(blocks, 16))
    assert (data.train == tokenizer.eos_token_id).sum() >= train_docs - 1
    assert data.heldout.shape == (2, 16) and data.heldout.flatten().tolist() == stream[len(expected):][:32]
    assert "held out: the last 20% of its train split" in data.name and data.name.startswith(files)
    short = source_blocks(files, tokenizer, length=16, heldout_count=2)  # the file as a short form: the same rows
    assert torch.equal(short.train, data.train) and torch.equal(short.heldout, data.heldout)


def test_the_validation_split_is_the_held_out_set_and_max_sequences_reads_only_what_it_needs(tokenizer, tmp_path):
    source = {"path": "json", "data_files": {"train": write_jsonl(tmp_path / "a.jsonl", DOCS),
                                             "validation": write_jsonl(tmp_path / "b.jsonl", DOCS[:5])}}
    data = source_blocks(source, tokenizer, length=16, max_train=3, heldout_count=2)
    assert data.train.shape == (3, 16) and "its validation split" in data.name
    first = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    assert data.heldout[0].tolist() == first[:16] and data.train[0].tolist() == first[:16]
    assert data.heldout_at(32, 1).shape == (1, 32)  # the wider evaluation at another length


def test_parquet_a_saved_dataset_dict_and_a_stream(tokenizer, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": DOCS}).to_parquet(str(tmp_path / "docs.parquet"))
    parquet = source_blocks({"path": "parquet", "data_files": str(tmp_path / "docs.parquet"), "text_field": "body"},
                            tokenizer, length=16, heldout_count=1)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS}),
                          "validation": datasets.Dataset.from_dict({"body": DOCS[30:]})}).save_to_disk(
        str(tmp_path / "saved"))
    saved = source_blocks({"path": str(tmp_path / "saved"), "text_field": "body"}, tokenizer, length=16,
                          heldout_count=1)
    assert torch.equal(saved.train[: len(parquet.train)], parquet.train[: len(saved.train)])
    assert "its validation split" in saved.name
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved-text"))  # the short form: a string
    short = source_blocks(str(tmp_path / "saved-text"), tokenizer, length=16, heldout_count=1)
    assert torch.equal(short.train[: len(parquet.train)], parquet.train[: len(short.train)])
    stream = source_blocks({"path": "json", "data_files": write_jsonl(tmp_path / "s.jsonl", DOCS),
                            "streaming": True}, tokenizer, length=16, max_train=4, heldout_count=2)
    # a stream without a validation split: its first documents are held out and training starts after them
    assert stream.heldout.flatten().tolist() == parquet.train.flatten().tolist()[:32]
    assert stream.train.shape == (4, 16) and "first documents of its stream" in stream.name
    assert not torch.equal(stream.train[0], stream.heldout[0])


def test_a_mixture_by_weight_with_a_short_form(tokenizer, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join("A different text, paragraph %d, with its own words." % i for i in range(200)))
    source = [{"path": "json", "data_files": write_jsonl(tmp_path / "a.jsonl", DOCS * 4), "weight": 3},
              str(other)]
    data = source_blocks(source, tokenizer, length=16, max_train=8, heldout_count=2)
    alone = source_blocks(source[1:], tokenizer, length=16, max_train=8, heldout_count=2)
    from_text = sum(any(torch.equal(row, block) for block in alone.train) for row in data.train)
    assert data.train.shape == (8, 16) and from_text == 2  # shares 3 : 1
    assert " + " in data.name and data.heldout_at is None
    mixed = mix_blocks([torch.zeros(6, 2), torch.ones(2, 2)], [1.0, 1.0], None)  # the scarcest part bounds it
    assert mixed[:, 0].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("entry, message", [
    ({"path": "json", "split_name": "x"}, "data.source: unknown key(s) 'split_name'"),
    ({"name": "x"}, "'path' (a dataset id, builder or folder) is required"),
    ({"path": "json", "weight": 0}, "'weight' must be a positive number"),
    ({"path": "json", "streaming": "yes"}, "'streaming' must be true or false"),
    ({"path": "json", "data_files": 3}, "'data_files' must be a path, a list"),
])
def test_bad_keys_are_named(entry, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_sources(entry)


def test_bad_fields_and_splits_name_the_dataset(tokenizer, tmp_path):
    files = write_jsonl(tmp_path / "t.jsonl", DOCS, field="content")
    with pytest.raises(ValueError, match=r"t.jsonl, split 'train': no field 'text' \(fields: content, id\); set "
                                         r"text_field"):
        source_blocks({"path": "json", "data_files": files}, tokenizer, length=16)
    with pytest.raises(ValueError, match=r"t.jsonl, split 'dev': Unknown split"):
        source_blocks({"path": "json", "data_files": files, "text_field": "content", "heldout_split": "dev"},
                      tokenizer, length=16)
    with pytest.raises(ValueError, match=r"heldout_split 'train' is the training split"):
        source_blocks({"path": "json", "data_files": files, "heldout_split": "train"}, tokenizer, length=16)
    with pytest.raises(ValueError, match=r"data.source\[1\]: unknown key"):
        parse_sources(["shakespeare", {"path": "json", "bogus": 1}])
    assert parse_sources([{"path": "json"}])[0] == DatasetSource(path="json")


def test_unreadable_files_are_one_line_naming_the_file(tokenizer, tmp_path):
    """datasets' generic errors come back with the file, the split and the root cause."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: .*no row could be read: an empty file\?"):
        source_blocks(str(tmp_path / "empty.jsonl"), tokenizer, length=16)
    with pytest.raises(ValueError, match=r"bad.jsonl, split 'train': .*bad.jsonl line 1 is not one JSON object "
                                         r"\(Expecting value at column 1\): not json$"):
        source_blocks(str(tmp_path / "bad.jsonl"), tokenizer, length=16)
    rows = [json.dumps({"text": f"document {i} " * 8}) for i in range(6)]
    rows[3] += " x"  # trailing data: pandas' error names only a byte position
    (tmp_path / "glued.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"glued.jsonl line 4 is not one JSON object \(Extra data at column \d+\): "
                                         r'\{"text": "document 3'):
        source_blocks(str(tmp_path / "glued.jsonl"), tokenizer, length=16)
    (tmp_path / "list.jsonl").write_text('{"text": "a b c"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"list.jsonl line 2 is a JSON list, not an object"):
        source_blocks(str(tmp_path / "list.jsonl"), tokenizer, length=16)


@pytest.mark.parametrize("item", ["data/goood.jsonl", "corpora/notes.txt", "./data/goood", "~/data/train.parquet"])
def test_a_missing_path_is_never_sent_to_the_hub(item):
    """A path-like string (relative or absolute by its start, or with a data-file suffix) that is not there is "no
    such file", even in the owner/name shape of a Hub id; a plain owner/name stays a Hub dataset."""
    with pytest.raises(FileNotFoundError, match=rf"data.source: {item}: no such file or folder"):
        parse_sources(item)
    assert parse_sources("HuggingFaceFW/fineweb-edu")[0].path == "HuggingFaceFW/fineweb-edu"
