"""Load a saved folder through remote code in a fresh Python process where hf_mixers cannot be imported.

This is what a Hub user without hf_mixers gets; the demo, the tests and (later) ``push`` use it to prove a folder
is self-contained. The child process blocks every ``hf_mixers`` import, loads the folder with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, and returns logits and greedy tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

_LOADER = r"""
import importlib.abc, os, sys, traceback

class BlockHfMixers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_mixers" or name.startswith("hf_mixers."):
            raise ImportError(f"hf_mixers is blocked in this process ({name})")

sys.meta_path.insert(0, BlockHfMixers())
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

def load(job):
    model_dir, inputs = job["model_dir"], job
    # what pipelines, evaluation harnesses and most scripts call first, without trust_remote_code
    tokenizer = None
    if os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
        tokenizer = type(AutoTokenizer.from_pretrained(model_dir)).__name__
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    tokens = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], do_sample=False,
                            max_new_tokens=inputs["max_new_tokens"], pad_token_id=inputs["pad_token_id"])
    if job["resave_dir"]:
        model.save_pretrained(job["resave_dir"])
    return {"logits": logits, "tokens": tokens, "class": type(model).__name__, "module": type(model).__module__,
            "tokenizer": tokenizer}

input_path, output_path = sys.argv[1:3]
results = []
for job in torch.load(input_path):
    try:
        result = load(job)
    except Exception:
        result = {"error": traceback.format_exc()}
    result["hf_mixers_imported"] = any(m == "hf_mixers" or m.startswith("hf_mixers.") for m in sys.modules)
    results.append(result)
torch.save(results, output_path)
"""


def load_in_fresh_process(model_dir, input_ids, attention_mask=None, max_new_tokens=8, pad_token_id=0,
                          resave_dir=None, timeout=900) -> dict:
    """Returns {"logits", "tokens", "class", "module", "tokenizer", "hf_mixers_imported", "seconds"} from the child
    process; "tokenizer" is the class ``AutoTokenizer.from_pretrained(model_dir)`` gives without trust_remote_code
    (None when the folder has no tokenizer).

    Raises RuntimeError with the child's traceback if loading fails (e.g. a missing remote-code file).
    """
    (outputs,) = load_many_in_fresh_process([dict(model_dir=model_dir, input_ids=input_ids,
                                                  attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                                  pad_token_id=pad_token_id, resave_dir=resave_dir)], timeout)
    if "error" in outputs:
        raise RuntimeError(f"remote-code load of {model_dir} failed in a fresh process without hf_mixers:\n"
                           f"{outputs['error'][-4000:]}")
    return outputs


def load_many_in_fresh_process(jobs: list[dict], timeout=900) -> list[dict]:
    """Several folders loaded one after the other in one fresh process (one start-up of torch and transformers).
    Each job: model_dir, input_ids and optionally attention_mask, max_new_tokens, pad_token_id, resave_dir; each
    result as ``load_in_fresh_process`` returns it, or {"error": the child's traceback, "hf_mixers_imported",
    "seconds"} when that folder failed. Folders need distinct names: transformers caches remote code by folder name.
    """
    names = [os.path.basename(os.path.normpath(str(job["model_dir"]))) for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"load_many_in_fresh_process: folder names must differ (remote code is cached by the "
                         f"folder's name), got {names}")
    defaults = dict(attention_mask=None, max_new_tokens=8, pad_token_id=0, resave_dir=None)
    jobs = [{**defaults, **job} for job in jobs]
    for job in jobs:
        job["model_dir"], job["resave_dir"] = str(job["model_dir"]), str(job["resave_dir"] or "")
        if job["attention_mask"] is None:
            job["attention_mask"] = torch.ones_like(job["input_ids"])
    with tempfile.TemporaryDirectory(prefix="hf-mixers-remote-") as scratch:
        input_path, output_path = os.path.join(scratch, "inputs.pt"), os.path.join(scratch, "outputs.pt")
        torch.save(jobs, input_path)
        # A private module cache: the child compiles the folders' own files, never a stale copy.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": os.path.join(scratch, "modules")}
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _LOADER, input_path, output_path], capture_output=True,
                                text=True, env=env, timeout=timeout)
        if result.returncode != 0:
            folders = ", ".join(job["model_dir"] for job in jobs)
            raise RuntimeError(f"remote-code load of {folders} failed in a fresh process without hf_mixers:\n"
                               f"{result.stderr[-4000:]}")
        outputs = torch.load(output_path)
    seconds = (time.perf_counter() - start) / len(jobs)
    for output in outputs:
        output["seconds"] = seconds
    return outputs
