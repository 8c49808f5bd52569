"""A converted folder as a vLLM model: ``vllm serve DIR`` / ``LLM(model=DIR)`` with hf-mixers installed (its
``vllm.general_plugins`` entry point, ``register``, names this class for every hf-mixers architecture).

The model is the folder's own ``MixerForCausalLM`` (the same modules, weights and math as ``generate()``), run on
vLLM's flat batch of tokens:

    kept attention layers   the layer's projections, then vLLM's ``Attention`` over its paged KV cache
    constant-state mixers   ``StateLayer``: the layer's state lives in vLLM's state cache (a ``MambaBase`` layer with
                            its own backend, ``HF_MIXERS_STATE``), one slot per sequence in ``serving/state.py``'s
                            layout, so continuous batching, preemption and swapping are vLLM's; a step's sequences
                            run ``mixer.mix`` from their slots in a few batched calls (``_groups``) and write the
                            new states back. The call is the custom op ``vllm::hf_mixers_mix``: a compiled graph
                            keeps it whole.

Prefix caching is vLLM's "align" mode for state models (``SupportsMambaPrefixCaching``; vLLM turns it on with
``enable_prefix_caching``, its default): the scheduler ends a prompt's chunks on block boundaries, a slot is kept
per block and holds the state after that block's last token, and vLLM copies a cached block's slot into a request's
running slot (``get_mamba_state_copy_func``: every slot tensor whole). The layer itself only reads and writes the
slot vLLM hands it, as without caching: a state after a prefix is the same tensors whichever call computed it.

Refused by name, with the reason (``servable_reason``): mixers whose decode cache keeps tokens (Sessa's, GLTM's
growing patterns'), and models mixing two kinds of constant-state layer
(vLLM sizes every state slot of a model alike). Tensor and pipeline parallelism are not supported: one device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata, BaseMambaAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..core.registry import get_mixer
from ..model.modeling import MixerForCausalLM
from . import ATTENTION, STATE_BACKEND as BACKEND_NAME, register, servable_reason, state_window
from .state import StateLayout, pack, state_layout, unpack



@dataclass
class MixerStateMetadata(BaseMambaAttentionMetadata):
    """vLLM's per-step batch description for state layers: decodes first, then prefills with their slots."""


class MixerStateMetadataBuilder(BaseMambaAttentionMetadataBuilder[MixerStateMetadata]):
    metadata_cls = MixerStateMetadata


class MixerStateBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "HF_MIXERS_STATE"

    @staticmethod
    def get_builder_cls() -> type[MixerStateMetadataBuilder]:
        return MixerStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


register()  # idempotent: vLLM has called it in this process already, a direct import has not
STATE_BACKEND = MambaAttentionBackendEnum[BACKEND_NAME]


_LAYOUTS: dict = {}


def layout_for(config, dtype: torch.dtype) -> StateLayout:
    """The state slot of ``config``'s constant-state layers, from a small warm call of one of them (built alone,
    on the CPU, once per config and dtype)."""
    key = (config.to_json_string(use_diff=False), dtype)
    if key not in _LAYOUTS:
        index = next(i for i, kind in enumerate(config.layer_types) if kind not in ATTENTION)
        with torch.device("cpu"):
            mixer = get_mixer(config.layer_types[index]).mixer_class(config, index).to(dtype)
            rotary = LlamaRotaryEmbedding(config=config)
        _LAYOUTS[key] = state_layout(mixer, rotary, state_window(config))
    return _LAYOUTS[key]


class StateLayer(MambaBase, nn.Module):
    """vLLM's view of one constant-state layer: its state shapes and dtypes, and the per-sequence calls."""

    def __init__(self, mixer, layout: StateLayout, prefix: str):
        super().__init__()
        self.__dict__["mixer"] = mixer  # not a submodule: its parameters keep their names in the block
        self.layout, self.prefix = layout, prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self):
        return self.layout.shapes

    def get_state_dtype(self):
        return self.layout.dtypes

    @property
    def mamba_type(self):
        return STATE_BACKEND

    def forward(self, hidden_states, cos, sin):
        output = torch.empty_like(hidden_states)
        torch.ops.vllm.hf_mixers_mix(hidden_states, cos, sin, output, self.prefix)
        return output

    def mix_sequences(self, hidden_states, cos, sin, output) -> None:
        """The batch's sequences from their slots: (N, D) tokens, in groups that run as one ``mix`` call each."""
        metadata = get_forward_context().attn_metadata
        metadata = None if metadata is None else metadata.get(self.prefix)
        if metadata is None:  # vLLM's profiling run: no sequences, no states
            out, _, _ = self.mixer.mix(hidden_states[None], (cos[None], sin[None]))
            output.copy_(out[0])
            return
        for spans, flags in _groups(metadata, self.kv_cache[-1]):
            tokens, real = _left_padded(spans, hidden_states.device)  # (B, T) token rows, real ones
            mask = None if bool(real.all()) else real
            slots = [slot for _, _, slot, _ in spans]
            state, history = (None, None) if flags is None else unpack(self.layout, self.kv_cache, slots, flags)
            cos_b = torch.where(real[..., None], cos[tokens], 1.0)  # padding: position 0's rotation
            sin_b = torch.where(real[..., None], sin[tokens], 0.0)
            out, state, history = self.mixer.mix(hidden_states[tokens] * real[..., None], (cos_b, sin_b), mask,
                                                 state, history)
            pack(self.layout, (state, history), self.kv_cache, slots)
            output[tokens[real]] = out[real]


def _spans(metadata) -> list[tuple[int, int, int, bool]]:
    """(first token, end, state slot, continues a state) of each sequence, in vLLM's token order: the decodes (one
    token each; a one-token prompt is one too, with nothing computed before it), then the prefills (a prompt, or
    a chunk of one)."""
    spans = []
    if metadata.num_decodes:
        slots = metadata.state_indices_tensor_d
        slots = (slots[:, 0] if slots.dim() > 1 else slots)[:metadata.num_decodes].tolist()
        computed = (metadata.seq_lens[:metadata.num_decodes] > 1).tolist()  # tokens before this one
        spans += [(row, row + 1, slot, bool(before)) for row, (slot, before) in enumerate(zip(slots, computed))]
    if metadata.num_prefills:
        offset = metadata.num_decode_tokens
        starts = metadata.query_start_loc_p.tolist()
        slots = metadata.state_indices_tensor_p
        slots = (slots[:, 0] if slots.dim() > 1 else slots)[:metadata.num_prefills].tolist()
        continues = metadata.has_initial_states_p[:metadata.num_prefills].tolist()
        spans += [(offset + starts[i], offset + starts[i + 1], slots[i], bool(continues[i]))
                  for i in range(metadata.num_prefills)]
    return spans


_last_groups: tuple = (None, None)  # (metadata, its groups): every state layer of a step makes the same calls


def _groups(metadata, flags) -> list[tuple[list, tuple | None]]:
    """The step's sequences (``_spans``) as ``mix`` calls, each with its rows' presence flags (None: new
    sequences): every new sequence in one left-padded call (padding before a sequence's first token is how
    ``generate`` batches prompts, and leaves each state as its own call would), and the ones that continue a state
    by length and by their state's parts (``flags``: the slots' presence flags; padding inside a sequence would
    take a window's places). Worked out once a step, from the first state layer's slots: the layers of a model are
    of one kind and see the same tokens, so their states have the same parts (one host read a step, not one a
    layer)."""
    global _last_groups
    if _last_groups[0] is metadata:
        return _last_groups[1]
    spans = _spans(metadata)
    parts = flags[torch.tensor([slot for _, _, slot, _ in spans], device=flags.device)].tolist()  # one read
    groups = {}
    for span, part in zip(spans, parts):
        start, end, _, continues = span
        groups.setdefault((end - start, tuple(part)) if continues else None, []).append(span)
    _last_groups = (metadata, [(members, None if key is None else key[1]) for key, members in groups.items()])
    return _last_groups[1]


def _left_padded(spans, device):
    """(B, T) token rows of the spans, each right-aligned in T = the longest, and which of them are real tokens."""
    longest = max(end - start for start, end, _, _ in spans)
    rows = [[0] * (longest - end + start) + list(range(start, end)) for start, end, _, _ in spans]
    real = [[False] * (longest - end + start) + [True] * (end - start) for start, end, _, _ in spans]
    return torch.tensor(rows, device=device), torch.tensor(real, device=device)


def _mix(hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, output: torch.Tensor,
         layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].mix_sequences(hidden_states, cos, sin, output)


def _mix_fake(hidden_states, cos, sin, output, layer_name) -> None:
    return None


direct_register_custom_op(op_name="hf_mixers_mix", op_func=_mix, mutates_args=["output"], fake_impl=_mix_fake)


class AttentionLayer(nn.Module):
    """A kept attention layer: its own projections, q/k norms and RoPE, then vLLM's paged attention."""

    def __init__(self, attention, prefix: str, cache_config):
        super().__init__()
        self.__dict__["attention"] = attention  # its parameters stay the block's
        self.attn = Attention(attention.num_heads, attention.head_dim, attention.scaling,
                              num_kv_heads=attention.num_key_value_heads, cache_config=cache_config,
                              per_layer_sliding_window=attention.sliding_window, prefix=f"{prefix}.attn")

    def forward(self, hidden_states, cos, sin):
        query, key, value = self.attention.project(hidden_states[None], (cos[None], sin[None]))  # (1, H, N, hd)
        flat = lambda x: x[0].transpose(0, 1).flatten(1)  # noqa: E731  (N, H * hd)
        return self.attention.o_proj(self.attn(flat(query), flat(key), flat(value)))


class MixerForCausalLMvLLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """Every hf-mixers architecture in vLLM (module docstring)."""

    state_tensors = 0  # of the layout built in this process: get_mamba_state_copy_func's length

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        reason = servable_reason(config)
        if reason is not None:
            raise ValueError(f"hf-mixers cannot serve this model in vLLM: {reason}")
        if vllm_config.parallel_config.tensor_parallel_size > 1 or \
                vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("hf-mixers models are served on one device: tensor and pipeline parallel size 1")
        self.config = config
        causal_lm = MixerForCausalLM(config)
        self.model, self.lm_head = causal_lm.model, causal_lm.lm_head
        # what the folder's safetensors hold: the parameters and persistent buffers, before vLLM's layers join
        self.checkpoint_names = set(self.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        layout = None
        for index, (block, kind) in enumerate(zip(self.model.layers, config.layer_types)):
            name = f"model.layers.{index}.mixer"
            if kind in ATTENTION:
                block.serving = AttentionLayer(block.mixer, name, vllm_config.cache_config)
            else:
                layout = layout or layout_for(config, vllm_config.model_config.dtype)
                block.serving = StateLayer(block.mixer, layout, name)
        type(self).state_tensors = 0 if layout is None else len(layout.shapes)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        layout = layout_for(vllm_config.model_config.hf_config, vllm_config.model_config.dtype)
        cls.state_tensors = len(layout.shapes)
        return layout.shapes

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return layout_for(vllm_config.model_config.hf_config, vllm_config.model_config.dtype).dtypes

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec,) * cls.state_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        hidden_states = (self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds)[None]
        cos, sin = self.model.rotary_emb(hidden_states, positions[None])
        for block in self.model.layers:
            hidden_states = block.around(hidden_states, lambda x, block=block: block.serving(x[0], cos[0],
                                                                                             sin[0])[None])
        return self.model.norm(hidden_states)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's safetensors by their own names (the modules are the folder's): every parameter of the
        folder's model must be given, except a head tied to the embeddings; vLLM's own (its attention's scales)
        keep their initial values."""
        parameters = dict(self.named_parameters())
        targets = {**dict(self.named_buffers()), **parameters}
        loaded = set()
        for name, tensor in weights:
            if name not in self.checkpoint_names:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"the checkpoint's {name} {tuple(tensor.shape)} is not a tensor of this model")
            if targets[name].shape != tensor.shape:
                raise ValueError(f"the checkpoint's {name} is {tuple(tensor.shape)}, the model's "
                                 f"{tuple(targets[name].shape)}")
            with torch.no_grad():
                targets[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(self.checkpoint_names - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
        return set(parameters)  # every parameter: the checkpoint's, and vLLM's own at their initial values
