"""Remote-code export: a saved folder that loads with ``trust_remote_code=True`` where hf_mixers is not installed.

The modeling sources are copied flat next to the weights, with their package-relative imports rewritten
(``from .kernels.feedback_solve import`` -> ``from .feedback_solve import``), and ``config.auto_map`` names the
classes. The copied files import only torch and transformers. This module is itself one of the copied files, so
a model loaded through remote code saves (and re-exports) itself the same way.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile

# module (relative to the hf_mixers package) -> file name in the saved folder
REMOTE_MODULES = {
    "config": "configuration_hf_mixers",
    "modeling": "modeling_hf_mixers",
    "attention": "attention",
    "sessa": "sessa",
    "rsa": "rsa",
    "cache": "cache",
    "export": "export",
    "kernels.dispatch": "dispatch",
    "kernels.feedback_solve": "feedback_solve",
    "kernels.feedback_solve_triton": "feedback_solve_triton",
    "kernels.rsa_memory": "rsa_memory",
    "kernels.rsa_chunk_triton": "rsa_chunk_triton",
}
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)\.([\w.]+)(\s+import\b)", re.MULTILINE)


def remote_auto_map(config) -> dict:
    """auto_map for ``config``'s class family: SessaConfig -> SessaModel / SessaForCausalLM, etc."""
    prefix = type(config).__name__.removesuffix("Config")
    config_file, modeling_file = REMOTE_MODULES["config"], REMOTE_MODULES["modeling"]
    return {"AutoConfig": f"{config_file}.{type(config).__name__}",
            "AutoModel": f"{modeling_file}.{prefix}Model",
            "AutoModelForCausalLM": f"{modeling_file}.{prefix}ForCausalLM"}


def _source_path(module: str) -> str:
    # Inside the hf_mixers package the sources are hf_mixers.<module>; inside a remote-code folder they are
    # already flat (<package>.<file name>).
    in_package = __package__ == "hf_mixers"
    name = f"{__package__}.{module if in_package else REMOTE_MODULES[module]}"
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"remote-code export: cannot locate the source of {name}")
    return spec.origin


def flatten_imports(source: str, file_name: str) -> str:
    """Rewrite package-relative imports to the flat file names; refuse anything that would not resolve."""
    flat_names = set(REMOTE_MODULES.values())

    def rewrite(match):
        module = match.group(2)
        if module in REMOTE_MODULES:
            module = REMOTE_MODULES[module]
        elif module not in flat_names:
            raise ValueError(f"remote-code export: {file_name} imports '.{module}', which is not exported; "
                             f"add it to REMOTE_MODULES in export.py")
        return f"{match.group(1)}.{module}{match.group(3)}"

    flattened = _RELATIVE_IMPORT.sub(rewrite, source)
    if re.search(r"^\s*(from|import)\s+hf_mixers\b", flattened, re.MULTILINE):
        raise ValueError(f"remote-code export: {file_name} imports hf_mixers by absolute name; use relative imports")
    return flattened


def write_remote_code(save_directory: str) -> list[str]:
    """Write the flat remote-code files into ``save_directory``; returns the file names written."""
    os.makedirs(save_directory, exist_ok=True)
    written = []
    for module, flat_name in REMOTE_MODULES.items():
        with open(_source_path(module), encoding="utf-8") as handle:
            source = flatten_imports(handle.read(), flat_name)
        with open(os.path.join(save_directory, f"{flat_name}.py"), "w", encoding="utf-8") as handle:
            handle.write(source)
        written.append(f"{flat_name}.py")
    return written


def check_output_folder(out_dir: str, overwrite: bool) -> str:
    """The absolute output path; an existing non-empty folder is refused unless ``overwrite``."""
    out_dir = os.path.abspath(out_dir)
    if os.path.isfile(out_dir):
        raise FileExistsError(f"{out_dir} is a file, not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    return out_dir


def save_atomically(model, out_dir: str, tokenizer=None, overwrite: bool = False, extra=None, **save_kwargs) -> str:
    """Save ``model`` (and ``tokenizer``) into ``out_dir`` via a temporary sibling folder renamed when complete.

    ``extra(folder)`` may write more files (reports) into the folder before the rename. An existing non-empty
    ``out_dir`` is refused unless ``overwrite``; nothing half-written is ever left there.
    """
    out_dir = check_output_folder(out_dir, overwrite)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if extra is not None:
            extra(staging)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
