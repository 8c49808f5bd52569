"""One folder check before a folder is trusted: the saved tensors must be the model config.json describes.

Each damage (a tensor dropped from the safetensors header, an extra tensor, a mis-shaped one) is refused by
``check_model_weights`` and so by ``hf-mixers push --dry-run``, ``eval`` and ``card``, naming the tensor."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_sessa_model, tiny_tokenizer
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.common.folder import FolderError, check_model_weights

CARD = "---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [hf-mixers]\n---\n# T\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "tiny"
    model = tiny_sessa_model(vocab_size=384)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text(CARD)
    return folder


def _damage(folder, kind):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    if kind == "missing":
        del tensors["lm_head.weight"]  # the head loads as random weights if nothing checks
    elif kind == "unexpected":
        tensors["model.layers.0.mixer.stray.weight"] = torch.zeros(2)
    else:
        tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, path, metadata={"format": "pt"})


DAMAGE = {"missing": r"missing lm_head\.weight", "unexpected": r"unexpected model\.layers\.0\.mixer\.stray\.weight",
          "misshaped": r"model\.norm\.weight is \(7,\) in model\.safetensors, the config's model has \(64,\)"}


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_command_that_trusts_a_folder_refuses_damaged_weights(saved, tmp_path, kind, capsys):
    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    check_model_weights(str(folder))  # intact: no complaint
    _damage(folder, kind)
    with pytest.raises(FolderError, match=rf"the saved weights do not match the SessaForCausalLM .*{DAMAGE[kind]}"):
        check_model_weights(str(folder))
    for command in (["push", "user/tiny", str(folder), "--dry-run"], ["card", str(folder)],
                    ["eval", str(folder), "--teacher", "none", "--heldout-sequences", "1"]):
        capsys.readouterr()
        assert cli_main(command) == 2, command
        error = capsys.readouterr().err
        assert "the saved weights do not match" in error and len(error.strip().splitlines()) == 1, (command, error)
    assert (folder / "README.md").read_text() == CARD  # the card was not rewritten


def test_tied_embeddings_may_be_absent_from_the_file(tmp_path):
    model = tiny_sessa_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    check_model_weights(str(tmp_path))
