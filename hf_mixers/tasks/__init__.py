"""Synthetic tasks of the papers the mixers implement, as seeded generators (the reproductions train on them).

One module per paper, named after its mixer (``tasks/<mixer>.py``; passkey.py for the RSA paper's passkey
retrieval), imported by name (``from hf_mixers.tasks.vort import entity_copy``): adding a mixer's tasks touches only
its own module. Every generator returns ``tokens`` (count, T) LongTensor and ``targets`` (count, T) LongTensor with
``IGNORE`` (-100, checks.py) where nothing is scored, and is deterministic for a given ``seed``; some return more
(the lag of each scored position, for bucketing). Each module's docstring says which parts of a task are the paper's
own definition and which are reconstructions where the paper is silent.
"""
