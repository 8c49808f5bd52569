"""The mixer contract (hf_mixers/testing.py) over every registered mixer and a hybrid of all of them with attention.

Parametrised from the registry: a mixer registered tomorrow is checked here without editing this file. Each mixer's base
configuration runs every check; its tiny variants (``"rsa[window]"``) run the math checks, marked ``variant`` (the full
tier only), as is every mixer's whole-graph compile of a block and, but RSA's, its compiled decode. The variants' and
the hybrid's compiled decode is traced by dynamo and AOTAutograd without Inductor's code generation
(conftest.compile_decode_without_inductor): each base configuration compiles its step with Inductor. Remote code is
proven once per mixer, all of them loaded by one fresh process.
"""

import pytest

from conftest import compile_decode_without_inductor

from hf_mixers import get_mixer, list_mixers
from hf_mixers.conversion.families import SUPPORTED_FAMILIES
from hf_mixers.testing import CHECKS, HYBRID, check_block_compiles_whole, check_compiled_decode, \
    check_from_attention, check_remote_code, contract_names, remote_code_failures

MIXERS = contract_names()
BASES = [name for name in MIXERS if "[" not in name]
MATH_CHECKS = [check for check in CHECKS if check is not check_remote_code]
FULL_TIER_CHECKS = (check_block_compiles_whole,)  # seconds of tracing each: the full tier only
# The compiled decode builds an Inductor step (10-15 s each on a clean cache): make test-fast builds RSA's, the
# recurrent step most mixers share; the full tier every mixer's.
FAST_COMPILED_DECODE = "rsa"


def _full_tier(name, check) -> bool:
    return "[" in name or check in FULL_TIER_CHECKS or (check is check_compiled_decode and name != FAST_COMPILED_DECODE)


CASES = [pytest.param(name, check, id=f"{name}-{check.__name__.removeprefix('check_')}",
                      marks=[pytest.mark.variant] if _full_tier(name, check) else [])
         for name in MIXERS for check in MATH_CHECKS]


@pytest.mark.parametrize("name, check", CASES)
def test_mixer_contract(name, check, monkeypatch):
    if check is check_compiled_decode and ("[" in name or name == HYBRID):
        compile_decode_without_inductor(monkeypatch)
    check(name)


@pytest.fixture(scope="module")
def remote_code():
    return remote_code_failures(BASES)


@pytest.mark.parametrize("name", BASES)
def test_remote_code(name, remote_code):
    if remote_code[name]:
        pytest.fail(remote_code[name], pytrace=False)


def test_the_contract_covers_the_built_in_mixers_and_their_variants():
    assert {"full_attention", "sliding_attention", "sessa", "rsa", "rsa[window]", HYBRID} <= set(MIXERS)
    assert {name for name in MIXERS if "[" in name} == {f"{spec.name}[{variant}]" for spec in list_mixers()
                                                        for variant in get_mixer(spec.name).tiny_variants}


def test_from_attention_errors_are_measured():
    errors = check_from_attention("rsa")
    assert set(errors) == {f"rsa/{family}" for family in SUPPORTED_FAMILIES}
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
