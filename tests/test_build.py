"""The build's decision line and its refusals (fast paths that fail before compiling anything)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(tmp_path, **env):
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t"),
         "--build-lib", str(tmp_path / "l")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


@pytest.mark.parametrize("env,needle", [
    ({"NCCLAVG_CUDA": "maybe"}, "NCCLAVG_CUDA must be auto, 0 or 1"),
    ({"NCCLAVG_CUDA": "1", "CUDA_HOME": "/nonexistent-cuda"}, "NCCLAVG_CUDA=1 but no CUDA toolkit"),
])
def test_refusals_are_one_clear_line(tmp_path, env, needle):
    r = _build(tmp_path, **env)
    assert r.returncode != 0
    assert needle in r.stdout + r.stderr


def test_bad_arch_list(tmp_path):
    from shutil import which
    if not (which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no CUDA toolkit on this machine: arch parsing is only reached with one")
    r = _build(tmp_path, NCCLAVG_CUDA="1", NCCLAVG_CUDA_ARCHS="ampere")
    assert r.returncode != 0 and "NCCLAVG_CUDA_ARCHS entry 'ampere'" in r.stdout + r.stderr
