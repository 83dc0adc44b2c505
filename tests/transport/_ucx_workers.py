"""Bodies of tests/transport/test_ucx_lanes.py: the lanes between (pretend) hosts on UCX through the torch
face, for what only they do: their calls compared in the first exchange whatever differs, a late peer
waited for without burning a core, the messages one call costs, the fallback to gloo's lanes."""
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from _process_group_workers import init_backend

R = dist.ReduceOp


def _report(outdir, rank, res):
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def mismatch_job(rank, world, port, layout, outdir, what):
    """The last host's ranks call something else than the others (`what`: which part of the call differs);
    every rank must fail naming both calls, within one exchange, and refuse the next call saying why."""
    init_backend(rank, world, port, timeout_s=30, layout=layout)
    other = layout[rank] == layout[-1]
    n = 5000
    t0 = time.monotonic()
    res = {"transport": dist.group.WORLD.transport}
    try:
        if what == "dtype":
            dist.all_reduce(torch.ones(n, dtype=torch.float64 if other else torch.float32))
        elif what == "op":
            dist.all_reduce(torch.ones(n), op=R.MAX if other else R.SUM)
        elif what == "root":
            dist.broadcast(torch.ones(n), src=0 if other else world - 1)
        elif what == "collective":
            if other:
                dist.broadcast(torch.ones(n), src=0)
            else:
                dist.all_reduce(torch.ones(n))
        else:
            raise ValueError(what)
        res["error"] = None
    except Exception as e:   # noqa: BLE001 (reported for the test to judge)
        res.update(error=str(e), type=type(e).__name__)
    res["elapsed"] = time.monotonic() - t0
    try:
        dist.all_reduce(torch.ones(4))
        res["after"] = None
    except Exception as e:   # noqa: BLE001
        res["after"] = str(e)
    _report(outdir, rank, res)
    from ncclavg.comm import end_process

    end_process(0)   # the group failed: no teardown


def late_peer_job(rank, world, port, layout, outdir, late_s):
    """Rank 0 comes `late_s` late to an all-reduce: the CPU time the others spend waiting for it."""
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    x = torch.ones(1024)
    dist.all_reduce(x)
    if rank == 0:
        time.sleep(late_s)
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    dist.all_reduce(x)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert torch.equal(x, torch.full((1024,), float(world * world)))
    _report(outdir, rank, {"cpu_s": cpu, "wall_s": time.monotonic() - wall, "transport": dist.group.WORLD.transport})
    dist.barrier()


def messages_job(rank, world, port, layout, outdir, chunk_kb):
    """The messages this rank sends between the hosts for one call of each size: the hello and the data."""
    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = str(chunk_kb)
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    lanes = dist.group.WORLD._runner.transport.lanes
    sent = {}
    for n in (2, 1024, (chunk_kb << 10) // 4 * 3):   # (2: one element per lane)
        before = lanes.messages_sent
        t = torch.ones(n)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((n,), float(world)))
        sent[n] = lanes.messages_sent - before
    _report(outdir, rank, {"sent": sent, "peers": list(lanes.peers()), "depth": lanes.depth,
                           "chunk_bytes": lanes.chunk_bytes, "ucx": dict(lanes.ucx_settings),
                           "spin_us": lanes.spin_us, "chunk_us": lanes.chunk_us})
    dist.barrier()


def fallback_job(rank, world, port, layout, outdir):
    """UCX that cannot start (the environment the test sets): the group says which transport it got."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            init_backend(rank, world, port, timeout_s=30, layout=layout)
            t = torch.ones(70000)
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((70000,), float(world)))
            res = {"transport": dist.group.WORLD.transport, "error": None}
        except Exception as e:   # noqa: BLE001
            res = {"transport": None, "error": str(e), "type": type(e).__name__}
    res["warnings"] = [str(w.message) for w in caught if "between hosts" in str(w.message)]
    _report(outdir, rank, res)
    from ncclavg.comm import end_process

    end_process(0)


def whole_edge_job(rank, world, port, layout):
    """All-reduces (SUM of every float type, exact data) and broadcasts (random bytes, every root) around
    the size up to which they go whole (_C.HOSTS_WHOLE_BYTES) and around the chunks after it: exact, the
    same bits on every rank."""
    from _hosts_workers import FLOATS, exact, random_bits

    from ncclavg import _C

    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = "32"
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    edge = _C.HOSTS_WHOLE_BYTES
    for seed, dtype in enumerate(FLOATS):
        e = edge // dtype.itemsize
        for n in (1, e - 1, e, e + 1, 3 * e + 5):
            xs = [exact(r, n, dtype, seed) for r in range(world)]
            t = xs[rank].clone()
            dist.all_reduce(t)
            assert torch.equal(t, sum(x.double() for x in xs).to(dtype)), (dtype, n)
    for root in range(world):
        for n in (edge - 1, edge, edge + 1, 5 * edge + 3):
            want = random_bits(n, torch.uint8, 100 * root + n)
            b = want.clone() if rank == root else random_bits(n, torch.uint8, rank)
            dist.broadcast(b, src=root)
            assert torch.equal(b, want), (root, n)
    dist.barrier()


def forked_child_job(rank, world, port, outdir):
    """The core's lanes alone (two processes, each its own host, addresses through a TCPStore): a child
    forked after they connected is refused, naming both pids; the parent's next call still works."""
    import datetime

    from ncclavg import _C, _ext

    assert _ext.ucx_load()["loaded"]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
    lanes = _C.HostLanes([[0], [1]], rank, None, "tcp", "", 1 << 19, 4)
    store.set(f"addr{rank}", lanes.address)
    lanes.connect([store.get(f"addr{r}") for r in range(world)], 30.0)
    res = {}
    if rank == 0:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: refused at once, before anything reaches the wire
            os.close(r)
            try:
                t = torch.ones(4)
                lanes.all_reduce_sum(t.data_ptr(), 4, 0, 5.0)
                msg = "not refused"
            except RuntimeError as e:
                msg = str(e)
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        res["child"] = os.read(r, 4096).decode()
    t = torch.full((1000,), float(rank + 1))
    lanes.all_reduce_sum(t.data_ptr(), t.numel(), 0, 30.0)
    res["sum_ok"] = bool((t == 3).all())
    _report(outdir, rank, res)


def paced_waits_job(rank, world, port, outdir, slow_chunk_us):
    """The core's lanes alone (two processes, each its own host): a pipelined call's waits poll for the
    whole window unless its chunks take longer than `slow_chunk_us`, then for HostLanes.SLOW_SPIN_US at
    most; a whole call's always for the whole window. Every result exact."""
    import datetime

    from ncclavg import _C, _ext

    assert _ext.ucx_load()["loaded"]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
    lanes = _C.HostLanes([[0], [1]], rank, None, "tcp", "", 4096, 4, 300, slow_chunk_us)
    store.set(f"addr{rank}", lanes.address)
    lanes.connect([store.get(f"addr{r}") for r in range(world)], 30.0)
    res = {"before": lanes.chunk_us}
    n = 64 * 1024   # 256 KiB of float32 in 4 KiB chunks: 64 of them
    t = torch.full((n,), float(rank + 1))
    lanes.all_reduce_sum(t.data_ptr(), n, 0, 60.0)
    res.update(sum_ok=bool((t == 3).all()), chunk_us=lanes.chunk_us, pipelined=lanes.wait_window_us)
    t = torch.full((8,), float(rank + 1))
    lanes.all_reduce_sum(t.data_ptr(), 8, 0, 60.0)
    res.update(whole_ok=bool((t == 3).all()), whole=lanes.wait_window_us)
    _report(outdir, rank, res)


def lanes_timeout_job(rank, world, port, layout, outdir, absent):
    """The ranks in `absent` never make the call; the others call the lanes directly with a 1 s limit: a
    lane's wait (or a channel step inside the call) past its deadline is a plain timeout that names no rank
    (Note [A timeout between the hosts] in csrc/transport/host_lanes.cpp)."""
    from ncclavg._ext import _C
    from ncclavg.transport.calls import make
    from ncclavg.transport.shm import tag

    init_backend(rank, world, port, timeout_s=60, layout=layout)
    lanes = dist.group.WORLD._runner.transport.lanes
    t = torch.ones(1024)
    dist.all_reduce(t)   # connected, and every rank past its first call
    res = {"transport": dist.group.WORLD.transport}
    if rank in absent:
        time.sleep(4.0)   # until the others have timed out and reported
    else:
        t0 = time.monotonic()
        try:
            lanes.all_reduce_sum(t.data_ptr(), t.numel(), 0, 1.0, *tag(make("all_reduce", t.dtype, count=t.numel())))
            res["error"] = None
        except Exception as e:   # noqa: BLE001 (reported for the test to judge)
            res.update(error=str(e), type=type(e).__name__, comm_timeout=isinstance(e, _C.CommTimeoutError),
                       shm_timeout=isinstance(e, _C.ShmTimeoutError))
        res["elapsed"] = time.monotonic() - t0
        res["refused"] = None
        try:
            lanes.all_reduce_sum(t.data_ptr(), t.numel(), 0, 1.0, *tag(make("all_reduce", t.dtype, count=t.numel())))
        except Exception as e:   # noqa: BLE001
            res["refused"] = str(e)
    _report(outdir, rank, res)
    from ncclavg.comm import end_process

    end_process(0)   # the lanes failed: no teardown
