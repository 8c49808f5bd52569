"""``hf-mixers demo``: build a small Sessa LM, train it briefly, generate, save, reload through remote code.

The text is Python's own documentation (``pydoc_data.topics``, part of the standard library), read as bytes, so
nothing is downloaded. Steps: train on 90% of it, measure held-out loss, generate a sample with and without the
cache, save the model atomically, then load the folder in a fresh process where hf_mixers cannot be imported and
check that logits and generated tokens are identical. Everything lands in ``OUT/demo_report.json``.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from .config import SessaConfig
from .export import save_atomically
from .modeling import SessaForCausalLM
from .remote_check import load_in_fresh_process

PROMPT = "The for statement"


def load_text_bytes() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def sample_batch(data: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length - 1, (batch_size,), generator=generator)
    return torch.stack([data[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, length: int, max_windows: int = 16) -> float:
    windows = data[: (len(data) // length) * length].view(-1, length)[:max_windows]
    return model(windows, labels=windows).loss.item()


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def run_demo(out_dir: str, overwrite: bool = False, max_steps: int = 300, seq_len: int = 128, batch_size: int = 8,
             new_tokens: int = 80) -> dict:
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
    start = time.perf_counter()
    torch.manual_seed(0)
    data = load_text_bytes()
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]

    config = SessaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
                         sessa_gamma_bias_init=0.1)
    model = SessaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    initial_loss = held_out_loss(model.eval(), held_out, seq_len)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=max_steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    model.train()
    progress = tqdm(range(max_steps), desc="training Sessa on Python docs", unit="step")
    train_start = time.perf_counter()
    for step in progress:
        batch = sample_batch(train, batch_size, seq_len, generator)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        tokens_per_second = (step + 1) * batch_size * seq_len / (time.perf_counter() - train_start)
        progress.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_second:.0f}")
    train_seconds = time.perf_counter() - train_start
    model.eval()
    final_loss = held_out_loss(model, held_out, seq_len)
    gains = torch.cat([layer.mixer.gain(layer.input_layernorm(model.model.embed_tokens(held_out[None, :256])))
                       for layer in model.model.layers]).detach()

    prompt = torch.tensor([list(PROMPT.encode())])
    cached = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    uncached = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=40,
                             pad_token_id=0)

    model_dir = os.path.join(out_dir, "model")
    os.makedirs(out_dir, exist_ok=True)
    save_atomically(model, model_dir, overwrite=True)
    probe = held_out[: 2 * seq_len].view(2, seq_len)
    remote = load_in_fresh_process(model_dir, probe, max_new_tokens=new_tokens)
    with torch.no_grad():
        local_logits = model(probe).logits
    local_tokens = model.generate(probe, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    report = {
        "model": {"type": "SessaForCausalLM", "parameters": parameters, "layers": config.layer_types,
                  "hidden_size": config.hidden_size, "heads": config.num_attention_heads,
                  "kv_heads": config.num_key_value_heads, "vocab": "bytes (256)"},
        "data": {"source": "pydoc_data.topics (Python standard library)", "train_bytes": len(train),
                 "held_out_bytes": len(held_out)},
        "training": {"steps": max_steps, "batch_size": batch_size, "seq_len": seq_len,
                     "seconds": round(train_seconds, 2),
                     "tokens_per_second": round(max_steps * batch_size * seq_len / train_seconds, 1)},
        "held_out": {"loss_at_init": initial_loss, "loss_after_training": final_loss,
                     "bits_per_byte_after_training": final_loss / math.log(2)},
        "feedback_gain": {"mean_abs": gains.abs().mean().item(), "max_abs": gains.abs().max().item()},
        "generation": {"prompt": PROMPT, "sample": decode(sampled[0, prompt.shape[1]:]),
                       "sampling": "temperature 0.8, top-k 40, seed 0",
                       "cached_equals_uncached": bool(torch.equal(cached, uncached))},
        "remote_code_reload": {"folder": model_dir, "files": sorted(os.listdir(model_dir)),
                               "class_loaded": remote["module"] + "." + remote["class"],
                               "hf_mixers_imported_in_child": remote["hf_mixers_imported"],
                               "max_abs_logit_difference": (remote["logits"] - local_logits).abs().max().item(),
                               "generated_tokens_identical": bool(torch.equal(remote["tokens"], local_tokens)),
                               "seconds": round(remote["seconds"], 2)},
        "total_seconds": round(time.perf_counter() - start, 2),
    }
    with open(os.path.join(out_dir, "demo_report.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    print_report(report, out_dir)
    return report


def print_report(report: dict, out_dir: str) -> None:
    reload = report["remote_code_reload"]
    rows = [
        ("model", f"{report['model']['type']}, {report['model']['parameters'] / 1e6:.2f} M params, "
                  f"layers {report['model']['layers']}"),
        ("training", f"{report['training']['steps']} steps in {report['training']['seconds']} s "
                     f"({report['training']['tokens_per_second']:.0f} tokens/s)"),
        ("held-out loss", f"{report['held_out']['loss_at_init']:.3f} at init -> "
                          f"{report['held_out']['loss_after_training']:.3f} "
                          f"({report['held_out']['bits_per_byte_after_training']:.2f} bits/byte)"),
        ("feedback gain", f"mean |gamma| {report['feedback_gain']['mean_abs']:.3f}, "
                          f"max {report['feedback_gain']['max_abs']:.3f}"),
        ("generate", f"cached == uncached: {report['generation']['cached_equals_uncached']}"),
        ("sample", repr(report["generation"]["prompt"] + report["generation"]["sample"])[:110]),
        ("remote-code load", f"{reload['class_loaded'].split('.')[-1]} without hf_mixers "
                             f"(imported in child: {reload['hf_mixers_imported_in_child']})"),
        ("  same logits", f"max |diff| = {reload['max_abs_logit_difference']:.2e}"),
        ("  same tokens", str(reload["generated_tokens_identical"])),
        ("saved to", reload["folder"]),
        ("report", os.path.join(out_dir, "demo_report.json")),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nhf-mixers demo")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
