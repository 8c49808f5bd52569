"""Stage 3, supervised fine-tuning of a converted (or distilled) model on chat data with the tokenizer's template.

    examples  JSONL with "messages" ([{role, content}, ...], the last one the assistant's) or "prompt"/"response";
              embedded default: continue a Shakespeare speech (the prompt gives a speech's opening lines, the
              answer is the rest), from the training plays only
    encoding  chat template; the loss covers the final assistant turn only (prompt tokens are labelled -100)
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
from ..common.history import FINETUNE_SUMMARY
from ..conversion.teacher import stored_dtype
from .config import Recipe
from .precision import autocast, dtype_name, output_dtype, training_dtype
from .strategies import check_launch
from .tracking import finish_tracking, start_tracking
from .trainer import Processes, run_stage


def chat_examples(source: str | None) -> list[list[dict]]:
    if source is None:
        return _shakespeare_examples()
    examples = []
    with open(source, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = row["messages"] if "messages" in row else [
                    {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{source}, line {number}: expected {{\"messages\": [...]}} or "
                                 "{\"prompt\": ..., \"response\": ...}") from None
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"{source}, line {number}: the last message must be the assistant's")
            examples.append(messages)
    if not examples:
        raise ValueError(f"{source}: no examples")
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


def encode(tokenizer, examples, max_length: int) -> torch.Tensor:
    """(N, 2, max_length): token ids and labels (-100 outside the final assistant turn and on padding)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for messages in examples:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[:max_length]
        if full[:len(prompt)] != prompt or len(prompt) >= len(full):
            continue  # template without the prefix property, or no answer token left after truncation
        labels = [-100] * len(prompt) + full[len(prompt):]
        padding = max_length - len(full)
        rows.append([full + [pad] * padding, labels + [-100] * padding])
    if not rows:
        raise ValueError(f"no example fits in finetune.max_length = {max_length} tokens")
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


def finetune(recipe: Recipe, progress: bool = True, student=None, tokenizer=None) -> dict:
    """Stage 3 on ``recipe.model.student`` (or the given model); returns the summary (OUT/summary.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .stages import (_accelerator, add_lora, checked_recipe, copy_history, local_student, save_model,
                         sharding_for, train_mode, write_recipe)

    section, out = recipe.finetune, recipe.output.dir
    model_dir = os.path.join(out, "model")
    if os.path.isdir(model_dir) and os.listdir(model_dir) and not recipe.output.overwrite:
        raise FileExistsError(f"{model_dir} exists: this run already finished; set output.overwrite=true")
    if student is None and not recipe.model.student:
        raise ValueError("finetune needs model.student: the folder of a converted or distilled model")
    processes = Processes(_accelerator(recipe))
    check_launch(recipe.train)
    device = processes.device
    dtype = training_dtype(recipe.train.precision, device)
    if student is None:  # read straight in the training dtype
        folder = local_student(recipe.model.student)
        stored = stored_dtype(AutoConfig.from_pretrained(folder))
        student = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(recipe.model.student)
    else:
        stored = next(student.parameters()).dtype
    if tokenizer is None:
        raise ValueError("finetune: a model passed in needs its tokenizer (tokenizer=...)")
    saved_dtype = output_dtype(recipe.output.dtype, stored)
    write_recipe(recipe, checked_recipe(recipe), processes)
    start_tracking(processes, recipe)
    started = time.perf_counter()
    examples = chat_examples(section.source)
    held = max(1, len(examples) // 10)
    encoded = encode(tokenizer, examples, section.max_length)
    train_rows, heldout_rows = encoded[:-held], encoded[-held:]
    student.to(device=device, dtype=dtype)  # bf16: the frozen weights; run_stage keeps what it trains in fp32
    with autocast(dtype, device):
        before = heldout_loss(student, heldout_rows)
    torch.manual_seed(recipe.train.seed)
    if section.lora:
        model = add_lora(student, section, recipe.train.seed)
    else:
        model = student
        for parameter in model.parameters():
            parameter.requires_grad_(True)
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    train_mode(model, recipe.train)

    def measured_so_far() -> dict:  # train.eval_every
        with autocast(dtype, device):
            return {"assistant_loss": heldout_loss(model, heldout_rows)}

    history = run_stage("finetune", lambda batch: (assistant_loss(model, batch), {}), parameters, train_rows,
                        steps=section.steps, train=recipe.train, lr=section.lr or recipe.train.lr, out_dir=out,
                        checkpoint_every=recipe.output.checkpoint_every, log_every=recipe.output.log_every,
                        progress=progress and processes.is_main, processes=processes, sharding=sharding_for(model),
                        evaluate=measured_so_far)
    final = model.merge_and_unload() if section.lora and recipe.output.merge_lora else model
    with autocast(dtype, device):
        after = heldout_loss(final, heldout_rows)
    summary = {"examples": len(examples), "train_examples": len(train_rows), "heldout_examples": len(heldout_rows),
               "heldout_assistant_loss_before": before, "heldout_assistant_loss_after": after,
               "steps": len(history), "seconds": time.perf_counter() - started, "model_dir": model_dir,
               "precision": dtype_name(dtype), "saved_dtype": dtype_name(saved_dtype)}
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
