"""``hf-mixers reproduce CLAIM``: the papers' claims re-measured on this toolkit's mixers, one command each.

A claim is a function ``run(scale) -> dict`` registered in ``CLAIMS`` with the paper's statement. Its result says what
the paper reports, what we measure (with the scale, when it is reduced for a CPU), and whether the claim holds
(``holds``: True, False, or None where only an ordering is compared and it is partial). ``reproduce`` writes
``OUT/<claim>.json`` and ``.md`` (and a PNG when the claim plots). docs/reproductions.md collects the results.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from dataclasses import dataclass
from typing import Callable

from ...common.files import write_atomically


@dataclass(frozen=True)
class Claim:
    name: str
    paper: str  # which paper, and where in it
    statement: str  # the claim, in a sentence
    run: Callable[..., dict]  # run(out_dir, scale) -> result


CLAIMS: dict[str, Claim] = {}
SCALES = ("cpu", "paper", "smoke")


def claim(name: str, paper: str, statement: str):
    """Register ``run`` as claim ``name``."""
    def register(run):
        CLAIMS[name] = Claim(name, paper, statement, run)
        return run
    return register


def reproduce(name: str, out_dir: str, scale: str = "cpu") -> dict:
    """Run claim ``name`` (or "all") at ``scale``: "cpu" (reduced, minutes on 2 cores), "paper" (the paper's sizes)
    or "smoke" (the same code in seconds: a trained claim's verdict means nothing there)."""
    if scale not in SCALES:
        raise ValueError(f"reproduce: scale must be one of {SCALES}, got {scale!r}")
    _load_claims()
    names = sorted(CLAIMS) if name == "all" else [name]
    unknown = [n for n in names if n not in CLAIMS]
    if unknown:
        raise ValueError(f"reproduce: unknown claim {unknown[0]!r}; the claims are {', '.join(sorted(CLAIMS))}")
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for n in names:
        entry = CLAIMS[n]
        result = {"claim": n, "paper": entry.paper, "statement": entry.statement, "scale": scale,
                  **entry.run(out_dir, scale)}
        write_atomically(os.path.join(out_dir, f"{n}.json"), json.dumps(result, indent=2) + "\n")
        write_atomically(os.path.join(out_dir, f"{n}.md"), to_markdown(result))
        results[n] = result
    return results


def list_claims() -> list[Claim]:
    _load_claims()
    return [CLAIMS[n] for n in sorted(CLAIMS)]


def to_markdown(result: dict) -> str:
    verdict = {True: "holds", False: "does not hold", None: "partly"}[result["holds"]]
    lines = [f"# {result['claim']}: {verdict}", "", f"- paper: {result['paper']}", f"- claim: {result['statement']}",
             f"- paper's figure: {result['paper_value']}", f"- ours: {result['ours']}", f"- scale: {result['scale']}",
             ""]
    if result.get("table"):
        header = list(dict.fromkeys(key for row in result["table"] for key in row))  # rows may lack a column
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_cell(row.get(h, "")) for h in header) + " |" for row in result["table"]]
    if result.get("notes"):
        lines += ["", *[f"- {note}" for note in result["notes"]]]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _load_claims() -> None:
    """Import every module of this package once: each registers its claims with ``claim`` above, so a mixer's claims
    are one new file here."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
