"""Which converted layers stay attention (``keep_attention``): by at-init error or by marginal KL.

    auto:K   the K layers whose mixer output is farthest from the teacher attention's (relative L2, per layer)
    kl:K     the K layers whose restoration to attention lowers the whole student's KL(teacher || student) the most,
             each measured alone on calibration text (the marginal-KL selection of fla-org's hybrid-distillation)

A layer's own error says little about what it costs the model: errors compound through the layers after it, and
some layers matter more to the output than others. The marginal KL measures that cost directly, at the price of one
student forward per converted layer.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..common.measures import compare_to_teacher
from ..core.mixer import SequenceMixer


def worst_layers(errors: dict, k: int) -> list[int]:
    """auto:K: the K layers with the largest at-init error (ties: the lower index), sorted."""
    return sorted(sorted(errors, key=lambda i: (-errors[i], i))[:k])


def largest_drops(drops: dict, k: int) -> list[int]:
    """kl:K: the K layers whose restoration lowers the KL the most (ties: the lower index), sorted."""
    return sorted(sorted(drops, key=lambda i: (-drops[i], i))[:k])


class TeacherAttentionLayer(SequenceMixer):
    """A teacher's own attention module behind the mixer forward (no cache): the student with that layer restored."""

    def __init__(self, attention, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention = attention

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, token_mask=None,
                past_key_values=None, **kwargs):
        return self.attention(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask)[0]


@torch.no_grad()
def marginal_kl_drops(teacher_model, student, ids, layers, progress: bool = False) -> dict[int, float]:
    """{layer: KL(teacher || student) - KL with that layer alone restored to the teacher's attention}, mean per
    token over ``ids`` (N, T) (unpadded rows: the teacher attention runs causal without a mask)."""
    hidden = teacher_model.model(ids, use_cache=False).last_hidden_state
    base = compare_to_teacher(teacher_model, student, ids, teacher_hidden=hidden)["kl_teacher_student"]
    drops = {}
    for index in tqdm(layers, desc="ranking layers by marginal KL", disable=not progress, leave=False):
        block = student.model.layers[index]
        mixer = block.mixer
        block.mixer = TeacherAttentionLayer(teacher_model.model.layers[index].self_attn, student.config, index)
        try:
            restored = compare_to_teacher(teacher_model, student, ids, teacher_hidden=hidden)["kl_teacher_student"]
        finally:
            block.mixer = mixer
        drops[index] = base - restored
    return drops
