"""Bodies of tests/comm/test_backend_fast.py: the `ncclavg` backend's fast path for a synchronous
all_reduce (Note [The backend's fast path] in ncclavg/comm/backend_fast.py) against the general path."""
import gc
import os

import torch
import torch.distributed as dist

from _backend_workers import init_backend

R = dist.ReduceOp


def _fast_cached(group=None):
    """How many tensors the group's fast paths have seen (0: none taken)."""
    pg = dist.group.WORLD if group is None else group   # the ncclavg group itself (extended_api)
    return sum(f.cached for f in pg._fast.values())


def _values(world, n, k, dtype):
    """Every rank's input of call k (integers and halves, exact in every dtype below) and the float64 sum."""
    vals = [((torch.arange(n, dtype=torch.float64) * 3 + k + 7 * r) % 61 - 30) / 4 for r in range(world)]
    return [v.to(dtype) for v in vals], sum(vals)


def agree_job(rank, world, port):
    """Rank 0 calls synchronously (the fast path), the others with async_op=True (the lane), call by call
    the other way round too: the ranks meet, and every result is the float64 reference rounded once (the
    inputs are quarters below 16 in magnitude: their sums are exact in every dtype here, and the AVG of
    float32/float64 is the exact sum divided once)."""
    init_backend(rank, world, port)
    k = 0
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for op in (R.SUM, R.AVG):
            for n in (0, 1, 2, 7, 1000, 70000):
                vals, total = _values(world, n, k, dtype)
                t = vals[rank].clone()
                fast_here = (rank == k % world)
                work = dist.all_reduce(t, op=op, async_op=not fast_here)
                if work is not None:
                    work.wait()
                want = (total if op == R.SUM else total / world).to(dtype)
                if dtype in (torch.float16, torch.bfloat16) and op == R.AVG:
                    want = (total.to(torch.float32) / world).to(dtype)   # the general path: an fp32 sum, one division
                assert torch.equal(t, want), (dtype, op, n, t[:4], want[:4])
                k += 1
    assert _fast_cached() > 0, "no call took the fast path"
    dist.barrier()


def order_job(rank, world, port):
    """Synchronous calls issued while asynchronous ones are queued wait their turn: a fast call that
    overtook a queued one would meet another call on the other rank (an error) or the wrong data."""
    init_backend(rank, world, port)
    for k in range(30):
        big = torch.full((1 << 18,), float(rank + k))
        works = [dist.all_reduce(big, async_op=True) for _ in range(2)]
        small = torch.full((3,), float(rank + 1))
        dist.all_reduce(small)                         # behind the two queued ones
        for w in works:
            w.wait()
        assert torch.equal(small, torch.full((3,), float(world * (world + 1) // 2))), small
        s = sum(r + k for r in range(world))
        assert torch.equal(big, torch.full_like(big, float(s * world))), big[:2]   # summed twice
    dist.barrier()


def mismatch_job(rank, world, port, outdir):
    """Ranks whose synchronous all_reduces differ (4 against 5 elements) fail on every rank naming both
    calls, after the fast path has been taken once; the group then refuses at once, fast path or not."""
    import json

    init_backend(rank, world, port, timeout_s=30)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert _fast_cached() > 0
    bad = torch.ones(4 + (rank == 1))
    rep = {}
    try:
        dist.all_reduce(bad)
        rep["first"] = "none"
    except Exception as e:   # noqa: BLE001 (judged by the test)
        rep["first"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(t)   # the tensor the fast path has cached
        rep["later"] = "none"
    except Exception as e:   # noqa: BLE001
        rep["later"] = f"{type(e).__name__}: {e}"
    rep["cached_after"] = _fast_cached()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)


def _channel_mappings():
    with open("/proc/self/maps") as f:
        return sum("ncclavg-shm-channel" in line for line in f)


def groups_cycle_job(rank, world, port, cycles):
    """Groups made, used through the fast path and destroyed `cycles` times leave no channel mapped."""
    init_backend(rank, world, port)
    baseline = _channel_mappings()
    for _ in range(cycles):
        g = dist.new_group()
        t = torch.ones(8)
        dist.all_reduce(t, group=g)
        assert _fast_cached(g) > 0
        dist.destroy_process_group(g)
        del g, t
    gc.collect()
    assert _channel_mappings() == baseline, (_channel_mappings(), baseline)
    dist.barrier()
