"""The one model family every mixer shares. Importing it registers the built-in mixers (config.py imports
mixers/) and every mixer's classes with transformers' Auto classes, for mixers registered now and later."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from ..core.registry import on_register
from .config import MixerConfig, config_class
from .modeling import MixerForCausalLM, MixerModel, model_classes


def _register_auto_classes(config, model, causal_lm) -> None:
    # never exist_ok: a model_type transformers already knows was refused at registration (core/registry.py)
    AutoConfig.register(config.model_type, config)
    AutoModel.register(config, model)
    AutoModelForCausalLM.register(config, causal_lm)


def _unregister_auto_classes(spec) -> None:
    # transformers has no unregister: its mappings keep registered classes in _extra_content
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING._extra_content.pop(spec.name, None)
    for auto in (AutoModel, AutoModelForCausalLM):
        auto._model_mapping._extra_content.pop(config, None)


_register_auto_classes(MixerConfig, MixerModel, MixerForCausalLM)
on_register(lambda spec: None if spec.is_teacher_attention else _register_auto_classes(
    config_class(spec.name), *model_classes(spec.name)), _unregister_auto_classes)
