"""MixerConfig: a Llama-style backbone whose layers each pick a sequence mixer by ``layer_types[i]``.

One config class serves every mixer so hybrids need nothing special; each registered mixer also gets its own
``model_type`` (``SessaConfig`` is ``"sessa"``, derived from the registry) whose default ``layer_types`` use that
mixer everywhere. The mixers' options are not fields written here: every registered ``MixerSpec`` declares its own
(``sessa_chunk_size``, ``rsa_num_slots``, ...), with defaults, documentation and checks, and a config takes those of
the mixers its ``layer_types`` use, no others (a Sessa model's config.json holds no ``rsa_*`` field; the other
mixers' fields that older folders saved are dropped when they load). All validation runs when the config is built,
with the field named, not deep inside a forward.

Saved, the per-layer choice is written as ``mixer_types``: transformers' generic config (what ``AutoTokenizer`` and
pipelines read from a folder when hf_mixers is not installed) rejects ``layer_types`` entries it does not know.
Folders written before that (``layer_types`` naming mixers) still load.
"""

from __future__ import annotations

import sys

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from ..mixers import MIXERS  # noqa: F401  (importing registers the built-in mixers)
from ..core.registry import get_mixer, list_mixers, on_register
from ..kernels.conventions import COMPILE_MODES
from ..kernels.dispatch import BACKENDS as KERNEL_BACKENDS

BLOCK_TYPES = ("llama", "sessa")  # llama: norm-mixer-norm-MLP; sessa: the Sessa paper's gated block, no MLP


@strict(accept_kwargs=True)
class MixerConfig(PreTrainedConfig):
    r"""Configuration of a hf-mixers causal LM.

    Backbone fields follow ``LlamaConfig`` (plus ``qk_norm`` for Qwen3, ``attention_out_bias`` for Qwen2, whose
    o_proj has no bias while q/k/v do, and ``sliding_window`` for the "sliding_attention" layers a Mistral or Qwen
    teacher keeps). Mixer fields are prefixed by the mixer name.

    kernel_backend: "auto" (Triton kernels where they can run: CUDA with triton installed, else the PyTorch path,
        said once in the log), "triton" (the kernels or an error) or "torch" (always the PyTorch path). The
        environment variable HF_MIXERS_BACKEND overrides it (kernels/dispatch.py).
    compile_decode: run each one-token decode step of a block around a mixer that has a compiled step (RSA, the
        selective SSMs, VORT: every ``RecurrentMixer``; GLTM's evicting patterns; Sessa, with symbolic shapes) as
        one compiled graph, shared by every such block (hf_mixers/decode). On CPU a step of fixed shapes in fp32 is
        an AOTInductor library (decode/exported.py; built once per machine, kept in
        $HF_MIXERS_CACHE/compiled-steps; HF_MIXERS_EXPORTED_STEP=0 keeps torch.compile's), elsewhere torch.compile's
        step (compiled in each process).
        "auto" (the default): ``generate`` takes the compiled step where it was measured faster than the eager one
        (decode/engine.py ``auto_decode_refusal``: CPU, fp32, constant-size states, long enough generations), and
        every other call is eager. True (torch.compile's default mode) or a mode name from ``COMPILE_MODES``: every
        token step of such a block, in that mode; "reduce-overhead" replays the step as a CUDA graph on CUDA, and
        where every layer's step has fixed shapes the whole stack of blocks is one graph. False: eager.
        ``HF_MIXERS_COMPILE_DECODE=0`` in the environment makes every step eager. A runtime switch:
        ``model.config.compile_decode = ...`` on a loaded model.

    Mixer options: see each mixer's ``MixerSpec.options`` (``hf_mixers.get_mixer("rsa").options``) and its page in
    docs/mixers/.
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
    compile_decode: bool | str = "auto"

    default_mixer = "full_attention"  # class attribute: what layer_types defaults to

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if "mixer_types" in kwargs:  # the saved form of layer_types (see the module docstring)
            self.layer_types = kwargs.pop("mixer_types")
        if self.layer_types is None:
            self.layer_types = [self.default_mixer] * self.num_hidden_layers
        else:
            self.layer_types = list(self.layer_types)
        used = self.used_mixers()
        for spec in list_mixers():  # the options of the mixers its layers use; other mixers' (older folders) dropped
            for option in spec.options:
                value = kwargs.pop(option.name, option.default)
                if spec in used:
                    setattr(self, option.name, value)
        for spec in used:
            if spec.derived_defaults is not None:
                for name, value in spec.derived_defaults(self).items():
                    if getattr(self, name) is None:
                        setattr(self, name, value)
        # Validate before transformers' __post_init__: it silently renames legacy layer names ("mamba" ->
        # "linear_attention"), which would make the error name a word the user never wrote.
        validate_mixer_config(self)
        super().__post_init__(**kwargs)

    def used_mixers(self) -> list:
        """The specs of the mixers in ``layer_types``, in registration order: the config carries their options only."""
        kinds = set(self.layer_types)
        return [spec for spec in list_mixers() if spec.name in kinds]

    def validate_layer_type(self):
        # transformers' own check only knows its layer names; ours are checked in validate_mixer.
        pass

    def validate_mixer(self):
        # Run by transformers' strict validation (e.g. on save) as well as when the config is built.
        validate_mixer_config(self)

    def to_dict(self) -> dict:
        output = super().to_dict()
        if "layer_types" in output:
            output["mixer_types"] = output.pop("layer_types")
        used = self.used_mixers()  # e.g. a mixer whose layers were all restored to attention after the config was built
        for spec in list_mixers():
            if spec not in used:
                for option in spec.options:
                    output.pop(option.name, None)
        return output


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
    known = tuple(spec.name for spec in list_mixers())
    for index, kind in enumerate(config.layer_types):
        if kind not in known:
            fail(f"layer_types[{index}] = {kind!r} is not a known mixer; choose from {known}")
    if "sliding_attention" in config.layer_types and (
            not isinstance(config.sliding_window, int) or config.sliding_window < 1):
        fail(f"layer_types has 'sliding_attention' layers, so sliding_window must be a positive integer, "
             f"got {config.sliding_window!r}")
    if config.block == "sessa" and heads * config.head_dim != config.hidden_size:
        fail(f"block='sessa' needs num_attention_heads * head_dim == hidden_size "
             f"({heads} * {config.head_dim} != {config.hidden_size})")
    if config.head_dim % 2 and config.block == "llama":
        fail(f"head_dim ({config.head_dim}) must be even for rotary embeddings")
    if config.kernel_backend not in KERNEL_BACKENDS:
        fail(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {config.kernel_backend!r}")
    if not isinstance(config.compile_decode, bool) and config.compile_decode not in ("auto", *COMPILE_MODES):
        fail(f"compile_decode must be 'auto', true, false or a torch.compile mode {COMPILE_MODES}, got "
             f"{config.compile_decode!r}")
    used = config.used_mixers()
    for spec in used:
        for option in spec.options:
            value = getattr(config, option.name)
            problem = option.check(value) if option.check is not None else None
            if problem:
                fail(f"{option.name} {problem}, got {value!r}")
            limit = getattr(config, option.at_most) if option.at_most is not None else None
            if limit is not None and isinstance(value, int) and value > limit:
                fail(f"{option.name} ({value}) must be at most {option.at_most} ({limit}): a longer one never fills "
                     "and keeps a cache the size of a full attention's")
    for spec in used:
        problem = spec.validate(config) if spec.validate is not None else None
        if problem:
            fail(problem)
    # rope_parameters is None until transformers' __post_init__ fills it (also from legacy rope_theta/rope_scaling)
    if config.rope_parameters is not None and "rope_type" not in config.rope_parameters:
        fail(f"rope_parameters must be a dict with a 'rope_type' key, got {config.rope_parameters!r}")


def saved_layer_types(config: dict) -> list[str]:
    """The per-layer mixer names of a saved config.json (``mixer_types``; ``layer_types`` in older folders)."""
    return list(config.get("mixer_types") or config.get("layer_types") or [])


def config_class(name: str) -> type:
    """``<Title>Config`` of a registered mixer: a MixerConfig whose layers default to that mixer."""
    spec = get_mixer(name)
    if spec.is_teacher_attention:
        return MixerConfig
    return getattr(sys.modules[__name__], f"{spec.title}Config")


def _derive_config_class(spec) -> None:
    if spec.is_teacher_attention:
        return
    cls = type(f"{spec.title}Config", (MixerConfig,), {
        "__doc__": f"A MixerConfig whose layers are {spec.title} mixers unless ``layer_types`` says otherwise "
                   f"(model_type {spec.name!r}).",
        "__module__": __name__, "model_type": spec.name, "default_mixer": spec.name})
    setattr(sys.modules[__name__], cls.__name__, cls)


def _forget_config_class(spec) -> None:
    vars(sys.modules[__name__]).pop(f"{spec.title}Config", None)


on_register(_derive_config_class, _forget_config_class)
