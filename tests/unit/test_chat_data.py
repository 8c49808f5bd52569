"""Chat data for finetune (recipes/sft.py): TRL's layouts, every assistant turn learned, packing, datasets."""

import json

import pytest
import torch

from conftest import tiny_tokenizer

from hf_mixers.recipes.sft import chat_examples, conversation, conversation_tokens, encode

pytestmark = pytest.mark.unit

DIALOGUE = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "Nay, answer me."},
            {"role": "user", "content": "Long live the king!"}, {"role": "assistant", "content": "Bernardo?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def learned(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])


def test_every_assistant_turn_is_learned_and_nothing_else(tokenizer):
    ids, labels = conversation_tokens(tokenizer, DIALOGUE)
    assert ids == tokenizer.apply_chat_template(DIALOGUE, tokenize=True, return_dict=False)
    assert all(label in (-100, token) for token, label in zip(ids, labels))
    assert learned(tokenizer, ids, labels) == "assistant: Nay, answer me.\nassistant: Bernardo?\n"
    ids, labels = conversation_tokens(tokenizer, DIALOGUE, turns="last")
    assert learned(tokenizer, ids, labels) == "assistant: Bernardo?\n"


def test_trl_layouts_give_the_same_conversation():
    prompt = {"prompt": "Who goes there?", "completion": "Nay, answer me."}
    lists = {"prompt": [DIALOGUE[0]], "completion": [DIALOGUE[1]]}
    assert conversation(prompt, "x") == conversation(lists, "x") == DIALOGUE[:2]
    assert conversation({"prompt": "Who goes there?", "response": "Nay, answer me."}, "x") == DIALOGUE[:2]
    assert conversation({"chat": DIALOGUE}, "x", messages_field="chat") == DIALOGUE
    with pytest.raises(ValueError, match=r"row 3: expected 'messages', or 'prompt' with 'completion'"):
        conversation({"question": "?"}, "row 3")
    with pytest.raises(ValueError, match="x: no field 'chat'"):
        conversation({"messages": DIALOGUE}, "x", messages_field="chat")


def test_packing_fills_rows_with_eos_between_examples(tokenizer):
    examples = [DIALOGUE[:2], DIALOGUE, DIALOGUE[2:]] * 3
    padded = encode(tokenizer, examples, 128)  # long enough to cut nothing
    packed = encode(tokenizer, examples, 64, packing=True)
    assert padded.shape[0] == 9 and packed.shape[0] < 9
    stream = [t for full, _ in (conversation_tokens(tokenizer, m) for m in examples) for t in full
              + [tokenizer.eos_token_id]]
    assert packed[:, 0].flatten()[:len(stream)].tolist() == stream
    assert packed[0, 1].tolist().count(-100) < 64 and (packed[:-1, 0] != tokenizer.pad_token_id).any(dim=1).all()
    # the labels learned in the packed rows are the labels of the padded rows, in order
    assert [t for t in packed[:, 1].flatten().tolist() if t != -100] == \
        [t for t in padded[:, 1].flatten().tolist() if t != -100]


def test_a_chat_dataset_holds_out_its_validation_split(tmp_path):
    for split, rows in (("train", [{"chat": DIALOGUE}] * 5), ("validation", [{"chat": DIALOGUE[:2]}] * 2)):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    source = {"path": "json", "messages_field": "chat",
              "data_files": {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "validation")}}
    train, heldout, how = chat_examples(source)
    assert train == [DIALOGUE] * 5 and heldout == [DIALOGUE[:2]] * 2 and how == "its validation split"
    with pytest.raises(ValueError, match=r"train.jsonl, split 'train': no 'messages', and no 'prompt' with "
                                         r"'completion'"):
        chat_examples({"path": "json", "data_files": str(tmp_path / "train.jsonl")})
    assert torch.is_tensor(encode(tiny_tokenizer(), train, 64))


def test_a_streamed_chat_dataset_is_read_only_as_far_as_needed(tmp_path):
    """streaming: true reads the chat data as a stream: the validation split's first examples held out (or, without
    one, the stream's first STREAM_HELDOUT), then as many training examples as asked for, in order; nothing more is
    read, and a stream too short to hold anything out says so."""
    from hf_mixers.recipes.sft import STREAM_HELDOUT

    dialogue = lambda n: [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]  # noqa: E731
    count = STREAM_HELDOUT + 40
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"messages": dialogue(n)}) for n in range(count)))
    (tmp_path / "validation.jsonl").write_text("\n".join(json.dumps({"messages": dialogue(-n)}) for n in range(90)))
    files = {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "validation")}
    train, heldout, how = chat_examples({"path": "json", "data_files": files, "streaming": True}, needed=7)
    assert train == [dialogue(n) for n in range(7)] and heldout == [dialogue(-n) for n in range(STREAM_HELDOUT)]
    assert how == f"the first {STREAM_HELDOUT} examples of validation split"
    train, heldout, how = chat_examples({"path": "json", "data_files": {"train": files["train"]}, "streaming": True},
                                        needed=10)
    assert heldout == [dialogue(n) for n in range(STREAM_HELDOUT)] and how.endswith("examples of its stream")
    assert train == [dialogue(n) for n in range(STREAM_HELDOUT, STREAM_HELDOUT + 10)]
    train, _, _ = chat_examples({"path": "json", "data_files": {"train": files["train"]}, "streaming": True})
    assert len(train) == 40  # needed=None: the rest of the stream
    (tmp_path / "short.jsonl").write_text(json.dumps({"messages": dialogue(0)}))
    with pytest.raises(ValueError, match=r"short.jsonl.*no training examples \(0 read for training, 1 held out: "
                                         r"the first 1 examples of its stream\)"):
        chat_examples({"path": "json", "data_files": str(tmp_path / "short.jsonl"), "streaming": True})
