"""The classes derived for each built-in mixer, bound to their names so that grep and IDEs find them.

model/config.py and model/modeling.py derive ``<Title>Config``, ``<Title>Model`` and ``<Title>ForCausalLM`` from the
registry when a mixer registers (a plugin's too: ``hf_mixers.<Title>Config`` reaches those). Generated from the
registry by tests/unit/test_derived_classes.py, which fails when this file is out of date; do not edit by hand.
"""

from .config import config_class
from .modeling import model_classes

RSAConfig = config_class("rsa")
RSAModel, RSAForCausalLM = model_classes("rsa")
SessaConfig = config_class("sessa")
SessaModel, SessaForCausalLM = model_classes("sessa")
SelectiveSSMConfig = config_class("selective_ssm")
SelectiveSSMModel, SelectiveSSMForCausalLM = model_classes("selective_ssm")
GLTMConfig = config_class("gltm")
GLTMModel, GLTMForCausalLM = model_classes("gltm")
VORTConfig = config_class("vort")
VORTModel, VORTForCausalLM = model_classes("vort")

__all__ = [
    "RSAConfig", "RSAModel", "RSAForCausalLM",
    "SessaConfig", "SessaModel", "SessaForCausalLM",
    "SelectiveSSMConfig", "SelectiveSSMModel", "SelectiveSSMForCausalLM",
    "GLTMConfig", "GLTMModel", "GLTMForCausalLM",
    "VORTConfig", "VORTModel", "VORTForCausalLM",
]
