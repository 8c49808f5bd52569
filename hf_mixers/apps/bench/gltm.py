"""``hf-mixers bench gltm``: each GLTM pattern's training cost vs SDPA attention, and decoding vs a KV-cache model.

(a) Training: forward+backward time and peak memory of one GLTM layer per pattern (the chunked solve) against the
    attention mixer on SDPA with the same width and heads, at each T (the shared harness: interleaved timing, fastest
    of ``repeats``; CPU peak memory in a fresh process).
(b) Decoding: small models of the same shape, one per pattern, and full attention; each context is prefilled, then
    ``decode_tokens`` single-token steps are timed (median); with the cache's bytes.
Written to bench_gltm.json and .png, with the project's targets for ``pow2_ce`` evaluated in the same run.
"""

from __future__ import annotations

import torch

from ...kernels.token_patterns import PATTERNS
from ...model.config import MixerConfig, config_class
from ...model.modeling import MixerForCausalLM, model_classes
from .harness import (ATTENTION, bench_device, check_shape, decode_shape, decoding_rows, memory_growth, pick,
                      plot_training_and_decoding, print_decoding_table, print_training_table, time_ratios,
                      training_rows, write_report)
from . import decoding_flags, lengths_flag, register_bench, shape_flags
from ..arguments import name_list

BENCH_PATTERNS = tuple(p for p in PATTERNS if not p.startswith("custom"))  # custom needs an offset function


def bench_gltm(out_dir, lengths=(512, 1024, 2048, 4096, 8192), contexts=(1024, 4096, 16384), hidden_size=576,
               num_heads=9, num_kv_heads=3, patterns=BENCH_PATTERNS, decode_layers=2, decode_tokens=64, repeats=3,
               device=None) -> dict:
    check_shape("gltm", lengths, contexts, hidden_size, num_heads, num_kv_heads)
    unknown = sorted(set(patterns) - set(BENCH_PATTERNS))
    if unknown or not patterns:
        raise ValueError(f"bench gltm: patterns (--variants) must be among {BENCH_PATTERNS}, got {list(patterns)}")
    device = bench_device(device, "gltm")
    kinds = {"sdpa_attention": ATTENTION,
             **{f"gltm:{pattern}": ("gltm", {"gltm_pattern": pattern}) for pattern in patterns}}
    torch.manual_seed(0)
    training = training_rows(kinds, lengths, hidden_size, num_heads, num_kv_heads, repeats, device,
                             "bench gltm: training")

    shape = decode_shape(hidden_size, num_heads, num_kv_heads, decode_layers, max(contexts) + 8 + decode_tokens)
    gltm_config, (_, gltm_model) = config_class("gltm"), model_classes("gltm")
    models = {**{pattern: gltm_model(gltm_config(**shape, gltm_pattern=pattern)) for pattern in patterns},
              "attention": MixerForCausalLM(MixerConfig(**shape))}
    decoding = decoding_rows(models, contexts, decode_tokens, device, "bench gltm: decoding")

    ratios = time_ratios(training, list(kinds)[1:], lengths)
    first, last, longest = min(contexts), max(contexts), max(lengths)
    targets = {"definitions": "pow2_ce: fwd+bwd at the longest T within 2x SDPA, peak memory linear in T (growth per "
                              "doubling near 2), decode cache at the longest context at most 1/100 of attention's KV "
                              "cache, decode latency flat (longest / shortest context <= 1.3)"}
    if "pow2_ce" in patterns:
        ratio = pick(ratios, "T", longest, "gltm:pow2_ce_time_vs_sdpa", "T", longest)
        cache = pick(decoding, "context", last, "cache_bytes", "model", "pow2_ce") / pick(
            decoding, "context", last, "cache_bytes", "model", "attention")
        growth = pick(decoding, "context", last, "token_latency_s", "model", "pow2_ce") / pick(
            decoding, "context", first, "token_latency_s", "model", "pow2_ce")
        memory = [r for r in training if r["mixer"] == "gltm:pow2_ce" and r["peak_bytes"]]
        targets.update({"pow2_ce_time_vs_sdpa": ratio, "pow2_ce_time_met": ratio <= 2.0,
                        "pow2_ce_memory_growth_per_doubling": memory_growth(memory),
                        "pow2_ce_cache_vs_kv": cache, "pow2_ce_cache_met": cache <= 0.01,
                        "pow2_ce_decode_growth": growth, "pow2_ce_decode_flat": growth <= 1.3})
    targets["cache_bytes"] = {name: {r["context"]: r["cache_bytes"] for r in decoding if r["model"] == name}
                              for name in models}
    report = {"benchmark": "gltm", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
              "shape": {"hidden": hidden_size, "heads": num_heads, "kv_heads": num_kv_heads,
                        "bandwidth": models[patterns[0]].config.gltm_bandwidth,
                        "chunk_size": models[patterns[0]].config.gltm_chunk_size, "decode_layers": decode_layers},
              "training": training, "training_ratios": ratios, "decoding": decoding, "targets": targets}
    return write_report(report, out_dir, "bench_gltm", _plot, _print)


def _plot(report, path):
    shape = report["shape"]
    plot_training_and_decoding(report, path, f"GLTM patterns vs attention -- {report['device']}, fp32, hidden "
                               f"{shape['hidden']}, heads {shape['heads']}/{shape['kv_heads']}, bandwidth "
                               f"{shape['bandwidth']}, chunk {shape['chunk_size']}")


def _print(report):
    print_training_table(report, "GLTM training vs SDPA attention", "gltm:")
    print_decoding_table(report)
    print(f"targets: { {k: v for k, v in report['targets'].items() if k != 'cache_bytes'} }")


def _arguments(parser) -> None:
    shape_flags(parser)
    lengths_flag(parser, [512, 1024, 2048, 4096, 8192])
    decoding_flags(parser)
    parser.add_argument("--patterns", "--variants", dest="patterns", type=name_list, default=list(BENCH_PATTERNS),
                        help="the patterns measured (default all but custom)")


register_bench("gltm", "GLTM's patterns: training cost, decoding and cache growth against a KV-cache attention "
               "model, and the pow2_ce targets", _arguments,
               lambda args: bench_gltm(args.out, lengths=args.lengths, contexts=args.contexts,
                                       hidden_size=args.hidden_size, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                       patterns=args.patterns, decode_layers=args.decode_layers,
                                       decode_tokens=args.decode_tokens, repeats=args.repeats, device=args.device))
