"""bench/newcomer.py: it times the README's trainer snippet as the README has it, alternates the two
runs, and writes the ratio with every run's time (runs replaced by a stand-in here: no timing)."""
from __future__ import annotations

import json

import pytest

from _paths import ROOT, load_script


@pytest.fixture
def bench():
    return load_script(ROOT / "bench" / "newcomer.py", "newcomer_bench")


def test_the_snippet_is_the_readmes_and_compiles(bench):
    code = bench.readme_snippet()
    compile(code, "snippet.py", "exec")
    assert "ncclavg.TowerTrainer(" in code and ".fit(" in code
    assert code in (ROOT / "README.md").read_text()


def test_rounds_alternate_and_the_results_say_the_ratio(bench, tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, env):
        name = "cli" if "train" in cmd else "snippet"
        calls.append(name)
        return {"wall_s": 2.0 if name == "cli" else 3.0, "summary": f"summary: {name}", "load_1m_after": 1.0}

    monkeypatch.setattr(bench, "run_once", fake_run)
    monkeypatch.setattr(bench, "machine", lambda: {"cpu": "c", "cores": 2, "python": "3", "torch": "t",
                                                   "ncclavg": "n", "platform": "p"})
    out = tmp_path / "r"
    assert bench.main(["--runs", "3", "--out", str(out)]) == 0
    assert calls == ["cli", "snippet", "cli", "snippet", "snippet", "cli", "cli", "snippet"]  # warm-up, then alternated
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["median_s"] == {"cli": 2.0, "snippet": 3.0} and r["ratio_snippet_over_cli"] == 1.5
    assert r["within_target"] is False and len(r["runs"]["cli"]) == 3
    assert "**1.50x** (target <= 1.3x: missed)" in out.with_suffix(".md").read_text()


def test_bad_rounds_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--runs", "0"])
