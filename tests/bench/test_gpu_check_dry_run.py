"""bench/gpu_check.sh --dry-run walks every step of the GPU check without a GPU: the CUDA build (when
a toolkit is here) into a scratch folder, import of that build, the GPU tests collected and run (they
skip), and gpu_bench.py --dry-run, which checks its arguments and writes JSON marked dry_run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _paths import ROOT


def toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc")) or bool(home and (Path(home) / "bin" / "nvcc").exists())


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                       text=True, env=env, cwd=str(ROOT), timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "RESULT: all steps passed" in r.stdout.splitlines()[-1]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["dry_run"] is True
    assert [s["step"] for s in doc["steps"]] == ["env", "build", "import", "tests_list", "tests", "sanitizer",
                                                  "bench", "sweep", "trainer", "wheel"]
    assert all(s["status"] == "pass" for s in doc["steps"]), doc["steps"]
    sweep = json.loads((tmp_path / "bench-local.json").read_text())
    assert sweep["rows"] and all(row["wrong"] == 0 for row in sweep["rows"])
    assert json.loads((tmp_path / "trainer_cpu.json").read_text())
    bench = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert bench["header"]["dry_run"] is True
    assert set(bench["sections"]) == {"copy", "average", "pack", "allreduce", "pinned"}
    listed = (tmp_path / "logs" / "tests_list.log").read_text()
    assert "test_gpu_nccl.py" in listed and "test_gpu_average.py" in listed
    imported = (tmp_path / "logs" / "import.log").read_text()
    if toolkit_present():
        assert "cuda_built True" in imported and "NcclComm True" in imported, imported


def test_gpu_check_rejects_unknown_arguments():
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--bogus" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--iters", "0"], "--iters"),
    (["--sizes", "8,abc"], "abc"),
    (["--only", "copy,nope"], "--only"),
    (["--towers", "0"], "--towers"),
])
def test_gpu_bench_rejects_bad_arguments(args, message, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", "--out",
                        str(tmp_path / "x.json"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.json").exists()
