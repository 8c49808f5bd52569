"""The code's structure (docs/architecture.md): imports run one way between the layers, and no module imports itself
back through others, at the top of a file or inside a function.

Read from the source with ``ast``, as installed: kernels/, conversion/, recipes/ and model_cards/ are
``hf_mixers.<name>``. A package importing its own children (``reproduce/__init__.py`` collecting its claims) is not a
circle when the children import only the names the package defined before.
"""

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hf_mixers": "hf_mixers", "kernels": "hf_mixers.kernels", "conversion": "hf_mixers.conversion",
            "recipes": "hf_mixers.recipes", "model_cards": "hf_mixers.model_cards"}
# what each layer may import (besides itself); the top-level modules (hf_mixers/__init__, testing, ops) are tools
ALLOWED = {
    "kernels": set(),
    "core": {"kernels"},  # the window branch's attention is a kernel (kernels/local_attention.py)
    "tasks": set(),
    "decode": {"core", "kernels"},  # the compiled token step: a mixer's TokenStep (core) with its block around it
    "mixers": {"core", "kernels"},
    "model": {"core", "kernels", "mixers", "decode"},
    "common": {"core", "kernels", "mixers", "decode", "model"},
    "conversion": {"common", "core", "kernels", "mixers", "decode", "model"},
    "recipes": {"conversion", "common", "core", "kernels", "mixers", "decode", "model"},
    "model_cards": {"common", "core", "kernels", "mixers", "decode", "model"},
    "serving": {"core", "kernels", "mixers", "decode", "model"},  # imported by vLLM (its plugin entry point)
    "apps": {"recipes", "conversion", "model_cards", "common", "core", "kernels", "mixers", "decode", "model", "tasks",
             "testing", "ops", "__init__"},
}


def modules() -> dict:
    """{dotted name: (path, is_package)} of every module of the installed package."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if folder == "hf_mixers" and parts and parts[0] in PACKAGES:
                continue
            found[".".join([package, *parts])] = (path, is_package)
    return found


def imports(name: str, path: Path, is_package: bool, known: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its source (top level and inside functions)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        targets |= {target for target in candidates if target in known and target != name}
    return targets


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_run_one_way_between_the_layers():
    known = modules()
    wrong = []
    for name, (path, is_package) in known.items():
        source = layer(name)
        if source not in ALLOWED:
            continue
        for target in imports(name, path, is_package, known):
            if name.startswith(f"{target}."):
                continue  # a parent package (hf_mixers.__version__): initialised before any of its children
            if layer(target) != source and layer(target) not in ALLOWED[source]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against the layer order (docs/architecture.md):\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    known = modules()
    graph = {}
    for name, (path, is_package) in known.items():
        targets = imports(name, path, is_package, known)
        # a child importing its parent package (for a name it defines, e.g. `from . import claim`) is not an edge:
        # the package is already being initialised when it imports the child
        graph[name] = {target for target in targets if not name.startswith(f"{target}.")}
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                circles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_structure_check_sees_every_layer():
    assert {layer(name) for name in modules()} >= set(ALLOWED) and os.path.isdir(ROOT / "kernels")


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages by hand: a folder with an ``__init__.py`` left out works in the editable install
    of this checkout and is missing from a built wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(setuptools["packages"]), set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            folders.add(".".join((name, *relative)))
    assert not folders - listed, f"package folders missing from pyproject.toml's packages: {sorted(folders - listed)}"


def test_pyproject_allows_only_the_torch_the_suite_runs_on():
    """The compiled decode step (hf_mixers/decode) reads torch internals that change between releases, each with a
    tested fallback; pyproject.toml allows the one minor version constraints.txt pins and the suite runs on."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    torch_requirement = next(Requirement(item) for item in tomllib.loads((ROOT / "pyproject.toml").read_text())
                             ["project"]["dependencies"] if Requirement(item).name == "torch")
    pinned = next(Version(line.split("==")[1]) for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    major, minor = pinned.release[:2]
    assert pinned in torch_requirement.specifier
    neighbours = [Version(f"{major}.{minor - 1}.99"), Version(f"{major}.{minor + 1}.0")]
    assert not list(torch_requirement.specifier.filter(neighbours)), torch_requirement
