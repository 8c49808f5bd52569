"""The DeepSpeed config of ``train.strategy: deepspeed``: what the recipe sets, merged with a user's JSON.

    config = merged(read_deepspeed_config(path), deepspeed_settings(train, lr, dtype), path)

``train.deepspeed_config: PATH`` is a DeepSpeed JSON as users keep them for the HF Trainer: ``"auto"`` values take the
recipe's, keys the recipe does not set (offload, bucket sizes, overlap_comm, ...) are kept as written, and a key the
recipe sets (batch size, accumulation, ZeRO stage, optimizer, rate, weight decay, clipping, precision) written with
another value is refused, naming the file, the key and the recipe field, as is a ``scheduler``: the recipe's
``train.lr_scheduler`` sets every step's rate. A key DeepSpeed would not read (a misspelt one, which it ignores at the
top level) is refused too, checked by DeepSpeed's own parser (``unknown_keys``).
"""

from __future__ import annotations

import copy
import json

import torch

# the keys the recipe decides, with the field that decides each
RECIPE_OWNED = {"train_micro_batch_size_per_gpu": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum",
                "zero_optimization.stage": "train.zero_stage", "optimizer.type": "train.optimizer",
                "optimizer.params.lr": "train.lr / stage2.lr (set it to \"auto\")",
                "optimizer.params.weight_decay": "train.weight_decay", "gradient_clipping": "train.max_grad_norm",
                "bf16.enabled": "train.precision", "fp16.enabled": "train.precision"}


def deepspeed_settings(train, lr: float, dtype: torch.dtype) -> dict:
    """What the recipe sets: micro-batch and accumulation, the ZeRO stage, torch's AdamW at the stage's rate, clipping,
    the precision blocks (bf16 / fp16: the engine's copies in that dtype, fp32 masters and Adam states in ZeRO's
    partitions; fp16 with DeepSpeed's dynamic loss scaling, whose settings a user's JSON may tune)."""
    return {"train_micro_batch_size_per_gpu": train.batch_size,
            "gradient_accumulation_steps": train.grad_accum,
            "zero_optimization": {"stage": train.zero_stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": train.weight_decay,
                                                      "torch_adam": True}},
            "gradient_clipping": train.max_grad_norm or 0.0, "steps_per_print": 10**9,
            "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}


def zero3_settings(hidden: int, largest_block: int) -> dict:
    """ZeRO-3's gathering sized to the model (a user's JSON may set each key otherwise): tensors under 10 x hidden
    (norms, biases) stay whole, and each prefetch asks for 0.9 x hidden^2 values (transformers' "auto" values); at
    most two blocks' weights gathered ahead (``stage3_max_live_parameters``), and a gathered weight kept only for a
    reuse within one block (``stage3_max_reuse_distance``: from a checkpointed block's recomputed forward to its
    backward). DeepSpeed's defaults, 1e9 values each, let the prefetch run up to 1e9 weights ahead: for a 1.1B model
    nearly all of it gathered at once, GiBs more per process than these settings in a bf16 run."""
    return {"stage3_param_persistence_threshold": 10 * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden**2),
            "stage3_max_live_parameters": 2 * largest_block, "stage3_max_reuse_distance": largest_block}


def zero3_settings_with(path: str | None, hidden: int, largest_block: int) -> dict:
    """``zero3_settings`` with the ``zero_optimization`` block of the user's JSON at ``path`` merged over them as a
    run merges it ("auto" keeps ours; the recipe-owned ``stage`` was checked when the recipe loaded)."""
    ours = zero3_settings(hidden, largest_block)
    if not path:
        return ours
    return _merge(read_deepspeed_config(path).get("zero_optimization", {}), ours, "zero_optimization.", [])


def zero3_gathered(zero_optimization: dict, parameters: int) -> int:
    """An upper bound on the weights (values) ZeRO-3 holds gathered at once, beyond the embeddings and head: what
    its prefetch may hold ahead (``stage3_max_live_parameters``) plus what it keeps for a reuse
    (``stage3_max_reuse_distance``), at most the model's ``parameters``; DeepSpeed's defaults where unset."""
    live = zero_optimization.get("stage3_max_live_parameters", 1e9)
    reuse = zero_optimization.get("stage3_max_reuse_distance", 1e9)
    return int(min(parameters, live + reuse))


def read_deepspeed_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as error:
        raise ValueError(f"train.deepspeed_config: {path}: cannot be read ({error.strerror})") from None
    except ValueError as error:
        raise ValueError(f"train.deepspeed_config: {path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"train.deepspeed_config: {path}: a DeepSpeed config is a JSON object")
    return config


def merged(user: dict, ours: dict, path: str) -> dict:
    """``ours`` with ``user``'s keys merged in (see the module's docstring); every conflict named in one error."""
    conflicts = []
    if "scheduler" in user:
        conflicts.append("scheduler: the recipe's train.lr_scheduler sets each step's rate; remove it")
    config = _merge(user, ours, "", conflicts)
    if conflicts:
        raise ValueError(f"train.deepspeed_config: {path} disagrees with the recipe: " + "; ".join(conflicts))
    unknown = unknown_keys(config)
    if unknown:
        raise ValueError(f"train.deepspeed_config: {path}: DeepSpeed does not know " + "; ".join(unknown))
    return config


def unknown_keys(config: dict) -> list[str]:
    """The keys of ``config`` that DeepSpeed would not read, each with a close known name where there is one. The
    top level: the keys its ``DeepSpeedConfig`` asks for while it parses ``config`` (recorded as it reads them; an
    unknown one it would silently ignore); a section (zero_optimization, ...): what its pydantic model refuses."""
    import difflib

    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    asked = set()

    class Recorded(dict):  # a dict that notes every key looked up in it, however it is asked
        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

        def keys(self):
            return _RecordedKeys(self, asked)

    # train_batch_size must equal micro-batch x accumulation x processes, which only the launched run knows
    checked = {key: value for key, value in config.items() if key != "train_batch_size"}
    try:
        DeepSpeedConfig(Recorded(checked))
    except ValidationError as error:
        found = []
        for problem in error.errors():
            key = ".".join(str(part) for part in problem["loc"])
            sections = [name for name, value in config.items() if isinstance(value, dict) and problem["loc"]
                        and problem["loc"][0] in value]
            found.append(f"{sections[0] + '.' if sections else ''}{key} ({problem['msg'].lower()})")
        return found
    except (AssertionError, ValueError, TypeError):  # a value it refuses: DeepSpeed says which when the run starts
        return []
    return [name + (f" (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, asked, 1)) else "")
            for name in checked if name not in asked]


class _RecordedKeys:
    """``dict.keys()`` of ``unknown_keys``' recording dict: a membership test is a lookup of that key."""

    def __init__(self, mapping: dict, asked: set):
        self.mapping, self.asked = mapping, asked

    def __contains__(self, key):
        self.asked.add(key)
        return dict.__contains__(self.mapping, key)

    def __iter__(self):
        return iter(dict.keys(self.mapping))

    def __len__(self):
        return len(self.mapping)


def _merge(user: dict, ours: dict, prefix: str, conflicts: list) -> dict:
    config = copy.deepcopy(ours)
    for key, value in user.items():
        name = prefix + key
        if isinstance(value, dict) and isinstance(ours.get(key), dict):
            config[key] = _merge(value, ours[key], f"{name}.", conflicts)
        elif value == "auto":
            continue  # the recipe's value, or (a key it does not set) DeepSpeed's own default
        elif name in RECIPE_OWNED and value != ours.get(key):
            conflicts.append(f"{name} is {json.dumps(value)} there, {json.dumps(ours.get(key))} from "
                             f"{RECIPE_OWNED[name]}")
        else:
            config[key] = value
    return config
