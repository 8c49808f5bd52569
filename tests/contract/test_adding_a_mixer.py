"""docs/adding-a-mixer.md: the guide's Python blocks, run in order from an empty folder, register a mixer defined
outside the package (sections 1-3 are the file ema_mixer.py, section 4 runs next to it) and pass the contract suite;
the same mixer converts a teacher, distils through the recipes, and ships as remote code."""

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from hf_mixers import get_mixer, list_mixers, register_mixer
from hf_mixers.common.remote_check import load_in_fresh_process
from hf_mixers.core.registry import unregister_mixer

GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "adding-a-mixer.md")


def guide_blocks() -> tuple[str, str]:
    """(ema_mixer.py, the script that runs next to it): the guide's Python blocks of sections 1-3, and of 4 on."""
    text = open(GUIDE, encoding="utf-8").read()
    module, script = [], []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        number = int(section.split(".", 1)[0]) if section[0].isdigit() else 0
        blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
        (module if number <= 3 else script).extend(blocks)
    return "\n\n".join(module), "\n".join(script)


@pytest.fixture(scope="module")
def guide_folder(tmp_path_factory):
    """A folder holding the guide's ema_mixer.py, and nothing else."""
    folder = tmp_path_factory.mktemp("guide")
    (folder / "ema_mixer.py").write_text(guide_blocks()[0], encoding="utf-8")
    return str(folder)


@pytest.fixture
def ema_mixer(guide_folder):
    """The guide's mixer, registered for this test only (the rest of the suite never sees "ema")."""
    sys.path.insert(0, guide_folder)
    try:
        module = importlib.import_module("ema_mixer")  # its first import registers "ema"
    finally:
        sys.path.remove(guide_folder)
    register_mixer(module.EMA)  # again after an earlier test forgot it (a no-op otherwise)
    yield module
    unregister_mixer("ema")


def test_the_guides_blocks_run_in_order_from_an_empty_folder(tmp_path, monkeypatch):
    """Sections 1-3 saved as ema_mixer.py in an empty folder, section 4's block run there as written: it imports the
    file, which registers "ema", and passes ``check_mixer`` (the whole contract suite, remote code included)."""
    module, script = guide_blocks()
    assert "class EMAMixer(SequenceMixer)" in module and "check_mixer(\"ema\")" in script
    (tmp_path / "ema_mixer.py").write_text(module, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ema_mixer", raising=False)  # an earlier test's import would skip registering
    try:
        exec(compile(script, "docs/adding-a-mixer.md, section 4", "exec"), {})
        assert get_mixer("ema").mixer_class.__module__ == "ema_mixer"
        assert "ema" in [spec.name for spec in list_mixers(convertible=True)]
    finally:
        unregister_mixer("ema")
        sys.modules.pop("ema_mixer", None)


def test_a_mixer_registered_by_a_test_is_forgotten_after_it(ema_mixer):
    import hf_mixers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf_mixers.EMAConfig
    assert AutoConfig.for_model("ema").__class__ is config and config in AutoModelForCausalLM._model_mapping
    unregister_mixer("ema")
    with pytest.raises(KeyError, match="unknown mixer 'ema'"):
        get_mixer("ema")
    with pytest.raises(AttributeError):
        hf_mixers.EMAConfig
    with pytest.raises(ValueError, match="Unrecognized model identifier: ema"):
        AutoConfig.for_model("ema")
    assert config not in AutoModelForCausalLM._model_mapping and "ema_decay_init" not in hf_mixers.MixerConfig().to_dict()
    register_mixer(ema_mixer.EMA)  # and it can come back (the fixture forgets it once more)
    assert AutoConfig.for_model("ema").__class__.__name__ == "EMAConfig"
    with pytest.raises(ValueError, match="the teacher's attention kinds stay registered"):
        unregister_mixer("full_attention")


@pytest.mark.integration  # end to end: convert, distil, load; the command line in a subprocess
def test_the_example_mixer_converts_distils_and_loads_without_hf_mixers(ema_mixer, teacher_dir, tmp_path):
    from hf_mixers import EMAForCausalLM
    from hf_mixers.recipes import distill, load_recipe

    out = tmp_path / "run"
    summary = distill(load_recipe([], [f"model.teacher={teacher_dir}", "model.mixer=ema", "data.sequence_length=32",
                                       "data.max_train_sequences=8", "data.heldout_sequences=2", "stage1.steps=2",
                                       "stage2.steps=2", f"output.dir={out}"]), progress=False)
    assert isinstance(summary["model"], EMAForCausalLM)
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "ema" and set(config["mixer_types"]) == {"ema"}
    files = set(os.listdir(out / "model"))
    assert {"ema_mixer.py", "mixers.py"} <= files and not {"rsa.py", "sessa.py"} & files
    saved = (out / "model" / "ema_mixer.py").read_text()
    assert "from .mixer import SequenceMixer" in saved and "hf_mixers" not in saved.split('"""')[-1]
    ids = torch.randint(1, 300, (2, 10))
    remote = load_in_fresh_process(out / "model", ids, max_new_tokens=4)
    assert not remote["hf_mixers_imported"] and remote["class"] == "EMAForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], summary["model"].eval()(ids).logits, rtol=1e-5, atol=1e-6)


def test_names_are_checked_at_registration(ema_mixer):
    spec = ema_mixer.EMA
    for name, message in (("mamba", "reserved: one of transformers' own layer kinds"), ("linear_attention", "reserved"),
                          ("llama", "transformers' model type"), ("Bad-Name", "must match"),
                          ("hf_mixer", "MixerConfig's model type"),
                          ("ema", "already registered")):
        with pytest.raises(ValueError, match=message):
            register_mixer(type(spec)(**{**spec.__dict__, "name": name, "title": "Other", "options": ()}))
    assert register_mixer(spec) is spec  # the same spec again (a module imported twice) is a no-op
    with pytest.raises(ValueError, match="must start with 'other_'"):
        register_mixer(type(spec)(**{**spec.__dict__, "name": "other", "title": "Other"}))


@pytest.mark.integration  # end to end: convert, distil, load; the command line in a subprocess
def test_the_command_line_loads_mixer_plugins(guide_folder, teacher_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [guide_folder, os.environ.get("PYTHONPATH")])),
           "HF_MIXERS_PLUGINS": "ema_mixer"}
    command = [sys.executable, "-m", "hf_mixers", "convert", teacher_dir, "--mixer", "ema", "--out",
               str(tmp_path / "ema"), "--sequence-length", "32", "--calibration-sequences", "2",
               "--heldout-sequences", "1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "ema" / "config.json").read_text())["model_type"] == "ema"
    # a plugin that does not load: one line naming it, for a command and for a help that lists the mixers (the
    # top-level --help loads no plugin: it answers without torch)
    for argv in (command, command[:4] + ["--help"]):
        broken = subprocess.run(argv, env={**env, "HF_MIXERS_PLUGINS": "no_such_mixer_module"},
                                capture_output=True, text=True, timeout=600)
        assert broken.returncode == 2 and broken.stderr.count("\n") == 1, broken.stderr[-2000:]
        assert "HF_MIXERS_PLUGINS: module 'no_such_mixer_module' failed to load" in broken.stderr
    exiting = tmp_path / "exiting_plugin.py"
    exiting.write_text("import sys\nsys.exit(0)\n")  # a plugin must not end the command silently
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]]),
           "HF_MIXERS_PLUGINS": "exiting_plugin"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "module 'exiting_plugin' failed to load: it called sys.exit(0)" in \
        result.stderr


def test_entry_point_plugins_load_once_and_a_failing_one_is_named(monkeypatch):
    import importlib.metadata

    from hf_mixers.core import registry

    calls = []

    class Entry:
        def __init__(self, name, target):
            self.name, self.value, self._target = name, f"pkg:{name}", target

        def load(self):
            return self._target

    entries = [Entry("good", lambda: calls.append("good"))]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: entries if group == registry.PLUGIN_GROUP
                        else [])
    monkeypatch.delenv(registry.PLUGIN_MODULES, raising=False)
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    assert registry.load_plugins() == ["pkg:good"] and registry.load_plugins() == [] and calls == ["good"]

    def broken():
        raise ImportError("no module named mixer_dependency")

    entries[:] = [Entry("broken", broken)]
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    with pytest.raises(RuntimeError, match="hf_mixers plugin 'broken' \\(pkg:broken\\) failed to load: no module"):
        registry.load_plugins()
