"""The GLTM paper's claims: its pattern theory (§4: shortest information paths, per-token reads and cache sizes),
computed from the implementation's own supports (kernels/token_patterns.py), and its Table 1 (§5.2: copy,
associative recall and multi-hop recall across mixers), trained on the tasks of hf_mixers/tasks/gltm.py."""

from __future__ import annotations

import math

import torch

from ...kernels.token_patterns import longest_shortest_path, pattern_support
from ...tasks.checks import IGNORE
from ...tasks.gltm import associative_recall, copy_task, curriculum_divisor, multi_hop_recall, vocab_layout
from . import claim
from .training import scored_accuracy, tiny_model, train

PATTERNS = ("ssm", "banded", "pow2", "pow2_ce", "quad", "quad_ce", "dense")
# max |P(i)| / nnz(B) / longest shortest path at T = 128, 256 (path lengths computed exactly by BFS) and 1024, 2048
EXPECTED = {"ssm": [(1, 127, 127), (1, 255, 255), (1, 1023), (1, 2047)],
            "banded": [(8, 988, 16), (8, 2012, 32), (8, 8156), (8, 16348)],
            "pow2": [(7, 769, 7), (8, 1793, 8), (10, 9217), (11, 20481)],
            "pow2_ce": [(7, 769, 7), (8, 1793, 8), (10, 9217), (11, 20481)],
            "quad": [(12, 1018, 4), (16, 2840, 4), (32, 22320), (46, 62767)],
            "quad_ce": [(10, 824, 5), (13, 2240, 5), (25, 16869), (36, 46639)],
            "dense": [(127, 8128, 1), (255, 32640, 1), (1023, 523776), (2047, 2096128)]}


@claim("gltm-patterns", "GLTM (§4: Props. 4.4-4.12, App. D)",
       "pow2 reads and caches ceil(log2 T) positions with log2-hop paths; quad reads O(sqrt T) with at most 4 hops; "
       "their cache-efficient variants keep those costs in a bounded cache (pow2_ce exactly, quad_ce with paths of "
       "at most 6 hops); ssm and banded need T - 1 and T / w hops")
def gltm_patterns(out_dir: str, scale: str) -> dict:
    lengths = (128, 256, 1024, 2048)
    rows, mismatches = [], []
    for pattern in PATTERNS:
        for length, expected in zip(lengths, EXPECTED[pattern]):
            supports = pattern_support(pattern, length)
            row = {"pattern": pattern, "T": length, "max |P|": max(len(r) for r in supports),
                   "nnz(B)": sum(len(r) for r in supports)}
            if length <= 256:
                row["longest shortest path"] = longest_shortest_path(supports)
            measured = (row["max |P|"], row["nnz(B)"]) + ((row["longest shortest path"],) if length <= 256 else ())
            if measured != expected:
                mismatches.append(f"{pattern} at T = {length}: {measured} vs {expected}")
            rows.append(row)
    logs = all(next(r["max |P|"] for r in rows if r["pattern"] == "pow2_ce" and r["T"] == t) == math.ceil(
        math.log2(t - 1)) for t in lengths)
    return {"paper_value": "pow2: ceil(log2 T) reads, log2 T hops; quad: ceil(sqrt(T - 1)) reads, <= 4 hops; exact "
                           "counts (max |P| / nnz / longest path) tabulated from the definitions for T = 128 ... 2048",
            "ours": "every count equal" if not mismatches else "; ".join(mismatches),
            "holds": not mismatches and logs, "table": rows,
            "notes": ["computed from pattern_support, the supports the layer uses; the longest shortest path by an "
                      "exact BFS from every source, at T <= 256 (O(T^3) per hop)",
                      "the exact table is our derivation from the paper's definitions (the paper states the "
                      "asymptotics); tests/unit/test_token_patterns.py checks the same numbers"]}


TASKS = ("copy", "associative recall", "multi-hop recall")
# Table 1's rows: (registered mixer, its options); the models are otherwise identical (2 blocks, width, data, steps).
# Attention and local attention are the plain attention mixers; the rest are gltm patterns, solved densely as the
# paper did (masked T x T matrices, one triangular solve: exact for every pattern, and the fastest at these lengths).
RECALL_MIXERS = {"attention": ("full_attention", {}),
                 "local attention (w = 8)": ("sliding_attention", {"sliding_window": 8}),
                 "diagonal SSM": ("gltm", {"gltm_pattern": "ssm"}),
                 "k-th order recurrence (banded, w = 8)": ("gltm", {"gltm_pattern": "banded", "gltm_bandwidth": 8}),
                 "dense recurrence": ("gltm", {"gltm_pattern": "dense"}),
                 "f(k) = 2^k": ("gltm", {"gltm_pattern": "pow2"}),
                 "f(k) = 2^k, cache-efficient": ("gltm", {"gltm_pattern": "pow2_ce"}),
                 "f(k) = k^2 + 1": ("gltm", {"gltm_pattern": "quad"}),
                 "f(k) = k^2 + 1, cache-efficient": ("gltm", {"gltm_pattern": "quad_ce"})}
# the paper's Table 1: copy / associative recall / multi-hop recall accuracy (%), in RECALL_MIXERS' order
PAPER_TABLE_1 = ((100.00, 100.00, 39.21), (23.75, 26.20, 23.59), (42.98, 32.53, 27.17), (74.66, 41.12, 39.08),
                 (100.00, 99.99, 99.80), (92.63, 49.03, 34.85), (75.47, 52.59, 38.63), (99.66, 53.61, 35.68),
                 (91.59, 54.56, 38.02))
# vocabulary; the largest copy length L and recall pair count N (the curriculum's last phase); model width and heads;
# training steps (4 equal curriculum phases), sequences per step and peak learning rate; fresh final-phase test
# batches and their size. cpu: lr 1e-3, the paper's 3e-3 lowered for 32 sequences a step instead of >= 1024 (at 3e-3
# attention did not learn associative recall at all), N = 12 so that attention learns it within the steps.
RECALL_SCALES = {"smoke": dict(vocab=16, copy_length=4, pairs=2, width=16, heads=2, steps=4, batch=4, lr=1e-3,
                               tests=2, test_batch=4),
                 "cpu": dict(vocab=64, copy_length=32, pairs=12, width=64, heads=2, steps=800, batch=32, lr=1e-3,
                             tests=32, test_batch=32),
                 "paper": dict(vocab=8192, copy_length=128, pairs=64, width=256, heads=4, steps=20_000, batch=1024,
                               lr=3e-3, tests=10, test_batch=1024)}
MARGIN = 20.0  # percentage points: how far above local attention "much better" is in the verdict


@claim("gltm-recall", "GLTM (§5.2, Table 1: copy, associative recall, multi-hop recall)",
       "attention and the dense recurrence solve copy and associative recall where local attention fails; on "
       "multi-hop recall only the dense recurrence succeeds (paper: 99.80% vs attention's 39.21%); the sparse "
       "patterns fall in between")
def gltm_recall(out_dir: str, scale: str) -> dict:
    """2-block models that differ only in the mixer, each trained on each task with a shortened Mamba-2 curriculum
    (4 equal phases dividing the task's size by 8, 4, 2, 1) and scored on fresh final-phase sequences."""
    size = RECALL_SCALES[scale]
    length = max(2 * size["copy_length"] + 2, 4 * size["pairs"])  # the longest sequence: copy 2L + 2, recall 4N
    device = "cuda" if scale == "paper" and torch.cuda.is_available() else "cpu"
    rows = []
    for (name, (mixer, options)), paper in zip(RECALL_MIXERS.items(), PAPER_TABLE_1):
        row = {"mixer": name}
        for task, paper_accuracy in zip(TASKS, paper):
            model = _recall_model(mixer, options, size["vocab"], length, size["width"], size["heads"]).to(device)

            def batch(step):  # every mixer sees the same data: seeded by the step
                divisor = curriculum_divisor(step, size["steps"])
                tokens, targets, _, _ = _recall_batch(task, size, size["batch"], divisor, seed=step)
                return tokens.to(device), targets.to(device)

            train(model, batch, size["steps"], lr=size["lr"], cosine=True, weight_decay=0.1, clip=1.0,
                  desc=f"gltm-recall {name}: {task}")
            model.cpu()  # scored_accuracy counts on the CPU
            hits, counts = torch.zeros(2), torch.zeros(2)  # per group: one hop / two or more (multi-hop only)
            for test in range(size["tests"]):  # each final-phase batch draws its own size, as in training
                tokens, _, targets, hops = _recall_batch(task, size, size["test_batch"], 1, seed=1_000_000 + test)
                accuracy, scored = scored_accuracy(model, tokens, targets, (hops >= 2).long(), 2)
                hits += torch.tensor(accuracy) * torch.tensor(scored)
                counts += torch.tensor(scored)
            row[task] = 100 * hits.sum().item() / counts.sum().item()
            row[f"{task} (paper)"] = paper_accuracy
            if task == "multi-hop recall":
                row["multi-hop, >= 2 hops"] = 100 * (hits[1] / counts[1].clamp(min=1)).item()
        rows.append(row)
    return _recall_verdict(rows, scale, size)


def _recall_batch(task: str, size: dict, count: int, divisor: int, seed: int):
    """One batch at 1/divisor of the task's largest size: (count, T) tokens, training targets, scored targets and
    each scored position's hop count (1 but for multi-hop). Multi-hop trains on the labels at intermediary keys too
    (the paper's help to learning) and is scored on the queries only."""
    vocab = size["vocab"]
    if task == "copy":
        tokens, targets = copy_task(count, max(1, size["copy_length"] // divisor), vocab=vocab, seed=seed)
        return tokens, targets, targets, torch.ones_like(tokens)
    pairs = max(1, size["pairs"] // divisor)
    if task == "associative recall":
        tokens, targets = associative_recall(count, pairs, vocab=vocab, seed=seed)
        return tokens, targets, targets, torch.ones_like(tokens)
    tokens, targets, intermediary, hops = multi_hop_recall(count, pairs, vocab=vocab, seed=seed)
    return tokens, torch.where(intermediary != IGNORE, intermediary, targets), targets, hops


def _recall_model(mixer: str, options: dict, vocab: int, length: int, width: int, heads: int):
    """A 2-block model of ``mixer`` (the paper's: the first block prepares the tokens, the second transports)."""
    if mixer == "sliding_attention":  # the attention config defaults to full attention: name the layers
        options = {**options, "layer_types": ["sliding_attention"] * 2}
    if mixer == "gltm":
        options = {**options, "gltm_solver": "dense"}
    return tiny_model(mixer, vocab, length, width=width, layers=2, heads=heads, **options)


def _recall_verdict(rows: list, scale: str, size: dict) -> dict:
    """The paper's robust orderings: the dense recurrence at least as good as attention on multi-hop (1 point of
    slack for noise), attention and the dense recurrence well above local attention on copy and recall."""
    by_name = {row["mixer"]: row for row in rows}
    attention, local, dense = by_name["attention"], by_name["local attention (w = 8)"], by_name["dense recurrence"]
    checks = {"dense recurrence >= attention - 1 on multi-hop recall":
              dense["multi-hop recall"] >= attention["multi-hop recall"] - 1,
              **{f"{model['mixer']} >= local attention + {MARGIN:.0f} on {task}": model[task] >= local[task] + MARGIN
                 for model in (attention, dense) for task in TASKS[:2]}}
    layout = vocab_layout(size["vocab"])
    return {"paper_value": "copy / AR / multi-hop (%): " + "; ".join(
                f"{name} {copy:.2f} / {recall:.2f} / {hops:.2f}"
                for name, (copy, recall, hops) in zip(RECALL_MIXERS, PAPER_TABLE_1)),
            "ours": "; ".join(f"{row['mixer']} {row[TASKS[0]]:.1f} / {row[TASKS[1]]:.1f} / {row[TASKS[2]]:.1f}"
                              for row in rows),
            "holds": None if scale == "smoke" else all(checks.values()),
            "table": rows,
            "notes": [f"scale {scale}: {size}; chance is {100 / len(layout.content):.1f}% on copy and "
                      f"{100 / len(layout.values):.1f}% on recall",
                      "holds requires every one of: " + "; ".join(
                          f"{check} ({'yes' if passed else 'no'})" for check, passed in checks.items()),
                      "the mixers: full_attention, sliding_attention (8 tokens including the current one) and the "
                      "gltm mixer's seven patterns of the paper (ssm, banded w = 8, dense, pow2, pow2_ce, quad, "
                      "quad_ce; gate mamba2, dense solver); Llama-style blocks (RMSNorm, SwiGLU MLP of 2 x width, "
                      "RoPE, untied embeddings) instead of the paper's GPT-2 + RoPE",
                      f"training, identical for every model: AdamW, lr {size['lr']:g}, weight decay 0.1, gradient "
                      "clip 1, 5% warmup then cosine (the paper: lr 3e-3, 2k of 20k steps warmup, beta2 0.98, fp16; "
                      "the paper scale runs in fp32, on the GPU when there is one); the curriculum's 4 phases are "
                      "steps / 4 each; one size drawn per batch; the same data for every model",
                      "local attention's floor: its 2 layers of 8 tokens reach 14 tokens back, so it can copy "
                      "sequences of L <= 13 and answer the queries that come within 14 tokens of their bind",
                      "the generators are our reconstruction (hf_mixers/tasks/gltm.py); multi-hop trains on the "
                      "labels at intermediary keys as well and is scored on the queries only; 'multi-hop, >= 2 "
                      "hops' is its accuracy on the queries whose chain has at least 2 bindings; a chain ends on "
                      "one of few genuine values in the sequence, so guessing among those scores well above chance",
                      "the paper's numbers are probably single runs, and so are ours (seed 0)"]}
