"""Synthetic tasks of the papers the mixers implement, as seeded generators (the reproductions train on them).

Every generator returns ``tokens`` (count, T) LongTensor and ``targets`` (count, T) LongTensor with ``IGNORE``
(-100) where nothing is scored, and is deterministic for a given ``seed``. Each module's docstring says which parts
of a task are the paper's own definition and which are reconstructions where the paper is silent.

    selective_ssm.py   MQAR, induction heads, KEEP n-th (Huang et al., ICML 2025)
"""

from .selective_ssm import IGNORE, induction_heads, induction_targets, keep_nth, mqar

__all__ = ["IGNORE", "mqar", "induction_heads", "induction_targets", "keep_nth"]
