"""Synthetic tasks of the papers the mixers implement, as seeded generators (the reproductions train on them).

Every generator returns ``tokens`` (count, T) LongTensor and ``targets`` (count, T) LongTensor with ``IGNORE``
(-100) where nothing is scored, and is deterministic for a given ``seed``; some return more (the lag of each scored
position, for bucketing). Each module's docstring says which parts of a task are the paper's own definition and which
are reconstructions where the paper is silent.

    selective_ssm.py   MQAR, induction heads, KEEP n-th (Huang et al., ICML 2025): the paper's exact definitions
    sessa.py           SymbolSoup (a port of the authors' released generator) and Diffuse MQAR (reconstructed)
    gltm.py            copy, associative recall, multi-hop recall (the GLTM paper's Table 1 tasks)
    vort.py            Zipf-lag retrieval and entity label copy (the VORT paper's two synthetic tasks)
    passkey.py         passkey retrieval (the RSA paper's Table 4), in tokens (reconstructed)
    common.py          IGNORE and the argument checks
"""

from .common import IGNORE
from .gltm import associative_recall, copy_task, multi_hop_recall
from .passkey import passkey
from .selective_ssm import induction_heads, induction_targets, keep_nth, mqar
from .sessa import diffuse_mqar, symbol_soup
from .vort import entity_copy, zipf_lag_retrieval

__all__ = ["IGNORE", "mqar", "induction_heads", "induction_targets", "keep_nth", "symbol_soup", "diffuse_mqar",
           "copy_task", "associative_recall", "multi_hop_recall", "zipf_lag_retrieval", "entity_copy", "passkey"]
