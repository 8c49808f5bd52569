"""``hf-mixers bench kernels``: the Triton kernels against the PyTorch paths and SDPA attention, kernel level.

For each model shape (heads and widths of SmolLM2-135M and Llama-3-8B) and sequence length T, one batch row:

    sdpa          torch scaled_dot_product_attention, causal, the model's q/kv heads (FlashAttention on CUDA):
                  the baseline a converted layer replaces
    sessa_torch   feedback_solve_chunked: the PyTorch chunked solve with its hand-written backward
    sessa_triton  feedback_solve_triton (CUDA only: the CPU interpreter is no benchmark)
    rsa_torch     rsa_chunked: the RSA memory of a layer of this shape as converted (4 levels x 64 slots,
                  chunks of 64, the count-aware softmax readout)
    rsa_triton    rsa_chunked_triton: its read side in Triton kernels (CUDA only)

timed round-robin (``bench.time_calls``) for the forward alone (no grad) and forward + backward, with the peak CUDA
memory of a forward + backward step. A candidate whose forward + backward at one T, scaled linearly to the next T (a
lower bound of its cost there), is longer than ``max_call_seconds`` is not run at the longer ones of that shape (the
report lists it under "cut"): the PyTorch paths at 16K tokens and Llama-3-8B's heads would take the run's minutes.
Each point's rows are written as it ends (``bench_kernels.partial.json``, and a log line), so a run stopped part-way
keeps what it measured. On CPU only the PyTorch paths are compared and memory is not measured.
Written to bench_kernels.json / .png with ratios to the PyTorch path and to SDPA from the same run.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ...common.history import save_figure
from ...common.dtypes import names_of, to_dtype
from ...core.registry import get_mixer
from .harness import bench_device, build_mixer, format_log_axes, save_point, time_calls, write_report
from ...kernels.dispatch import triton_unavailable
from ...kernels.feedback_solve import feedback_solve
from ...kernels.rsa_memory import initial_state, rsa_memory
from . import register_bench
from ..arguments import at_least, name_list, positive_list, positive_number

# feedback heads: SmolLM2 as converted (one feedback head over the whole width, the official layout); Llama-3-8B
# with one feedback head per attention head (D = d = 128 per row), the layout a kernel keeps in registers.
SHAPES = {
    "smollm2-135m": dict(heads=9, kv_heads=3, head_dim=64, feedback_heads=1),
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, feedback_heads=32),
}
CANDIDATES = ("sdpa", "sessa_torch", "sessa_triton", "rsa_torch", "rsa_triton")


def _candidate(candidate: str, shape: dict, length: int, device, dtype, generator, chunk_size: int,
               rsa_options: dict | None = None):
    """(input tensors that take gradients, run(): the output) of one candidate at one point. ``shape``: a head
    layout (``SHAPES``; ``feedback_key_dim`` sets Sessa's feedback keys apart from its row width); ``rsa_options``:
    RSA mixer options over the conversion defaults (e.g. the local window)."""
    def randn(*size):
        return torch.randn(*size, generator=generator).to(device, dtype).requires_grad_()

    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    if candidate == "sdpa":
        tensors = {"query": randn(1, heads, length, head_dim), "key": randn(1, kv_heads, length, head_dim),
                   "value": randn(1, kv_heads, length, head_dim)}
        return tensors, lambda: F.scaled_dot_product_attention(**tensors, is_causal=True, enable_gqa=True)
    if candidate.startswith("rsa"):  # the memory of an RSA layer of this shape as converted (4 x 64 slots)
        module, _ = build_mixer("rsa", converted_rsa_options(rsa_options), heads * head_dim, heads, kv_heads, device,
                                torch.float32)
        tensors = {"q": randn(1, kv_heads, heads // kv_heads, length, head_dim),
                   "k": randn(1, kv_heads, length, head_dim), "v": randn(1, kv_heads, length, head_dim)}
        backend = "triton" if candidate == "rsa_triton" else "torch"  # each candidate on its own path, forced

        def run():
            params = module.memory_params(torch.float32)  # rebuilt per call: a fresh autograd graph
            state = initial_state(params, 1, head_dim, torch.float32)
            return rsa_memory(**tensors, valid=None, state=state, params=params, backend=backend, fresh=True)[0]
        return tensors, run
    rows = shape["feedback_heads"]
    width = heads * head_dim // rows  # f: the attention output, split by feedback head
    key_dim = shape.get("feedback_key_dim", width)
    gain = (torch.rand(rows, length, generator=generator) * 1.8 - 0.9).to(device, dtype).requires_grad_()
    tensors = {"f": randn(rows, length, width), "q": randn(rows, length, key_dim), "k": randn(rows, length, key_dim),
               "gain": gain}
    backend = "triton" if candidate == "sessa_triton" else "torch"  # each candidate on its own path, forced
    return tensors, lambda: feedback_solve(**tensors, chunk_size=chunk_size, backend=backend)


def converted_rsa_options(rsa_options: dict | None = None) -> dict:
    """RSA's options as ``convert`` sets them (its conversion defaults: the count-aware softmax readout), then
    ``rsa_options``. Each readout is its own kernel variant, so what is timed and warmed (`make gpu-check`) must be the
    converted layer's: warming another readout leaves the converted variant to compile inside the timed run."""
    return {**get_mixer("rsa").conversion_options, **(rsa_options or {})}


def _unsupported(shape: dict) -> dict:
    """{candidate: why its kernel cannot take this head layout}: the RSA read holds a head's (C, d) tile whole, and
    wider ones do not fit a GPU block's shared memory (the Sessa solve takes any width, in blocks)."""
    from ...kernels.rsa_chunk_triton import rsa_chunk_triton_supports

    module, _ = build_mixer("rsa", converted_rsa_options(), shape["heads"] * shape["head_dim"], shape["heads"],
                            shape["kv_heads"], "cpu", torch.float32)
    reason = rsa_chunk_triton_supports(module.memory_params(torch.float32), v=torch.zeros(1, 1, 1, shape["head_dim"]))
    return {"rsa_triton": reason} if reason else {}


def _calls(tensors, run):
    def forward():
        with torch.no_grad():
            run()

    def forward_backward():
        for tensor in tensors.values():
            tensor.grad = None
        run().float().pow(2).mean().backward()

    return forward, forward_backward


# report key -> (numerator candidate, denominator candidate, measure): ratios from the same run
RATIOS = {
    "torch_fwd_bwd_vs_sdpa": ("sessa_torch", "sdpa", "fwd_bwd_s"),
    "triton_speedup_fwd": ("sessa_torch", "sessa_triton", "fwd_s"),
    "triton_speedup_fwd_bwd": ("sessa_torch", "sessa_triton", "fwd_bwd_s"),
    "triton_fwd_bwd_vs_sdpa": ("sessa_triton", "sdpa", "fwd_bwd_s"),
    "triton_peak_vs_torch": ("sessa_triton", "sessa_torch", "peak_bytes"),
    "rsa_torch_fwd_bwd_vs_sdpa": ("rsa_torch", "sdpa", "fwd_bwd_s"),
    "rsa_triton_speedup_fwd_bwd": ("rsa_torch", "rsa_triton", "fwd_bwd_s"),
    "rsa_triton_peak_vs_torch": ("rsa_triton", "rsa_torch", "peak_bytes"),
}


def _cuda_peak(step) -> int:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def bench_kernels(out_dir, lengths=None, shapes=("smollm2-135m", "llama3-8b"), repeats=3, dtype="bfloat16",
                  chunk_size=64, device=None, max_call_seconds: float = 10.0) -> dict:
    device = bench_device(device, "kernels")
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown:
        raise ValueError(f"bench kernels: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    lengths = lengths or ([1024, 2048, 4096, 8192, 16384] if device.type == "cuda" else [256, 512, 1024])
    torch_dtype = to_dtype(dtype)
    why_not = triton_unavailable(device)
    if why_not is None and os.environ.get("TRITON_INTERPRET") == "1":
        why_not = "TRITON_INTERPRET=1: the interpreter is no benchmark"
    unsupported = {name: _unsupported(SHAPES[name]) if why_not is None else {} for name in shapes}
    results, cut = [], {}  # cut: {shape: {candidate: the T at which it passed max_call_seconds}}
    points = [(name, length) for name in shapes for length in sorted(lengths)]
    for name, length in tqdm(points, desc="bench kernels", unit="point"):
        generator = torch.Generator().manual_seed(0)
        candidates = [c for c in CANDIDATES if (not c.endswith("triton") or why_not is None)
                      and c not in unsupported[name] and c not in cut.get(name, {})]
        inputs = {c: _candidate(c, SHAPES[name], length, device, torch_dtype, generator, chunk_size)
                  for c in candidates}
        calls = {c: _calls(*inputs[c]) for c in candidates}
        forward = time_calls([calls[c][0] for c in candidates], repeats, device)
        forward_backward = time_calls([calls[c][1] for c in candidates], repeats, device)
        for index, candidate in enumerate(candidates):
            results.append({"shape": name, "T": length, "candidate": candidate, "fwd_s": forward[index][0],
                            "fwd_bwd_s": forward_backward[index][0],
                            "peak_bytes": _cuda_peak(calls[candidate][1]) if device.type == "cuda" else None})
            save_point(out_dir, "bench_kernels", results[-1], results)
            # the next T costs at least length-proportionally more: a call predicted past the limit is not made
            following = next((longer for longer in sorted(lengths) if longer > length), length)
            if forward_backward[index][0] * following / length > max_call_seconds:
                cut.setdefault(name, {})[candidate] = length
        del inputs, calls
        gc.collect()

    def pick(name, length, candidate, key):
        return next((r[key] for r in results if (r["shape"], r["T"], r["candidate"]) == (name, length, candidate)),
                    None)

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    ratios = [{"shape": name, "T": length,
               **{key: ratio(pick(name, length, top, field), pick(name, length, bottom, field))
                  for key, (top, bottom, field) in RATIOS.items()}}
              for name, length in points]
    report = {"benchmark": "kernels",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": dtype, "chunk_size": chunk_size, "repeats": repeats,
              "shapes": {name: SHAPES[name] for name in shapes}, "triton": why_not or "timed",
              "not_run": {name: reasons for name, reasons in unsupported.items() if reasons},
              "max_call_seconds": max_call_seconds,
              "cut": {name: {candidate: f"not run past T={length}: its forward+backward there, scaled to the next "
                                        f"T, is over {max_call_seconds:g} s" for candidate, length in by.items()}
                      for name, by in cut.items()},
              "memory": "torch.cuda.max_memory_allocated over one forward+backward" if device.type == "cuda"
              else "not measured on CPU", "results": results, "ratios": ratios}
    return write_report(report, out_dir, "bench_kernels", _plot, _print_table)


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(report["shapes"])
    figure, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    for axis, name in zip(axes[0], shapes):
        for candidate in CANDIDATES:
            rows = [r for r in report["results"] if r["shape"] == name and r["candidate"] == candidate]
            if rows:
                axis.plot([r["T"] for r in rows], [r["fwd_bwd_s"] for r in rows], marker="o", label=candidate)
        axis.set_title(name)
    format_log_axes([(axis, "forward+backward (s)") for axis in axes[0]], "sequence length T")
    save_figure(figure, path, f"Sessa feedback solve and RSA memory vs SDPA -- {report['device']}, {report['dtype']}, "
                f"chunk {report['chunk_size']}; Triton: {report['triton']}")


def _print_table(report: dict) -> None:
    def fmt(value, scale=1.0, digits=4):
        return "-" if value is None else f"{value / scale:.{digits}f}"

    print(f"\nkernels ({report['device']}, {report['dtype']}; Triton: {report['triton']})")
    for name, reasons in report.get("not_run", {}).items():
        for candidate, reason in reasons.items():
            print(f"  {name}: {candidate} not run: {reason}")
    for name, reasons in report.get("cut", {}).items():
        for candidate, reason in reasons.items():
            print(f"  {name}: {candidate} {reason}")
    print(f"{'shape':>13} {'T':>6} | {'candidate':>12} {'fwd s':>8} {'fwd+bwd s':>9} {'peak MiB':>9}")
    for row in report["results"]:
        print(f"{row['shape']:>13} {row['T']:>6} | {row['candidate']:>12} {fmt(row['fwd_s']):>8} "
              f"{fmt(row['fwd_bwd_s']):>9} {fmt(row['peak_bytes'], 2**20, 1):>9}")
    columns = {"sessa torch/sdpa": "torch_fwd_bwd_vs_sdpa", "sessa triton x": "triton_speedup_fwd_bwd",
               "sessa triton/sdpa": "triton_fwd_bwd_vs_sdpa", "sessa mem tri/torch": "triton_peak_vs_torch",
               "rsa torch/sdpa": "rsa_torch_fwd_bwd_vs_sdpa", "rsa triton x": "rsa_triton_speedup_fwd_bwd",
               "rsa mem tri/torch": "rsa_triton_peak_vs_torch"}
    print("\nforward+backward ratios (x: speed-up of the Triton kernel over the PyTorch path)")
    print(f"{'shape':>13} {'T':>6} | " + " ".join(f"{label:>19}" for label in columns))
    for row in report["ratios"]:
        print(f"{row['shape']:>13} {row['T']:>6} | "
              + " ".join(f"{fmt(row[key], digits=2):>19}" for key in columns.values()))


def _arguments(parser) -> None:
    parser.add_argument("--lengths", type=positive_list, default=None, help="sequence lengths (default per shape)")
    parser.add_argument("--shapes", type=name_list, default=["smollm2-135m", "llama3-8b"],
                        help=f"model shapes (heads and widths), of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", choices=names_of("fp32", "bf16"), default="float32")
    parser.add_argument("--chunk-size", type=at_least(1), default=64, help="query chunk of the feedback solve (64)")
    parser.add_argument("--max-call-seconds", type=positive_number, default=10.0,
                        help="a candidate whose forward+backward, scaled to the next T, is slower than this is not "
                             "run at longer T (10)")


register_bench("kernels", "the Triton kernels against their PyTorch paths and SDPA attention (CUDA)", _arguments,
               lambda args: bench_kernels(args.out, lengths=args.lengths, shapes=args.shapes, repeats=args.repeats,
                                          dtype=args.dtype, chunk_size=args.chunk_size, device=args.device,
                                          max_call_seconds=args.max_call_seconds))
