"""Conversion of a pretrained Transformer (Llama, Mistral, Qwen2, Qwen3) into a mixer model.

    from hf_mixers.conversion import convert
    model, report = convert("smollm2-135m", "sessa", out="converted/")

Files: teacher.py (loading a folder, hub id, GGUF or the embedded default), families.py (what each supported
architecture maps to), converter.py (the layer-by-layer conversion and checks), report.py (ConversionReport).
"""

from .converter import convert, convertible_mixers
from .families import SUPPORTED_FAMILIES, UnsupportedArchitecture
from .report import ConversionReport, LayerReport
from .teacher import Teacher, TeacherLoadError, load_teacher

__all__ = ["convert", "convertible_mixers", "ConversionReport", "LayerReport", "SUPPORTED_FAMILIES",
           "UnsupportedArchitecture", "Teacher", "TeacherLoadError", "load_teacher"]
