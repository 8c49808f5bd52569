"""hf-mixers: turn a pretrained Transformer into a model with new sequence mixers (Sessa, RSA, ...).

Importing the package registers the built-in mixers and, for each, ``<Title>Config`` / ``<Title>Model`` /
``<Title>ForCausalLM`` with transformers' Auto classes (``model_type`` = the mixer's name). A mixer of your own:
subclass ``SequenceMixer``, describe it in a ``MixerSpec`` and call ``register_mixer`` (docs/adding-a-mixer.md).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .core.mixer import SequenceMixer
from .core.registry import MixerOption, MixerSpec, get_mixer, list_mixers, on_register, register_mixer
from .model.config import MixerConfig, config_class
from .model.modeling import MixerForCausalLM, MixerModel, model_classes

__version__ = "0.1.0"


def _register_auto_classes(config, model, causal_lm) -> None:
    # never exist_ok: a model_type transformers already knows was refused at registration (core/registry.py)
    AutoConfig.register(config.model_type, config)
    AutoModel.register(config, model)
    AutoModelForCausalLM.register(config, causal_lm)


_register_auto_classes(MixerConfig, MixerModel, MixerForCausalLM)
on_register(lambda spec: None if spec.is_teacher_attention else _register_auto_classes(
    config_class(spec.name), *model_classes(spec.name)))


def __getattr__(name: str):
    """``hf_mixers.SessaConfig``, ``hf_mixers.RSAForCausalLM``, ...: the classes derived for each registered mixer."""
    for spec in list_mixers(convertible=True):
        for cls in (config_class(spec.name), *model_classes(spec.name)):
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module 'hf_mixers' has no attribute {name!r}")


__all__ = ["SequenceMixer", "MixerSpec", "MixerOption", "register_mixer", "get_mixer", "list_mixers", "on_register",
           "MixerConfig", "MixerModel", "MixerForCausalLM", "config_class", "model_classes"]
