"""NcclComm across processes: several ranks on ONE GPU (NCCL >= 2.30; one process per rank, or one
process with one rank per tower), one rank per GPU when there are several, several towers per process
across processes (init_ranks: one communicator over every tower, ranks numbered process-major), no CUDA
context on a GPU a rank does not use, and the no-hang guarantees: a rank whose peer never starts, and a
collective that a live peer never joins, both raise CommTimeoutError within timeout + 10 s. Every rank
is a subprocess running tests/_comm_nccl_rank_worker.py with a hard time limit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _dist_util import free_port
from _gpu import nccl_version, require_nccl_comm
from _paths import ROOT, TESTS
from ncclavg import _ext
from ncclavg.comm.nccl import MULTI_RANK_GPU_ENV, multi_rank_gpu_problem

pytestmark = pytest.mark.gpu

WORKER = TESTS / "_comm_nccl_rank_worker.py"


def rank_env(shared_gpu: bool, nranks: int = 2) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if shared_gpu:
        env.update(NCCL_MULTI_RANK_GPU_ENABLE="1", NCCL_NVLS_ENABLE="0")
        if nranks > 2:   # NCCL 2.30's docs: more than 2 ranks on one GPU may hang without enough resources
            env.update(NCCL_MAX_CTAS="2")
    return env


def spawn(mode, nranks, rank, device, uid=b"", timeout=60.0, shared_gpu=False):
    cmd = [sys.executable, str(WORKER), "--mode", mode, "--nranks", str(nranks), "--rank", str(rank),
           "--device", str(device), "--timeout", str(timeout), "--uid", uid.hex()]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=rank_env(shared_gpu, nranks), cwd=str(ROOT))


def result(proc, limit) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"rank process did not finish within {limit} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"rank process printed no result (rc {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return json.loads(lines[-1])


def run_ranks(devices, shared_gpu):
    uid = _ext.nccl_unique_id()
    procs = [spawn("collectives", len(devices), r, d, uid, timeout=120.0, shared_gpu=shared_gpu)
             for r, d in enumerate(devices)]
    results = [result(p, 300) for p in procs]
    for res in results:
        assert res["ok"], f"rank {res['rank']}:\n" + "\n".join(res["failures"])
        assert res["size"] == len(devices)
    return results


def require_multi_rank_gpu():
    if nccl_version() < (2, 30, 0):
        pytest.skip("several ranks on one GPU need NCCL >= 2.30; loaded " + ".".join(map(str, nccl_version())))


@pytest.mark.parametrize("nranks", [2, 3])
def test_several_ranks_on_one_gpu(nranks):
    require_nccl_comm()
    require_multi_rank_gpu()
    results = run_ranks([0] * nranks, shared_gpu=True)
    # 3 ranks: 1/3 is inexact, so 16-bit types must take SUM + divide (See Note [Choosing the reduction])
    if nranks == 3:
        assert "divide" in results[0]["reduction"]["float16"]


def test_several_ranks_on_one_gpu_in_one_process():
    # Communicator.nccl([0, 0]): one NCCL rank per tower, both on GPU 0 (See Note [Several ranks on one
    # GPU] in csrc/cuda/nccl_api.cpp). A fresh process: NCCL reads NCCL_MULTI_RANK_GPU_ENABLE once.
    require_nccl_comm()
    require_multi_rank_gpu()
    res = result(spawn("towers", 2, 0, 0, timeout=120.0, shared_gpu=True), 300)
    assert res["ok"], "\n".join(res["failures"])
    assert res["size"] == 2 and res["local_size"] == 2


def test_no_context_on_a_gpu_the_rank_does_not_use():
    require_nccl_comm()
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices to see a context appear on the wrong one, {n} visible")
    res = result(spawn("no_context", 1, 0, n - 1, timeout=60.0), 120)
    assert res["ok"], "\n".join(res["failures"])
    assert res["contexts"][n - 1], "the rank's own GPU has no context: the check itself is broken"


def test_one_rank_per_gpu():
    require_nccl_comm()
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices for one rank per GPU, {n} visible")
    run_ranks(list(range(n)), shared_gpu=False)


def test_rank_whose_peer_never_starts_times_out():
    require_nccl_comm()
    if nccl_version() < (2, 14, 0):
        pytest.skip("a bounded NCCL init needs non-blocking communicators (NCCL >= 2.14)")
    t0 = time.monotonic()
    res = result(spawn("never_joins", 2, 0, 0, timeout=5.0), 120)
    assert res["ok"], res["failures"]
    assert res["elapsed"] < 5.0 + 10.0 and time.monotonic() - t0 < 60.0
    assert "did not complete within 5 s" in res["message"] and "aborted" in res["message"]


def two_ranks_rank0_result(mode: str) -> dict:
    """Runs `mode` on 2 ranks (2 GPUs, or 2 ranks on one GPU where NCCL allows it); rank 1 is killed once
    rank 0 has reported. Returns rank 0's result."""
    require_nccl_comm()
    import torch

    if torch.cuda.device_count() >= 2:
        devices, shared = [0, 1], False
    else:
        require_multi_rank_gpu()
        devices, shared = [0, 0], True
    uid = _ext.nccl_unique_id()
    procs = [spawn(mode, 2, r, d, uid, timeout=60.0, shared_gpu=shared) for r, d in enumerate(devices)]
    try:
        return result(procs[0], 120)
    finally:
        procs[1].kill()
        procs[1].communicate()


def test_collective_that_a_peer_never_joins_times_out():
    res = two_ranks_rank0_result("hang")
    assert res["ok"], res["failures"]
    assert res["elapsed"] < 5.0 + 10.0
    msg = res["message"]
    assert "all_reduce_avg[bucket 7]" in msg and "4194304 bytes" in msg and "rank 0 of 2" in msg, msg
    assert res["aborted"] and "communicator was aborted after" in res["after_abort"]


def test_peer_lost_before_the_first_collective_is_an_error_not_a_hang():
    """Note [Connections inside the bounded init] (comm_init.cpp): with connections made during init, the
    first collective after a peer died is enqueued and then times out, instead of hanging in a blocking
    ncclGroupEnd that connects to a dead peer."""
    res = two_ranks_rank0_result("dies_before_first")
    assert res["ok"], res["failures"]
    assert res["elapsed"] < 5.0 + 10.0, res
    assert "first bucket" in res["message"], res["message"]
    if "blocking" in res["mode_reason"] or "ncclCommSplit" in res["mode_reason"]:
        assert "NCCL_RUNTIME_CONNECT" in res["mode_reason"] or nccl_version() < (2, 22, 0), res["mode_reason"]


@pytest.mark.parametrize("counts", [(1, 1), (2, 2), (1, 2)], ids=["1+1", "2+2", "1+2"])
def test_towers_of_several_processes(counts):
    # Communicator.from_torch_distributed(devices=[...]) in 2 processes: ONE NCCL communicator over every
    # tower (Note [GPU towers of several processes] in ncclavg/comm/nccl.py). A GPU per tower where there
    # are enough; otherwise the towers take the GPUs in turn, which puts several ranks on one GPU.
    require_nccl_comm()
    import torch

    total, n = sum(counts), torch.cuda.device_count()
    shared = total > n
    if shared:
        why = multi_rank_gpu_problem(_ext.nccl_info().get("version_code", 0), {MULTI_RANK_GPU_ENV: "1"})
        if why:
            pytest.skip(f"{total} towers on {n} GPU(s) put several NCCL ranks on one GPU: {why}")
    devices = [[(sum(counts[:p]) + t) % n for t in range(c)] for p, c in enumerate(counts)]
    port = free_port()
    procs = []
    for p, devs in enumerate(devices):
        cmd = [sys.executable, str(WORKER), "--mode", "process_towers", "--nranks", str(len(counts)), "--rank",
               str(p), "--device", str(devs[0]), "--timeout", "120", "--devices", ",".join(map(str, devs)),
               "--counts", ",".join(map(str, counts)), "--port", str(port)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=rank_env(shared, total), cwd=str(ROOT)))
    try:
        results = [result(proc, 300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for p, res in enumerate(results):
        assert res["ok"], f"process {p} (devices {devices[p]}):\n" + "\n".join(res["failures"])
        assert res["size"] == total and res["tower_offset"] == sum(counts[:p]), res
