"""``hf-mixers compare``: one teacher, several mixers, the same recipe and token budget -> one table, one plot.

    each entry (a mixer and chosen options: ``rsa``, ``rsa:rsa_window=64``, ``sessa``)
        convert -> distil with the recipe -> held-out perplexity and KL at init and after; passkey retrieval;
        cache bytes at long contexts; decode ms/token; training tokens/s
    -> OUT/<entry>/      the distilled model, its reports, and ``entry.json`` once the entry is finished
    -> OUT/compare.json, OUT/compare.md, OUT/compare.png       (the teacher measured the same way, in the same run)

Resumable: relaunching the same command redoes nothing that finished (an entry with its ``entry.json``), and an
entry that was killed resumes from its training checkpoints. An entry finished under other settings (recipe,
measures) is refused, naming what changed: it would not be comparable.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass

from ..common.files import check_output_folder, write_atomically
from ..common.history import save_figure, wider_table
from ..common.measures import cache_bytes_at, decode_latency, passkey_accuracy

ENTRY_FILE = "entry.json"


@dataclass(frozen=True)
class Entry:
    """One compared configuration: a registered mixer and option values (``MixerOption`` names)."""

    mixer: str
    options: dict

    @property
    def label(self) -> str:
        options = ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(self.options.items()))
        return f"{self.mixer}:{options}" if options else self.mixer

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.label.replace(":", "__"))


def parse_entry(text: str) -> Entry:
    """``MIXER`` or ``MIXER:KEY=VALUE,KEY=VALUE`` (values as JSON when they are JSON; KEY with or without the
    mixer's prefix; a value may hold commas: a comma starts a new option only before ``KEY=``) -> an Entry. An
    unknown mixer or option, an option given twice or a value its check refuses is a ValueError naming it, before
    any work."""
    from ..core.registry import get_mixer, list_mixers

    mixer, _, rest = text.partition(":")
    names = [spec.name for spec in list_mixers(convertible=True)]
    if mixer not in names:
        raise ValueError(f"compare entry {text!r}: unknown mixer {mixer!r}; choose from {names}")
    spec = get_mixer(mixer)
    pairs = []
    for item in filter(None, re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", rest)):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"compare entry {text!r}: {item!r} is not KEY=VALUE")
        try:
            pairs.append((key, json.loads(value)))
        except json.JSONDecodeError:
            pairs.append((key, value))
    full = [spec.option_name(key) for key, _ in pairs]
    twice = sorted({name for name in full if full.count(name) > 1})
    if twice:
        raise ValueError(f"compare entry {text!r}: {twice[0]} is given twice")
    return Entry(mixer, spec.checked_options(dict(pairs), f"compare entry {text!r}"))


def _measure(model, tokenizer, settings: dict, progress: bool) -> dict:
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    passkey = passkey_accuracy(model, tokenizer, settings["passkey_lengths"], trials=settings["passkey_trials"],
                               progress=progress)
    seconds, _ = decode_latency(model, settings["decode_context"], settings["decode_tokens"], vocab, device)
    return {"passkey": {str(length): result["accuracy"] for length, result in passkey.items()},
            "cache_bytes": {str(c): b for c, b in cache_bytes_at(model, settings["cache_contexts"], vocab,
                                                                 device).items()},
            "decode_ms_per_token": seconds * 1e3}


def _tokens_per_s(folder: str) -> dict:
    """Median training tokens/s per stage, from the entry's metrics.jsonl."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {stage: statistics.median(r["tokens_per_s"] for r in rows if r["stage"] == stage)
            for stage in sorted({r["stage"] for r in rows})}


def _finished(folder: str, settings: dict, label: str, overwrite: bool):
    """The finished entry's result, None if it has not finished; refused if it finished under other settings."""
    path = os.path.join(folder, ENTRY_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        result = json.load(handle)
    from ..recipes.config import flatten, recipe_with_defaults

    recorded = dict(result["settings"])
    if "recipe" in recorded:  # fields added to recipes since that entry ran are not changes if left at their defaults
        recorded["recipe"] = {key: value for key, value in recipe_with_defaults(recorded["recipe"]).items()
                              if key != "output"}
    if recorded == settings:
        return result
    if overwrite:
        return None
    old, new = flatten(recorded), flatten(settings)
    changed = [f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}"
               for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
    raise ValueError(f"{path}: entry {label} finished under other settings ({'; '.join(changed)}); use another "
                     "--out, or --overwrite to redo it")


def trained_options(entries: list[Entry], recipe_options: dict) -> dict:
    """{label: the options each entry trains with}: the recipe's ``model.mixer_options`` (files and --set) that
    belong to the entry's mixer, then the entry's own on top. A recipe option of no entry's mixer is an error: it
    would be silently unused."""
    from ..core.registry import get_mixer

    used, trained = set(), {}
    for entry in entries:
        spec = get_mixer(entry.mixer)
        names = {option.name for option in spec.options}
        mine = {key: spec.option_name(key) for key in recipe_options if spec.option_name(key) in names}
        used |= set(mine)
        trained[entry.label] = {**{name: recipe_options[key] for key, name in mine.items()}, **entry.options}
    unused = sorted(set(recipe_options) - used)
    if unused:
        mixers = sorted({entry.mixer for entry in entries})
        raise ValueError(f"compare: model.mixer_options {unused} belong to none of the compared mixers {mixers}")
    return trained


def run_compare(out: str, entries: list[Entry], teacher_source: str = "smollm2-135m", recipes=(), overrides=(),
                passkey_lengths=(1024, 2048), passkey_trials: int = 5, cache_contexts=(4096, 16384),
                decode_context: int = 512, decode_tokens: int = 16, overwrite: bool = False,
                progress: bool = True) -> dict:
    """Compare ``entries`` (see the module docstring); returns what OUT/compare.json holds."""
    from tqdm.auto import tqdm

    from ..conversion import load_teacher
    from ..core.registry import get_mixer
    from ..recipes import RecipeError, load_recipe
    from ..recipes.stages import distill

    if not entries:
        raise ValueError("compare: name at least one entry (--mixer rsa --mixer rsa:rsa_window=64 ...)")
    out = check_output_folder(out, overwrite=True)  # a folder under a file is refused before any work; finished
    # entries inside are kept or refused one by one below
    labels = [entry.label for entry in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"compare: an entry is named twice ({labels})")
    base = load_recipe(list(recipes), [*overrides, f"model.teacher={teacher_source}"])  # checked before any work
    settings = {"teacher": teacher_source, "recipe": {k: v for k, v in base.to_dict().items() if k != "output"},
                "passkey_lengths": list(passkey_lengths), "passkey_trials": passkey_trials,
                "cache_contexts": list(cache_contexts), "decode_context": decode_context,
                "decode_tokens": decode_tokens}
    # what each row was measured under; the teacher's row does not depend on the recipe
    plan = {"teacher": (os.path.join(out, "teacher"), {k: v for k, v in settings.items() if k != "recipe"}, None)}
    trained = trained_options(entries, base.model.mixer_options or {})
    for entry in entries:
        plan[entry.label] = (os.path.join(out, entry.folder), {**settings, "mixer": entry.mixer,
                                                                "options": trained[entry.label]}, entry)
    results = {label: _finished(folder, row_settings, label, overwrite)  # a changed row fails before any work
               for label, (folder, row_settings, _) in plan.items()}
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    say = tqdm.write if progress else print
    teacher = load_teacher(teacher_source)
    for label, (folder, row_settings, entry) in plan.items():
        if results[label] is not None:
            say(f"compare: {label} finished earlier ({folder}), kept")
            continue
        say(f"compare: {label}")
        if overwrite and os.path.isdir(folder):  # finished under other settings, or killed: redone from scratch
            shutil.rmtree(folder)
        if entry is None:  # the teacher
            os.makedirs(folder, exist_ok=True)
            result = {"settings": row_settings, **_measure(teacher.model, teacher.tokenizer, settings, progress)}
        else:
            recipe = load_recipe(list(recipes), [*overrides, f"model.teacher={teacher_source}",
                                                 f"model.mixer={entry.mixer}",
                                                 f"model.mixer_options={json.dumps(row_settings['options'])}",
                                                 f"output.dir={folder}", "output.overwrite=true"])
            try:
                summary = distill(recipe, progress=progress, teacher=teacher)
            except RecipeError as error:  # e.g. a killed entry's checkpoints, recorded under other settings
                raise RecipeError(f"compare: entry {label}: {error}; or relaunch compare with --overwrite to redo "
                                  "this entry from scratch") from None
            model = summary.pop("model")
            model_options = {option.name: getattr(model.config, option.name)
                             for option in get_mixer(entry.mixer).options}
            wrong = {key: (value, model_options[key]) for key, value in row_settings["options"].items()
                     if value is not None and model_options[key] != value}  # None: the option's derived default
            if wrong:  # what is recorded is what was trained, or nothing is recorded
                raise RuntimeError(f"compare: {label} trained other options than it records: {wrong}")
            result = {"settings": row_settings, "mixer_options": model_options,
                      "evaluations": summary["evaluations"], "stages": summary["stages"],
                      "wider_evaluations": summary["wider_evaluations"],
                      "train_tokens_per_s": _tokens_per_s(folder), "seconds": summary["seconds"],
                      "model_dir": summary["model_dir"],
                      **_measure(model, teacher.tokenizer, settings, progress)}
            del model, summary
            gc.collect()
        write_atomically(os.path.join(folder, ENTRY_FILE), json.dumps(result, indent=2))
        results[label] = result
    report = {"teacher": teacher_source, "entries": labels, "results": results,
              "seconds": time.perf_counter() - started}
    write_atomically(os.path.join(out, "compare.json"), json.dumps(report, indent=2))
    write_atomically(os.path.join(out, "compare.md"), to_markdown(report))
    _plot(report, os.path.join(out, "compare.png"))
    return report


def _after(result: dict) -> dict:
    """The evaluation after the last stage that ran (init if none did)."""
    return result["evaluations"][list(result["evaluations"])[-1]]


def to_markdown(report: dict) -> str:
    results, labels = report["results"], report["entries"]
    teacher = results["teacher"]
    settings = teacher["settings"]
    lengths, contexts = settings["passkey_lengths"], settings["cache_contexts"]
    first = results[labels[0]]["evaluations"]["init"]
    teacher_ppl = first["teacher_perplexity"]
    recipe = results[labels[0]]["settings"]["recipe"]
    steps = {stage: recipe[stage]["steps"] if recipe[stage]["enabled"] else 0 for stage in ("stage1", "stage2")}
    lines = [f"# hf-mixers compare: {report['teacher']}", "",
             f"Same recipe and budget for every entry: stage 1 {steps['stage1']} steps, stage 2 {steps['stage2']} "
             "steps, "
             f"{recipe['data']['sequence_length']}-token sequences, batch {recipe['train']['batch_size']}. "
             f"Held-out perplexity and KL(teacher ‖ model) at init and after distillation; passkey accuracy over "
             f"{settings['passkey_trials']} trials; cache bytes after a prefill; decode ms/token after "
             f"{settings['decode_context']} tokens; {report['seconds'] / 60:.1f} min in all.", "",
             "| model | ppl init | ppl after | x teacher | KL init | KL after | "
             + " | ".join(f"passkey {n}" for n in lengths) + " | "
             + " | ".join(f"cache {c} (MB)" for c in contexts) + " | decode ms/token | train tokens/s |",
             "|---" * (8 + len(lengths) + len(contexts)) + "|"]

    def measures(result):
        return (" | ".join(f"{result['passkey'][str(n)]:.0%}" for n in lengths) + " | "
                + " | ".join(f"{result['cache_bytes'][str(c)] / 1e6:.1f}" for c in contexts)
                + f" | {result['decode_ms_per_token']:.1f}")

    lines.append(f"| teacher | {teacher_ppl:.2f} | {teacher_ppl:.2f} | 1.00 | | | {measures(teacher)} | |")
    for label in labels:
        result = results[label]
        init, after = result["evaluations"]["init"], _after(result)
        speed = ", ".join(f"{stage} {value:.0f}" for stage, value in result["train_tokens_per_s"].items())
        lines.append(f"| {label} | {init['student_perplexity']:.2f} | {after['student_perplexity']:.2f} | "
                     f"{after['student_perplexity'] / after['teacher_perplexity']:.2f} | "
                     f"{init['kl_teacher_student']:.3f} | {after['kl_teacher_student']:.3f} | {measures(result)} | "
                     f"{speed} |")
    wider = {label: results[label]["wider_evaluations"] for label in labels if results[label].get("wider_evaluations")}
    if wider:  # where the teacher is strong, and beyond the training length: what the main table cannot show
        lines += ["", *wider_table(wider)]
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, labels = report["results"], report["entries"]
    contexts = results["teacher"]["settings"]["cache_contexts"]
    longest = str(max(contexts))
    names = ["teacher", *labels]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    teacher_ppl = results[labels[0]]["evaluations"]["init"]["teacher_perplexity"]
    ratio = [1.0] + [_after(results[label])["student_perplexity"] / teacher_ppl for label in labels]
    axes[0].bar(names, ratio, color=["grey"] + ["C0"] * len(labels))
    axes[0].set_ylabel("held-out perplexity / teacher's, after distillation")
    axes[0].set_yscale("log")
    axes[1].bar(names, [results[name]["cache_bytes"][longest] / 1e6 for name in names])
    axes[1].set_ylabel(f"cache MB at {int(longest):,} tokens")
    axes[1].set_yscale("log")
    axes[2].bar(names, [results[name]["decode_ms_per_token"] for name in names])
    axes[2].set_ylabel("decode ms/token")
    for axis in axes:
        axis.tick_params(axis="x", labelrotation=30)
    save_figure(figure, path, title=f"hf-mixers compare: {report['teacher']}")
