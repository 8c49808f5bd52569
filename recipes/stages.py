"""Distillation of a converted model back towards its teacher: stage 1 (attention transfer), stage 2 (LoRA KD).

    stage 1  each converted layer learns to reproduce its teacher layer's attention output (relative MSE). The
             teacher runs once per batch; its attention inputs and outputs are captured by hooks and every
             student mixer is trained on the teacher's own inputs ("teacher passthrough"), so layers train
             independently. Trains only the mixers' new parameters (``stage1.train_qkv`` adds q/k/v).
    stage 2  peft LoRA (r=8, alpha=16 on q,k,v,o by default) plus the new mixer parameters; loss =
             T^2 KL(teacher_T || student_T) over the vocabulary (+ ``ce_weight`` x next-token CE). The teacher
             runs without gradients.
    then     LoRA merged (``output.merge_lora``), the model saved atomically to ``OUT/model`` (remote code,
             tokenizer), held-out perplexity / KL / agreement after every stage in ``OUT/summary.json``, the
             loss curves in ``OUT/loss_curve.png``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from tqdm.auto import tqdm

from ..core.attention import TEACHER_MODULES
from ..common.history import CONVERSION_REPORT, HISTORY_FILES, LOSS_CURVE, TRAINING_SUMMARY, save_figure
from ..core.registry import TEACHER_ATTENTION
from ..common.corpus import HUB_ID, PYTHON_DOCS, PYTHON_DOCS_NAME, hub_offline, python_docs
from ..conversion import convert, load_teacher
from ..conversion.converter import KL_RANKING_SEQUENCES
from ..conversion.selection import keep_by_marginal_kl
from ..conversion.shared_weights import (freed_memory_released_per_block, release_freed_memory, share_frozen_weights,
                                         shared_bytes, unshare_weights)
from ..common.dtypes import dtype_name
from .precision import autocast, output_dtype
from ..common.measures import compare_to_teacher
from ..common.files import cache_folder, save_atomically, write_atomically
from ..kernels import distill_loss as loss_from_hidden
from ..kernels.distill_loss import IGNORE
from .config import Recipe, RecipeError, check_mixer_options, recipe_changes, selects_after_stage1
from .blockwise import transfer_loss
from .data import materialise_sources, pack
from .dataset_sources import DataBlocks, parse_sources, source_blocks
from .run_plan import RunPlan, plan_run
from .strategies import Sharding, check_launch, from_accelerate_config
from .tracking import finish_tracking, start_tracking, trackers
from .trainer import Processes, leaves_nothing_unless_started, peak_memory, run_stage

logger = logging.getLogger(__name__)
HELD_OUT_CURVE = "heldout_kl_teacher_student"  # what loss_curve.png draws beside a stage's loss (train.eval_every)



def converted_layers(model) -> list[int]:
    return [i for i, kind in enumerate(model.config.layer_types) if kind not in TEACHER_ATTENTION]


def new_mixer_parameters(model, train_qkv: bool = False) -> dict:
    """The parameters conversion added (name -> tensor), optionally with the converted layers' q/k/v."""
    converted = set(converted_layers(model))
    chosen = {}
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if "mixer" not in parts or "lora_A" in parts or "lora_B" in parts:
            continue
        at = parts.index("mixer")
        layer, module = int(parts[at - 1]), parts[at + 1]
        if layer not in converted:
            continue
        if module not in TEACHER_MODULES or (train_qkv and module in ("q_proj", "k_proj", "v_proj")):
            chosen[name] = parameter
    return chosen


def sharding_for(model, layers: list[int] | None = None, teacher_model=None) -> Sharding:
    """What ``train.strategy: fsdp`` / ZeRO-3 shard: the whole model (a peft model or a MixerForCausalLM), with the
    decoder blocks as the units the loss runs and the transformers model as FSDP's root.

    Stage 1 (``layers``) calls the converted mixers directly on the teacher's inputs: those mixers are the units,
    the blocks are sharded around them, and FSDP leaves the root (embeddings, final norm, head) whole, since the
    loss never runs it (and FSDP can shard a module object once per process: stage 2 shards it as its root).
    The frozen weights the student shares with ``teacher_model`` are ``kept``: put back, not gathered, at the end.
    A head among them is read as the teacher's by the stage-2 loss (``distillation_loss``), which then calls only the
    decoder: the decoder is FSDP's root, and the head is left whole (sharding it would free nothing)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = list(base.model.layers)
    teacher = {p.data_ptr() for p in teacher_model.parameters()} if teacher_model is not None else set()
    kept = {name: p.data for name, p in model.named_parameters() if not p.requires_grad and p.data_ptr() in teacher}
    if layers is None:
        head = base.get_output_embeddings().weight
        root = base.model if teacher_model is not None and _shares_frozen(
            head, teacher_model.get_output_embeddings().weight) else base
        return Sharding(model=model, units=blocks, blocks=blocks, root=root, kept=kept)
    return Sharding(model=model, units=[blocks[i].mixer for i in layers], blocks=blocks, root=None, kept=kept)


def attention_transfer_loss(student, teacher_model, layers, checkpointing: bool = False):
    """Stage 1: mean over converted layers of ||mixer(h) - attention(h)||^2 / ||attention(h)||^2 on teacher inputs
    (plus each mixer's auxiliary loss: ``transfer_loss``). With ``checkpointing`` (``train.gradient_checkpointing``)
    each layer's term keeps only its inputs, the teacher's captured tensors, and is recomputed in the backward pass:
    one mixer's activations at a time instead of every converted layer's (docs/benchmarks.md, "Memory plan")."""
    def loss_fn(batch, metrics: bool = True):
        captured = {}

        def hook(index):
            def record(module, args, kwargs, output):
                captured[index] = (kwargs["hidden_states"], kwargs["position_embeddings"], output[0])
            return record

        blocks = teacher_model.model.layers
        handles = [blocks[i].self_attn.register_forward_hook(hook(i), with_kwargs=True) for i in layers]
        try:
            with torch.no_grad():
                teacher_model.model(batch.to(teacher_model.device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        losses = []
        for index in layers:
            hidden, (cos, sin), target = (_to(t, student.device) for t in captured[index])
            mixer = student.model.layers[index].mixer
            if checkpointing:
                losses.append(torch.utils.checkpoint.checkpoint(transfer_loss, mixer, hidden, (cos, sin), target,
                                                                use_reentrant=False))
            else:
                losses.append(transfer_loss(mixer, hidden, (cos, sin), target))
        return torch.stack(losses).mean(), {}
    return loss_fn


def _to(value, device):
    return tuple(_to(v, device) for v in value) if isinstance(value, tuple) else value.to(device)


def distillation_loss(student, teacher_model, temperature: float, ce_weight: float, chunk_rows: int = 512):
    """Stage 2: T^2 KL(softmax(teacher / T) || softmax(student / T)) per token, + ce_weight x CE on the next token.

    From the final hidden states through the lm_heads in chunks of ``chunk_rows`` tokens (kernels/distill_loss.py; on
    CUDA Liger-Kernel's fused linear kernels where installed): the batch's (B, T, V) logits never exist. The dense
    form (full logits) runs with ``chunk_rows=0``, or when a head's weight is not a whole local tensor (sharded by
    FSDP or ZeRO-3: read only inside its module's forward). A frozen student head that is the teacher's tensor (one
    copy of the frozen weights) is read as the teacher's, which is never sharded: the chunked form then runs under
    FSDP and ZeRO-3 too (``sharding_for`` makes FSDP's root the decoder, whose forward the loss calls).

    ``loss_fn(batch, metrics) -> (loss, {"kl", "ce"})``, the metrics detached device scalars; at ce_weight 0 the CE
    only reports, so it is computed where ``metrics`` (the trainer reads that step's values) and left out elsewhere."""
    teacher_head = teacher_model.get_output_embeddings().weight
    student_head = student.get_output_embeddings().weight
    shared_head = _shares_frozen(student_head, teacher_head)  # decided now, before a strategy shards the student

    def heads():
        weights = (teacher_head if shared_head else student.get_output_embeddings().weight, teacher_head)
        return None if not chunk_rows or any(_sharded(w) for w in weights) else weights

    def loss_fn(batch, metrics: bool = True):
        weights = heads()
        if weights is None:
            return _dense_distillation_loss(student, teacher_model, batch, temperature, ce_weight, metrics)
        with torch.no_grad():  # the teacher may sit on another device (model.teacher_device)
            h_t = teacher_model.get_decoder()(batch.to(teacher_model.device), use_cache=False).last_hidden_state
        on_host = batch.device.type == "cpu"
        if on_host:  # each forward's freed transients go back to the OS before the next part of the step stands
            release_freed_memory()  # on them (a lower peak at the same tokens/s: docs/benchmarks.md)
        h_s = student.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        if on_host:
            release_freed_memory()
        targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], IGNORE)], 1)  # the last has no next token
        loss, kl, ce = loss_from_hidden.distillation_loss(  # Liger's fused kernels on CUDA where installed
            h_s.reshape(-1, h_s.shape[-1]), weights[0], h_t.to(h_s.device).reshape(-1, h_t.shape[-1]),
            weights[1].to(h_s.device), targets.reshape(-1), temperature, ce_weight, chunk_rows, with_ce=metrics)
        return loss, {"kl": kl} if ce is None else {"kl": kl, "ce": ce}
    return loss_fn


def top_k_distillation_loss(student, blocks, targets, temperature: float, ce_weight: float, chunk_rows: int,
                            device: torch.device):
    """Stage 2 against cached teacher targets (``stage2.teacher_top_k``, recipes/teacher_targets.py): no teacher
    runs. The stage's rows are indices of ``blocks``; ``batch_of(rows)`` gives the loss their tokens and top-k
    targets on ``device``. ``loss_fn`` as ``distillation_loss``'s, its KL kernels/distill_loss.py's
    ``top_k_kl`` (chunked; over the whole logits where the head is sharded or ``chunk_rows`` is 0)."""

    def batch_of(rows):
        rows = rows[:, 0]
        return (blocks[rows].to(device, torch.long), targets.index[rows].to(device),
                targets.log_probs[rows].to(device))

    def loss_fn(batch, metrics: bool = True):
        ids, index, log_probs = batch
        next_tokens = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1).reshape(-1)
        index, log_probs = index.flatten(0, 1), log_probs.flatten(0, 1)
        head = student.get_output_embeddings().weight
        if not chunk_rows or _sharded(head):
            logits = student(input_ids=ids, use_cache=False).logits.flatten(0, 1).float()
            kl = loss_from_hidden.top_k_kl(logits, index, log_probs, temperature)
            if not (ce_weight or metrics):
                return kl, {"kl": kl.detach()}
            ce = F.cross_entropy(logits, next_tokens, ignore_index=IGNORE)
            return kl + ce_weight * ce, {"kl": kl.detach(), "ce": ce.detach()}
        h_s = student.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        loss, kl, ce = loss_from_hidden.top_k_distillation_loss(h_s.flatten(0, 1), head, index, log_probs, next_tokens,
                                                                temperature, ce_weight, chunk_rows, with_ce=metrics)
        return loss, {"kl": kl} if ce is None else {"kl": kl, "ce": ce}
    return loss_fn, batch_of


def _shares_frozen(weight, teacher_weight) -> bool:
    return not weight.requires_grad and weight.data_ptr() == teacher_weight.data_ptr()


def _sharded(weight) -> bool:
    """A parameter FSDP2 (a DTensor) or ZeRO-3 (``ds_id``, empty at rest) holds in shards."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor) or hasattr(weight, "ds_id")


def _dense_distillation_loss(student, teacher_model, batch, temperature, ce_weight, metrics: bool = True):
    """The distillation loss over the whole (B, T, V) logits, through the models' own forwards."""
    with torch.no_grad():
        teacher_logits = teacher_model(batch.to(teacher_model.device), use_cache=False).logits.float()
    teacher_logits = teacher_logits.to(batch.device)
    student_logits = student(input_ids=batch, use_cache=False).logits.float()
    vocab = student_logits.shape[-1]
    kl = F.kl_div(F.log_softmax(student_logits.view(-1, vocab) / temperature, -1),
                  F.log_softmax(teacher_logits.view(-1, vocab) / temperature, -1),
                  log_target=True, reduction="batchmean") * temperature**2
    if not (ce_weight or metrics):  # the CE is for the logs only, and this step's are not read
        return kl, {"kl": kl.detach()}
    ce = F.cross_entropy(student_logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1))
    return kl + ce_weight * ce, {"kl": kl.detach(), "ce": ce.detach()}


def add_lora(student, stage2, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # LoRA A init: the same on every (re)launch, before a checkpoint overwrites it
    config = LoraConfig(r=stage2.lora_r, lora_alpha=stage2.lora_alpha, target_modules=list(stage2.lora_targets),
                        lora_dropout=0.0, bias="none")
    try:
        peft_model = get_peft_model(student, config)
    except ValueError as error:
        raise ValueError(f"stage2.lora_targets {stage2.lora_targets}: {error}") from error
    for parameter in new_mixer_parameters(peft_model).values():
        parameter.requires_grad_(True)  # peft froze them; the mixers' own parameters keep training
    return peft_model


def train_mode(model, plan: RunPlan) -> None:
    """``model.train()``, recomputing each block in the backward pass when ``train.gradient_checkpointing``
    (non-reentrant: frozen embeddings under LoRA need no gradient on the inputs), each block compiled in the plan's
    ``compile_mode``."""
    model.train()
    if plan.train.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    compile_blocks(model, plan.compile_mode)


COMPILE_BACKEND = "inductor"  # the tests trace with "aot_eager": no C++ build on CI's two cores


def compile_blocks(model, mode: str | None) -> None:
    """torch.compile each decoder block of ``model`` (a student, the teacher, a LoRA-wrapped one) in ``mode``; None:
    leave them eager. Fixed shapes (a run's batches have one shape): an evaluation's other shapes compile their own
    graphs. Every mixer's block is one graph (the mixer contract's ``check_block_compiles_whole``), LoRA's and
    checkpointing's wrappers included."""
    if mode is None:
        return
    options = dict(mode=mode) if COMPILE_BACKEND == "inductor" else {}
    for block in model.get_decoder().layers:
        block.compile(backend=COMPILE_BACKEND, dynamic=False, **options)


def released_per_block(model, plan: RunPlan):
    """Within it, where the plan releases host memory (``train.release_host_memory`` on a CPU host; "auto": under
    fsdp and deepspeed), the memory each of ``model``'s decoder blocks frees goes back to the OS at the block's
    boundaries, and an untied input embedding's memory-mapped rows after each lookup (conversion/shared_weights.py);
    otherwise nothing."""
    if not plan.releases_host_memory:
        return freed_memory_released_per_block(())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    looked_up = head is None or head.weight.data_ptr() != embedding.weight.data_ptr()  # a tied head reads it whole
    return freed_memory_released_per_block(model.get_decoder().layers, embedding if looked_up else None)


def teacher_text_folder(recipe: Recipe) -> str:
    """Where ``teacher:N`` text is kept: ``data.teacher_text_dir``, else $HF_MIXERS_CACHE (default
    ~/.cache/hf-mixers)/teacher-text/<teacher>, shared by every run of the same teacher."""
    if recipe.data.teacher_text_dir:
        return recipe.data.teacher_text_dir
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.abspath(recipe.model.teacher) if os.path.exists(
        recipe.model.teacher) else recipe.model.teacher).strip("_")
    return os.path.join(cache_folder("teacher-text"), name)


def wider_evaluation_sets(recipe: Recipe, tokenizer, data: DataBlocks) -> dict:
    """{name: token blocks} of the wider evaluations (``data.wider_evaluations``): the held-out text at 4x the
    training length (not for a mixture with a dataset), and the Python docs (a domain the run does not train on,
    unless it is its source) at 1x and 4x, each with as many tokens as the main held-out set. A text too short for
    one long sequence is left out."""
    if not recipe.data.wider_evaluations:
        return {}
    length, count = recipe.data.sequence_length, recipe.data.heldout_sequences
    sizes = [(data.name, data.heldout_at, 4 * length)] if data.heldout_at is not None else []
    sources = recipe.data.source if isinstance(recipe.data.source, list) else [recipe.data.source]
    if PYTHON_DOCS not in sources:  # the other domain stays one the run never trained on
        docs = python_docs()
        blocks_of_docs = lambda size, count: pack(tokenizer, docs, size, count, PYTHON_DOCS_NAME)  # noqa: E731
        sizes += [(PYTHON_DOCS_NAME, blocks_of_docs, size) for size in (length, 4 * length)]
    sets = {}
    for text_name, blocks, size in sizes:
        name = f"{text_name}, {size} tokens"
        try:
            sets[name] = blocks(size, max(1, count * length // size))
        except ValueError:  # shorter than one sequence of that length: measured at the training length only
            logger.info("%s: not enough text for one sequence, not evaluated", name)
    return sets


@leaves_nothing_unless_started
def distill(recipe: Recipe, progress: bool = True, teacher=None, student=None, conversion_report=None) -> dict:
    """Run the recipe's enabled stages; returns the summary (also written to OUT/summary.json).

    ``teacher`` (a conversion.Teacher) and ``student`` (a converted model, with its ``conversion_report``) may be
    passed in already loaded (the demo converts once per mixer); otherwise they come from ``recipe.model``. The
    trained model is ``summary["model"]`` (not serialised). The saved folder carries its history for the model
    card: the conversion report, ``training_summary.json`` (this summary and the recipe) and ``loss_curve.png``.

    The phases, in order: the recipe checked and launched; the teacher and the data; the student; the evaluations
    at init; stage 1 (with its kl:K selection); stage 2; the summary and the export.
    """
    if student is None and recipe.model.student is None:
        check_mixer_options(recipe)  # a wrong option fails here, not after the teacher and the data are ready
    parse_sources(recipe.data.source)  # likewise a wrong dataset key
    model_dir = os.path.join(recipe.output.dir, "model")
    if os.path.isdir(model_dir) and os.listdir(model_dir) and not recipe.output.overwrite:
        raise FileExistsError(f"{model_dir} exists: this run already finished; set output.overwrite=true to redo "
                              "the export, or choose another output.dir")
    recipe, processes = launched(recipe)
    progress = progress and processes.is_main
    record = checked_recipe(recipe)
    start_tracking(processes, recipe)  # a tracker that cannot start fails here, before the teacher, data, conversion
    started = time.perf_counter()
    plan = plan_run(recipe, processes.device, processes.world)
    dtype = plan.dtype
    loaded_here = teacher is None
    teacher, data = _teacher_and_data(recipe, processes, dtype, teacher, progress)
    student, conversion_report = _student(recipe, teacher, dtype, processes.device, student, conversion_report,
                                          progress)
    write_recipe(recipe, record, processes)
    evaluator = _Evaluator(recipe, teacher, data, student, dtype, processes.device)
    evaluator.evaluate("init", student)
    student, histories = _train(recipe, plan, processes, teacher, student, conversion_report, data.train, evaluator,
                                progress)
    saved_dtype = output_dtype(recipe.output.dtype, teacher.stored_dtype)
    summary = _summary(recipe, plan, processes, student, data, evaluator, histories, started, model_dir, saved_dtype)
    tokenizer = teacher.tokenizer
    if loaded_here:  # the teacher's last use is behind: its tensors go as the student's are cast for the export
        teacher = evaluator = None
        release_freed_memory()
    _export(recipe, processes, student.to(saved_dtype), tokenizer, summary, histories, conversion_report, model_dir)
    return {**summary, "model": student}


def _teacher_and_data(recipe: Recipe, processes: Processes, dtype, teacher, progress: bool):
    """The teacher, frozen, straight in the training dtype (no fp32 copy of a bf16 checkpoint) on its device, and the
    data: a file that cannot make one sequence fails before minutes of conversion. ``teacher:N`` text is written once,
    by the main process; a dataset is tokenised once, into datasets' cache, and the main process packs the training
    blocks into OUT/data/train.int32, which every process then memory-maps (recipes/token_blocks.py)."""
    teacher = teacher or load_teacher(recipe.model.teacher, dtype=dtype)
    teacher.model.to(device=recipe.model.teacher_device or processes.device, dtype=dtype)
    for parameter in teacher.model.parameters():
        parameter.requires_grad_(False)
    length, source, folder = recipe.data.sequence_length, recipe.data.source, teacher_text_folder(recipe)
    if processes.is_main:
        materialise_sources(source, teacher, folder, recipe.train.seed, length, progress)
    processes.barrier()
    source = materialise_sources(source, teacher, folder, recipe.train.seed, length, False)
    with processes.main_first():
        data = source_blocks(source, teacher.tokenizer, length, recipe.data.max_train_sequences,
                             recipe.data.heldout_sequences, recipe.data.heldout_fraction,
                             train_path=os.path.join(recipe.output.dir, "data", "train.int32"),
                             read_train=not processes.is_main)
    return teacher, data


def _student(recipe: Recipe, teacher, dtype, device, student, conversion_report, progress: bool):
    """The student in the training dtype on ``device``: given, read from ``model.student``, or converted here (on the
    teacher's device); what it took over unchanged from the teacher held once (conversion/shared_weights.py), q/k/v
    apart when stage 1 trains them. Returns (student, its conversion report)."""
    read_from = None  # the folder of a student read here: its weights are compared with the teacher's as stored
    if student is None and recipe.model.student:
        from transformers import AutoModelForCausalLM

        folder = local_student(recipe.model.student)
        read_from = folder if os.path.isdir(folder) else None
        # in its stored dtype, a folder's tensors stay in its files, unread, until shared or kept (not converted whole)
        student = AutoModelForCausalLM.from_pretrained(folder, dtype="auto" if read_from else dtype)
        conversion_report = read_conversion_report(recipe.model.student)
    elif student is None:
        keep = None if selects_after_stage1(recipe) else recipe.model.keep_attention  # kl:K: ranked in stage 1
        student, conversion_report = convert(teacher, recipe.model.mixer, keep_attention=keep,
                                             mixer_options=recipe.model.mixer_options, seed=recipe.train.seed,
                                             progress=progress, dtype=dtype_name(dtype),
                                             share_teacher_weights=True)
    if read_from is None:  # a student in memory is compared as it is: in the training dtype, on the device
        student.to(device=device, dtype=dtype)
    trained_qkv = (".q_proj.", ".k_proj.", ".v_proj.") if recipe.stage1.enabled and recipe.stage1.train_qkv else ()
    share_frozen_weights(student, teacher.model, keep_separate=trained_qkv, stored_in=read_from)
    if trained_qkv:
        unshare_weights(student, teacher.model, only=trained_qkv)
    student.to(device=device, dtype=dtype)  # frozen weights in the training dtype; run_stage makes the trained fp32
    release_freed_memory()  # the student's own copies of those weights (a loaded model.student) are gone
    shared = shared_bytes(student, teacher.model)
    if shared and progress:
        tqdm.write(f"student and teacher hold their {shared / 2**20:.0f} MiB of common frozen weights once")
    return student, conversion_report


class _Evaluator:
    """The run's measures against the teacher: on the held-out set and the wider ones after each stage
    (``evaluations``, ``wider``), and on the held-out set during a stage (``measured_so_far``, ``train.eval_every``).
    The frozen teacher's final states per set are computed once, not once per stage."""

    def __init__(self, recipe: Recipe, teacher, data: DataBlocks, student, dtype, device):
        self.teacher, self.student, self.dtype, self.device = teacher, student, dtype, device
        self.heldout = data.heldout.to(device, torch.long)  # the training blocks stay mapped: moved batch by batch
        self.wider_ids = {name: ids.to(device, torch.long) for name, ids in
                          wider_evaluation_sets(recipe, teacher.tokenizer, data).items()}
        self.evaluations, self.wider = {}, {name: {} for name in self.wider_ids}
        self.teacher_hidden = {}

    def against_teacher(self, name: str, model, ids) -> dict:
        if name not in self.teacher_hidden:
            teacher = self.teacher.model
            with torch.no_grad():
                self.teacher_hidden[name] = torch.cat([teacher.model(ids[row:row + 1].to(teacher.device),
                                                                     use_cache=False).last_hidden_state
                                                       for row in range(ids.shape[0])])
        return compare_to_teacher(self.teacher.model, model, ids, teacher_hidden=self.teacher_hidden[name])

    def evaluate(self, stage: str, model) -> None:
        with autocast(self.dtype, self.device):
            self.evaluations[stage] = self.against_teacher("heldout", model, self.heldout)
            for name, ids in self.wider_ids.items():
                self.wider[name][stage] = self.against_teacher(name, model, ids)

    def measured_so_far(self) -> dict:
        """The held-out measures of the student now (LoRA, once added, is in it)."""
        with torch.no_grad(), autocast(self.dtype, self.device):
            measures = self.against_teacher("heldout", self.student, self.heldout)
        return {name: value for name, value in measures.items() if name != "teacher_perplexity"}


def _train(recipe: Recipe, plan: RunPlan, processes: Processes, teacher, student, conversion_report, train_ids,
           evaluator: _Evaluator, progress: bool):
    """Stage 1 (attention transfer; under kl:K a short one on every layer, the ranking, then the rest) and stage 2
    (LoRA distillation), each evaluated after. Returns (the trained student, {stage: its history})."""
    device, dtype = processes.device, plan.dtype
    histories = {}
    common = dict(blocks=train_ids, plan=plan, out_dir=recipe.output.dir,
                  checkpoint_every=recipe.output.checkpoint_every, log_every=recipe.output.log_every,
                  progress=progress, processes=processes)
    train_mode(student, plan)
    compile_blocks(teacher.model, plan.compile_mode)  # its forward in each stage-2 step
    selection_steps = plan.selection_steps
    # the run-wide step of each stage's first step, less one: the trackers see one increasing step
    log_offsets = {"stage1-selection": 0, "stage1": selection_steps,
                   "stage2": recipe.stage1.steps if recipe.stage1.enabled else 0}

    def transfer(stage: str, steps: int) -> list[dict]:
        """``steps`` of attention transfer on the layers converted now (stage 1, or its selection part)."""
        layers = converted_layers(student)
        parameters = new_mixer_parameters(student, recipe.stage1.train_qkv)
        for parameter in student.parameters():
            parameter.requires_grad_(False)
        for parameter in parameters.values():
            parameter.requires_grad_(True)
        if recipe.stage1.blockwise:
            return _blockwise_stage1(student, teacher.model, layers, parameters, recipe, train_ids, common)
        loss_fn = attention_transfer_loss(student, teacher.model, layers, recipe.train.gradient_checkpointing)
        return run_stage(stage, loss_fn, parameters, steps=steps,
                         lr=recipe.train.lr, sharding=sharding_for(student, layers, teacher.model),
                         evaluate=evaluator.measured_so_far, log_offset=log_offsets[stage], **common)

    stage1_steps = recipe.stage1.steps if recipe.stage1.enabled else 0
    if selection_steps:
        histories["stage1-selection"] = transfer("stage1-selection", selection_steps)
        count = int(recipe.model.keep_attention.removeprefix("kl:"))
        with autocast(dtype, device):  # the frozen weights may be bf16 beside the fp32 trained ones
            ranked_on = train_ids[:KL_RANKING_SEQUENCES].to(device, torch.long)
            kept = keep_by_marginal_kl(student, teacher.model, ranked_on, count, conversion_report,
                                       f"ranked after {selection_steps} stage-1 steps")
        if progress:
            tqdm.write(f"kl:{count}: layers {kept} back to attention (ranked after {selection_steps} stage-1 steps)")
        evaluator.evaluate("stage1-selection", student)
        stage1_steps -= selection_steps
    if stage1_steps > 0:
        histories["stage1"] = transfer("stage1", stage1_steps)
        evaluator.evaluate("stage1", student)
    if recipe.stage2.enabled and recipe.stage2.steps > 0:
        peft_model = add_lora(student, recipe.stage2, recipe.train.seed)
        parameters = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
        loss_fn, data = stage2_loss(recipe, plan, peft_model, teacher, train_ids, processes, progress)
        with released_per_block(peft_model, plan):
            histories["stage2"] = run_stage("stage2", loss_fn, parameters, steps=recipe.stage2.steps,
                                            lr=recipe.stage2.lr or recipe.train.lr,
                                            sharding=sharding_for(peft_model, teacher_model=teacher.model),
                                            evaluate=evaluator.measured_so_far, log_offset=log_offsets["stage2"],
                                            **{**common, **data})
        del loss_fn  # it holds the teacher, which the export may free
        if recipe.output.merge_lora:  # merging writes into the adapted weights: the teacher's must stay as they are
            unshare_weights(peft_model, teacher.model, only=("base_layer",), release_teacher_pages=True)
        student = peft_model.merge_and_unload() if recipe.output.merge_lora else peft_model
        evaluator.evaluate("stage2", student.get_base_model() if hasattr(student, "get_base_model") else student)
    student.eval()
    return student, histories


def _summary(recipe: Recipe, plan: RunPlan, processes: Processes, student, data: DataBlocks, evaluator: _Evaluator,
             histories, started: float, model_dir: str, saved_dtype) -> dict:
    """The run's summary: its data, the evaluations after each stage, each stage's steps, losses and tokens, time,
    precision, the run plan and each rank's peak memory (what ``--plan`` is checked against)."""
    length = recipe.data.sequence_length
    return {"teacher": recipe.model.teacher, "mixer": recipe.model.mixer, "data": data.name,
            "layer_types": student.config.layer_types, "train_sequences": int(data.train.shape[0]),
            "heldout_sequences": int(data.heldout.shape[0]), "sequence_length": length,
            "evaluations": evaluator.evaluations, "wider_evaluations": evaluator.wider,
            "stages": {name: {"steps": len(h), "first_loss": h[0]["loss"] if h else None,
                              "final_loss": h[-1]["loss"] if h else None,
                              "tokens": len(h) * recipe.train.batch_size * recipe.train.grad_accum * length
                              * processes.world}
                       for name, h in histories.items()},
            "seconds": time.perf_counter() - started, "model_dir": model_dir, "world_size": processes.world,
            "precision": dtype_name(plan.dtype), "saved_dtype": dtype_name(saved_dtype), "run_plan": plan.describe(),
            "peak_memory_gib": processes.gather(peak_memory(processes.device))}


def _export(recipe: Recipe, processes: Processes, student, tokenizer, summary: dict, histories, conversion_report,
            model_dir: str) -> None:
    """The trained student to OUT/model (the main process), with its history: the conversion report,
    training_summary.json and the loss curve; OUT/summary.json beside it."""
    out = recipe.output.dir
    if processes.is_main:
        def write_history(folder):
            if conversion_report is not None:
                conversion_report.save(folder)
            with open(os.path.join(folder, TRAINING_SUMMARY), "w", encoding="utf-8") as handle:
                json.dump({**summary, "model_dir": None, "recipe": recipe.to_dict()}, handle, indent=2)
            plot_losses(histories, os.path.join(folder, LOSS_CURVE))

        save_model(student, model_dir, tokenizer, extra=write_history)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
        if os.path.exists(os.path.join(model_dir, LOSS_CURVE)):  # drawn once (a figure is slow), in both folders
            shutil.copyfile(os.path.join(model_dir, LOSS_CURVE), os.path.join(out, LOSS_CURVE))
    finish_tracking(processes)
    processes.barrier()


def stage2_loss(recipe: Recipe, plan: RunPlan, student, teacher, train_ids, processes: Processes, progress: bool):
    """Stage 2's loss and what ``run_stage`` draws its batches from: the teacher online (every step), or with
    ``stage2.teacher_top_k`` its cached top-k targets (computed here once, by the main process)."""
    stage2 = recipe.stage2
    if not stage2.teacher_top_k:
        return distillation_loss(student, teacher.model, stage2.temperature, stage2.ce_weight,
                                 stage2.loss_chunk_rows), {}
    from .teacher_targets import cached_top_k

    with processes.main_first(), autocast(plan.dtype, processes.device):
        targets = cached_top_k(teacher.model, train_ids, stage2.teacher_top_k, stage2.temperature,
                               recipe.model.teacher, recipe.train.batch_size, stage2.loss_chunk_rows or 512,
                               progress and processes.is_main, compute=processes.is_main)
    loss_fn, batch_of = top_k_distillation_loss(student, train_ids, targets, stage2.temperature, stage2.ce_weight,
                                                stage2.loss_chunk_rows, processes.device)
    rows = torch.arange(train_ids.shape[0])[:, None]  # batches of row indices, drawn as token blocks are
    return loss_fn, {"blocks": rows, "tokens_per_row": train_ids.shape[1], "batch_of": batch_of}


def _blockwise_stage1(student, teacher_model, layers, parameters, recipe, train_ids, common) -> list[dict]:
    """Stage 1 one layer at a time from cached teacher activations (recipes/blockwise.py); one history row per
    step with the mean relative MSE over layers (the sum of the scaled per-layer losses), like the joint stage."""
    from .blockwise import capture_activations, layer_loss

    if common["processes"].world > 1:
        raise ValueError("stage1.blockwise runs in one process (the cache is written once); launch it without "
                         "torchrun, or set stage1.blockwise=false")
    cache = capture_activations(teacher_model, layers, train_ids, recipe.train.batch_size,
                                os.path.join(recipe.output.dir, "stage1-cache"))
    row_indices = torch.arange(train_ids.shape[0])[:, None]  # batches of cache rows, drawn like token blocks
    histories = []
    for index in layers:
        prefix = f"model.layers.{index}.mixer."
        own = {name: p for name, p in parameters.items() if name.startswith(prefix)}
        mixer = student.model.layers[index].mixer
        loss_fn = layer_loss(mixer, cache["layers"][index], cache["rope"], student.device, scale=1 / len(layers))
        histories.append(run_stage(f"stage1-layer{index}", loss_fn,
                                   own, **{**common, "blocks": row_indices}, steps=recipe.stage1.steps,
                                   lr=recipe.train.lr, tokens_per_row=train_ids.shape[1],
                                   log_offset=len(histories) * recipe.stage1.steps))
    return [{"stage": "stage1", "step": rows[0]["step"], "loss": sum(r["loss"] for r in rows)}
            for rows in zip(*histories)]


def save_model(model, model_dir: str, tokenizer, extra=None) -> None:
    """The full model to ``model_dir``; an unmerged peft model also writes its adapter to ``<model_dir>-adapter``
    (and ``model_dir`` gets the base model without LoRA, so the two load as base + adapter). ``extra(folder)``
    writes more files (the history) into the folder before it is renamed into place."""
    if hasattr(model, "peft_config"):
        save_atomically(model, f"{model_dir}-adapter", overwrite=True)
        model = copy.deepcopy(model).unload()
    save_atomically(model, model_dir, tokenizer=tokenizer, overwrite=True, extra=extra)




def checked_recipe(recipe: Recipe) -> dict:
    """What OUT/recipe.json will record, after checking that a relaunch onto existing checkpoints has the recipe they
    were made with (fields that only say how long to train or how often to save may change): resuming with other
    data, rates or mixer options would mix two runs. ``output.allow_recipe_change`` resumes anyway and records the
    changes. Nothing is written here: ``write_recipe`` does, once the run's inputs are known to be good."""
    out = recipe.output.dir
    path, checkpoints = os.path.join(out, "recipe.json"), os.path.join(out, "checkpoints")
    record = recipe.to_dict()
    if os.path.isfile(path) and os.path.isdir(checkpoints) and os.listdir(checkpoints):
        try:
            with open(path, encoding="utf-8") as handle:
                recorded = json.load(handle)
        except (OSError, ValueError) as error:
            raise RecipeError(f"{path}: the recorded recipe of the checkpoints in {checkpoints} cannot be read "
                              f"({error}); use a new output.dir") from None
        changes = recipe_changes(recorded, recipe)
        if changes and not recipe.output.allow_recipe_change:
            raise RecipeError(f"{out}: its checkpoints were made with another recipe ({'; '.join(changes)}); resuming "
                              "would mix two runs. Use a new output.dir, or set output.allow_recipe_change=true to "
                              "resume anyway (the changes are recorded in recipe.json)")
        record["changed_on_resume"] = recorded.get("changed_on_resume", []) + changes
    return record


def write_recipe(recipe: Recipe, record: dict, processes: Processes) -> None:
    if processes.is_main:
        write_atomically(os.path.join(recipe.output.dir, "recipe.json"), json.dumps(record, indent=2))


def local_student(student: str) -> str:
    """``model.student`` as given: a folder, or an ``owner/name`` hub id; anything else is a folder that is not there."""
    if os.path.isdir(student):
        return student
    if HUB_ID.fullmatch(student) and not student.startswith((".", "/", "~")) and not hub_offline():
        return student
    raise FileNotFoundError(f"model.student: {student} is not a folder (the output of convert or distill"
                            + (", and HF_HUB_OFFLINE is set, so it cannot be a hub id)" if hub_offline() else
                               ", or an owner/name hub id)"))


def read_conversion_report(folder: str):
    """The ConversionReport saved in ``folder`` (None when there is none: e.g. a model not made by convert)."""
    from ..conversion.report import ConversionReport

    return ConversionReport.load(folder) if os.path.isfile(os.path.join(folder, f"{CONVERSION_REPORT}.json")) else None


def copy_history(source: str, folder: str) -> None:
    """Carry ``source``'s history files (conversion report, training summary, loss curve) into ``folder``."""
    for name in HISTORY_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(folder, name))


def launched(recipe: Recipe) -> tuple[Recipe, Processes]:
    """The recipe with what an agreeing accelerate config of this launch adds (``from_accelerate_config``), and
    accelerate's view of the launch (torchrun / accelerate launch / plain python; CPU runs use gloo) with the
    recipe's experiment trackers (recipes/tracking.py; TensorBoard under OUT/tensorboard). A launch that disagrees
    with the recipe fails here, before any work (``check_launch``)."""
    from accelerate import Accelerator

    recipe = replace(recipe, train=from_accelerate_config(recipe.train))
    processes = Processes(Accelerator(cpu=not torch.cuda.is_available(), log_with=trackers(recipe.train) or None,
                                      project_dir=os.path.join(recipe.output.dir, "tensorboard")))
    check_launch(recipe.train)
    return recipe, processes


def plot_losses(histories: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [name for name, history in histories.items() if history]
    if not stages:
        return
    figure, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 3.8), squeeze=False)
    titles = {"stage1": "stage 1: attention transfer (relative MSE)", "stage2": "stage 2: LoRA KD (loss)"}
    for axis, name in zip(axes[0], stages):
        axis.plot([row["step"] for row in histories[name]], [row["loss"] for row in histories[name]], label="loss")
        axis.set_title(titles.get(name, name))
        axis.set_xlabel("step")
        if min(row["loss"] for row in histories[name]) > 0:
            axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        held_out = [(row["step"], row[HELD_OUT_CURVE]) for row in histories[name] if HELD_OUT_CURVE in row]
        if held_out:  # train.eval_every: the held-out KL on its own scale
            twin = axis.twinx()
            twin.plot(*zip(*held_out), "o-", color="tab:orange", label="held-out KL to the teacher")
            twin.set_ylabel("held-out KL to the teacher", color="tab:orange")
    save_figure(figure, path)
