"""Cache-layer bases on the transformers 5 Cache API, written once for every mixer.

transformers' ``DynamicCache(config=...)`` builds one layer object per ``config.layer_types`` entry from
``DYNAMIC_LAYER_TYPE_MAPPING``; a layer class that sets ``_layer_type`` registers itself there. So the one cache
class for every layer kind is transformers' own ``DynamicCache``: "full_attention" layers get a ``DynamicLayer`` and
each mixer's spec names its own layer class, a few lines on top of one of these bases:

    KVPlusLayer           attention K/V plus extra per-token tensors (B, t, ...) appended along the sequence
                          (Sessa: feedback keys and solved outputs)
    RecurrentStateLayer   a fixed-size state (a tensor, a tuple of tensors, or an object with ``map``), an optional
                          short-convolution history, and a token count (RSA)

``generate()``, beam search (``reorder_cache``), ``crop`` where it is possible and batch selection then work without
a custom Cache subclass. Both bases subclass ``DynamicLayer`` (not ``LinearAttentionLayer``): they keep a sequence
length, so ``get_seq_length`` and the causal-mask sizes stay valid in a stack with no attention layer at all
(transformers' own linear-attention layers raise there).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer


def map_tensors(value, fn):
    """``fn`` applied to every tensor of ``value``: None, a tensor, a tuple/list of them, or an object with ``map``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, fn) for item in value)
    return value.map(fn) if hasattr(value, "map") else value  # e.g. RSAState


@functools.lru_cache(maxsize=None)
def _field_names(cls) -> tuple:
    return tuple(field.name for field in dataclasses.fields(cls))


def tensors_of(value, first: bool = False, found: list | None = None) -> list:
    """The tensors of ``value``, in the order ``map_tensors`` meets them, found without rebuilding ``value`` (a decode
    step walks its inputs once per layer and token); ``first``: stop at the first one."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if first and found:
                break
            tensors_of(item, first, found)
    elif value is None or not hasattr(value, "map"):
        pass  # map_tensors leaves it as it is
    elif dataclasses.is_dataclass(value):  # RSAState, WindowState, ...: their ``map`` goes through their fields
        tensors_of([getattr(value, name) for name in _field_names(type(value))], first, found)
    else:  # an object with ``map`` of another kind: let it walk its tensors
        map_tensors(value, lambda tensor: found.append(tensor) or tensor)
    return found


def first_tensor(value) -> torch.Tensor | None:
    """The first tensor ``map_tensors`` would meet in ``value`` (a decode step asks once per layer and token)."""
    found = tensors_of(value, first=True)
    return found[0] if found else None


class KVPlusLayer(DynamicLayer):
    """K/V of the attention branch plus the per-token tensors named in ``extra_names``, each (B, t, ...).

    Appends are amortised: each of these tensors is the front of a buffer with room for an eighth more tokens (at
    least 64), so a decode step writes its token in place instead of copying the whole cache (``torch.cat``, what
    transformers' ``DynamicLayer`` does). Anything that replaces the tensors (beam reordering, crop, batch
    selection) drops the buffers; the next append starts new ones from the tensors as they are."""

    extra_names: tuple[str, ...] = ()
    SPARE = 0.125  # room kept beyond the cached tokens when a buffer grows (at least 64 tokens): a regrowth copies
    # the cache once per SPARE * t steps, i.e. 1 / SPARE tokens' worth per step, where torch.cat copies all t

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffers = {}  # attribute name -> (buffer, the view of it the attribute holds)
        for name in self.extra_names:
            setattr(self, name, None)

    def update(self, key_states, value_states, *args, **kwargs):
        """Append K/V (B, Hkv, T, d) -> all the cached K/V (views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append("keys", key_states, dim=-2)
        self.append("values", value_states, dim=-2)
        return self.keys, self.values

    def append(self, name: str, tensor: torch.Tensor, dim: int) -> None:
        """Attribute ``name`` with ``tensor`` appended along ``dim``, written into its buffer's spare room."""
        current = getattr(self, name)
        # nothing cached yet (DynamicLayer starts from an empty 1-D tensor); a tensor of zero width (GLTM's entries
        # of a pattern that keeps none) still counts its tokens, so that every cached tensor has the same length
        if current is None or current.dim() != tensor.dim() or current.shape[dim] == 0:
            current = tensor.narrow(dim, 0, 0)
        if torch.is_grad_enabled() and (tensor.requires_grad or current.requires_grad):
            # a cache in a graph (training through a prefill): an in-place write would invalidate what was saved
            self.buffers.pop(name, None)
            setattr(self, name, torch.cat([current, tensor], dim=dim))
            return
        buffer, view = self.buffers.get(name, (None, None))
        used, needed = current.shape[dim], current.shape[dim] + tensor.shape[dim]
        # never left full: a view that is its whole buffer has contiguous strides, and a compiled step with
        # symbolic shapes guards on that (it would recompile the one time a view filled its buffer)
        if view is not current or buffer.shape[dim] <= needed:
            shape = list(current.shape)
            shape[dim] = needed + max(int(needed * self.SPARE), 64)
            buffer = current.new_empty(shape)
            buffer.narrow(dim, 0, used).copy_(current)
        buffer.narrow(dim, used, tensor.shape[dim]).copy_(tensor)
        view = buffer.narrow(dim, 0, needed)
        self.buffers[name] = (buffer, view)
        setattr(self, name, view)

    @property
    def extras(self) -> tuple:
        """The extra tensors of the cached tokens, in ``extra_names`` order (all None when empty)."""
        return tuple(getattr(self, name) for name in self.extra_names)

    def append_extras(self, *tensors: torch.Tensor) -> None:
        for name, tensor in zip(self.extra_names, tensors, strict=True):
            self.append(name, tensor, dim=1)

    def _map_extras(self, fn):
        """``fn`` on every extra tensor; every method that calls this replaces the K/V too, so the appends' buffers
        go (the next append starts new ones)."""
        for name in self.extra_names:
            setattr(self, name, map_tensors(getattr(self, name), fn))
        self.buffers = {}

    def reset(self) -> None:
        super().reset()
        self._map_extras(lambda x: None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_extras(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._map_extras(lambda x: x[:, :tokens_to_remove])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_extras(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_extras(lambda x: x[indices, ...])

    def offload(self):
        super().offload()
        self._map_extras(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        self._map_extras(lambda x: x if x.device == self.device else x.to(self.device, non_blocking=True))


class RecurrentStateLayer(DynamicLayer):
    """A constant-size recurrent state, the short-convolution history (the last K - 1 inputs, if the layer has one)
    and the number of tokens seen.

    It keeps no K/V; ``get_seq_length`` counts tokens (padding included, as attention caches do), so positions and
    mask sizes stay right even when no layer is attention. A recurrent state cannot drop tokens, so ``crop`` refuses.
    """

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = None
        self.conv_history = None
        self.seen_tokens = 0

    def update_state(self, state, new_tokens: int, conv_history=None) -> None:
        self.state, self.conv_history = state, conv_history
        self.seen_tokens += new_tokens
        self.device, self.is_initialized = first_tensor(state).device, True

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def _map_state(self, fn):
        self.state = map_tensors(self.state, fn)
        self.conv_history = map_tensors(self.conv_history, fn)

    def reset(self) -> None:
        self.state, self.conv_history, self.seen_tokens, self.is_initialized = None, None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(f"{type(self).__name__}: a fixed-size recurrent state cannot drop tokens (crop)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda x: x[indices, ...])

    def offload(self):
        self._map_state(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        self._map_state(lambda x: x if x.device == self.device else x.to(self.device, non_blocking=True))


def cache_nbytes(cache: Cache, spare: bool = True) -> int:
    """Bytes held by the tensors of every layer of ``cache`` (for benchmarks and reports): each storage once and
    whole, so a cache's spare room (``KVPlusLayer``) counts; ``spare=False``: the cached tokens' bytes alone."""
    storages, used = {}, []

    def count(x):
        used.append(x.numel() * x.element_size())
        storage = x.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, (torch.Tensor, tuple, list)) or hasattr(value, "map"):
                map_tensors(value, count)
    return sum(storages.values()) if spare else sum(used)
