"""The benchmark harness shared by ``hf-mixers bench sessa|rsa|kernels|distill``: device choice, standalone mixer
modules, interleaved timing, peak memory and the JSON + PNG report.

Timing: the runs of one point are timed round-robin, ``repeats`` times each after a warm-up, so they share the same
background load; the fastest step is reported (the median too). Peak memory: on CUDA the allocator's peak. On CPU
there is no allocator statistic, so each point runs once more in a fresh process with glibc's mmap threshold fixed
at 64 KiB (large tensors are then mapped and returned to the OS when freed, so RSS follows live memory): peak RSS
(VmHWM, reset through /proc/self/clear_refs) over one step minus the RSS before it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from ...common.files import write_atomically
from ...common.device import resolve_device
from ...common.dtypes import names_of, to_dtype
from ...common.history import save_figure
from ...core.registry import get_mixer
from ...model.config import config_class


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
    """``--device`` (default: cuda when available, else cpu); a device that is not there is refused by name."""
    return resolve_device(device, f"bench {benchmark}")


ATTENTION = ("full_attention", {})  # the baseline of every training comparison, labelled "sdpa_attention"


def build_mixer(mixer: str, options: dict, hidden_size: int, num_heads: int, num_kv_heads: int, device, dtype):
    """A standalone layer of a registered ``mixer`` with config ``options``, scratch-initialised (no model around
    it to run _init_weights), and its config. The benchmarks name their runs {label: (mixer, options)}."""
    shape = dict(hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                 intermediate_size=4 * hidden_size, num_hidden_layers=1, vocab_size=128)
    config = config_class(mixer)(**shape, layer_types=[mixer], **options)
    config._attn_implementation = "sdpa"
    module = get_mixer(mixer).mixer_class(config, 0)
    module.reset_parameters()
    return module.to(device=device, dtype=dtype), config


def _step(module, x, position_embeddings):
    x.grad = None
    module(x, position_embeddings).float().pow(2).mean().backward()


def time_interleaved(runs, repeats, device):
    """Time every (module, x, position_embeddings) of one T round-robin; (fastest, median) step per run."""
    return time_calls([lambda run=run: _step(*run) for run in runs], repeats, device)


def training_rows(kinds: dict, lengths, hidden_size, num_heads, num_kv_heads, repeats, device, desc) -> list[dict]:
    """Forward+backward time (fastest and median of ``repeats``, interleaved) and peak memory of each standalone
    layer ``kinds[label] = (mixer, options)`` (``build_mixer``) at each T, batch 1, fp32: one row per (T, label)."""
    from tqdm.auto import tqdm

    measure_cpu_peak = device.type == "cpu" and cpu_peak_supported()
    rows = []
    for length in tqdm(lengths, desc=desc, unit="length"):
        runs = []
        for kind in kinds:
            module, config = build_mixer(*kinds[kind], hidden_size, num_heads, num_kv_heads, device, torch.float32)
            x = torch.randn(1, length, hidden_size, device=device, requires_grad=True)
            runs.append((module, x, rotary_embeddings(config, x, length)))
        timings = time_interleaved(runs, repeats, device)
        peaks = [cuda_peak(*run) if device.type == "cuda" else None for run in runs]
        del runs
        gc.collect()
        for index, kind in enumerate(kinds):
            peak = cpu_peak(*kinds[kind], length, hidden_size, num_heads, num_kv_heads, 1, "float32") \
                if measure_cpu_peak \
                else peaks[index]
            rows.append({"T": length, "mixer": kind, "fwd_bwd_s": timings[index][0],
                         "fwd_bwd_median_s": timings[index][1], "peak_bytes": peak})
    return rows


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


def cpu_peak_point(mixer, options_json, length, hidden_size, num_heads, num_kv_heads, batch_size, dtype):
    """Run in a fresh process (see cpu_peak): print the peak RSS growth of one step, in bytes."""
    torch.manual_seed(0)
    torch_dtype = to_dtype(dtype, choices=names_of("fp32", "bf16"))
    module, config = build_mixer(mixer, json.loads(options_json), hidden_size, num_heads, num_kv_heads,
                                 torch.device("cpu"), torch_dtype)
    x = torch.randn(batch_size, length, hidden_size, dtype=torch_dtype, requires_grad=True)
    position_embeddings = rotary_embeddings(config, x, length)
    _step(module, x, position_embeddings)  # warm-up: lazily created buffers, gradients of the parameters
    gc.collect()
    before = _read_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    _step(module, x, position_embeddings)
    print((_read_status_kib("VmHWM") - before) * 1024)


def cpu_peak(mixer, options, length, hidden_size, num_heads, num_kv_heads, batch_size, dtype):
    """The peak RSS growth of one forward+backward step of ``build_mixer(mixer, options, ...)``, in bytes."""
    code = (f"from hf_mixers.apps.bench.harness import cpu_peak_point; cpu_peak_point({mixer!r}, "
            f"{json.dumps(options)!r}, {length}, {hidden_size}, {num_heads}, {num_kv_heads}, {batch_size}, {dtype!r})")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"bench: memory run for {mixer} {options} at T={length} failed:\n{result.stderr[-2000:]}")
    return int(result.stdout.strip().splitlines()[-1])


def save_point(out_dir: str, name: str, row: dict, rows: list) -> None:
    """After each measured point: its row as one log line, and ``out_dir/name.partial.json`` with the rows so far,
    so that a run stopped part-way (a time limit, Ctrl-C, a failure at a later point) leaves what it measured.
    ``write_report`` removes the partial file once the whole report is written."""
    from tqdm.auto import tqdm

    tqdm.write(f"{name} point: " + json.dumps(row, default=str))
    os.makedirs(out_dir, exist_ok=True)
    write_atomically(os.path.join(out_dir, f"{name}.partial.json"),
                     json.dumps({"complete": False, "rows": rows}, indent=1, default=str))


def write_report(report: dict, out_dir: str, name: str, plot, show) -> dict:
    """``out_dir/name.json`` (written to a temporary file, then renamed), ``out_dir/name.png``, and a table; the
    partial file of ``save_point`` goes."""
    write_atomically(os.path.join(out_dir, f"{name}.json"), json.dumps(report, indent=2))
    partial = os.path.join(out_dir, f"{name}.partial.json")
    if os.path.exists(partial):
        os.remove(partial)
    plot(report, os.path.join(out_dir, f"{name}.png"))
    show(report)
    return report


def rotary_embeddings(config, x, length):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config).to(x.device)
    return rotary(x, torch.arange(length, device=x.device)[None])


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


def plot_against_teacher(report: dict, series, x: str, y: str, x_label: str, y_label: str, title: str,
                         path: str) -> None:
    """One line per (model, group) of ``report["rows"]``: ``y`` against ``x`` on log axes, the teacher's dashed.
    ``series``: (model, group field, group value) triples, in legend order."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, field, value in series:
        rows = [r for r in report["rows"] if r["model"] == label and r[field] == value]
        axis.plot([r[x] for r in rows], [r[y] for r in rows], marker="o",
                  linestyle="--" if label == "teacher" else "-", label=f"{label}, {field} {value}")
    format_log_axes([(axis, y_label)], x_label)
    axis.set_title(title)
    save_figure(figure, path)


def check_shape(benchmark, lengths, contexts, hidden_size, num_heads, num_kv_heads) -> None:
    """The arguments every training + decoding benchmark shares, refused with the benchmark's name."""
    if not lengths or not contexts or min(*lengths, *contexts) < 2:
        raise ValueError(f"bench {benchmark}: lengths and contexts must be non-empty lists of integers >= 2, got "
                         f"{lengths} and {contexts}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"bench {benchmark}: --heads ({num_heads}) must divide --hidden-size ({hidden_size}) and "
                         f"--kv-heads ({num_kv_heads}) must divide --heads")


def decode_shape(hidden_size, num_heads, num_kv_heads, layers, positions) -> dict:
    """Config fields of the small decoding models: the mixer's width and heads, ``layers`` layers."""
    return dict(vocab_size=2048, hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=positions)


def pick(rows, key, value, field, name_key, name):
    """``field`` of the row where ``key`` == value and ``name_key`` == name (None when there is none)."""
    return next((r[field] for r in rows if r[key] == value and r[name_key] == name), None)


def time_ratios(training, kinds, lengths) -> list[dict]:
    """Per T, each kind's fwd+bwd time over SDPA attention's, as ``<kind>_time_vs_sdpa``."""
    return [{"T": t, **{f"{kind}_time_vs_sdpa": pick(training, "T", t, "fwd_bwd_s", "mixer", kind)
                        / pick(training, "T", t, "fwd_bwd_s", "mixer", "sdpa_attention") for kind in kinds}}
            for t in lengths]


def memory_growth(rows) -> list[float]:
    """Peak memory ratio per doubling of T, between consecutive measured lengths (2.0: linear in T)."""
    rows = sorted(rows, key=lambda r: r["T"])
    return [round((b["peak_bytes"] / a["peak_bytes"]) ** (1 / math.log2(b["T"] / a["T"])), 3)
            for a, b in zip(rows, rows[1:])]


def decoding_rows(models: dict, contexts, decode_tokens, device, desc, batch: int = 1) -> list[dict]:
    """Per-token decode latency (median, after a prefill of each context) and cache bytes of each named model."""
    from tqdm.auto import tqdm

    from ...common.measures import decode_latency

    rows = []
    for context in tqdm(contexts, desc=desc, unit="context"):
        for name, model in models.items():
            latency, cache_bytes = decode_latency(model.to(device).eval(), context, decode_tokens, 2048, device,
                                                  batch=batch)
            rows.append({"context": context, "model": name, "token_latency_s": latency, "cache_bytes": cache_bytes})
    return rows


def plot_training_and_decoding(report, path, title, decode_label="decode latency per token (ms)"):
    """Three panels: training fwd+bwd time and peak memory per mixer against T, decode latency per model against the
    context (its cache at the longest context in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for kind in dict.fromkeys(r["mixer"] for r in report["training"]):
        rows = [r for r in report["training"] if r["mixer"] == kind]
        axes[0].plot([r["T"] for r in rows], [r["fwd_bwd_s"] for r in rows], marker="o", label=kind)
        rows = [r for r in rows if r["peak_bytes"]]
        axes[1].plot([r["T"] for r in rows], [r["peak_bytes"] / 2**20 for r in rows], marker="o", label=kind)
    for name in dict.fromkeys(r["model"] for r in report["decoding"]):
        rows = [r for r in report["decoding"] if r["model"] == name]
        axes[2].plot([r["context"] for r in rows], [1e3 * r["token_latency_s"] for r in rows], marker="o",
                     label=f"{name} ({rows[-1]['cache_bytes'] / 2**20:.2f} MiB cache at {rows[-1]['context']})")
    format_log_axes(list(zip(axes, ("training fwd+bwd (s)", "training peak memory (MiB)", decode_label))),
                    "context length")
    save_figure(figure, path, title)


def print_training_table(report, title, prefix):
    """T rows, one column per mixer (``prefix`` stripped): fwd+bwd seconds (peak MiB), SDPA first."""
    kinds = sorted({r["mixer"] for r in report["training"]}, key=lambda k: k != "sdpa_attention")
    print(f"\n{title} ({report['device']}, {report['threads']} threads): fwd+bwd s (peak MiB)")
    print(f"{'T':>6} | " + " ".join(f"{kind.removeprefix(prefix):>18}" for kind in kinds))
    for length in sorted({r["T"] for r in report["training"]}):
        row = {r["mixer"]: r for r in report["training"] if r["T"] == length}
        cells = [f"{row[k]['fwd_bwd_s']:.3f}" + ("" if row[k]["peak_bytes"] is None
                                                 else f" ({row[k]['peak_bytes'] / 2**20:.0f})") for k in kinds]
        print(f"{length:>6} | " + " ".join(f"{cell:>18}" for cell in cells))


def print_decoding_table(report):
    """Context rows, one column per model: ms/token (cache MiB)."""
    print(f"\nDecoding, {report['shape']['decode_layers']}-layer models: ms/token (cache MiB)")
    names = sorted({r["model"] for r in report["decoding"]})
    print(f"{'context':>8} | " + " ".join(f"{name:>17}" for name in names))
    for context in sorted({r["context"] for r in report["decoding"]}):
        row = {r["model"]: r for r in report["decoding"] if r["context"] == context}
        print(f"{context:>8} | " + " ".join(
            f"{1e3 * row[n]['token_latency_s']:>7.2f} ({row[n]['cache_bytes'] / 2**20:>7.3f})" for n in names))
