"""Decoder blocks around a mixer, and the compiled single-token decode step of a block.

    LlamaBlock ("llama"):  x + mixer(RMSNorm(x)), then + MLP(RMSNorm(.))   a converted teacher keeps its norms and MLP
    SessaBlock ("sessa"):  x + W_out(mixer(GELU(a)) * g), [a | g] = W_in(LayerNorm(x))   the Sessa paper's native
                           block: no MLP, a linear gate, exact erf GELU, LayerNorm eps 1e-5

A block's ``around(x, mix)`` runs its own layers around ``mix`` (normed input -> mixer output); ``forward`` calls
it with the mixer, or with the mixer's compiled one-token step when it asks for one (``mixer.compiles_decode``: the
recurrent mixers, GLTM, Sessa).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from ..core.cache import map_tensors

logger = logging.getLogger(__name__)


class MixerBlock(GradientCheckpointingLayer):
    def around(self, hidden_states, mix):
        raise NotImplementedError

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        if self.mixer.compiles_decode(hidden_states, past_key_values):
            return decode_compiled(self, hidden_states, position_embeddings, token_mask, past_key_values)
        return self.around(hidden_states, lambda x: self.mixer(x, position_embeddings, attention_mask, token_mask,
                                                              past_key_values, **kwargs))


class LlamaBlock(MixerBlock):
    """The Llama decoder layer with its attention replaced by the layer's mixer (names kept: input_layernorm, ...)."""

    def __init__(self, config, layer_idx: int, mixer_class):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = mixer_class(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def around(self, hidden_states, mix):
        hidden_states = hidden_states + mix(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SessaBlock(MixerBlock):
    """The Sessa paper's native layer: y = x + W_out(mixer(GELU(a)) * g), [a | g] = W_in(LN(x)), with any mixer."""

    def __init__(self, config, layer_idx: int, mixer_class):
        super().__init__()
        size = config.hidden_size
        self.norm = nn.LayerNorm(size, eps=1e-5)
        self.in_proj = nn.Linear(size, 2 * size, bias=True)
        self.mixer = mixer_class(config, layer_idx)
        self.out_proj = nn.Linear(size, size, bias=True)

    def around(self, hidden_states, mix):
        value, gate = self.in_proj(self.norm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.out_proj(mix(F.gelu(value)) * gate)


BLOCK_CLASSES = {"llama": LlamaBlock, "sessa": SessaBlock}


def block_step(block, hidden_states, position_embeddings, inputs):
    """A block around its mixer's one-token step, without cache objects: -> output, the mixer's new state.

    ``inputs`` are what the mixer's ``decode_inputs`` read from its cache (for a recurrent mixer: the token's mask,
    the state and the short-conv history); ``decode_step`` is the mixer's layer for one token on them."""
    new = {}

    def mix(x):
        out, new["state"] = block.mixer.decode_step(x, position_embeddings, *inputs)
        return out

    return block.around(hidden_states, mix), new["state"]


_compiled_block_steps = {}  # (device type, mixer class, batch, mode) -> (compiled block_step, replays a CUDA graph)


def compile_block_step(device: str, mode: str | None = None, dynamic: bool = False):
    """``block_step`` compiled for ``device`` -> (the step, whether it replays as a CUDA graph). ``mode``:
    torch.compile's (None or "default": the default, with a C++ launcher on CPU; "reduce-overhead": replayed as a
    CUDA graph on CUDA). ``dynamic``: symbolic shapes (a mixer whose cache grows, ``decode_dynamic_shapes``), never
    replayed as a CUDA graph (it would record one per context length).

    Each call compiles its own copy of the function's code: dynamo keeps its graphs, and its limit of 8 recompiles
    before it silently falls back to eager, per code object. decode_compiled keeps one per mixer class and batch
    size, so a process serving several models and batch sizes never reaches that limit."""
    mode = None if mode == "default" else mode
    if dynamic and mode in ("reduce-overhead", "max-autotune"):  # a CUDA graph has fixed shapes: one per length
        mode = None if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
    options = {"cpp_wrapper": True} if device == "cpu" and mode is None else None  # torch.compile takes one of two
    copy = types.FunctionType(block_step.__code__.replace(), block_step.__globals__, block_step.__name__)
    step = torch.compile(copy, dynamic=dynamic, fullgraph=True, options=options, mode=mode)
    return step, device == "cuda" and mode in ("reduce-overhead", "max-autotune")


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the strides of a new contiguous one: dynamo guards on every stride, also of size-1 dimensions
    (a batch-1 slice that a prefill leaves is contiguous but strided otherwise), and would recompile the step."""
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= size
    dense = tensor.stride() == tuple(reversed(strides))
    return tensor if dense else tensor.clone(memory_format=torch.contiguous_format)


def decode_compiled(block, hidden_states, position_embeddings, token_mask, past_key_values):
    """One token through ``block_step`` compiled with torch.compile (fullgraph, static shapes; built on first use).

    Eager, a decode step of a recurrent memory is ~100 small ops and dispatch-bound; compiled with the whole block
    around it (projections, o_proj, norms, MLP), it is one graph of a few fused kernels. The block is an argument,
    so its parameters are graph inputs and every block of a mixer class shares the graph (one per class, batch size
    and mode, see compile_block_step). Static shapes: what the mixer reads (``decode_inputs``) does not grow with the
    context, and every input is given dense strides, so neither the context length nor a strided state recompiles
    it; a mixer whose cache grows (Sessa, ``decode_dynamic_shapes``) is compiled with symbolic shapes instead, its
    cache read in place. On CPU the graph's launcher is C++ (``cpp_wrapper``): the default Python launcher of ~50
    kernels cost ~0.13 ms per block call, a tenth of an RSA step. The first call compiles for 10-60 s on a CPU,
    hence opt-in (``config.compile_decode``). Replayed as a CUDA graph, one graph serves every block, and each
    replay writes its outputs into the same memory: they are copied out before the next block's replay would
    overwrite them.
    """
    device = hidden_states.device.type
    dynamic = block.mixer.decode_dynamic_shapes  # a class may have both kinds (GLTM: by its pattern)
    key = (device, type(block.mixer), hidden_states.shape[0], block.mixer.decode_compile_mode(), dynamic)
    if key not in _compiled_block_steps:
        logger.warning("compiling the %s block's token step at batch %d with torch.compile (compile_decode=%s); the "
                       "first decode step takes 10-60 s", key[1].__name__, key[2], key[3])
        _compiled_block_steps[key] = compile_block_step(device, key[3], dynamic)
    step, cuda_graph = _compiled_block_steps[key]
    if cuda_graph:
        torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs were copied out: reuse is fine
    block.mixer.prepare_compiled_decode()
    layer_cache = past_key_values.layers[block.mixer.layer_idx]
    inputs = block.mixer.decode_inputs(layer_cache, token_mask)
    if not dynamic:  # a growing cache's views keep their strides: symbolic there, and a copy would cost a cache a step
        inputs = map_tensors(inputs, _dense)
    output, state = step(block, _dense(hidden_states), position_embeddings, inputs)
    if cuda_graph:
        output, state = map_tensors((output, state), torch.Tensor.clone)
    block.mixer.store_decode_state(layer_cache, state)
    return output
