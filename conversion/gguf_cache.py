"""A GGUF teacher decoded once: its de-quantised tensors, tokenizer and licence kept as a plain model folder.

Reading a GGUF file is slow in transformers (pure Python: the metadata parsed for the config, again for the
tensors and again for the tokenizer, whose vocabulary is then rebuilt token by token: tens of seconds for
SmolLM2-135M's file on a small CPU). The same tensors from safetensors load in under a second. So the first load of a
GGUF file writes what it decoded into

    $HF_MIXERS_CACHE/gguf/<file stem>-<key>/    (default ~/.cache/hf-mixers/gguf)
        config.json, model.safetensors, tokenizer files, decoded.json (written last)

and later loads read that folder; processes that miss it at once decode it one at a time (a lock file beside it),
the later ones then read what the first wrote. The key covers the file (absolute path, size, modification time),
the dtype it was decoded to and the transformers version that decoded it: a changed file or another transformers
decodes again, and the entry it replaces is removed. An entry appears whole or not at all (written beside it, then renamed); a
failed write or an unreadable entry never fails a load, it only costs the slow path. ``HF_MIXERS_GGUF_CACHE=off``
turns the cache off.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import logging
import os
import shutil

import torch

from ..common.files import cache_folder, finish_modes, staging_folder

logger = logging.getLogger("hf_mixers")
RECORD = "decoded.json"  # written last: an entry without it is not used


def cache_root() -> str | None:
    """The folder of the decoded GGUF files, or None when ``HF_MIXERS_GGUF_CACHE`` turns the cache off."""
    if os.environ.get("HF_MIXERS_GGUF_CACHE", "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    return cache_folder("gguf")


def entry_folder(path: str, dtype: torch.dtype) -> str | None:
    """Where the decode of the GGUF file ``path`` to ``dtype`` is (or would be) cached; None if the cache is off."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = "\0".join((path, str(stat.st_size), str(stat.st_mtime_ns), str(dtype), transformers.__version__))
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def read_entry(folder: str | None) -> dict | None:
    """The record of a complete entry (the GGUF file, dtype, licence, whether it has a tokenizer), or None. An entry
    is renamed into place whole, so a folder whose record is missing or unreadable is damaged: it is removed (named
    in a warning), else no later load could write the entry again."""
    if folder is None or not os.path.isdir(folder):
        return None
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as handle:
            record = json.load(handle)
        if isinstance(record, dict):
            return record
        raise ValueError(f"{RECORD} is not a JSON object")
    except (OSError, ValueError) as error:
        discard_entry(folder, error)
        return None


def decode_lock(folder: str | None):
    """A lock held while ``folder`` is decoded and written (filelock, as huggingface_hub locks its downloads), so a
    second process waits for the first's entry instead of decoding the same file beside it; no lock without a
    cache, or where the lock file cannot be made (the load goes on without it)."""
    import contextlib

    from filelock import FileLock

    if folder is None:
        return contextlib.nullcontext()
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        return FileLock(folder + ".lock").acquire()  # held now; released when the caller's `with` ends
    except OSError:  # a read-only or missing cache: decode without it
        return contextlib.nullcontext()


def remove_lock(folder: str | None) -> None:
    if folder is not None and os.path.exists(folder + ".lock"):
        try:
            os.remove(folder + ".lock")
        except OSError:  # never in place of the error that brought us here
            pass


def discard_entry(folder: str, reason: BaseException) -> None:
    logger.warning("hf_mixers: the cached decode %s cannot be read (%s); decoding the GGUF file again", folder, reason)
    shutil.rmtree(folder, ignore_errors=True)


def write_entry(folder: str | None, gguf_path: str, model, tokenizer, license: str | None) -> None:
    """Save a decoded GGUF teacher into ``folder``: the config (without the GGUF quantisation note, for which
    transformers refuses to save the model), the tensors, the tokenizer, then the record. Another process's finished
    entry wins; any failure is logged and the load goes on."""
    from safetensors.torch import save_model

    if folder is None or os.path.isdir(folder):
        return
    record = {"gguf_file": os.path.abspath(gguf_path), "dtype": str(model.dtype), "license": license,
              "has_tokenizer": tokenizer is not None}
    staging = None
    try:
        staging = staging_folder(folder)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        save_model(model, os.path.join(staging, "model.safetensors"))  # tied tensors (embeddings and head) once
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=2)
        finish_modes(staging)  # readable by whoever may read the cache folder (mkdtemp alone: 0700)
        os.rename(staging, folder)  # fails if another process finished first: its entry is as good as ours
        staging = None
    except Exception as error:  # a full disk, a read-only cache, a tokenizer that cannot save: the load goes on
        if not os.path.isdir(folder):
            logger.warning("hf_mixers: could not cache the decoded GGUF file in %s (%s); the next load decodes it "
                           "again", folder, error)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    if os.path.isdir(folder):
        _remove_replaced(folder, record)


def _remove_replaced(folder: str, record: dict) -> None:
    """Remove the entries of the same file and dtype that ``folder`` replaces (the file changed since, or
    transformers did), so the cache holds one decode of a file per dtype."""
    for other in glob.glob(os.path.join(glob.escape(os.path.dirname(folder)), "*", RECORD)):
        other_folder = os.path.dirname(other)
        found = read_entry(other_folder)
        if other_folder != folder and found and (found.get("gguf_file"), found.get("dtype")) == \
                (record["gguf_file"], record["dtype"]):
            shutil.rmtree(other_folder, ignore_errors=True)
            remove_lock(other_folder)
