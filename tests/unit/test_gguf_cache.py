"""The decoded-GGUF cache (conversion/gguf_cache.py): a GGUF teacher is decoded once, later loads read the plain
folder it left. Here the slow decode is a tiny stand-in teacher; the real SmolLM2 file is checked in
tests/integration/test_conversion_smollm2.py (the cached load equals the decoded one)."""

import logging
import os

import pytest
import torch

from conftest import tiny_teacher, tiny_tokenizer

from hf_mixers.conversion import gguf_cache
from hf_mixers.conversion import teacher as teacher_module
from hf_mixers.conversion.teacher import Teacher, load_teacher


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file named .gguf whose "decode" is a tiny Llama teacher with a tokenizer and a licence; the decodes are
    counted (``decodes``), and the cache lives in tmp_path/cache."""
    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF stand-in")
    tokenizer = tiny_tokenizer()
    decodes = []

    def decode(path, source, kind, dtype):
        decodes.append(path)
        model = tiny_teacher("llama", len(tokenizer)).to(dtype)
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": os.path.basename(path)}
        return Teacher(model.eval(), tokenizer, source, kind, path, "llama", "apache-2.0")

    monkeypatch.setattr(teacher_module, "_decode_gguf", decode)
    return str(path), decodes


def _same(first: Teacher, second: Teacher) -> None:
    assert (second.source, second.kind, second.path, second.family, second.license) == \
        (first.source, first.kind, first.path, first.family, first.license)
    assert second.stored_dtype == first.stored_dtype
    ours, theirs = first.model.state_dict(), second.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    text = "Shall I compare thee to a summer's day?"
    assert second.tokenizer(text).input_ids == first.tokenizer(text).input_ids
    assert second.tokenizer.eos_token == first.tokenizer.eos_token
    messages = [{"role": "user", "content": text}]
    assert second.tokenizer.apply_chat_template(messages, tokenize=False) == \
        first.tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_gguf_file_is_decoded_once_then_read_from_the_cache(fake_gguf):
    path, decodes = fake_gguf
    decoded = load_teacher(path)
    entry = gguf_cache.entry_folder(path, torch.float32)
    assert decodes == [path] and os.path.isfile(os.path.join(entry, gguf_cache.RECORD))
    assert not [name for name in os.listdir(os.path.dirname(entry)) if ".partial-" in name]
    cached = load_teacher(path)
    assert decodes == [path]  # not decoded again
    _same(decoded, cached)
    assert not hasattr(cached.model.config, "quantization_config")
    load_teacher(path, dtype=torch.bfloat16)  # another dtype is another entry
    assert len(decodes) == 2 and gguf_cache.entry_folder(path, torch.bfloat16) != entry


def test_a_changed_file_is_decoded_again(fake_gguf):
    path, decodes = fake_gguf
    load_teacher(path)
    first = gguf_cache.entry_folder(path, torch.float32)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.entry_folder(path, torch.float32) != first
    load_teacher(path)
    assert len(decodes) == 2
    assert not os.path.exists(first) and os.path.isdir(gguf_cache.entry_folder(path, torch.float32))  # replaced
    assert not os.path.exists(first + ".lock")


def test_a_file_that_fails_to_decode_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    from hf_mixers.conversion.teacher import TeacherLoadError

    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(TeacherLoadError, match="broken.gguf: cannot read the GGUF file"):
        load_teacher(str(broken))
    assert os.listdir(tmp_path / "cache" / "gguf") == []


@pytest.mark.parametrize("damage", ["truncated weights", "garbage weights", "garbage config", "garbage record"])
def test_an_unreadable_entry_is_replaced(fake_gguf, caplog, damage):
    """An entry cut short or overwritten with garbage (each of its files): named in a warning, removed, decoded
    again and written anew; the load never fails for it."""
    path, decodes = fake_gguf
    decoded = load_teacher(path)
    entry = gguf_cache.entry_folder(path, torch.float32)
    name = {"truncated weights": "model.safetensors", "garbage weights": "model.safetensors",
            "garbage config": "config.json", "garbage record": gguf_cache.RECORD}[damage]
    target = os.path.join(entry, name)
    size = os.path.getsize(target)
    with open(target, "r+b") as handle:
        if damage == "truncated weights":
            handle.truncate(size // 2)
        else:
            handle.write(os.urandom(size))
    with caplog.at_level(logging.WARNING, logger="hf_mixers"):
        again = load_teacher(path)
    assert len(decodes) == 2 and "cannot be read" in caplog.text and entry in caplog.text
    _same(decoded, again)
    _same(decoded, load_teacher(path))  # the entry was written anew
    assert len(decodes) == 2


def test_the_cache_can_be_turned_off(fake_gguf, monkeypatch, tmp_path):
    path, decodes = fake_gguf
    monkeypatch.setenv("HF_MIXERS_GGUF_CACHE", "off")
    assert gguf_cache.cache_root() is None and gguf_cache.entry_folder(path, torch.float32) is None
    load_teacher(path)
    load_teacher(path)
    assert len(decodes) == 2 and not (tmp_path / "cache").exists()


def test_a_cache_that_cannot_be_written_never_fails_a_load(fake_gguf, monkeypatch, tmp_path, caplog):
    path, decodes = fake_gguf
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("HF_MIXERS_CACHE", str(blocked))
    with caplog.at_level(logging.WARNING, logger="hf_mixers"):
        teacher = load_teacher(path)
    assert teacher.family == "llama" and "could not cache the decoded GGUF file" in caplog.text
    load_teacher(path)
    assert len(decodes) == 2


def test_a_lock_that_cannot_be_taken_never_fails_a_load(fake_gguf, monkeypatch):
    """A read-only cache folder (root ignores permissions, so the refusal is simulated): decoded without the lock."""
    from filelock import FileLock

    path, decodes = fake_gguf

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", self.lock_file)

    monkeypatch.setattr(FileLock, "acquire", refuse)
    assert load_teacher(path).family == "llama" and len(decodes) == 1


def test_the_cache_sits_in_the_toolkits_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_MIXERS_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_cache.cache_root() == str(tmp_path / ".cache" / "hf-mixers" / "gguf")
    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path / "elsewhere"))
    assert gguf_cache.cache_root() == str(tmp_path / "elsewhere" / "gguf")


def test_processes_that_miss_the_cache_at_once_decode_the_file_once(fake_gguf, monkeypatch):
    """The second loader waits on the first's lock, then reads its entry (a thread stands in for the process)."""
    import threading

    path, decodes = fake_gguf
    quick_decode, started = teacher_module._decode_gguf, threading.Event()

    def slow_decode(*args):
        started.set()
        threading.Event().wait(0.5)  # the second loader arrives during the decode
        return quick_decode(*args)

    monkeypatch.setattr(teacher_module, "_decode_gguf", slow_decode)
    first = threading.Thread(target=load_teacher, args=(path,))
    first.start()
    started.wait(10)
    second = load_teacher(path)
    first.join()
    assert decodes == [path] and second.family == "llama"
