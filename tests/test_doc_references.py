"""The README and docs/ point readers at files and at Notes in them; a move that leaves a pointer behind
sends a reader to nothing. Every `path` they name under a top-level folder of the repository exists, and
every "Note [Name] in `path`" names a Note that file holds."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = tuple(p.name + "/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
PATH = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+)`")
NOTE_IN = re.compile(r"Note \[([^\]]+)\]\s+in\s+`([^`]+)`")


def _flat(text: str) -> str:
    """Text with comment markers and line breaks folded to single spaces (a Note's name may wrap)."""
    return re.sub(r"\s+", " ", re.sub(r"(^|\n)\s*(#|//|\*)", " ", text))


def test_named_paths_exist():
    missing = [f"{page.name}: {m.group(1)}" for page in PAGES for m in PATH.finditer(page.read_text())
               if m.group(1).startswith(TOP) and not (ROOT / m.group(1)).exists()]
    assert not missing, missing


def test_named_notes_are_in_the_files_named():
    wrong = []
    for page in PAGES:
        for m in NOTE_IN.finditer(_flat(page.read_text())):
            name, path = m.group(1), ROOT / m.group(2)
            if not path.is_file() or f"Note [{name}]" not in _flat(path.read_text()):
                wrong.append(f"{page.name}: Note [{name}] in {m.group(2)}")
    assert not wrong, wrong


def test_the_checks_see_pointers():
    # A regex that matched nothing would pass any docs; the pages do point at many files and Notes.
    text = "".join(_flat(p.read_text()) for p in PAGES)
    assert len(NOTE_IN.findall(text)) >= 20 and len(PATH.findall(text)) >= 50
