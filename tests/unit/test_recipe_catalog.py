"""Recipes by name (recipes/catalog.py) and the merged recipe printed with its docs: `hf-mixers distill base
stage2_lora_kd ...` from any folder, `--list`, `--print-config`."""

import dataclasses

import pytest
import yaml

from hf_mixers.apps.cli import main as cli_main
from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.catalog import RECIPES_DIR, builtin_recipes, field_docs
from hf_mixers.recipes.config import Recipe, RecipeError, recipe_text


def test_builtin_recipes_are_named_without_a_path_from_any_folder(tmp_path, monkeypatch):
    """From a folder with no recipes/ in it (a pip install), names, names with .yaml and the checkout's relative
    paths all find the packaged files, and give the recipe the files themselves give."""
    files = [f"{RECIPES_DIR}/{name}.yaml" for name in ("base", "stage2_lora_kd", "smollm2_rsa_window")]
    expected = load_recipe(files, ["train.lr=3e-4"])
    monkeypatch.chdir(tmp_path)
    for given in (["base", "stage2_lora_kd", "smollm2_rsa_window"],
                  ["base.yaml", "recipes/stage2_lora_kd.yaml", "smollm2_rsa_window"]):
        assert load_recipe(given, ["train.lr=3e-4"]) == expected
    assert expected.model.mixer_options == {"rsa_window": 64} and expected.stage2.steps == 200


def test_a_missing_recipe_names_the_argument_and_the_builtin_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"smollm2_rsa_windw: cannot read the recipe: no such file, and not a "
                                          r"built-in recipe \(one of base, .*smollm2_rsa_window, .*hf-mixers distill "
                                          r"--list"):
        load_recipe(["base", "smollm2_rsa_windw"])
    with pytest.raises(RecipeError, match="elsewhere/base.yaml: cannot read the recipe: no such file"):
        load_recipe(["elsewhere/base.yaml"])  # only a bare name or recipes/NAME falls back to the packaged ones


def test_every_field_has_its_doc():
    recipe = Recipe()
    for section in dataclasses.fields(recipe):
        docs = field_docs(type(getattr(recipe, section.name)))
        missing = [f.name for f in dataclasses.fields(getattr(recipe, section.name)) if not docs.get(f.name)]
        assert not missing, (section.name, missing)


def test_print_config_is_the_merged_recipe_as_yaml_with_docs_and_defaults(capsys):
    """--print-config: the output read back as YAML is the merged recipe, field for field; each field carries its
    doc and range, and its default where the recipe changed it."""
    assert cli_main(["distill", "base", "stage2_lora_kd", "--set", "train.lr=3e-4", "--print-config"]) == 0
    out = capsys.readouterr().out
    recipe = load_recipe(["base", "stage2_lora_kd"], ["train.lr=3e-4"])
    assert yaml.safe_load(out) == recipe.to_dict()
    assert "  teacher: smollm2-135m  # anything conversion.load_teacher takes\n" in out
    assert "  lr: 0.0003  # the learning rate (stage 2 and finetune may set their own); > 0.0; default: 0.001\n" in out
    assert "  batch_size: 2  # sequences per micro-batch, per process; >= 1\n" in out  # unchanged: no default shown
    assert out.startswith("# the merged recipe of base, stage2_lora_kd, --set train.lr=3e-4")
    assert "; default: " not in recipe_text(Recipe())  # nothing changed


def test_list_names_every_builtin_recipe_with_its_first_sentence(capsys):
    assert cli_main(["distill", "--list"]) == 0
    out = capsys.readouterr().out
    recipes = builtin_recipes()
    assert {"base", "stage2_lora_kd", "zero3", "fsdp", "smollm2_rsa_window"} <= set(recipes)
    for name, description in recipes.items():
        assert description and f"{name}  " in out and description in out
    assert "Stage 2: LoRA (r=8, alpha=16 on q,k,v,o)" in recipes["stage2_lora_kd"]
    assert cli_main(["finetune", "--list"]) == 0
