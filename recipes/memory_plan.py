"""The memory plan of a recipe (``hf-mixers distill RECIPE --plan``): what each process will hold, before anything
is loaded, and whether it fits.

    weights      the teacher in the training dtype (never sharded); the student's frozen weights are the teacher's
                 tensors (ddp, ZeRO-1/2) or 1/N shards of their own plus the gathered blocks (fsdp, ZeRO-3); what a
                 stage trains (the mixers' new tensors, LoRA) in fp32. On a CPU host with
                 ``train.release_host_memory`` an untied embedding read from its file counts only the pages one
                 batch's lookups map (each token at most 64 KiB: the kernel's fault-around)
    gradients    fp32, of the trained tensors: whole (ddp: plus DistributedDataParallel's buckets; ZeRO-1) or 1/N
    optimizer    AdamW's two fp32 states per trained value (Adafactor's factored rows and columns, 8-bit AdamW's two
                 bytes: recipes/optimizers.py), 1/N under ZeRO and FSDP (DeepSpeed adds its fp32 masters)
    activations  what autograd keeps for the backward pass, *counted*: one block of each kind the student has (the
                 mixer, kept attention) is built at the teacher's width with random weights on the CPU, wrapped with
                 the recipe's LoRA, and run once per stage in the recipe's dtype under ``saved_tensors_hooks``. The
                 counts are taken at the recipe's length (beyond 4096 tokens: at 1K, 2K and 4K, extrapolated as a
                 quadratic) and at two small MLP widths, extended linearly to the real width (exact: the MLP's saved
                 tensors are linear in it)
    loss         the stage-2 loss's full-vocabulary logits: 5.7 fp32 (rows, vocab) tensors per chunk of
                 ``stage2.loss_chunk_rows`` (7 over the whole batch for the dense loss), the factors measured by
                 scripts/distill_loss_memory.py
    heap slack   (CPU plans, Linux) what glibc's heap keeps resident beyond the kept tensors (freed transients
                 between them), measured as the rise of resident memory over a first and a second block (with
                 ``train.release_host_memory``, releasing at each block as the run does); under fsdp and ZeRO-3
                 with it set to false (its default, "auto", releases there), also the heap fragmented by gathering:
                 up to every block's gathered weights once (an upper bound: docs/benchmarks.md measured 15-95% of it)
    at once      the stage-2 loss's logits are freed before the backward pass makes its own parts (one block
                 recomputed under checkpointing, the heap's slack, the gradients): a stage's total counts the larger
    runtime      this process's own memory after its imports and the teacher folder's tokenizer (CPU), or 1 GiB of
                 CUDA context and workspaces (GPU)
    loading      (on CPU, where the host is the device) the teacher in the training dtype, plus its checkpoint's
                 memory-mapped file while it is read into another dtype (a bf16 checkpoint trained in fp32); for a
                 ``model.student`` folder its own tensors and its largest tensor being compared with the teacher's
                 (conversion/shared_weights.py: the folder is never held whole)

The counts come from the teacher's config.json and the student built on the meta device: no weight is read. What is
not counted: the CUDA allocator's fragmentation and caching (hence a 10% margin in "fits"), evaluation passes (no
grad, smaller than a training step), and conversion's calibration forward. For a plan that does not fit, ``advise``
re-plans the recipe with each switch that lowers the peak and names those that make it fit.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import resource
from dataclasses import dataclass, field

import torch

from ..conversion.shared_weights import freed_memory_released_per_block, release_freed_memory
from ..core.registry import TEACHER_ATTENTION, get_mixer
from .config import Recipe, releases_host_memory
from .deepspeed_config import zero3_gathered, zero3_settings_with
from .optimizers import state_bytes
from ..common.dtypes import dtype_name
from .run_plan import RunPlan, plan_run

GIB = 2**30
LOSS_TENSORS_PER_CHUNK_ROW = 5.7  # fp32 (rows, vocab) tensors alive in a chunk of the chunked loss (measured)
LOSS_TENSORS_DENSE = 7.0  # the same for the dense loss over the whole batch (measured)
CUDA_RUNTIME = 1 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers: what nvidia-smi shows before tensors
MARGIN = 0.10  # allocator caching and fragmentation
OPTIMIZER_STATES = {"adamw": "AdamW states", "adafactor": "Adafactor states (factored)",
                    "adamw_8bit": "8-bit AdamW states"}
MEASURED_LENGTHS = (1024, 2048, 4096)  # the block runs at the recipe's length, or at these when it is longer
MLP_WIDTHS = (16, 32)
FAULT_AROUND = 64 * 2**10  # Linux maps up to 64 KiB of a file mapping's cached pages around a faulting read
RESIDENT_MEASURED = os.path.isfile("/proc/self/status")  # Linux: the heap's slack is measured (_activations)


@dataclass
class MemoryPlan:
    """Per-process bytes of each part, per stage (``stages``: name -> {part: bytes}), and what it was planned for.
    ``apart`` (stage -> two lists of parts) names parts never held at once: a stage's total counts the larger group."""
    title: str
    processes: int
    device: str
    device_memory: int | None
    dtype: str
    stages: dict = field(default_factory=dict)
    host_at_load: int = 0
    notes: list = field(default_factory=list)
    apart: dict = field(default_factory=dict)
    # for a plan that does not fit (``advise``): (overrides, peak bytes, alone: one switch, else all together)
    advice: list = field(default_factory=list)

    def bytes_of(self, stage: str, parts) -> int:
        return sum(self.stages[stage][part] for part in parts)

    def total(self, stage: str) -> int:
        groups = self.apart.get(stage, ())
        return self.bytes_of(stage, self.stages[stage]) - min((self.bytes_of(stage, g) for g in groups), default=0)

    def peak(self) -> tuple[str, int]:
        name = max(self.stages, key=self.total)
        return name, self.total(name)

    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return self.peak()[1] * (1 + MARGIN) <= self.device_memory

    def to_dict(self) -> dict:
        stage, peak = self.peak()
        return {"title": self.title, "processes": self.processes, "device": self.device,
                "device_memory": self.device_memory, "dtype": self.dtype, "stages": self.stages,
                "totals": {name: self.total(name) for name in self.stages}, "apart": self.apart,
                "peak_stage": stage, "peak_bytes": peak, "host_at_load": self.host_at_load, "fits": self.fits(),
                "notes": self.notes, "advice": [{"set": list(overrides), "peak_bytes": bytes_, "alone": alone}
                                                for overrides, bytes_, alone in self.advice]}

    def to_text(self) -> str:
        parts = list(dict.fromkeys(part for values in self.stages.values() for part in values))
        width = max(len(part) for part in parts) + 2
        lines = [self.title, f"{'per process':<{width}}" + "".join(f"{name:>14}" for name in self.stages)]
        for part in parts:
            lines.append(f"  {part:<{width - 2}}" + "".join(f"{_gib(values.get(part, 0)):>14}"
                                                            for values in self.stages.values()))
        lines.append(f"  {'total':<{width - 2}}" + "".join(f"{_gib(self.total(name)):>14}" for name in self.stages))
        for name, (first, second) in self.apart.items():
            lines.append(f"{name}'s total counts the larger of {' + '.join(first)} ({_gib(self.bytes_of(name, first))})"
                         f" and {' + '.join(second)} ({_gib(self.bytes_of(name, second))}), never held at once")
        stage, peak = self.peak()
        lines.append(f"host memory per process while loading the teacher: {_gib(self.host_at_load)}")
        if self.device_memory is not None:
            verdict = "fits" if self.fits() else "does NOT fit"
            where = ("per cpu process (this machine's RAM over the processes)" if self.device == "cpu"
                     else f"per {self.device} device")
            lines.append(f"{verdict} in {_gib(self.device_memory)} {where}: the peak ({stage}) "
                         f"is {_gib(peak)}, {peak / self.device_memory:.0%} of it (with a {MARGIN:.0%} margin "
                         f"for the allocator)")
        if self.advice:
            lines.append("to fit, any one of (cheapest to the run first):" if self.advice[0][2] else
                         "no single switch makes it fit; these together do:")
            for overrides, peak_bytes, _ in self.advice:
                flags = " ".join(f"--set {item}" for item in overrides)
                lines.append(f"  {flags}: peak {_gib(peak_bytes)}, {peak_bytes / self.device_memory:.0%}")
        elif self.fits() is False:
            lines.append("nothing the plan can switch makes it fit: more processes or a larger device")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def parse_size(text: str) -> int:
    """'80GB', '80G', '24GiB', '512MB' -> bytes (GB and G read as GiB: what device specs mean)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(float(value))
    except ValueError:
        raise ValueError(f"--device-memory: expected a size such as 80GB or 24GiB, got {text!r}") from None


@dataclass(frozen=True)
class _Sizes:
    """What every stage's parts are computed from: the run plan, the student's config, parameter counts, bytes a
    weight, and the shared parts (the teacher's weights, a looked-up embedding, the runtime)."""
    run: RunPlan
    config: object
    counts: dict
    blocks: dict
    element: int
    tokens: int
    teacher_bytes: int
    embedding: int
    runtime: int
    fragmenting: bool


def plan_memory(recipe: Recipe, processes: int = 1, device_memory: int | None = None,
                device: str | None = None) -> MemoryPlan:
    """The per-process memory of ``recipe``'s stages on ``processes`` processes of ``device`` ("cpu" or "cuda";
    default: cuda when ``device_memory`` is given or this machine has a GPU). ``device_memory`` (bytes per process)
    defaults to this machine's GPU memory, or on CPU to its RAM divided by the processes. The run is resolved as a
    launch resolves it (run_plan.py): its dtype, strategy and stages."""
    from ..conversion.teacher import stored_dtype, teacher_config

    if processes < 1:
        raise ValueError(f"--processes must be at least 1, got {processes}")
    device = device or ("cuda" if device_memory is not None or torch.cuda.is_available() else "cpu")
    device_memory = device_memory if device_memory is not None else _this_machines_memory(device, processes)
    run = plan_run(recipe, torch.device(device), processes, planned=not torch.cuda.is_available())
    dtype = run.dtype
    teacher, _ = teacher_config(recipe.model.teacher)
    if recipe.model.student:  # a converted folder: its own config says which layers are what
        from transformers import AutoConfig

        from .stages import local_student

        config = AutoConfig.from_pretrained(local_student(recipe.model.student))
    else:
        config = _student_config(recipe, teacher)
    counts = _parameter_counts(config, teacher, recipe)
    element = torch.finfo(dtype).bits // 8
    blocks = _block_counts(config)
    layers = ", ".join(f"{count} {kind}" for kind, count in blocks.items())
    title = (f"memory plan: {recipe.model.teacher} -> {config.model_type} ({layers}), {recipe.train.batch_size} x "
             f"{recipe.data.sequence_length} tokens per micro-batch, {run.strategy} over {processes} "
             f"process{'es' if processes > 1 else ''}, {dtype_name(dtype)} on {device}")
    plan = MemoryPlan(title, processes, device, device_memory, dtype_name(dtype))
    for module in ("accelerate", "peft", "datasets"):  # what a run imports before it loads anything: its runtime
        importlib.import_module(module)
    _folder_tokenizer(recipe.model.teacher)  # a run holds it too: in the peak below
    host_runtime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process's peak so far, bytes
    teacher_bytes = counts["teacher"] * element
    # reading a checkpoint stored in another dtype holds its memory-mapped file and the converted tensors at once
    stored = stored_dtype(teacher)
    checkpoint = counts["teacher"] * torch.finfo(stored).bits // 8 if stored != dtype else 0
    plan.host_at_load = teacher_bytes + checkpoint + host_runtime
    runtime = CUDA_RUNTIME if device == "cuda" else host_runtime
    if device == "cpu":  # the host is the device: loading is a stage of its own
        plan.stages["loading"] = {f"teacher weights ({plan.dtype})": teacher_bytes,
                                  "runtime (this process)": runtime}
        if checkpoint:
            plan.stages["loading"][f"checkpoint being read ({dtype_name(stored)})"] = checkpoint
        if recipe.model.student:  # its frozen weights become the teacher's, compared one stored tensor at a time
            student_element = torch.finfo(stored_dtype(config)).bits // 8
            plan.stages["loading"]["model.student's own tensors"] = counts["new"] * max(element, student_element)
            plan.stages["loading"]["its largest tensor being compared"] = (
                config.vocab_size * config.hidden_size * (student_element + element))

    # a CPU host's heap under fsdp / ZeRO-3, which gather and free each block's weights (train.release_host_memory)
    fragmenting = run.shards_model and device == "cpu" and RESIDENT_MEASURED and not run.releases_host_memory
    # a CPU host releasing its memory at each block reads the memory-mapped (stored in the training dtype), untied
    # embedding a batch's rows at a time, and hands them back after each lookup (recipes/stages.py released_per_block)
    looked_up = (run.releases_host_memory and not run.shards_model and stored == dtype
                 and not config.tie_word_embeddings)
    sizes = _Sizes(run, config, counts, blocks, element, recipe.train.batch_size * recipe.data.sequence_length,
                   teacher_bytes, config.vocab_size * config.hidden_size * element if looked_up else 0, runtime,
                   fragmenting)
    shapes = counts["shapes"]
    for stage in run.stages:  # what each trains, as the run plan says
        if stage.name == "stage1":
            trained = shapes["new"] + (shapes["qkv"] if recipe.stage1.train_qkv else [])
            plan.stages["stage 1"] = _stage_parts("stage 1", trained, recipe, sizes, plan)
        elif stage.name == "stage2":
            plan.stages["stage 2"] = _stage_parts("stage 2", shapes["new"] + shapes["lora"], recipe, sizes, plan)
    if not set(plan.stages) - {"loading"}:
        raise ValueError("the recipe trains nothing (stage 1 and stage 2 are off or have 0 steps): nothing to plan")
    if fragmenting:
        plan.notes.append("on a CPU host, gathering and freeing each block's weights fragments the heap (counted as "
                          "an upper bound); train.release_host_memory (its default, auto, under fsdp and "
                          "deepspeed) hands the memory back at each block, for steps 10-15% longer")
    if recipe.train.gradient_checkpointing:
        plan.notes.append("train.gradient_checkpointing: the blocks (stage 1: the converted mixers) keep their "
                          "inputs only, and one is recomputed at a time")
    return plan


def _this_machines_memory(device: str, processes: int) -> int | None:
    """A process's share of this machine: its GPU's memory, or its RAM divided by the processes (None: unknown)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    if device == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes
    return None


def _stage_parts(name: str, trained_shapes: list, recipe: Recipe, sizes: _Sizes, plan: MemoryPlan) -> dict:
    """One stage's parts (name -> bytes per process): the frozen weights, what trains and its gradients and optimizer
    states as the strategy holds them, the activations, the loss, the runtime; parts never held at once go to
    ``plan.apart``."""
    run, config, counts, element, train = sizes.run, sizes.config, sizes.counts, sizes.element, recipe.train
    world, strategy, device = run.world, train.strategy, run.device.type
    trained = sum(math.prod(shape) for shape in trained_shapes)
    parts = {f"teacher weights ({plan.dtype})": sizes.teacher_bytes - sizes.embedding}
    if sizes.embedding:
        parts["embedding rows a batch looks up (mapped)"] = min(sizes.embedding, sizes.tokens * FAULT_AROUND)
    own = counts["new"] * 4 + (counts["lora"] * 4 if name == "stage 2" else 0)
    if name == "stage 1" and recipe.stage1.train_qkv:
        own += counts["qkv"] * 4  # trained copies of the converted layers' q/k/v, no longer shared
    if run.shards_model:
        student_bytes = (counts["student"] - counts["new"]) * element + own
        parts["student weights (1/N shard)"] = student_bytes // world
        # stage 2 gathers the root's embeddings (and norm); its head is the teacher's tensor, left whole
        # (recipes/stages.py sharding_for; tied, it is the embedding, gathered with it)
        head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
        root = (counts["root"] - head) * element if name == "stage 2" else 0
        if strategy == "deepspeed":  # what its prefetch and reuse settings let it hold (deepspeed_config.py)
            settings = zero3_settings_with(train.deepspeed_config, config.hidden_size, counts["largest_block"])
            gathered = zero3_gathered(settings, counts["student"] - counts["root"])
            parts["gathered weights (ZeRO-3 prefetch and reuse)"] = gathered * element + root
        else:
            parts["gathered blocks (2 in flight)"] = 2 * counts["largest_block"] * element + root
    else:
        parts["student's own weights (fp32)"] = own
    if strategy == "deepspeed":
        parts["DeepSpeed fp32 masters (1/N)"] = trained * 4 // world
    grads = trained * 4
    if strategy == "ddp" or (strategy == "deepspeed" and train.zero_stage == 1):
        parts["gradients (fp32)"] = grads
        if strategy == "ddp" and world > 1:
            parts["DDP gradient buckets"] = grads
    else:
        parts["gradients (fp32, 1/N)"] = grads // world
    partitioned = run.partitions_optimizer
    parts[OPTIMIZER_STATES[train.optimizer] + (" (1/N)" if partitioned else "")] = (
        state_bytes(train.optimizer, trained_shapes) // (world if partitioned else 1))
    per_row, recomputed, slack = _activations(config, recipe, run.dtype, name,
                                              resident=device == "cpu" and RESIDENT_MEASURED)
    parts["activations"] = per_row * train.batch_size
    if recomputed:
        parts["one block recomputed (backward)"] = recomputed * train.batch_size
    if slack:
        parts["heap slack (freed, still resident)"] = slack * train.batch_size
    if sizes.fragmenting:
        # gathered weights freed between the tensors the backward keeps: the heap grew by about one gathered
        # block per block in the 1.1B runs (docs/benchmarks.md, "Memory plan")
        parts["heap fragmented by gathering (up to every block once)"] = (counts["student"] - counts["root"]) * element
    if name == "stage 1":
        converted = sum(count for kind, count in sizes.blocks.items() if kind not in TEACHER_ATTENTION)
        parts["captured teacher activations"] = 2 * converted * sizes.tokens * config.hidden_size * element
    else:
        _loss_parts(name, parts, recipe, sizes, plan)
    parts["runtime" + (" (CUDA context)" if device == "cuda" else " (this process)")] = sizes.runtime
    return {part: int(value) for part, value in parts.items()}


def _loss_parts(name: str, parts: dict, recipe: Recipe, sizes: _Sizes, plan: MemoryPlan) -> None:
    """Stage 2's loss logits in ``parts``, and in ``plan.apart`` what is never held beside them."""
    rows, vocab = recipe.stage2.loss_chunk_rows, sizes.config.vocab_size
    if rows:  # sharded too: the student's frozen head is the teacher's, read whole (stages.py)
        parts["loss logits (chunked)"] = int(LOSS_TENSORS_PER_CHUNK_ROW * min(rows, sizes.tokens) * vocab * 4)
    else:
        parts["loss logits (whole batch)"] = int(LOSS_TENSORS_DENSE * sizes.tokens * vocab * 4)
    # the loss's logits are freed before the backward pass makes its own parts: one block recomputed, the heap it
    # leaves (a CPU step hands the forwards' back before the loss), the gradients (None between steps, zero_grad;
    # DeepSpeed keeps its buffers). Accumulating micro-batches hold gradients at the loss.
    after = ["one block recomputed (backward)", "heap slack (freed, still resident)"]
    if recipe.train.grad_accum == 1 and recipe.train.strategy != "deepspeed":
        after += ["gradients (fp32)", "gradients (fp32, 1/N)"]
    logits = [part for part in parts if part.startswith("loss logits")]
    backward = [part for part in after if part in parts]
    if logits and backward:
        plan.apart[name] = (logits, backward)


def _with(recipe: Recipe, overrides: tuple) -> Recipe:
    """A copy of ``recipe`` with ``overrides`` ("section.field=value", the value read as the field's current type:
    int, str, or "true" for a bool) applied; only ``_switches``' own fields are written."""
    recipe = copy.deepcopy(recipe)
    for item in overrides:
        path, value = item.split("=", 1)
        section, name = path.split(".")
        current = getattr(getattr(recipe, section), name)
        setattr(getattr(recipe, section), name, type(current)(value) if not isinstance(current, bool)
                else value == "true")
    return recipe


def _switches(recipe: Recipe, processes: int):
    """The switches that lower the peak, cheapest to the run first, each a list of candidate override tuples (the
    first that fits is named): what costs compute before what changes the training."""
    train, data = recipe.train, recipe.data
    if not train.gradient_checkpointing:  # about a third more compute; the same training
        yield [("train.gradient_checkpointing=true",)]
    if recipe.stage2.loss_chunk_rows == 0:  # the loss's logits a chunk of rows at a time
        yield [("stage2.loss_chunk_rows=512",)]
    if train.batch_size > 1:  # the same tokens per optimizer step, in more micro-batches
        yield [(f"train.batch_size={train.batch_size // factor}", f"train.grad_accum={train.grad_accum * factor}")
               for factor in (2, 4, 8, 16, 32, 64) if train.batch_size % factor == 0]
    if processes > 1 and train.strategy == "ddp":  # the weights, gradients and states shared over the processes
        yield [("train.strategy=fsdp",)]
    if train.strategy == "deepspeed" and train.zero_stage < 3:
        yield [(f"train.zero_stage={stage}",) for stage in range(train.zero_stage + 1, 4)]
    if data.sequence_length > 256:  # shorter sequences: this changes what the run learns, so it comes last
        yield [(f"data.sequence_length={data.sequence_length // factor}",) for factor in (2, 4, 8)
               if data.sequence_length // factor >= 128]


def advise(plan: MemoryPlan, recipe: Recipe, processes: int = 1) -> MemoryPlan:
    """For a plan that does not fit: each switch of ``_switches`` that makes it fit on its own, with the peak it
    gives (re-planned; the block measurements are reused), into ``plan.advice``; when none does, all of the switches
    that keep the training the same (everything but the sequence length) at once, if that fits."""
    if plan.fits() is not False:
        return plan

    def peak(overrides):
        return plan_memory(_with(recipe, overrides), processes, plan.device_memory, plan.device).peak()[1]

    def fits(bytes_):
        return bytes_ * (1 + MARGIN) <= plan.device_memory

    together = ()
    for candidates in _switches(recipe, processes):
        if not candidates[0][0].startswith("data."):
            together += candidates[-1]
        for overrides in candidates:
            if fits(bytes_ := peak(overrides)):
                plan.advice.append((overrides, bytes_, True))
                break
    if not plan.advice and together and fits(bytes_ := peak(together)):
        plan.advice.append((together, bytes_, False))
    return plan


def _folder_tokenizer(source: str):
    """The tokenizer of a teacher folder that has one, loaded as a run loads it (None otherwise: a hub id or GGUF
    is not read for a plan)."""
    if not (os.path.isdir(source) and any(os.path.isfile(os.path.join(source, name))
                                          for name in ("tokenizer.json", "tokenizer.model"))):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):  # the run says what is wrong with it; the plan counts without it
        return None


def _student_config(recipe: Recipe, teacher):
    """The converted model's config, as ``convert`` would make it (K kept layers, whichever they turn out to be)."""
    from ..conversion.families import backbone_fields, teacher_layer_kinds
    from ..model.config import config_class

    spec = get_mixer(recipe.model.mixer)
    options = {**spec.conversion_options, **spec.checked_options(recipe.model.mixer_options or {}, "mixer options")}
    kinds = teacher_layer_kinds(teacher)
    keep = recipe.model.keep_attention
    if isinstance(keep, str) and ":" in keep:
        kept = set(range(int(keep.partition(":")[2])))
    elif keep:
        kept = {int(item) for item in (keep.split(",") if isinstance(keep, str) else keep) if str(item).strip()}
    else:
        kept = set()
    layer_types = [kinds[i] if i in kept else recipe.model.mixer for i in range(len(kinds))]
    return config_class(recipe.model.mixer)(**backbone_fields(teacher), layer_types=layer_types, **options)


def _block_counts(config) -> dict:
    counts = {}
    for kind in config.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _parameter_counts(config, teacher_config, recipe: Recipe) -> dict:
    """Parameter counts, on the meta device: the teacher; the student, its new (mixers' own) tensors, the converted
    layers' q/k/v, the LoRA the stage-2 recipe adds, its largest block and its root (embeddings, norm, head)."""
    from transformers import AutoModelForCausalLM

    from ..model.modeling import model_classes
    from .stages import new_mixer_parameters

    with torch.device("meta"):
        student = model_classes(config.model_type)[1](config)
        teacher = AutoModelForCausalLM.from_config(teacher_config)
    new = {name: tuple(p.shape) for name, p in new_mixer_parameters(student).items()}
    qkv = [tuple(p.shape) for name, p in new_mixer_parameters(student, train_qkv=True).items() if name not in new]
    targets, r = tuple(recipe.stage2.lora_targets), recipe.stage2.lora_r
    lora = [shape for name, module in student.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets
            for shape in ((r, module.in_features), (module.out_features, r))]
    total = sum(p.numel() for p in student.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in student.model.layers]
    shapes = {"new": list(new.values()), "qkv": qkv, "lora": lora}  # what the stages train (optimizer states)
    return {"student": total, **{part: sum(math.prod(shape) for shape in value) for part, value in shapes.items()},
            "shapes": shapes, "teacher": sum(p.numel() for p in teacher.parameters()), "largest_block": max(blocks),
            "root": total - sum(blocks)}


def _activations(config, recipe: Recipe, dtype: torch.dtype, stage: str, resident: bool) -> tuple[int, int, int]:
    """(bytes autograd keeps for one sequence of the recipe's length through every block (stage 2: whole blocks with
    LoRA; stage 1: the converted mixers alone, on the teacher's inputs), what the backward pass adds recomputing one
    block (stage 2 with checkpointing; else 0), the heap's slack beside them), measured on blocks of each kind. The
    slack (``resident``: a CPU plan on Linux) is what the process holds beyond the kept tensors: transients freed
    between them stay resident in glibc's heap until reused. It is measured as the rise of resident memory over a
    first block and over a second: the whole model holds the first block's rise, the second's for every further
    block, less what the blocks keep."""
    length = recipe.data.sequence_length
    total = recomputed = slack = 0
    for kind, count in _block_counts(config).items():
        if stage == "stage 1" and kind in TEACHER_ATTENTION:
            continue  # stage 1 runs the teacher's attention without gradients
        measured = {}

        def measure(t, width, part):
            if (t, width) not in measured:
                measured[t, width] = _block_memory(config, kind, recipe, dtype, stage, t, width, resident)
            return measured[t, width][part]

        saved = _extrapolated(lambda t, width: measure(t, width, 0), length, config.intermediate_size)
        # the slack is the mixer's transients (the MLP keeps its intermediate tensors): the two widths' mean
        first, further = (_extrapolated(lambda t, width: measure(t, width, part), length, sum(MLP_WIDTHS) / 2)
                          for part in (1, 2))
        if recipe.train.gradient_checkpointing and stage == "stage 2":
            kept = length * config.hidden_size * torch.finfo(dtype).bits // 8
            total += count * kept  # the inputs of each block; one block recomputed at a time in the backward pass
            recomputed = max(recomputed, saved - kept)
            slack += max(0, first - saved) if resident else 0
        elif recipe.train.gradient_checkpointing:  # stage 1: one mixer recomputed at a time; its inputs are the
            total += saved  # teacher's captured tensors, counted on their own
            slack += max(0, first - saved) if resident else 0
        else:
            total += count * saved
            slack += max(0, first + (count - 1) * further - count * saved) if resident else 0
    return total, recomputed, slack


def _extrapolated(measure, length: int, width: float) -> int:
    """measure(t, w) at the recipe's length (when at most 4096; chunked layouts pad to their chunk, so the length
    itself is what is exact) or fitted as a + b t + c t^2 over MEASURED_LENGTHS, at two MLP widths, extended
    linearly to ``width``."""
    lengths = [length] if length <= MEASURED_LENGTHS[-1] else list(MEASURED_LENGTHS)

    def at_width(w):
        values = [measure(t, w) for t in lengths]
        if len(values) == 1:
            return values[0]
        coefficients = torch.linalg.solve(torch.tensor([[1.0, t, t * t] for t in lengths], dtype=torch.float64),
                                          torch.tensor(values, dtype=torch.float64))
        return float(coefficients @ torch.tensor([1.0, length, length * length], dtype=torch.float64))

    low, high = (at_width(w) for w in MLP_WIDTHS)
    return int(round(low + (high - low) / (MLP_WIDTHS[1] - MLP_WIDTHS[0]) * (width - MLP_WIDTHS[0])))


_measured: dict = {}  # one process's block measurements, by everything they read: the advice re-plans reuse them


def _block_memory(config, kind: str, recipe: Recipe, dtype: torch.dtype, stage: str, length: int, width: int,
                  resident: bool) -> tuple[int, int, int]:
    """(bytes of the distinct storages autograd saves in one forward of one block of ``kind`` (its MLP ``width``
    wide) over one sequence of ``length``, parameters excluded; the rise of resident memory over the first block and
    over a second: 0 unless ``resident``, when two blocks run)."""
    key = (config.to_json_string(), kind, str(dtype), stage, length, width, resident, recipe.stage1.train_qkv,
           tuple(recipe.stage2.lora_targets), recipe.stage2.lora_r, releases_host_memory(recipe.train))
    if key not in _measured:
        _measured[key] = _measure_block(config, kind, recipe, dtype, stage, length, width, resident)
    return _measured[key]


def _measure_block(config, kind: str, recipe: Recipe, dtype: torch.dtype, stage: str, length: int, width: int,
                   resident: bool) -> tuple[int, int, int]:
    """``_block_memory``, measured."""
    from ..model.modeling import model_classes
    from .precision import autocast, fp32_masters

    blocks = 2 if resident else 1
    small = copy.deepcopy(config)
    small.num_hidden_layers, small.layer_types, small.intermediate_size, small.vocab_size = (
        blocks, [kind] * blocks, width, 16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_classes(config.model_type)[1](small).model.to(dtype)
    model.norm = torch.nn.Identity()  # the blocks alone: the final norm is the whole model's, once
    from .stages import new_mixer_parameters

    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trained = list(new_mixer_parameters(_Wrapped(model), recipe.stage1.train_qkv and stage == "stage 1").values())
    if stage == "stage 2":
        from peft import LoraConfig, inject_adapter_in_model

        targets = [t for t in recipe.stage2.lora_targets
                   if any(name.endswith(t) for name, _ in model.named_modules())]
        if targets:
            inject_adapter_in_model(LoraConfig(r=recipe.stage2.lora_r, lora_alpha=recipe.stage2.lora_alpha,
                                               target_modules=targets, lora_dropout=0.0), model)
            trained += [p for name, p in model.named_parameters() if "lora_" in name]
    fp32_masters(trained)
    for parameter in trained:
        parameter.requires_grad_(True)
    hidden = torch.randn(1, length, config.hidden_size, dtype=dtype, requires_grad=stage == "stage 2")
    rises, kept = [], []

    def forward():
        release_freed_memory()  # earlier work's freed pages out of the count: what the blocks touch is counted
        start = _resident_heap()
        if stage == "stage 2":  # with train.release_host_memory as a run's stage 2 releases (stages.py)
            with freed_memory_released_per_block(model.layers if releases_host_memory(recipe.train) else ()):
                hooks = [block.register_forward_hook(lambda *args: rises.append(_resident_heap() - start))
                         for block in model.layers]
                kept.append(model(inputs_embeds=hidden, use_cache=False))
            for hook in hooks:
                hook.remove()
            return
        rope = model.rotary_emb(hidden, position_ids=torch.arange(length).unsqueeze(0))
        for block in model.layers:
            kept.append(block.mixer(hidden, rope))
            rises.append(_resident_heap() - start)

    with autocast(dtype, torch.device("cpu")):
        saved = saved_bytes(forward, model) // blocks
    return (saved, rises[0], rises[1] - rises[0]) if resident else (saved, 0, 0)


def _resident_heap() -> int:
    """This process's resident anonymous memory, bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def saved_bytes(forward, model) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``forward()`` runs, ``model``'s own
    parameters excluded (they are counted as weights)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage  # held: a freed one's address reused would hide another
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storage.nbytes() for storage in saved.values())


class _Wrapped(torch.nn.Module):
    """A bare MixerModel seen as a causal LM's ``.model`` (what new_mixer_parameters reads names and config from)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
