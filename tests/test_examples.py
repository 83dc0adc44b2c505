"""The examples run: the custom loop (GradientAverager + CPUAdamW) and the torchrun/gloo launch."""
import os
import re
import subprocess
import sys

import pytest
from _dist_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_custom_loop_example():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_loop.py"), "--towers", "3",
                           "--epochs", "2"], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"custom_loop: test_accuracy=(\d\.\d+) towers=3 replicas_identical=True", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) > 0.85


@pytest.mark.slow   # ~5 s: torchrun
def test_torchrun_gloo_example():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "examples", "torchrun_gloo.py"), "--epochs", "2"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"torchrun_gloo: test_accuracy=(\d\.\d+) world_size=2 replicas_identical=True", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) > 0.85
