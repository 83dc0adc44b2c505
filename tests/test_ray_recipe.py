"""examples/ray_train.py: Ray Train's TorchTrainer with TorchConfig(backend="ncclavg") and two CPU workers
that never import ncclavg. It trains because the installed ncclavg registers the backend at `import torch`
in Ray's worker processes, and fails by name with the autoload turned off. Skipped with the reason when
Ray Train is not installed (.ci/run installs it)."""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest

from _paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                   reason="Ray Train is not installed (pip install \"ray[train]\")")]


def _run(tmp_path, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("NCCLAVG_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    # Ray's session folder holds AF_UNIX sockets (paths of at most 107 bytes): pytest's tmp_path is too deep.
    with tempfile.TemporaryDirectory(prefix="ray") as ray_tmp:
        env.update(OMP_NUM_THREADS="1", RAY_TMPDIR=ray_tmp, **env_changes)
        return subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), "--workers", "2"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_ray_train_workers_find_the_backend(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"ray_train: backend=ncclavg world_size=2 wrapped=DistributedDataParallel first_loss=([\d.]+) "
                  r"last_loss=([\d.]+) test_accuracy=([\d.]+) replicas_identical=True", proc.stdout)
    assert m, proc.stdout[-3000:]
    assert float(m.group(2)) < 0.5 * float(m.group(1)) and float(m.group(3)) > 0.7, m.group(0)


def test_without_the_autoload_the_workers_refuse_the_name(tmp_path):
    proc = _run(tmp_path, NCCLAVG_AUTOLOAD="0")
    assert proc.returncode != 0
    assert "Unknown backend type ncclavg" in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
