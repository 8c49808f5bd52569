"""argparse types shared by the command line and the benchmarks' own flags: each names what it expected, and
argparse turns the error into one line naming the flag (exit 2). Nothing heavy is imported here."""

from __future__ import annotations

import argparse
import json


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def at_least(least: int):
    """An integer >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    parse.__name__ = f"integer >= {least}"
    return parse


def positive_number(text: str) -> float:
    """A number > 0 (e.g. a memory budget in GiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


positive_number.__name__ = "number > 0"


def positive_list(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def non_negative_list(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """Comma-separated names, at least one."""
    names = [part for part in text.split(",") if part]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def keep_attention(text: str):
    """``--keep-attention``: a list of layers, or auto:K / kl:K."""
    return text if text.startswith(("auto:", "kl:")) else int_list(text)


def key_value(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE parsed as JSON when it is JSON (numbers, true/false, null), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def option_dict(pairs) -> dict:
    """The repeated ``--option KEY=VALUE`` flags as a dict; a key given twice is an error, not the last one silently."""
    options = {}
    for key, value in pairs:
        if key in options:
            raise ValueError(f"--option {key} is given twice ({options[key]!r} and {value!r})")
        options[key] = value
    return options
