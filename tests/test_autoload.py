"""The `torch.backends` entry point (_ncclavg_autoload.py) in this environment: `import torch` alone
registers the `ncclavg` backend, NCCLAVG_AUTOLOAD=0 and TORCH_DEVICE_BACKEND_AUTOLOAD=0 turn it off, and a
broken ncclavg (its compiled core missing) leaves `import torch` working with a warning. From a fresh
venv with the released wheel installed: scripts/test_wheel.sh (run by .ci/run)."""
from __future__ import annotations

import importlib.machinery
import logging
import os
import shutil
import subprocess
import sys

import pytest

import _ncclavg_autoload
from _paths import ROOT

PROBE = ("import sys, torch; print('registered' if 'ncclavg' in torch.distributed.Backend.backend_list "
         "else 'absent', 'loaded' if 'ncclavg' in sys.modules else 'unloaded')")


def _python(code: str, tmp_path, **env_changes) -> subprocess.CompletedProcess:
    """`python -c code` from outside the checkout, the autoload switches unset unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("NCCLAVG_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_entry_point_is_installed(tmp_path):
    # from outside the checkout, as torch sees it (a stale ncclavg.egg-info in the checkout would hide it)
    proc = _python("import importlib.metadata as md; print([e.value for e in md.entry_points(group='torch.backends')"
                   " if e.name == 'ncclavg'])", tmp_path)
    assert proc.stdout.strip() == "['_ncclavg_autoload:register']", (
        "the torch.backends entry point is not installed: reinstall ncclavg (pip install -e .)\n" + proc.stdout
        + proc.stderr)


def test_import_torch_alone_registers_the_backend(tmp_path):
    proc = _python(PROBE, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["registered", "loaded"], proc.stdout + proc.stderr


# ~2.5 s each (a fresh interpreter imports torch): one in the quick suite
@pytest.mark.parametrize("env", [{"NCCLAVG_AUTOLOAD": "0"},
                                 pytest.param({"NCCLAVG_AUTOLOAD": "off"}, marks=pytest.mark.slow),
                                 pytest.param({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, marks=pytest.mark.slow)])
def test_the_switches_turn_it_off(tmp_path, env):
    proc = _python(PROBE, tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    # nothing of ncclavg imported at all, and `import ncclavg` still registers it as before
    assert proc.stdout.split() == ["absent", "unloaded"], proc.stdout + proc.stderr
    proc = _python(PROBE.replace("import sys, torch;", "import sys, ncclavg, torch;"), tmp_path, **env)
    assert proc.stdout.split() == ["registered", "loaded"], proc.stdout + proc.stderr


def test_a_group_in_a_program_that_never_imports_ncclavg(tmp_path):
    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('ncclavg', init_method='file://' + __import__('os').path.abspath('rdv'), "
            "rank=0, world_size=1)\n"
            "t = torch.arange(4.0); dist.all_reduce(t, op=dist.ReduceOp.AVG)\n"
            "print(dist.get_backend(), type(dist.group.WORLD).__name__, t.tolist())\n"
            "__import__('os')._exit(0)\n")   # see Note [Gloo teardown] in ncclavg/comm/dist.py
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ncclavg", "ProcessGroupNcclavg", "[0.0,", "1.0,", "2.0,", "3.0]"], proc.stdout


def test_a_broken_ncclavg_leaves_import_torch_working(tmp_path):
    # The real package first on the path, its compiled core replaced by a file that does not load (a
    # core merely left out would be found by an editable install's finder): ncclavg/_ext.py raises as it
    # does for a broken install.
    pkg = tmp_path / "site" / "ncclavg"
    shutil.copytree(ROOT / "ncclavg", pkg, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "_build.json"))
    (pkg / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not a shared object")
    proc = _python(PROBE, tmp_path, PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["absent", "unloaded"], proc.stdout
    assert "the 'ncclavg' torch.distributed backend was not registered" in proc.stderr, proc.stderr
    assert "compiled core (ncclavg._C) is missing or failed to load" in proc.stderr, proc.stderr
    # NCCLAVG_AUTOLOAD=0 silences it; `import ncclavg` still says what is wrong
    proc = _python(PROBE, tmp_path, PYTHONPATH=str(tmp_path / "site"), NCCLAVG_AUTOLOAD="0")
    assert proc.returncode == 0 and "ncclavg" not in proc.stderr, proc.stderr
    proc = _python("import ncclavg", tmp_path, PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode != 0 and "compiled core (ncclavg._C) is missing" in proc.stderr, proc.stderr


def test_register_never_raises(monkeypatch, caplog):
    # A None entry in sys.modules makes `import ncclavg` raise ImportError, as any failure inside would.
    monkeypatch.delenv("NCCLAVG_AUTOLOAD", raising=False)
    monkeypatch.setitem(sys.modules, "ncclavg", None)
    with caplog.at_level(logging.WARNING, logger="ncclavg"):
        assert _ncclavg_autoload.register() is None
    assert "ModuleNotFoundError" in caplog.text and "NCCLAVG_AUTOLOAD=0" in caplog.text, caplog.text


@pytest.mark.parametrize("value,on", [("1", True), ("", True), ("0", False), ("False", False), (" no ", False),
                                      ("OFF", False)])
def test_the_switch_values(monkeypatch, value, on):
    monkeypatch.setenv("NCCLAVG_AUTOLOAD", value)
    assert _ncclavg_autoload.enabled() is on
