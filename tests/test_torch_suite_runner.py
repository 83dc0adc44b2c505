"""scripts/torch_suite.py: the gate lifting, the -k selection and the reading of failures (quick), and
a handful of suite tests on ncclavg at world size 2 (slow)."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts import torch_suite, torch_suite_lift as lift, torch_suite_report as report

ROOT = Path(__file__).resolve().parent.parent

# The gate shapes of torch's distributed_test.py, one per line as they appear there.
SAMPLE = '''\
        @skip_but_pass_in_sandcastle_if(BACKEND != "gloo", "Only gloo backend supports timeouts")
        @skip_but_pass_in_sandcastle_if(BACKEND != "gloo" and BACKEND != "nccl", "x")
            if BACKEND == 'gloo':
        @require_backend_is_available({"gloo"})
        @require_backend_is_available({"nccl"})
            if dist.get_backend(group_gloo) == "gloo":
            BACKEND_NAME = "gloo"
'''


def test_lift_source_rewrites_only_backend_gates_and_keeps_lines():
    report = lift.LiftReport()
    out = lift.lift_source(SAMPLE, "ncclavg", report)
    lines = out.splitlines()
    assert len(lines) == len(SAMPLE.splitlines())  # tracebacks keep the installed file's line numbers
    assert 'BACKEND not in ("gloo", "ncclavg"), "Only gloo' in lines[0]
    assert 'BACKEND not in ("gloo", "ncclavg") and BACKEND != "nccl"' in lines[1]
    assert 'if BACKEND in ("gloo", "ncclavg"):' in lines[2]
    assert lines[3].strip() == '@require_backend_is_available({"gloo", "ncclavg"})'
    # Not gates on the suite's BACKEND: left as they are.
    assert lines[4:] == SAMPLE.splitlines()[4:]
    assert (report.eq, report.ne, report.require) == (1, 2, 1)


def test_lifted_gates_evaluate_as_gloo_would():
    out = lift.lift_source('a = BACKEND == "gloo"\nb = BACKEND != "gloo"\n', "ncclavg")
    for backend, expect in (("ncclavg", (True, False)), ("gloo", (True, False)), ("mpi", (False, True))):
        ns = {"BACKEND": backend}
        exec(out, ns)
        assert (ns["a"], ns["b"]) == expect, backend


def test_lift_source_refuses_a_name_that_is_not_an_identifier():
    with pytest.raises(ValueError):
        lift.lift_source(SAMPLE, 'x") or ("y')


def test_feature_sets_gain_the_backend_where_gloo_is():
    cases = SimpleNamespace(backend_feature={"ddp": {"nccl", "gloo"}, "hpu": {"hccl"}, "plugin": set()})
    report = lift.LiftReport()
    lift.lift_feature_sets(cases, "ncclavg", report)
    assert cases.backend_feature == {"ddp": {"nccl", "gloo", "ncclavg"}, "hpu": {"hccl"}, "plugin": {"ncclavg"}}
    assert report.feature_sets == ["ddp", "plugin"]


def test_profiling_allowlists_gain_the_backend():
    module = SimpleNamespace(PROFILING_SUPPORTED_BACKENDS=["nccl", "gloo"],
                             SEND_RECV_PROFILING_SUPPORTED_BACKENDS=["nccl"])
    lift.lift_profiling(module, "ncclavg")
    assert module.PROFILING_SUPPORTED_BACKENDS == ["nccl", "gloo", "ncclavg"]
    assert module.SEND_RECV_PROFILING_SUPPORTED_BACKENDS == ["nccl"]


@pytest.mark.parametrize("expr, picked", [
    ("test_all_reduce_sum or test_broadcast", ["test_all_reduce_sum", "test_all_reduce_sum_cuda",
                                               "test_broadcast", "test_broadcast_group"]),
    ("test_all_reduce* and not cuda", ["test_all_reduce_sum", "test_all_reduce_max"]),
    ("(test_barrier* or test_broadcast) and group", ["test_broadcast_group", "test_barrier_group"]),
    ("TEST_BARRIER_GROUP", ["test_barrier_group"]),
    (None, None),
])
def test_keyword_matcher_reads_expressions_as_pytest_does(expr, picked):
    names = ["test_all_reduce_sum", "test_all_reduce_sum_cuda", "test_all_reduce_max", "test_broadcast",
             "test_broadcast_group", "test_barrier_group", "test_scatter"]
    match = torch_suite.keyword_matcher(expr)
    assert [n for n in names if match(n)] == (picked if picked is not None else names)


@pytest.mark.parametrize("expr", ["a b", "a or", "(a", "a and and b"])
def test_keyword_matcher_refuses_malformed_expressions(expr):
    with pytest.raises(ValueError):
        torch_suite.keyword_matcher(expr)


# A failure as MultiProcessTestCase reports it: the parent's traceback, then each rank's.
FAILURE = """\
Traceback (most recent call last):
  File "common_utils.py", line 3300, in wrapper
    method(*args, **kwargs)
RuntimeError: Process 1 exited with error code 10 and exception:
Traceback (most recent call last):
  File "common_distributed.py", line 1050, in run_test
    getattr(self, test_name)()
ValueError: first problem

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "distributed_test.py", line 2990, in test_sparse_all_reduce_sum
    dist.all_reduce(t)
RuntimeError: ncclavg: sparse all_reduce is not supported
more text of the message

Process 0 exited with error code 10 and exception:
Traceback (most recent call last):
  File "distributed_test.py", line 2990, in test_sparse_all_reduce_sum
AssertionError: rank zero
"""


def test_error_head_names_the_first_reported_rank_and_its_last_exception():
    assert torch_suite.error_head(FAILURE) == "rank 1: RuntimeError: ncclavg: sparse all_reduce is not supported"
    assert torch_suite.trim_detail(FAILURE).startswith("Process 1 exited")


def test_error_head_of_a_parent_side_failure():
    timed_out = ('Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
                 "RuntimeError: Process 0 terminated or timed out after 60.1 seconds\n")
    assert torch_suite.error_head(timed_out) == "RuntimeError: Process 0 terminated or timed out after 60.1 seconds"
    assert torch_suite.error_head("hung: no result 165 s after the test started") == \
        "hung: no result 165 s after the test started"


def test_summary_counts_and_keeps_reasons():
    results = {"test_a": {"outcome": "passed", "seconds": 1.0, "detail": ""},
               "test_b": {"outcome": "failed", "seconds": 2.0, "detail": FAILURE},
               "test_c": {"outcome": "skipped", "seconds": 0.0, "detail": "Only gloo backend supports timeouts"}}
    s = torch_suite.summarize({"backend": "ncclavg"}, {}, results, 3.0)
    assert s["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert s["tests"]["test_b"]["error"].startswith("rank 1: RuntimeError")
    assert s["tests"]["test_c"]["reason"] == "Only gloo backend supports timeouts"


def test_scrub_leaves_no_directory_of_the_machine():
    text = ('File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 3\n'
            'File "/home/me/ncclavg/ncclavg/process_group/cpu_collectives.py", line 9\n'
            "init file /tmp/torch-suite-x1/tmpq: gone")
    out = torch_suite.scrub(text, ("/home/me/ncclavg", "/tmp/torch-suite-x1"))
    assert out == ('File "torch/distributed/c10d.py", line 3\n'
                   'File "ncclavg/process_group/cpu_collectives.py", line 9\n'
                   "init file tmpq: gone")


def _run(backend, ws, lifted, tests):
    return {"config": {"backend": backend, "world_size": ws, "lift_gates": lifted, "selected": len(tests)},
            "wall_seconds": 60.0, "counts": {"passed": 0, "failed": 0, "skipped": 0}, "tests": tests}


def test_report_lists_what_passes_on_gloo_only_at_the_same_world_size():
    ok, bad = {"outcome": "passed"}, {"outcome": "failed", "error": "rank 0: RuntimeError: no | sparse"}
    runs = [_run("gloo", 2, False, {"test_a": ok, "test_b": ok, "test_c": bad}),
            _run("gloo", 3, False, {"test_a": bad}),
            _run("ncclavg", 2, True, {"test_a": ok, "test_b": bad, "test_c": bad}),
            _run("ncclavg", 3, True, {"test_a": bad})]
    rows = report.gloo_only_passes(runs)
    assert [(r["config"]["world_size"], name) for r, name, _, _ in rows] == [(2, "test_b")]
    md = report.render(runs, {"test_b": "gloo-only: no"})
    assert "| `test_b` | failed | rank 0: RuntimeError: no \\| sparse | gloo-only: no |" in md


@pytest.mark.slow
def test_a_handful_of_suite_tests_pass_on_ncclavg_at_world_size_2(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("expecttest")  # the suite's TestCase imports it
    out = tmp_path / "suite.json"
    # test_all_reduce_sum, test_all_reduce_sum_async, test_broadcast: CPU collectives on the default
    # group (the suite's _group tests want 3 ranks and skip at 2).
    keyword = "(test_all_reduce_sum or test_broadcast) and not (cuda or complex or object or _group)"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_suite.py"), "--backend", "ncclavg",
                           "--world-size", "2", "-k", keyword, "--timeout", "120", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    outcomes = {name: t["outcome"] for name, t in summary["tests"].items()}
    assert set(outcomes) == {"test_all_reduce_sum", "test_all_reduce_sum_async", "test_broadcast"}, outcomes
    assert all(o == "passed" for o in outcomes.values()), outcomes
