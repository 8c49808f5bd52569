"""``hf-mixers bench vort``: VORT's training cost vs SDPA attention, and its constant-state decoding vs a KV cache.

(a) Training: forward+backward time and peak memory of one VORT layer per kernel (window 64, the chunked global
    branch) against the attention mixer on SDPA with the same width and heads, at each T (the shared harness:
    interleaved timing, fastest of ``repeats``; CPU peak memory in a fresh process).
(b) Decoding: small models of the same shape, VORT (the default power-law kernel) and full attention; each context
    is prefilled, then ``decode_tokens`` single-token steps are timed (median; ``decode_batch`` rows together); with
    the cache's bytes.
Written to bench_vort.json and .png, with the project's targets evaluated in the same run.
"""

from __future__ import annotations

import torch

from ...model.config import MixerConfig, config_class
from ...model.modeling import MixerForCausalLM, model_classes
from .harness import (ATTENTION, bench_device, check_shape, decode_shape, decoding_rows, memory_growth, pick,
                      plot_training_and_decoding, print_decoding_table, print_training_table, time_ratios,
                      training_rows, write_report)
from . import decoding_flags, lengths_flag, register_bench, shape_flags
from ..arguments import name_list

BENCH_KERNELS = ("gl", "exp", "mixture")  # "power" costs what "gl" does (same slots)


def bench_vort(out_dir, lengths=(512, 1024, 2048, 4096, 8192), contexts=(1024, 4096, 16384), hidden_size=576,
               num_heads=9, num_kv_heads=3, kernels=("gl",), decode_layers=2, decode_tokens=64, repeats=3,
               device=None, decode_batch: int = 1) -> dict:
    check_shape("vort", lengths, contexts, hidden_size, num_heads, num_kv_heads)
    unknown = sorted(set(kernels) - set(BENCH_KERNELS))
    if unknown or not kernels:
        raise ValueError(f"bench vort: kernels (--variants) must be among {BENCH_KERNELS}, got {list(kernels)}")
    device = bench_device(device, "vort")
    kinds = {"sdpa_attention": ATTENTION,
             **{f"vort:{kernel}": ("vort", {"vort_kernel": kernel}) for kernel in kernels}}
    torch.manual_seed(0)
    training = training_rows(kinds, lengths, hidden_size, num_heads, num_kv_heads, repeats, device,
                             "bench vort: training")

    shape = decode_shape(hidden_size, num_heads, num_kv_heads, decode_layers, max(contexts) + 8 + decode_tokens)
    vort_config, (_, vort_model) = config_class("vort"), model_classes("vort")
    models = {"vort": vort_model(vort_config(**shape, vort_combine="shared_normalizer")),
              "attention": MixerForCausalLM(MixerConfig(**shape))}
    decoding = decoding_rows(models, contexts, decode_tokens, device, "bench vort: decoding", batch=decode_batch)

    ratios = time_ratios(training, list(kinds)[1:], lengths)
    first, last, longest = min(contexts), max(contexts), max(lengths)

    def latency(model, context):
        return pick(decoding, "context", context, "token_latency_s", "model", model)

    def cache(model, context):
        return pick(decoding, "context", context, "cache_bytes", "model", model)

    memory = [r for r in training if r["mixer"] == f"vort:{kernels[0]}" and r["peak_bytes"]]
    time_ratio = pick(ratios, "T", longest, f"vort:{kernels[0]}_time_vs_sdpa", "T", longest)
    targets = {"definitions": "fwd+bwd at the longest T at most SDPA's time, peak memory linear in T (growth per "
                              "doubling near 2), decode latency flat (longest / shortest context <= 1.3), cache "
                              "constant in the context, decode at the longest context >= 4x faster than attention",
               "time_vs_sdpa": time_ratio, "time_met": time_ratio <= 1.0,
               "memory_growth_per_doubling": memory_growth(memory),
               "decode_growth": latency("vort", last) / latency("vort", first),
               "cache_constant": cache("vort", last) == cache("vort", first),
               "decode_speedup_vs_attention": latency("attention", last) / latency("vort", last)}
    targets["decode_flat"] = targets["decode_growth"] <= 1.3
    targets["decode_speedup_met"] = targets["decode_speedup_vs_attention"] >= 4.0
    targets["cache_bytes"] = {name: {r["context"]: r["cache_bytes"] for r in decoding if r["model"] == name}
                              for name in models}
    config = models["vort"].config
    report = {"benchmark": "vort", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
              "shape": {"hidden": hidden_size, "heads": num_heads, "kv_heads": num_kv_heads,
                        "window": config.vort_window, "soe_terms": config.vort_soe_terms,
                        "feature_dim": config.vort_feature_dim, "chunk_size": config.vort_chunk_size,
                        "decode_layers": decode_layers, "decode_batch": decode_batch},
              "training": training, "training_ratios": ratios, "decoding": decoding, "targets": targets}
    return write_report(report, out_dir, "bench_vort", _plot, _print)


def _plot(report, path):
    shape = report["shape"]
    plot_training_and_decoding(report, path, f"VORT vs attention -- {report['device']}, fp32, hidden "
                               f"{shape['hidden']}, heads {shape['heads']}/{shape['kv_heads']}, window "
                               f"{shape['window']}, S+1 = {shape['soe_terms'] + 1} slots, features "
                               f"{shape['feature_dim']}")


def _print(report):
    print_training_table(report, "VORT training vs SDPA attention", "vort:")
    print_decoding_table(report)
    print(f"targets: { {k: v for k, v in report['targets'].items() if k != 'cache_bytes'} }")


def _arguments(parser) -> None:
    shape_flags(parser)
    lengths_flag(parser, [512, 1024, 2048, 4096, 8192])
    decoding_flags(parser, batch=True)
    parser.add_argument("--kernels", "--variants", dest="kernels", type=name_list, default=["gl"],
                        help="the retention kernels of the training part (default gl)")


register_bench("vort", "VORT: training cost per retention kernel, and decoding against a KV-cache attention model",
               _arguments,
               lambda args: bench_vort(args.out, lengths=args.lengths, contexts=args.contexts,
                                       hidden_size=args.hidden_size, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                       kernels=args.kernels, decode_layers=args.decode_layers,
                                       decode_tokens=args.decode_tokens, repeats=args.repeats, device=args.device,
                                       decode_batch=args.decode_batch))
