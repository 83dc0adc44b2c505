"""Scenarios of the NCCL backend's Python layer (ncclavg/comm/nccl.py) over the emulated core: each runs
in its own process (one per rank for the torch.distributed ones), started by
tests/comm/test_nccl_python_emu.py:

    python _nccl_python_emu_workers.py SCENARIO RANK WORLD INIT_FILE

NCCLAVG_EMU_CORE names the emulated core, NCCLAVG_NCCL_LIBRARY the stand-in NCCL, NCCLEMU_* its faults;
NCCLAVG_EMU_PLANT (JSON [[old, new], ...]) plants a defect in nccl.py's source before the scenario runs.
A scenario prints PASS and exits 0, or raises.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nccl_emu_core as emu  # noqa: E402

emu.install(os.environ["NCCLAVG_EMU_CORE"])

import torch  # noqa: E402

import ncclavg  # noqa: E402
from ncclavg._ext import _C  # noqa: E402
from ncclavg.comm import nccl as nccl_module  # noqa: E402

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def _plant() -> None:
    """Re-runs nccl.py's source with the planted replacements in its own module namespace, so every
    later use of NcclCommunicator / _NcclWork (Communicator.nccl looks the class up per call) gets them."""
    plant = json.loads(os.environ.get("NCCLAVG_EMU_PLANT", "[]"))
    if not plant:
        return
    path = Path(nccl_module.__file__)
    text = path.read_text()
    for old, new in plant:
        if old not in text:
            raise AssertionError(f"planted defect: {old!r} does not occur in {path.name}")
        text = text.replace(old, new)
    exec(compile(text, str(path), "exec"), nccl_module.__dict__)
    from ncclavg.comm import base

    base._BACKENDS["nccl"] = nccl_module.NcclCommunicator   # the factories' table holds the class itself


def exact_values(n: int, device_index: int, seed: int) -> torch.Tensor:
    """Small integers times a power of two: sums and halvings of a few of them are exact in fp16, bf16
    and fp32, so every rounding mode and reduction order gives the same bits."""
    g = torch.Generator().manual_seed(seed * 100 + device_index)
    return torch.randint(-64, 65, (n,), generator=g).to(torch.float64) * 0.25


def fp32_mean_bound(srcs: list) -> torch.Tensor:
    """Per element, what an fp32 mean of `srcs` may differ from the float64 one: with n inputs, one
    rounding of each product or quotient by n, one per addition (n - 1) and the final one, each at most
    2^-24 of the magnitudes it touches, all at most sum(|x|): (n + 2) * 2^-24 * sum(|x|). Derived, so it
    holds whatever order the reduction runs in."""
    return (len(srcs) + 2) * 2.0 ** -24 * sum(s.abs() for s in srcs)


def refused(call, what: str, *words: str, error=RuntimeError) -> str:
    """Runs call(); it must raise `error` whose message holds one of `words` (any, when none given)."""
    try:
        call()
    except error as e:
        assert not words or any(w in str(e) for w in words), (what, str(e))
        return str(e)
    raise AssertionError(what)


def _close_bounded(comm, limit_s: float) -> None:
    t0 = time.monotonic()
    comm.close()
    took = time.monotonic() - t0
    assert took < limit_s, f"close() took {took:.1f} s, more than {limit_s} s"


# ---------------------------------------------------------------------------------------------------
@scenario
def public_api(rank, world, init):
    comm = ncclavg.Communicator.nccl(devices=[0, 1], timeout=30)
    assert (comm.backend, comm.size, comm.local_size, comm.devices) == ("nccl", 2, 2, ["cuda:0", "cuda:1"])
    assert comm.nccl_version == 22809 and comm.collective_mode in ("blocking", "nonblocking"), comm.collective_mode
    # exact inputs: bit for bit against the float64 mean, every dtype, with and without predivide
    for predivide in (False, True):
        comm.predivide = predivide
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n in (1, 7, 1000, 4099):
                src = [exact_values(n, d, n) for d in (0, 1)]
                ts = [emu.cuda_tensor(s, d, dtype) for d, s in enumerate(src)]
                comm.all_reduce_avg(ts)
                want = ((src[0] + src[1]) / 2).to(dtype)
                for d, t in enumerate(ts):
                    got = emu.host(t)
                    assert torch.equal(got, want), (predivide, dtype, n, d, got[:8], want[:8])
    comm.predivide = False
    # random fp32 (inputs rounded to fp32 first, as the reference is of the rounded inputs): within
    # fp32_mean_bound, derived, not tuned to any CPU
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(3001, generator=g, dtype=torch.float64).float().double() for _ in (0, 1)]
    ts = [emu.cuda_tensor(s, d) for d, s in enumerate(src)]
    w = comm.all_reduce_avg_async(ts)
    w.wait()
    ref, bound = (src[0] + src[1]) / 2, fp32_mean_bound(src)
    for t in ts:
        err = (emu.host(t).double() - ref).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
    # reduce-scatter: tower t gets shard t of the mean; all-gather puts every tower's shard in order
    ins = [emu.cuda_tensor(exact_values(10, d, 9), d) for d in (0, 1)]
    mean = (exact_values(10, 0, 9) + exact_values(10, 1, 9)) / 2
    outs = [emu.cuda_tensor(torch.zeros(5), d) for d in (0, 1)]
    comm.reduce_scatter_avg(ins, outs)
    for d in (0, 1):
        assert torch.equal(emu.host(outs[d]).double(), mean[5 * d:5 * d + 5])
    gathered = [emu.cuda_tensor(torch.zeros(10), d) for d in (0, 1)]
    comm.all_gather(outs, gathered)
    for d in (0, 1):
        assert torch.equal(emu.host(gathered[d]).double(), mean)
    # arguments are refused naming the argument, and the communicator stays usable
    a, b = emu.cuda_tensor([1.0], 0), emu.cuda_tensor([3.0], 1)
    for bad, word in (([b, a], "tensors[0]"), ([a], "local_size"), ([a, emu.cuda_tensor([1.0, 2.0], 1)], "tensors[1]"),
                      ([a, torch.ones(1)], "tensors[1]")):
        refused(lambda: comm.all_reduce_avg(bad), f"{word}: accepted", word, error=(ValueError, TypeError))
    comm.all_reduce_avg([a, b])
    assert emu.host(a).item() == 2.0 and emu.host(b).item() == 2.0
    comm.wait()
    _close_bounded(comm, 15)
    refused(lambda: comm.all_reduce_avg([a, b]), "a closed communicator ran a collective", "closed")


@scenario
def ordering(rank, world, init):
    """The synchronous collectives return before NCCL ran (NCCLEMU_SLOW_COLLECTIVE_S): the caller's
    stream is ordered after them, so a read through it sees the result with no host wait in between."""
    comm = ncclavg.Communicator.nccl(devices=[0, 1], timeout=30)
    for _ in range(3):
        ts = [emu.cuda_tensor([float(d) * 4] * 64, d) for d in (0, 1)]
        t0 = time.monotonic()
        comm.all_reduce_avg(ts)
        issued = time.monotonic() - t0
        for t in ts:
            got = emu.host(t)
            assert torch.equal(got, torch.full((64,), 2.0)), got[:4]
    assert issued < float(os.environ["NCCLEMU_SLOW_COLLECTIVE_S"]), f"the collective blocked the host {issued:.2f} s"
    _close_bounded(comm, 15)


@scenario
def work_keeps_its_tensors(rank, world, init):
    comm = ncclavg.Communicator.nccl(devices=[0, 1], timeout=30)
    ts = [emu.cuda_tensor([1.0] * 8, d) for d in (0, 1)]
    refs = [weakref.ref(t) for t in ts]
    w = comm.all_reduce_avg_async(ts)
    del ts
    gc.collect()
    assert all(r() is not None for r in refs), "the Work let its tensors go before the collective ended"
    assert not w.done(), "done() before the slow collective could have ended"
    w.wait()
    gc.collect()
    assert all(r() is None for r in refs), "the Work kept its tensors after wait()"
    # dropped without wait(): it orders the callers' streams after the collective as it goes
    ts = [emu.cuda_tensor([float(d)] * 8, d) for d in (0, 1)]
    w = comm.all_reduce_avg_async(ts)
    del w
    for t in ts:
        assert torch.equal(emu.host(t), torch.full((8,), 0.5))
    _close_bounded(comm, 15)


def _one_tower_each_then_rank_1_skips(rank, world, init, timeout):
    """One tower per process; rank 1 builds the communicator, then never joins a collective: it waits
    (bounded) for rank 0's `_done` in the store. Returns rank 0's communicator and tensors, None on rank 1."""
    dist = _init_dist(rank, world, init)
    comm = ncclavg.Communicator.from_torch_distributed(device=f"cuda:{rank}", timeout=timeout)
    if rank == 1:
        dist.distributed_c10d._get_default_store().wait(["rank 0 done"], datetime.timedelta(seconds=60))
        return None, None
    return comm, [emu.cuda_tensor([1.0] * 4, 0)]


def _done(rank):
    import torch.distributed as dist

    dist.distributed_c10d._get_default_store().set("rank 0 done", b"1")


@scenario
def timeout_fails_the_communicator(rank, world, init):
    comm, ts = _one_tower_each_then_rank_1_skips(rank, world, init, timeout=12)
    if comm is None:
        return
    w = comm.all_reduce_avg_async(ts, tag="bucket 0")
    t0 = time.monotonic()
    try:
        w.wait(timeout=1.0)   # this wait's own limit, not the communicator's 12 s
    except ncclavg.CommTimeoutError as e:
        took = time.monotonic() - t0
        assert took < 8, f"wait(timeout=1.0) raised after {took:.1f} s"
        assert "bucket 0" in str(e), str(e)
    else:
        raise AssertionError("a collective a peer never joined did not time out")
    for call in (lambda: comm.all_reduce_avg(ts), lambda: comm.wait()):
        refused(call, "a timed-out communicator ran another call", "bucket 0", "timed out")
    _close_bounded(comm, 5)
    _done(rank)


@scenario
def abort_ends_a_wait(rank, world, init):
    comm, ts = _one_tower_each_then_rank_1_skips(rank, world, init, timeout=40)
    if comm is None:
        return
    w = comm.all_reduce_avg_async(ts)
    threading.Timer(0.5, comm.abort, kwargs={"reason": "stopped by the test"}).start()
    t0 = time.monotonic()
    try:
        w.wait()
    except RuntimeError:
        took = time.monotonic() - t0
        assert took < 8, f"wait() ended {took:.1f} s after it began, the abort came at 0.5 s"
    else:
        raise AssertionError("wait() returned after an abort")
    refused(lambda: comm.all_reduce_avg(ts), "an aborted communicator ran a collective", "stopped by the test")
    _close_bounded(comm, 5)
    _done(rank)


@scenario
def sticky_cuda_error_fails_the_communicator(rank, world, init):
    comm = ncclavg.Communicator.nccl(devices=[0, 1], timeout=30)
    ts = [emu.cuda_tensor([1.0] * 4, d) for d in (0, 1)]
    w = comm.all_reduce_avg_async(ts)
    emu.lib().ncclavg_emu_inject_sticky_error(0, 700)   # cudaErrorIllegalAddress, as after a faulting kernel
    first = refused(w.wait, "a sticky CUDA error went unseen", error=_C.CudaError)
    assert "illegal memory access" in first, first
    refused(lambda: comm.all_reduce_avg(ts), "a communicator whose context broke ran a collective",
            "illegal memory access")


def _init_dist(rank, world, init):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    return dist


@scenario
def towers_of_several_processes(rank, world, init):
    """Process p feeds p + 1 towers (1+2 on two processes): one communicator over all towers, ranks
    process-major, the mean over towers."""
    dist = _init_dist(rank, world, init)
    counts = [p + 1 for p in range(world)]
    total = sum(counts)
    offset = sum(counts[:rank])
    # Global tower g on emulated GPU g: every process emulates the whole machine, and the stand-in (as
    # NCCL < 2.30) refuses two ranks of one communicator on one GPU.
    towers = [offset + i for i in range(rank + 1)]
    comm = ncclavg.Communicator.from_torch_distributed(devices=[f"cuda:{g}" for g in towers], timeout=30)
    assert (comm.backend, comm.size, comm.local_size, comm.tower_counts) == ("nccl", total, rank + 1, counts)
    assert comm.tower_offset == offset
    n = 6 * total
    ts = [emu.cuda_tensor(exact_values(n, g, 3), g) for g in towers]
    comm.all_reduce_avg(ts)
    srcs = [exact_values(n, g, 3) for g in range(total)]
    mean, bound = sum(srcs) / total, fp32_mean_bound(srcs)
    for t in ts:
        assert bool(((emu.host(t).double() - mean).abs() <= bound).all()), emu.host(t)
    ins = [emu.cuda_tensor(exact_values(n, g, 4), g) for g in towers]
    outs = [emu.cuda_tensor(torch.zeros(6), g) for g in towers]
    comm.reduce_scatter_avg(ins, outs)
    srcs = [exact_values(n, g, 4) for g in range(total)]
    mean, bound = sum(srcs) / total, fp32_mean_bound(srcs)
    for out, g in zip(outs, towers):   # the shard of global tower g
        err = (emu.host(out).double() - mean[6 * g:6 * g + 6]).abs()
        assert bool((err <= bound[6 * g:6 * g + 6]).all()), (g, err)
    assert comm.allgather_object(("rank", rank)) == [("rank", p) for p in range(world)]
    comm.wait()
    _close_bounded(comm, 15)
    dist.barrier()


@scenario
def peer_never_builds_the_communicator(rank, world, init):
    """Rank 1 never calls from_torch_distributed: rank 0 fails within its timeout, naming the store keys."""
    dist = _init_dist(rank, world, init)
    if rank == 1:
        dist.distributed_c10d._get_default_store().wait(["rank 0 done"], datetime.timedelta(seconds=60))
        return
    t0 = time.monotonic()
    try:
        ncclavg.Communicator.from_torch_distributed(device="cuda:0", timeout=2)
    except ncclavg.CommTimeoutError as e:
        took = time.monotonic() - t0
        assert took < 10, took
        assert "tower count" in str(e), str(e)
    else:
        raise AssertionError("built a communicator with a process that never joined")
    _done(rank)


def main(argv):
    name, rank, world, init = argv[0], int(argv[1]), int(argv[2]), argv[3]
    _plant()
    try:
        SCENARIOS[name](rank, world, init)
    except BaseException:
        import torch.distributed as dist

        if rank == 0 and dist.is_initialized():
            _done(rank)   # a waiting rank 1 need not wait out its limit
        raise
    print(f"PASS {name} rank {rank}", flush=True)
    sys.stdout.flush()
    os._exit(0)   # no teardown of stream threads or of a frozen stand-in peer: the OS ends them


if __name__ == "__main__":
    main(sys.argv[1:])
