"""``hf-mixers eval MODEL``: one report on a converted or distilled model, side by side with its teacher.

    model (+ teacher)  ->  held-out perplexity, KL(teacher || model), top-1 agreement       (evaluation.py)
                           passkey retrieval at several context lengths
                           greedy samples for a few prompts
                           decode tokens/s and cache bytes after a prefill of each context
                       ->  MODEL/eval_report.json (every figure) and MODEL/eval_report.md (for people)

The teacher defaults to the one named in the folder's ``conversion_report.json``; ``teacher=None`` evaluates the
model alone. The card builder (``hf-mixers card``) puts the report's tables into the model card.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from ..common.device import resolve_device
from ..common.dtypes import to_dtype
from ..common.files import write_atomically
from ..common.folder import check_model_weights
from ..common.history import CONVERSION_REPORT, EVAL_REPORT, blank_or
from ..common.measures import (compare_to_teacher, compiled_decode, decode_latency, generate_sample,
                               passkey_accuracy)
from ..decode.switch import check_compile_decode

DEFAULT_PROMPTS = ("Write one line of verse about the sea.", "What is the capital of France?",
                   "Explain in one sentence what a language model is.")
REPORT_NAME = EVAL_REPORT


@dataclass
class EvalReport:
    model: str
    teacher: str | None
    data: str
    heldout_sequences: int
    sequence_length: int
    dtype: str
    device: str
    quality: dict  # student_perplexity (+ teacher_perplexity, kl_teacher_student, top1_agreement with a teacher)
    passkey_trials: int
    passkey: list[dict]  # per length: length, prompt_tokens, model_accuracy, teacher_accuracy, answers
    samples: list[dict]  # per prompt: prompt, model, teacher
    decode_tokens: int
    decode: list[dict]  # per context: context, model_tokens_per_s, model_cache_bytes, teacher_... (None: no teacher)
    seconds: float
    hf_mixers_version: str = ""
    notes: list[str] = field(default_factory=list)
    decode_step: str = "eager"  # how the model's token steps ran: "eager", or "compiled (MODE)" (--compile-decode)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        teacher = self.teacher is not None
        q = self.quality
        title = "/".join(self.model.rstrip("/").split("/")[-2:])  # e.g. "rsa/model": "model" alone says nothing
        lines = [f"# Evaluation: {title}", "",
                 f"Model `{self.model}`, teacher `{self.teacher or 'none'}`; {self.dtype} on {self.device}; "
                 f"{self.seconds:.0f} s.", "",
                 f"## Held-out text ({self.heldout_sequences} sequences of {self.sequence_length} tokens, {self.data})",
                 "", "| | model | teacher |", "|---|---|---|",
                 f"| perplexity | {q['student_perplexity']:.3f} | {blank_or(q.get('teacher_perplexity'), '.3f')} |"]
        if teacher:
            lines += [f"| KL(teacher \u2016 model), nats/token | {q['kl_teacher_student']:.4f} | |",
                      f"| next-token top-1 agreement with the teacher | {q['top1_agreement']:.3f} | |"]
        lines += ["", f"## Passkey retrieval ({self.passkey_trials} trials per length, needle depths spread evenly)",
                  "", "| context (tokens) | model | teacher |", "|---|---|---|"]
        lines += [f"| {row['prompt_tokens']:.0f} | {row['model_accuracy']:.0%} | "
                  f"{blank_or(row['teacher_accuracy'], '.0%')} |" for row in self.passkey]
        lines += ["", f"## Decoding (batch 1, median of {self.decode_tokens} single-token steps after the prefill; "
                  f"the model's token step {self.decode_step})", "",
                  "| context | model tokens/s | model cache MiB | teacher tokens/s | teacher cache MiB | speed-up |",
                  "|---|---|---|---|---|---|"]
        for row in self.decode:
            speedup = (row["model_tokens_per_s"] / row["teacher_tokens_per_s"]) if row["teacher_tokens_per_s"] else None
            teacher_mib = None if row["teacher_cache_bytes"] is None else row["teacher_cache_bytes"] / 2**20
            lines.append(f"| {row['context']} | {row['model_tokens_per_s']:.1f} | "
                         f"{row['model_cache_bytes'] / 2**20:.2f} | "
                         f"{blank_or(row['teacher_tokens_per_s'], '.1f')} | {blank_or(teacher_mib, '.2f')} | "
                         f"{blank_or(speedup, '.2f', 'x')} |")
        lines += ["", "## Samples (greedy)", ""]
        for sample in self.samples:
            lines.append(f"- **{sample['prompt']}**")
            lines.append(f"  - model: {sample['model']!r}")
            if sample.get("teacher") is not None:
                lines.append(f"  - teacher: {sample['teacher']!r}")
        lines += [""] + [f"Note: {note}" for note in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def save(self, folder: str) -> None:
        """eval_report.json and eval_report.md, each written to a temporary name and renamed when complete."""
        for suffix, text in ((".json", json.dumps(self.to_dict(), indent=2) + "\n"), (".md", self.to_markdown())):
            write_atomically(os.path.join(folder, REPORT_NAME + suffix), text)

    @classmethod
    def load(cls, folder: str) -> "EvalReport":
        with open(os.path.join(folder, REPORT_NAME + ".json"), encoding="utf-8") as handle:
            return cls(**json.load(handle))



def teacher_of(model_dir: str) -> str | None:
    """The teacher named in the folder's conversion report (None when the folder has none)."""
    path = os.path.join(model_dir, f"{CONVERSION_REPORT}.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle).get("source")


def load_model(model_dir: str, dtype: torch.dtype, device, trust_remote_code: bool = False):
    """The model and tokenizer of a saved folder: any causal LM transformers or hf-mixers (its registered mixers,
    plugins included) knows. The folder's own code runs only with ``trust_remote_code`` (``--trust-remote-code``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{model_dir}: no config.json; pass a saved model folder (convert/distill output)")
    # a model type nobody here knows is refused by name; a missing tensor would load as random weights
    check_model_weights(model_dir, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def _check_lengths(model, model_dir: str, **lengths) -> None:
    """Each flag's lengths (``passkey_lengths=...``: ``--passkey-lengths``) within the model's
    max_position_embeddings, or a ValueError naming the flag."""
    limit = getattr(model.config, "max_position_embeddings", None)
    for name, values in lengths.items():
        too_long = [v for v in values if limit and v > limit]
        if too_long:
            raise ValueError(f"--{name.replace('_', '-')} {too_long} exceed{'s' if len(too_long) == 1 else ''} the "
                             f"model's max_position_embeddings ({limit}, {model_dir}/config.json)")


def _decode_row(model, teacher_model, context: int, decode_tokens: int, device) -> dict:
    """Decode tokens/s and cache bytes after a ``context``-token prompt, for the model and the teacher (None where
    there is none)."""
    row = {"context": context}
    for name, candidate in (("model", model), ("teacher", teacher_model)):
        latency, cache_bytes = (decode_latency(candidate, context, decode_tokens, candidate.config.vocab_size, device)
                                if candidate is not None else (None, None))
        row[f"{name}_tokens_per_s"] = None if latency is None else 1.0 / latency
        row[f"{name}_cache_bytes"] = cache_bytes
    return row


def run_eval(model_dir: str, teacher: str | None = "auto", data: str | None = None, sequence_length: int = 512,
             heldout_sequences: int = 8, passkey_lengths=(256, 1024, 2048), passkey_trials: int = 5,
             prompts=DEFAULT_PROMPTS, max_new_tokens: int = 32, decode_contexts=(512, 2048), decode_tokens: int = 16,
             dtype: str = "float32", device: str | None = None, out: str | None = None, seed: int = 0,
             progress: bool = True, trust_remote_code: bool = False,
             compile_decode: bool | str = False) -> EvalReport:
    """Evaluate ``model_dir`` (and its teacher) and write the report into ``out`` (default: ``model_dir``). The
    folder's own modeling code runs only with ``trust_remote_code``: hf-mixers folders load through its classes.
    ``compile_decode`` (True or a torch.compile mode): time the model's decode through its compiled token step
    (``config.compile_decode``), as a server would run it, where its mixers have one."""
    from .. import __version__
    from ..conversion import load_teacher
    from ..recipes.dataset_sources import source_blocks

    check_compile_decode(compile_decode, "eval")
    started = time.perf_counter()
    model_dir = os.path.abspath(model_dir)
    device = resolve_device(device)
    torch_dtype = to_dtype(dtype)
    notes = []
    if teacher == "auto":
        teacher = teacher_of(model_dir)
        if teacher is not None:
            notes.append(f"teacher {teacher!r} taken from conversion_report.json")
    model, tokenizer = load_model(model_dir, torch_dtype, device, trust_remote_code)
    teacher_model = None
    if teacher is not None:
        loaded = load_teacher(teacher)
        mine, theirs = model.get_output_embeddings().weight.shape[0], loaded.model.get_output_embeddings().weight.shape[0]
        if mine != theirs:  # token ids would mean different things: KL and agreement are meaningless
            raise ValueError(f"--teacher {teacher}: its vocabulary has {theirs} tokens, {model_dir}'s has {mine}; "
                             "compare a model with the teacher it was converted from (or --teacher none)")
        teacher_model = loaded.model.to(device=device, dtype=torch_dtype).eval()
        tokenizer = tokenizer or loaded.tokenizer
    if tokenizer is None:
        raise FileNotFoundError(f"{model_dir}: no tokenizer files, and no teacher to take them from (--teacher)")
    _check_lengths(model, model_dir, passkey_lengths=passkey_lengths, contexts=decode_contexts,
                   sequence_length=[sequence_length])

    heldout = source_blocks(data, tokenizer, sequence_length, heldout_count=heldout_sequences, heldout_only=True)
    heldout_ids, data_name = heldout.heldout, heldout.name
    quality = compare_to_teacher(teacher_model, model, heldout_ids.to(device, torch.long))

    passkey_model = passkey_accuracy(model, tokenizer, passkey_lengths, passkey_trials, seed, progress)
    passkey_teacher = (passkey_accuracy(teacher_model, tokenizer, passkey_lengths, passkey_trials, seed, progress)
                       if teacher_model is not None else {})
    passkey = [{"length": length, "prompt_tokens": result["prompt_tokens"], "model_accuracy": result["accuracy"],
                "teacher_accuracy": passkey_teacher[length]["accuracy"] if passkey_teacher else None,
                "answers": {"model": result["answers"],
                            "teacher": passkey_teacher[length]["answers"] if passkey_teacher else None}}
               for length, result in passkey_model.items()]

    samples = [{"prompt": prompt, "model": generate_sample(model, tokenizer, prompt, max_new_tokens),
                "teacher": generate_sample(teacher_model, tokenizer, prompt, max_new_tokens)
                if teacher_model is not None else None} for prompt in prompts]

    # the samples and passkey ran as the folder's config says; the timing as asked
    with compiled_decode(model, compile_decode or getattr(model.config, "compile_decode", False)) as decode_step:
        decode = [_decode_row(model, teacher_model, context, decode_tokens, device) for context in decode_contexts]

    report = EvalReport(model=model_dir, teacher=teacher, data=data_name, heldout_sequences=int(heldout_ids.shape[0]),
                        sequence_length=sequence_length, dtype=dtype, device=str(device), quality=quality,
                        passkey_trials=passkey_trials, passkey=passkey, samples=samples, decode_tokens=decode_tokens,
                        decode=decode, seconds=time.perf_counter() - started, hf_mixers_version=__version__,
                        notes=notes, decode_step=decode_step)
    out = out or model_dir
    os.makedirs(out, exist_ok=True)
    report.save(out)
    return report
