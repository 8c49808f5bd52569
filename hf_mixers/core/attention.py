"""The teacher's attention: exactly the causal self-attention of Llama, Mistral, Qwen2 and Qwen3.

It is a mixer itself ("full_attention", "sliding_attention": mixers/full_attention.py) and the shared base of the
mixers that keep the teacher's projections (Sessa attends with it, RSA projects with it).

Same parameter names (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm) and the same op order as transformers'
modeling files, so a teacher layer's weights load verbatim and the outputs agree bit for bit. The attention
kernel comes from transformers' ``ALL_ATTENTION_FUNCTIONS`` (sdpa, eager, flash_attention_2, ...), chosen by
``config._attn_implementation``.

The forward signature is every mixer's (core/mixer.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, eager_attention_forward

from ..kernels.rope import apply_rope
from .mixer import SequenceMixer

TEACHER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # what from_attention copies


class FullAttention(SequenceMixer):
    teacher_modules = TEACHER_MODULES

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's channels, before RoPE
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.use_rope = True  # a mixer may turn RoPE off on its attention branch (Sessa's NoPE option)
        # Mistral / Qwen sliding-window layers kept as attention: the window goes to the kernel (flash) and the mask
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        # q/k/v as one matrix product in the compiled token step (fuse_qkv); None until that step first runs
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self._qkv_prepared = None  # what keep_qkv_fused last decided on (_qkv_identity)

    # ----- q, k and v in one matrix product
    # A token step multiplies one row by three matrices; one product of their rows stacked reads the same bytes in
    # one call. The three weights become views of the stacked one, so it costs no memory, the state dict keeps its
    # names and an in-place update (an optimizer step, load_state_dict) reaches both. Used only without autograd (its
    # gradient would not reach q/k/v_proj), and not in fp32 on a CPU, where one product measured slower (below).

    def qkv_projections(self) -> tuple[nn.Linear, ...] | None:
        """q_proj, k_proj and v_proj when they can share one product: plain nn.Linear layers (not peft-wrapped) of
        one input, dtype and device; else None."""
        layers = tuple(getattr(self, name, None) for name in ("q_proj", "k_proj", "v_proj"))
        if not all(type(layer) is nn.Linear for layer in layers):
            return None
        kinds = {(layer.in_features, layer.weight.dtype, layer.weight.device, None if layer.bias is None else
                  layer.bias.dtype) for layer in layers}
        return layers if len(kinds) == 1 else None

    def qkv_fused(self) -> bool:
        """Whether ``qkv_weight`` / ``qkv_bias`` are what q/k/v_proj hold now (their tensors views of them)."""
        layers = self.qkv_projections()
        if self.qkv_weight is None or layers is None or (self.qkv_bias is None) != (layers[0].bias is None):
            return False
        sizes = [layer.out_features for layer in layers]
        stacked = [(self.qkv_weight, [layer.weight for layer in layers])]
        if self.qkv_bias is not None:
            stacked.append((self.qkv_bias, [layer.bias for layer in layers]))
        return all(tensor.data_ptr() == part.data_ptr() and tensor.shape == part.shape
                   for whole, tensors in stacked for tensor, part in zip(tensors, whole.split(sizes)))

    def fuses_qkv(self) -> bool:
        """Whether the compiled token step stacks q/k/v_proj here: they can share one product, and it is faster for
        their dtype and device: on a CPU one product beat three in bf16 and lost in fp32 (the compiled step of each
        windowed mixer converted from SmolLM2, measured in one process). fp64 fuses: the tests' dtype, so they check
        it."""
        layers = self.qkv_projections()
        return layers is not None and (layers[0].weight.device.type, layers[0].weight.dtype) != ("cpu", torch.float32)

    def fuse_qkv(self) -> None:
        """Stack q/k/v_proj's weights (and biases) into ``qkv_weight`` / ``qkv_bias`` and make theirs views of them;
        nothing when they are fused already or cannot be (``qkv_projections``)."""
        layers = self.qkv_projections()
        if layers is None or self.qkv_fused():
            return
        with torch.no_grad():
            self.qkv_weight = torch.cat([layer.weight for layer in layers])
            for layer, part in zip(layers, self.qkv_weight.split([layer.out_features for layer in layers])):
                layer.weight.data = part
            if layers[0].bias is not None:
                self.qkv_bias = torch.cat([layer.bias for layer in layers])
                for layer, part in zip(layers, self.qkv_bias.split([layer.out_features for layer in layers])):
                    layer.bias.data = part

    def unfuse_qkv(self) -> None:
        """Three products again. q/k/v_proj keep their views: the stacked storage lives on in them."""
        self.qkv_weight = self.qkv_bias = None
        self._qkv_prepared = None

    def _apply(self, fn, recurse=True):
        self.unfuse_qkv()  # .to() / .half() give each weight new storage: the stacked one would part from them
        return super()._apply(fn, recurse)

    def linear_qkv(self, hidden_states):
        """q_proj, k_proj and v_proj of (B, T, D): one product of the stacked weights when fused (and no autograd),
        else three."""
        if self.qkv_weight is not None and not torch.is_grad_enabled() and (
                torch.compiler.is_compiling() or self.qkv_fused()):  # the compiled step checks before it runs
            return F.linear(hidden_states, self.qkv_weight, self.qkv_bias).split(
                [layer.out_features for layer in (self.q_proj, self.k_proj, self.v_proj)], -1)
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)

    def _qkv_identity(self) -> tuple:
        """What decides fusing, cheaply: each projection's class (peft wraps them) and its tensors' addresses (a
        replaced weight), and whether autograd is on."""
        identity = [torch.is_grad_enabled()]
        for name in ("q_proj", "k_proj", "v_proj"):
            layer = self._modules.get(name)
            # nn.Linear's own tensors straight from its dict: getattr goes through Module.__getattr__, in Python
            tensors = getattr(layer, "_parameters", {})
            weight, bias = tensors.get("weight"), tensors.get("bias")
            identity += (type(layer), weight is not None and weight.data_ptr(), bias is not None and bias.data_ptr())
        return tuple(identity)

    def keep_qkv_fused(self) -> None:
        """Before each compiled token step (``TokenStep.prepare`` of the mixers built on this one): q/k/v fused, or
        fused again if a weight was replaced since (a host-side check the graph cannot make). It runs per layer and
        token, so the decision is kept and only its inputs are compared (several times cheaper than the full
        ``qkv_fused`` check)."""
        identity = self._qkv_identity()
        if identity == self._qkv_prepared:
            return
        if not self.qkv_fused():
            self.unfuse_qkv()
            if self.fuses_qkv() and not torch.is_grad_enabled():
                self.fuse_qkv()
        self._qkv_prepared = self._qkv_identity()  # fusing moved the weights: the addresses after it

    def project(self, hidden_states, position_embeddings, rotate: bool | None = None):
        """Queries (B, H, T, hd) and keys, values (B, Hkv, T, hd), after q/k norm and RoPE (``rotate``: None follows
        ``use_rope``; False returns them unrotated)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (x.view(hidden_shape) for x in self.linear_qkv(hidden_states))  # (B, T, H|Hkv, hd)
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, H|Hkv, T, hd)
        if self.use_rope if rotate is None else rotate:
            cos, sin = position_embeddings
            query, key = apply_rope(query, key, cos, sin, self.config.kernel_backend)
        return query, key, value

    def attend(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs):
        """Causal GQA attention before o_proj: (B, T, D) -> (B, T, H * head_dim); appends K/V to the cache."""
        input_shape = hidden_states.shape[:-1]
        query, key, value = self.project(hidden_states, position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        output, _ = attention_interface(
            self, query, key, value, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        return output.reshape(*input_shape, -1).contiguous()

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        return self.o_proj(self.attend(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs))

    # The pieces of a token step over a growing K/V cache (core/mixer.py TokenStep): attending over the cached K/V
    # where they lie. Sessa's step is built on them. Attention alone declares no token step (it decodes eagerly): its
    # compiled block decoded slower than the eager teacher on a CPU (one SDPA call leaves little to fuse, and each
    # compiled call pays its guards).
    def kv_ready(self, layer_cache) -> bool:
        return layer_cache.is_initialized and layer_cache.keys.shape[-2] > 0

    def kv_inputs(self, layer_cache, token_mask) -> tuple:
        """The token mask (B, P + 1) or None and the cached K/V (B, Hkv, P, d), as the cache holds them."""
        return token_mask, layer_cache.keys, layer_cache.values

    def attend_step(self, hidden_states, position_embeddings, token_mask, keys, values):
        """``forward`` for one token (B, 1, D) over the cached K/V -> (output (B, 1, D), its key, its value)."""
        query, key, value = self.project(hidden_states, position_embeddings)
        return self.o_proj(self.attend_one(query, key, value, keys, values, token_mask)), key, value

    def store_kv(self, layer_cache, key_value) -> None:
        layer_cache.update(*key_value)

    def attend_one(self, query, key, value, past_keys, past_values, token_mask=None):
        """``attend`` for one token over the cached K/V where they lie (a compiled step's: no mask tensor, no copy of
        the cache beside the new key). query (B, H, 1, d); key, value (B, Hkv, 1, d); past_keys, past_values (B, Hkv,
        P, d); token_mask (B, P + 1) bool or None -> (B, 1, H * d). One softmax over the past and the token itself,
        in fp32 (fp64 stays fp64)."""
        batch, kv_heads, past = query.shape[0], past_keys.shape[1], past_keys.shape[2]
        grouped = query.reshape(batch, kv_heads, self.num_key_value_groups, self.head_dim)  # (B, Hkv, g, d)
        logits = torch.cat([torch.matmul(grouped, past_keys.transpose(-1, -2)),  # (B, Hkv, g, P + 1)
                            (grouped * key[:, :, 0, None]).sum(-1, keepdim=True)], -1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * self.scaling
        if token_mask is not None:
            logits = logits.masked_fill(~token_mask[:, None, None, :], float("-inf"))
        weights = torch.softmax(logits, -1).to(past_values.dtype)
        output = torch.matmul(weights[..., :past], past_values) + weights[..., past:] * value[:, :, 0, None]
        return output.reshape(batch, 1, -1)  # (B, Hkv, g, d) -> (B, 1, H * d): heads in the order of query's


def attention_output_error(mixer: nn.Module, teacher: nn.Module, hidden_states, position_embeddings,
                           reference=None) -> float:
    """Relative L2 error ||mixer(h) - teacher(h)|| / ||teacher(h)|| of two attention-like layers on the same input.

    The teacher is called as a transformers attention layer (``teacher(h, position_embeddings, None)``, causal
    through SDPA) unless its output ``reference`` is given; the mixer with its uniform signature. One row at a time:
    a mixer's exact reference may hold (heads, T, T) tensors, which for a whole calibration batch would set a
    conversion's peak memory.
    """
    error = total = 0.0
    with torch.no_grad():
        for row in range(hidden_states.shape[0]):
            h = hidden_states[row:row + 1]
            embeddings = tuple(e if e.shape[0] == 1 else e[row:row + 1] for e in position_embeddings)
            expected = (teacher(h, position_embeddings=embeddings, attention_mask=None)[0] if reference is None
                        else reference[row:row + 1]).float()
            error += (mixer(h, embeddings).float() - expected).square().sum().item()
            total += expected.square().sum().item()
    return math.sqrt(error / total)
