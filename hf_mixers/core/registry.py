"""The mixer registry: one ``MixerSpec`` per sequence mixer, and everything else derived from it.

A mixer module declares its spec once (layer-type name, class, config options, cache layer, conversion defaults,
card text) and ends with ``register_mixer(SPEC)``. The config's fields and validation, the ``<Title>Config`` /
``<Title>Model`` / ``<Title>ForCausalLM`` classes and their Auto registration, the cache layers, the CLI choices,
the converter's tables, the card text and the contract test suite are all read from ``list_mixers()``.

Names are checked when a mixer registers, not when it is first used: a layer-type name must not be one of
transformers' own layer kinds or model types (registering ``mamba`` would silently replace transformers' class).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# transformers' layer kinds (configuration_utils.ALLOWED_LAYER_TYPES) and old names it renames; only the teacher's own
# attention kinds may use them (the built-in "full_attention" / "sliding_attention" mixers).
RESERVED_NAMES = {"mamba", "mamba2", "attention", "linear_attention", "conv", "hybrid", "moe", "mlp", "dense", "sparse",
                  "dummy", "hf_mixer"}  # hf_mixer: the model type of MixerConfig itself
TEACHER_ATTENTION = ("full_attention", "sliding_attention")


def positive_int(value) -> str | None:
    """An option check: None when ``value`` is a positive integer, else what is wrong."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "must be a positive integer"


def non_negative_int(value) -> str | None:
    """An option check: None when ``value`` is an integer >= 0 (0 often meaning "off")."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "must be an integer >= 0"


def one_of(*choices) -> Callable[[Any], str | None]:
    """An option check: the value must be one of ``choices``."""
    return lambda value: None if value in choices else f"must be one of {choices}"


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def number(value) -> str | None:
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "must be a number"


def open_unit_interval(value) -> str | None:
    """A number strictly between 0 and 1 (a probability that may not be 0 or 1, a tolerance)."""
    return number(value) or (None if 0.0 < value < 1.0 else "must lie in (0, 1)")


def non_negative_number(value) -> str | None:
    return number(value) or (None if value >= 0 else "must be >= 0")


def positive_number(value) -> str | None:
    return number(value) or (None if value > 0 else "must be > 0")


@dataclass(frozen=True)
class MixerOption:
    """One config field of a mixer: its name (prefixed by the mixer's name), default, documentation and check.

    ``check(value)`` returns None or what is wrong ("must be a positive integer"); the config names the field. A
    default of None means "derived from other fields" by the spec's ``derived_defaults``, before the checks.
    ``at_most``: the config field that bounds a size option (a window is at most ``max_position_embeddings``
    tokens); the config refuses a larger value, naming both.
    """

    name: str
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None
    at_most: str | None = None


@dataclass(frozen=True)
class MixerSpec:
    """Everything about one sequence mixer. See docs/adding-a-mixer.md for a walk-through.

    name: the ``config.layer_types`` entry and the ``model_type`` of the mixer's own config class.
    mixer_class: a ``SequenceMixer`` subclass: ``mixer_class(config, layer_idx)``, uniform forward.
    title: the class-name prefix (``Sessa`` -> ``SessaConfig``, ``SessaForCausalLM``) and the card's name.
    summary: one line for model cards and ``--help``.
    paper: the paper the mixer implements, by title and arXiv id ("" for the teacher's attention).
    options: the mixer's config fields.
    derived_defaults(config) -> dict: values for the options left None, computed from the other fields.
    validate(config) -> str | None: what is wrong with a combination the per-option checks cannot see alone (the
        config prefixes its class name); runs after the option checks.
    cache_layer: the transformers cache-layer class of one layer of this mixer (its ``_layer_type`` is ``name``),
        or None for a plain K/V layer (the teacher's attention).
    attention_mask: the backend mask the mixer reads ("causal", "sliding") or None: built once per forward, only
        for mixers that attend over the past, since building it costs O(context) per decode step.
    keep_in_fp32: parameter names kept in fp32 when a model loads in bf16/fp16.
    conversion_options: config values ``convert`` uses unless the user sets them (the conversion defaults).
    exact_at_init: ``from_attention`` reproduces the teacher layer exactly (checked by the contract suite).
    constant_state: the decode state does not grow with the context.
    limitations: sentences the model card says about a model with this mixer.
    sliding_note: what the conversion report adds when the mixer replaces a sliding-window teacher layer.
    tiny_options: option values for the contract suite's tiny models (small, so every check runs in seconds).
    tiny_variants: further option sets the contract suite also checks, by name (``{"window": {"rsa_window": 3}}``
        is checked as ``"rsa[window]"``): the mixer's optional branches get the same contract.
    lag_theory(mixer, inputs, position_embeddings) -> dict | None: the law the mixer's theory predicts for the lag
        sensitivity ||dy_t/dx_{t-l}|| on ``inputs`` (1, T, D), for ``hf-mixers diagnose``: {"law": "power",
        "exponent": p} or {"law": "exponential", "rate": r}, with "source" (where its parameter came from).
    """

    name: str
    mixer_class: type
    title: str
    summary: str
    paper: str = ""
    options: tuple[MixerOption, ...] = ()
    derived_defaults: Callable[[Any], dict] | None = None
    validate: Callable[[Any], str | None] | None = None
    cache_layer: type | None = None
    attention_mask: str | None = None
    keep_in_fp32: tuple[str, ...] = ()
    conversion_options: dict = field(default_factory=dict)
    exact_at_init: bool = False
    limitations: tuple[str, ...] = ()
    sliding_note: str = ""
    tiny_options: dict = field(default_factory=dict)
    tiny_variants: dict = field(default_factory=dict)
    lag_theory: Callable[..., dict | None] | None = None

    def option_name(self, key: str) -> str:
        """The option ``key`` names: itself, or ``<mixer>_<key>`` for the short form (``window`` -> ``rsa_window``);
        anything else comes back unchanged (the config then names it as unknown)."""
        names = {option.name for option in self.options}
        return f"{self.name}_{key}" if key not in names and f"{self.name}_{key}" in names else key

    def checked_options(self, options: dict, where: str) -> dict:
        """``options`` under their full names (``window`` -> ``rsa_window``: one naming rule for convert, the
        recipes, compare and diagnose), each value passed by its option's check. An unknown name, a name given
        twice (short and full) or a refused value is a ValueError that ``where`` (e.g. "model.mixer_options")
        starts, naming the option; nothing is built, so it can run before any work."""
        known = {option.name: option for option in self.options}
        checked = {}
        for key, value in options.items():
            name = self.option_name(key)
            if name not in known:
                raise ValueError(f"{where}: unknown {self.name} option {key!r}; the {self.name} options are: "
                                 f"{', '.join(sorted(known)) or 'none'}")
            if name in checked:
                raise ValueError(f"{where}: {name} is given twice")
            problem = known[name].check(value) if known[name].check is not None and value is not None else None
            if problem:
                raise ValueError(f"{where}: {name} {problem}, got {value!r}")
            checked[name] = value
        return checked

    @property
    def is_teacher_attention(self) -> bool:
        return self.name in TEACHER_ATTENTION


_MIXERS: dict[str, MixerSpec] = {}
# (what to derive from a newly registered spec, how to forget it again or None)
_LISTENERS: list[tuple[Callable[[MixerSpec], None], Callable[[MixerSpec], None] | None]] = []


def _check(spec: MixerSpec) -> None:
    from transformers.configuration_utils import ALLOWED_LAYER_TYPES
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from .mixer import SequenceMixer

    def fail(message):
        raise ValueError(f"register_mixer({spec.name!r}): {message}")

    if not isinstance(spec.name, str) or not NAME.match(spec.name):
        fail("the name must match [a-z][a-z0-9_]* (it is a config layer type and a model type)")
    if not spec.is_teacher_attention and (spec.name in RESERVED_NAMES or spec.name in ALLOWED_LAYER_TYPES):
        fail("the name is reserved: one of transformers' own layer kinds (or MixerConfig's model type); "
             "choose another")
    if spec.name in CONFIG_MAPPING_NAMES:
        fail(f"the name is transformers' model type of {CONFIG_MAPPING_NAMES[spec.name]}; choose another")
    if not (isinstance(spec.mixer_class, type) and issubclass(spec.mixer_class, SequenceMixer)):
        fail(f"mixer_class must subclass hf_mixers.SequenceMixer, got {spec.mixer_class!r}")
    if not spec.title.isidentifier():
        fail(f"title {spec.title!r} must be a Python identifier (it prefixes the class names)")
    for option in spec.options:
        if not option.name.startswith(f"{spec.name}_"):
            fail(f"option {option.name!r} must start with '{spec.name}_' (options of all mixers share one config)")
    names = {option.name for option in spec.options}
    for other in _MIXERS.values():
        if other.title == spec.title:
            fail(f"title {spec.title!r} is already used by mixer {other.name!r}")
        clash = names & {option.name for option in other.options}
        if clash:
            fail(f"options {sorted(clash)} are already declared by mixer {other.name!r}")
    if spec.cache_layer is not None and getattr(spec.cache_layer, "_layer_type", None) != spec.name:
        fail(f"cache_layer {spec.cache_layer.__name__} must set _layer_type = {spec.name!r}")
    if spec.attention_mask not in (None, "causal", "sliding"):
        fail(f"attention_mask must be None, 'causal' or 'sliding', got {spec.attention_mask!r}")


def register_mixer(spec: MixerSpec) -> MixerSpec:
    """Make ``spec`` known: its layer type, config options, classes and Auto registration. Returns the spec.

    Registering the same spec object again is a no-op (a module imported twice); another spec under a known name
    is an error, as is a name transformers already uses.
    """
    known = _MIXERS.get(spec.name)
    if known is spec:
        return spec
    if known is not None:
        raise ValueError(f"register_mixer({spec.name!r}): a mixer of that name is already registered "
                         f"({known.mixer_class.__module__}.{known.mixer_class.__qualname__})")
    _check(spec)
    _MIXERS[spec.name] = spec
    done = []
    try:
        for listener, forget in list(_LISTENERS):
            listener(spec)
            done.append(forget)
    except BaseException:
        del _MIXERS[spec.name]  # a half-derived mixer is not registered: what was derived is forgotten again
        _forget(spec, done)
        raise
    return spec


def unregister_mixer(name: str) -> MixerSpec:
    """Forget a registered mixer and everything derived from it (its classes, its Auto registration). For tests that
    register a mixer of their own: the registration lasts for that test only. Returns the spec."""
    spec = get_mixer(name)
    if spec.is_teacher_attention:
        raise ValueError(f"unregister_mixer({name!r}): the teacher's attention kinds stay registered")
    del _MIXERS[name]
    _forget(spec, [forget for _, forget in _LISTENERS])
    return spec


def _forget(spec: MixerSpec, forgets: list) -> None:
    for forget in reversed(forgets):  # the reverse order of derivation: Auto classes before the classes they map
        if forget is not None:
            forget(spec)


def get_mixer(name: str) -> MixerSpec:
    try:
        return _MIXERS[name]
    except KeyError:
        raise KeyError(f"unknown mixer {name!r}; registered: {', '.join(_MIXERS)}") from None


def list_mixers(convertible: bool = False) -> list[MixerSpec]:
    """Every registered spec in registration order; ``convertible``: only the mixers that replace attention."""
    return [spec for spec in _MIXERS.values() if not (convertible and spec.is_teacher_attention)]


def on_register(listener: Callable[[MixerSpec], None], forget: Callable[[MixerSpec], None] | None = None) -> None:
    """Call ``listener(spec)`` for every spec registered so far and every one registered later; ``forget(spec)``
    undoes it when a mixer is unregistered."""
    _LISTENERS.append((listener, forget))
    for spec in list(_MIXERS.values()):
        listener(spec)



class PluginError(RuntimeError):
    """A mixer plugin that does not load; the message names it."""


PLUGIN_GROUP = "hf_mixers.mixers"  # entry points: a zero-argument function (or module) that registers mixers
PLUGIN_MODULES = "HF_MIXERS_PLUGINS"  # environment: comma-separated modules to import, e.g. "my_mixers.ema"
_plugins_loaded = False


def load_plugins() -> list[str]:
    """Import the mixers of other packages once per process: every ``hf_mixers.mixers`` entry point, then the modules
    named in $HF_MIXERS_PLUGINS. A plugin that fails to load raises, naming it. Returns what was loaded."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    loaded = []
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            target = entry.load()
            if callable(target):
                target()
        except (Exception, SystemExit) as error:  # a plugin's sys.exit() must not end the command silently
            raise PluginError(f"hf_mixers plugin {entry.name!r} ({entry.value}) failed to load: "
                              f"{_describe(error)}") from error
        loaded.append(entry.value)
    for name in filter(None, (part.strip() for part in os.environ.get(PLUGIN_MODULES, "").split(","))):
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as error:
            raise PluginError(f"{PLUGIN_MODULES}: module {name!r} failed to load: {_describe(error)}") from error
        loaded.append(name)
    return loaded


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}) while being imported"
    return str(error) or type(error).__name__
