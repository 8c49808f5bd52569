"""The one dtype vocabulary of the recipes, the command line, ``convert`` and the benchmarks: ``fp32``, ``bf16`` and
``fp16``, with the spellings users bring from torch and transformers (``float32``, ``bfloat16``, ``float16``)
accepted as the same names. Summaries and plans write torch's spelling (``dtype_name``). torch is imported only
when a name becomes a dtype, so the command line's parser reads the names without it."""

from __future__ import annotations

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the short names, and torch's for each
ALIASES = {torch_name: short for short, torch_name in TORCH_NAMES.items()}  # "bfloat16" -> "bf16"
NAMES = (*TORCH_NAMES, *ALIASES)  # what a recipe field, a --dtype flag or a dtype argument accepts


def names_of(*short: str) -> tuple[str, ...]:
    """The accepted names of some of the dtypes, by short name (a --dtype flag's choices where only those make
    sense): names_of("fp32", "bf16") -> ("fp32", "bf16", "float32", "bfloat16")."""
    return tuple(name for name in NAMES if ALIASES.get(name, name) in short)


def dtype_key(name: str, field: str = "dtype", choices: tuple[str, ...] = NAMES) -> str:
    """The short name of ``name`` ("bfloat16" -> "bf16"); a ValueError naming ``field`` and the choices if
    ``name`` is not one of them."""
    if name not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}, got {name!r}")
    return ALIASES.get(name, name)


def to_dtype(name: str, field: str = "dtype", choices: tuple[str, ...] = NAMES):
    """torch's dtype for ``name`` ("bf16" and "bfloat16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, TORCH_NAMES[dtype_key(name, field, choices)])


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how summaries, plans and saved configs name a dtype."""
    return str(dtype).removeprefix("torch.")
