"""The Sessa paper's trained comparison (its Table 1): Sessa, a Transformer and Mamba-2 decoders that differ only in
the sequence mixer, on SymbolSoup and Diffuse MQAR. The paper gives no sizes or settings; ours are stated in the
results, and the tasks are in hf_mixers/tasks/sessa.py."""

from __future__ import annotations

import torch

from ...tasks.sessa import SYMBOL_SOUP_VOCAB_SIZE, diffuse_mqar, diffuse_mqar_lags, diffuse_mqar_vocab, symbol_soup
from . import claim
from .training import parameter_count, scored_accuracy, tiny_model, train

# the three decoders: our registered mixers, each in its own block (Sessa's block for Sessa, the Llama block else)
DECODERS = {"Sessa": "sessa", "Transformer": "full_attention", "Mamba-2": "selective_ssm"}
PAPER = {"SymbolSoup": {"Sessa": 0.8601, "Transformer": 0.7921, "Mamba-2": 0.0500},
         "Diffuse MQAR": {"Sessa": 0.1541, "Transformer": 0.1222, "Mamba-2": 0.0021}}
WIDTH, LAYERS, HEADS, LR = 64, 2, 2, 3e-3

SOUP_SCALES = {"smoke": dict(tokens=(60, 80), train=40, test=20, steps=3, batch=8),
               "cpu": dict(tokens=(200, 300), train=6000, test=1000, steps=500, batch=32),
               "paper": dict(tokens=(400, 600), train=20_000, test=2000, steps=20_000, batch=32)}


def _ordering(accuracy: dict) -> bool:
    return accuracy["Sessa"] > accuracy["Transformer"] > accuracy["Mamba-2"]


@claim("sessa-symbolsoup", "Sessa (§7, Table 1: SymbolSoup)",
       "on SymbolSoup (20-way style classification of two blocks hidden in noise) Sessa > Transformer > Mamba-2: "
       "0.860 vs 0.792 vs 0.050 (chance)")
def sessa_symbolsoup(out_dir: str, scale: str) -> dict:
    """A fixed training set (the script's splits are fixed), batches drawn from it; the class token is predicted at
    <label>, with the script's tokens minus the spaces and newlines (``whitespace=False``: half the length)."""
    size = SOUP_SCALES[scale]
    low, high = size["tokens"]
    data = symbol_soup(size["train"], low, high, whitespace=False, seed=0)
    test = symbol_soup(size["test"], low, high, whitespace=False, seed=1)
    rows, accuracy = [], {}
    for name, mixer in DECODERS.items():
        model = tiny_model(mixer, SYMBOL_SOUP_VOCAB_SIZE, data.tokens.shape[1], WIDTH, LAYERS, HEADS)
        order = torch.Generator().manual_seed(0)

        def batch(step):
            rows_ = torch.randint(size["train"], (size["batch"],), generator=order)
            return data.tokens[rows_], data.targets[rows_]

        losses = train(model, batch, size["steps"], lr=LR, desc=f"symbolsoup {name}")
        accuracy[name] = scored_accuracy(model, test.tokens, test.targets)[0][0]
        rows.append({"model": name, "parameters": parameter_count(model), "accuracy": accuracy[name],
                     "paper": PAPER["SymbolSoup"][name], "final loss": losses[-1]})
    return {"paper_value": "accuracy: Sessa 0.8601, Transformer 0.7921, Mamba-2 0.0500 (2 seeds)",
            "ours": ", ".join(f"{row['model']} {row['accuracy']:.3f}" for row in rows),
            "holds": None if scale == "smoke" else _ordering(accuracy),
            "table": rows,
            "notes": [f"scale {scale}: {low}-{high} script tokens per example ({data.tokens.shape[1]} without "
                      f"whitespace), {size['train']} training examples, {size['steps']} steps of {size['batch']}, "
                      f"AdamW {LR} cosine; {size['test']} balanced test examples; one seed (the paper: 2)",
                      f"decoders: {LAYERS} layers, width {WIDTH}, {HEADS} heads, identical but for the mixer "
                      "(Mamba-2 is our selective_ssm mixer at its Mamba-2 defaults: conv, gate, output norm); the "
                      "parameter counts are not matched (the paper's are): each mixer brings its own",
                      "the best possible accuracy at the script's 400-600 tokens is about 0.82 (an exact Bayes "
                      "classifier, hf_mixers/tasks/sessa.py), below the paper's 0.86",
                      "holds: accuracy orders Sessa > Transformer > Mamba-2"]}


DMQAR_SCALES = {"smoke": dict(pairs=4, train=(2, 4), test=(8, 16), steps=3, batch=8, tests=16),
                "cpu": dict(pairs=8, train=(4, 16), test=(48, 96), steps=600, batch=32, tests=512),
                "paper": dict(pairs=16, train=(16, 64), test=(192, 256), steps=20_000, batch=32, tests=2000)}


@claim("sessa-diffuse-mqar", "Sessa (§7, Table 1: Diffuse MQAR)",
       "on Diffuse MQAR (multi-token keys, prefix-sharing distractors, test lags up to 4x the training ones) "
       "Sessa > Transformer > Mamba-2: token accuracy 0.154 vs 0.122 vs 0.002")
def sessa_diffuse_mqar(out_dir: str, scale: str) -> dict:
    """Fresh training batches with distractor counts in the training range; scored on held-out sequences at the
    training lags and at lags up to about 4x longer (more distractors between memory and queries)."""
    size = DMQAR_SCALES[scale]
    vocab = diffuse_mqar_vocab().size
    pairs = size["pairs"]
    short = diffuse_mqar(size["tests"], pairs, distractors=size["train"], seed=1_000_000)
    long = diffuse_mqar(size["tests"], pairs, distractors=size["test"], seed=2_000_000)
    rows, accuracy = [], {}
    for name, mixer in DECODERS.items():
        model = tiny_model(mixer, vocab, long.tokens.shape[1], WIDTH, LAYERS, HEADS)
        losses = train(model, lambda step: diffuse_mqar(size["batch"], pairs, distractors=size["train"],
                                                        seed=step)[:2],
                       size["steps"], lr=LR, desc=f"diffuse-mqar {name}")
        at_training_lags = scored_accuracy(model, short.tokens, short.targets)[0][0]
        accuracy[name] = scored_accuracy(model, long.tokens, long.targets)[0][0]
        rows.append({"model": name, "parameters": parameter_count(model), "training lags": at_training_lags,
                     "longer lags": accuracy[name], "paper": PAPER["Diffuse MQAR"][name], "final loss": losses[-1]})
    trained, tested = diffuse_mqar_lags(pairs, distractors=size["train"]), diffuse_mqar_lags(pairs,
                                                                                            distractors=size["test"])
    return {"paper_value": "token accuracy: Sessa 0.1541, Transformer 0.1222, Mamba-2 0.0021 (2 seeds)",
            "ours": "training lags / longer lags: " + ", ".join(
                f"{row['model']} {row['training lags']:.3f} / {row['longer lags']:.3f}" for row in rows),
            "holds": None if scale == "smoke" else _ordering(accuracy),
            "table": rows,
            "notes": [f"scale {scale}: {pairs} pairs of 3-token keys, 32 key and 64 value tokens; training with "
                      f"{size['train']} distractors (lags {trained[0]}-{trained[1]}), tested with {size['test']} "
                      f"(lags {tested[0]}-{tested[1]}); {size['steps']} steps of {size['batch']} fresh sequences, "
                      f"AdamW {LR} cosine; {size['tests']} test sequences each; one seed",
                      "the task is our reconstruction from the paper's prose (no generator was released)",
                      "holds: the accuracy at the longer lags orders Sessa > Transformer > Mamba-2"]}
