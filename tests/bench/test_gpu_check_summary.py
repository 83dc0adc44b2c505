"""bench/gpu_check/gpu_check_summary.py, the end of bench/gpu_check.sh, on fake steps: the RESULT states (pass /
fail / not run / incomplete), the steps table, per-test outcomes from a real pytest junit XML, the $OUT
rules of a GPU machine, the packing of the logs, and the compute-sanitizer refusal detector. Fast: no
build, no GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def gc():
    return load_script(ROOT / "bench" / "gpu_check" / "gpu_check_summary.py", "gpu_check_summary")


def steps(*spec):
    """steps(("build", "pass"), ("wheel", "not run", "budget: 3s left")) -> the records read_steps makes."""
    out = []
    for name, status, *reason in spec:
        s = {"step": name, "status": status, "rc": 0 if status == "pass" else 1, "seconds": 1, "limit_s": 10}
        if reason:
            s["reason"] = reason[0]
        out.append(s)
    return out


# ------------------------------------------------------------------------------------------ verdict
def test_all_ran_and_passed(gc):
    assert gc.verdict(steps(("build", "pass"), ("info", "pass"))) == (True, "all steps passed")


def test_a_step_not_run_is_incomplete_never_passed(gc):
    ok, text = gc.verdict(steps(("build", "pass"), ("sanitizer", "not run", "not supported here: Device not supported"),
                                ("wheel", "not run", "budget: 3s left of 470s, the step needs 28s")))
    assert not ok
    assert text == "incomplete: not run: sanitizer (not supported here); wheel (budget)"


def test_not_run_steps_of_one_kind_are_grouped(gc):
    ok, text = gc.verdict(steps(*[(n, "not run", f"budget: {i}s left") for i, n in enumerate(("a", "b", "c"))]))
    assert not ok and text == "incomplete: not run: a, b, c (budget)"


def test_a_failure_wins_and_still_names_what_did_not_run(gc):
    ok, text = gc.verdict(steps(("build", "pass"), ("tests", "fail"), ("bench", "timeout"),
                                ("wheel", "not run", "budget: 1s left")))
    assert not ok
    assert text == "FAILED: tests, bench (timeout); not run: wheel (budget)"


@pytest.mark.parametrize("status", ["interrupted", "skipped", "weird"])
def test_any_other_status_is_a_failure(gc, status):
    ok, text = gc.verdict(steps(("build", "pass"), ("tests", status)))
    assert not ok and text.startswith("FAILED: tests")


def test_no_steps_and_out_problems(gc):
    assert gc.verdict([]) == (False, "incomplete: no step ran")
    ok, text = gc.verdict(steps(("build", "pass")), ["9 files (at most 8)", "x"])
    assert not ok and text.startswith("FAILED: $OUT would not come back whole (2 problems: 9 files")


def test_read_steps_keeps_reasons_with_colons_and_spaces(gc, tmp_path):
    tsv = tmp_path / "steps.tsv"
    tsv.write_text("build\tpass\t0\t12\t75\t\n"
                   "wheel\tnot run\t-\t0\t25\tbudget: 3s left of 470s, the step needs 28s\n\n")
    got = gc.read_steps(tsv)
    assert got == [{"step": "build", "status": "pass", "rc": 0, "seconds": 12, "limit_s": 75},
                   {"step": "wheel", "status": "not run", "rc": None, "seconds": 0, "limit_s": 25,
                    "reason": "budget: 3s left of 470s, the step needs 28s"}]
    assert gc.read_steps(tmp_path / "missing.tsv") == []


# ------------------------------------------------------------------------------------------ junit
def test_per_test_outcomes_from_a_real_pytest_run(gc, tmp_path):
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "pytest.ini").write_text("[pytest]\n")
    (proj / "tests" / "test_mix.py").write_text(textwrap.dedent('''
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2, "first line of the failure\\nsecond line"

        @pytest.mark.parametrize("x", [1])
        def test_skip(x):
            pytest.skip("no CUDA device: " + "x" * 400)

        class TestGroup:
            def test_in_class(self):
                pass
        '''))
    (proj / "tests" / "test_needs_pkg.py").write_text("import a_package_that_is_not_here_at_all\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                    f"--junitxml={xml}", "-o", "junit_family=xunit1", "tests"], cwd=proj, capture_output=True,
                   text=True, timeout=120)
    got = gc.parse_junit(xml)
    assert got["counts"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 1, "total": 5}
    by_id = {c["id"]: c for c in got["cases"]}
    assert by_id["tests/test_mix.py::test_ok"] == {"id": "tests/test_mix.py::test_ok", "outcome": "passed"}
    assert by_id["tests/test_mix.py::TestGroup::test_in_class"]["outcome"] == "passed"
    bad = by_id["tests/test_mix.py::test_bad"]
    assert bad["outcome"] == "failed" and "first line of the failure" in bad["message"]
    assert "second line" not in bad["message"]
    skip = by_id["tests/test_mix.py::test_skip[1]"]
    assert skip["outcome"] == "skipped" and skip["message"].startswith("no CUDA device")
    assert len(skip["message"]) <= gc.MESSAGE_CHARS
    errors = [c for c in got["cases"] if c["outcome"] == "error"]
    assert len(errors) == 1 and "test_needs_pkg" in errors[0]["id"]
    assert errors[0]["message"] == "ModuleNotFoundError: No module named 'a_package_that_is_not_here_at_all'"
    assert gc.parse_junit(tmp_path / "none.xml") is None
    (tmp_path / "broken.xml").write_text("<testsuites><testsuite")
    assert "unreadable" in gc.parse_junit(tmp_path / "broken.xml")["error"]


# ------------------------------------------------------------------------------------------ $OUT rules
def test_out_with_eight_plain_files_comes_back(gc, tmp_path):
    for i in range(7):
        (tmp_path / f"r-{i}.json").write_text("{}")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "deep_ok.txt").write_text("x")
    files, problems = gc.check_out(tmp_path)
    assert problems == [] and len(files) == 8
    assert {"name": "a/b/deep_ok.txt", "bytes": 1} in files


def test_out_problems_are_all_named(gc, tmp_path):
    for i in range(8):
        (tmp_path / f"r{i}.json").write_text("{}")
    (tmp_path / "bad name.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "too_deep.txt").write_text("x")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(gc.MAX_FILE_BYTES + 1)  # sparse: no disk used
    os.symlink(tmp_path / "r0.json", tmp_path / "link.json")
    files, problems = gc.check_out(tmp_path)
    text = "\n".join(problems)
    assert "'bad name.txt'" in text
    assert "a/b/c/too_deep.txt: 3 folders down" in text
    assert f"big.bin: {gc.MAX_FILE_BYTES + 1} bytes" in text
    assert "link.json: not a plain file" in text
    assert "11 files (at most 8)" in text
    _, problems = gc.check_out(tmp_path / "nowhere")
    assert problems


# ------------------------------------------------------------------------------------------ packing
def test_pack_caps_big_logs_keeping_head_and_tail(gc, tmp_path):
    keep = tmp_path / "keep"
    (keep / "logs").mkdir(parents=True)
    (keep / "logs" / "small.log").write_text("all of it\n")
    big = os.urandom(3 << 20)  # incompressible: the cap must shrink until the archive fits
    (keep / "logs" / "big.log").write_bytes(big)
    (keep / "steps.tsv").write_text("build\tpass\t0\t1\t10\t\n")
    info = gc.pack(keep, tmp_path / "logs.tar.gz", limit=1 << 20)
    assert info["bytes"] <= 1 << 20 and info["cap_bytes_per_file"] < 1 << 20
    assert info["members"] == ["logs/big.log", "logs/small.log", "steps.tsv"]
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert tar.extractfile("logs/small.log").read() == b"all of it\n"
        got = tar.extractfile("logs/big.log").read()
    cap = info["cap_bytes_per_file"]
    assert got.startswith(big[:cap // 4]) and got.endswith(big[-(cap - cap // 4):])
    assert b"bytes cut here" in got


# ------------------------------------------------------------------------------------------ sanitizer
@pytest.mark.parametrize("line", [
    "========= Error: Device not supported",
    "========= COMPUTE-SANITIZER ERROR: Device is not supported",
    "compute-sanitizer is not supported on this platform",
    "========= Error: No supported CUDA devices found",
])
def test_sanitizer_refusals_are_recognised(gc, line):
    assert gc.sanitizer_refusal(f"========= COMPUTE-SANITIZER\n{line}\n2 passed in 3.1s\n")


@pytest.mark.parametrize("text", [
    "========= COMPUTE-SANITIZER\n2 passed in 3.1s\n========= ERROR SUMMARY: 0 errors\n",
    "========= Invalid __global__ write of size 4 bytes\n=========     at copy_chunk+0x90\n"
    "========= ERROR SUMMARY: 1 error\n",
])
def test_sanitizer_findings_are_not_refusals(gc, text):
    assert gc.sanitizer_refusal(text) is None


def test_refused_command(gc, tmp_path, capsys):
    log = tmp_path / "s.out"
    log.write_text("========= Error: Device not supported\n")
    assert gc.main(["refused", str(log)]) == 0
    assert capsys.readouterr().out.strip() == "not supported here: Error: Device not supported"
    log.write_text("========= ERROR SUMMARY: 0 errors\n")
    assert gc.main(["refused", str(log)]) == 1
    assert gc.main(["refused", str(tmp_path / "missing")]) == 1


# ------------------------------------------------------------------------------------------ finish
def _keep(tmp_path, tsv: str):
    keep = tmp_path / "keep"
    (keep / "logs").mkdir(parents=True)
    (keep / "steps.tsv").write_text(tsv)
    (keep / "logs" / "build.log").write_text("ncclavg build: CUDA=yes\n")
    (keep / "logs" / "info.log").write_text("python 3.12.3 /usr/bin/python3\ntorch 2.11.0+cu130\n"
                                            "torch cuda 13.0 nccl 2.28.3\nNCCL            2.28.3 (libnccl.so.2)\n")
    (keep / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite tests="2"><testcase classname="tests.test_gpu_average" name="test_a" '
        'file="tests/test_gpu_average.py"/><testcase classname="tests.test_gpu_average" name="test_b" '
        'file="tests/test_gpu_average.py"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>'
        '</testsuite></testsuites>')
    return keep


def test_finish_writes_summary_and_archive_only(gc, tmp_path, capsys):
    keep = _keep(tmp_path, "build\tpass\t0\t20\t75\t\ninfo\tpass\t0\t3\t25\t\ntests\tfail\t1\t50\t135\t\n"
                           "wheel\tnot run\t-\t0\t25\tbudget: 5s left of 470s, the step needs 28s\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_bench.json").write_text(json.dumps({"header": {"device": "NVIDIA H200"},
                                                    "sections": {"copy": {"status": "ok"}}}))
    rc = gc.finish(out, keep, dry=False, seconds=99, budget=470)
    assert rc == gc.NOT_ALL_PASSED
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1] == "  RESULT: FAILED: tests; not run: wheel (budget)"
    assert any(line.split()[:2] == ["wheel", "not"] for line in (p.strip() for p in printed))
    assert sorted(p.name for p in out.iterdir()) == ["gpu_bench.json", "gpu_check.json", "logs.tar.gz"]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["result"] == "FAILED: tests; not run: wheel (budget)" and doc["ok"] is False
    assert doc["device"] == "NVIDIA H200" and doc["nccl"].startswith("2.28.3")
    assert doc["versions"] == {"python": "3.12.3", "torch": "2.11.0+cu130", "torch cuda": "13.0",
                               "torch nccl": "2.28.3"}
    assert [s["status"] for s in doc["steps"]] == ["pass", "pass", "fail", "not run"]
    assert doc["steps"][0]["log"] == "logs.tar.gz:logs/build.log" and "log" not in doc["steps"][3]
    assert doc["tests"]["cases"] == [
        {"id": "tests/test_gpu_average.py::test_a", "outcome": "passed"},
        {"id": "tests/test_gpu_average.py::test_b", "outcome": "failed", "message": "assert 1 == 2"}]
    assert doc["out_problems"] == [] and {f["name"] for f in doc["files"]} == {
        "gpu_bench.json", "gpu_check.json", "logs.tar.gz"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs/build.log", "logs/info.log", "pytest-gpu.xml", "steps.tsv"]


def test_finish_all_passed_and_too_many_files(gc, tmp_path, capsys):
    keep = _keep(tmp_path, "build\tpass\t0\t20\t75\t\n")
    (keep / "pytest-gpu.xml").unlink()
    out = tmp_path / "out"
    out.mkdir()
    assert gc.main(["finish", "--out", str(out), "--keep", str(keep), "--seconds", "3", "--budget", "470"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "  RESULT: all steps passed"
    for i in range(7):  # with gpu_check.json and logs.tar.gz: 9
        (out / f"extra{i}.json").write_text("{}")
    assert gc.finish(out, keep, dry=True, seconds=3, budget=470) == gc.NOT_ALL_PASSED
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("  RESULT: FAILED: $OUT would not come back whole") and "9 files" in last
    assert json.loads((out / "gpu_check.json").read_text())["ok"] is False


def test_skipped_gpu_tests_are_counted_with_their_reasons(gc):
    """A tests step that passed with skips must say so: those paths were not checked."""
    tests = {"counts": {"passed": 3, "failed": 0, "error": 0, "skipped": 5, "total": 8},
             "cases": [{"id": f"t{i}", "outcome": "skipped", "message": "needs NCCL >= 2.30, found 2.28.9"}
                       for i in range(3)] +
                      [{"id": "u", "outcome": "skipped", "message": "needs 2 CUDA devices, 1 visible"},
                       {"id": "v", "outcome": "skipped"}, {"id": "w", "outcome": "passed"}]}
    ok, text = gc.verdict(steps(("build", "pass"), ("tests", "pass")), tests=tests)
    assert ok
    assert text == ("all steps passed; 5 GPU tests skipped (3: needs NCCL >= 2.30, found 2.28.9; "
                    "1: needs 2 CUDA devices, 1 visible; 1: no reason given)")
    none = {"counts": {"passed": 3, "failed": 0, "error": 0, "skipped": 0, "total": 3}, "cases": []}
    assert gc.verdict(steps(("build", "pass")), tests=none) == (True, "all steps passed")
    ok, text = gc.verdict(steps(("tests", "fail")), tests=tests)
    assert not ok and text.startswith("FAILED: tests; 5 GPU tests skipped (3: needs NCCL")


def test_outcomes_of_every_pytest_process_are_merged_and_the_nccl_init_picked_out(gc, tmp_path):
    keep = _keep(tmp_path, "info\tpass\t0\t3\t30\t\ntests\tpass\t0\t50\t140\t\n")
    (keep / "pytest-gpu.xml").unlink()
    (keep / "junit").mkdir()
    for name, outcome in (("a", ""), ("b", '<skipped message="needs 2 CUDA devices"/>')):
        (keep / "junit" / f"tests_test_{name}.xml").write_text(
            f'<testsuites><testsuite><testcase classname="tests.test_{name}" name="test_x" file="tests/test_{name}.py">'
            f'{outcome}</testcase></testsuite></testsuites>')
    (keep / "logs" / "info.log").write_text(
        "NCCL            2.28.9 (libnccl.so.2)\n"
        "h200:1:1 [0] NCCL INFO cudaDriverVersion 13000\n"
        "h200:1:1 [0] NCCL INFO NCCL_RUNTIME_CONNECT set by environment to 0\n"
        "h200:1:1 [0] NCCL INFO CUMEM support enabled\n"
        "h200:1:1 [0] NCCL INFO cuMem host allocations enabled\n"
        "nccl_init: done; collective_mode blocking | ncclCommSplit (config.blocking = 1) ...\n")
    out = tmp_path / "out"
    out.mkdir()
    assert gc.finish(out, keep, dry=False, seconds=60, budget=345) == 0
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["tests"]["counts"] == {"passed": 1, "failed": 0, "error": 0, "skipped": 1, "total": 2}
    assert [c["id"] for c in doc["tests"]["cases"]] == ["tests/test_a.py::test_x", "tests/test_b.py::test_x"]
    assert doc["result"] == "all steps passed; 1 GPU tests skipped (1: needs 2 CUDA devices)"
    init = doc["nccl_init"]
    assert init["runtime connect"] == ["NCCL_RUNTIME_CONNECT set by environment to 0"]
    assert init["cuMem"] == ["CUMEM support enabled"] and init["cuMem host"] == ["cuMem host allocations enabled"]
    assert init["directMode"] == "not printed"   # said, never guessed
    assert init["result"].startswith("done; collective_mode blocking")
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"junit/tests_test_a.xml", "junit/tests_test_b.xml"} <= set(tar.getnames())


def test_a_dry_run_names_no_nccl_mode(gc):
    text = "NCCL            2.28.9 (libnccl.so.2)\nnccl_init: not run in a dry run (would run: ...)\n"
    assert gc._init_facts(text) == {"result": "not run in a dry run (would run: ...)"}
    assert gc._info_facts(text)["nccl"].startswith("2.28.9")   # the init's own line is not the NCCL version
    assert gc._init_facts("nothing here\n") == {}
