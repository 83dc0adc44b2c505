"""pytest plugin of bench/gpu_check.sh: a test module that cannot be imported because an OPTIONAL package
is not installed (the GPU machine's image installs nothing) is reported as skipped, with the package named,
instead of as a collection error that fails the whole tests step.

    PYTHONPATH=<folder holding this file> python -m pytest -p gpu_check_pytest ...

Only packages listed in the ini option `gpu_check_optional` (default: the optional extras of pyproject.toml
that tests use) count, and only when the package itself is missing: a missing submodule of an installed
package, or any other import error, stays an error. The right fix is a pytest.importorskip in the test
module; this keeps the GPU run meaningful until every module has one.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

DEFAULT_OPTIONAL = "hypothesis sklearn tqdm matplotlib cupy"
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def pytest_addoption(parser):
    parser.addini("gpu_check_optional", "optional packages whose absence skips a test module (gpu_check.sh)",
                  type="args", default=DEFAULT_OPTIONAL.split())


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
