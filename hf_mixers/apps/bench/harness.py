"""``hf-mixers bench sessa``: forward+backward time and peak memory of the Sessa mixer vs SDPA attention.

Three mixer modules of the same width and heads run on the same input at each sequence length T:
  sdpa_attention  FullAttention on torch SDPA (q/k/v/o projections included) -- the baseline;
  sessa_chunked   SessaMixer with the chunked O(T*C)-memory solve (the default path);
  sessa_dense     SessaMixer with the dense reference solve (O(T^2) memory).
A step is ``y = mixer(x); mean(y^2).backward()``. The three mixers of one T are timed round-robin, ``repeats``
times each after a warm-up, so they share the same background load; the fastest step is reported (the median
too).
Peak memory: on CUDA the allocator's peak. On CPU there is no allocator statistic, so each point runs once more
in a fresh process with glibc's mmap threshold fixed at 64 KiB (large tensors are then mapped and returned to the
OS when freed, so RSS follows live memory): peak RSS (VmHWM, reset through /proc/self/clear_refs) over one step
minus the RSS before it. Results are reported as ratios to the baseline measured in the same run, and written to
bench_sessa.json and bench_sessa.png.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from tqdm.auto import tqdm

from ...common.history import save_figure
from ...core.attention import FullAttention
from ...core.registry import get_mixer
from ...model.config import config_class

MIXERS = ("sdpa_attention", "sessa_chunked", "sessa_dense")


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def cpu_peak_supported() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def bench_device(device, benchmark: str) -> torch.device:
    """``--device`` (default: cuda when available, else cpu); a CUDA device that is not there is refused by name."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"bench {benchmark}: --device {device} asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}); leave --device out to run on the CPU")
    return device


def build_mixer(kind: str, hidden_size: int, num_heads: int, num_kv_heads: int, device, dtype):
    """A standalone mixer module: sdpa_attention | sessa_chunked | sessa_dense | rsa_chunked | rsa_recompute."""
    shape = dict(hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                 intermediate_size=4 * hidden_size, num_hidden_layers=1, vocab_size=128)
    if kind.startswith("rsa"):
        config = config_class("rsa")(**shape, rsa_recompute_chunks=kind == "rsa_recompute")
    else:
        config = config_class("sessa")(**shape, sessa_solver="dense" if kind == "sessa_dense" else "chunked",
                             sessa_gamma_bias_init=0.5)  # gain != 0: the real solve runs
    config._attn_implementation = "sdpa"
    module_class = FullAttention if kind == "sdpa_attention" else get_mixer(kind.split("_")[0]).mixer_class
    module = module_class(config, 0)
    if kind.startswith("rsa"):
        module.reset_parameters()  # no model around it to run _init_weights
    return module.to(device=device, dtype=dtype), config


def _step(module, x, position_embeddings):
    x.grad = None
    module(x, position_embeddings).float().pow(2).mean().backward()


def time_interleaved(runs, repeats, device):
    """Time every (module, x, position_embeddings) of one T round-robin; (fastest, median) step per run."""
    return time_calls([lambda run=run: _step(*run) for run in runs], repeats, device)


def time_calls(calls, repeats, device):
    """Time zero-argument ``calls`` round-robin, ``repeats`` times each after one warm-up; (fastest, median) each.

    Interleaving puts the candidates under the same background load; the minimum is the least disturbed run.
    """
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for call in calls:
        call()  # warm-up (and compilation of Triton kernels)
    times = [[] for _ in calls]
    for _ in range(repeats):
        for index, call in enumerate(calls):
            synchronize()
            start = time.perf_counter()
            call()
            synchronize()
            times[index].append(time.perf_counter() - start)
    return [(min(t), statistics.median(t)) for t in times]


def cuda_peak(module, x, position_embeddings):
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(module, x, position_embeddings)
    return torch.cuda.max_memory_allocated() - before


def cpu_peak_point(kind, length, hidden_size, num_heads, num_kv_heads, batch_size, dtype):
    """Run in a fresh process (see cpu_peak): print the peak RSS growth of one step, in bytes."""
    torch.manual_seed(0)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    module, config = build_mixer(kind, hidden_size, num_heads, num_kv_heads, torch.device("cpu"), torch_dtype)
    x = torch.randn(batch_size, length, hidden_size, dtype=torch_dtype, requires_grad=True)
    position_embeddings = rotary_embeddings(config, x, length)
    _step(module, x, position_embeddings)  # warm-up: lazily created buffers, gradients of the parameters
    gc.collect()
    before = _read_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    _step(module, x, position_embeddings)
    print((_read_status_kib("VmHWM") - before) * 1024)


def cpu_peak(kind, length, hidden_size, num_heads, num_kv_heads, batch_size, dtype):
    code = (f"from hf_mixers.apps.bench.harness import cpu_peak_point; cpu_peak_point({kind!r}, {length}, {hidden_size}, "
            f"{num_heads}, {num_kv_heads}, {batch_size}, {dtype!r})")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"bench sessa: memory run for {kind} at T={length} failed:\n{result.stderr[-2000:]}")
    return int(result.stdout.strip().splitlines()[-1])


def _dense_fits(batch: int, length: int) -> bool:
    """Skip dense points whose (B, T, T) intermediates would not fit in 60% of RAM (about a dozen of them live)."""
    with open("/proc/meminfo") as handle:
        total_kib = int(next(line for line in handle if line.startswith("MemTotal")).split()[1])
    return 12 * batch * length * length * 4 < 0.6 * total_kib * 1024


def bench_sessa(out_dir, lengths=(512, 1024, 2048, 4096), hidden_size=576, num_heads=9, num_kv_heads=3,
                batch_size=1, repeats=3, dtype="float32", device=None) -> dict:
    if not lengths or any(length < 2 for length in lengths):
        raise ValueError(f"bench sessa: lengths must be a non-empty list of integers >= 2, got {lengths}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"bench sessa: dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if min(hidden_size, num_heads, num_kv_heads, batch_size, repeats) < 1:
        raise ValueError("bench sessa: --hidden-size, --heads, --kv-heads, --batch-size and --repeats must be >= 1")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"bench sessa: --heads ({num_heads}) must divide --hidden-size ({hidden_size}) and "
                         f"--kv-heads ({num_kv_heads}) must divide --heads")
    device = bench_device(device, "sessa")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    measure_cpu_peak = device.type == "cpu" and cpu_peak_supported()
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
            module, config = build_mixer(kind, hidden_size, num_heads, num_kv_heads, device, torch_dtype)
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
                peaks[kind] = cpu_peak(kind, length, hidden_size, num_heads, num_kv_heads, batch_size, dtype)
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


def write_report(report: dict, out_dir: str, name: str, plot, show) -> dict:
    """``out_dir/name.json`` (written to a temporary file, then renamed), ``out_dir/name.png``, and a table."""
    os.makedirs(out_dir, exist_ok=True)
    staging = os.path.join(out_dir, f".{name}.json.partial")
    with open(staging, "w") as handle:
        json.dump(report, handle, indent=2)
    os.replace(staging, os.path.join(out_dir, f"{name}.json"))
    plot(report, os.path.join(out_dir, f"{name}.png"))
    show(report)
    return report


def rotary_embeddings(config, x, length):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config).to(x.device)
    return rotary(x, torch.arange(length, device=x.device)[None])


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



def format_log_axes(axes_and_labels, x_label: str) -> None:
    """log2 x, log y (only where there is data to log), grid and legend for each (axis, y label)."""
    for axis, label in axes_and_labels:
        axis.set_xscale("log", base=2)
        if any(len(line.get_ydata()) for line in axis.get_lines()):  # log axes need positive data
            axis.set_yscale("log")
        axis.set_xlabel(x_label)
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()


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
