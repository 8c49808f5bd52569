"""When a token runs through the compiled step: the switch's values, the environment's veto, and the checks the model
makes per layer before it asks the engine (decode/engine.py).

A mixer has a compiled token step when its class declares one (``SequenceMixer.token_step``, a ``TokenStep``); its
cache grows with the context (the step then has symbolic shapes) unless the mixer's state is constant
(``constant_state``, the same fact a serving engine reads).
"""

from __future__ import annotations

import os

from ..kernels.conventions import COMPILE_CHOICES, COMPILE_MODES
# ``HF_MIXERS_COMPILE_DECODE=0``: every token step eager, whatever ``config.compile_decode`` says
COMPILE_DECODE_ENV = "HF_MIXERS_COMPILE_DECODE"


def decode_compile_forbidden() -> bool:
    """Whether the environment makes every token step eager (``HF_MIXERS_COMPILE_DECODE=0``)."""
    return os.environ.get(COMPILE_DECODE_ENV) == "0"


def check_compile_decode(value, command: str) -> None:
    """A command's ``--compile-decode`` (False, True or a ``COMPILE_MODES`` name), or a ValueError naming it."""
    if value not in COMPILE_CHOICES:
        raise ValueError(f"{command}: --compile-decode takes a torch.compile mode {COMPILE_MODES} or nothing, got "
                         f"{value!r}")


def compile_mode(config) -> str | None:
    """The torch.compile mode of the compiled token step under ``config``, or None for an eager one.

    ``config.compile_decode``: True is "default", a mode itself; "auto" is eager here (``generate`` sets a mode for the
    calls it compiles, model/modeling.py); ``rsa_compile_decode = True``, the switch's older RSA-only name, asks for
    "default" too. ``HF_MIXERS_COMPILE_DECODE=0`` is eager always."""
    if decode_compile_forbidden():
        return None
    mode = config.compile_decode
    if mode == "auto" or not mode:
        mode = getattr(config, "rsa_compile_decode", False)
    return "default" if mode is True else mode or None


def has_token_step(mixer) -> bool:
    """Whether ``mixer``'s class declares a one-token step the block can compile."""
    return getattr(type(mixer), "token_step", None) is not None


def grows(mixer) -> bool:
    """Whether ``mixer``'s token step reads a cache that grows with the context (compiled with symbolic shapes)."""
    return not type(mixer).constant_state(mixer.config)


def compiles(mixer, hidden_states, past_key_values) -> bool:
    """Whether this call of ``mixer``'s layer runs as its block's compiled token step: a mixer that has one, a compile
    mode, one token, and a cache that already holds what the step reads (a prompt's prefill runs eagerly)."""
    step = type(mixer).token_step
    return (step is not None and hidden_states.shape[1] == 1 and past_key_values is not None
            and compile_mode(mixer.config) is not None and step.ready(mixer, past_key_values.layers[mixer.layer_idx]))
