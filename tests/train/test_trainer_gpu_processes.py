"""`ncclavg train` under torchrun on CUDA towers (Note [Towers of several processes]): one NCCL
communicator over the towers of every process (NcclCommunicator.init_rank / init_ranks), master="cpu" (the
offload pipeline, every process a whole CPU master: Note [Pipelined CPU master]) by default or "device", one
summary from rank 0 counting every process's towers."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from _gpu import nccl_version, require_nccl_comm
from _paths import ROOT

pytestmark = pytest.mark.gpu

SUMMARY = re.compile(r"^summary: test_accuracy=(\d\.\d{3}) epochs=\d+ samples_per_s=\S+ wall_s=\S+ "
                     r"processes=(\d+) towers=(\d+) devices=(\S+)$", re.M)


def _launch(nproc, *args, tmp_path, shared=False):
    import torch

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCLAVG_TIMEOUT="120")
    if shared or torch.cuda.device_count() < nproc:   # towers share GPUs: several NCCL ranks on one GPU
        if nccl_version() < (2, 30, 0):
            pytest.skip("towers sharing a GPU across processes need several NCCL ranks per GPU (NCCL >= 2.30); "
                        "loaded " + ".".join(map(str, nccl_version())))
        env.update(NCCL_MULTI_RANK_GPU_ENABLE="1", NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "ncclavg", "train", "--no-progress", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.parametrize("master", [None, "device"])
def test_two_processes_on_gpus_learn(tmp_path, master):
    require_nccl_comm()
    out = _launch(2, *(["--master", master] if master else []), tmp_path=tmp_path)
    found = SUMMARY.findall(out)
    assert len(found) == 1, out
    acc, processes, towers, _devices = found[0]
    assert (processes, towers) == ("2", "2") and f"master={master or 'cpu'}" in out
    assert float(acc) >= 0.95   # the default digits demo, as on one process


def test_two_processes_with_two_towers_each(tmp_path):
    """Several CUDA towers per process (both on the process's GPU): NcclCommunicator.init_ranks, one NCCL
    rank per tower."""
    require_nccl_comm()
    out = _launch(2, "--towers", "2", "--epochs", "3", "--model", "mlp", tmp_path=tmp_path, shared=True)
    found = SUMMARY.findall(out)
    assert len(found) == 1 and found[0][1:3] == ("2", "4"), out
