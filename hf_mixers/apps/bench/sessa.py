"""``hf-mixers bench sessa``: forward+backward time and peak memory of the Sessa mixer vs SDPA attention.

Three mixer modules of the same width and heads run on the same input at each sequence length T:
  sdpa_attention  FullAttention on torch SDPA (q/k/v/o projections included) -- the baseline;
  sessa_chunked   SessaMixer with the chunked O(T*C)-memory solve (the default path);
  sessa_dense     SessaMixer with the dense reference solve (O(T^2) memory).
A step is ``y = mixer(x); mean(y^2).backward()``, timed and measured by the harness (harness.py). Results are
reported as ratios to the baseline measured in the same run, and written to bench_sessa.json and bench_sessa.png.
"""

from __future__ import annotations

import gc

import torch
from tqdm.auto import tqdm

from ...common.history import save_figure
from ...common.dtypes import names_of, to_dtype
from . import harness, lengths_flag, register_bench, shape_flags
from .harness import (ATTENTION, bench_device, build_mixer, cpu_peak, cuda_peak, format_log_axes, rotary_embeddings,
                      time_interleaved, write_report)
from ..arguments import at_least

MIXERS = {"sdpa_attention": ATTENTION,  # gain != 0 below: the real solve runs
          **{f"sessa_{solver}": ("sessa", {"sessa_solver": solver, "sessa_gamma_bias_init": 0.5})
             for solver in ("chunked", "dense")}}


def _dense_fits(batch: int, length: int) -> bool:
    """Skip dense points whose (B, T, T) intermediates would not fit in 60% of RAM (about a dozen of them live)."""
    with open("/proc/meminfo") as handle:
        total_kib = int(next(line for line in handle if line.startswith("MemTotal")).split()[1])
    return 12 * batch * length * length * 4 < 0.6 * total_kib * 1024


def bench_sessa(out_dir, lengths=(512, 1024, 2048, 4096), hidden_size=576, num_heads=9, num_kv_heads=3,
                batch_size=1, repeats=3, dtype="float32", device=None) -> dict:
    if not lengths or any(length < 2 for length in lengths):
        raise ValueError(f"bench sessa: lengths must be a non-empty list of integers >= 2, got {lengths}")
    torch_dtype = to_dtype(dtype, "bench sessa: dtype", names_of("fp32", "bf16"))
    if min(hidden_size, num_heads, num_kv_heads, batch_size, repeats) < 1:
        raise ValueError("bench sessa: --hidden-size, --heads, --kv-heads, --batch-size and --repeats must be >= 1")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"bench sessa: --heads ({num_heads}) must divide --hidden-size ({hidden_size}) and "
                         f"--kv-heads ({num_kv_heads}) must divide --heads")
    device = bench_device(device, "sessa")
    measure_cpu_peak = device.type == "cpu" and harness.cpu_peak_supported()  # one switch for every bench
    memory_method = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
                     "peak RSS growth over one step, in a fresh process with MALLOC_MMAP_THRESHOLD_=65536"
                     if measure_cpu_peak else
                     "unavailable (/proc/self/clear_refs not writable)")
    torch.manual_seed(0)
    results = []
    config = None
    for length in tqdm(lengths, desc="bench sessa", unit="length"):
        kinds = [kind for kind in MIXERS
                 if not (kind == "sessa_dense" and device.type == "cpu" and not _dense_fits(batch_size, length))]
        runs = []
        for kind in kinds:
            module, config = build_mixer(*MIXERS[kind], hidden_size, num_heads, num_kv_heads, device, torch_dtype)
            x = torch.randn(batch_size, length, hidden_size, device=device, dtype=torch_dtype, requires_grad=True)
            runs.append((module, x, rotary_embeddings(config, x, length)))
        timings = dict(zip(kinds, time_interleaved(runs, repeats, device)))
        peaks = {}
        for kind, run in zip(kinds, runs):
            peaks[kind] = cuda_peak(*run) if device.type == "cuda" else None
        del runs
        gc.collect()
        for kind in MIXERS:
            if kind not in kinds:
                results.append({"T": length, "mixer": kind, "fwd_bwd_s": None, "fwd_bwd_median_s": None,
                                "peak_bytes": None, "skipped": "dense (B, T, T) intermediates would exceed 60% of RAM"})
                continue
            if device.type == "cpu" and measure_cpu_peak:
                peaks[kind] = cpu_peak(*MIXERS[kind], length, hidden_size, num_heads, num_kv_heads, batch_size,
                                       dtype)
            results.append({"T": length, "mixer": kind, "fwd_bwd_s": timings[kind][0],
                            "fwd_bwd_median_s": timings[kind][1], "peak_bytes": peaks[kind]})

    def value(length, kind, key):
        return next(r[key] for r in results if r["T"] == length and r["mixer"] == kind)

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    ratios = [{"T": length,
               "chunked_time_vs_sdpa": ratio(value(length, "sessa_chunked", "fwd_bwd_s"),
                                             value(length, "sdpa_attention", "fwd_bwd_s")),
               "dense_time_vs_sdpa": ratio(value(length, "sessa_dense", "fwd_bwd_s"),
                                           value(length, "sdpa_attention", "fwd_bwd_s")),
               "chunked_peak_vs_dense": ratio(value(length, "sessa_chunked", "peak_bytes"),
                                              value(length, "sessa_dense", "peak_bytes"))} for length in lengths]
    at = {r["T"]: r for r in ratios}
    time_ratio = at.get(2048, {}).get("chunked_time_vs_sdpa")
    memory_ratio = at.get(4096, {}).get("chunked_peak_vs_dense")
    report = {
        "benchmark": "sessa", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": dtype,
        "shape": {"batch": batch_size, "hidden": hidden_size, "heads": num_heads, "kv_heads": num_kv_heads,
                  "feedback_dim": config.sessa_feedback_dim, "chunk_size": config.sessa_chunk_size},
        "memory_method": memory_method, "results": results, "ratios": ratios,
        "targets": {"time_ratio_at_2048": time_ratio,
                    "time_target": "sessa_chunked fwd+bwd <= 2x sdpa_attention at T=2048",
                    "time_target_met": None if time_ratio is None else time_ratio <= 2.0,
                    "memory_ratio_at_4096": memory_ratio,
                    "memory_target": "sessa_chunked peak <= 0.25x sessa_dense peak at T=4096",
                    "memory_target_met": None if memory_ratio is None else memory_ratio <= 0.25},
    }
    return write_report(report, out_dir, "bench_sessa", _plot, _print_table)


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind in MIXERS:
        rows = [r for r in report["results"] if r["mixer"] == kind and r["fwd_bwd_s"] is not None]
        time_axis.plot([r["T"] for r in rows], [r["fwd_bwd_s"] for r in rows], marker="o", label=kind)
        rows = [r for r in rows if r["peak_bytes"]]  # no point for a missing or zero peak on a log axis
        memory_axis.plot([r["T"] for r in rows], [r["peak_bytes"] / 2**20 for r in rows], marker="o", label=kind)
    format_log_axes([(time_axis, "forward+backward (s)"), (memory_axis, "peak memory (MiB)")], "sequence length T")
    shape = report["shape"]
    save_figure(figure, path, f"Sessa mixer vs SDPA attention -- {report['device']}, {report['dtype']}, batch "
                f"{shape['batch']}, hidden {shape['hidden']}, heads {shape['heads']}/{shape['kv_heads']}, "
                f"feedback dim {shape['feedback_dim']}, chunk {shape['chunk_size']}")



def _print_table(report: dict) -> None:
    def fmt(value, scale=1.0, digits=3):
        return "-" if value is None else f"{value / scale:.{digits}f}"

    print(f"\nSessa mixer vs SDPA attention ({report['device']}, {report['dtype']}, {report['threads']} threads)")
    print(f"{'T':>6} | {'sdpa s':>8} {'chunked s':>9} {'dense s':>8} | {'sdpa MiB':>8} {'chunked MiB':>11} "
          f"{'dense MiB':>9} | {'chunked/sdpa':>12} {'chunked/dense mem':>17}")
    for ratio in report["ratios"]:
        row = {r["mixer"]: r for r in report["results"] if r["T"] == ratio["T"]}
        times = [fmt(row[k]["fwd_bwd_s"]) for k in MIXERS]
        peaks = [fmt(row[k]["peak_bytes"], 2**20, 1) for k in MIXERS]
        print(f"{ratio['T']:>6} | {times[0]:>8} {times[1]:>9} {times[2]:>8} | {peaks[0]:>8} {peaks[1]:>11} "
              f"{peaks[2]:>9} | {fmt(ratio['chunked_time_vs_sdpa'], digits=2):>12} "
              f"{fmt(ratio['chunked_peak_vs_dense'], digits=2):>17}")
    targets = report["targets"]
    print(f"target: {targets['time_target']}: {fmt(targets['time_ratio_at_2048'], digits=2)}x "
          f"(met: {targets['time_target_met']})")
    print(f"target: {targets['memory_target']}: {fmt(targets['memory_ratio_at_4096'], digits=2)}x "
          f"(met: {targets['memory_target_met']})")


def _arguments(parser) -> None:
    shape_flags(parser)
    lengths_flag(parser, [512, 1024, 2048, 4096])
    parser.add_argument("--batch-size", type=at_least(1), default=1)
    parser.add_argument("--dtype", choices=names_of("fp32", "bf16"), default="float32")


register_bench("sessa", "Sessa's feedback solve (chunked and dense) against SDPA attention: forward+backward time and "
               "peak memory per sequence length", _arguments,
               lambda args: bench_sessa(args.out, lengths=args.lengths, hidden_size=args.hidden_size,
                                        num_heads=args.heads, num_kv_heads=args.kv_heads, batch_size=args.batch_size,
                                        repeats=args.repeats, dtype=args.dtype, device=args.device))
