"""hf-mixers: turn a pretrained Transformer into a model with new sequence mixers (Sessa, RSA, ...).

``import hf_mixers`` is cheap (no torch, so ``hf-mixers --help`` answers at once). The first name used from it
(``hf_mixers.SessaConfig``, ``from hf_mixers import register_mixer``, ...), or any import of its model code, loads
the model core: that registers the built-in mixers and, for each, ``<Title>Config`` / ``<Title>Model`` /
``<Title>ForCausalLM`` with transformers' Auto classes (``model_type`` = the mixer's name); ``hf_mixers.load()``
does it explicitly. A mixer of your own: subclass ``SequenceMixer``, describe it in a ``MixerSpec`` and call
``register_mixer`` (docs/adding-a-mixer.md).
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # for IDEs and type checkers: the names __getattr__ gives at run time  # noqa: F401
    from .core.mixer import SequenceMixer
    from .core.registry import MixerOption, MixerSpec, get_mixer, list_mixers, on_register, register_mixer
    from .model.classes import *  # noqa: F403  (SessaConfig, RSAForCausalLM, ...)
    from .model.config import MixerConfig, config_class
    from .model.modeling import MixerForCausalLM, MixerModel, model_classes

# public name -> the module that defines it
_EXPORTS = {
    "SequenceMixer": "core.mixer",
    **dict.fromkeys(("MixerSpec", "MixerOption", "register_mixer", "get_mixer", "list_mixers", "on_register"),
                    "core.registry"),
    **dict.fromkeys(("MixerConfig", "config_class"), "model.config"),
    **dict.fromkeys(("MixerModel", "MixerForCausalLM", "model_classes"), "model.modeling"),
}


def load() -> None:
    """Load the model core: the built-in mixers registered, with transformers' Auto classes (idempotent)."""
    importlib.import_module(".model", __name__)


def __getattr__(name: str):
    """The public API on first use, and ``hf_mixers.SessaConfig``, ``hf_mixers.RSAForCausalLM``, ...: the classes
    derived for each registered mixer."""
    if name.startswith("__"):
        raise AttributeError(name)
    load()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    from .core import registry
    from .model import config, modeling

    for spec in registry.list_mixers(convertible=True):  # a plugin's classes too
        for cls in (config.config_class(spec.name), *modeling.model_classes(spec.name)):
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module 'hf_mixers' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_EXPORTS})


__all__ = ["load", *_EXPORTS]
