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
from ..core.attention import FullAttention
from ..core.mixer import SequenceMixer
from ..core.registry import TEACHER_ATTENTION
from .families import teacher_layer_kinds


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


def restore_attention(student, teacher_model, layers) -> None:
    """Converted layers ``layers`` of ``student`` become exact copies of their teacher attention again."""
    kinds = teacher_layer_kinds(teacher_model.config)
    for index in layers:
        attention = teacher_model.model.layers[index].self_attn
        reference = next(student.model.layers[index].mixer.parameters())
        student.model.replace_mixer(index, kinds[index], lambda: FullAttention.from_attention(
            attention, student.config, index).to(device=reference.device, dtype=reference.dtype))


def keep_by_marginal_kl(student, teacher_model, ids, count: int, report=None, when: str = "") -> list[int]:
    """kl:K on a student already converted (and perhaps trained a little): rank its converted layers by
    ``marginal_kl_drops`` on ``ids``, restore the ``count`` largest to attention, record it in the conversion
    ``report``; returns the restored layers."""
    converted = [i for i, kind in enumerate(student.config.layer_types) if kind not in TEACHER_ATTENTION]
    drops = marginal_kl_drops(teacher_model, student, ids, converted)
    chosen = largest_drops(drops, count)
    restore_attention(student, teacher_model, chosen)
    if report is not None:
        report.layers_kept = sorted(set(report.layers_kept) | set(chosen))
        report.layers_converted = [i for i in report.layers_converted if i not in chosen]
        report.keep_attention = f"kl:{count}"
        for layer in report.layers:
            layer.kl_drop = drops.get(layer.index)
            if layer.index in chosen:
                layer.kind = student.config.layer_types[layer.index]
                layer.note = f"kept as attention (kl:{count}{', ' + when if when else ''})"
    return chosen
