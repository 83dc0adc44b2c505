"""bench/trainer.py's time budget: past --budget-s it stops timing rounds (keeping at least MIN_REPS) and
says so in the JSON, so a machine slower than planned still gives a result inside gpu_check.sh's limit;
bad budgets and repetition counts are refused by name. Run in this process on a tiny model (the script
sets torch's thread count: restored after each test)."""
from __future__ import annotations

import json

import pytest

from _paths import ROOT, load_script

torch = pytest.importorskip("torch")
SMALL = ["--width", "64", "--layers", "2", "--towers", "2"]


@pytest.fixture
def bench():
    mod = load_script(ROOT / "bench" / "trainer.py", "trainer_bench")
    threads = torch.get_num_threads()
    yield mod
    torch.set_num_threads(threads)


def test_a_spent_budget_keeps_the_minimum_rounds_and_says_so(bench, tmp_path):
    out = tmp_path / "t.json"
    assert bench.main([*SMALL, "--reps", "8", "--budget-s", "1e-6", "--json", str(out)]) == 0
    sizes = json.loads(out.read_text())["sizes"]
    assert sizes["reps"] == 8 and sizes["reps_done"] == bench.MIN_REPS == 3 and sizes["cut_by_budget"] is True


def test_without_a_budget_every_round_runs(bench, tmp_path):
    out = tmp_path / "t.json"
    assert bench.main([*SMALL, "--reps", "4", "--json", str(out)]) == 0
    sizes = json.loads(out.read_text())["sizes"]
    assert sizes["reps_done"] == 4 and sizes["cut_by_budget"] is False


@pytest.mark.parametrize("args,name", [(["--reps", "0"], "--reps"), (["--budget-s", "0"], "--budget-s"),
                                       (["--budget-s", "nan"], "--budget-s")])
def test_bad_counts_are_refused_by_name(bench, tmp_path, capsys, args, name):
    with pytest.raises(SystemExit) as e:
        bench.main([*SMALL, *args, "--json", str(tmp_path / "t.json")])
    assert e.value.code == 2 and name in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
