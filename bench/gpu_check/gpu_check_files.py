#!/usr/bin/env python3
"""The tests and forced steps of bench/gpu_check.sh: GPU tests in pytest processes of their own, so that
a hung or crashed test costs that test and not the rest of the step.

    python bench/gpu_check/gpu_check_files.py tests  --out DIR [--budget-s S] [--test-timeout T]
    python bench/gpu_check/gpu_check_files.py forced --out DIR [--budget-s S] [--test-timeout T]
    python bench/gpu_check/gpu_check_files.py list tests|forced        # the groups it would run, runs nothing

`tests`: one pytest process per test file that has GPU tests (`-m gpu`). `forced`: the stream-ordering
test and the Work-lifetime tests again, once per forced reduction (NCCLAVG_TEST_REDUCTION=sum_divide:2,
then premulsum:2: Note [Forcing the reduction in tests] in csrc/cuda/comm_collectives.cpp), one process
each: on one rank the plain average is the identity, which no ordering mistake can change; x/2 can.

Note [A hung test costs that test]
Each process runs with bench/gpu_check/gpu_check_pytest.py, which writes every test's start and outcome to a
progress file as it happens and ends the process when a test runs past --test-timeout. When a process
ends without finishing its session (a hang, a crash, a kill at the step's deadline), the test that had
started and not ended is recorded as hung or crashed, and the group runs again with every test that
already has an outcome, and that one, deselected. The outcomes go to DIR/<group>.xml as junit XML
(pytest's own when the session finished; made from the progress file otherwise), which
gpu_check_summary.py reads. A group that cannot start before the step's deadline is "not run": its
file is listed as skipped with that reason, and the exit status says the step did not run whole; so is
a test still running at the deadline that had not reached its own hang limit (cut by time, not failed).

Only the standard library. Exit status: 0 when every group ran and nothing failed, 1 when a test failed,
hung or crashed, NOT_RUN_RC (86, last line "not run: ...") when nothing failed but a group was cut for time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent   # bench/gpu_check/
ROOT = HERE.parent.parent
PLUGIN = HERE / "gpu_check_pytest.py"
HUNG_EXIT = 87          # gpu_check_pytest.HUNG_EXIT
NOT_RUN_RC = 86         # gpu_check.sh's "not run"
START_S = 10            # a group is not started with less than this left: a pytest process takes seconds
END_MARGIN_S = 4        # kept before the step's own limit, to write the results
FORCED_TESTS = ["tests/comm/test_gpu_nccl.py::test_ordering_after_the_callers_stream_and_before_the_readers",
                "tests/comm/test_gpu_nccl_work.py"]
FORCED_REDUCTIONS = ["sum_divide:2", "premulsum:2"]
_GPU_MARK = re.compile(r"pytest\.mark\.gpu\b|pytestmark\s*=\s*.*\bgpu\b")


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """tests/**/test_*.py that mark tests (or the module) with `gpu`, relative to root, sorted."""
    files = []
    for p in sorted((root / "tests").rglob("test_*.py")):
        if _GPU_MARK.search(p.read_text(errors="replace")):
            files.append(p.relative_to(root).as_posix())
    return files


def groups(kind: str) -> list[dict]:
    """[{name, args, env, label}]: one pytest process each."""
    if kind == "tests":
        return [{"name": re.sub(r"[^A-Za-z0-9_.-]", "_", f[:-3]), "args": ["-m", "gpu", f], "env": {}, "label": ""}
                for f in gpu_test_files()]
    if kind == "forced":
        return [{"name": "forced-" + r.replace(":", "-"), "args": list(FORCED_TESTS),
                 "env": {"NCCLAVG_TEST_REDUCTION": r}, "label": f"NCCLAVG_TEST_REDUCTION={r}"}
                for r in FORCED_REDUCTIONS]
    raise ValueError(f"kind: expected 'tests' or 'forced', got {kind!r}")


# ---------------------------------------------------------------------------------------------- junit
def _case(nodeid: str, outcome: str, message: str = "") -> ET.Element:
    """A junit testcase for a pytest node id, with the attributes gpu_check_summary.py reads back."""
    parts = nodeid.split("::")
    file = parts[0]
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    case = ET.Element("testcase", classname=".".join([module, *parts[1:-1]]), name=parts[-1] if len(parts) > 1 else file,
                      file=file)
    if outcome != "passed":
        tag = {"failed": "failure", "error": "error", "skipped": "skipped"}[outcome]
        ET.SubElement(case, tag, message=message or outcome).text = message
    return case


def write_junit(path: Path, cases: list[ET.Element]) -> None:
    suite = ET.Element("testsuite", name="gpu_check", tests=str(len(cases)))
    suite.extend(cases)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def read_progress(path: Path) -> tuple[dict, list, bool]:
    """({id: (outcome, message)} of the tests that ended, [ids started and not ended, with 'hung' seen],
    whether the session finished)."""
    ended, started, hung, finished = {}, [], set(), False
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue   # a line cut by a kill
            ev = r.get("event")
            if ev == "start":
                started.append(r["id"])
            elif ev == "end":
                ended[r["id"]] = (r.get("outcome", "passed"), r.get("message", ""))
            elif ev == "hung":
                hung.add(r["id"])
            elif ev == "finished":
                finished = True
    open_ = [(i, i in hung) for i in dict.fromkeys(started) if i not in ended]
    return ended, open_, finished


def label_cases(path: Path, label: str) -> None:
    """Appends ' [label]' to every testcase name of a junit file (the forced reruns repeat test ids)."""
    if not label or not path.exists():
        return
    tree = ET.parse(path)
    for case in tree.getroot().iter("testcase"):
        case.set("name", f"{case.get('name', '')} [{label}]")
    tree.write(path, encoding="utf-8", xml_declaration=True)


# ---------------------------------------------------------------------------------------------- runs
class Runner:
    def __init__(self, out: Path, deadline: float, test_timeout: float, python: str, cwd: Path = ROOT):
        self.out, self.deadline, self.test_timeout, self.python = out, deadline, test_timeout, python
        self.cwd = cwd   # where pytest runs: the checkout (tests use a project of their own)
        self.child: subprocess.Popen | None = None
        self.failed = self.cut = 0
        self.cut_names: list[str] = []
        self.plugins = Path(tempfile.mkdtemp(prefix="gpu_check_plugins."))
        shutil.copy(PLUGIN, self.plugins)   # from a folder of its own: the scripts beside it must not shadow tests

    def stop_child(self, *_):
        if self.child and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)   # the test's own rank processes too
            except ProcessLookupError:
                pass

    def run_group(self, g: dict) -> None:
        name, progress = g["name"], self.out / f"{g['name']}.jsonl"
        progress.unlink(missing_ok=True)
        cases: list[ET.Element] = []

        def case(nodeid: str, outcome: str, message: str = "") -> ET.Element:
            c = _case(nodeid, outcome, message)
            if g["label"]:
                c.set("name", f"{c.get('name')} [{g['label']}]")
            return c
        deselect: list[str] = []
        attempt = 0
        while True:
            left = self.deadline - time.monotonic()
            if left < START_S:
                why = f"not run: the step's time ran out ({left:.0f}s left) before {name} could " + \
                      ("start" if attempt == 0 else "run the rest of its tests (if any were left)")
                cases.append(case(g["args"][-1] if attempt == 0 else f"{g['args'][-1]}::(the rest of {name})",
                                  "skipped", why))
                self.cut += 1
                self.cut_names.append(name)
                print(f"-- {name}: {why}", flush=True)
                break
            attempt += 1
            xml = self.out / f"{name}.{attempt}.xml"
            cmd = [self.python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "gpu_check_pytest",
                   "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1",
                   f"--gpu-check-progress={progress}", f"--gpu-check-test-timeout={self.test_timeout:g}",
                   *[f"--deselect={d}" for d in deselect], *g["args"]]
            env = dict(os.environ, **g["env"])
            env["PYTHONPATH"] = os.pathsep.join([str(self.plugins), str(self.cwd), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            print(f"-- {name} (attempt {attempt}, {left:.0f}s left){' ' + g['label'] if g['label'] else ''}: "
                  f"{' '.join(cmd[3:])}", flush=True)
            self.child = subprocess.Popen(cmd, cwd=self.cwd, env=env, start_new_session=True)
            at_deadline = False
            try:
                rc = self.child.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop_child()
                rc = self.child.wait()
                at_deadline = True
            self.child = None
            ended, open_, finished = read_progress(progress)
            if finished and xml.exists():
                label_cases(xml, g["label"])
                cases.extend(ET.parse(xml).getroot().iter("testcase"))
                xml.unlink()
                break
            # not finished: what ended is known from the progress file; the open test is the culprit
            xml.unlink(missing_ok=True)
            for i, (outcome, message) in ended.items():
                if i not in deselect:
                    cases.append(case(i, outcome, message))
                    deselect.append(i)
            if not open_:   # died outside any test (collection, session start): nothing to skip past
                cases.append(case(g["args"][-1], "error", f"the pytest process of {name} ended without finishing "
                                   f"(exit status {rc}) outside any test"))
                break
            culprit, was_hung = open_[-1]
            deselect.append(culprit)
            if at_deadline and not was_hung:   # cut by time before its own limit: not run, not failed
                why = "not run: the step's time ran out while it ran (before its own hang limit)"
                cases.append(case(culprit, "skipped", why))
                self.cut += 1
                self.cut_names.append(name)
                print(f"-- {name}: {culprit}: {why}", flush=True)
                continue   # the loop finds no time left and records the rest as not run
            why = (f"hung: no result within {self.test_timeout:g}s; its process was ended and the rest rerun" if was_hung
                   else f"crashed: the pytest process ended (exit status {rc}) while it ran; the rest rerun")
            cases.append(case(culprit, "error", why))
            print(f"-- {name}: {culprit}: {why}", flush=True)
        self.failed += sum(any(ch.tag in ("failure", "error") for ch in c) for c in cases)
        write_junit(self.out / f"{name}.xml", cases)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("tests", "forced", "list"))
    ap.add_argument("what", nargs="?", choices=("tests", "forced"), help="for list: which groups")
    ap.add_argument("--out", type=Path, help="folder of the junit XML and progress files")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("STEP_LIMIT", "0") or 0),
                    help="seconds this may take in all (default: $STEP_LIMIT, the step's limit)")
    ap.add_argument("--test-timeout", type=float, default=60.0, help="seconds after which one test is hung")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    if args.kind == "list":
        if not args.what:
            ap.error("list: say which groups: tests or forced")
        for g in groups(args.what):
            print(g["name"], " ".join(f"{k}={v}" for k, v in g["env"].items()), " ".join(g["args"]))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.budget_s <= 0:
        ap.error("--budget-s: give a positive number of seconds (or run under gpu_check.sh, which sets STEP_LIMIT)")
    if args.test_timeout <= 0:
        ap.error("--test-timeout: must be > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.out, time.monotonic() + args.budget_s - END_MARGIN_S, args.test_timeout, args.python)

    def on_signal(signum, _frame):   # the step is stopped: end the pytest process group with it
        runner.stop_child()
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        for g in groups(args.kind):
            runner.run_group(g)
    finally:
        shutil.rmtree(runner.plugins, ignore_errors=True)
    print(f"{args.kind}: {len(groups(args.kind))} groups, {runner.failed} tests failed, hung or crashed, "
          f"{runner.cut} cut for time")
    if runner.failed:
        return 1
    if runner.cut:
        print(f"not run: time: {', '.join(runner.cut_names)} did not run within the step's {args.budget_s:g}s")
        return NOT_RUN_RC
    return 0


if __name__ == "__main__":
    sys.exit(main())
