"""MixerConfig: a Llama-style backbone whose layers each pick a sequence mixer by ``layer_types[i]``.

One config class serves every mixer so hybrids need nothing special; each mixer also gets its own registered
``model_type`` (``SessaConfig`` is ``"sessa"``) whose default ``layer_types`` use that mixer everywhere.
All validation lives in ``validate_mixer_config`` so a bad combination fails when the config is built, with the
field named, not deep inside a forward pass.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .kernels.dispatch import BACKENDS as KERNEL_BACKENDS

# Layer kinds a MixerConfig may name. "full_attention" is the teacher's own attention (exact Llama/Qwen math).
# "sliding_attention" is the teacher's windowed attention (Mistral, Qwen sliding layers), window = sliding_window.
MIXER_TYPES = ("full_attention", "sliding_attention", "sessa", "rsa")  # never "mamba"/"attention" (renamed)
ATTENTION_TYPES = ("full_attention", "sliding_attention")  # the teacher's own attention, kept as is
BLOCK_TYPES = ("llama", "sessa")  # llama: norm-mixer-norm-MLP; sessa: the paper's gated block (spec §2), no MLP
SESSA_SOLVERS = ("chunked", "dense")
RSA_CHOICES = {"rsa_assign_fn": ("softmax", "sigmoid"), "rsa_readout": ("sigmoid", "softmax_count"),
               "rsa_routing": ("relation", "elementwise", "none"), "rsa_state_init": ("prototypes", "zeros")}


@strict(accept_kwargs=True)
class MixerConfig(PreTrainedConfig):
    r"""Configuration of a hf-mixers causal LM.

    Backbone fields follow ``LlamaConfig`` (plus ``qk_norm`` for Qwen3, ``attention_out_bias`` for Qwen2, whose
    o_proj has no bias while q/k/v do, and ``sliding_window`` for the "sliding_attention" layers a Mistral or Qwen
    teacher keeps). Mixer fields are prefixed by the mixer name.

    kernel_backend: "auto" (Triton kernels where they can run: CUDA with triton installed, else the PyTorch path,
        said once in the log), "triton" (the kernels or an error) or "torch" (always the PyTorch path). The
        environment variable HF_MIXERS_BACKEND overrides it (kernels/dispatch.py).

    Sessa fields (shared/specs/sessa.md):
        sessa_feedback_dim: total width of the feedback queries/keys (``None`` = hidden_size, the official choice).
        sessa_feedback_heads: feedback heads; head h routes channel group h of f with its own matrix B_h
            (official: 1 head, one B shared by every channel). Must divide sessa_feedback_dim and hidden_size.
        sessa_feedback_bias: biases on the feedback q/k projection (official: True).
        sessa_gamma_max: gain bound, gamma = gamma_max * tanh(b + w.x), must lie in (0, 1).
        sessa_gamma_bias_init: initial b. ``None`` = 0.0 for the llama block (then gamma == 0 and a converted layer
            is exactly its teacher) and 1.0 for the native block (the official init, gamma ~ 0.76).
        sessa_forward_rope: RoPE on the forward branch (False = NoPE, official ``use_forward_rope=False``).
        sessa_solver: "chunked" (default, O(T*C) memory) or "dense" (the reference).
        sessa_chunk_size: query chunk size C of the chunked solve.

    RSA fields (shared/specs/rsa.md §4; state per KV head):
        rsa_num_levels, rsa_num_slots: memory levels and slots per level (paper: 4 x 64).
        rsa_assign_fn: slot assignment f: "softmax" over slots (default) or "sigmoid".
        rsa_readout: "sigmoid" (the paper's sigma(q.S)W) or "softmax_count" (count-aware softmax; level-0 cluster
            attention, the conversion choice).
        rsa_routing: how scores chain down the levels: "relation" (through the relation matrices, default),
            "elementwise" (the paper's literal product) or "none".
        rsa_threshold_init: initial theta = 1/z of the sparse read (``None`` = 0.5 for the sigmoid readout, 0.0 for
            softmax_count); learned, clamped to [0, rsa_threshold_max].
        rsa_chunk_size: chunk size C; references for assignments refresh every C real tokens, in training and decoding.
        rsa_state_init: "prototypes" (learned initial key slots with a pseudo-count) or "zeros" (paper-literal; slots
            can never separate, a warning says so).
        rsa_query_read: the RSA-q branch, sum_i (q W_qr_i / 16) @ SV_i.
        rsa_mlp_hidden: hidden width of the residual inter-level MLPs (``None`` = head_dim).
        rsa_decay: GLA-style data-dependent decay of the memory (off by default): before each token writes, the
            slot sums, masses and relations are multiplied by exp(logsigmoid(x W + b) / 16) per KV head (b starts at
            4, a half-life of ~600 tokens); the prototype prior does not decay.
        rsa_recompute_chunks: in training, recompute each chunk's intermediates in the backward pass instead of
            storing them (about 10x less activation memory for the RSA memory, 2-2.7x the time at T = 8192 on
            CPU, where the default path reads all chunks in one batched pass; off by default).
        rsa_compile_decode: run each single-token decode step of an RSA decoder block (norms, projections, memory,
            MLP) as one torch.compile graph shared by every RSA layer (about 2x faster per token on CPU; the first
            step compiles for 10-30 s). Off by default.
        rsa_short_conv: kernel size K of a causal depthwise convolution over the mixer input before the q/k/v
            projections (0 = off, the default; identity at init, so turning it on changes nothing until trained).
    """

    model_type = "hf_mixer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    block: str = "llama"
    kernel_backend: str = "auto"
    sessa_feedback_dim: int | None = None
    sessa_feedback_heads: int = 1
    sessa_feedback_bias: bool = True
    sessa_gamma_max: float = 0.999
    sessa_gamma_bias_init: float | None = None
    sessa_forward_rope: bool = True
    sessa_solver: str = "chunked"
    sessa_chunk_size: int = 128
    rsa_num_levels: int = 4
    rsa_num_slots: int = 64
    rsa_assign_fn: str = "softmax"
    rsa_readout: str = "sigmoid"
    rsa_routing: str = "relation"
    rsa_threshold_init: float | None = None
    rsa_threshold_max: float = 0.99
    rsa_chunk_size: int = 64
    rsa_state_init: str = "prototypes"
    rsa_query_read: bool = False
    rsa_mlp_hidden: int | None = None
    rsa_eps: float = 1e-6
    rsa_short_conv: int = 0
    rsa_decay: bool = False
    rsa_recompute_chunks: bool = False
    rsa_compile_decode: bool = False

    default_mixer = "full_attention"  # class attribute: what layer_types defaults to

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.layer_types is None:
            self.layer_types = [self.default_mixer] * self.num_hidden_layers
        else:
            self.layer_types = list(self.layer_types)
        if self.sessa_feedback_dim is None:
            self.sessa_feedback_dim = self.hidden_size
        if self.rsa_threshold_init is None:
            self.rsa_threshold_init = 0.5 if self.rsa_readout == "sigmoid" else 0.0
        if self.rsa_mlp_hidden is None:
            self.rsa_mlp_hidden = self.head_dim
        if self.sessa_gamma_bias_init is None:
            self.sessa_gamma_bias_init = 1.0 if self.block == "sessa" else 0.0
        # Validate before transformers' __post_init__: it silently renames legacy layer names ("mamba" ->
        # "linear_attention"), which would make the error name a word the user never wrote.
        validate_mixer_config(self)
        super().__post_init__(**kwargs)

    def validate_layer_type(self):
        # transformers' own check only knows its layer names; ours are checked in validate_mixer.
        pass

    def validate_mixer(self):
        # Run by transformers' strict validation (e.g. on save) as well as when the config is built.
        validate_mixer_config(self)


def validate_mixer_config(config: MixerConfig) -> None:
    """Raise ValueError naming the field for every invalid combination."""
    name = type(config).__name__

    def fail(message):
        raise ValueError(f"{name}: {message}")

    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        if not isinstance(getattr(config, field), int) or getattr(config, field) < 1:
            fail(f"{field} must be a positive integer, got {getattr(config, field)!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if config.head_dim is None:
        fail(f"num_attention_heads ({heads}) does not divide hidden_size ({config.hidden_size}); "
             "set head_dim explicitly if the heads are not hidden_size / num_attention_heads wide")
    if heads % kv_heads != 0:
        fail(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    if config.block not in BLOCK_TYPES:
        fail(f"block must be one of {BLOCK_TYPES}, got {config.block!r}")
    if len(config.layer_types) != config.num_hidden_layers:
        fail(f"layer_types has {len(config.layer_types)} entries but num_hidden_layers is {config.num_hidden_layers}")
    for index, kind in enumerate(config.layer_types):
        if kind not in MIXER_TYPES:
            fail(f"layer_types[{index}] = {kind!r} is not a known mixer; choose from {MIXER_TYPES}")
    if "sliding_attention" in config.layer_types and (
            not isinstance(config.sliding_window, int) or config.sliding_window < 1):
        fail(f"layer_types has 'sliding_attention' layers, so sliding_window must be a positive integer, "
             f"got {config.sliding_window!r}")
    if config.block == "sessa" and heads * config.head_dim != config.hidden_size:
        fail(f"block='sessa' needs num_attention_heads * head_dim == hidden_size "
             f"({heads} * {config.head_dim} != {config.hidden_size})")
    if config.head_dim % 2 and (config.block == "llama" or config.sessa_forward_rope):
        fail(f"head_dim ({config.head_dim}) must be even for rotary embeddings")
    if not 0.0 < float(config.sessa_gamma_max) < 1.0:
        fail(f"sessa_gamma_max must lie in (0, 1), got {config.sessa_gamma_max}")
    if not isinstance(config.sessa_feedback_dim, int) or config.sessa_feedback_dim < 1:
        fail(f"sessa_feedback_dim must be a positive integer, got {config.sessa_feedback_dim!r}")
    feedback_heads = config.sessa_feedback_heads
    if not isinstance(feedback_heads, int) or feedback_heads < 1:
        fail(f"sessa_feedback_heads must be a positive integer, got {feedback_heads!r}")
    if config.sessa_feedback_dim % feedback_heads or config.hidden_size % feedback_heads:
        fail(f"sessa_feedback_heads ({feedback_heads}) must divide sessa_feedback_dim ({config.sessa_feedback_dim}) "
             f"and hidden_size ({config.hidden_size})")
    if config.kernel_backend not in KERNEL_BACKENDS:
        fail(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {config.kernel_backend!r}")
    if config.sessa_solver not in SESSA_SOLVERS:
        fail(f"sessa_solver must be one of {SESSA_SOLVERS}, got {config.sessa_solver!r}")
    if not isinstance(config.sessa_chunk_size, int) or config.sessa_chunk_size < 1:
        fail(f"sessa_chunk_size must be a positive integer, got {config.sessa_chunk_size!r}")
    for field in ("rsa_num_levels", "rsa_num_slots", "rsa_chunk_size", "rsa_mlp_hidden"):
        if not isinstance(getattr(config, field), int) or getattr(config, field) < 1:
            fail(f"{field} must be a positive integer, got {getattr(config, field)!r}")
    for field, choices in RSA_CHOICES.items():
        if getattr(config, field) not in choices:
            fail(f"{field} must be one of {choices}, got {getattr(config, field)!r}")
    if not isinstance(config.rsa_short_conv, int) or config.rsa_short_conv < 0 or config.rsa_short_conv == 1:
        fail(f"rsa_short_conv must be 0 (off) or a kernel size >= 2, got {config.rsa_short_conv!r}")
    if not 0.0 <= config.rsa_threshold_init <= config.rsa_threshold_max < 1.0:
        fail(f"rsa_threshold_init ({config.rsa_threshold_init}) must lie in [0, rsa_threshold_max] and "
             f"rsa_threshold_max ({config.rsa_threshold_max}) below 1")
    # rope_parameters is None until transformers' __post_init__ fills it (also from legacy rope_theta/rope_scaling)
    if config.rope_parameters is not None and "rope_type" not in config.rope_parameters:
        fail(f"rope_parameters must be a dict with a 'rope_type' key, got {config.rope_parameters!r}")


class SessaConfig(MixerConfig):
    """A MixerConfig whose layers are Sessa mixers unless ``layer_types`` says otherwise (model_type "sessa")."""

    model_type = "sessa"
    default_mixer = "sessa"


class RSAConfig(MixerConfig):
    """A MixerConfig whose layers are RSA mixers unless ``layer_types`` says otherwise (model_type "rsa")."""

    model_type = "rsa"
    default_mixer = "rsa"
