"""One rank of a multi-process NCCL test (run by tests/test_gpu_nccl_ranks.py, never collected).

Prints one JSON line: {"rank", "ok", "failures": [...], ...}. Modes:
  collectives  all-reduce (exact and random, every dtype, predivide), reduce-scatter, all-gather, ordering
  hang         a warm-up all-reduce, then rank 0 reduces alone and must get CommTimeoutError; the other
               ranks sleep until killed
  never_joins  init of rank 0 of 2 whose peer never starts: must raise CommTimeoutError
  towers       ONE process, Communicator.nccl([device] * nranks): several NCCL ranks on one GPU (NCCL >= 2.30,
               NCCL_MULTI_RANK_GPU_ENABLE=1); exact average bit for bit, every dtype
  no_context   a single-rank communicator on --device from a thread that never chose a device: no CUDA
               context may appear on any other GPU (the device guard must not "restore" device 0)
  process_towers  process --rank of --nranks processes (gloo on 127.0.0.1:--port carries the store):
               Communicator.from_torch_distributed(devices=--devices), one NCCL communicator over every
               tower of every process (--counts: each process's tower count); all_reduce_avg against the
               float64 mean, reduce_scatter_avg / all_gather in global tower order, the process-level
               helpers, the debug-mode sequence check
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

import numpy as np



def _check_mean(failures, n, got, want, absmax, dtype, what, exact):
    """Appends to `failures` where `got` is not the mean `want` of n towers: bit for bit when `exact`,
    else within the bound of _gpu.assert_close_to_mean: one rounding of the result, n of partial sums and
    the 1/n pre-multiply, each within one ulp (eps) of its magnitude or half a subnormal spacing."""
    import torch
    from _gpu import HALF_SUBNORMAL, eps

    g = got.detach().float().cpu().double().numpy()
    if exact:
        w = torch.from_numpy(want).to(getattr(torch, dtype)).float().double().numpy()
        if not np.array_equal(g, w):
            i = int(np.flatnonzero(g != w)[0])
            failures.append(f"{what}: element {i} is {g[i]!r}, want exactly {w[i]!r}")
        return
    e = eps(dtype)
    bad = np.flatnonzero(np.abs(g - want) > e * np.abs(want) + (n + 2) * (e * absmax + HALF_SUBNORMAL[dtype]))
    if bad.size:
        i = int(bad[0])
        failures.append(f"{what}: {bad.size} elements off, first {i}: {g[i]!r} vs {want[i]!r}")

def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True,
                   choices=["collectives", "hang", "never_joins", "dies_before_first", "towers", "no_context",
                            "process_towers"])
    p.add_argument("--uid", default="", help="hex of the 128-byte unique id")
    p.add_argument("--nranks", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--devices", default="", help="process_towers: this process's CUDA devices, e.g. 0,0")
    p.add_argument("--counts", default="", help="process_towers: every process's tower count, e.g. 2,1")
    p.add_argument("--port", type=int, default=0, help="process_towers: rank 0's TCP store port")
    a = p.parse_args()
    out = {"rank": a.rank, "ok": False, "failures": []}
    try:
        run(a, out)
        out["ok"] = not out["failures"]
    except Exception as e:  # reported to the parent test, which fails with it
        out["failures"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    print(json.dumps(out), flush=True)
    if a.mode == "process_towers":   # out without torch's gloo teardown: Note [Gloo teardown] in comm/dist.py
        from ncclavg.comm import end_process

        end_process(0)
    return 0


def run(a, out):
    import torch

    import ncclavg
    from ncclavg import _ext
    from ncclavg.buffers import as_buffers

    NcclComm = _ext.nccl_comm_class()
    if a.mode == "no_context":   # before anything chooses a device for this thread
        no_context(a, out, NcclComm)
        return
    torch.cuda.set_device(a.device)
    if a.mode == "towers":
        towers(a, out)
        return
    if a.mode == "process_towers":
        process_towers(a, out)
        return
    if a.mode == "never_joins":
        t0 = time.monotonic()
        try:
            NcclComm.init_rank(_ext.nccl_unique_id(), 2, 0, a.device, a.timeout)
            out["failures"].append("init of a rank whose peer never starts returned")
        except ncclavg.CommTimeoutError as e:
            out["message"] = str(e)
        out["elapsed"] = time.monotonic() - t0
        return

    uid = bytes.fromhex(a.uid)
    comm = NcclComm.init_rank(uid, a.nranks, a.rank, a.device, a.timeout)
    stream = [int(torch.cuda.current_stream(a.device).cuda_stream)]
    dev = f"cuda:{a.device}"

    def allreduce(t, **kw):
        seq = comm.all_reduce_avg(as_buffers([t]), stream, **kw)
        comm.stream_wait(stream)
        return seq

    if a.mode == "hang":
        t = torch.ones(1 << 20, device=dev)
        allreduce(t, tag="warm-up")
        comm.wait(a.timeout)
        if a.rank != 0:
            time.sleep(600)  # a hung peer: the parent kills it
            return
        t0 = time.monotonic()
        try:
            comm.all_reduce_avg(as_buffers([t]), stream, timeout_s=5.0, tag="bucket 7")
            comm.wait(5.0)
            out["failures"].append("a collective whose peer never joined completed")
        except ncclavg.CommTimeoutError as e:
            out["message"] = str(e)
        out["elapsed"] = time.monotonic() - t0
        out["aborted"] = comm.aborted
        try:
            comm.all_reduce_avg(as_buffers([t]), stream)
            out["failures"].append("a call after the abort did not raise")
        except ncclavg.NcclError as e:
            out["after_abort"] = str(e)
        return

    if a.mode == "dies_before_first":   # See Note [Connections inside the bounded init] in comm_init.cpp
        out["mode_reason"] = comm.collective_mode_reason
        if a.rank != 0:
            print(json.dumps({"rank": a.rank, "ok": True, "failures": []}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)   # lost after init, before any collective
        time.sleep(2.0)
        t = torch.ones(1 << 20, device=dev)
        t0 = time.monotonic()
        try:
            comm.all_reduce_avg(as_buffers([t]), stream, timeout_s=5.0, tag="first bucket")
            comm.wait(5.0)
            out["failures"].append("the first collective of a rank whose peer died completed")
        except (ncclavg.CommTimeoutError, ncclavg.NcclError) as e:
            out["message"] = str(e)
        out["elapsed"] = time.monotonic() - t0
        return

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _gpu import DTYPE_CODE, exact_rank_inputs

    n, r = comm.size, comm.rank
    out["size"], out["ranks"], out["reduction"] = n, comm.ranks, {}

    def check(got, want, absmax, dtype, what, exact):
        _check_mean(out["failures"], n, got, want, absmax, dtype, what, exact)

    for dtype in ("float32", "float16", "bfloat16"):
        if dtype == "bfloat16" and comm.nccl_version < 21000:
            continue
        dt = getattr(torch, dtype)
        red = comm.reduction(DTYPE_CODE[dtype])
        out["reduction"][dtype] = red
        exact_ok = (n & (n - 1)) == 0 or "divide" in red
        for size in (1, 7, 4097, 1_000_003):
            x = exact_rank_inputs(n, size, seed=size)
            t = torch.from_numpy(x[r]).to(dt).to(dev)
            allreduce(t, tag=f"exact {dtype} {size}")
            check(t, x.mean(axis=0), np.abs(x).max(axis=0), dtype, f"exact {dtype} {size}", exact_ok)
            g = torch.Generator().manual_seed(size)
            xs = torch.stack([(torch.randn(size, generator=g) * 2).to(dt) for _ in range(n)])
            xf = xs.double().numpy()
            t = xs[r].to(dev)
            allreduce(t)
            check(t, xf.mean(axis=0), np.abs(xf).max(axis=0), dtype, f"random {dtype} {size}", False)
        # predivide: 40000 + 50000 overflows fp16 unless the inputs are scaled first
        big = 40000.0 if dtype == "float16" else 1e30
        xs = torch.stack([torch.full((4097,), big * (1 + 0.25 * (k % 2))).to(dt) for k in range(n)])
        xf = xs.double().numpy()
        t = xs[r].to(dev)
        allreduce(t, predivide=True)
        check(t, xf.mean(axis=0), np.abs(xf).max(axis=0), dtype, f"predivide {dtype}", False)
        # reduce-scatter then all-gather
        shard = 4097
        x = exact_rank_inputs(n, n * shard, seed=3)
        full = torch.from_numpy(x[r]).to(dt).to(dev)
        part = torch.empty(shard, dtype=dt, device=dev)
        comm.reduce_scatter_avg(as_buffers([full]), as_buffers([part]), stream)
        comm.stream_wait(stream)
        mean = x.mean(axis=0)
        exact_rs = (n & (n - 1)) == 0 or "divide" in comm.reduction(DTYPE_CODE[dtype], all_reduce=False)
        check(part, mean[r * shard:(r + 1) * shard], np.abs(x).max(axis=0)[r * shard:(r + 1) * shard], dtype,
              f"reduce_scatter {dtype}", exact_rs)
        gathered = torch.empty(n * shard, dtype=dt, device=dev)
        comm.all_gather(as_buffers([part]), as_buffers([gathered]), stream)
        comm.stream_wait(stream)
        check(gathered, mean, np.abs(x).max(axis=0), dtype, f"all_gather {dtype}", exact_rs)

    # ordering: a late producer on a side stream; the collective must wait for it
    side = torch.cuda.Stream(device=a.device)
    t = torch.zeros(1 << 20, device=dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        t.fill_(float(r + 1))
    comm.all_reduce_avg(as_buffers([t]), [int(side.cuda_stream)])
    comm.stream_wait([int(side.cuda_stream)])
    with torch.cuda.stream(side):
        if not bool(torch.all(t == (n + 1) / 2).item()):
            out["failures"].append("the collective did not wait for the producing stream")
    comm.wait(a.timeout)
    comm.destroy()


def towers(a, out):
    """Several NCCL ranks on one GPU in ONE process: one rank per tower of Communicator.nccl."""
    import torch

    import ncclavg

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _bits import bits_mismatch
    from _gpu import exact_rank_inputs

    n, dev = a.nranks, f"cuda:{a.device}"
    comm = ncclavg.Communicator.nccl([a.device] * n, timeout=a.timeout)
    out["size"], out["local_size"], out["mode"] = comm.size, comm.local_size, comm.collective_mode
    for dtype in ("float32", "float16", "bfloat16"):
        dt = getattr(torch, dtype)
        for size in (1, 4097, 1_000_003):
            x = exact_rank_inputs(n, size, seed=size)
            ts = [torch.from_numpy(x[r]).to(dt).to(dev) for r in range(n)]
            comm.all_reduce_avg(ts, tag=f"{dtype} {size}")
            torch.cuda.synchronize(a.device)
            want = torch.from_numpy(x.mean(axis=0)).to(dt)
            for r, t in enumerate(ts):
                why = bits_mismatch(t, want)
                if why and (n & (n - 1)) == 0:   # 1/n pre-multiplies are exact only for powers of two
                    out["failures"].append(f"{dtype} {size} tower {r}: {why}")
    comm.close()


def process_towers(a, out):
    """One process of a communicator over the CUDA towers of several processes (init_ranks / init_rank)."""
    import datetime

    import torch
    import torch.distributed as dist

    import ncclavg

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _gpu import DTYPE_CODE, exact_rank_inputs

    devs = [int(d) for d in a.devices.split(",")]
    counts = [int(c) for c in a.counts.split(",")]
    offset, n = sum(counts[:a.rank]), sum(counts)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.nranks,
                            timeout=datetime.timedelta(seconds=a.timeout))
    comm = ncclavg.Communicator.from_torch_distributed(devices=[f"cuda:{d}" for d in devs], timeout=a.timeout)
    out.update(size=comm.size, local_size=comm.local_size, tower_offset=comm.tower_offset,
               tower_counts=comm.tower_counts, mode=comm.collective_mode, backend=comm.backend)
    want = ("nccl", n, len(devs), a.rank, a.nranks, offset, counts, [f"cuda:{d}" for d in devs])
    got = (comm.backend, comm.size, comm.local_size, comm.rank, comm.world_size, comm.tower_offset,
           comm.tower_counts, comm.devices)
    if got != want:
        out["failures"].append(f"(backend, size, local_size, rank, world_size, tower_offset, tower_counts, devices) "
                               f"is {got}, want {want}")
        return

    def mine(rows, dt):
        """This process's towers' rows of an all-towers array, one tensor per local device."""
        return [torch.from_numpy(rows[offset + t]).to(dt).to(f"cuda:{d}") for t, d in enumerate(devs)]

    def check(got, want, absmax, dtype, what, exact):
        _check_mean(out["failures"], n, got, want, absmax, dtype, what, exact)

    for dtype in ("float32", "float16", "bfloat16"):
        if dtype == "bfloat16" and comm.nccl_version < 21000:
            continue
        dt = getattr(torch, dtype)
        # exact inputs give the mean bit for bit unless a rounded 1/n pre-multiply (ncclAvg for a
        # non-power-of-two n) is in the way: See Note [Choosing the reduction] in comm_collectives.cpp
        exact_ok = (n & (n - 1)) == 0 or "divide" in comm._handle.reduction(DTYPE_CODE[dtype])
        out.setdefault("reduction", {})[dtype] = comm._handle.reduction(DTYPE_CODE[dtype])
        for size in (1, 7, 4097, 1_000_003):
            x = exact_rank_inputs(n, size, seed=size)
            ts = mine(x, dt)
            comm.all_reduce_avg(ts, tag=f"exact {dtype} {size}")
            for t, tensor in enumerate(ts):
                check(tensor, x.mean(axis=0), np.abs(x).max(axis=0), dtype, f"exact {dtype} {size} tower {t}",
                      exact_ok)
            # fresh random inputs, every process drawing all towers' rows from one seed
            g = torch.Generator().manual_seed(size)
            xs = torch.stack([(torch.randn(size, generator=g) * 2).to(dt) for _ in range(n)]).double().numpy()
            ts = mine(xs, dt)
            comm.all_reduce_avg(ts, tag=f"random {dtype} {size}")
            for t, tensor in enumerate(ts):
                check(tensor, xs.mean(axis=0), np.abs(xs).max(axis=0), dtype, f"random {dtype} {size} tower {t}",
                      False)
        # reduce-scatter: local tower t gets the mean of shard offset + t (global tower order); all-gather back
        shard = 4097
        x = exact_rank_inputs(n, n * shard, seed=3)
        mean, absmax = x.mean(axis=0), np.abs(x).max(axis=0)
        fulls = mine(x, dt)
        parts = [torch.empty(shard, dtype=dt, device=f"cuda:{d}") for d in devs]
        comm.reduce_scatter_avg(fulls, parts, tag=f"reduce_scatter {dtype}")
        for t, part in enumerate(parts):
            g_ = offset + t
            sl = slice(g_ * shard, (g_ + 1) * shard)
            check(part, mean[sl], absmax[sl], dtype, f"reduce_scatter {dtype} tower {t}", False)
        gathered = [torch.empty(n * shard, dtype=dt, device=f"cuda:{d}") for d in devs]
        comm.all_gather(parts, gathered, tag=f"all_gather {dtype}")
        for t, full in enumerate(gathered):
            check(full, mean, absmax, dtype, f"all_gather {dtype} tower {t}", False)
    torch.cuda.synchronize()

    # the debug-mode sequence check gathers one record per tower and must pick one per process
    comm.debug = True
    ts = [torch.ones(1024, device=f"cuda:{d}") for d in devs]
    comm.all_reduce_avg(ts, tag="debug", debug_key=(1, 0, 12345))
    comm.debug = False
    if not all(bool(torch.all(t == 1).item()) for t in ts):
        out["failures"].append("debug-mode all_reduce_avg of ones is not ones")
    # the process-level helpers the trainer uses on every communicator
    if comm.allgather_object(a.rank) != list(range(a.nranks)):
        out["failures"].append("allgather_object is not every process's rank in order")
    if comm.sum_over_processes([1.0, a.rank]) != [float(a.nranks), float(sum(range(a.nranks)))]:
        out["failures"].append("sum_over_processes is not the sum over processes")
    w = [torch.full((5,), float(a.rank), device=f"cuda:{devs[0]}"), torch.full((3,), float(a.rank))]
    comm.broadcast_tensors(w)
    if any(bool(torch.any(t != 0).item()) for t in w):
        out["failures"].append("broadcast_tensors did not give every process rank 0's tensors")
    comm.wait()
    comm.close()
    dist.barrier()


def primary_context_active(device: int) -> bool:
    """Whether GPU `device` has an active primary context in this process, asked of the driver directly
    (torch.cuda calls could create one themselves)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device) != 0:
        raise RuntimeError("the CUDA driver did not answer cuInit / cuDeviceGet")
    if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
        raise RuntimeError("cuDevicePrimaryCtxGetState failed")
    return bool(active.value)


def no_context(a, out, NcclComm):
    """init_rank and a collective on --device must leave every other GPU without a context."""
    import torch

    from ncclavg import _ext
    from ncclavg.buffers import as_buffers

    comm = NcclComm.init_rank(_ext.nccl_unique_id(), 1, 0, a.device, a.timeout)
    t = torch.ones(1024, device=f"cuda:{a.device}")
    comm.all_reduce_avg(as_buffers([t]), [int(torch.cuda.current_stream(a.device).cuda_stream)])
    comm.wait(a.timeout)
    comm.destroy()
    out["contexts"] = [primary_context_active(d) for d in range(torch.cuda.device_count())]
    for d, active in enumerate(out["contexts"]):
        if active and d != a.device:
            out["failures"].append(f"a CUDA context appeared on GPU {d}; only GPU {a.device} was used")


if __name__ == "__main__":
    sys.exit(main())
