"""Family adapters: what of a teacher's config the converted model keeps, per supported architecture.

Every supported family is a Llama-shaped decoder (embed -> [norm, attention, norm, SwiGLU MLP] x L -> norm ->
lm_head) with the attention parameters under ``model.layers.i.self_attn``; the families differ only in biases,
q/k norms and sliding windows, which MixerConfig expresses with flags. The converted model names the attention
module ``mixer``, so ``student_name`` is the whole weight-name mapping.
"""

from __future__ import annotations

SUPPORTED_FAMILIES = {
    "llama": "Llama 2/3, SmolLM/SmolLM2, TinyLlama",
    "mistral": "Mistral",
    "qwen2": "Qwen2, Qwen2.5 (q/k/v bias)",
    "qwen3": "Qwen3 (q/k norm)",
}


class UnsupportedArchitecture(ValueError):
    pass


def check_family(config, where: str) -> str:
    """The teacher's family, or UnsupportedArchitecture listing what is supported."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        supported = "; ".join(f"{name} ({examples})" for name, examples in SUPPORTED_FAMILIES.items())
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures field"
        raise UnsupportedArchitecture(f"{where}: model_type {family!r} ({architectures}) is not supported; "
                                      f"supported families: {supported}")
    return family


def teacher_layer_kinds(config) -> list[str]:
    """Per layer, "full_attention" or "sliding_attention" (with config.sliding_window tokens)."""
    layers = config.num_hidden_layers
    if config.model_type == "mistral":
        return ["sliding_attention" if config.sliding_window is not None else "full_attention"] * layers
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    if getattr(config, "sliding_window", None) is None:
        kinds = ["full_attention" if kind == "sliding_attention" else kind for kind in kinds]
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedArchitecture(f"{config.model_type}: layer types {unknown} are not supported")
    return kinds


def backbone_fields(config) -> dict:
    """MixerConfig fields that reproduce the teacher's backbone (everything except the mixers)."""
    family = config.model_type
    heads = config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_act=config.hidden_act, max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range, rms_norm_eps=config.rms_norm_eps,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=dict(config.rope_parameters),
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    if family == "qwen2":  # q/k/v carry a bias, o_proj does not
        fields.update(attention_bias=True, attention_out_bias=False)
    else:
        bias = bool(getattr(config, "attention_bias", False))
        fields.update(attention_bias=bias, attention_out_bias=bias)
    fields["qk_norm"] = family == "qwen3"
    if "sliding_attention" in teacher_layer_kinds(config):
        fields["sliding_window"] = config.sliding_window
    return fields


def student_name(teacher_name: str) -> str:
    """Weight name in the converted model: the attention module is called ``mixer``."""
    return teacher_name.replace(".self_attn.", ".mixer.")
