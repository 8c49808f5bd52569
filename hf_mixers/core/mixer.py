"""SequenceMixer: the base class of every mixer, and the one forward signature the blocks call.

    forward(hidden_states (B, T, D), position_embeddings (cos, sin) or None, attention_mask (backend mask or None),
            token_mask (B, P+T) bool or None, past_key_values Cache or None) -> (B, T, D)

``token_mask`` marks the real tokens of the cached and new positions (False = padding), so a mixer keeps padding out
of its memory; ``attention_mask`` is the backend mask the spec asked for (``MixerSpec.attention_mask``). A mixer
reads and writes its own layer of ``past_key_values`` (``past_key_values.layers[self.layer_idx]``), an instance of
its spec's ``cache_layer``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
# ``HF_MIXERS_COMPILE_DECODE=0``: every token step eager, whatever ``config.compile_decode`` says
COMPILE_DECODE_ENV = "HF_MIXERS_COMPILE_DECODE"


def decode_compile_forbidden() -> bool:
    """Whether the environment makes every token step eager (``HF_MIXERS_COMPILE_DECODE=0``)."""
    return os.environ.get(COMPILE_DECODE_ENV) == "0"

COMPILE_CHOICES = (False, True, *COMPILE_MODES)  # a compile switch: off, torch.compile's default mode, or a mode


def check_compile_decode(value, command: str) -> None:
    """A command's ``--compile-decode`` (False, True or a ``COMPILE_MODES`` name), or a ValueError naming it."""
    if value not in COMPILE_CHOICES:
        raise ValueError(f"{command}: --compile-decode takes a torch.compile mode {COMPILE_MODES} or nothing, got "
                         f"{value!r}")


# (token mask, its version, its last column): the one a decode step's recurrent layers share (``last_token_mask``)
_last_column: tuple = (None, None, None)


def last_token_mask(token_mask):
    """``token_mask[:, -1:]`` (B, 1) with a new tensor's strides, or None: made once per token mask, since every
    recurrent layer of a decode step asks for the same one (a slice of (B, P + 1) has other strides, which the
    compiled step would copy, layer by layer). Kept for the same mask object, unmodified since: its version, or, for
    an inference tensor (which has none), until the next model forward (``forget_token_mask``)."""
    global _last_column
    if token_mask is None:
        return None
    version = None if token_mask.is_inference() else token_mask._version
    mask, seen_version, column = _last_column  # one tuple, read once: another thread may replace it meanwhile
    if mask is token_mask and seen_version == version:
        return column
    column = token_mask[:, -1:].clone(memory_format=torch.contiguous_format)
    _last_column = (token_mask, version, column)
    return column


def forget_token_mask() -> None:
    """Drop ``last_token_mask``'s copy (each model forward starts so: a mask modified in place in between is seen)."""
    global _last_column
    _last_column = (None, None, None)


class SequenceMixer(nn.Module):
    """Subclass this, implement ``forward``, and register a ``MixerSpec`` naming the class.

    Hooks a mixer may override:
        reset_parameters(): scratch initialisation of the mixer's own parameters (the model's ``_init_weights``
            calls it; use ``transformers.initialization`` functions so weights loaded from a checkpoint are kept).
        init_new_parameters(): the conversion initialisation of what a converted layer adds to its teacher's
            attention (default: ``reset_parameters``).
        teacher_modules: names of submodules ``from_attention`` must fill from the teacher attention.
        conversion_note: what ``from_attention`` chose, in a few words (the conversion report shows it per layer).
        auxiliary_loss(hidden_states, position_embeddings): a loss stage 1 adds to the layer's attention-transfer
            loss (None by default; VORT's retrieval loss).
    """

    teacher_modules: tuple[str, ...] = ()
    conversion_note: str = ""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if not 0 <= layer_idx < config.num_hidden_layers:
            raise ValueError(f"layer_idx {layer_idx} is out of range for a config with num_hidden_layers = "
                             f"{config.num_hidden_layers}")
        self.config = config
        self.layer_idx = layer_idx

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def reset_parameters(self) -> None:
        """Scratch initialisation of the mixer's own parameters (none by default)."""

    def init_new_parameters(self) -> None:
        """Conversion initialisation of the parameters the mixer adds to its teacher's attention."""
        self.reset_parameters()

    def auxiliary_loss(self, hidden_states, position_embeddings):
        """An extra stage-1 training loss of this layer on the teacher's inputs (None: there is none)."""
        return None

    # The compiled token step (model/blocks.py decode_compiled). A mixer that has one says so in
    # ``can_compile_decode`` and implements the three methods below; the block then runs each one-token step of
    # its layer, with the block's own layers around it, as one torch.compile graph.
    # A step whose inputs grow with the context (a per-token cache read where it lies) is compiled with dynamic
    # shapes: one graph for every length, and the cache's views passed as they are (no copy to dense strides).
    decode_dynamic_shapes = False

    @classmethod
    def constant_state(cls, config) -> bool:
        """Whether this mixer's decode cache, under ``config``, is a state of fixed size that ``mix(hidden_states,
        position_embeddings, token_mask, state, history) -> (output, state, history)`` reads and returns: what a
        serving engine keeps per sequence (hf_mixers/serving). A cache that keeps tokens is not."""
        return False

    def can_compile_decode(self) -> bool:
        """Whether this mixer has a one-token step the block can compile (never by default)."""
        return False

    def decode_compile_mode(self) -> str | None:
        """The torch.compile mode of the compiled token step (``config.compile_decode``: True is "default"), or None
        for an eager one: "auto" is eager here, and ``generate`` sets a mode for the calls it compiles
        (model/modeling.py); ``HF_MIXERS_COMPILE_DECODE=0`` is eager always."""
        mode = self.config.compile_decode
        if mode == "auto" or decode_compile_forbidden():
            return None
        return "default" if mode is True else mode or None

    def compiles_decode(self, hidden_states, past_key_values) -> bool:
        """Whether the block runs this step as one compiled graph: a mixer that can, ``config.compile_decode``, one
        token, its cache already filled (a call with an empty cache, e.g. the prompt's prefill, runs eagerly)."""
        return (self.can_compile_decode() and self.decode_compile_mode() is not None and hidden_states.shape[1] == 1
                and past_key_values is not None and self.decode_ready(past_key_values.layers[self.layer_idx]))

    def decode_ready(self, layer_cache) -> bool:
        """Whether ``layer_cache`` holds what ``decode_inputs`` reads."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled token step")

    def decode_inputs(self, layer_cache, token_mask) -> tuple:
        """What the compiled step reads besides the block's input and the rotary embedding, from the layer's cache
        and the token mask (B, P + 1): tensors, tuples of them or None, of shapes that do not grow with the context
        (each shape is a graph), unless ``decode_dynamic_shapes``."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled token step")

    def decode_step(self, hidden_states, position_embeddings, *inputs) -> tuple:
        """One token (B, 1, D) and ``decode_inputs`` -> (output (B, 1, D), the new state): traced by torch.compile
        (fullgraph), so no host synchronisation and no shape that depends on values."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled token step")

    def store_decode_state(self, layer_cache, state) -> None:
        """Write the state ``decode_step`` returned back into the layer's cache."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled token step")

    def prepare_compiled_decode(self) -> None:
        """Host-side work before each compiled token step, outside the graph (nothing by default; the teacher's
        attention stacks q/k/v_proj into one product: core/attention.py ``fuse_qkv``)."""

    def decode_state_inputs(self, inputs) -> tuple | None:
        """The part of ``decode_inputs``'s ``inputs`` that the new state of ``decode_step`` replaces, in the same
        structure (the compiled step may then write the new state into these tensors in place, model/blocks.py), or
        None (never in place)."""
        return None

    @classmethod
    def teacher_state(cls, attention: nn.Module, config) -> dict:
        """The teacher tensors ``from_attention`` copies (default: all of them; a mixer without some of the teacher's
        projections, e.g. one with constant B and C, leaves those out here)."""
        return attention.state_dict()

    @classmethod
    def from_attention(cls, attention: nn.Module, config, layer_idx: int, **calibration) -> "SequenceMixer":
        """This mixer for layer ``layer_idx``, initialised from a teacher attention layer.

        The teacher's parameters whose names the mixer shares (q_proj, k_proj, ... for Llama/Mistral/Qwen teachers)
        are copied; every ``teacher_modules`` entry must be among them. The mixer's other parameters get
        ``init_new_parameters``. Mixers that fit on calibration activations take them as keyword arguments and
        override this; the others ignore them.
        """
        reference = next(attention.parameters(), None)
        if reference is None:
            raise ValueError(f"layer {layer_idx}: the teacher attention has no parameters")
        mixer = cls(config, layer_idx).to(device=reference.device)
        mixer.init_new_parameters()
        state = cls.teacher_state(attention, config)
        missing, unexpected = mixer.load_state_dict(state, strict=False)
        if unexpected and cls.teacher_modules:  # a mixer that takes the teacher's projections takes all of them
            raise ValueError(f"layer {layer_idx}: the teacher attention has parameters {cls.__name__} does not: "
                             f"{sorted(unexpected)}")
        uncopied = [name for name in missing if name.split(".")[0] in cls.teacher_modules
                    and hasattr(mixer, name.split(".")[0])]
        if uncopied:
            raise ValueError(f"layer {layer_idx}: the teacher attention lacks {uncopied} (it has {sorted(state)})")
        return mixer.to(dtype=reference.dtype)


class RecurrentMixer(SequenceMixer):
    """A mixer whose decode state lives in a ``core.cache.RecurrentStateLayer`` (a constant-size state and a short
    conv history). Subclasses implement ``mix(hidden_states, position_embeddings, token_mask, state, history) ->
    (output, state, history)``; this forward reads the layer's cache and writes the new state back."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        layer_cache = None if past_key_values is None else past_key_values.layers[self.layer_idx]
        state, history = (None, None) if layer_cache is None else (layer_cache.state, layer_cache.conv_history)
        output, state, history = self.mix(hidden_states, position_embeddings, token_mask, state, history)
        if layer_cache is not None:
            layer_cache.update_state(state, hidden_states.shape[1], history)
        return output

    def mix(self, hidden_states, position_embeddings=None, token_mask=None, state=None, history=None):
        raise NotImplementedError(f"{type(self).__name__} must implement mix")

    decode_dynamic_shapes = False  # a constant state (before FullAttention in the subclasses' order)

    @classmethod
    def constant_state(cls, config) -> bool:
        return True

    def can_compile_decode(self) -> bool:
        return True

    def decode_ready(self, layer_cache) -> bool:
        return layer_cache.state is not None

    def decode_inputs(self, layer_cache, token_mask) -> tuple:
        """This token's mask (B, 1) or None, the state and the short-conv history."""
        return last_token_mask(token_mask), layer_cache.state, layer_cache.conv_history

    def decode_step(self, hidden_states, position_embeddings, token_mask, state, history):
        output, state, history = self.mix(hidden_states, position_embeddings, token_mask, state, history)
        return output, (state, history)

    def decode_state_inputs(self, inputs) -> tuple:
        return inputs[1], inputs[2]  # (state, history): what decode_step returns

    def store_decode_state(self, layer_cache, state) -> None:
        layer_cache.update_state(state[0], 1, state[1])
