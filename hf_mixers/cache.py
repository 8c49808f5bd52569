"""Per-layer caches on the transformers 5 Cache API.

transformers' ``DynamicCache(config=...)`` builds one layer object per ``config.layer_types`` entry from
``DYNAMIC_LAYER_TYPE_MAPPING``; a layer class that sets ``_layer_type`` registers itself there. So the one cache
class for every layer kind is transformers' own ``DynamicCache``: "full_attention" layers get a ``DynamicLayer``
and each mixer registers its own layer class here. ``generate()``, beam search (``reorder_cache``), ``crop`` and
batch selection then work without a custom Cache subclass or private generation hooks.

Mixer cache layers subclass ``DynamicLayer`` (not ``LinearAttentionLayer``): they keep a sequence length, so
``get_seq_length`` and the causal-mask sizes stay valid even in a stack with no attention layer (the trap noted in
shared/research/environment.md §3).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SessaCacheLayer(DynamicLayer):
    """Attention K/V (B, Hkv, t, hd) plus Sessa's feedback keys (B, t, d_fb) and solved outputs s (B, t, D, fp32)."""

    _layer_type = "sessa"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.feedback_keys: torch.Tensor | None = None
        self.outputs: torch.Tensor | None = None

    def feedback_state(self):
        """(feedback keys, outputs) of the cached tokens, or (None, None) when empty."""
        return self.feedback_keys, self.outputs

    def update_feedback(self, keys: torch.Tensor, outputs: torch.Tensor) -> None:
        if self.feedback_keys is None:
            self.feedback_keys, self.outputs = keys, outputs
        else:
            self.feedback_keys = torch.cat([self.feedback_keys, keys], dim=1)
            self.outputs = torch.cat([self.outputs, outputs], dim=1)

    def _map_feedback(self, fn):
        if self.feedback_keys is not None:
            self.feedback_keys, self.outputs = fn(self.feedback_keys), fn(self.outputs)

    def reset(self) -> None:
        super().reset()
        self.feedback_keys = self.outputs = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_feedback(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._map_feedback(lambda x: x[:, :tokens_to_remove])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_feedback(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_feedback(lambda x: x[indices, ...])

    def offload(self):
        super().offload()
        self._map_feedback(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        if self.feedback_keys is not None and self.feedback_keys.device != self.device:
            self._map_feedback(lambda x: x.to(self.device, non_blocking=True))


class RSACacheLayer(DynamicLayer):
    """RSA's constant-size memory state (kernels.rsa_memory.RSAState), the short-convolution history (the last K - 1
    inputs, if the layer has one) and the number of tokens seen.

    It keeps no K/V; ``get_seq_length`` counts tokens (padding included, as attention caches do), so positions and
    mask sizes stay right even when no layer is attention.
    """

    _layer_type = "rsa"
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = None
        self.conv_history = None
        self.seen_tokens = 0

    def update_state(self, state, new_tokens: int, conv_history=None) -> None:
        self.state, self.conv_history = state, conv_history
        self.seen_tokens += new_tokens
        self.device, self.is_initialized = state.count.device, True

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def _map_state(self, fn):
        if self.state is not None:
            self.state = self.state.map(fn)
        if self.conv_history is not None:
            self.conv_history = fn(self.conv_history)

    def reset(self) -> None:
        self.state, self.conv_history, self.seen_tokens, self.is_initialized = None, None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_state(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("RSA layers keep a fixed-size recurrent state and cannot drop tokens (crop)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_state(lambda x: x[indices, ...])

    def offload(self):
        self._map_state(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.state is not None and self.state.count.device != self.device:
            self._map_state(lambda x: x.to(self.device, non_blocking=True))


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by every tensor of every layer of ``cache`` (for benchmarks and reports)."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif hasattr(value, "nbytes") and callable(value.nbytes):  # e.g. RSAState
                total += value.nbytes()
    return total
