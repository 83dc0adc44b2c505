"""bench/results/README.md indexes every results file, and docs/performance.md shows only what the
committed results say: each of its tables is the one bench/plot_results.py computes from them, and each
figure names the results files it was drawn from."""
from __future__ import annotations

import re

import pytest

from _paths import ROOT, load_script

RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"


@pytest.fixture(scope="module")
def plots():
    return load_script(ROOT / "bench" / "plot_results.py", "plot_results")


def indexed_names(text: str) -> set[str]:
    """The file names the index's tables give, with `X.md`, `.json` shorthand expanded to X.json."""
    names = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        stem = None
        for span in re.findall(r"`([^`]+)`", first_cell):
            if span.startswith(".") and stem is not None:
                names.add(stem + span)
            else:
                names.add(span)
                stem = span.rsplit(".", 1)[0]
    return names


def index_text() -> str:
    """The index: the page up to its History section (whose old tables name commands, not files)."""
    return INDEX.read_text().split("\n## History", 1)[0]


def results_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def test_every_results_file_is_in_the_index():
    names = indexed_names(index_text())
    missing = [f for f in results_files() if f not in names]
    assert not missing, f"bench/results/README.md does not index {missing}: add a row (what, when, machine, command)"


def test_the_index_names_no_file_that_is_not_there():
    gone = sorted(n for n in indexed_names(index_text()) if not (RESULTS / n).is_file())
    assert not gone, f"bench/results/README.md indexes files that do not exist: {gone}"


def test_the_shorthand_is_read_as_meant():
    text = "| `a-1.md`, `.json`, `.png` | x |\n| `d/b.json`, `d/c.json` | y |\n| not a row `z.md` |"
    assert indexed_names(text) == {"a-1.md", "a-1.json", "a-1.png", "d/b.json", "d/c.json"}


def test_every_figure_names_its_results_files(plots):
    lines = PERFORMANCE.read_text().splitlines()
    figures = [(i, m.group(1)) for i, ln in enumerate(lines) for m in [re.match(r"!\[[^\]]*\]\(([^)]+)\)", ln)] if m]
    by_path = {f"figures/{plots.figure_path(q).name}": q for q in plots.FIGURE_MAKERS}
    assert sorted(p for _, p in figures) == sorted(by_path), "every question has its figure, and only those"
    indexed = indexed_names(index_text())
    for i, path in figures:
        assert (PERFORMANCE.parent / path).is_file(), f"{path}: not committed (python bench/plot_results.py)"
        caption = " ".join(lines[i + 1:i + 4])
        named = re.findall(r"`bench/results/([^`]+)`", caption)
        assert named, f"the figure {path} names no results file in the lines under it"
        assert sorted(named) == sorted(plots.SOURCES[by_path[path]]), (path, named)
        for n in named:
            assert (RESULTS / n).is_file() and n in indexed, f"{path}: {n} is not a committed, indexed results file"


def test_every_table_is_computed_from_the_results(plots):
    page = PERFORMANCE.read_text()
    for question, make in plots.TABLES.items():
        table = make()
        assert table in page, (f"docs/performance.md: the {question} table differs from what "
                               f"`python bench/plot_results.py --tables` computes:\n{table}")
