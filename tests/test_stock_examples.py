"""The stock-PyTorch recipes of examples/ run under torchrun with 2 processes on the `ncclavg` backend:
DDP (plain and with ncclavg.ddp's hook on a bfloat16 wire), FSDP2, PyTorch Lightning and Accelerate (each
skipped with the reason when the framework is not installed; .ci/run installs them)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, *args):
    from ncclavg.bench.launch import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.join(ROOT, "examples", script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _summary(out, name, hook):
    m = re.search(rf"{name}: test_accuracy=(\d\.\d+) backend=ncclavg world_size=2 hook={hook} replicas_identical=True",
                  out)
    assert m, out[-3000:]
    assert float(m.group(1)) > 0.7   # two epochs of the digits MLP (about 0.87 here)


@pytest.mark.parametrize("extra,hook", [((), "off"), pytest.param(("--hook", "--wire", "bfloat16"), "on",
                                                                    marks=pytest.mark.slow)])
def test_stock_ddp_example(extra, hook):
    _summary(_torchrun("stock_ddp.py", "--epochs", "2", *extra), "stock_ddp", hook)


@pytest.mark.slow
def test_stock_ddp_example_names_a_slowed_rank():
    out = _torchrun("stock_ddp.py", "--epochs", "1", "--slow-rank", "1", "--slow-ms", "30")
    _summary(out, "stock_ddp", "off")
    assert re.search(r"stragglers: rank 1 was last in \d+ of \d+ calls that waited, late by (2[4-9]|3[0-6])\.\d ms", out), out


@pytest.mark.slow
def test_fsdp2_example():
    out = _torchrun("fsdp2.py", "--epochs", "2")
    m = re.search(r"fsdp2: test_accuracy=(\d\.\d+) world_size=2 transport=shm", out)
    assert m and float(m.group(1)) > 0.7, out[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None and importlib.util.find_spec("lightning") is None,
                    reason="PyTorch Lightning is not installed (pip install pytorch-lightning)")
def test_lightning_example():
    _summary(_torchrun("lightning_ddp.py", "--epochs", "2", "--hook"), "lightning_ddp", "on")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="Accelerate is not installed (pip install accelerate)")
def test_accelerate_example():
    _summary(_torchrun("accelerate_ddp.py", "--epochs", "2", "--hook"), "accelerate_ddp", "on")
