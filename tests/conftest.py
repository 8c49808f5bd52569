"""Shared fixtures: offline, deterministic, tiny models built from configs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_mixers  # noqa: E402,F401  (registers the Auto classes)
from hf_mixers import MixerConfig, SessaConfig, SessaForCausalLM  # noqa: E402

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)


def tiny_config(cls=SessaConfig, **overrides):
    return cls(**{**TINY, **overrides})


def turn_on_feedback(model, std=0.5, bias=0.4, seed=0):
    """Give every Sessa layer a non-zero, token-dependent gain (the converted-at-init model has gamma == 0)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "gamma_proj"):
            with torch.no_grad():
                module.gamma_proj.weight.copy_(torch.randn(module.gamma_proj.weight.shape, generator=generator) * std)
                module.gamma_bias.fill_(bias)
    return model


def tiny_sessa_model(dtype=torch.float32, seed=0, feedback=True, **overrides):
    torch.manual_seed(seed)
    model = SessaForCausalLM(tiny_config(**overrides)).eval()
    if feedback:
        turn_on_feedback(model, seed=seed)
    return model.to(dtype)


def step_through(model, ids, mask, prefill):
    """Prefill ``prefill`` tokens, then decode the rest one at a time; returns the concatenated logits and cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache,
                        use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                                use_cache=True).logits)
    return torch.cat(logits, dim=1), cache


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


__all__ = ["TINY", "tiny_config", "tiny_sessa_model", "turn_on_feedback", "step_through", "MixerConfig", "SessaConfig"]
