"""The teacher's own attention as mixers: "full_attention" and "sliding_attention" (the kinds a converted model keeps).

The module is core/attention.py (the base of the mixers that keep the teacher's projections); this file only
declares the two layer kinds. A model of "full_attention" layers only gives the teacher's logits exactly.
"""

from ..core.attention import FullAttention
from ..core.registry import MixerSpec, register_mixer

def attention_lag_theory(mixer, inputs, position_embeddings=None) -> dict:
    return {"law": "power", "exponent": -1.0, "source": "attention's fixed-routing Jacobian alpha_{t,s} ~ 1/t"}


FULL_ATTENTION = register_mixer(MixerSpec(
    name="full_attention", mixer_class=FullAttention, title="FullAttention",
    summary="the teacher's causal softmax attention, unchanged (a KV cache that grows with the context)",
    attention_mask="causal", exact_at_init=True, lag_theory=attention_lag_theory))

SLIDING_ATTENTION = register_mixer(MixerSpec(
    name="sliding_attention", mixer_class=FullAttention, title="SlidingAttention",
    summary="the teacher's sliding-window attention (Mistral, Qwen), window = config.sliding_window",
    attention_mask="sliding", exact_at_init=True))
