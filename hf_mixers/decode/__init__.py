"""The compiled one-token decode step, in one place.

    switch.py    when a token runs through it: ``config.compile_decode``'s modes, HF_MIXERS_COMPILE_DECODE=0, and
                 which layers have a step (a mixer class's ``token_step``, core/mixer.py ``TokenStep``)
    engine.py    the block (or the whole stack) around the mixers' steps as one torch.compile graph, kept per mixer
                 classes, batch size and mode; "auto"'s choice for ``generate``; eager where it cannot be built
    exported.py  on a CPU, a block's fp32 step of fixed shapes as an AOTInductor library called without dynamo

A saved folder ships this package (model/export.py), so a model loaded with ``trust_remote_code=True`` decodes the same
way without hf_mixers installed.
"""
