"""The mixer contract (hf_mixers/testing.py) over every registered mixer and a hybrid of all of them with attention.

Parametrised from the registry: a mixer registered tomorrow is checked here without editing this file.
"""

import pytest

from hf_mixers import list_mixers
from hf_mixers.testing import CHECKS, check_from_attention, contract_names

MIXERS = contract_names()


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", MIXERS)
def test_mixer_contract(name, check):
    check(name)


def test_the_contract_covers_the_built_in_mixers():
    assert {"full_attention", "sliding_attention", "sessa", "rsa", "rsa[window]", "hybrid"} <= set(MIXERS)


def test_from_attention_errors_are_measured():
    errors = check_from_attention("rsa")
    assert set(errors) == {"rsa/llama", "rsa/qwen2", "rsa/qwen3"}
    assert all(0.0 < error < 10.0 for error in errors.values())  # RSA is approximate at init, but finite


def test_every_mixer_module_registers_and_every_spec_reaches_the_derived_tables():
    import importlib
    import pkgutil

    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_mixers.mixers
    from hf_mixers import config_class, model_classes
    from hf_mixers.apps.cli import build_parser
    from hf_mixers.model.export import import_closure, registration_list

    specs = {spec.name: spec for spec in list_mixers()}
    for info in pkgutil.iter_modules(hf_mixers.mixers.__path__):
        module = importlib.import_module(f"hf_mixers.mixers.{info.name}")
        assert any(getattr(module, key) is spec for key in dir(module) for spec in specs.values()), info.name
    convert = build_parser()._subparsers._group_actions[0].choices["convert"]
    mixer_choices = next(action.choices for action in convert._actions if action.dest == "mixer")
    for spec in list_mixers(convertible=True):
        assert spec.name in mixer_choices
        config = config_class(spec.name)
        assert config.model_type == spec.name and AutoConfig.for_model(spec.name).__class__ is config
        assert AutoModelForCausalLM._model_mapping[config] is model_classes(spec.name)[1]
        shipped = import_closure(registration_list([spec.name])[0])  # what a folder of this mixer saves
        module = spec.mixer_class.__module__
        assert module.removeprefix("hf_mixers.") in shipped or f"ext:{module}" in shipped
