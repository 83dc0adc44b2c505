"""A Work of the nccl backend keeps its tensors alive on a real GPU (Note [A Work keeps its tensors
alive] in ncclavg/comm/nccl.py): the tensors outlive the caller's references until wait(), and a Work
dropped without wait() orders the caller's stream after the collective, so memory the caching
allocator hands to new work is not written by NCCL afterwards. The Python logic alone is tested on a
CPU in tests/comm/test_nccl_python_layer.py."""
from __future__ import annotations

import gc
import os
import weakref

import pytest

from _gpu import forced_divisor, require_nccl_comm
from ncclavg import _ext
from ncclavg.comm.nccl import MULTI_RANK_GPU_ENV, multi_rank_gpu_problem

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 50_000_000   # tens of milliseconds on the caller's stream: the collective starts late


def communicator(min_size: int):
    """Communicator.nccl over every visible GPU, or over cuda:0 twice when one GPU must hold min_size
    ranks and this process may already put several ranks on one GPU (NCCL reads the variable once)."""
    require_nccl_comm()
    import torch

    import ncclavg

    n = torch.cuda.device_count()
    if n >= min_size:
        return ncclavg.Communicator.nccl(list(range(n)), timeout=60)
    why = multi_rank_gpu_problem(_ext.nccl_info().get("version_code", 0), os.environ)
    if why:
        pytest.skip(f"needs {min_size} NCCL ranks, so {min_size} GPUs ({n} visible) or several ranks on one GPU, "
                    f"with {MULTI_RANK_GPU_ENV}=1 set before the test process started: {why}")
    return ncclavg.Communicator.nccl([0] * min_size, timeout=60)


def sleep_on_every_device(torch, comm):
    for d in sorted({torch.device(d).index for d in comm.devices}):
        with torch.cuda.device(d):
            torch.cuda._sleep(SLEEP_CYCLES)


def test_tensors_outlive_the_callers_references_until_wait():
    import torch

    comm = communicator(1)
    try:
        ts = [torch.full((1 << 20,), float(r + 1), device=d) for r, d in enumerate(comm.devices)]
        sleep_on_every_device(torch, comm)
        refs = [weakref.ref(t) for t in ts]
        work = comm.all_reduce_avg_async(ts)
        del ts
        gc.collect()
        assert all(r() is not None for r in refs), "the Work let go of a tensor NCCL may still write"
        work.wait()
        gc.collect()
        assert all(r() is None for r in refs), "wait() returned: the tensors may go"
    finally:
        comm.close()


def test_dropped_work_orders_reused_memory_after_the_collective():
    import torch

    # The collective must write something: with a forced reduction (x/d, gpu_check.sh's forced step) one
    # rank does; the plain average needs two (one rank's in-place average writes nothing).
    comm = communicator(1 if forced_divisor() > 1 else 2)
    try:
        numel = 1 << 22
        first = torch.device(comm.devices[0])
        ts = [torch.full((numel,), float(r + 1), device=d) for r, d in enumerate(comm.devices)]
        freed = {t.data_ptr() for t in ts if t.device == first}
        sleep_on_every_device(torch, comm)   # the collective (ordered after it) writes late
        work = comm.all_reduce_avg_async(ts)
        del ts, work   # dropped without wait(): See Note [A Work keeps its tensors alive]
        gc.collect()
        new = torch.empty(numel, device=first)   # same size, same stream: the allocator reuses a freed block
        if new.data_ptr() not in freed:
            pytest.skip("the caching allocator did not hand a freed block back, so nothing is shared to check")
        new.fill_(7.0)
        torch.cuda.synchronize(first)
        bad = int((new != 7.0).sum().item())
        assert bad == 0, f"{bad} elements of new work were overwritten by a collective of a dropped Work"
    finally:
        comm.close()
