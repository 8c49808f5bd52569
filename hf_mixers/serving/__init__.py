"""Serving converted models with vLLM: the per-sequence state layout an engine keeps (state.py), the vLLM model
(vllm_model.py, imported by vLLM only) and ``register``, the plugin entry point vLLM calls in each of its processes
(``vllm.general_plugins`` in pyproject.toml)."""

from __future__ import annotations

VLLM_MODEL = "hf_mixers.serving.vllm_model:MixerForCausalLMvLLM"
STATE_BACKEND = "HF_MIXERS_STATE"  # the state layers' vLLM backend (vllm_model.MixerStateBackend)


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
