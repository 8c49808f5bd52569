"""hf_mixers/model/classes.py names every class derived for a built-in mixer, so that grep and IDEs find them; it is
generated from the registry. When this test fails, rewrite the file:
``.venv/bin/python tests/unit/test_derived_classes.py``.
"""

from pathlib import Path

import hf_mixers
from hf_mixers.mixers import MIXERS

CLASSES = Path(hf_mixers.__file__).parent / "model" / "classes.py"
HEADER = '''"""The classes derived for each built-in mixer, bound to their names so that grep and IDEs find them.

model/config.py and model/modeling.py derive ``<Title>Config``, ``<Title>Model`` and ``<Title>ForCausalLM`` from the
registry when a mixer registers (a plugin's too: ``hf_mixers.<Title>Config`` reaches those). Generated from the
registry by tests/unit/test_derived_classes.py, which fails when this file is out of date; do not edit by hand.
"""

from .config import config_class
from .modeling import model_classes
'''


def expected_source() -> str:
    lines, names = [HEADER], []
    for spec in MIXERS:
        if spec.is_teacher_attention:
            continue
        lines.append(f'{spec.title}Config = config_class("{spec.name}")')
        lines.append(f'{spec.title}Model, {spec.title}ForCausalLM = model_classes("{spec.name}")')
        names.append(f'    "{spec.title}Config", "{spec.title}Model", "{spec.title}ForCausalLM",')
    return "\n".join(lines + ["", "__all__ = [", *names, "]", ""])


def test_the_derived_classes_are_named_in_the_source():
    assert CLASSES.read_text(encoding="utf-8") == expected_source(), (
        f"{CLASSES} is out of date: run `.venv/bin/python {__file__}`")
    from hf_mixers.model import classes

    for name in classes.__all__:
        derived = getattr(classes, name)
        assert derived.__name__ == name and getattr(hf_mixers, name) is derived


if __name__ == "__main__":
    CLASSES.write_text(expected_source(), encoding="utf-8")
    print(f"wrote {CLASSES}")
