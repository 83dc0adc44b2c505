"""bench/gpu_check/gpu_check_pytest.py, the pytest plugin of gpu_check.sh's tests step: a test module that needs a
missing optional package is a skip that names it (and the summary shows that reason), while any other
import error stays an error."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from _paths import ROOT, load_script


def _load(name):
    return load_script(ROOT / "bench" / "gpu_check" / f"{name}.py", name)


@pytest.fixture(scope="module")
def plugin():
    return _load("gpu_check_pytest")


def test_missing_optional_only_for_listed_packages_that_are_absent(plugin):
    text = "E   ModuleNotFoundError: No module named 'not_here_pkg.sub'"
    assert plugin.missing_optional(text, {"not_here_pkg"}) == "not_here_pkg"
    assert plugin.missing_optional(text, {"other"}) is None
    assert plugin.missing_optional("E   ModuleNotFoundError: No module named 'json.nope'", {"json"}) is None
    assert plugin.missing_optional("E   ImportError: cannot import name 'x' from 'y'", {"y"}) is None


def test_a_module_needing_a_missing_optional_package_is_skipped_with_its_name(tmp_path):
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "pytest.ini").write_text("[pytest]\n")
    (proj / "tests" / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (proj / "tests" / "test_optional.py").write_text("import not_here_pkg\n\ndef test_x():\n    pass\n")
    (proj / "tests" / "test_other.py").write_text("import other_missing_pkg\n")
    (proj / "tests" / "test_installed.py").write_text("import json.not_a_submodule\n")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    shutil.copy(ROOT / "bench" / "gpu_check" / "gpu_check_pytest.py", plugins)
    xml = tmp_path / "junit.xml"
    env = dict(os.environ, PYTHONPATH=str(plugins) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "gpu_check_pytest",
                        "-o", "gpu_check_optional=not_here_pkg json", "--continue-on-collection-errors",
                        f"--junitxml={xml}", "-o", "junit_family=xunit1", "tests"],
                       cwd=proj, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr  # the two real import errors still fail the run
    assert "optional package 'not_here_pkg' is not installed here" in r.stdout
    got = _load("gpu_check_summary").parse_junit(xml)
    by_outcome = {}
    for c in got["cases"]:
        by_outcome.setdefault(c["outcome"], []).append(c)
    assert [c["id"] for c in by_outcome["passed"]] == ["tests/test_ok.py::test_ok"]
    (skip,) = by_outcome["skipped"]
    assert skip["message"].startswith("optional package 'not_here_pkg' is not installed here; tests/test_optional.py")
    errors = sorted(c["message"] for c in by_outcome["error"])
    assert len(errors) == 2
    assert errors[0].startswith("ModuleNotFoundError: No module named 'json.not_a_submodule'")
    assert errors[1] == "ModuleNotFoundError: No module named 'other_missing_pkg'"
