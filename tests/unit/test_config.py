"""Config validation: each invalid combination fails when the config is built, naming the field."""

import pytest

from conftest import tiny_config
from hf_mixers import MixerConfig, SessaConfig


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=100, num_attention_heads=3), "num_attention_heads \\(3\\) does not divide hidden_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads \\(3\\) must divide num_attention_heads"),
    (dict(layer_types=["sessa", "mamba"]), "layer_types\\[1\\] = 'mamba' is not a known mixer"),
    (dict(layer_types=["sessa"]), "layer_types has 1 entries but num_hidden_layers is 2"),
    (dict(sessa_gamma_max=1.0), "sessa_gamma_max must lie in \\(0, 1\\)"),
    (dict(sessa_gamma_max=0.0), "sessa_gamma_max must lie in \\(0, 1\\)"),
    (dict(block="mlp"), "block must be one of"),
    (dict(sessa_solver="fast"), "sessa_solver must be one of"),
    (dict(layer_types=["rsa", "rsa"], rsa_compile_write="fast"),
     "rsa_compile_write must be one of \\(False, True, 'default', 'reduce-overhead'"),
    (dict(sessa_chunk_size=0), "sessa_chunk_size must be a positive integer"),
    (dict(sessa_feedback_dim=0), "sessa_feedback_dim must be a positive integer"),
    (dict(sessa_feedback_heads=3), "sessa_feedback_heads \\(3\\) must divide sessa_feedback_dim \\(64\\)"),
    (dict(hidden_size=60, num_attention_heads=4, head_dim=15), "head_dim \\(15\\) must be even"),
    (dict(block="sessa", head_dim=32), "block='sessa' needs num_attention_heads \\* head_dim == hidden_size"),
])
def test_invalid_configs_raise_named_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_defaults_and_round_trip():
    config = tiny_config()
    assert config.layer_types == ["sessa", "sessa"]
    assert config.head_dim == 16 and config.sessa_feedback_dim == 64
    assert config.sessa_gamma_bias_init == 0.0  # llama block: exact teacher at init
    assert tiny_config(block="sessa").sessa_gamma_bias_init == 1.0  # native block: official init
    assert MixerConfig(num_hidden_layers=3).layer_types == ["full_attention"] * 3
    restored = SessaConfig.from_dict(config.to_dict())
    assert restored.to_dict() == config.to_dict()


def test_qwen_style_fields():
    config = tiny_config(attention_bias=True, attention_out_bias=False, qk_norm=True, head_dim=32,
                         rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})
    assert config.attention_bias and not config.attention_out_bias and config.head_dim == 32
    assert tiny_config(attention_bias=True).attention_out_bias is True  # Llama semantics by default


def test_a_size_option_beyond_its_bound_is_refused_for_every_mixer():
    """Every option with an ``at_most`` bound (every mixer's local window) is refused beyond it, naming both."""
    from hf_mixers import config_class, list_mixers

    bounded = [(spec, option) for spec in list_mixers(convertible=True) for option in spec.options if option.at_most]
    assert {option.name for _, option in bounded} >= {"rsa_window", "vort_window", "selective_ssm_window"}
    for spec, option in bounded:
        fields = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=64)
        with pytest.raises(ValueError, match=rf"{option.name} \(65\) must be at most {option.at_most} \(64\)"):
            config_class(spec.name)(**fields, **{option.name: 65})
        assert getattr(config_class(spec.name)(**fields, **{option.name: 64}), option.name) == 64
