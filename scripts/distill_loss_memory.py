#!/usr/bin/env python3
"""Peak host memory of one stage-2 loss + backward at a 128K vocabulary: the dense loss (full logits) against the
chunked one (kernels/distill_loss.py) at several chunk sizes, each in a fresh process (ru_maxrss is per process).

A two-layer Llama (hidden 256, vocabulary 128,256 as Llama-3's, tied head) as teacher and a copy of it as student
(head frozen, as under LoRA), batch 2 x 2,048 tokens, KL + 0.5 CE, on CPU, in fp32 or (``--dtype bfloat16``) with
bf16 weights under bf16 autocast, as train.precision=bf16 runs. Writes distill_loss_memory[_bfloat16].json to --out.

  python scripts/distill_loss_memory.py [--out outputs/bench] [--chunks 0,1024,512,256] [--dtype bfloat16]
      [--vocab V --hidden D --batch B --length T]   (another model's ratio of vocabulary to width)
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _status(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 2**20  # GiB


def _reset_peak() -> float:
    """The resident size now, the peak reset to it (Linux: clear_refs 5), so that building the models, which may
    have peaked higher, does not hide the loss's own peak; elsewhere the peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return _status("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _peak() -> float:
    try:
        return _status("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(chunk_rows: int, batch: int, length: int, dtype: str, vocab: int = 128256, hidden: int = 256) -> dict:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mixers.recipes.precision import autocast
    from hf_mixers.recipes.stages import distillation_loss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    teacher = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    student = copy.deepcopy(teacher).train()
    student.get_output_embeddings().weight.requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (batch, length))
    before = _reset_peak()
    began = time.perf_counter()
    with autocast(getattr(torch, dtype), torch.device("cpu")):
        loss, _ = distillation_loss(student, teacher, 1.0, 0.5, chunk_rows)(ids)
    loss.backward()
    seconds = time.perf_counter() - began
    peak = _peak()
    rows = min(chunk_rows or batch * length, batch * length)
    return {"chunk_rows": chunk_rows, "loss": loss.item(), "peak_rss_gib": round(peak, 2),
            "over_models_gib": round(peak - before, 2), "seconds": round(seconds, 1),
            # in fp32 (rows, vocab) tensors: the plan's LOSS_TENSORS_PER_CHUNK_ROW (dense: LOSS_TENSORS_DENSE)
            "fp32_logit_tensors": round((peak - before) * 2**30 / (rows * vocab * 4), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/bench")
    parser.add_argument("--chunks", default="0,1024,512,256", help="chunk_rows values (0: the dense loss)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (default: Llama-3's)")
    parser.add_argument("--hidden", type=int, default=256, help="the models' width")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batch, args.length, args.dtype, args.vocab, args.hidden)))
        return 0
    rows = []
    for chunk in map(int, args.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, "--one", str(chunk), "--batch", str(args.batch), "--length",
                              str(args.length), "--dtype", args.dtype, "--vocab", str(args.vocab), "--hidden",
                              str(args.hidden)], capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(("dense" if chunk == 0 else f"chunks of {chunk}") + f": +{rows[-1]['over_models_gib']} GiB over the "
              f"models ({rows[-1]['fp32_logit_tensors']} fp32 logit tensors), peak {rows[-1]['peak_rss_gib']} GiB, "
              f"{rows[-1]['seconds']} s, loss {rows[-1]['loss']:.4f}")
    os.makedirs(args.out, exist_ok=True)
    name = "distill_loss_memory" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as handle:
        json.dump({"benchmark": "distill_loss_memory", "vocab": args.vocab, "hidden": args.hidden, "batch": args.batch,
                   "length": args.length,
                   "dtype": args.dtype, "threads": os.cpu_count(), "results": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
