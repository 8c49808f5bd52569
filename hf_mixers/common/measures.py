"""Measures of a converted or distilled model: held-out perplexity and agreement with its teacher, passkey
retrieval over long filler text, generation samples, and decoding latency with its cache size.

``eval_report.py`` runs them all for ``hf-mixers eval``; the demo, the conversion report and the recipes use
``compare_to_teacher``, ``generate_sample`` and ``cache_bytes_at``; ``bench rsa`` uses ``decode_latency``.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..core.cache import cache_nbytes
from ..decode.switch import has_token_step


@torch.no_grad()
def compare_to_teacher(teacher_model, student, heldout_ids, teacher_hidden=None, positions: int = 32) -> dict:
    """Held-out perplexity of both, mean KL(teacher || student) per token, and next-token top-1 agreement.

    ``teacher_model=None``: only ``{"student_perplexity"}``.

    ``teacher_hidden`` (N, T, D): the teacher's final hidden states if already computed. Logits are formed
    ``positions`` at a time from final hidden states: a full (T, vocab) fp32 logit matrix and its softmax copies
    would otherwise dominate peak memory for large vocabularies.
    """
    was_training = student.training
    student.eval()
    nll_teacher = nll_student = kl = agree = 0.0
    for row in range(heldout_ids.shape[0]):
        ids = heldout_ids[row:row + 1]
        targets = ids[0, 1:, None].cpu()
        student_hidden = student.model(ids.to(student.device), use_cache=False).last_hidden_state[0, :-1]
        if teacher_model is not None:
            hidden = (teacher_model.model(ids.to(teacher_model.device), use_cache=False).last_hidden_state
                      if teacher_hidden is None else teacher_hidden[row:row + 1])[0, :-1]
        for start in range(0, ids.shape[1] - 1, positions):
            span = slice(start, min(start + positions, ids.shape[1] - 1))
            student_logp = F.log_softmax(student.lm_head(student_hidden[span]).float(), -1).cpu()
            nll_student -= student_logp.gather(-1, targets[span]).sum().item()
            if teacher_model is None:
                continue
            teacher_logp = F.log_softmax(teacher_model.lm_head(hidden[span]).float(), -1).cpu()
            nll_teacher -= teacher_logp.gather(-1, targets[span]).sum().item()
            kl += (teacher_logp.exp() * (teacher_logp - student_logp)).sum().item()
            agree += (teacher_logp.argmax(-1) == student_logp.argmax(-1)).sum().item()
    student.train(was_training)
    tokens = heldout_ids.shape[0] * (heldout_ids.shape[1] - 1)
    if teacher_model is None:
        return {"student_perplexity": math.exp(nll_student / tokens)}
    return {"teacher_perplexity": math.exp(nll_teacher / tokens), "student_perplexity": math.exp(nll_student / tokens),
            "kl_teacher_student": kl / tokens, "top1_agreement": agree / tokens}


@torch.no_grad()
def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation of ``prompt`` (as a user turn through the chat template when the tokenizer has one)."""
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id)
    return tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# Passkey retrieval (Mohtashami & Jaggi, 2023): a number hidden at some depth of repetitive filler, asked for at the
# end. A model that keeps its context retrieves it at any length; one that forgets fails past its memory span.
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about it at the end.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, context_tokens: int, depth: float, key: int) -> list[int]:
    """Token ids of a passkey prompt of at most ``context_tokens`` tokens (as close as whole filler sentences
    allow; never fewer than intro + needle + question) with the needle at ``depth`` (0 = first, 1 = last)."""
    def build(repeats):
        before = round(repeats * depth)
        text = (PASSKEY_INTRO + PASSKEY_FILLER * before + PASSKEY_NEEDLE.format(key=key)
                + PASSKEY_FILLER * (repeats - before) + PASSKEY_QUESTION)
        return tokenizer(text)["input_ids"]

    per_filler = len(tokenizer(PASSKEY_FILLER * 8, add_special_tokens=False)["input_ids"]) / 8
    repeats = max(0, int((context_tokens - len(build(0))) / per_filler))
    ids = build(repeats)
    while len(ids) > context_tokens and repeats > 0:  # token merges across fillers make the estimate inexact
        repeats -= 1
        ids = build(repeats)
    return ids


@torch.no_grad()
def passkey_accuracy(model, tokenizer, lengths, trials: int = 5, seed: int = 0, progress: bool = True) -> dict:
    """{length: {"accuracy", "prompt_tokens" (mean), "answers"}}: greedy answers to ``trials`` prompts per length,
    needles spread evenly over the depth, 5-digit keys drawn with ``seed``; an answer counts when the first number
    the model writes is the key."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    results = {}
    bar = tqdm(total=len(lengths) * trials, desc="passkey retrieval", disable=not progress)
    for length in lengths:
        correct, sizes, answers = 0, [], []
        for trial in range(trials):
            key = rng.randint(10_000, 99_999)
            ids = torch.tensor([passkey_prompt(tokenizer, length, (trial + 0.5) / trials, key)], device=model.device)
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                    else tokenizer.eos_token_id)
            answer = tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True)
            number = re.search(r"\d+", answer)
            correct += number is not None and number.group() == str(key)
            sizes.append(ids.shape[1])
            answers.append({"key": key, "answer": answer.strip()})
            bar.update()
        results[length] = {"accuracy": correct / trials, "prompt_tokens": statistics.mean(sizes), "answers": answers}
    bar.close()
    return results


@torch.no_grad()
def generation_timing(model, context: int, decode_tokens: int, vocab: int, device, warmup: int = 3,
                      batch: int = 1, keep_cache: bool = False) -> dict:
    """Prefill ``batch`` rows of ``context`` random tokens (timed), decode ``warmup`` tokens untimed, then time
    ``decode_tokens`` single-token steps: {"prefill_s", "decode_s" (median per step), "cache_bytes" (held after the
    prefill, a cache's spare room included), "cache_used_bytes" (the cached tokens' alone)}, and with ``keep_cache``
    the "cache" itself."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    synchronize()
    prefill = time.perf_counter() - start
    cache_bytes, cache_used_bytes = cache_nbytes(cache), cache_nbytes(cache, spare=False)
    # warm-up steps first: allocator, kernel caches (and the compile, if asked)
    decode = decode_step_seconds(model, cache, batch, decode_tokens, vocab, device, warmup) if decode_tokens else None
    timing = {"prefill_s": prefill, "decode_s": decode, "cache_bytes": cache_bytes,
              "cache_used_bytes": cache_used_bytes}
    return {**timing, "cache": cache} if keep_cache else timing


def timed_steps(step, batch: int, steps: int, vocab: int, device, warmup: int = 1) -> float:
    """Median seconds of ``step(ids, index)`` on random (``batch``, 1) token ids, after ``warmup`` untimed calls (a
    compiled step compiles there); the device synchronised around each timed call."""
    device = torch.device(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(1)
    times = []
    for index in range(warmup + steps):
        ids = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
        synchronize()
        start = time.perf_counter()
        step(ids, index)
        synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def decode_step_seconds(model, cache, batch: int, steps: int, vocab: int, device, warmup: int = 1) -> float:
    """Median seconds of a single-token step of the ``batch`` rows of ``cache`` (``timed_steps``). Each step gets the
    all-ones attention mask ``generate`` passes: the step timed is the one ``generate`` runs, and a compiled step's
    graph serves both."""
    past = cache.get_seq_length()
    mask = torch.ones(batch, past + warmup + steps, dtype=torch.long, device=device)
    return timed_steps(lambda ids, index: model(ids, attention_mask=mask[:, :past + index + 1], past_key_values=cache,
                                                use_cache=True), batch, steps, vocab, device, warmup)


def compiles_decode(model) -> bool:
    """Whether any layer of ``model`` has a compiled token step (``config.compile_decode`` changes its decoding): an
    hf-mixers model with a mixer that has one."""
    return any(has_token_step(getattr(layer, "mixer", None)) for layer in getattr(getattr(model, "model", None),
                                                                                  "layers", ()))


@contextlib.contextmanager
def compiled_decode(model, mode):
    """Inside the block, ``model`` decodes through its compiled token step (``config.compile_decode = mode``) when
    ``mode`` is set and the model has one, else eagerly (``compile_decode = False``: "auto", the default, would
    compile a long ``generate``); yields the step's name ("eager" or "compiled (MODE)"). The config is restored
    after, and a model without a compiled step (a teacher) is left untouched."""
    if not compiles_decode(model):
        yield "eager"
        return
    mode = False if mode == "auto" else mode
    saved = model.config.compile_decode
    model.config.compile_decode = mode
    try:
        yield "compiled (" + ("default" if mode is True else mode) + ")" if mode else "eager"
    finally:
        model.config.compile_decode = saved


def decode_latency(model, context: int, decode_tokens: int, vocab: int, device, warmup: int = 3,
                   batch: int = 1) -> tuple[float, int]:
    """``generation_timing``'s (median s per decode step, the cached tokens' bytes after the prefill)."""
    timing = generation_timing(model, context, decode_tokens, vocab, device, warmup, batch)
    return timing["decode_s"], timing["cache_used_bytes"]


def cache_bytes_at(model, contexts, vocab: int, device, probes=(64, 128, 256)) -> dict:
    """{context: cache bytes} after a prefill of each context. Most caches are affine in the context (attention K/V
    grow by a fixed amount per token, a constant-state mixer stays put): when three short prefills, each twice as
    long as the one before (so log or sqrt growth cannot pass for a line), lie on one line, the line gives any
    context exactly without prefilling 16K tokens. A cache that is not affine (GLTM's cache-efficient patterns keep
    log or sqrt of the context) is measured at each context. (A sliding-window attention cache stops growing at its
    window: extrapolated, it is overestimated.)"""
    measured = [decode_latency(model, probe, 1, vocab, device, warmup=0)[1] for probe in probes]
    slope = (measured[1] - measured[0]) / (probes[1] - probes[0])
    if measured[2] - measured[1] != slope * (probes[2] - probes[1]):
        return {context: decode_latency(model, context, 1, vocab, device, warmup=0)[1] for context in contexts}
    return {context: int(round(measured[1] + slope * (context - probes[1]))) for context in contexts}
