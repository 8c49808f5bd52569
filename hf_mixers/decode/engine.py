"""The compiled one-token decode step: a block (or the whole stack) around its mixers' token steps, as one graph.

A mixer declares its step (``SequenceMixer.token_step``, a ``core.mixer.TokenStep``: what it reads from its cache,
the step, how the new state is stored); this module runs it with the block's own layers around it
(``block.around``) as one torch.compile graph, fullgraph, built on first use and kept per mixer classes, batch size
and mode. On a CPU a single block's fp32 step of fixed shapes runs as an AOTInductor library instead
(decode/exported.py). Where a step cannot be compiled here (no C++ compiler, a backend error) the token runs eagerly,
said once per process. decode/switch.py decides when a call takes this path.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch

from ..core.cache import map_tensors, tensors_of
from ..kernels.conventions import own_code
from .exported import run_exported_step
from .switch import COMPILE_DECODE_ENV, compile_mode, compiles, decode_compile_forbidden, grows, has_token_step

logger = logging.getLogger(__name__)



def block_step(block, hidden_states, position_embeddings, inputs):
    """A block around its mixer's one-token step, without cache objects: -> output, the mixer's new state.

    ``inputs`` are what the mixer's ``TokenStep.inputs`` read from its cache (for a recurrent mixer: the token's
    mask, the state and the short-conv history); ``TokenStep.step`` is the mixer's layer for one token on them."""
    new = {}

    def mix(x):
        out, new["state"] = type(block.mixer).token_step.step(block.mixer, x, position_embeddings, *inputs)
        return out

    return block.around(hidden_states, mix), new["state"]


def stack_step(blocks, hidden_states, position_embeddings, inputs):
    """Every block's ``block_step`` in turn (``inputs``: one tuple a block) -> output, the list of the new states."""
    states = []
    for block, block_inputs in zip(blocks, inputs):
        hidden_states, state = block_step(block, hidden_states, position_embeddings, block_inputs)
        states.append(state)
    return hidden_states, states


def _leaves(value) -> list:
    """The tensors of ``value`` (a state: tensors, tuples, dataclasses with ``map``) in a fixed order."""
    found = []
    map_tensors(value, lambda tensor: found.append(tensor) or tensor)
    return found


def _copied_out(value):
    """``value`` (a replay's output and states) with its tensors copied out of the CUDA graph's output memory, which
    the next replay overwrites: one batched copy (``torch._foreach_copy_``, what cudagraph trees copy inputs with)
    where a clone each was a launch each (about 360 a token for SmolLM2's stack of 30 windowed RSA blocks)."""
    sources = _leaves(value)
    copies = [torch.empty_like(tensor) for tensor in sources]
    torch._foreach_copy_(copies, sources)
    fresh = iter(copies)
    return map_tensors(value, lambda tensor: next(fresh))


def _signature(leaves: list) -> tuple:
    """The shapes and dtypes of a state's tensors (``_leaves``): two states of one signature can take each other's
    place."""
    return tuple((tuple(tensor.shape), tensor.dtype) for tensor in leaves)


def stack_step_in_place(blocks, hidden_states, position_embeddings, inputs, targets):
    """``stack_step``, each block's new state written into ``targets[i]`` (its mixer's ``TokenStep.replaced``: the
    tensors it replaces, of the same structure) in place -> the output alone. The writes come after every read."""
    hidden_states, states = stack_step(blocks, hidden_states, position_embeddings, inputs)
    for target, state in zip(targets, states):
        for old, new in zip(_leaves(target), _leaves(state)):
            old.copy_(new)
    return hidden_states


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that replay a CUDA graph on CUDA
# torch.compile's backend for the steps: Inductor. "aot_eager" (dynamo's capture and AOTAutograd's functionalisation,
# no code generation) where only the graph matters and Inductor's C++ compiles would dominate the time: the
# CPU dry run of scripts/gpu_check.py and the tests' variants (tests/conftest.py compile_decode_without_inductor)
COMPILE_BACKEND = "inductor"
# (device type, mixer classes, batch, mode, dynamic, backend[, "in place"]) -> (compiled step, replays a CUDA graph)
_compiled_steps = {}


# The CPU step's small matrix products (a memory's per-level assignments, reads and residual MLPs, the window's
# scores: at most this many rows, or this many batched matrices, and inner sizes up to SMALL_PRODUCT_WIDTH) are
# computed by Inductor as loops fused with the elementwise work around them instead of one BLAS call each
# (Inductor's own decompose_mm_pass, whose CPU default takes a single row only): a BLAS call's fixed cost, paid ~30
# times a windowed RSA block, outweighs such a product (docs/benchmarks.md).
# The teacher's projections (wider) stay BLAS calls.
SMALL_PRODUCT_ROWS = 16
SMALL_PRODUCT_WIDTH = 256


def small_products_fused() -> dict:
    """Inductor's options for a CPU step whose small products are fused loops (``SMALL_PRODUCT_ROWS``); {} where
    this torch's Inductor lacks the pass. Its size limits are module settings of the pass, read when it runs."""
    try:
        from torch._inductor.fx_passes import decompose_mem_bound_mm as decompose
    except ImportError:
        return {}
    if not hasattr(decompose, "cpu_max_first_dimension_decomposition"):
        return {}
    decompose.cpu_max_first_dimension_decomposition = SMALL_PRODUCT_ROWS
    decompose.cpu_max_other_dimension_decomposition = SMALL_PRODUCT_WIDTH
    return {"post_grad_fusion_options": {"decompose_mm_pass": {}}}


def compile_step(function, device: str, mode: str | None = None, dynamic: bool = False):
    """``function`` (``block_step``, ``stack_step`` or ``stack_step_in_place``) compiled for ``device`` -> (the
    step, whether it replays as a CUDA graph). ``mode``: torch.compile's (None or "default": the default, with a C++
    launcher on CPU; "reduce-overhead": replayed as a CUDA graph on CUDA). ``dynamic``: symbolic shapes (a mixer
    whose cache grows, ``switch.grows``), never replayed as a CUDA graph (it would record one per length).
    "reduce-overhead" off CUDA has no graph to replay: it is the default mode there (on CPU with the C++ launcher,
    faster than the Python one that mode would bring).

    Each call compiles its own copy of the function's code (``own_code``: dynamo's graphs and its recompile limit are
    per code object). decode_compiled keeps one per mixer classes and batch size, so a process serving several models
    and batch sizes never reaches that limit."""
    if COMPILE_BACKEND != "inductor":  # no modes nor options: those are Inductor's
        return torch.compile(own_code(function), dynamic=dynamic, fullgraph=True, backend=COMPILE_BACKEND), False
    mode = None if mode == "default" or (mode == "reduce-overhead" and device != "cuda") else mode  # no CUDA graph
    if dynamic and mode in CUDA_GRAPH_MODES:  # a CUDA graph has fixed shapes: one per length
        mode = None if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
    # torch.compile takes a mode or options; a stack's C++ launcher would be one source file for every block
    options = None
    if device == "cpu" and mode is None and function is block_step:
        options = {"cpp_wrapper": True, **({} if dynamic else small_products_fused())}
    step = torch.compile(own_code(function), dynamic=dynamic, fullgraph=True, options=options, mode=mode)
    return step, device == "cuda" and mode in CUDA_GRAPH_MODES


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape: torch.Size) -> tuple:
    """The strides of a new contiguous tensor of ``shape`` (asked per input and token: kept per shape)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has the strides of a new contiguous one: dynamo guards on every stride, also of size-1
    dimensions (a batch-1 slice that a prefill leaves is contiguous but strided otherwise), and would recompile."""
    return tensor.stride() == _contiguous_strides(tensor.shape)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the strides of a new contiguous one (``_is_dense``), copied only where it has other ones."""
    if _is_dense(tensor):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _dense_all(value):
    """``value`` (what a mixer's ``TokenStep.inputs`` returned) with every tensor ``_dense``: itself when they all are
    already (a state the previous compiled step wrote), found by walking it without rebuilding it (``map_tensors``
    would rebuild every dataclass of a windowed state to find its tensors dense)."""
    if all(map(_is_dense, tensors_of(value))):
        return value
    return map_tensors(value, _dense)


def _hooked(block) -> bool:
    """Whether ``block`` has a forward hook of its own (transformers' output capture, idle unless asked, aside)."""
    hooks = [*block._forward_pre_hooks.values(), *block._forward_hooks.values()]
    return any(getattr(hook, "__name__", None) != "output_capturing_hook" for hook in hooks)


# Where a single block's static-shape step in torch.compile's default mode runs as an AOTInductor library instead
# (decode/exported.py: the same graph without dynamo's per-call path); HF_MIXERS_EXPORTED_STEP=0 turns it
# off. Any call it cannot serve (autograd on, a hook, a failed export) runs through torch.compile.
EXPORT_DEVICES = () if os.environ.get("HF_MIXERS_EXPORTED_STEP", "1") == "0" else ("cpu",)
# The dtypes it serves: on a CPU the library measured faster than torch.compile's step in fp32 and slower in bf16
# (RSA w = 64 on SmolLM2, one process alternating them; docs/benchmarks.md).
EXPORT_DTYPES = (torch.float32, torch.float64)
STACK_DEVICES = ("cuda",)  # where a stack's step replays as a CUDA graph (the tests add "cpu")
# Where the stack's step writes the new states into the cache's tensors in place (at static addresses under a CUDA
# graph) instead of returning them: a CUDA-graph replay then neither copies the states in nor out. Off until a GPU
# has measured it (scripts/gpu_check.py decode-graphs; docs/benchmarks.md); the tests turn it on on CPU.
IN_PLACE_DEVICES: tuple = ()
_fixed_points: set = set()  # (step key, state signature): a state whose new state has its own shapes


# ``config.compile_decode = "auto"``: where ``generate`` takes the compiled step unasked. Measured faster than the
# eager step on a CPU in fp32, where the step is an AOTInductor library kept on disk (docs/benchmarks.md, "Decoding by
# default"). A process's first compiled step of a mixer class and batch size first exports and loads its library
# (built once per machine), which a generation of fewer than AUTO_NEW_TOKENS tokens does not win back; once a model's
# step has run in the process, any generation of that model takes it. Elsewhere (bf16 or a GPU: torch.compile in every
# process; a growing cache: symbolic shapes) a user asks for it (``compile_decode = True`` or a mode).
AUTO_NEW_TOKENS = 64
_auto_announced: set = set()
_stepped = weakref.WeakKeyDictionary()  # mixer -> the batch sizes whose compiled step it has run in this process


def auto_decode_refusal(blocks, parameter: torch.Tensor, new_tokens: int | None, batch: int | None = None
                        ) -> str | None:
    """Why ``compile_decode="auto"`` leaves a ``generate`` of ``new_tokens`` (None: unknown) at ``batch`` eager on
    ``blocks`` with weights like ``parameter``; None: it decodes through the compiled step."""
    mixers = [block.mixer for block in blocks if has_token_step(block.mixer)]
    if decode_compile_forbidden():
        return f"{COMPILE_DECODE_ENV}=0"
    if not mixers:
        return "no layer has a compiled token step"
    if any(map(grows, mixers)):
        return "a layer's cache grows with the context (its step has symbolic shapes, compiled in every process)"
    if parameter.device.type not in EXPORT_DEVICES or parameter.dtype not in EXPORT_DTYPES:
        return (f"{parameter.dtype} on {parameter.device.type}: the step is measured faster unasked only on a CPU in "
                "fp32; set model.config.compile_decode = True (or a torch.compile mode) to compile it")
    loaded = all(batch in _stepped.get(mixer, ()) for mixer in mixers)  # this model's step, built and loaded
    if not loaded and new_tokens is not None and new_tokens < AUTO_NEW_TOKENS:
        return f"{new_tokens} new tokens (a process's first compiled step pays from {AUTO_NEW_TOKENS})"
    return None


def announce_auto_decode(refusal: str | None) -> None:
    """Say once a process what ``compile_decode="auto"`` chose, and how to choose otherwise."""
    if refusal is None and None not in _auto_announced:
        logger.warning("hf_mixers: generate decodes through the compiled token step (compile_decode='auto'; the "
                       "first process on a machine builds it once, later ones load it); model.config.compile_decode "
                       "= False or HF_MIXERS_COMPILE_DECODE=0 decodes eagerly")
    elif refusal is not None and refusal not in _auto_announced:
        logger.info("hf_mixers: generate decodes eagerly (compile_decode='auto': %s)", refusal)
    _auto_announced.add(refusal)


def stack_compiles_decode(blocks, hidden_states, past_key_values, output_hidden_states=False) -> bool:
    """Whether this token runs through the whole stack as one compiled graph (``decode_compiled(blocks, ...)``):
    on CUDA, every block's mixer compiles this step with static shapes, in one mode that replays a CUDA graph, and
    no block must run on its own (a hook, or hidden states asked for, sees each block's call).

    Replayed block by block, a token costs the host one graph launch, dynamo's guards, cudagraph trees' input checks
    and the cache's glue per block: on the first H100 timings (docs/benchmarks.md) a token of SmolLM2's 30 blocks at
    batch 1 cost the teacher's eager step. The whole stack replays once. Without a CUDA
    graph it does not pay: on a CPU its kernels are launched from Python (a C++ launcher would be one source file
    for every block, too long for g++), and it measured slower than block by block (docs/benchmarks.md)."""
    if hidden_states.device.type not in STACK_DEVICES or output_hidden_states:  # every forward asks: CPU at once
        return False
    mixers = [block.mixer for block in blocks]
    return (compile_mode(mixers[0].config) in CUDA_GRAPH_MODES
            and all(compiles(mixer, hidden_states, past_key_values) and not grows(mixer) for mixer in mixers)
            and not any(_hooked(block) for block in blocks))


def decode_compiled(blocks, hidden_states, position_embeddings, token_mask, past_key_values):
    """One token through ``blocks`` (one block, or the whole stack: ``stack_compiles_decode``) as one torch.compile
    graph (fullgraph, static shapes; built on first use) -> the blocks' output, or None where this step cannot be
    compiled here (``_build_failed``: the caller runs the token eagerly).

    Eager, a decode step of a recurrent memory is ~100 small ops and dispatch-bound; compiled with the whole block
    around it (projections, o_proj, norms, MLP), it is one graph of a few fused kernels. The blocks are an argument,
    so their parameters are graph inputs and every block of a mixer class shares the graph (one per mixer classes,
    batch size and mode, see compile_step). Static shapes: what the mixer reads (``TokenStep.inputs``) does not grow
    with the context, and every input is given dense strides, so neither the context length nor a strided state
    recompiles it; a mixer whose cache grows (Sessa, ``switch.grows``) is compiled with symbolic shapes instead, its
    cache read in place. On CPU the graph's launcher is C++ (``cpp_wrapper``), and a single block's fp32 step of fixed
    shapes in the default mode runs as an AOTInductor library instead, without dynamo's call path (``_exports``,
    decode/exported.py). The first call compiles (seconds a mixer class; minutes for a stack), hence asked for
    (``config.compile_decode``; "auto" where it pays). Replayed as a CUDA graph, each replay writes its outputs into
    the same memory: they are copied out before the next replay would overwrite them (or, on an ``IN_PLACE_DEVICES``
    device, the stack writes its states into the cache's tensors: ``_decode_in_place``).
    """
    device = hidden_states.device.type
    mixers = [block.mixer for block in blocks]
    token_steps = [type(mixer).token_step for mixer in mixers]
    dynamic = any(map(grows, mixers))  # a class may have both kinds (GLTM: by pattern)
    key = (device, tuple(type(mixer) for mixer in mixers), hidden_states.shape[0], compile_mode(mixers[0].config),
           dynamic, COMPILE_BACKEND)
    if key in _eager_keys:
        return None
    caches = [past_key_values.layers[mixer.layer_idx] for mixer in mixers]
    inputs = []
    for mixer, token_step, layer_cache in zip(mixers, token_steps, caches):
        if token_step.prepare is not None:
            token_step.prepare(mixer)
        layer_inputs = token_step.inputs(mixer, layer_cache, token_mask)
        # a growing cache's views keep their strides: symbolic there, and a copy would cost a cache a step
        inputs.append(layer_inputs if dynamic else _dense_all(layer_inputs))
    for mixer in mixers:
        _stepped.setdefault(mixer, set()).add(key[2])
    if len(blocks) == 1 and _exports(key) and hidden_states.dtype in EXPORT_DTYPES:
        result = run_exported_step(block_step, blocks[0], _dense(hidden_states), position_embeddings, inputs[0],
                                   small_products_fused)
        if result is not None:
            output, state = result
            token_steps[0].store(mixers[0], caches[0], state)
            return output
    try:
        output, states = _run_compiled(key, blocks, hidden_states, position_embeddings, inputs, token_steps)
    except _build_failures() as error:
        if key in _ran:  # it compiled and ran before: this failure is the step's own
            raise
        _build_failed(key, error)
        return None
    _ran.add(key)
    for mixer, token_step, layer_cache, state in zip(mixers, token_steps, caches, states):
        token_step.store(mixer, layer_cache, state)
    return output


def _run_compiled(key, blocks, hidden_states, position_embeddings, inputs, token_steps):
    """``decode_compiled``'s graph call, compiled on first use -> (output, the new states, one a block)."""
    device, batch, mode, dynamic = key[0], key[2], key[3], key[4]
    if key not in _compiled_steps:
        what = (f"{key[1][0].__name__} block's" if len(blocks) == 1 else f"{len(blocks)} blocks' (one graph)")
        logger.warning("compiling the %s token step at batch %d with torch.compile (compile_decode=%s); the first "
                       "decode step takes %s", what, batch, mode, "5-20 s" if len(blocks) == 1 else "minutes")
        _compiled_steps[key] = compile_step(block_step if len(blocks) == 1 else stack_step, device, mode, dynamic)
    compiled, cuda_graph = _compiled_steps[key]
    if cuda_graph:
        torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs were copied out: reuse is fine
    targets = None
    if len(blocks) > 1 and device in IN_PLACE_DEVICES:
        targets = [None if token_step.replaced is None else token_step.replaced(block.mixer, layer_inputs)
                   for block, token_step, layer_inputs in zip(blocks, token_steps, inputs)]
        leaves = [] if None in targets else _leaves(targets)
        signature = None if None in targets else _signature(leaves)
    if targets is not None and (key, signature) in _fixed_points:
        output = _decode_in_place(key, blocks, hidden_states, position_embeddings, inputs, targets, leaves)
        return output, targets
    if len(blocks) == 1:
        output, state = compiled(blocks[0], _dense(hidden_states), position_embeddings, inputs[0])
        states = [state]
    else:
        output, states = compiled(list(blocks), _dense(hidden_states), position_embeddings, inputs)
    if cuda_graph:
        output, states = _copied_out((output, states))
    if targets is not None and signature == _signature(_leaves(states)):
        _fixed_points.add((key, signature))  # from the next token on, this state is written in place
    return output, states


def _build_failures() -> tuple:
    """What a failed build raises: the backend's error (Inductor's, a C++ compiler missing or failing, wrapped by
    dynamo or not). A graph break is no such failure: it is a bug of the step, and stays an error. (Imported when an
    error is being handled: Inductor's modules are not loaded before a step compiles.)"""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    return BackendCompilerFailed, InvalidCxxCompiler, CppCompileError


_eager_keys: set = set()  # decode_compiled keys whose build failed here: their tokens run eagerly
_ran: set = set()  # keys whose compiled step has run


def _build_failed(key, error) -> None:
    """Keep ``key``'s tokens eager from now on, and say so once per mixer classes."""
    if not any(known[1] == key[1] for known in _eager_keys):
        error = getattr(error, "inner_exception", None) or error  # dynamo's wrapper names the backend; this, why
        names = ", ".join(sorted({cls.__name__ for cls in key[1]}))
        lines = str(error).strip().splitlines()
        logger.warning("hf_mixers: the compiled token step of %s could not be built here (%s: %s); these blocks "
                       "decode eagerly (HF_MIXERS_COMPILE_DECODE=0 or config.compile_decode = False skips the "
                       "attempt)", names, type(error).__name__, lines[0][:300] if lines else "")
    _eager_keys.add(key)


def _exports(key) -> bool:
    """Whether a block's step of this ``decode_compiled`` key runs as an AOTInductor library (``EXPORT_DEVICES``):
    static shapes, Inductor in its default mode (no CUDA graph, no autotuning asked for)."""
    device, mode, dynamic, backend = key[0], key[3], key[4], key[5]
    return (device in EXPORT_DEVICES and not dynamic and backend == "inductor"
            and (mode in (None, "default") or (mode == "reduce-overhead" and device != "cuda")))


def _decode_in_place(key, blocks, hidden_states, position_embeddings, inputs, targets, leaves):
    """The stack's step through ``stack_step_in_place`` (compiled once per ``key``): ``targets``, the cache's own
    dense tensors (``leaves``: theirs, in order), take the new states. Under a CUDA graph they are marked static
    addresses (cudagraph trees record a graph that writes its inputs only for those), so a replay copies no state in
    or out."""
    device, mode, dynamic = key[0], key[3], key[4]
    if key + ("in place",) not in _compiled_steps:
        _compiled_steps[key + ("in place",)] = compile_step(stack_step_in_place, device, mode, dynamic)
    step, cuda_graph = _compiled_steps[key + ("in place",)]
    if cuda_graph:
        for tensor in leaves:
            torch._dynamo.mark_static_address(tensor, guard=False)
    output = step(list(blocks), _dense(hidden_states), position_embeddings, inputs, targets)
    return output.clone() if cuda_graph else output
