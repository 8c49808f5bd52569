"""Before trusting a saved model folder: do its weights match what its config.json describes?

transformers fills a tensor missing from the weights with a fresh initialisation and only logs it, so a folder whose
safetensors lost ``lm_head.weight`` still loads, with a random head. ``check_model_weights`` compares the saved
tensor names and shapes (read from the safetensors headers, shards included) with the model the config builds (on
the meta device: no memory, no weights) and names every missing, unexpected or mis-shaped tensor. ``hf-mixers push``,
``eval`` and ``card`` all run it.
"""

from __future__ import annotations

import json
import os


class FolderError(ValueError):
    """A saved model folder whose files do not hold the model they describe; the message names the file and tensor."""


def saved_tensors(folder: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, file)} of every top-level ``*.safetensors`` file of ``folder``, from the headers."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    found[key] = (tuple(handle.get_slice(key).get_shape()), name)
        except Exception as error:  # SafetensorError, OSError: the file is damaged
            raise FolderError(f"{path}: the safetensors file does not load ({type(error).__name__}: {error})") from None
    if not found:
        raise FolderError(f"{folder}: no *.safetensors weights (save the model with save_pretrained)")
    return found


def expected_tensors(folder: str, trust_remote_code: bool = False) -> tuple[dict, set[str], str]:
    """({name: shape} of the model config.json describes, names that may be absent because they are tied, class)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise FolderError(f"{os.path.join(folder, 'config.json')}: cannot build the model it describes "
                          f"({type(error).__name__}: {error})") from None
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    tied = set()
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        tied_keys = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(tied_keys) if isinstance(tied_keys, (dict, list, set, tuple)) else set()
    return shapes, tied, type(model).__name__


def check_known_model_type(folder: str, config: dict) -> None:
    """Refuse, by name, a model type neither transformers nor a registered mixer (plugins included) knows, before any
    code would run: transformers' own error would ask for trust_remote_code, which these commands do not take."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .. import load
    from ..core.registry import PLUGIN_MODULES

    load()
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise FolderError(f"{folder}: model_type {model_type!r} is not a model transformers or hf-mixers knows; if it "
                          f"is a plugin's mixer, name its module in {PLUGIN_MODULES} (eval also takes "
                          "--trust-remote-code to run the folder's own code)")


def check_model_weights(folder: str, trust_remote_code: bool = False) -> None:
    """Raise FolderError naming every tensor the saved weights lack, add or shape differently from the config's
    model (``trust_remote_code``: build a model type only the folder's own code knows)."""
    folder = os.path.abspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FolderError(f"{folder}: no config.json; pass a saved model folder")
    try:
        config = json.loads(open(os.path.join(folder, "config.json"), encoding="utf-8").read())
    except ValueError as error:
        raise FolderError(f"{os.path.join(folder, 'config.json')}: not valid JSON: {error}") from None
    if not trust_remote_code:
        check_known_model_type(folder, config)
    saved = saved_tensors(folder)
    expected, tied, model_class = expected_tensors(folder, trust_remote_code)
    missing = sorted(set(expected) - set(saved) - tied)
    unexpected = sorted(set(saved) - set(expected))
    misshaped = [f"{name} is {saved[name][0]} in {saved[name][1]}, the config's model has {shape}"
                 for name, shape in sorted(expected.items()) if name in saved and saved[name][0] != shape]
    problems = ([f"missing {', '.join(missing[:5])}" + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")]
                if missing else []) + ([f"unexpected {', '.join(unexpected[:5])}"] if unexpected else []) + misshaped[:5]
    if problems:
        raise FolderError(f"{folder}: the saved weights do not match the {model_class} that config.json describes: "
                          + "; ".join(problems))
