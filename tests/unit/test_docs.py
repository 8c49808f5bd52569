"""The docs stay short and their links resolve: README.md and docs/*.md (issue 69's budgets). A page that grows past
its budget is a page that became a run log; dated runs belong in git history or docs/runs/."""

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
