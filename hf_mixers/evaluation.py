"""Comparing a converted or distilled model with its teacher on held-out token blocks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def compare_to_teacher(teacher_model, student, heldout_ids, teacher_hidden=None, positions: int = 128) -> dict:
    """Held-out perplexity of both, mean KL(teacher || student) per token, and next-token top-1 agreement.

    ``teacher_hidden`` (N, T, D): the teacher's final hidden states if already computed. Logits are formed
    ``positions`` at a time from final hidden states: a full (T, vocab) fp32 logit matrix and its softmax copies
    would otherwise dominate peak memory for large vocabularies.
    """
    was_training = student.training
    student.eval()
    nll_teacher = nll_student = kl = agree = 0.0
    for row in range(heldout_ids.shape[0]):
        ids = heldout_ids[row:row + 1]
        hidden = (teacher_model.model(ids.to(teacher_model.device), use_cache=False).last_hidden_state
                  if teacher_hidden is None else teacher_hidden[row:row + 1])[0, :-1]
        student_hidden = student.model(ids.to(student.device), use_cache=False).last_hidden_state[0, :-1]
        for start in range(0, ids.shape[1] - 1, positions):
            span = slice(start, min(start + positions, ids.shape[1] - 1))
            teacher_logp = F.log_softmax(teacher_model.lm_head(hidden[span]).float(), -1).cpu()
            student_logp = F.log_softmax(student.lm_head(student_hidden[span]).float(), -1).cpu()
            targets = ids[0, 1:][span, None].cpu()
            nll_teacher -= teacher_logp.gather(-1, targets).sum().item()
            nll_student -= student_logp.gather(-1, targets).sum().item()
            kl += (teacher_logp.exp() * (teacher_logp - student_logp)).sum().item()
            agree += (teacher_logp.argmax(-1) == student_logp.argmax(-1)).sum().item()
    student.train(was_training)
    tokens = heldout_ids.shape[0] * (heldout_ids.shape[1] - 1)
    return {"teacher_perplexity": math.exp(nll_teacher / tokens), "student_perplexity": math.exp(nll_student / tokens),
            "kl_teacher_student": kl / tokens, "top1_agreement": agree / tokens}
