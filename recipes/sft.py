"""Stage 3, supervised fine-tuning of a converted (or distilled) model on chat data with the tokenizer's template.

    examples  TRL's layouts: "messages" ([{role, content}, ...]) or "prompt" + "completion" / "response" (strings or
              message lists), from a JSONL file or a dataset (``finetune.source`` as a data.source mapping; its
              validation split held out when it has one; ``streaming``: read as a stream, as far as the steps
              need); embedded default: continue a Shakespeare speech (the prompt gives a speech's opening lines,
              the answer is the rest), from the training plays only
    encoding  chat template; the loss covers every assistant turn (``finetune.assistant_turns: last``: the last
              one), end-of-turn tokens included, -100 elsewhere; one padded example per row, or ``packing``
    training  LoRA (``finetune.lora``) or every parameter; the same loop as stages 1 and 2 (checkpoints, resume)
    output    OUT/model, OUT/summary.json with the held-out assistant-token loss before and after
"""

from __future__ import annotations

import json
import os
import re
import time

import torch
import torch.nn.functional as F

from ..common.corpus import shakespeare
from ..common.dtypes import dtype_name
from ..common.history import FINETUNE_SUMMARY
from ..conversion.teacher import stored_dtype
from .config import Recipe
from .precision import autocast, output_dtype
from .run_plan import plan_run
from .tracking import finish_tracking, start_tracking
from .trainer import leaves_nothing_unless_started, run_stage


def conversation(row: dict, where: str, messages_field: str | None = None) -> list[dict]:
    """One row in a layout TRL takes, as a conversation: ``messages`` (or ``messages_field``), or ``prompt`` with
    ``completion`` (or ``response``), each a string or a list of messages. Bad rows name ``where``."""
    field = messages_field or ("messages" if "messages" in row else None)
    answer_field = "completion" if "completion" in row else "response"
    if field is not None:
        if field not in row:
            raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(row)})")
        messages = row[field]
    elif "prompt" in row and answer_field in row:
        def as_messages(value, role):
            return [{"role": role, "content": value}] if isinstance(value, str) else value
        messages = as_messages(row["prompt"], "user"), as_messages(row[answer_field], "assistant")
        if not all(isinstance(part, list) for part in messages):
            raise ValueError(f"{where}: 'prompt' and '{answer_field}' must be strings or lists of messages")
        messages = messages[0] + messages[1]
    else:
        raise ValueError(f"{where}: expected 'messages', or 'prompt' with 'completion' (or 'response'); fields: "
                         f"{', '.join(row)}")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{where}: messages must be a list of {{role, content}} with string values")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to learn from")
    return messages


def _chat_fields(columns) -> str | None:
    """Why a dataset's columns hold no chat layout (None: they do)."""
    if "messages" in columns or ("prompt" in columns and ("completion" in columns or "response" in columns)):
        return None
    return "no 'messages', and no 'prompt' with 'completion' or 'response'"


STREAM_HELDOUT = 64  # a streamed chat dataset: examples held out (its validation split's first, or its own first)


def chat_examples(source, heldout_share: float = 0.1, needed: int | None = None) -> tuple[list, list, str]:
    """(training conversations, held-out conversations, where the held-out ones come from) of ``finetune.source``:
    None (Shakespeare speeches), a JSONL file, or a dataset mapping (recipes/dataset_sources.py; its validation
    split is the held-out set when it has one). Otherwise the last ``heldout_share`` of the examples is held out.
    A mapping with ``streaming: true`` is read as a stream, never whole: ``STREAM_HELDOUT`` held-out examples (the
    first of its validation split, else the stream's first) and then ``needed`` training examples (None: the rest
    of the stream)."""
    if isinstance(source, dict):
        from itertools import islice

        from .dataset_sources import DatasetSource, document_splits

        entry = DatasetSource.parse(source, "finetune.source")
        fields = (lambda columns: None if entry.messages_field in columns else f"no field {entry.messages_field!r}") \
            if entry.messages_field else _chat_fields
        train, heldout, how = document_splits(entry, heldout_share, fields)
        rows, first = iter(train), 0  # first: the training rows' number in their split
        if entry.streaming:  # bounded reads from the stream, in its order
            if heldout is None:
                heldout = list(islice(rows, STREAM_HELDOUT))
                how, first = f"the first {len(heldout)} examples of its stream", len(heldout)
            else:
                heldout = list(islice(heldout, STREAM_HELDOUT))
                how = f"the first {len(heldout)} examples of {how.removeprefix('its ')}"
            rows = islice(rows, needed)
        where = lambda split, i: f"{entry.label}, split {split!r}, row {i}"  # noqa: E731
        train = [conversation(row, where(entry.split, first + i), entry.messages_field) for i, row in enumerate(rows)]
        heldout = [conversation(row, where("held out", i), entry.messages_field) for i, row in enumerate(heldout)]
        if not train or not heldout:
            raise ValueError(f"{entry.label}: no {'training' if not train else 'held-out'} examples "
                             f"({len(train)} read for training, {len(heldout)} held out: {how})")
        return train, heldout, how
    examples = _shakespeare_examples() if source is None else _jsonl_examples(source)
    held = max(1, int(len(examples) * heldout_share))
    if len(examples) < 2:
        raise ValueError(f"{source or 'the default chat data'}: {len(examples)} example(s), too few to hold one out")
    return examples[:-held], examples[-held:], f"the last {held} examples"


def _jsonl_examples(path: str) -> list[list[dict]]:
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}, line {number}: not JSON") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object")
            examples.append(conversation(row, f"{path}, line {number}"))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def _shakespeare_examples(limit: int = 2000) -> list[list[dict]]:
    examples = []
    for speech in re.split(r"\n\n+", shakespeare("train")):
        speaker, _, body = speech.partition(":\n")
        lines = [line for line in body.splitlines() if line.strip()]
        if not speaker.isupper() or len(lines) < 4:
            continue
        cut = len(lines) // 2
        examples.append([{"role": "user", "content": f"Continue this speech by {speaker.title()}:\n"
                                                     + "\n".join(lines[:cut])},
                         {"role": "assistant", "content": "\n".join(lines[cut:])}])
        if len(examples) == limit:
            break
    return examples


def conversation_tokens(tokenizer, messages, turns: str = "all"):
    """(token ids, labels) of one conversation through the chat template: labels are the tokens of every assistant
    turn (``turns="last"``: the last one only), end-of-turn tokens included, -100 elsewhere. None when the template
    lacks the prefix property the spans are read with (a conversation's tokens start with those of its start)."""
    def template(part, prompt=False):
        return tokenizer.apply_chat_template(part, add_generation_prompt=prompt, tokenize=True, return_dict=False)

    full = template(messages)
    labels = [-100] * len(full)
    answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    for i in answers[-1:] if turns == "last" else answers:
        prefix = template(messages[:i], prompt=True) if i else []
        upto = template(messages[:i + 1])
        if full[:len(upto)] != upto or upto[:len(prefix)] != prefix or len(prefix) >= len(upto):
            return None
        labels[len(prefix):len(upto)] = upto[len(prefix):]
    return full, labels


def encode(tokenizer, examples, max_length: int, turns: str = "all", packing: bool = False) -> torch.Tensor:
    """(N, 2, max_length): token ids and labels (-100 outside the learned assistant turns and on padding). One
    example per row, cut at ``max_length`` and padded; with ``packing``, examples one after the other with EOS
    between them, cut into full rows (an example may continue on the next row)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokens for tokens in (conversation_tokens(tokenizer, m, turns) for m in examples) if tokens]
    rows = []
    if packing:
        ids = [t for full, _ in encoded for t in full + [tokenizer.eos_token_id]]
        labels = [t for _, lab in encoded for t in lab + [-100]]
        for start in range(0, len(ids), max_length):
            row_ids, row_labels = ids[start:start + max_length], labels[start:start + max_length]
            padding = max_length - len(row_ids)
            rows.append([row_ids + [pad] * padding, row_labels + [-100] * padding])
    else:
        for full, labels in encoded:
            full, labels = full[:max_length], labels[:max_length]
            padding = max_length - len(full)
            rows.append([full + [pad] * padding, labels + [-100] * padding])
    rows = [row for row in rows if any(label != -100 for label in row[1])]  # no answer token left: nothing to learn
    if not rows:
        raise ValueError(f"no example fits in finetune.max_length = {max_length} tokens with an answer token")
    return torch.tensor(rows, dtype=torch.long)


def assistant_loss(model, batch) -> torch.Tensor:
    ids, labels = batch[:, 0], batch[:, 1]
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


@torch.no_grad()
def heldout_loss(model, encoded, batch_size: int = 4) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = [assistant_loss(model, encoded[i:i + batch_size]).item() for i in range(0, len(encoded), batch_size)]
    model.train(was_training)
    return sum(losses) / len(losses)


def _check_chat_tokenizer(tokenizer, student_name) -> None:
    """Before any work: a tokenizer, with the chat template every example goes through."""
    if tokenizer is None:
        raise ValueError("finetune: a model passed in needs its tokenizer (tokenizer=...)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"finetune: the tokenizer of {student_name or 'the model passed in'} has no chat "
                         "template, which finetune encodes its conversations with; fine-tune a model converted from "
                         "a chat (instruct) teacher, or give the folder a template (tokenizer.chat_template = ..., "
                         "then tokenizer.save_pretrained(folder))")


def _trainable(student, section, seed: int):
    """What stage 3 trains: LoRA adapters on the student (``finetune.lora``), or the whole student."""
    from .stages import add_lora

    torch.manual_seed(seed)
    if section.lora:
        return add_lora(student, section, seed)
    for parameter in student.parameters():
        parameter.requires_grad_(True)
    return student


@leaves_nothing_unless_started
def finetune(recipe: Recipe, progress: bool = True, student=None, tokenizer=None) -> dict:
    """Stage 3 on ``recipe.model.student`` (or the given model); returns the summary (OUT/summary.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .stages import (checked_recipe, copy_history, launched, local_student, released_per_block, save_model,
                         sharding_for, train_mode, write_recipe)

    section, out = recipe.finetune, recipe.output.dir
    model_dir = os.path.join(out, "model")
    if os.path.isdir(model_dir) and os.listdir(model_dir) and not recipe.output.overwrite:
        raise FileExistsError(f"{model_dir} exists: this run already finished; set output.overwrite=true")
    if student is None and not recipe.model.student:
        raise ValueError("finetune needs model.student: the folder of a converted or distilled model")
    recipe, processes = launched(recipe)
    record = checked_recipe(recipe)
    start_tracking(processes, recipe)  # a tracker that cannot start fails here, before the weights are read
    device = processes.device
    plan = plan_run(recipe, device, processes.world, finetune=True)
    dtype = plan.dtype
    if student is None:  # a folder: its tokenizer first, checked before the weights are read
        folder = local_student(recipe.model.student)
        tokenizer = AutoTokenizer.from_pretrained(recipe.model.student)
    _check_chat_tokenizer(tokenizer, recipe.model.student)
    if student is None:  # read straight in the training dtype
        stored = stored_dtype(AutoConfig.from_pretrained(folder))
        student = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        stored = next(student.parameters()).dtype
    saved_dtype = output_dtype(recipe.output.dtype, stored)
    write_recipe(recipe, record, processes)
    started = time.perf_counter()
    # a streamed source is read for one example per training row the steps take (with packing they fill fewer rows,
    # which the steps then go over again)
    needed = section.steps * recipe.train.batch_size * recipe.train.grad_accum * processes.world
    train_examples, heldout_examples, heldout_from = chat_examples(section.source, needed=needed)
    train_rows = encode(tokenizer, train_examples, section.max_length, section.assistant_turns, section.packing)
    heldout_rows = encode(tokenizer, heldout_examples, section.max_length, section.assistant_turns)
    student.to(device=device, dtype=dtype)  # bf16: the frozen weights; run_stage keeps what it trains in fp32
    with autocast(dtype, device):
        before = heldout_loss(student, heldout_rows)
    model = _trainable(student, section, recipe.train.seed)
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    train_mode(model, plan)

    def measured_so_far() -> dict:  # train.eval_every
        with autocast(dtype, device):
            return {"assistant_loss": heldout_loss(model, heldout_rows)}

    with released_per_block(model, plan):
        history = run_stage("finetune", lambda batch, metrics: (assistant_loss(model, batch), {}), parameters,
                            train_rows, steps=section.steps, plan=plan, lr=section.lr or recipe.train.lr,
                            out_dir=out, checkpoint_every=recipe.output.checkpoint_every,
                            log_every=recipe.output.log_every,
                            progress=progress and processes.is_main, processes=processes,
                            sharding=sharding_for(model), evaluate=measured_so_far)
    final = model.merge_and_unload() if section.lora and recipe.output.merge_lora else model
    with autocast(dtype, device):
        after = heldout_loss(final, heldout_rows)
    summary = {"examples": len(train_examples) + len(heldout_examples), "train_examples": len(train_examples),
               "train_rows": len(train_rows), "heldout_examples": len(heldout_rows), "heldout_from": heldout_from,
               "heldout_assistant_loss_before": before, "heldout_assistant_loss_after": after,
               "steps": len(history), "seconds": time.perf_counter() - started, "model_dir": model_dir,
               "precision": dtype_name(dtype), "saved_dtype": dtype_name(saved_dtype), "run_plan": plan.describe()}
    final.to(saved_dtype)
    if processes.is_main:
        def write_history(folder):  # the distilled model's history, and this stage's summary
            if recipe.model.student:
                copy_history(recipe.model.student, folder)
            with open(os.path.join(folder, FINETUNE_SUMMARY), "w", encoding="utf-8") as handle:
                json.dump({**summary, "model_dir": None, "recipe": recipe.to_dict()}, handle, indent=2)

        save_model(final.eval(), model_dir, tokenizer, extra=write_history)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
    finish_tracking(processes)
    processes.barrier()
    return summary
