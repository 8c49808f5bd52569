"""SequenceMixer: the base class of every mixer, and the one forward signature the blocks call.

    forward(hidden_states (B, T, D), position_embeddings (cos, sin) or None, attention_mask (backend mask or None),
            token_mask (B, P+T) bool or None, past_key_values Cache or None) -> (B, T, D)

``token_mask`` marks the real tokens of the cached and new positions (False = padding), so a mixer keeps padding out
of its memory; ``attention_mask`` is the backend mask the spec asked for (``MixerSpec.attention_mask``). A mixer
reads and writes its own layer of ``past_key_values`` (``past_key_values.layers[self.layer_idx]``), an instance of
its spec's ``cache_layer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

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


@dataclass(frozen=True)
class TokenStep:
    """A mixer's one-token decode step, declared by its class (``SequenceMixer.token_step``); hf_mixers/decode runs it
    with the block around it as one compiled graph. Each field is a function of the mixer first:

        ready(mixer, layer_cache) -> bool          the cache holds what ``inputs`` reads (a prefill came first)
        inputs(mixer, layer_cache, token_mask) -> tuple   what the step reads: tensors, tuples of them or None;
                                                   token_mask (B, P + 1) bool or None
        step(mixer, hidden_states (B, 1, D), position_embeddings, *inputs) -> (output (B, 1, D), new state)
        store(mixer, layer_cache, new state)       the new state written back into the cache
        replaced(mixer, inputs) -> tuple | None     the part of ``inputs`` the new state replaces, in its structure
                                                   (the stack's step may then write it in place); None: never
        prepare(mixer)                             host work before each step (the teacher's q/k/v stacked)

    ``step`` is traced whole (fullgraph): no host synchronisation, no shape that depends on values. Its inputs keep
    their shapes from token to token when the mixer's state is constant (``constant_state``); otherwise they grow
    with the context, and the step is compiled with symbolic shapes, reading the cache where it lies. A subclass
    that changes one function declares its own ``TokenStep`` (``dataclasses.replace`` of its parent's).
    """
    ready: Callable
    inputs: Callable
    step: Callable
    store: Callable
    replaced: Callable | None = None
    prepare: Callable | None = None


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
        token_step: the one-token decode step (``TokenStep``) the block may compile, or None (eager decode).
        constant_state(config): whether the decode cache is a state of fixed size (serving, the token step's shapes).
    """

    teacher_modules: tuple[str, ...] = ()
    conversion_note: str = ""
    token_step: TokenStep | None = None

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

    @classmethod
    def constant_state(cls, config) -> bool:
        """Whether this mixer's decode cache, under ``config``, is a state of fixed size that ``mix(hidden_states,
        position_embeddings, token_mask, state, history) -> (output, state, history)`` reads and returns: what a
        serving engine keeps per sequence (hf_mixers/serving). A cache that keeps tokens is not."""
        return False

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

    @classmethod
    def constant_state(cls, config) -> bool:
        return True

    # The token step: this token's mask (B, 1) or None, the state and the short-conv history in; ``mix`` on them.
    def step_ready(self, layer_cache) -> bool:
        return layer_cache.state is not None

    def step_inputs(self, layer_cache, token_mask) -> tuple:
        return last_token_mask(token_mask), layer_cache.state, layer_cache.conv_history

    def step(self, hidden_states, position_embeddings, token_mask, state, history):
        output, state, history = self.mix(hidden_states, position_embeddings, token_mask, state, history)
        return output, (state, history)

    def store_step(self, layer_cache, state) -> None:
        layer_cache.update_state(state[0], 1, state[1])

    def replaced_by_step(self, inputs) -> tuple:
        return inputs[1], inputs[2]  # (state, history): what ``step`` returns

    token_step = TokenStep(ready=step_ready, inputs=step_inputs, step=step, store=store_step,
                           replaced=replaced_by_step)
