"""pytest plugin of bench/gpu_check.sh (its tests and forced steps, through bench/gpu_check/gpu_check_files.py).

    PYTHONPATH=<folder holding this file> python -m pytest -p gpu_check_pytest ...

1. A test module that cannot be imported because an OPTIONAL package is not installed (the GPU machine's
   image installs nothing) is reported as skipped, with the package named, instead of as a collection
   error that fails the whole tests step. Only packages listed in the ini option `gpu_check_optional`
   (default: the optional extras of pyproject.toml that tests use) count, and only when the package itself
   is missing: a missing submodule of an installed package, or any other import error, stays an error.
   The right fix is a pytest.importorskip in the test module; this keeps the GPU run meaningful until
   every module has one.
2. --gpu-check-progress FILE: one JSON line per event, flushed at once, so that what a killed or crashed
   process had done is known: {"event": "start", "id"}, {"event": "end", "id", "outcome", "message"?},
   {"event": "hung", "id", "seconds"}, {"event": "finished"} at the end of the session.
3. --gpu-check-test-timeout S: a test still running after S seconds (setup, call and teardown together)
   is written as hung, every thread's stack is dumped to stderr, and the process exits at once (status
   HUNG_EXIT): a test stuck in C++ with the GIL released never sees a signal, so a watchdog thread does
   it. The runner then reruns the rest of the file without that test (Note [A hung test costs that test]
   in gpu_check_files.py).
"""
from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import re
import sys
import threading
import time

import pytest

HUNG_EXIT = 87

DEFAULT_OPTIONAL = "hypothesis sklearn tqdm matplotlib cupy"
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def pytest_addoption(parser):
    parser.addini("gpu_check_optional", "optional packages whose absence skips a test module (gpu_check.sh)",
                  type="args", default=DEFAULT_OPTIONAL.split())
    parser.addoption("--gpu-check-progress", default=None, help="JSON-lines file of test starts and outcomes")
    parser.addoption("--gpu-check-test-timeout", type=float, default=0.0,
                     help="seconds after which a running test is hung: the process exits (0: never)")


def missing_optional(text: str, optional) -> str | None:
    """The optional package whose absence the collection error text shows, or None."""
    m = _MISSING.search(text)
    if not m:
        return None
    top = m.group(1).split(".")[0]
    if top not in optional:
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None  # installed: the error is about something else
    except (ImportError, ValueError):
        pass
    return top


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or not isinstance(collector, pytest.Module):
        return
    pkg = missing_optional(str(rep.longrepr), set(collector.config.getini("gpu_check_optional")))
    if pkg:
        reason = (f"optional package '{pkg}' is not installed here; {collector.nodeid} imports it at "
                  "module level without pytest.importorskip")
        outcome.force_result(pytest.CollectReport(rep.nodeid, "skipped", (str(collector.path), 0, reason), []))


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """Writes the progress file and runs the hang watchdog of one pytest session."""

    def __init__(self, path: str | None, timeout_s: float):
        self._file = open(path, "a", encoding="utf-8") if path else None
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None   # (node id, monotonic start)
        self._outcome: dict[str, tuple[str, str]] = {}
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="gpu-check-watchdog", daemon=True).start()

    def write(self, **record) -> None:
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def start(self, nodeid: str) -> None:
        self._outcome[nodeid] = ("passed", "")
        self.write(event="start", id=nodeid)
        self._current = (nodeid, time.monotonic())

    def report(self, rep) -> None:
        """Folds one phase's report into the test's outcome: a failure anywhere wins, a setup skip skips."""
        old = self._outcome.get(rep.nodeid, ("passed", ""))
        if rep.failed:
            kind = "failed" if rep.when == "call" else "error"
            if old[0] not in ("failed", "error"):
                self._outcome[rep.nodeid] = (kind, _first_line(rep.longreprtext))
        elif rep.skipped and old[0] == "passed":
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            self._outcome[rep.nodeid] = ("skipped", _first_line(reason))

    def end(self, nodeid: str) -> None:
        self._current = None
        outcome, message = self._outcome.pop(nodeid, ("passed", ""))
        self.write(event="end", id=nodeid, outcome=outcome, **({"message": message} if message else {}))

    def finished(self) -> None:
        self.write(event="finished")

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            cur = self._current
            if cur is not None and time.monotonic() - cur[1] > self._timeout:
                self.write(event="hung", id=cur[0], seconds=self._timeout)
                sys.stderr.write(f"\ngpu_check: {cur[0]} has run for more than {self._timeout:g} s: hung; "
                                 "every thread's stack follows, then this process exits\n")
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(HUNG_EXIT)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    # pytest's "E   AssertionError: ..." says the most; else the first line
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    line = errors[0] if errors else (lines[0] if lines else "")
    return line[:300]


_PROGRESS: Progress | None = None


def pytest_configure(config):
    global _PROGRESS
    path, timeout_s = config.getoption("--gpu-check-progress"), config.getoption("--gpu-check-test-timeout")
    if path or timeout_s:
        _PROGRESS = Progress(path, timeout_s)


def pytest_runtest_logstart(nodeid, location):
    if _PROGRESS:
        _PROGRESS.start(nodeid)


def pytest_runtest_logreport(report):
    if _PROGRESS:
        _PROGRESS.report(report)


def pytest_runtest_logfinish(nodeid, location):
    if _PROGRESS:
        _PROGRESS.end(nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _PROGRESS:
        _PROGRESS.finished()
