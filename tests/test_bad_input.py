"""Bad input, by class: every numeric flag and recipe field has a range, checked before any work, named in the error.

Each class is tested as a class (every flag, every field), not only by the example that found it.
"""

import argparse
import dataclasses
import typing

import pytest

from hf_mixers.apps.cli import build_parser, main
from hf_mixers.recipes import RecipeError, load_recipe
from hf_mixers.recipes.config import Recipe

COMMAND_PREFIX = {"convert": ["convert", "teacher", "--mixer", "rsa", "--out", "out"], "eval": ["eval", "model"],
                  "demo": ["demo"], "bench": ["bench", "sessa"]}


def _numeric_flags():
    """(command, flag, least) of every integer option of every command."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command, sub in commands.items():
        for action in sub._actions:
            if action.type is int or action.type is float:
                yield command, action.option_strings[0], None
            name = getattr(action.type, "__name__", "")
            if name.startswith("integer >= "):
                yield command, action.option_strings[0], int(name.removeprefix("integer >= "))


def test_no_numeric_flag_is_unchecked():
    unchecked = [(command, flag) for command, flag, least in _numeric_flags() if least is None]
    assert not unchecked, f"integer flags without a range: {unchecked}"


@pytest.mark.parametrize("command, flag, least", [f for f in _numeric_flags() if f[0] in COMMAND_PREFIX],
                         ids=lambda value: str(value))
def test_a_numeric_flag_below_its_range_is_one_line_naming_it(command, flag, least, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*COMMAND_PREFIX[command], flag, str(least - 1)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: must be >= {least}, got {least - 1}" in error


def test_list_flags_refuse_non_positive_entries(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rsa", "--contexts", "1024,0"])
    assert "argument --contexts: expected comma-separated integers >= 1, got '1024,0'" in capsys.readouterr().err


def _bounded_fields():
    for section in dataclasses.fields(Recipe):
        for item in dataclasses.fields(section.default_factory()):
            hint = typing.get_type_hints(section.default_factory)[item.name]
            numeric = {int, float} & set(typing.get_args(hint) or (hint,))
            if numeric and item.type != "bool":
                yield section.name, item.name, item.metadata.get("range")


def test_every_numeric_recipe_field_declares_its_range():
    unbounded = [f"{s}.{n}" for s, n, bounds in _bounded_fields() if bounds is None]
    assert unbounded == ["train.zero_stage"]  # a choice (1, 2 or 3), checked by name in _validate


@pytest.mark.parametrize("section, name, bounds", [f for f in _bounded_fields() if f[2] is not None],
                         ids=lambda value: str(value))
def test_a_recipe_number_out_of_range_names_the_key_and_range(section, name, bounds):
    low, high, low_open, high_open = bounds
    bad = low if low_open else low - 1
    with pytest.raises(RecipeError, match=rf"{section}\.{name} must be [>]=? {low}.*, got {bad}"):
        load_recipe([], [f"{section}.{name}={bad}"])
    if high is not None:
        with pytest.raises(RecipeError, match=rf"{section}\.{name} must be .*, got {high}"):
            load_recipe([], [f"{section}.{name}={high}"])


def test_an_enabled_stage_with_no_steps_is_refused():
    with pytest.raises(RecipeError, match="stage2.steps is 0 but the stage is enabled: set stage2.enabled=false"):
        load_recipe([], ["stage2.steps=0"])
    assert load_recipe([], ["stage2.steps=0", "stage2.enabled=false"]).stage2.steps == 0


def test_the_library_refuses_the_same_numbers_before_any_work():
    from hf_mixers.common.corpus import token_blocks
    from hf_mixers.conversion import convert

    with pytest.raises(ValueError, match="sequence_length must be an integer >= 2, got 0"):
        convert("no/such/teacher", "rsa", sequence_length=0)
    with pytest.raises(ValueError, match="heldout_sequences must be an integer >= 1, got 0"):
        convert("no/such/teacher", "rsa", heldout_sequences=0)
    with pytest.raises(ValueError, match="calibration text: token blocks need a positive integer length, got 0"):
        token_blocks(None, "to be or not to be", 0, 4, what="calibration text")
