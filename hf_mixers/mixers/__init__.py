"""The built-in mixers, one import each. A mixer module declares its ``MixerSpec`` and registers it itself; this list
is the one line a new built-in mixer adds (a mixer of your own registers from your code: docs/adding-a-mixer.md).
A saved model folder gets its own copy of this file, naming only the mixers that model uses (model/export.py).
"""

from .full_attention import FULL_ATTENTION, SLIDING_ATTENTION
from .gltm import GLTM
from .rsa import RSA
from .selective_ssm import SELECTIVE_SSM
from .sessa import SESSA
from .vort import VORT

MIXERS = (FULL_ATTENTION, SLIDING_ATTENTION, RSA, SESSA, SELECTIVE_SSM, GLTM, VORT)
