"""A block's CPU token step exported once and compiled ahead of time (AOTInductor), called without dynamo.

torch.compile's step (decode/engine.py) runs through dynamo on every call: frame evaluation, a check of ~370 guards (the
block's modules, its config, every tensor's shape), AOTAutograd's runtime wrappers, then Inductor's graph. On a CPU that
path costs a large share of a block call beside its graph (docs/benchmarks.md). Here the step is exported
(``torch.export``, the block's parameters, buffers and the step's inputs all arguments, so one library serves every
block of a model), compiled by AOTInductor into a shared library and called through its C++ runner.

What dynamo's guards checked is checked here by a memo per block (``_Memo``), cheaply: the inputs' skeleton (the state's
structure, the batch, the dtype), the global switches a trace reads (autograd and autocast off, the default dtype, no
global hooks), the config's contents, and copies of every module's attribute, parameter, buffer, child and hook dicts.
The library checks its inputs' dtypes, shapes and strides itself, in C++ (``AOTI_RUNTIME_CHECK_INPUTS``, set for a
library's first call unless a user has set it, and never left in the environment). A call that differs is described
again (``_describe``: the modules' classes and public attributes, ``layer_idx`` aside, the tensors' layouts) and served
by the library of what it now is, exported and built if new; one that no library can serve (autograd on, autocast, a
hook, a config changing on every call, an export that failed) falls back to torch.compile (``run_exported_step`` returns
None).

A library takes seconds to build (docs/benchmarks.md); it is kept on disk ($HF_MIXERS_CACHE/compiled-steps, keyed by the
exported program's code, its inputs' layouts, torch's version and the CPU's instruction set), so a later process only
exports the step and loads it. A library is checked against the eager step on its first inputs when built, and on each
further block it serves at that block's first call.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import operator
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers import PretrainedConfig

from ..core.cache import map_tensors, tensors_of

logger = logging.getLogger(__name__)

UNREAD_ATTRIBUTES = frozenset({"layer_idx", "training"})  # layer_idx: no step reads it; training: kept apart
MAX_CONFIGS = 8  # libraries for one key under distinct configs before the key falls back to torch.compile
CACHE_NAME = "compiled-steps"
# Each library checks its inputs' dtypes, shapes, strides and devices itself, in C++, when this is set (read once
# per library, at its first call: ``_first_call`` sets it there); where a user turned it off, ``_memo_holds``
# compares them in Python instead.
INPUT_CHECKS = "AOTI_RUNTIME_CHECK_INPUTS"
LIBRARY_CHECKS_INPUTS = os.environ.get(INPUT_CHECKS, "1") != "0"
# what this process did: libraries exported, built (compiled), loaded; blocks described (a memo's slow path)
counts = {"exported": 0, "built": 0, "loaded": 0, "described": 0}


@dataclass
class ExportedStep:
    """One compiled library of ``function(block, hidden_states, position_embeddings, inputs)`` and what it needs to
    be called: the config it was traced with (``config_snapshot``) and the structure of its outputs."""
    runner: object  # torch._C._aoti.AOTIModelPackageLoader: ``boxed_run(list of tensors) -> list of tensors``
    config_snapshot: dict
    state_template: object  # the new state of the first call: its structure, its tensors replaced per call


_steps: dict = {}  # the key ``_remember`` builds -> list of ExportedStep (one per config contents)
_fallbacks: set = set()  # keys that run through torch.compile (their export failed, or too many configs)


def cache_folder() -> str:
    """$HF_MIXERS_CACHE/compiled-steps (default ~/.cache/hf-mixers/compiled-steps). The model package is shipped as
    remote code without hf_mixers' other folders, hence not common/files.py's helper."""
    root = os.environ.get("HF_MIXERS_CACHE") or os.path.join("~", ".cache", "hf-mixers")
    return os.path.join(os.path.expanduser(root), CACHE_NAME)


# each module's attributes, parameters, buffers, children and hooks: one C call a module (operator.attrgetter)
_MODULE_PARTS = operator.attrgetter("__dict__", "_parameters", "_buffers", "_modules", "_forward_hooks",
                                    "_forward_pre_hooks")


def _live(modules) -> list:
    """What a call compares with a block's memo (``_Memo.witness``, copies of the same dicts): each module's
    ``_MODULE_PARTS`` (dict comparison: the same objects compare equal without looking inside them)."""
    return list(map(_MODULE_PARTS, modules))


def _hashable(value):
    """An attribute's value as part of a key: a config as a marker (its contents are compared apart:
    ``_config_matches``), an unhashable value (a list) by its repr."""
    if isinstance(value, PretrainedConfig):
        return PretrainedConfig
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _describe(block: nn.Module):
    """(every module of ``block``, each with its class and public attributes, the names and tensors of the
    parameters and buffers in one fixed order, whether a module inside the block has a forward hook: the library
    would skip it. The block's own hooks run around its forward, whatever serves the step.)"""
    modules, described, names, tensors, hooked = [], [], [], [], False
    for prefix, module in block.named_modules():
        hooked = hooked or (module is not block and bool(module._forward_hooks or module._forward_pre_hooks))
        modules.append(module)
        attributes = tuple((name, _hashable(value)) for name, value in module.__dict__.items()
                           if name[0] != "_" and name not in UNREAD_ATTRIBUTES)
        described.append((type(module), module.training, attributes))
        for kind in (module._parameters, module._buffers):
            for name, tensor in kind.items():
                if tensor is not None:
                    names.append(f"{prefix}.{name}" if prefix else name)
                    tensors.append(tensor)
    return modules, tuple(described), names, tensors, hooked


def _layout(tensors) -> tuple:
    return tuple((tensor.shape, tensor.stride(), tensor.dtype, tensor.device) for tensor in tensors)


def _flatten(value, found: list):
    """Append ``value``'s tensors to ``found`` (``map_tensors``' order) and return its skeleton: a hashable picture
    of the rest (the types, None, the other values), so that inputs of one skeleton and one tensor layout trace
    the same program."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return "T"
    if isinstance(value, (tuple, list)):
        return (type(value), *(_flatten(item, found) for item in value))
    if value is None or not hasattr(value, "map"):
        return value if value is None or isinstance(value, (bool, int, float, str)) else (type(value), id(value))
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is None:  # an object with ``map`` of another kind: its own tensors, and only itself matches
        found.extend(tensors_of(value))
        return type(value), id(value)
    return (type(value), *(_flatten(getattr(value, name), found) for name in fields))


def _global_hooks() -> bool:
    """Whether a global module hook is registered. torch keeps them in private dicts of torch.nn.modules.module, with
    no public reader; a torch without those dicts counts as having a hook (the call then goes to torch.compile, which
    sees every hook), so a library never runs past one it cannot see."""
    try:
        return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
    except AttributeError:
        return True


def _switches() -> tuple:
    """The global state a trace reads: autograd, autocast, the default dtype, global module hooks."""
    return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_default_dtype(), _global_hooks()


def _config_of(block):
    return getattr(block.mixer, "config", None)


def _label(block, step_inputs) -> str:
    """How logs name a step (made only when one is written, off the hot path)."""
    return f"{type(block.mixer).__name__} block's (batch {step_inputs[0].shape[0]})"


def _config_matches(snapshot: dict, config) -> bool:
    return config is not None and config.__dict__ == snapshot


class _BlockCall(nn.Module):
    """``function(block, ...)`` as a module's forward, for ``torch.func.functional_call``."""

    def __init__(self, function, block):
        super().__init__()
        self.block = block
        self.__dict__["function"] = function

    def forward(self, hidden_states, position_embeddings, inputs):
        return self.function(self.block, hidden_states, position_embeddings, inputs)


class _FlatStep(nn.Module):
    """``function`` of one block with every tensor an argument: the block's parameters and buffers (``names``), then
    the step inputs' tensors in ``tensors_of`` order; returns the output then the new state's tensors. The block is
    not a submodule: its tensors are this program's arguments, not constants baked into the library."""

    def __init__(self, function, block, names, step_inputs):
        super().__init__()
        self.__dict__.update(call=_BlockCall(function, block), names=[f"block.{name}" for name in names],
                             template=step_inputs)

    def forward(self, *flat):
        tensors = dict(zip(self.names, flat))
        rest = iter(flat[len(self.names):])
        step_inputs = map_tensors(self.template, lambda tensor: next(rest))
        output, state = torch.func.functional_call(self.call, tensors, step_inputs)
        return (output, *tensors_of(state))


def _package_key(program, flat, options: dict) -> str:
    """The on-disk name of a library: the exported program's code (constants included), its inputs' layouts,
    Inductor's options, torch's version and the instruction set the kernels are compiled for."""
    from torch._inductor import cpu_vec_isa

    digest = hashlib.sha256()
    code = program.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    for part in (torch.__version__, str(cpu_vec_isa.pick_vec_isa()), code, repr(_layout(flat)), repr(options)):
        digest.update(part.encode())
    for name, constant in sorted(program.constants.items()):
        digest.update(name.encode())
        if isinstance(constant, torch.Tensor):
            digest.update(constant.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _build(function, block, names, flat, step_inputs, options: dict):
    """Export ``function`` on these inputs, then load its library from the disk cache or compile and keep it (written
    whole or not at all, with the umask's mode, as common/files.py writes: this package ships as remote code without
    common/)."""
    started, label = time.perf_counter(), _label(block, step_inputs)
    with warnings.catch_warnings():  # torch.export's own pytree deprecation notice, nothing of the user's
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(_FlatStep(function, block, names, step_inputs), tuple(flat), strict=False)
    counts["exported"] += 1
    path = os.path.join(cache_folder(), f"{_package_key(program, flat, options)}.pt2")
    runner = _load_kept(path) if os.path.exists(path) else None
    if runner is None:
        logger.warning("compiling the %s token step with AOTInductor (15-25 s on 2 cores; kept in %s for later "
                       "processes)", label, cache_folder())
        os.makedirs(cache_folder(), exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".partial-{os.getpid()}-", suffix=".pt2", dir=cache_folder())
        os.close(handle)
        try:
            with warnings.catch_warnings():  # torch's own pytree deprecation notice again
                warnings.simplefilter("ignore", FutureWarning)
                torch._inductor.aoti_compile_and_package(program, package_path=staging, inductor_configs=options)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staging, 0o666 & ~umask)  # a new file's usual mode (mkstemp's is 0600): a team's cache
            os.replace(staging, path)  # whole or absent: a concurrent process compiles its own copy
        finally:
            if os.path.exists(staging):
                os.remove(staging)
        counts["built"] += 1
        runner = torch._inductor.aoti_load_package(path).loader
    counts["loaded"] += 1
    logger.info("%s token step ready in %.1f s (%s)", label, time.perf_counter() - started, path)
    return runner


def _load_kept(path: str):
    """The library kept at ``path``, or None once a broken entry (truncated, overwritten) is named and removed, so
    that it is built again instead of failing every later process."""
    try:
        return torch._inductor.aoti_load_package(path).loader
    except Exception as error:  # noqa: BLE001 - whatever a damaged archive raises, the entry is rebuilt
        logger.warning("the compiled-steps cache entry %s cannot be loaded (%s: %s): removed, building it again",
                       path, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        try:
            os.remove(path)
        except FileNotFoundError:  # another process removed it first
            pass
        return None


# fp64 at fp32's: the Llama RMSNorm around a mixer computes in fp32 whatever the model's dtype
CHECK_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@contextlib.contextmanager
def _first_call():
    """Around a library's first call: its input checks on (``INPUT_CHECKS``, which it reads then), unless the user
    chose; the environment is left as it was."""
    if INPUT_CHECKS in os.environ:
        yield
        return
    os.environ[INPUT_CHECKS] = "1"
    try:
        yield
    finally:
        os.environ.pop(INPUT_CHECKS, None)


def _check(runner, flat, reference) -> None:
    """The library's outputs on its first inputs against the eager step's (``reference``, flat): each within
    ``CHECK_TOLERANCE`` of it in norm, relative (the graph sums in another order), integers and flags equal. What
    it catches is a wrong program (another block's weights, a misread state), not rounding."""
    with _first_call():
        outputs = runner.boxed_run(list(flat))
    if len(outputs) != len(reference):
        raise RuntimeError(f"the library returned {len(outputs)} tensors, the eager step {len(reference)}")
    for index, (got, want) in enumerate(zip(outputs, reference)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise RuntimeError(f"output {index}: {tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} "
                               f"{want.dtype}")
        if want.is_floating_point():
            error = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)
            if not error <= CHECK_TOLERANCE.get(want.dtype, 1e-2):
                raise RuntimeError(f"output {index} differs from the eager step by {error.item():.3g} in norm")
        elif not torch.equal(got, want):
            raise RuntimeError(f"output {index} differs from the eager step")


@dataclass
class _Memo:
    """What a block's last call was served by (a library, or None: torch.compile), and what it saw (``_live``
    copies, the inputs' skeleton, the switches): a call that sees the same is served the same way without
    describing the block again."""
    step: ExportedStep | None
    modules: list
    witness: list
    tensors: list  # the block's parameters and buffers: the library's first arguments
    skeleton: object
    switches: tuple
    layout: tuple  # every argument's (shape, strides, dtype, device): compared here only without LIBRARY_CHECKS_INPUTS
    config_snapshot: dict


_memos = weakref.WeakKeyDictionary()  # block -> _Memo


def _memo_holds(memo: _Memo, skeleton, switches, config, step_tensors) -> bool:
    if skeleton != memo.skeleton or switches != memo.switches or not _config_matches(memo.config_snapshot, config):
        return False
    if not LIBRARY_CHECKS_INPUTS and _layout([*memo.tensors, *step_tensors]) != memo.layout:
        return False
    try:
        return _live(memo.modules) == memo.witness
    except RuntimeError:  # a tensor attribute replaced by another: comparing them asked a tensor for its truth
        return False


def run_exported_step(function, block, hidden_states, position_embeddings, inputs, inductor_options):
    """``function(block, hidden_states, position_embeddings, inputs)`` (-> output, new state) through its compiled
    library, built on first use; None where no library can serve this call (the caller runs torch.compile's).
    ``inductor_options()``: AOTInductor's options, asked for only when a library is built."""
    config = _config_of(block)
    switches = _switches()
    if config is None or switches[0] or switches[1] or switches[3]:  # autograd, autocast, global hooks: the
        return None  # library's outputs would carry no autograd graph, its products no autocast, no hook would run
    step_inputs, step_tensors = (hidden_states, position_embeddings, inputs), []
    # the skeleton, and the batch and dtype, which change between generations (a library would reject them, and
    # say so on stderr, at the cost of a failed call)
    skeleton = (_flatten(step_inputs, step_tensors), hidden_states.shape, hidden_states.dtype)
    memo = _memos.get(block)
    if memo is None or not _memo_holds(memo, skeleton, switches, config, step_tensors):
        memo = _remember(function, block, step_inputs, step_tensors, skeleton, switches, inductor_options)
    if memo.step is None:
        return None
    try:
        outputs = memo.step.runner.boxed_run([*memo.tensors, *step_tensors])
    except RuntimeError:  # the library's own input check (a tensor's dtype, shape or strides changed): describe
        memo = _remember(function, block, step_inputs, step_tensors, skeleton, switches,
                         inductor_options)  # the block again: a library for the new layout
        if memo.step is None:
            return None
        outputs = memo.step.runner.boxed_run([*memo.tensors, *step_tensors])
    outputs = iter(outputs)
    output = next(outputs)
    return output, map_tensors(memo.step.state_template, lambda tensor: next(outputs))


def _remember(function, block, step_inputs, step_tensors, skeleton, switches, inductor_options):
    """The slow path of ``run_exported_step``: describe the block, find or build the library for what this call sees
    (none for a hooked block or a key that fell back), and keep the answer as the block's memo."""
    counts["described"] += 1
    modules, structure, names, tensors, hooked = _describe(block)
    config = _config_of(block)
    step = None
    key = (structure, _layout(tensors), _layout(step_tensors), skeleton, switches)
    if not hooked and key not in _fallbacks:
        entries = _steps.setdefault(key, [])
        step = next((entry for entry in entries if _config_matches(entry.config_snapshot, config)), None)
        if step is None:
            step = _new_step(function, block, names, tensors, step_tensors, step_inputs, key, inductor_options)
        elif not _serves(step, function, block, step_inputs, tensors, step_tensors):
            step = None  # this block runs through torch.compile; the library still serves the blocks it matched
    snapshot = step.config_snapshot if step is not None else copy.deepcopy(config.__dict__)
    memo = _Memo(step, modules, [tuple(map(dict, parts)) for parts in _live(modules)], tensors, skeleton, switches,
                 _layout([*tensors, *step_tensors]), snapshot)
    _memos[block] = memo
    return memo


def _matches_eager(runner, function, block, step_inputs, tensors, step_tensors):
    """Run the eager step on these inputs and ``_check`` the library against it -> the eager new state (its
    structure is what the library's outputs are rebuilt into); RuntimeError where they differ. Both run on copies
    of the step's inputs (the block's ``tensors`` are only read): a step may write its state in place (the window's
    ring), and the call itself runs the library on the originals afterwards."""
    output, state = function(block, *map_tensors(step_inputs, torch.clone))
    _check(runner, [*tensors, *(tensor.clone() for tensor in step_tensors)], [output, *tensors_of(state)])
    return state


def _serves(step, function, block, step_inputs, tensors, step_tensors) -> bool:
    """Whether a library built on another block (or before a change the key does not see) equals this block's eager
    step on this call's inputs: checked once per block and memo, so that what the key leaves out (``layer_idx``,
    which no step should read, and what a trace reads beyond the modules' public attributes) cannot serve a block
    another one's program."""
    try:
        _matches_eager(step.runner, function, block, step_inputs, tensors, step_tensors)
    except RuntimeError as error:
        logger.warning("the %s token step's library, built on another block, differs from this block's eager step "
                       "(%s); this block runs through torch.compile", _label(block, step_inputs), error)
        return False
    return True


def _new_step(function, block, names, tensors, step_tensors, step_inputs, key, inductor_options):
    entries, label = _steps[key], _label(block, step_inputs)
    snapshot = copy.deepcopy(_config_of(block).__dict__)
    if len(entries) >= MAX_CONFIGS or not _config_matches(snapshot, _config_of(block)):
        logger.warning("the %s token step's config changes from call to call (or cannot be compared): it runs "
                       "through torch.compile from here on", label)
        _fallbacks.add(key)
        return None
    try:
        runner = _build(function, block, names, [*tensors, *step_tensors], step_inputs, inductor_options())
        state = _matches_eager(runner, function, block, step_inputs, tensors, step_tensors)
    except Exception as error:  # noqa: BLE001 - any failure to export or build falls back, said once
        logger.warning("the %s token step could not be compiled ahead of time (%s: %s); it runs through "
                       "torch.compile", label, type(error).__name__, error)
        _fallbacks.add(key)
        return None
    step = ExportedStep(runner, snapshot, state)
    entries.append(step)
    return step


def reset() -> None:
    """Forget every loaded library and fallback (the libraries on disk stay)."""
    _steps.clear()
    _fallbacks.clear()
    _memos.clear()
    for name in counts:
        counts[name] = 0
