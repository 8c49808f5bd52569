"""The mixer contract (hf_mixers/testing.py) over every registered mixer and a hybrid of all of them with attention.

Parametrised from the registry: a mixer registered tomorrow is checked here without editing this file.
"""

import pytest

from hf_mixers import list_mixers
from hf_mixers.testing import CHECKS, HYBRID, check_from_attention

MIXERS = [spec.name for spec in list_mixers()] + [HYBRID]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", MIXERS)
def test_mixer_contract(name, check):
    check(name)


def test_the_contract_covers_the_built_in_mixers():
    assert {"full_attention", "sliding_attention", "sessa", "rsa"} <= set(MIXERS)


def test_from_attention_errors_are_measured():
    errors = check_from_attention("rsa")
    assert set(errors) == {"rsa/llama", "rsa/qwen2", "rsa/qwen3"}
    assert all(0.0 < error < 10.0 for error in errors.values())  # RSA is approximate at init, but finite
