"""Loading a teacher: a local Hugging Face folder, a hub id, a ``.gguf`` file, or the alias ``smollm2-135m``.

Every path ends in the same place: a transformers causal LM in fp32 and eval mode, its tokenizer (or None) and
where it came from. Predictable mistakes (a missing config or weight file, a corrupt file, an unsupported
architecture, a GGUF file without the ``gguf`` package, a hub id while offline) raise one clear error naming the
file; the family is checked from config.json before any weight is read. A GGUF checkpoint is de-quantised by
transformers once and kept as a plain folder for later loads (gguf_cache.py); the converted model is built from plain
tensors, so the GGUF model's refusal to ``save_pretrained`` never matters here.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from dataclasses import dataclass

import torch

from ..common.corpus import HUB_ID, SMOLLM2_ALIAS, hub_offline, smollm2_gguf_path
from . import gguf_cache
from .families import check_family

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "README.md"]


class TeacherLoadError(ValueError):
    pass


@dataclass
class Teacher:
    model: torch.nn.Module  # a transformers *ForCausalLM, fp32, eval
    tokenizer: object | None
    source: str  # as the user gave it
    kind: str  # "alias" | "folder" | "hub" | "gguf"
    path: str  # the local folder or .gguf file read
    family: str
    license: str | None = None
    stored_dtype: torch.dtype = torch.float32  # the checkpoint's own dtype (config.json's "dtype"; fp32 if unsaid)


def load_teacher(source: str, dtype: torch.dtype = torch.float32) -> Teacher:
    if source == SMOLLM2_ALIAS:
        return _load_gguf(smollm2_gguf_path(), source, "alias", dtype)
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"{source}: no such GGUF file")
        return _load_gguf(source, source, "gguf", dtype)
    if os.path.isdir(source):
        return _load_folder(source, source, "folder", dtype)
    if os.path.exists(source):
        raise TeacherLoadError(f"{source}: a teacher is a model folder, a .gguf file, a hub id or "
                               f"'{SMOLLM2_ALIAS}', not this file")
    if HUB_ID.fullmatch(source):
        return _load_folder(_download(source), source, "hub", dtype)
    raise FileNotFoundError(f"{source}: no such folder or .gguf file, and not a hub id (owner/name) "
                            f"or the alias '{SMOLLM2_ALIAS}'")


def teacher_config(source: str):
    """(transformers config, family) of ``source`` without reading a weight: what the memory plan starts from. A hub
    id fetches config.json only (from the local cache when offline)."""
    from transformers import AutoConfig

    if source == SMOLLM2_ALIAS or source.endswith(".gguf"):
        path = smollm2_gguf_path() if source == SMOLLM2_ALIAS else source
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{source}: no such GGUF file")
        folder, name = os.path.split(os.path.abspath(path))
        config, where = AutoConfig.from_pretrained(folder, gguf_file=name), path
    elif os.path.isdir(source) or HUB_ID.fullmatch(source):
        where = os.path.join(source, "config.json") if os.path.isdir(source) else f"{source}/config.json"
        try:
            config = AutoConfig.from_pretrained(source)
        except (ValueError, OSError, json.JSONDecodeError) as error:
            raise TeacherLoadError(f"{where}: cannot read the config: {error}") from error
    else:
        raise FileNotFoundError(f"{source}: no such folder or .gguf file, and not a hub id (owner/name) "
                                f"or the alias '{SMOLLM2_ALIAS}'")
    return config, check_family(config, where)


def _download(repo_id: str) -> str:
    if hub_offline():
        raise ConnectionError(f"{repo_id}: HF_HUB_OFFLINE is set, so the hub cannot be reached; download the model "
                              f"first (huggingface-cli download {repo_id}) and pass its local folder")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as error:  # network, auth, missing repo: say which repo and why
        raise ConnectionError(f"{repo_id}: could not download from the hub: {error}") from error


def _load_folder(folder: str, source: str, kind: str, dtype) -> Teacher:
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder}: no config.json; a teacher folder is what save_pretrained writes")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, json.JSONDecodeError) as error:
        raise TeacherLoadError(f"{config_path}: cannot read the config: {error}") from error
    family = check_family(config, config_path)
    _check_weight_files(folder)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except Exception as error:  # safetensors header errors, truncated files, pickles: name the folder
        raise TeacherLoadError(f"{folder}: cannot read the weights (corrupt or incomplete file?): {error}") from error
    missing = [name for name in info.get("missing_keys", []) if not name.endswith("rotary_emb.inv_freq")]
    if missing:
        raise TeacherLoadError(f"{folder}: the weight files lack {len(missing)} tensors, e.g. {sorted(missing)[:5]}; "
                               "they would be randomly initialised")
    return Teacher(model.eval(), _tokenizer(folder), source, kind, folder, family, _folder_license(folder),
                   stored_dtype(config))


def stored_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _check_weight_files(folder: str) -> None:
    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present and not glob.glob(os.path.join(folder, "*.safetensors")):
        raise FileNotFoundError(f"{folder}: no weight files (expected one of {', '.join(WEIGHT_FILES)})")
    for index_name in (name for name in present if name.endswith(".index.json")):
        index_path = os.path.join(folder, index_name)
        try:
            with open(index_path, encoding="utf-8") as handle:
                shards = set(json.load(handle)["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise TeacherLoadError(f"{index_path}: not a valid weight index: {error}") from error
        absent = sorted(shard for shard in shards if not os.path.isfile(os.path.join(folder, shard)))
        if absent:
            raise FileNotFoundError(f"{index_path} lists shards that are missing: {absent}")


def _tokenizer(folder: str, **kwargs):
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if "gguf_file" not in kwargs and not any(os.path.isfile(os.path.join(folder, n)) for n in names):
        return None
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def _folder_license(folder: str) -> str | None:
    """``license:`` from the model card's YAML front matter, if there is one."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme):
        return None
    with open(readme, encoding="utf-8") as handle:
        text = handle.read()
    if not text.startswith("---"):
        return None
    for line in text.split("---")[1].splitlines():
        if line.strip().startswith("license:"):
            return line.split(":", 1)[1].strip() or None
    return None


def _load_gguf(path: str, source: str, kind: str, dtype) -> Teacher:
    """A GGUF file's teacher: read from the folder an earlier load decoded it into (conversion/gguf_cache.py),
    else decoded, and that folder written for the next load."""
    entry = gguf_cache.entry_folder(path, dtype)
    teacher = _cached_decode(entry, path, source, kind, dtype)
    if teacher is None:
        try:
            with gguf_cache.decode_lock(entry):  # another process decoding the same file: wait for its entry
                teacher = _cached_decode(entry, path, source, kind, dtype)
                if teacher is None:
                    teacher = _decode_gguf(path, source, kind, dtype)
                    gguf_cache.write_entry(entry, path, teacher.model, teacher.tokenizer, teacher.license)
        except Exception:  # not a readable GGUF file: leave no lock file for it in the cache
            gguf_cache.remove_lock(entry)
            raise
    return teacher


def _cached_decode(entry: str | None, path: str, source: str, kind: str, dtype) -> Teacher | None:
    record = gguf_cache.read_entry(entry)
    if record is None:
        return None
    try:
        return _load_decoded(entry, record, path, source, kind, dtype)
    except Exception as error:  # a damaged entry: decoded again, and replaced
        gguf_cache.discard_entry(entry, error)
        return None


def _load_decoded(folder: str, record: dict, path: str, source: str, kind: str, dtype) -> Teacher:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    family = check_family(config, path)
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, config=config, output_loading_info=True)
    missing = [name for name in info.get("missing_keys", []) if not name.endswith("rotary_emb.inv_freq")]
    if missing:
        raise ValueError(f"the cached tensors lack {sorted(missing)[:5]}")
    tokenizer = _tokenizer(folder) if record.get("has_tokenizer") else None
    return Teacher(model.eval(), tokenizer, source, kind, path, family, record.get("license"))


def _decode_gguf(path: str, source: str, kind: str, dtype) -> Teacher:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{path}: loading a GGUF file needs the 'gguf' package: "
                          "pip install -c constraints.txt gguf accelerate")
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(path))
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as error:  # not a GGUF file, truncated header, unknown GGUF architecture
        raise TeacherLoadError(f"{path}: cannot read the GGUF file: {error}") from error
    family = check_family(config, path)
    try:
        # the config read above: without it from_pretrained parses the file's metadata once more (slow: pure Python)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, config=config)
        tokenizer = _tokenizer(folder, gguf_file=name)
    except Exception as error:
        raise TeacherLoadError(f"{path}: cannot read the GGUF tensors: {error}") from error
    return Teacher(model.eval(), tokenizer, source, kind, path, family, _gguf_license(path))


def _gguf_license(path: str) -> str | None:
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.license")
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:  # licence metadata is optional; a reader hiccup must not block a conversion
        return None
