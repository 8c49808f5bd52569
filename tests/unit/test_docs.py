"""The docs stay short, their links resolve and the files they name exist: README.md and docs/*.md (issue 69's
budgets). A page that grows past its budget is a page that became a run log; dated runs belong in git history or
docs/runs/."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = {"README.md": ("words", 1500), "docs/architecture.md": ("lines", 120),
           "docs/benchmarks.md": ("lines", 600), "docs/status.md": ("lines", 120)}
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", sorted(BUDGETS))
def test_each_page_keeps_its_budget(page):
    unit, budget = BUDGETS[page]
    text = (ROOT / page).read_text(encoding="utf-8")
    size = len(text.split()) if unit == "words" else len(text.splitlines())
    assert size <= budget, f"{page} is {size} {unit} (budget {budget})"


def test_no_status_cell_runs_over_sixty_words():
    for line in (ROOT / "docs/status.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            for cell in line.strip("|").split("|"):
                assert len(cell.split()) <= 60, f"docs/status.md: a cell of {len(cell.split())} words: {cell[:80]}"


def test_every_relative_link_names_a_file_that_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):  # an anchor on the same page, a URL
                continue
            if not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


# a file named in prose: a relative path with a folder and a known extension (placeholders such as OUT/ or R.yaml,
# written in capitals, are a reader's own files)
NAMED_FILE = re.compile(r"(?<![\w/.$~-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|yml|json|toml|txt|cfg|sh))(?![\w/])")
PLACEHOLDER = re.compile(r"[A-Z]+(\.\w+)*")


def test_every_file_the_docs_name_exists():
    """README.md and docs/ (dated run logs in docs/runs/ aside: they describe the tree as it was) name files that
    exist: from the repository root, from hf_mixers/ (module paths such as decode/engine.py), or from the page."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "runs" not in p.parts)]
    missing = []
    for page in pages:
        text = re.sub(r"https?://\S+", "", page.read_text(encoding="utf-8"))
        for name in sorted(set(NAMED_FILE.findall(text))):
            if any(PLACEHOLDER.fullmatch(part) for part in name.split("/")):
                continue
            if not any((base / name).exists() for base in (ROOT, ROOT / "hf_mixers", page.parent)):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "files the docs name that do not exist:\n" + "\n".join(missing)
