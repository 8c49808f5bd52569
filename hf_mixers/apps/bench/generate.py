"""``hf-mixers bench generate``: serving a converted model as a user meets it, against its teacher in the same run.

Models: the teacher (``--teacher``, default the embedded SmolLM2-135M), each saved MODEL_DIR, and the teacher
converted here to each ``--mixer`` (with ``--option KEY=VALUE``). For each model, batch size and context:
  prefill   one forward over batch x context prompt tokens that builds the cache: prompt tokens/s
  decode    one-token steps after that prompt, the median of ``--decode-tokens``: tokens/s = batch / step
  cache     its bytes after the prompt; with the weights, the largest batch whose weights + caches fit
            ``--memory-budget-gib`` at that context (activations not counted: a lower bound on what fits)
and at batch 1 the wall time of ``generate`` for ``--generate-tokens`` new tokens after a ``--prompt-tokens``
prompt (greedy). With ``--budget-decode-steps N``: decode tokens/s at the largest batch that fits the budget (at
most ``--budget-batch-cap``), each context, the batch-1 prompt's cache copied to every row (a step's cost does not
depend on what the rows hold), so no batch x 16K prompt has to be prefilled. Each figure also as a ratio to the
teacher's at the same point; with ``--repeats`` a row keeps its fastest repeat, and its decode ratio also paired:
the median over repeats of its step against the teacher's in the same round, which a drifting machine moves
least. Written to bench_generate.json,
bench_generate.md (the table) and bench_generate.png (decode tokens/s against the context, a line per model and
batch).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import torch

from ...common.dtypes import names_of, to_dtype
from . import register_bench
from ..arguments import at_least, key_value, option_dict, positive_list, positive_number


def _weights_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _models(teacher_source: str, model_dirs, mixers, options, dtype, device,
            compile_decode: bool | str = False) -> tuple[dict, object]:
    """{label: model} in ``dtype`` on ``device``, the teacher first; and the teacher's tokenizer. ``compile_decode``
    (True or a torch.compile mode): the converted models' blocks decode through their compiled step where they have
    one (``config.compile_decode``)."""
    from transformers import AutoModelForCausalLM

    from ...conversion import convert, load_teacher

    teacher = load_teacher(teacher_source)
    models = {"teacher": teacher.model}
    for folder in model_dirs:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"bench generate: {folder}: no such model folder")
        label = os.path.basename(os.path.normpath(folder))  # the folder's name; its path when the name is taken
        models[os.path.normpath(folder) if label in models else label] = AutoModelForCausalLM.from_pretrained(folder)
    for mixer in mixers:
        student, _ = convert(teacher, mixer, mixer_options=options, progress=False)
        label = mixer + "".join(f" {key}={value}" for key, value in sorted(options.items()))
        models[label] = student
    for label, model in models.items():
        model.to(device=device, dtype=dtype).eval()
        if label != "teacher":  # eager unless asked: "auto" would compile a long generate
            model.config.compile_decode = compile_decode
    if compile_decode:
        suffix = ", compiled decode" + ("" if compile_decode is True else f" ({compile_decode})")
        models = {label if label == "teacher" else label + suffix: model for label, model in models.items()}
    return models, teacher.tokenizer


@torch.no_grad()
def _generate_seconds(model, tokenizer, prompt_tokens: int, new_tokens: int, device) -> float:
    """Wall time of greedy ``generate``: ``new_tokens`` tokens after a random ``prompt_tokens`` prompt, batch 1."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    began = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=pad)
    synchronize()
    return time.perf_counter() - began


def _point(label, model, batch: int, context: int, runs: list, weights: int, budget: float, budget_batch_cap: int,
           budget_decode_steps: int, device) -> dict:
    """One model's row at (batch, context) from its ``generation_timing`` runs (the fastest of them, every repeat's
    decode step kept beside it); where the first
    run kept its cache (``--budget-decode-steps``), that cache copied to the largest batch that fits the budget
    (capped) and decoded."""
    from ...common.measures import decode_step_seconds

    prefill, decode = min(r["prefill_s"] for r in runs), min(r["decode_s"] for r in runs)
    per_row = runs[0]["cache_bytes"] / batch
    fits = max(0, int((budget - weights) // per_row)) if per_row else None
    row = {"model": label, "batch": batch, "context": context, "prefill_s": prefill,
           "prefill_tokens_per_s": batch * context / prefill, "decode_s_per_step": decode,
           "decode_tokens_per_s": batch / decode, "cache_bytes": runs[0]["cache_bytes"], "max_batch_in_budget": fits,
           # every repeat's median step, in the order run: the row keeps the fastest, these show the spread
           "decode_s_per_step_repeats": [r["decode_s"] for r in runs]}
    cache = runs[0].pop("cache", None)
    if cache is not None and fits:
        row["budget_batch"] = min(fits, budget_batch_cap)
        cache.batch_repeat_interleave(row["budget_batch"])
        seconds = decode_step_seconds(model, cache, row["budget_batch"], budget_decode_steps, model.config.vocab_size,
                                      device)
        row["budget_decode_tokens_per_s"] = row["budget_batch"] / seconds
    return row


def bench_generate(out_dir: str, teacher: str = "smollm2-135m", model_dirs=(), mixers=(), options=None,
                   batch_sizes=(1, 4), contexts=(512, 2048), decode_tokens: int = 8, prompt_tokens: int = 512,
                   generate_tokens: int = 32, memory_budget_gib: float = 8.0, dtype: str = "float32", device=None,
                   repeats: int = 1, compile_decode: bool | str = False, budget_decode_steps: int = 0,
                   budget_batch_cap: int = 512) -> dict:
    from tqdm.auto import tqdm

    from .harness import bench_device, save_point, write_report
    from ...common.files import write_atomically
    from ...common.measures import generation_timing

    from ...decode.switch import check_compile_decode

    if not model_dirs and not mixers:
        raise ValueError("bench generate: name a model: MODEL_DIR arguments (saved converted models) and/or --mixer "
                         "(the teacher converted here)")
    check_compile_decode(compile_decode, "bench generate")
    device = bench_device(device, "generate")
    models, tokenizer = _models(teacher, model_dirs, mixers, options or {}, to_dtype(dtype), device,
                                compile_decode)
    budget = memory_budget_gib * 2**30
    weights = {label: _weights_bytes(model) for label, model in models.items()}
    rows = []
    # Each compiled step built before anything is timed: the steps right after a compile ran measurably slower on a
    # CPU, which the two warm-up steps of a point did not cover.
    # Timed, the warm-up is what a compiled step costs to build (its compile, a 16-token prompt and 4 steps): what
    # a process's first `generate` at that batch size waits.
    compiled = {label: model for label, model in models.items() if compile_decode and label != "teacher"}
    compile_seconds = {}
    for (label, model), batch in itertools.product(compiled.items(), batch_sizes):
        began = time.perf_counter()
        generation_timing(model, 16, 4, model.config.vocab_size, device, warmup=2, batch=batch)
        compile_seconds.setdefault(label, {})[str(batch)] = time.perf_counter() - began
    # At each (batch, context) the models one after another: a shared CPU's speed drifts by 10-40% within minutes,
    # and so the drift falls on the teacher and the converted models alike, not on one of them. Each repeat starts
    # from the next model: in A/B runs on this CPU the model timed first after the teacher came out 2-4% ahead of
    # the same model timed later in the round (docs/benchmarks.md), and the fastest repeat is what a row keeps.
    labels = list(models)
    progress = tqdm(total=len(batch_sizes) * len(contexts) * repeats * len(labels), desc="bench generate",
                    unit="point")
    for batch, context in itertools.product(batch_sizes, contexts):
        at_budget = budget_decode_steps and batch == 1
        timings = {label: [] for label in labels}
        for repeat in range(repeats):
            first = repeat % len(labels)
            for label in labels[first:] + labels[:first]:
                model = models[label]
                timings[label].append(generation_timing(model, context, decode_tokens, model.config.vocab_size,
                                                        device, warmup=2, batch=batch,
                                                        keep_cache=at_budget and not timings[label]))
                progress.update()
        for label in labels:
            rows.append(_point(label, models[label], batch, context, timings.pop(label), weights[label], budget,
                               budget_batch_cap, budget_decode_steps, device))
            save_point(out_dir, "bench_generate", rows[-1], rows)
    progress.close()
    order = {label: index for index, label in enumerate(models)}
    rows.sort(key=lambda row: order[row["model"]])  # by model, then (stable) by batch and context
    _against_teacher(rows)
    generation = {label: _generate_seconds(model, tokenizer, prompt_tokens, generate_tokens, device)
                  for label, model in models.items()}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"benchmark": "generate", "device": device_name, "dtype": dtype, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "teacher": teacher, "models": list(models), "batch_sizes": list(batch_sizes),
              "contexts": list(contexts), "decode_tokens": decode_tokens, "repeats": repeats,
              "memory_budget_gib": memory_budget_gib,
              "budget_decode_steps": budget_decode_steps, "budget_batch_cap": budget_batch_cap,
              "compile_seconds": compile_seconds, "rows": rows,
              "generate": {"prompt_tokens": prompt_tokens, "new_tokens": generate_tokens, "seconds": generation,
                           "speedup_vs_teacher": {label: generation["teacher"] / seconds
                                                  for label, seconds in generation.items()}}}
    os.makedirs(out_dir, exist_ok=True)
    write_atomically(os.path.join(out_dir, "bench_generate.md"), table(report))
    return write_report(report, out_dir, "bench_generate", _plot, lambda r: print(table(r)))


def _against_teacher(rows: list) -> None:
    """Each row's ratios to the teacher's row at the same batch and context, added to it."""
    teacher_rows = {(r["batch"], r["context"]): r for r in rows if r["model"] == "teacher"}
    for row in rows:
        base = teacher_rows[(row["batch"], row["context"])]
        row["decode_speedup_vs_teacher"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        # each repeat's model against the teacher's step of the same round (seconds apart): the ratio a drifting
        # machine moves least, where the fastest repeats of two models may come from different phases
        row["decode_speedup_vs_teacher_paired"] = statistics.median(
            teacher / model for teacher, model in zip(base["decode_s_per_step_repeats"],
                                                      row["decode_s_per_step_repeats"], strict=True))
        row["prefill_speedup_vs_teacher"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        if row["max_batch_in_budget"] is not None and base["max_batch_in_budget"]:
            row["max_batch_vs_teacher"] = row["max_batch_in_budget"] / base["max_batch_in_budget"]
        if "budget_decode_tokens_per_s" in row and "budget_decode_tokens_per_s" in base:
            row["budget_decode_vs_teacher"] = row["budget_decode_tokens_per_s"] / base["budget_decode_tokens_per_s"]


def table(report: dict) -> str:
    """The report as a markdown table, then the generate line."""
    paired = report.get("repeats", 1) > 1  # with one repeat the paired ratio is the ratio itself
    lines = [f"Decode and prefill on {report['device']} ({report['dtype']}, {report['threads']} threads), budget "
             f"{report['memory_budget_gib']:g} GiB (weights + caches); ratios to the teacher at the same point"
             + ("; paired: the median over repeats of each repeat's ratio to the teacher's in the same round"
                if paired else "") + ".", "",
             "| model | batch | context | prefill tok/s | x teacher | decode tok/s | x teacher | "
             + ("x teacher, paired | " if paired else "") + "cache MiB | max batch in budget | x teacher |",
             "|---|---|---|---|---|---|---|" + ("---|" if paired else "") + "---|---|---|"]
    for row in report["rows"]:
        most, ratio = row["max_batch_in_budget"], row.get("max_batch_vs_teacher")
        cells = [row["model"], row["batch"], row["context"], f"{row['prefill_tokens_per_s']:.0f}",
                 f"{row['prefill_speedup_vs_teacher']:.2f}", f"{row['decode_tokens_per_s']:.1f}",
                 f"{row['decode_speedup_vs_teacher']:.2f}",
                 *([f"{row['decode_speedup_vs_teacher_paired']:.2f}"] if paired else []),
                 f"{row['cache_bytes'] / 2**20:.1f}", "-" if most is None else most,
                 "-" if ratio is None else f"{ratio:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    budget_rows = [row for row in report["rows"] if "budget_decode_tokens_per_s" in row]
    if budget_rows:
        lines += ["", f"Decode at the largest batch within the budget (capped at {report['budget_batch_cap']}; the "
                  "prompt's cache copied to every row):", "",
                  "| model | context | batch | decode tok/s | x teacher |", "|---|---|---|---|---|"]
        lines += [f"| {row['model']} | {row['context']} | {row['budget_batch']} | "
                  f"{row['budget_decode_tokens_per_s']:.1f} | "
                  + ("-" if "budget_decode_vs_teacher" not in row else f"{row['budget_decode_vs_teacher']:.2f}") + " |"
                  for row in budget_rows]
    if report.get("compile_seconds"):
        lines += ["", "compiled token steps built (the first decode at each batch size: the compile, a 16-token "
                  "prompt and 4 steps): " + ", ".join(f"{label} at batch {batch} {seconds:.1f} s"
                                                      for label, batches in report["compile_seconds"].items()
                                                      for batch, seconds in batches.items())]
    generate = report["generate"]
    lines += ["", f"generate, {generate['new_tokens']} new tokens after a {generate['prompt_tokens']}-token prompt, "
              "batch 1: " + ", ".join(f"{label} {seconds:.2f} s (x{generate['speedup_vs_teacher'][label]:.2f})"
                                      for label, seconds in generate["seconds"].items())]
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: str) -> None:
    from .harness import plot_against_teacher

    plot_against_teacher(report, itertools.product(report["models"], ["batch"], report["batch_sizes"]), "context",
                         "decode_tokens_per_s", "context (prompt tokens)", "decode tokens/s",
                         f"decode throughput, {report['device']}, {report['dtype']}", path)


def _arguments(parser) -> None:
    parser.add_argument("model_dirs", nargs="*", metavar="MODEL_DIR", help="saved converted models to measure")
    parser.add_argument("--teacher", default="smollm2-135m", help="the baseline (any convert SOURCE; default the "
                        "embedded SmolLM2-135M)")
    parser.add_argument("--mixer", action="append", default=[], help="also convert the teacher to this mixer here "
                        "(repeatable)")
    parser.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="a mixer option for --mixer, e.g. rsa_window=64 (repeatable)")
    parser.add_argument("--batch-sizes", type=positive_list, default=[1, 4], help="default 1,4")
    parser.add_argument("--contexts", type=positive_list, default=[512, 2048], help="prompt lengths (default "
                        "512,2048)")
    parser.add_argument("--decode-tokens", type=at_least(1), default=8, help="timed decode steps per point")
    parser.add_argument("--prompt-tokens", type=at_least(1), default=512, help="the generate timing's prompt")
    parser.add_argument("--generate-tokens", type=at_least(1), default=32, help="the generate timing's new tokens")
    parser.add_argument("--memory-budget-gib", type=positive_number, default=8.0,
                        help="weights + caches (default 8)")
    parser.add_argument("--dtype", choices=names_of("fp32", "bf16"), default="float32")
    parser.add_argument("--budget-decode-steps", type=at_least(0), default=0, help="also time this many decode "
                        "steps at the largest batch within --memory-budget-gib (each context, from the batch-1 "
                        "prompt's cache copied to every row; 0: off)")
    parser.add_argument("--budget-batch-cap", type=at_least(1), default=512, help="the most rows that decode "
                        "(default 512)")
    parser.add_argument("--compile-decode", nargs="?", const=True, default=False, metavar="MODE",
                        help="decode the converted models' blocks through their torch.compile'd step where they "
                        "have one (config.compile_decode; compiled during warmup, once per mixer and batch size); "
                        "MODE: a torch.compile mode, e.g. reduce-overhead (CUDA graphs on CUDA); the teacher stays "
                        "eager")


def _run(args):
    return bench_generate(args.out, teacher=args.teacher, model_dirs=args.model_dirs, mixers=args.mixer,
                          options=option_dict(args.option), batch_sizes=args.batch_sizes, contexts=args.contexts,
                          decode_tokens=args.decode_tokens, prompt_tokens=args.prompt_tokens,
                          generate_tokens=args.generate_tokens, memory_budget_gib=args.memory_budget_gib,
                          dtype=args.dtype, device=args.device, repeats=args.repeats,
                          compile_decode=args.compile_decode, budget_decode_steps=args.budget_decode_steps,
                          budget_batch_cap=args.budget_batch_cap)


register_bench("generate", "prefill and decode tokens/s, cache and the largest batch in a memory budget, and the time "
               "to generate, of converted models against their teacher", _arguments, _run)
