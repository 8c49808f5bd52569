"""Remote-code export: a saved folder that loads with ``trust_remote_code=True`` where hf_mixers is not installed.

What is saved is the import closure (found with ``ast``) of the entry points that ``config.auto_map`` names and of
the mixers the config uses, built-in or registered from a user's own file. Each file is saved flat next to the
weights, its imports of hf_mixers rewritten at their own positions (``from ..kernels.feedback_solve import x`` ->
``from .feedback_solve import x``; in a user's file ``from hf_mixers import SequenceMixer`` -> ``from .mixer import
SequenceMixer``). The mixer registration list (hf_mixers/mixers/__init__.py) is written anew for the folder: it names
only the mixers the model uses. An import that cannot be rewritten, or two files that would get the same flat
name, is an error at save time. The saved files import only torch, transformers and each other; this module is one
of them, so a model loaded through remote code saves (and re-exports) itself the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

from ..core.registry import TEACHER_ATTENTION, get_mixer

ENTRY_POINTS = ("model.config", "model.modeling")  # what config.auto_map names
# flat names transformers users expect for the entry points; every other module is saved under its own last name
FLAT_ENTRY_NAMES = {"model.config": "configuration_hf_mixers", "model.modeling": "modeling_hf_mixers"}
REGISTRATION_LIST = "mixers"  # hf_mixers/mixers/__init__.py: generated in a saved folder
# a saved folder's possible files; never common/, apps/, recipes/...
SHIPPED = ("core", "mixers", "model", "kernels", "decode")
EXTERNAL = "ext:"  # key prefix of a module outside hf_mixers (a user's mixer), by its absolute name
IN_PACKAGE = __package__.split(".")[0] == "hf_mixers"  # False inside a remote-code folder (already flat)


def remote_auto_map(config) -> dict:
    """auto_map for ``config``'s class family: SessaConfig -> SessaModel / SessaForCausalLM, etc."""
    prefix = type(config).__name__.removesuffix("Config")
    config_file, modeling_file = FLAT_ENTRY_NAMES["model.config"], FLAT_ENTRY_NAMES["model.modeling"]
    return {"AutoConfig": f"{config_file}.{type(config).__name__}",
            "AutoModel": f"{modeling_file}.{prefix}Model",
            "AutoModelForCausalLM": f"{modeling_file}.{prefix}ForCausalLM"}


def _spec(module: str):
    """Import spec of a closure key: "core.cache" (in hf_mixers), "ext:name" (outside), a flat name (remote)."""
    if module.startswith(EXTERNAL):
        name = module[len(EXTERNAL):]
    elif IN_PACKAGE:
        name = f"hf_mixers.{module}"
    else:
        name = f"{__package__}.{FLAT_ENTRY_NAMES.get(module, module)}"
    try:
        return importlib.util.find_spec(name)
    except (ImportError, AttributeError, ValueError):  # "module.Name" where module is not a package
        return None


def _flat_name(module: str) -> str:
    if not IN_PACKAGE:
        return FLAT_ENTRY_NAMES.get(module, module)
    return FLAT_ENTRY_NAMES.get(module) or module.removeprefix(EXTERNAL).rsplit(".", 1)[-1]


def _where(module: str, node) -> str:
    return f"{module.removeprefix(EXTERNAL)} (line {node.lineno})"


def _public_module(name: str, module: str, node) -> str:
    """The hf_mixers module that defines ``hf_mixers.<name>`` (for ``from hf_mixers import name`` in a user file)."""
    value = getattr(sys.modules["hf_mixers"], name, None)  # only for a user's file, so hf_mixers is imported
    defined_in = getattr(value, "__module__", None) or ""
    if not defined_in.startswith("hf_mixers."):
        raise ValueError(f"remote-code export: {_where(module, node)} imports hf_mixers.{name}, which cannot be "
                         "mapped to a saved file; import it from the module that defines it")
    return defined_in.removeprefix("hf_mixers.")


def _imports(module: str, source: str, is_package: bool) -> list:
    """[(node, [(target module, [aliases])])] for every import of hf_mixers code in ``module``'s source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(alias.name.split(".")[0] == "hf_mixers" for alias in node.names):
                raise ValueError(f"remote-code export: {_where(module, node)}: 'import hf_mixers...' cannot be "
                                 "rewritten for a saved folder; write 'from hf_mixers... import name'")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        absolute = node.module if not node.level else None
        if module.startswith(EXTERNAL):  # a user's mixer file: one file, importing hf_mixers by absolute name
            if node.level:
                raise ValueError(f"remote-code export: {_where(module, node)}: a mixer module outside hf_mixers is "
                                 "saved as one file, so it cannot import its own package relatively")
            if absolute == "hf_mixers":
                groups = {}
                for alias in node.names:
                    groups.setdefault(_public_module(alias.name, module, node), []).append(alias)
                found.append((node, list(groups.items())))
            elif absolute and absolute.startswith("hf_mixers."):
                found.append((node, [(absolute.removeprefix("hf_mixers."), node.names)]))
            continue
        if absolute and absolute.split(".")[0] == "hf_mixers" and IN_PACKAGE:
            raise ValueError(f"remote-code export: {_where(module, node)} imports {absolute} by absolute name; "
                             "a saved folder has no hf_mixers package, so use a relative import")
        if not node.level:
            continue
        if IN_PACKAGE:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            target = ".".join(parts[:len(parts) - (node.level - 1)] + (node.module.split(".") if node.module else []))
        else:
            target = node.module or ""
        found.append((node, [(target, node.names)]))
    for node, groups in found:
        for target, aliases in groups:
            if IN_PACKAGE and target.split(".")[0] not in SHIPPED:
                raise ValueError(f"remote-code export: {_where(module, node)} imports hf_mixers.{target}, which a "
                                 f"saved folder does not ship (only {', '.join(SHIPPED)})")
            if target != REGISTRATION_LIST and _spec(target) is None:
                raise ValueError(f"remote-code export: {_where(module, node)} imports {target}, which cannot be found")
            modules = [a.name for a in aliases if _spec(f"{target}.{a.name}")]
            if modules:
                raise ValueError(f"remote-code export: {_where(module, node)} imports the module(s) {modules} from "
                                 f"{target or 'its package'}; import names from the module instead (from .x import "
                                 "name), the only form transformers copies with remote code")
    return found


def _mixer_module(name: str) -> tuple[str, str]:
    """(closure key of the module that holds mixer ``name``'s spec as a module-level name, that name)."""
    spec = get_mixer(name)
    candidates = [spec.mixer_class.__module__] + [m for m in list(sys.modules) if m != spec.mixer_class.__module__]
    for module_name in candidates:
        namespace = getattr(sys.modules.get(module_name), "__dict__", {})
        attribute = next((key for key, value in list(namespace.items()) if value is spec), None)
        if attribute is not None and module_name != "hf_mixers.mixers":  # the list re-exports the built-in specs
            key = module_name.removeprefix("hf_mixers.") if module_name.startswith("hf_mixers.") \
                else EXTERNAL + module_name
            return key, attribute
    raise ValueError(f"remote-code export: the MixerSpec of mixer {name!r} is not a module-level name of any module, "
                     "so a saved folder cannot register it; assign it in the mixer's module (SPEC = "
                     "register_mixer(MixerSpec(...)))")


def registration_list(layer_types) -> tuple[list[str], str]:
    """(closure keys of the used mixers' modules, the source of the saved folder's mixers.py)."""
    names = list(dict.fromkeys([*TEACHER_ATTENTION, *layer_types]))
    found = [(name, *_mixer_module(name)) for name in names]
    lines = ['"""The mixers this model uses: written by hf_mixers\' remote-code export, one import each."""', "",
             "from .registry import register_mixer"]
    lines += [f"from .{_flat_name(key)} import {attribute}" for _, key, attribute in found]
    lines += ["", f"MIXERS = ({', '.join(attribute for _, _, attribute in found)},)", "for _spec in MIXERS:",
              "    register_mixer(_spec)  # a no-op for modules that register themselves", ""]
    return [key for _, key, _ in found], "\n".join(lines)


def import_closure(roots) -> dict[str, str]:
    """Every module reached from ``roots`` through hf_mixers imports -> its flat file name (each name once)."""
    modules, todo = {}, list(roots)
    while todo:
        module = todo.pop()
        if module in modules:
            continue
        modules[module] = _flat_name(module)
        if module == REGISTRATION_LIST and IN_PACKAGE:
            continue  # generated for the folder, not copied
        spec = _spec(module)
        with open(spec.origin, encoding="utf-8") as handle:
            source = handle.read()
        for _, groups in _imports(module, source, spec.submodule_search_locations is not None):
            todo.extend(target for target, _ in groups)
    by_name = {}
    for module, flat in modules.items():
        if by_name.setdefault(flat, module) != module:
            raise ValueError(f"remote-code export: {by_name[flat].removeprefix(EXTERNAL)} and "
                             f"{module.removeprefix(EXTERNAL)} would both be saved as {flat}.py; rename one of them")
    return modules


def flatten_imports(source: str, module: str, modules: dict[str, str], is_package: bool = False) -> str:
    """``source`` of ``module`` with each hf_mixers import rewritten, at its own position, to the flat file names of
    ``modules`` (docstrings and comments are left alone)."""
    lines = source.splitlines(keepends=True)
    for node, groups in sorted(_imports(module, source, is_package), key=lambda found: -found[0].lineno):
        indent = lines[node.lineno - 1][:node.col_offset]
        if indent.strip():
            raise ValueError(f"remote-code export: {_where(module, node)}: put the import on a line of its own")
        statements = []
        for target, aliases in groups:
            if target not in modules:
                raise ValueError(f"remote-code export: {_where(module, node)} imports {target}, which is not in "
                                 "the saved folder")
            statements.append(ast.unparse(ast.ImportFrom(module=modules[target], names=aliases, level=1)))
        tail = lines[node.end_lineno - 1][node.end_col_offset:]
        lines[node.lineno - 1:node.end_lineno] = [indent + f"\n{indent}".join(statements) + tail]
    return "".join(lines)


def write_remote_code(save_directory: str, layer_types=()) -> list[str]:
    """Write the flat remote-code files of a model whose layers are ``layer_types`` into ``save_directory``;
    returns their names."""
    os.makedirs(save_directory, exist_ok=True)
    if IN_PACKAGE:
        mixer_modules, mixers_source = registration_list(layer_types)
        modules = import_closure([*ENTRY_POINTS, *mixer_modules])
    else:  # a remote-code folder saving itself: its mixers.py already names its mixers
        flat_entries = [FLAT_ENTRY_NAMES[entry] for entry in ENTRY_POINTS]
        modules, mixers_source = import_closure([*flat_entries, REGISTRATION_LIST]), None
    written = []
    for module, flat_name in sorted(modules.items()):
        if module == REGISTRATION_LIST and mixers_source is not None:
            source = mixers_source
        else:
            spec = _spec(module)
            with open(spec.origin, encoding="utf-8") as handle:
                source = handle.read()
            if IN_PACKAGE:
                source = flatten_imports(source, module, modules, spec.submodule_search_locations is not None)
        with open(os.path.join(save_directory, f"{flat_name}.py"), "w", encoding="utf-8") as handle:
            handle.write(source)
        written.append(f"{flat_name}.py")
    return written
