"""Serving converted models with vLLM: the per-sequence state layout an engine keeps (state.py), the vLLM model
(vllm_model.py, imported by vLLM only) and ``register``, the plugin entry point vLLM calls in each of its processes
(``vllm.general_plugins`` in pyproject.toml)."""

from __future__ import annotations

VLLM_MODEL = "hf_mixers.serving.vllm_model:MixerForCausalLMvLLM"
STATE_BACKEND = "HF_MIXERS_STATE"  # the state layers' vLLM backend (vllm_model.MixerStateBackend)
ATTENTION = ("full_attention", "sliding_attention")  # kept teacher layers: vLLM's paged attention


def servable_reason(config) -> str | None:
    """None when vLLM can serve every layer of ``config``, else which layer cannot, and why: a mixer whose decode
    cache keeps tokens (``constant_state`` is False: Sessa's, GLTM's growing patterns'), or two kinds of
    constant-state layer (vLLM gives every state slot of a model one size)."""
    from ..core.registry import get_mixer

    constant = set()  # the kinds of constant-state layer
    for index, kind in enumerate(config.layer_types):
        if kind in ATTENTION:
            continue
        if not get_mixer(kind).mixer_class.constant_state(config):
            return (f"layer {index} is {kind!r}, whose decode cache keeps tokens (a state that grows with the "
                    "context, or chosen past positions), not the fixed-size state a vLLM state slot holds")
        constant.add(kind)
    if len(constant) > 1:
        return f"layers of {sorted(constant)}: vLLM gives every state layer of a model one slot size"
    return None


def state_window(config) -> int:
    """The longest local window of ``config``'s mixers (their ``<mixer>_window`` options): a windowed state exists
    whole only past it."""
    from ..core.registry import get_mixer

    names = {option.name for kind in set(config.layer_types) - set(ATTENTION) for option in get_mixer(kind).options
             if option.name.endswith("_window")}
    return max([getattr(config, name) or 0 for name in names] + [0])


def architectures() -> list[str]:
    """The ``architectures`` names hf-mixers folders carry: MixerForCausalLM and each mixer's <Title>ForCausalLM."""
    from ..core.registry import list_mixers
    from ..model.modeling import MixerForCausalLM, model_classes

    return sorted({MixerForCausalLM.__name__} | {model_classes(spec.name)[1].__name__ for spec in list_mixers()})


def register() -> None:
    """Name the vLLM model for every hf-mixers architecture (lazily: vLLM imports it when a folder needs it) and the
    state layers' backend (every vLLM process unpickles the cache specs that name it); the import of
    hf_mixers.model registers the configs with transformers' AutoConfig, so a folder loads without
    ``trust_remote_code``."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if STATE_BACKEND not in MambaAttentionBackendEnum._member_map_:
        MambaAttentionBackendEnum.register(STATE_BACKEND, "hf_mixers.serving.vllm_model.MixerStateBackend")
    for name in architectures():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, VLLM_MODEL)
