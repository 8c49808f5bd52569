"""Folders saved by earlier versions still load and give the same logits.

tests/fixtures/legacy/ holds tiny models saved by hf-mixers at commit fc316e3 (before the mixer registry): Sessa
(llama block, two feedback heads), Sessa with the paper's native block, RSA with every option on (short conv,
decay, RSA-q) and a hybrid of RSA, full and sliding attention. Every parameter was perturbed off its init, and
``expected.safetensors`` holds the logits that code gave on a left-padded batch. The .py remote-code files were left
out: this checks the config and weight format, read by the installed package.
"""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "legacy")


@pytest.mark.parametrize("name", sorted(os.listdir(FIXTURES)))
def test_a_folder_saved_by_an_earlier_version_gives_the_same_logits(name):
    folder = os.path.join(FIXTURES, name)
    expected = load_file(os.path.join(folder, "expected.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
