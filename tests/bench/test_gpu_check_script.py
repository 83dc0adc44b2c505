"""bench/gpu_check.sh itself, fast: the plan (step order, limits that fit the budget), steps cut for time
or not selected recorded as "not run" and the RESULT "incomplete", a failing step, a signal mid-step, and
what is left in $OUT (only what a GPU machine sends back). None of these builds anything; the whole dry run
is tests/bench/test_gpu_check_dry_run.py (slow)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile

import pytest

from _paths import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.sh"
ORDER = ["build", "info", "tests", "forced", "bench", "trainer", "sanitizer"]
PARTS = {"core": ["build", "info", "tests", "forced", "bench"],
         "extra": ["build", "info", "trainer", "sanitizer"],
         "all": ORDER}
BUDGETS = {(False, "core"): 345, (False, "extra"): 240, (False, "all"): 450,
           (True, "core"): 620, (True, "extra"): 470, (True, "all"): 720}


def run(out, *args, timeout=240, **env):
    e = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    e.pop("GPU_CHECK_STEPS", None)
    e.pop("GPU_CHECK_BUDGET_S", None)
    e.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, cwd=str(ROOT),
                          timeout=timeout)


def summary(out):
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.parametrize("dry", [False, True])
@pytest.mark.parametrize("part", [None, "core", "extra", "all"])
def test_plan_orders_steps_by_value_and_fits_the_budget(tmp_path, dry, part):
    r = run(tmp_path, "--plan", *(["--dry-run"] if dry else []), *(["--part", part] if part else []))
    assert r.returncode == 0, r.stdout + r.stderr
    part = part or "core"   # the default: the first call of a lease
    budget = BUDGETS[dry, part]   # a dry run is bounded by CI, not by a lease
    m = re.search(rf"plan \({part}\): (.*) = (\d+)s of limits \+ (\d+)s reserve = (\d+)s, budget {budget}s", r.stdout)
    assert m, r.stdout
    limits = [(name, int(v)) for name, v in re.findall(r"(\w+) (\d+)", m.group(1))]
    assert [n for n, _ in limits] == PARTS[part]
    assert sum(v for _, v in limits) == int(m.group(2))
    assert int(m.group(2)) + int(m.group(3)) == int(m.group(4)) <= budget
    assert not list(tmp_path.iterdir())  # --plan runs and writes nothing


def test_the_two_calls_fit_a_lease_with_room_to_rerun_the_core():
    # 15 minutes in all, of which the machine's start takes up to 3: the core call twice (a rerun after a
    # fix), or the core and the extra call, each with its whole budget.
    lease, start = 15 * 60, 180
    assert start + 2 * BUDGETS[False, "core"] <= lease
    assert start + BUDGETS[False, "core"] + BUDGETS[False, "extra"] <= lease
    assert set(PARTS["core"]) | set(PARTS["extra"]) == set(ORDER)


def test_plan_over_a_small_budget_says_so(tmp_path):
    r = run(tmp_path, "--plan", GPU_CHECK_BUDGET_S=300)
    assert r.returncode == 1 and "over the budget by 45s" in r.stdout


@pytest.mark.parametrize("args, env, message", [
    (["--dry-run"], {"GPU_CHECK_STEPS": "build,nope"}, "unknown step 'nope'"),
    (["--dry-run"], {"GPU_CHECK_STEPS": "build,trainer"}, "unknown step 'trainer' (steps of --part core"),
    (["--dry-run"], {"GPU_CHECK_BUDGET_S": "7m"}, "whole seconds"),
    (["--part", "nope"], {}, "--part must be core, extra or all, got 'nope'"),
    (["--part"], {}, "--part needs core, extra or all"),
])
def test_bad_knobs_are_usage_errors(tmp_path, args, env, message):
    r = run(tmp_path, *args, **env)
    assert r.returncode == 2 and message in r.stderr


def test_budget_too_small_runs_nothing_and_says_incomplete(tmp_path):
    # earlier runs' leftovers of the old layout: removed, so that $OUT holds this run's files only
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "env.log").write_text("old")
    (tmp_path / "steps.tsv").write_text("old")
    (tmp_path / "dry-stage" / "ncclavg").mkdir(parents=True)
    r = run(tmp_path, "--dry-run", "--part", "all", GPU_CHECK_BUDGET_S=20, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.rstrip().splitlines()[-1]
    assert last == "  RESULT: incomplete: not run: " + ", ".join(ORDER) + " (budget)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "logs.tar.gz"]
    doc = summary(tmp_path)
    assert [s["step"] for s in doc["steps"]] == ORDER
    assert all(s["status"] == "not run" and s["reason"].startswith("budget: ") for s in doc["steps"])
    assert doc["ok"] is False and doc["result"].startswith("incomplete")
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert tar.getnames() == ["steps.tsv"]


def test_a_step_that_no_longer_fits_is_cut_and_the_rest_kept(tmp_path):
    # dry limits: bench 30 s, trainer 60 s; 12 s are kept for the end and 3 s for a kill. With a 58 s budget
    # bench fits when it starts within 13 s; trainer can never fit.
    r = run(tmp_path, "--dry-run", "--part", "all", GPU_CHECK_BUDGET_S=58, GPU_CHECK_STEPS="bench,trainer",
            timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = summary(tmp_path)
    status = {s["step"]: s for s in doc["steps"]}
    assert status["bench"]["status"] == "pass"
    assert status["trainer"]["status"] == "not run" and status["trainer"]["reason"].startswith("budget: ")
    assert status["build"]["reason"] == "not selected: GPU_CHECK_STEPS=bench,trainer"
    assert r.stdout.rstrip().splitlines()[-1] == (
        "  RESULT: incomplete: not run: build, info, tests, forced (not selected); trainer (budget); "
        "sanitizer (not selected)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_bench.json", "gpu_check.json", "logs.tar.gz"]
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["header"]["dry_run"] is True
    assert doc["bench"] and doc["files"] and doc["out_problems"] == []
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs/bench.log", "steps.tsv"]


@pytest.mark.slow   # builds and runs the sanitizer self-test (~8 s)
def test_the_sanitizer_detector_selftest_passes_and_a_failing_step_fails_the_run(tmp_path):
    # info without the build step has no staged build to import: a real failure
    r = run(tmp_path, "--dry-run", "--part", "all", GPU_CHECK_STEPS="info,sanitizer", timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    status = {s["step"]: s["status"] for s in summary(tmp_path)["steps"]}
    assert status["info"] == "fail" and status["sanitizer"] == "pass"
    last = r.stdout.rstrip().splitlines()[-1]
    assert last == "  RESULT: FAILED: info; not run: build, tests, forced, bench, trainer (not selected)"
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        info = tar.extractfile("logs/info.log").read().decode()
        sanitizer = tar.extractfile("logs/sanitizer.log").read().decode()
    assert "the build step did not run" in info
    assert "not supported here: Error: Device not supported" in sanitizer
    assert re.search(r"^\d+ checks on cpu, 0 wrong", sanitizer, re.M), sanitizer  # the driver, on CPU tensors


def test_foreign_files_in_out_that_would_not_come_back_fail_the_run(tmp_path):
    for i in range(7):
        (tmp_path / f"mine{i}.txt").write_text("x")
    r = run(tmp_path, "--dry-run", GPU_CHECK_BUDGET_S=20, timeout=120)
    assert r.returncode == 1
    last = r.stdout.rstrip().splitlines()[-1]
    assert last.startswith("  RESULT: FAILED: $OUT would not come back whole") and "9 files" in last


@pytest.mark.slow   # ~7 s: a dry-run step started, then signalled
def test_a_signal_stops_the_step_and_still_packs(tmp_path):
    e = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_STEPS="tests,bench")
    p = subprocess.Popen(["bash", str(SCRIPT), "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=e, cwd=str(ROOT))
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("== tests (limit"):
                p.send_signal(signal.SIGTERM)  # pytest takes seconds to start: the step is in flight
                break
        rest, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(lines) + rest
    assert p.returncode == 1, out
    doc = summary(tmp_path)
    status = {s["step"]: s for s in doc["steps"]}
    assert status["tests"]["status"] == "interrupted"
    assert status["bench"]["status"] == "not run" and status["bench"]["reason"].startswith("interrupted")
    assert out.rstrip().splitlines()[-1].startswith("  RESULT: FAILED: tests (interrupted)")
    assert sorted(p_.name for p_ in tmp_path.iterdir()) == ["gpu_check.json", "logs.tar.gz"]


@pytest.mark.parametrize("says, rc, status, reason, result", [
    ("========= Error: Device not supported", 1, "not run", "not supported here: Error: Device not supported",
     "incomplete: not run: build, info, trainer (not selected); sanitizer (not supported here)"),
    ("========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 1 error", 3, "fail", "",
     "FAILED: sanitizer; not run: build, info, trainer (not selected)"),
    # killed by its own limit before it finished, with no error found so far: it checked part of the
    # kernels, so "not run" (124 is what `timeout` returns for a command it stopped)
    ("========= COMPUTE-SANITIZER", 124, "not run",
     "timeout: memcheck did not finish the driver in 34s (no error found before that)",
     "incomplete: not run: build, info, trainer (not selected); sanitizer (timeout)"),
    # ... but an error it found before the limit is a failure
    ("========= Invalid __global__ read of size 16 bytes\n========= ERROR SUMMARY: 1 error", 124, "fail", "",
     "FAILED: sanitizer; not run: build, info, trainer (not selected)"),
])
def test_sanitizer_refused_timed_out_or_finding(tmp_path, says, rc, status, reason, result):
    # the GPU run's sanitizer step (part extra) against a stand-in compute-sanitizer on PATH
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho '========= COMPUTE-SANITIZER'\nprintf '%s\\n' \"{says}\"\nexit {rc}\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = run(out, "--part", "extra", GPU_CHECK_STEPS="sanitizer",
            PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = summary(out)
    san = next(s for s in doc["steps"] if s["step"] == "sanitizer")
    assert san["status"] == status and (san.get("reason") or "") == reason, san
    assert doc["result"] == result and doc["dry_run"] is False and doc["part"] == "extra"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "logs.tar.gz"]
