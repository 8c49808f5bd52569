"""The built-in recipes by name, and the docs of a recipe's fields.

The YAML files of this folder install with the package: ``hf-mixers distill base stage2_lora_kd smollm2_rsa_window``
names them without a path (``recipes/base.yaml`` from a checkout still works, and is found in the package when
there is no such file here). ``hf-mixers distill --list`` lists them with the first sentence of each file's comment.
``field_docs`` reads the comment beside or above each field of recipes/config.py's sections: the docs that
``--print-config`` shows beside the merged recipe (config.recipe_text).
"""

from __future__ import annotations

import inspect
import os
import re

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))


def builtin_recipes() -> dict[str, str]:
    """name -> the first sentence of the file's leading comment."""
    recipes = {}
    for file in sorted(os.listdir(RECIPES_DIR)):
        if file.endswith(".yaml"):
            comment = []
            with open(os.path.join(RECIPES_DIR, file), encoding="utf-8") as handle:
                for line in handle:
                    if not line.startswith("#") or line.startswith("#  "):  # the comment ends, or a command
                        break
                    comment.append(line.lstrip("#").strip())
            sentence = re.split(r"(?<=\.)\s", " ".join(comment), maxsplit=1)[0].rstrip(":")
            if len(sentence) > 110:
                sentence = sentence[:sentence.rfind(" ", 0, 108)] + " ..."
            recipes[file.removesuffix(".yaml")] = sentence
    return recipes


def recipe_path(given: str) -> str:
    """The file of a recipe argument: a path that exists, else a built-in recipe's name (``base``, ``base.yaml``,
    ``recipes/base.yaml``); a missing one is a FileNotFoundError that lists the built-in names."""
    if os.path.exists(given):
        return given
    builtin = os.path.join(RECIPES_DIR, os.path.basename(given).removesuffix(".yaml") + ".yaml")
    if os.path.dirname(given) in ("", "recipes") and os.path.isfile(builtin):
        return builtin
    names = sorted(file.removesuffix(".yaml") for file in os.listdir(RECIPES_DIR) if file.endswith(".yaml"))
    raise FileNotFoundError(f"{given}: cannot read the recipe: no such file, and not a built-in recipe (one of "
                            f"{', '.join(names)}; hf-mixers distill --list describes them)")


def field_docs(section_class) -> dict[str, str]:
    """field name -> its comment in the class's source: the one at the end of its line, else the comment lines just
    above it; '' -> the comment beside the class line. Empty without the source (an install without .py files)."""
    try:
        lines = inspect.getsource(section_class).splitlines()
    except (OSError, TypeError):
        return {}
    docs, above = {"": lines[0].partition("  # ")[2].strip()}, []
    for line in lines[1:]:
        if line.strip().startswith("#"):
            above.append(line.strip().lstrip("#").strip())
            continue
        field_line = re.match(r"    (\w+)\s*:", line)
        if field_line:
            docs[field_line.group(1)] = line.partition("  # ")[2].strip() or " ".join(above)
        above = []
    return docs
