"""``hf-mixers diagnose TARGET``: lag sensitivity ||dy_t / dx_{t-l}|| of a mixer layer or a model, with its tail fit
and the mixer theory's prediction (common/lag_sensitivity.py), as diagnose.json and diagnose.png.

TARGET is a registered mixer name (one freshly initialised layer of the given width and heads, on Gaussian inputs:
what the architecture does before training) or a model folder (each chosen layer's mixer on that layer's real inputs
for the given text, and the whole model from input embeddings to the last hidden state).
"""

from __future__ import annotations

import json
import math
import os

import torch
from tqdm.auto import tqdm

from ..common.files import write_atomically
from ..common.history import save_figure
from ..common.lag_sensitivity import PROTOCOL, fit_tail, lag_sensitivity
from ..core.registry import get_mixer, list_mixers
from ..model.config import config_class


def diagnose(target: str, out_dir: str, length: int = 256, source: int = 0, probes: int = 8, layers=None,
             text: str | None = None, hidden_size: int = 576, num_heads: int = 9, num_kv_heads: int = 3,
             options: dict | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Measure, fit, write; returns the report."""
    torch.manual_seed(seed)
    if os.path.isdir(target):
        config_path = os.path.join(target, "config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as handle:
                config = json.load(handle)
            limit = config.get("max_position_embeddings")
            if isinstance(limit, int) and length > limit:
                raise ValueError(f"diagnose: --length {length} is more than the model's max_position_embeddings "
                                 f"({limit})")
            hidden_size = config.get("hidden_size", hidden_size)
        _check_memory(length, probes, hidden_size)
        entries = _folder_entries(target, length, layers, text)
    elif target in {spec.name for spec in list_mixers()}:
        _check_memory(length, probes, hidden_size)
        entries = [_fresh_layer(target, length, hidden_size, num_heads, num_kv_heads, options or {}, seed)]
    else:
        names = ", ".join(spec.name for spec in list_mixers())
        raise ValueError(f"diagnose: {target!r} is neither a model folder nor a registered mixer ({names})")
    results = []
    for entry in tqdm(entries, desc="diagnose: lag sensitivity", unit="entry", disable=not progress):
        gains = lag_sensitivity(entry["fn"], entry["inputs"], source=source, probes=probes, seed=seed)
        results.append({"name": entry["name"], "kind": entry["kind"], "gains": {str(k): v for k, v in gains.items()},
                        "fit": fit_tail(gains), "theory": entry["theory"]})
    report = {"target": target, "protocol": PROTOCOL, "source": source, "length": length, "probes": probes,
              "entries": results}
    os.makedirs(out_dir, exist_ok=True)
    write_atomically(os.path.join(out_dir, "diagnose.json"), json.dumps(report, indent=2) + "\n")
    _plot(report, os.path.join(out_dir, "diagnose.png"))
    return report


def _check_memory(length: int, probes: int, hidden_size: int) -> None:
    """Refuse, before any work, a measurement that cannot fit: the probes' inputs and outputs and the activations a
    backward pass keeps are about 16 tensors of (probes, length, hidden) in fp32 (an estimate, on the safe side)."""
    needed = 16 * probes * length * hidden_size * 4
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            available = 1024 * int(next(line for line in handle if line.startswith("MemAvailable")).split()[1])
    except (OSError, StopIteration):
        return  # no /proc: nothing to compare with
    if needed > available:
        raise ValueError(f"diagnose: --length {length} with --probes {probes} needs about {needed / 2**30:.1f} GiB "
                         f"(16 x probes x length x {hidden_size} fp32 values), more than the "
                         f"{available / 2**30:.1f} GiB available: lower --length or --probes")


def _theory(kind, mixer, inputs, rope) -> dict | None:
    """What the mixer's theory predicts (its spec's ``lag_theory``), or None where it has none."""
    law = get_mixer(kind).lag_theory
    return None if law is None else law(mixer, inputs, rope)


def _layer_fn(mixer, rope):
    """x (P, T, D) -> the mixer's output, with its (cos, sin) repeated for the P probes."""
    return lambda x: mixer(x, tuple(r.expand(x.shape[0], -1, -1) for r in rope))


def _fresh_layer(name, length, hidden_size, num_heads, num_kv_heads, options, seed):
    """One scratch-initialised layer of mixer ``name`` in a one-layer model (its _init_weights, its RoPE)."""
    from ..model.modeling import model_classes

    spec = get_mixer(name)
    options = spec.checked_options(options, "diagnose --option")
    config = config_class(name)(vocab_size=128, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                                num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                max_position_embeddings=max(length, 2048), layer_types=[name], **options)
    config._attn_implementation = "sdpa"  # causal without a mask (called outside a model, no mask is built)
    model = model_classes(name)[1](config).eval()
    mixer = model.model.layers[0].mixer
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(1, length, hidden_size, generator=generator)
    rope = model.model.rotary_emb(inputs, torch.arange(length)[None])
    return {"name": f"{name} layer (scratch init)", "kind": name, "inputs": inputs,
            "fn": _layer_fn(mixer, rope),
            "theory": _theory(name, mixer, inputs, rope)}


def _folder_entries(folder, length, layers, text):
    """Per chosen layer: its mixer on the layer's real (normed) inputs for ``text``; and the whole model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..common.corpus import shakespeare

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"diagnose: {folder} has no config.json: pass a saved model folder (convert / distill "
                         "output) or a registered mixer's name")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text if text is not None else shakespeare("heldout"), return_tensors="pt").input_ids
    if ids.shape[1] < length:
        raise ValueError(f"diagnose: the text has {ids.shape[1]} tokens, fewer than --length {length}")
    ids = ids[:, :length]
    blocks = model.model.layers
    count = len(blocks)
    chosen = sorted(set(layers)) if layers else sorted({0, count // 3, 2 * count // 3, count - 1})
    bad = [i for i in chosen if not 0 <= i < count]
    if bad:
        raise ValueError(f"diagnose: layers {bad} out of range: the model has {count} layers")
    captured = {}

    def hook(index):
        def record(module, args, kwargs, output):
            captured[index] = (args[0] if args else kwargs["hidden_states"],
                               kwargs.get("position_embeddings", args[1] if len(args) > 1 else None))
        return record

    handles = [blocks[i].mixer.register_forward_hook(hook(i), with_kwargs=True) for i in chosen]
    try:
        with torch.no_grad():
            model.model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    entries = []
    for index in chosen:
        mixer, (hidden, rope) = blocks[index].mixer, captured[index]
        kind = model.config.layer_types[index]
        entries.append({"name": f"layer {index} ({kind})", "kind": kind, "inputs": hidden,
                        "fn": _layer_fn(mixer, rope),
                        "theory": _theory(kind, mixer, hidden, rope)})
    embeddings = model.model.embed_tokens(ids).detach()
    entries.append({"name": "whole model (embeddings -> last hidden state)", "kind": "model", "inputs": embeddings,
                    "fn": lambda x: model.model(inputs_embeds=x, use_cache=False).last_hidden_state, "theory": None})
    return entries


def _plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5.5))
    for entry in report["entries"]:
        lags = sorted(int(k) for k in entry["gains"])
        gains = [entry["gains"][str(k)] for k in lags]
        fit = entry["fit"]
        label = entry["name"]
        if "power" in fit:
            label += f": tail l^{fit['power']['exponent']:.2f} (R2 {fit['power']['r2']:.2f}), " \
                     f"e^-{fit['exponential']['rate']:.3g} l (R2 {fit['exponential']['r2']:.2f})"
        (line,) = axis.loglog(lags, gains, marker=".", label=label)
        law = entry["theory"]
        parameter = None if not law else law.get("exponent", law.get("rate"))
        if parameter is not None and math.isfinite(parameter) and "power" in fit:
            anchor = min((lag for lag in lags if lag >= fit["tail_from"]), default=lags[0])
            base = entry["gains"][str(anchor)]
            if law["law"] == "power":
                predicted = [base * (lag / anchor) ** law["exponent"] for lag in lags]
                name = f"theory l^{law['exponent']:.2f}"
            else:
                predicted = [base * math.exp(-law["rate"] * (lag - anchor)) for lag in lags]
                name = f"theory e^-{law['rate']:.3g} l"
            axis.loglog(lags, predicted, linestyle="--", color=line.get_color(), alpha=0.7, label=name)
    axis.set_xlabel("lag l")
    axis.set_ylabel("||dy_t/dx_s||_F / sqrt(D)")
    axis.set_title(f"{os.path.basename(str(report['target']).rstrip('/'))}: {report['protocol']}, s = "
                   f"{report['source']}", fontsize=9)
    axis.legend(fontsize=7)
    save_figure(figure, path)
