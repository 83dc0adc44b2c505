"""Bodies of tests/process_group/test_backend_fast.py: the `ncclavg` backend's fast path for a synchronous
all_reduce (Note [The backend's fast path] in ncclavg/process_group/fast_path.py) against the general path."""
import datetime
import gc
import os

import torch
import torch.distributed as dist

from _process_group_workers import init_backend

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
    """Rank 0 calls synchronously (the fast path), the others with async_op=True (the runner), call by call
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


def native_allreduce_job(rank, world, port):
    """The group's native allreduce (fast_path.native_allreduce): a Work someone holds is never handed out
    again for another call; only the last call's tensors stay referenced, and none after the group is
    destroyed; the group itself is collected; a per-call timeout in the options ends a round whose peer
    never comes, as a failed Work naming the call."""
    import weakref

    from torch._C._distributed_c10d import AllreduceOptions

    init_backend(rank, world, port)
    g = dist.new_group()
    assert type(g.allreduce).__name__ == "GroupAllreduce", type(g.allreduce)
    opts = AllreduceOptions()
    opts.reduceOp, opts.asyncOp = R.AVG, False
    a, b = torch.full((3,), float(rank)), torch.full((5,), float(rank))
    w1 = g.allreduce([a], opts)
    w2 = g.allreduce([b], opts)
    assert w1 is not w2 and w1.result()[0] is a and w2.result()[0] is b, (w1, w2)
    mean = (world - 1) / 2
    assert torch.equal(a, torch.full((3,), mean)) and torch.equal(b, torch.full((5,), mean)), (a, b)
    assert w1.is_completed() and w1.wait() and w1.exception() is None
    del w1, w2
    first = torch.ones(3)
    gone = weakref.ref(first)
    dist.all_reduce(first, group=g)
    del first
    dist.all_reduce(torch.ones(4), group=g)   # the call after: what the first call held is let go
    assert gone() is None, "the fast path kept an earlier call's tensor alive"
    last = torch.ones(6)
    held = weakref.ref(last)
    dist.all_reduce(last, group=g)
    group = weakref.ref(g)
    dist.destroy_process_group(g)
    del g, last
    gc.collect()
    assert held() is None, "the destroyed group kept its last call's tensor alive"
    assert group() is None, "the destroyed group was not collected"

    pg, h = dist.group.WORLD, dist.new_group()
    dist.all_reduce(torch.ones(2))   # the world's fast path has seen this kind of call: cached
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:   # alive, never calls: rank 0's rounds can only time out; it says when it is done
        store.wait(["timeouts checked"], datetime.timedelta(seconds=60))
        return
    # the general path (async: the job's deadline), then the native one (sync), each with its own limit
    _times_out(h, [torch.ones(3)], True, "allreduce of 3 x float32", 5.0)
    _times_out(pg, [torch.ones(2)], False, "allreduce of 2 x float32", 3.5)
    store.set("timeouts checked", "1")


def _times_out(group, tensors, async_op, what, within_s):
    """group.allreduce(tensors) with opts.timeout = 0.5 s, whose peer never calls, fails in `within_s` as a
    Work whose error names the call and the call's own timeout."""
    import time

    from torch._C._distributed_c10d import AllreduceOptions

    opts = AllreduceOptions()
    opts.reduceOp, opts.asyncOp = R.SUM, async_op
    opts.timeout = datetime.timedelta(seconds=0.5)
    start = time.monotonic()
    work = group.allreduce(tensors, opts)
    try:
        work.wait()
        raise AssertionError("a call whose peer never came completed")
    except Exception as e:   # noqa: BLE001 (judged here)
        assert what in str(e) and "within 0.5 s: the call's timeout expired" in str(e), e
    assert time.monotonic() - start < within_s, time.monotonic() - start


# ------------------------------------------------------------------ broadcast, all-gather, reduce-scatter
def _count_fast_calls(pg):
    """Wraps the group's FastCalls so that the test sees which calls they took: {name: times done}."""
    taken = {"broadcast": 0, "all_gather": 0, "reduce_scatter": 0}
    for name in taken:
        inner = getattr(pg._calls, name)

        def counted(*args, _inner=inner, _name=name):
            done = _inner(*args)
            taken[_name] += bool(done)
            return done
        setattr(pg._calls, name, counted)
    return taken


def _pattern(n, dtype, r, k):
    """Rank r's distinct input of call k: small integers (exact in every dtype below)."""
    v = (torch.arange(n, dtype=torch.int64) * 5 + 11 * r + k) % 23 - 11
    if dtype == torch.bool:
        return v > 0
    if dtype.is_complex:
        return torch.complex(v.double(), -v.double()).to(dtype)
    if dtype == torch.uint8:
        return (v + 11).to(dtype)
    return v.to(dtype)


def calls_agree_job(rank, world, port):
    """broadcast, all_gather_into_tensor and reduce_scatter_tensor with one rank synchronous (the fast
    path) and the others asynchronous (the runner), swapping call by call, over dtypes and sizes whose
    payloads are multiples of 4 bytes, of 2, and odd (the general path's padding): every rank gets the
    reference (the inputs are small integers: every sum is exact, AVG divides once)."""
    init_backend(rank, world, port)
    taken = _count_fast_calls(dist.group.WORLD)
    k = 0

    def call(fn, *args, **kw):
        nonlocal k
        fast_here = rank == k % world
        work = fn(*args, async_op=not fast_here, **kw)
        if work is not None:
            work.wait()
        k += 1

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int16,
                  torch.uint8, torch.bool, torch.complex64):
        for n in (0, 1, 3, 8, 1001, 40000):
            for root in range(world):
                t = _pattern(n, dtype, rank, k)
                want = _pattern(n, dtype, root, k)
                call(dist.broadcast, t, root)
                assert torch.equal(t, want), ("broadcast", dtype, n, root)
            inp = _pattern(n, dtype, rank, k)
            out = torch.empty(n * world, dtype=dtype)
            want = torch.cat([_pattern(n, dtype, r, k) for r in range(world)])
            call(dist.all_gather_into_tensor, out, inp)
            assert torch.equal(out, want), ("all_gather_into_tensor", dtype, n)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for op in (R.SUM, R.AVG):
            for n in (0, 1, 3, 1000, 30000):
                inp = _pattern(n * world, dtype, rank, k)
                out = torch.empty(n, dtype=dtype)
                rows = torch.stack([_pattern(n * world, torch.float64, r, k) for r in range(world)])
                total = rows.sum(0)[rank * n:(rank + 1) * n]
                if op == R.AVG:
                    total = total.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype) / world
                call(dist.reduce_scatter_tensor, out, inp, op=op)
                assert torch.equal(out, total.to(dtype)), ("reduce_scatter_tensor", dtype, op, n, out[:4], total[:4])
    assert all(taken.values()), taken   # each of the three took the fast path
    dist.barrier()


def calls_order_job(rank, world, port):
    """A synchronous broadcast, all-gather or reduce-scatter issued behind queued all_reduces waits its turn."""
    init_backend(rank, world, port)
    taken = _count_fast_calls(dist.group.WORLD)
    for k in range(20):
        big = torch.full((1 << 18,), float(rank + k))
        works = [dist.all_reduce(big, async_op=True) for _ in range(2)]
        t = torch.full((5,), float(rank + 1))
        dist.broadcast(t, k % world)
        assert torch.equal(t, torch.full((5,), float(k % world + 1))), t
        out = torch.empty(3 * world)
        dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
        assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(3)), out
        for w in works:
            w.wait()
        s = sum(r + k for r in range(world))
        assert torch.equal(big, torch.full_like(big, float(s * world))), big[:2]
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.ones(2 * world))
    assert torch.equal(o, torch.full((2,), float(world)))
    assert taken["reduce_scatter"] == 1 and taken["broadcast"] + taken["all_gather"] > 0, taken
    dist.barrier()


def calls_mismatch_job(rank, world, port, outdir):
    """Rank 0 broadcasts 4 float32 while rank 1 all-gathers 2 (the same bytes on the wire): both fast,
    both fail naming both calls, and the group then refuses, fast path or not."""
    import json

    init_backend(rank, world, port, timeout_s=30)
    taken = _count_fast_calls(dist.group.WORLD)
    x = torch.ones(4)
    dist.broadcast(x, 0)
    rep = {}
    try:
        if rank == 0:
            dist.broadcast(x, 0)
        else:
            dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
        rep["first"] = "none"
    except Exception as e:   # noqa: BLE001 (judged by the test)
        rep["first"] = f"{type(e).__name__}: {e}"
    try:
        dist.broadcast(x, 0)
        rep["later"] = "none"
    except Exception as e:   # noqa: BLE001
        rep["later"] = f"{type(e).__name__}: {e}"
    rep["taken"] = taken
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)


def calls_grad_job(rank, world, port):
    """Tensors that require grad (nn.Parameter) go through the fast paths as through gloo: in place,
    the group usable after."""
    init_backend(rank, world, port)
    taken = _count_fast_calls(dist.group.WORLD)
    p = torch.nn.Parameter(torch.full((4,), float(rank)))
    dist.broadcast(p, 1)
    assert torch.equal(p.detach(), torch.full((4,), 1.0)) and p.requires_grad
    out = torch.nn.Parameter(torch.zeros(2))
    dist.reduce_scatter_tensor(out, torch.full((2 * world,), float(rank + 1)), op=R.AVG)
    assert torch.equal(out.detach(), torch.full((2,), (world + 1) / 2)), out
    assert taken["broadcast"] == 1 and taken["reduce_scatter"] == 1, taken
    dist.barrier()
