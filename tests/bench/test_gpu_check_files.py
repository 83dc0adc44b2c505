"""bench/gpu_check/gpu_check_files.py, the runner of gpu_check.sh's tests and forced steps, on a project of its own
(no GPU, no torch): a hung test and a crashed test each cost only themselves (the rest of the file is
rerun without them), every outcome lands in the group's junit XML as gpu_check_summary.py reads it, the
forced reruns label their cases, and a group that cannot start before the deadline is "not run"."""
from __future__ import annotations

import sys
import textwrap
import time

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def files():
    return load_script(ROOT / "bench" / "gpu_check" / "gpu_check_files.py", "gpu_check_files")


@pytest.fixture(scope="module")
def summary():
    return load_script(ROOT / "bench" / "gpu_check" / "gpu_check_summary.py", "gpu_check_summary")


def _project(tmp_path):
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "pytest.ini").write_text("[pytest]\n")
    (proj / "tests" / "test_mixed.py").write_text(textwrap.dedent("""
        import os, time

        def test_a():
            pass

        def test_b_hangs():
            time.sleep(120)

        def test_c_crashes():
            os.abort()

        def test_d():
            pass

        def test_e_fails():
            assert 1 == 2, "one is not two"
        """))
    return proj


@pytest.mark.slow   # ~5 s: a hung test is waited out
def test_a_hung_and_a_crashed_test_cost_only_themselves(files, summary, tmp_path):
    proj, out = _project(tmp_path), tmp_path / "out"
    out.mkdir()
    runner = files.Runner(out, time.monotonic() + 120, test_timeout=3, python=sys.executable, cwd=proj)
    runner.run_group({"name": "mixed", "args": ["tests/test_mixed.py"], "env": {}, "label": ""})
    got = summary.parse_junit(out / "mixed.xml")
    outcome = {c["id"]: (c["outcome"], c.get("message", "")) for c in got["cases"]}
    assert set(outcome) == {f"tests/test_mixed.py::{n}" for n in
                            ("test_a", "test_b_hangs", "test_c_crashes", "test_d", "test_e_fails")}, outcome
    assert outcome["tests/test_mixed.py::test_a"][0] == outcome["tests/test_mixed.py::test_d"][0] == "passed"
    assert outcome["tests/test_mixed.py::test_b_hangs"][0] == "error"
    assert outcome["tests/test_mixed.py::test_b_hangs"][1].startswith("hung: no result within 3s")
    assert outcome["tests/test_mixed.py::test_c_crashes"][0] == "error"
    assert outcome["tests/test_mixed.py::test_c_crashes"][1].startswith("crashed: the pytest process ended")
    assert outcome["tests/test_mixed.py::test_e_fails"] == ("failed", "AssertionError: one is not two")
    assert runner.failed == 3 and runner.cut == 0


def test_forced_cases_are_labelled_and_a_late_group_is_not_run(files, summary, tmp_path):
    proj, out = _project(tmp_path), tmp_path / "out"
    out.mkdir()
    runner = files.Runner(out, time.monotonic() + 60, test_timeout=30, python=sys.executable, cwd=proj)
    g = {"name": "forced-x", "args": ["tests/test_mixed.py::test_a"], "env": {"NCCLAVG_TEST_REDUCTION": "sum_divide:2"},
         "label": "NCCLAVG_TEST_REDUCTION=sum_divide:2"}
    runner.run_group(g)
    (case,) = summary.parse_junit(out / "forced-x.xml")["cases"]
    assert case == {"id": "tests/test_mixed.py::test_a [NCCLAVG_TEST_REDUCTION=sum_divide:2]", "outcome": "passed"}
    runner.deadline = time.monotonic() + 2   # less than a pytest process needs to start
    runner.run_group(dict(g, name="late"))
    (case,) = summary.parse_junit(out / "late.xml")["cases"]
    assert case["outcome"] == "skipped" and case["message"].startswith("not run: the step's time ran out")
    assert runner.cut == 1 and runner.cut_names == ["late"] and runner.failed == 0


def test_the_groups_cover_every_gpu_test_file_and_the_forced_reruns(files):
    tests = files.groups("tests")
    names = [g["args"][-1] for g in tests]
    assert "tests/comm/test_gpu_nccl.py" in names and "tests/test_gpu_average.py" in names
    assert all(g["args"][:2] == ["-m", "gpu"] for g in tests)
    forced = files.groups("forced")
    assert [g["env"] for g in forced] == [{"NCCLAVG_TEST_REDUCTION": "sum_divide:2"},
                                          {"NCCLAVG_TEST_REDUCTION": "premulsum:2"}]
    for g in forced:   # the ordering test and the Work-lifetime tests, which exist
        for nodeid in g["args"]:
            path, _, test = nodeid.partition("::")
            assert (ROOT / path).is_file() and (not test or f"def {test}(" in (ROOT / path).read_text())
    with pytest.raises(ValueError, match="kind"):
        files.groups("nope")


@pytest.mark.slow   # waits out a step deadline (~12 s)
def test_a_test_cut_by_the_steps_deadline_is_not_run_not_failed(files, summary, tmp_path):
    proj, out = _project(tmp_path), tmp_path / "out"
    out.mkdir()
    # the hang limit (60 s) is beyond the step's deadline (12 s from now, 4 s of them kept for the end)
    runner = files.Runner(out, time.monotonic() + 12, test_timeout=60, python=sys.executable, cwd=proj)
    runner.run_group({"name": "cut", "args": ["tests/test_mixed.py::test_a", "tests/test_mixed.py::test_b_hangs"],
                      "env": {}, "label": ""})
    outcome = {c["id"]: (c["outcome"], c.get("message", "")) for c in summary.parse_junit(out / "cut.xml")["cases"]}
    assert outcome["tests/test_mixed.py::test_a"][0] == "passed"
    assert outcome["tests/test_mixed.py::test_b_hangs"] == (
        "skipped", "not run: the step's time ran out while it ran (before its own hang limit)")
    assert runner.failed == 0 and runner.cut >= 1
