"""``hf-mixers bench selective_ssm``: the selective-SSM variants' training cost vs SDPA attention, the chunked scan vs
the token recurrence, and decoding vs a KV-cache attention model.

(a) Training: forward+backward time and peak memory of each variant's layer (chunked scan) against the attention
    mixer on SDPA with the same width and heads, at each T (the shared harness: interleaved timing, fastest of
    ``repeats``; CPU peak memory in a fresh process).
(b) Scan forms: forward+backward of ``ssm_chunked`` against ``ssm_recurrent`` on one layer's shapes, per decay
    shape, at the shorter T (the recurrence is the slow reference).
(c) Decoding: small models of the same shape, each variant and full attention; each context is prefilled, then
    ``decode_tokens`` single-token steps are timed (median); with the cache's bytes.
Written to bench_selective_ssm.json and .png, with the project's targets evaluated in the same run.
"""

from __future__ import annotations

import torch

from ...kernels.selective_scan import ssm_chunked, ssm_recurrent
from ...model.config import MixerConfig, config_class
from ...model.modeling import MixerForCausalLM, model_classes
from .harness import (ATTENTION, bench_device, check_shape, decode_shape, decoding_rows, memory_growth, pick,
                      plot_training_and_decoding, print_decoding_table, print_training_table, time_calls, time_ratios,
                      training_rows, write_report)
from . import decoding_flags, lengths_flag, register_bench, shape_flags
from ..arguments import name_list

VARIANTS = ("mamba2", "s6", "delta_t", "s4d")
DECAY_SHAPES = {"mamba2": (1, 1), "delta_t (A per slot)": (1, None), "s6 / s4d": (None, None)}  # None: P or N


def bench_selective_ssm(out_dir, lengths=(512, 1024, 2048, 4096, 8192), contexts=(1024, 4096, 16384),
                        hidden_size=576, num_heads=9, num_kv_heads=3, variants=VARIANTS, decode_layers=2,
                        decode_tokens=64, repeats=3, scan_lengths=(512, 2048), device=None) -> dict:
    check_shape("selective_ssm", lengths, contexts, hidden_size, num_heads, num_kv_heads)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise ValueError(f"bench selective_ssm: variants must be among {VARIANTS}, got {list(variants)}")
    device = bench_device(device, "selective_ssm")
    kinds = {"sdpa_attention": ATTENTION,
             **{f"selective_ssm:{variant}": ("selective_ssm", {"selective_ssm_variant": variant})
                for variant in variants}}
    torch.manual_seed(0)

    training = training_rows(kinds, lengths, hidden_size, num_heads, num_kv_heads, repeats, device,
                             "bench selective_ssm: training")

    scans = _scan_forms(scan_lengths, num_heads, hidden_size // num_heads, repeats, device)

    shape = decode_shape(hidden_size, num_heads, num_kv_heads, decode_layers, max(contexts) + 8 + decode_tokens)
    ssm_config, (_, ssm_model) = config_class("selective_ssm"), model_classes("selective_ssm")
    models = {**{variant: ssm_model(ssm_config(**shape, selective_ssm_variant=variant)) for variant in variants},
              "attention": MixerForCausalLM(MixerConfig(**shape))}
    decoding = decoding_rows(models, contexts, decode_tokens, device, "bench selective_ssm: decoding")

    ratios = time_ratios(training, list(kinds)[1:], lengths)
    first, last = min(contexts), max(contexts)
    main = "mamba2" if "mamba2" in variants else variants[0]
    attention_last = pick(decoding, "context", last, "token_latency_s", "model", "attention")
    mamba2_ratio = next((r.get("selective_ssm:mamba2_time_vs_sdpa") for r in ratios if r["T"] == 8192), None)
    memory = [r for r in training if r["mixer"] == f"selective_ssm:{main}" and r["peak_bytes"]]
    targets = {
        "mamba2_time_vs_sdpa_at_8192": mamba2_ratio,
        "mamba2_time_met": None if mamba2_ratio is None else mamba2_ratio <= 0.5,
        "memory_growth_per_doubling": memory_growth(memory),
        "cache_bytes_constant": {v: len({r["cache_bytes"] for r in decoding if r["model"] == v}) == 1
                                 for v in variants},
        "decode_latency_growth": {v: pick(decoding, "context", last, "token_latency_s", "model", v)
                                  / pick(decoding, "context", first, "token_latency_s", "model", v) for v in variants},
        "decode_speedup_vs_attention": {v: attention_last / pick(decoding, "context", last, "token_latency_s",
                                                                  "model", v) for v in variants},
        "decode_speedup_met": {v: attention_last / pick(decoding, "context", last, "token_latency_s", "model", v)
                               >= 4.0 for v in variants} if last == 16384 else None,
        "definitions": "Mamba-2 chunked fwd+bwd at T=8192 at most 0.5x SDPA's time; peak memory linear in T (growth "
                       "per doubling of T near 2); constant cache bytes; decoding at 16K at least 4x faster than "
                       "attention",
    }
    report = {"benchmark": "selective_ssm",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
              "shape": {"hidden": hidden_size, "heads": num_heads, "kv_heads": num_kv_heads,
                        "state_size": models[main].config.selective_ssm_state_size,
                        "chunk_size": models[main].config.selective_ssm_chunk_size, "decode_layers": decode_layers},
              "training": training, "training_ratios": ratios, "scan_forms": scans, "decoding": decoding,
              "targets": targets}
    return write_report(report, out_dir, "bench_selective_ssm", _plot, _print)


def _scan_forms(lengths, heads, width, repeats, device):
    """fwd+bwd of the chunked scan and the token recurrence on one layer's shapes, per decay shape."""
    rows = []
    for length in lengths:
        for name, (pd, nd) in DECAY_SHAPES.items():
            generator = torch.Generator().manual_seed(0)

            def tensor(*shape, scale=1.0):
                return (scale * torch.randn(*shape, generator=generator)).to(device).requires_grad_()

            u, B, C = tensor(1, length, heads, width), tensor(1, length, heads, width), tensor(1, length, heads,
                                                                                                width)
            log_decay = (-0.05 * torch.rand(1, length, heads, pd or width, nd or width, generator=generator)).to(
                device).requires_grad_()

            def step(form):
                y, state = form(u, log_decay, B, C)
                (y.pow(2).mean() + state.pow(2).mean()).backward()

            timings = time_calls([lambda: step(ssm_chunked), lambda: step(ssm_recurrent)], repeats, device)
            rows.append({"T": length, "decay": name, "chunked_s": timings[0][0], "recurrent_s": timings[1][0],
                         "speedup": timings[1][0] / timings[0][0]})
    return rows


def _plot(report, path):
    shape = report["shape"]
    plot_training_and_decoding(report, path, f"selective SSMs vs attention -- {report['device']}, fp32, hidden "
                               f"{shape['hidden']}, heads {shape['heads']}/{shape['kv_heads']}, state "
                               f"{shape['state_size']}, chunk {shape['chunk_size']}")


def _print(report):
    print_training_table(report, "Selective SSM training vs SDPA attention", "selective_ssm:")
    print("\nScan forms, fwd+bwd s: chunked vs recurrent")
    for row in report["scan_forms"]:
        print(f"  T={row['T']:>5} {row['decay']:<22} chunked {row['chunked_s']:.3f}  recurrent "
              f"{row['recurrent_s']:.3f}  ({row['speedup']:.1f}x)")
    print_decoding_table(report)
    print(f"targets: {report['targets']}")


def _arguments(parser) -> None:
    shape_flags(parser)
    lengths_flag(parser, [512, 1024, 2048, 4096, 8192])
    decoding_flags(parser)
    parser.add_argument("--variants", type=name_list, default=list(VARIANTS),
                        help=f"the variants measured (default {','.join(VARIANTS)})")


register_bench("selective_ssm", "the selective SSMs: training cost, the scan's forms, and decoding against a "
               "KV-cache attention model", _arguments,
               lambda args: bench_selective_ssm(args.out, lengths=args.lengths, contexts=args.contexts,
                                                hidden_size=args.hidden_size, num_heads=args.heads,
                                                num_kv_heads=args.kv_heads, variants=args.variants,
                                                decode_layers=args.decode_layers, decode_tokens=args.decode_tokens,
                                                repeats=args.repeats, device=args.device))
