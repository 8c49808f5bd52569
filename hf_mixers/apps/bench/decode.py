"""``hf-mixers bench decode``: converted folders decoding as a user gets them, against their teacher.

Each folder is loaded as a user loads it (``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``: its
own remote code, the config it was saved with) in a fresh process beside the teacher, and decodes through a plain
``model.generate()``: whatever ``config.compile_decode`` picks by default. Two processes a folder, in turn, sharing one
compiled-steps cache (``--out``/compiled-steps, emptied first): "cold", the first process on a machine, which builds
the compiled step (measured at the first context only), and "warm", a later one, which loads it. In each, batch 1,
greedy, random prompt ids:

    first generate     the wall time of the process's first ``generate`` of the most new tokens (cold: the build)
    ms a token         (t(N) - t(1)) / (N - 1) of generate's wall time, N the most new tokens, after each context's
                       prompt, the best of ``--repeats``; the teacher's the same way, interleaved
    eager ms a token   the same with ``compile_decode = False`` (warm process only)
    generate s         a whole generate of each of ``--new-tokens`` for the model and the teacher

Written to bench_decode.json and bench_decode.png (ms a token over the teacher's, by context, cold and warm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from . import register_bench
from ..arguments import positive_list


def _generate_seconds(model, ids, new_tokens: int) -> float:
    import torch

    began = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - began


def measure(teacher_source: str, folder: str, contexts, new_tokens, repeats: int, eager: bool) -> dict:
    """One process's figures (the module docstring) for ``folder`` against ``teacher_source``."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...conversion import load_teacher

    teacher = load_teacher(teacher_source).model.eval()
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    most = max(new_tokens)
    counts = sorted({1, *new_tokens})
    ids = {context: torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(
        context)) for context in contexts}
    result = {"compile_decode": model.config.compile_decode, "points": []}
    result["first_generate_s"] = _generate_seconds(model, ids[contexts[0]], most)
    for context in contexts:
        times = {"model": {n: [] for n in counts}, "teacher": {n: [] for n in counts}}
        for _ in range(repeats):
            for n in counts:
                for label, which in (("teacher", teacher), ("model", model)):
                    times[label][n].append(_generate_seconds(which, ids[context], n))
        best = {label: {n: min(values) for n, values in by_count.items()} for label, by_count in times.items()}
        point = {"context": context, "generate_s": best,
                 **{f"{label}_ms_per_token": 1e3 * (best[label][most] - best[label][1]) / max(most - 1, 1)
                    for label in best}}
        if eager:
            model.config.compile_decode = False
            first, last = (min(_generate_seconds(model, ids[context], n) for _ in range(repeats)) for n in (1, most))
            point["eager_ms_per_token"] = 1e3 * (last - first) / max(most - 1, 1)
            model.config.compile_decode = result["compile_decode"]
        point["ratio"] = point["model_ms_per_token"] / point["teacher_ms_per_token"]
        result["points"].append(point)
    return result


def bench_decode(out_dir: str, model_dirs, teacher: str = "smollm2-135m", contexts=(512, 2048),
                 new_tokens=(8, 64), repeats: int = 3) -> dict:
    from .harness import save_point, write_report

    cache = os.path.join(out_dir, "compiled-steps")
    rows = []
    for folder in model_dirs:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise SystemExit(f"bench decode: {folder} is not a model folder (no config.json)")
        shutil.rmtree(cache, ignore_errors=True)  # the first process on this "machine" builds
        for process in ("cold", "warm"):  # cold: the build and the first context only
            warm = process == "warm"
            arguments = json.dumps([teacher, folder, list(contexts if warm else contexts[:1]), list(new_tokens),
                                    repeats, warm])
            done = subprocess.run([sys.executable, "-c", f"import json, sys; from {__name__} import measure; "
                                   f"print('RESULT', json.dumps(measure(*json.loads(sys.argv[1]))))", arguments],
                                  env={**os.environ, "HF_MIXERS_CACHE": out_dir}, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"bench decode: the {process} process for {folder} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.split("RESULT ", 1)[1])
            rows.append({"model": os.path.basename(os.path.normpath(folder)), "process": process, **result})
            save_point(out_dir, "bench_decode", rows[-1], rows)
    report = {"teacher": teacher, "contexts": list(contexts), "new_tokens": list(new_tokens), "repeats": repeats,
              "rows": rows}
    return write_report(report, out_dir, "bench_decode", _plot, lambda report: print(table(report)))


def table(report: dict) -> str:
    lines = ["| model | process | first generate s | " + " | ".join(
        f"ms a token x teacher @{context} (eager)" for context in report["contexts"]) + " |",
             "|---|---|---|" + "---|" * len(report["contexts"])]
    for row in report["rows"]:
        cells = [f"{p['ratio']:.2f}" + (f" ({p['eager_ms_per_token'] / p['teacher_ms_per_token']:.2f})"
                                        if "eager_ms_per_token" in p else "") for p in row["points"]]
        lines.append(f"| {row['model']} | {row['process']} | {row['first_generate_s']:.1f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for row in report["rows"]:
        axis.plot([p["context"] for p in row["points"]], [p["ratio"] for p in row["points"]], marker="o",
                  linestyle="-" if row["process"] == "warm" else ":", label=f"{row['model']} ({row['process']})")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("ms a token / the teacher's (plain generate)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _arguments(parser) -> None:
    parser.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="saved converted models")
    parser.add_argument("--teacher", default="smollm2-135m", help="the baseline (any convert SOURCE)")
    parser.add_argument("--contexts", type=positive_list, default=[512, 2048], help="prompt lengths (default 512,2048)")
    parser.add_argument("--new-tokens", type=positive_list, default=[8, 64],
                        help="the generations timed (default 8,64; the most gives ms a token)")


def _run(args):
    return bench_decode(args.out, args.model_dirs, args.teacher, args.contexts, args.new_tokens, args.repeats)


register_bench("decode", "converted folders decoding by default (plain generate, fresh processes, cold and warm "
               "compiled-step cache) against their teacher", _arguments, _run)
