"""Saving: safetensors + config + self-contained remote code that loads where hf_mixers is not importable."""

import json
import os
import sys

import pytest
import torch
from transformers.dynamic_module_utils import get_imports
from transformers import AutoModelForCausalLM

from conftest import first_in_fast, tiny_sessa_model
from hf_mixers.common.files import save_atomically
from hf_mixers.model.export import flatten_imports, import_closure
from hf_mixers.common.remote_check import load_in_fresh_process



@pytest.mark.parametrize("overrides", first_in_fast(  # ~7 s each (a fresh process); the widest first
    dict(layer_types=["rsa", "sessa"], rsa_num_levels=2, rsa_num_slots=8, rsa_chunk_size=4, rsa_query_read=True),
    dict(), dict(layer_types=["full_attention", "sessa"], qk_norm=True), dict(block="sessa", attention_bias=True)))
def test_remote_code_load_with_hf_mixers_blocked(tmp_path, overrides):
    model = tiny_sessa_model(**overrides)
    model.save_pretrained(tmp_path / "model")
    files = set(os.listdir(tmp_path / "model"))
    assert {"model.safetensors", "config.json"} | {f"{name}.py" for name in import_closure(["model.config", "model.modeling", "mixers.sessa"]).values()} <= files
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hf_mixers.SessaForCausalLM"
    for name in import_closure(["model.config", "model.modeling", "mixers.sessa"]).values():
        # what transformers requires before loading remote code: only torch, transformers and the stdlib (triton is
        # imported in a try block, by the kernel module alone, and only once the dispatch chose it)
        required = set(get_imports(tmp_path / "model" / f"{name}.py"))
        assert required <= {"torch", "transformers", "huggingface_hub"} | sys.stdlib_module_names, (name, required)

    ids = torch.randint(1, 101, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    remote = load_in_fresh_process(tmp_path / "model", ids, mask, max_new_tokens=8, resave_dir=tmp_path / "resaved")
    assert not remote["hf_mixers_imported"] and remote["class"] == "SessaForCausalLM"
    assert remote["module"].startswith("transformers_modules.")
    with torch.no_grad():
        # same weights, same code; another process may split the fp32 reductions differently (seen: 6e-8)
        torch.testing.assert_close(remote["logits"], model(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)
    local_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(remote["tokens"], local_tokens)
    # the folder re-saved by the remote-code model is again complete and loads
    assert {f"{name}.py" for name in import_closure(["model.config", "model.modeling", "mixers.sessa"]).values()} <= set(os.listdir(tmp_path / "resaved"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", trust_remote_code=True)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, attention_mask=mask).logits, remote["logits"])


def test_save_load_round_trip_through_auto_classes(tmp_path):
    model = tiny_sessa_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "SessaForCausalLM" and type(loaded).__module__ == "hf_mixers.model.modeling"
    ids = torch.randint(1, 101, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf16.model.layers[0].mixer.q_proj.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].mixer.gamma_bias.dtype == torch.float32  # b_gamma stays an fp32 scalar


def test_save_atomically_refuses_non_empty_folder_and_leaves_nothing_behind(tmp_path):
    model = tiny_sessa_model()
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        save_atomically(model, target)
    assert os.listdir(target) == ["keep.txt"]
    save_atomically(model, target, overwrite=True)
    assert "model.safetensors" in os.listdir(target) and "keep.txt" not in os.listdir(target)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.partial")]


def test_flatten_imports_rewrites_each_import_at_its_position():
    modules = import_closure(["mixers.rsa", "model.config"])
    source = ('"""Docstring: from ..kernels.feedback_solve import x stays as written."""\n'
              "from ..kernels.rsa_memory import (RSAParams,\n    rsa_memory)  # two lines\n"
              "def f():\n    from ..model.config import MixerConfig\n")
    flat = flatten_imports(source, "mixers.rsa", modules)
    assert flat == ('"""Docstring: from ..kernels.feedback_solve import x stays as written."""\n'
                    "from .rsa_memory import RSAParams, rsa_memory  # two lines\n"
                    "def f():\n    from .configuration_hf_mixers import MixerConfig\n")
    with pytest.raises(ValueError, match=r"mixers.rsa \(line 1\) imports mixers.secret, which cannot be found"):
        flatten_imports("from .secret import z\n", "mixers.rsa", modules)
    with pytest.raises(ValueError, match="imports hf_mixers.mixers.sessa by absolute name"):
        flatten_imports("from hf_mixers.mixers.sessa import z\n", "mixers.rsa", modules)
    with pytest.raises(ValueError, match=r"imports the module\(s\) \['cache'\] from core"):
        flatten_imports("from ..core import cache\n", "mixers.rsa", modules)
    with pytest.raises(ValueError, match="import hf_mixers...' cannot be rewritten"):
        flatten_imports("import hf_mixers.core\n", "mixers.rsa", modules)
    with pytest.raises(ValueError, match="imports hf_mixers.common.corpus, which a saved folder does not ship"):
        flatten_imports("from ..common.corpus import shakespeare\n", "mixers.rsa", modules)


def test_the_saved_folder_holds_the_import_closure_of_the_mixers_it_uses(tmp_path):
    modules = import_closure(["model.config", "model.modeling", "mixers.rsa"])
    assert modules["model.modeling"] == "modeling_hf_mixers" and modules["mixers.rsa"] == "rsa"
    assert "apps.cli" not in modules and "common.corpus" not in modules  # applications never ship
    model = tiny_sessa_model(layer_types=["rsa", "full_attention"], rsa_num_levels=2, rsa_num_slots=4,
                             rsa_chunk_size=4)
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"rsa.py", "rsa_memory.py", "full_attention.py", "mixers.py"} <= files
    assert not {"sessa.py", "feedback_solve.py"} & files  # the config uses no Sessa layer
    assert "from .rsa import RSA" in (tmp_path / "mixers.py").read_text()


def test_fresh_process_load_reports_a_broken_folder(tmp_path):
    model = tiny_sessa_model()
    model.save_pretrained(tmp_path)
    os.remove(tmp_path / "feedback_solve.py")
    with pytest.raises(RuntimeError, match="failed in a fresh process without hf_mixers"):
        load_in_fresh_process(tmp_path, torch.randint(1, 101, (1, 4)))


def test_outputs_get_the_umask_modes_and_a_killed_writer_leaves_nothing_behind(tmp_path):
    import subprocess
    import sys

    from hf_mixers.common.files import write_atomically

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited: its staging leftovers are stale
    stale = tmp_path / f".out.partial-{dead_pid}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    live = tmp_path / f".out.partial-{os.getppid()}-xyz"  # a live writer's staging folder is left alone
    live.mkdir()
    old_mask = os.umask(0o022)
    try:
        save_atomically(tiny_sessa_model(), tmp_path / "out")
        write_atomically(str(tmp_path / "report.json"), "{}")
    finally:
        os.umask(old_mask)
    assert not stale.exists() and live.exists()
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o755
    assert os.stat(tmp_path / "out" / "config.json").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "report.json").st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir() if ".partial" in p.name) == [live.name]


def test_a_safetensors_write_error_is_the_os_error_it_stands_for(tmp_path):
    """safetensors reports a full disk as a SafetensorError holding the OS error: both atomic writers re-raise the
    OSError (errno 28, the path named) and leave no staging behind."""
    import errno

    from safetensors import SafetensorError

    from hf_mixers.common.files import save_atomically, write_atomically

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    class Model:
        save_pretrained = staticmethod(full_disk)

    for write in (lambda: save_atomically(Model(), str(tmp_path / "model")),
                  lambda: write_atomically(str(tmp_path / "file.safetensors"), full_disk)):
        with pytest.raises(OSError) as caught:
            write()
        assert caught.value.errno == errno.ENOSPC and "No space left on device (writing " in str(caught.value)
    assert os.listdir(tmp_path) == []
