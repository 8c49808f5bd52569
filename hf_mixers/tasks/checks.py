"""What every task generator shares: the ignored-target value and the argument checks (one message format)."""

from __future__ import annotations

from numbers import Integral, Real

IGNORE = -100  # targets where nothing is scored (torch's cross-entropy default ignore_index)


def check_int(name: str, value, least: int, caller: str, why: str = "") -> None:
    """``value`` must be an integer >= ``least``; else a ValueError naming the caller and the argument."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{caller}: {name} must be an integer >= {least}{reason}, got {value!r}")


def check_probability(name: str, value, caller: str) -> None:
    """``value`` must be a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 1:
        raise ValueError(f"{caller}: {name} must be a probability in [0, 1], got {value!r}")
