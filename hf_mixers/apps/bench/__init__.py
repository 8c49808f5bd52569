"""``hf-mixers bench TARGET``: the benchmarks, each a module of this package that registers itself.

A module declares its target with ``register_bench(name, help, add_arguments, run)``: ``add_arguments(parser)`` adds
the target's own flags to ``hf-mixers bench NAME`` (``shape_flags``, ``decoding_flags``, ... below for the common
ones), and ``run(args)`` runs it and writes ``args.out``/bench_NAME.json and .png. ``targets()`` imports every module
here once, so a mixer's benchmark is one new file. Nothing heavy is imported until a target is asked for.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from ..arguments import at_least, positive_list

HELPERS = ("harness",)  # modules of this package that are not targets


@dataclass(frozen=True)
class BenchTarget:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], object]


_TARGETS: dict[str, BenchTarget] = {}


def register_bench(name: str, help: str, add_arguments, run) -> BenchTarget:
    target = BenchTarget(name, help, add_arguments, run)
    known = _TARGETS.get(name)
    if known is not None and known.run.__module__ != run.__module__:
        raise ValueError(f"bench target {name!r} is already registered by {known.run.__module__}")
    _TARGETS[name] = target
    return target


def targets() -> dict[str, BenchTarget]:
    """Every registered target, by name (the modules of this package are imported on the first call)."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in HELPERS:
            importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(_TARGETS.items()))


def target_parser(target: BenchTarget) -> argparse.ArgumentParser:
    """``hf-mixers bench NAME``'s own parser: the flags every target has, then the target's."""
    parser = argparse.ArgumentParser(prog=f"hf-mixers bench {target.name}", description=target.help)
    parser.add_argument("--out", default="outputs/bench", help="output folder (default: outputs/bench)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier bench_<target>.json in --out")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats per point (default 3)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    target.add_arguments(parser)
    return parser


def shape_flags(parser: argparse.ArgumentParser) -> None:
    """The width and heads of the benchmarked layers (default: SmolLM2-135M's)."""
    parser.add_argument("--hidden-size", type=at_least(1), default=576, help="model width (default 576)")
    parser.add_argument("--heads", type=at_least(1), default=9, help="attention heads (default 9)")
    parser.add_argument("--kv-heads", type=at_least(1), default=3, help="key/value heads (default 3)")


def lengths_flag(parser: argparse.ArgumentParser, default: list[int]) -> None:
    parser.add_argument("--lengths", type=positive_list, default=default,
                        help=f"training sequence lengths (default {','.join(map(str, default))})")


def decoding_flags(parser: argparse.ArgumentParser, batch: bool = False) -> None:
    """The decoding half: contexts, layers and steps of the decoding models (and rows decoded together)."""
    parser.add_argument("--contexts", type=positive_list, default=[1024, 4096, 16384],
                        help="decoding contexts (default 1024,4096,16384)")
    parser.add_argument("--decode-layers", type=at_least(1), default=2, help="layers of the decoding models (2)")
    parser.add_argument("--decode-tokens", type=at_least(1), default=64, help="decode steps timed per context (64)")
    if batch:
        parser.add_argument("--decode-batch", type=at_least(1), default=1, help="rows decoded together (default 1)")
