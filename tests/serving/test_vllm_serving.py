"""Converted folders served by the real vLLM engine (its CPU build) through the hf-mixers plugin
(hf_mixers/serving): greedy tokens and their log-probabilities equal ``generate()``'s for 8 concurrent requests of
different lengths (continuous batching: prefills and decodes of several sequences in one step), a folder vLLM
cannot serve is refused with the reason, and ``vllm serve`` answers the OpenAI API.

``make test-vllm`` runs this file in .venv-vllm; in the main environment (no vLLM) it is skipped.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # the engine itself (not any folder named vllm)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the KV and state caches

from hf_mixers.testing import tiny_model  # noqa: E402

pytestmark = pytest.mark.integration
# head_dim 64: vLLM's CPU attention takes no smaller heads (the kept attention layers of the hybrid)
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
SERVED = {"rsa": ("rsa[window]", None), "selective_ssm": ("selective_ssm[window]", None), "vort": ("vort", None),
          "gltm": ("gltm", None),  # pow2_ce: its cache evicts, at fixed slots
          "hybrid": ("rsa[window]", ["rsa", "full_attention", "sliding_attention", "rsa"])}
LENGTHS = (1, 5, 9, 13, 20, 27, 33, 40)  # past the tiny windows (3) and chunks (4); one a decode from its start
BLOCKS = {"rsa": 12, "hybrid": 16}  # cache blocks for the preemption test: fewer than 8 sequences need at once


def _folder(tmp_path, name, layer_types=None):
    extra = {} if layer_types is None else {"layer_types": layer_types, "num_hidden_layers": len(layer_types)}
    model = tiny_model(name, dtype=torch.float32, seed=3, **SHAPE, **extra)
    model.save_pretrained(tmp_path)
    return model, str(tmp_path)


def _prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 61, (length,), generator=generator).tolist() for length in LENGTHS]


def _expected(model, prompts, new_tokens):
    """generate()'s greedy tokens and their log-probabilities, one prompt at a time."""
    expected = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        expected.append((tokens, [torch.log_softmax(score[0], -1)[token].item()
                                  for score, token in zip(out.scores, tokens)]))
    return expected


def _engine(folder, **options):
    """vLLM's engine on the folder; prefix caching off unless asked for (one slot per sequence: its "none" mode)."""
    from vllm import LLM

    return LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
               max_num_seqs=8, seed=0, **{"enable_prefix_caching": False, **options})


def _served_as_generated(outputs, expected, served):
    for output, (tokens, log_probs) in zip(outputs, expected):
        got = output.outputs[0]
        assert list(got.token_ids) == tokens, (served, len(output.prompt_token_ids))
        served_log_probs = [step[token].logprob for step, token in zip(got.logprobs, tokens)]
        assert served_log_probs == pytest.approx(log_probs, abs=1e-5)


@pytest.mark.parametrize("served", list(SERVED))
def test_vllm_serves_a_converted_folder_as_generate_does(served, tmp_path):
    from vllm import SamplingParams

    model, folder = _folder(tmp_path, *SERVED[served])
    prompts = _prompts()
    expected = _expected(model, prompts, 6)
    llm = _engine(folder)
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                               SamplingParams(max_tokens=6, temperature=0.0, detokenize=False, logprobs=1))
    finally:
        llm.llm_engine.engine_core.shutdown()
    _served_as_generated(outputs, expected, served)


@pytest.mark.parametrize("served", ["rsa", "hybrid"])
def test_prefix_caching_and_preemption_keep_generate_tokens(served, tmp_path):
    """vLLM's prefix caching ("align" mode: a state slot per block) and preemption: prompts sharing a 37-token
    prefix, the first alone, then 8 at once in a cache too small for all of them; the later ones start from the
    cached blocks' states, one is preempted and recomputed, and every token is still generate()'s."""
    from vllm import SamplingParams

    model, folder = _folder(tmp_path, *SERVED[served])
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 61, (37,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 61, (length,), generator=generator).tolist() for length in LENGTHS]
    expected = _expected(model, prompts, 12)
    llm = _engine(folder, enable_prefix_caching=True, block_size=16, num_gpu_blocks_override=BLOCKS[served],
                  disable_log_stats=False)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, logprobs=1)
    try:
        assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
        outputs = llm.generate([{"prompt_token_ids": prompts[0]}], sampling)
        outputs += llm.generate([{"prompt_token_ids": ids} for ids in prompts[1:]], sampling)
        metrics = {metric.name: getattr(metric, "value", None) for metric in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown()
    block = 16 if served == "rsa" else 32  # a hybrid's blocks grow until an attention page holds a state slot
    preempted = metrics["vllm:num_preemptions"]
    hits = [output.num_cached_tokens for output in outputs]
    assert preempted >= 1 and hits[0] == 0
    # a request starts from the prefix's cached state unless a preemption evicted those blocks before it ran
    assert sum(hit >= block for hit in hits[1:]) >= len(hits) - 1 - preempted, (hits, preempted)
    _served_as_generated(outputs, expected, served)


def test_a_folder_vllm_cannot_serve_is_refused_with_the_reason(tmp_path, capfd):
    _, folder = _folder(tmp_path, "sessa")
    with pytest.raises(Exception):
        _engine(folder)
    captured = capfd.readouterr()  # the engine's processes log the worker's error
    assert "hf-mixers cannot serve this model in vLLM: layer 0 is 'sessa', whose decode cache keeps tokens" \
        in captured.out + captured.err


def _tokenizer(folder):
    """A tiny word-level tokenizer of the model's 61 ids, with a chat template (what ``vllm serve`` reads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{index}" for index in range(58)]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return fast


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_vllm_serve_answers_completions_and_chat(tmp_path):
    """``vllm serve DIR`` on a loopback port: a completion equals generate()'s tokens, a chat request is answered
    through the folder's chat template; the server then stops."""
    from openai import OpenAI

    model, folder = _folder(tmp_path, *SERVED["rsa"])
    tokenizer = _tokenizer(folder)
    prompt = " ".join(f"w{index}" for index in (4, 17, 9, 30, 12, 8, 41))
    ids = tokenizer(prompt)["input_ids"]
    (tokens, _), = _expected(model, [ids], 5)
    port = _free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "vllm"), "serve", folder, "--port", str(port),
                               "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len",
                               "128", "--max-num-seqs", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.time() < deadline, "vllm serve did not start in 300 s"
            time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        completion = client.completions.create(model=folder, prompt=prompt, max_tokens=5, temperature=0.0)
        assert completion.choices[0].text.split() == tokenizer.convert_ids_to_tokens(tokens)
        chat = client.chat.completions.create(model=folder, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=5, temperature=0.0)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"] \
            == folder
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_bench_serve_measures_a_converted_folder_against_its_teacher(tmp_path):
    """``hf-mixers bench serve`` (vLLM's default mode: compiled): each model at each point, the ratios to the
    teacher's, the JSON and the plot."""
    from hf_mixers.apps.bench.serve import bench_serve

    _folder(tmp_path / "teacher", "full_attention")
    _, converted = _folder(tmp_path / "rsa", *SERVED["rsa"])
    report = bench_serve(str(tmp_path / "out"), str(tmp_path / "teacher"), [converted], concurrency=(1, 3),
                         contexts=(8,), new_tokens=2, cache_gib=1)
    assert [(row["model"], row["concurrency"]) for row in report["rows"]] == [("teacher", 1), ("teacher", 3),
                                                                              ("rsa", 1), ("rsa", 3)]
    assert all(row["output_tokens"] == 2 * row["concurrency"] and row["output_vs_teacher"] > 0
               for row in report["rows"])
    assert report["rows"][0]["output_vs_teacher"] == 1.0
    assert (tmp_path / "out" / "bench_serve.json").exists() and (tmp_path / "out" / "bench_serve.png").exists()
