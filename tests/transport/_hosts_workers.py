"""Bodies of tests/transport/test_hosts_algorithm.py: the all-reduce and the broadcast between (pretend)
hosts of ncclavg/transport/hosts.py (Note [Several hosts]) through both faces, around their boundaries
(the record's 4 KiB, the chunks, shards that do not divide), exact against a float64 reference (the
broadcast: the root's bytes), the same bits on every rank, and the exchanges between the hosts counted:
the calls' check rides in the first one."""
import os
import time

import torch
import torch.distributed as dist

from _dist_util import between_hosts
from _process_group_workers import init_backend

R = dist.ReduceOp
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def exact(rank, numel, dtype, seed):
    """Multiples of 1/4 in [-4, 4): any sum of 4 of them is exact in every float type here, and so is its
    division by 4 (a power of two): the reference is exact, the comparison bit for bit."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randint(-16, 16, (numel,), generator=g) * 0.25).to(dtype)


def sizes_around(dtype, chunk_bytes, hosts):
    """Element counts on both sides of every boundary between `hosts` hosts: nothing, FOLD_BYTES (the
    record's data when a call does not fit it whole), the most a record carries whole (fold_limit), past
    it the chunks of the pipeline (their edges, and counts no number of lanes divides), and the most a
    record carries as slices."""
    from ncclavg.transport.calls import FOLD_BYTES, fold_limit

    fold, chunk = FOLD_BYTES // dtype.itemsize, chunk_bytes // dtype.itemsize
    whole = fold_limit(hosts) // dtype.itemsize
    k = -(-(whole - fold) // chunk) + 1   # the first whole number of chunks past the record
    # (between 3 hosts or more with no channel, a sum up to `hosts` records' worth is a record that
    # reduce-scatters, then gloo's all-gather: its edge too)
    return sorted({0, 1, 3, fold - 1, fold, fold + 1, whole - 1, whole, whole + 1, fold + k * chunk - 1,
                   fold + k * chunk, fold + (k + 1) * chunk + 7, hosts * whole, hosts * whole + 1})


def layout_hosts(layout):
    """(hosts, the most processes on one host) of a pretend layout (each rank's host)."""
    return len(set(layout)), max(layout.count(h) for h in set(layout))


class Spy:
    """Counts the operations a c10d group runs (by method name), passing them on."""

    def __init__(self, real):
        self.real, self.ops = real, []

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name.startswith("_allgather") or name in ("allreduce", "broadcast", "alltoall_base", "allgather", "send",
                                                     "recv"):
            def run(*a, **kw):
                self.ops.append(name)
                return fn(*a, **kw)
            return run
        return fn


def spy_between_hosts(pg):
    """A Spy on every group this process sends over between the hosts: its lanes (shm+gloo), else the
    group's own gloo (every process alone on its host)."""
    transport = pg._runner.transport
    if transport is None:
        pg._cpu.paths.gloo.gloo = spy = Spy(pg._cpu.paths.gloo.gloo)
        return [spy]
    spies = []
    for lane in transport.lane_groups:
        lane.group = Spy(lane.group)
        spies.append(lane.group)
    return spies


def across_hosts_job(rank, world, port, layout, chunk_kb):
    """Every float dtype x SUM / AVG x sizes around the boundaries, through the torch face and the public
    API: exact results, and for random float32 the same bits on every rank within the float64 bound; then
    the reduce-scatters, all-gathers and broadcasts between the hosts."""
    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = str(chunk_kb)
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    pg = dist.group.WORLD
    from ncclavg import Communicator
    import ncclavg.comm.gloo as gloo_backend

    gloo_backend.host_identity = lambda: f"test-host-{layout[rank]}"
    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    assert comm.transport == pg.transport, (comm.transport, pg.transport)
    hosts = layout_hosts(layout)[0]
    for seed, dtype in enumerate(FLOATS):
        for n in sizes_around(dtype, chunk_kb << 10, hosts):
            xs = [exact(r, n, dtype, seed) for r in range(world)]
            total = sum(x.double() for x in xs)
            for op, want in ((R.SUM, total), (R.AVG, total / world)):
                t = xs[rank].clone()
                dist.all_reduce(t, op=op)
                assert torch.equal(t, want.to(dtype)), (dtype, n, op)
            if dtype != torch.float64:   # the public API's towers hold float32, bfloat16 or float16
                t = xs[rank].clone()
                comm.all_reduce_avg([t])
                assert torch.equal(t, (total / world).to(dtype)), ("api", dtype, n)
    # random float32: the same bits on every rank, within gamma_{world-1} * sum|x| of the float64 sum (any
    # order of adding `world` terms is: Higham, ch. 3)
    n = sizes_around(torch.float32, chunk_kb << 10, hosts)[-1]
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    t = xs[rank].clone()
    dist.all_reduce(t)
    rows = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(rows, t)
    assert all(torch.equal(r, t) for r in rows)
    u, k = 2.0 ** -24, world - 1
    bound = k * u / (1 - k * u) * sum(x.double().abs() for x in xs)
    assert bool(((t.double() - sum(x.double() for x in xs)).abs() <= bound).all())
    slice_collectives(rank, world, chunk_kb, comm, layout)
    broadcasts(rank, world, chunk_kb, hosts)
    dist.barrier()


def slice_sizes(dtype, world, chunk_kb, layout):
    """Slice lengths on both sides of the boundaries of reduce_scatter and all_gather between the hosts of
    `layout`: the most a record carries whole (the largest host's slices within fold_limit), past it the
    record's head of every slice and whole chunks after it, one chunk more, several, and lengths nothing
    divides."""
    from ncclavg.transport.calls import FOLD_BYTES, fold_limit

    hosts, most = layout_hosts(layout)
    per = max(1, (chunk_kb << 10) // (dtype.itemsize * world))
    whole = fold_limit(hosts) // (dtype.itemsize * most)
    head = FOLD_BYTES // (dtype.itemsize * most)   # past `whole`, the record's part of every slice
    k = -(-(whole - head) // per) + 1              # the first whole number of chunks past it
    edges = {whole, whole + per, whole + 3 * per, head + k * per}
    return sorted({0, 1, 3} | {e + d for e in edges for d in (-1, 0, 1)} | {whole + 3 * per + 7})


def slice_collectives(rank, world, chunk_kb, comm, layout):
    """reduce_scatter (SUM, AVG of every float type; MAX of int32) and all_gather (every float type, uint8
    of odd lengths) through the torch face, and the public API's reduce_scatter_avg and all_gather, around
    slice_sizes: exact (the data of `exact`: every sum of `world` terms is exact, and so is its division by
    a power of two; world is 4 here)."""
    for seed, dtype in enumerate(FLOATS + [torch.uint8, torch.int32]):
        for n in slice_sizes(dtype, world, chunk_kb, layout):
            full = [exact(r, n * world, torch.float32, 10 + seed) for r in range(world)]
            if not dtype.is_floating_point:
                full = [(f * 4 + 16).to(dtype) for f in full]   # whole numbers in [0, 32)
            full = [f.to(dtype) for f in full]
            gathered = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(gathered, full[rank][:n].clone())
            assert torch.equal(gathered, torch.cat([f[:n] for f in full])), ("all_gather", dtype, n)
            if dtype == torch.uint8:
                continue
            mine = slice(rank * n, (rank + 1) * n)
            total = sum(f.double() for f in full)[mine]
            ops = ((R.SUM, total), (R.AVG, total / world)) if dtype.is_floating_point else \
                ((R.MAX, torch.stack(full).max(0).values[mine].double()), (R.SUM, total))
            for op, want in ops:
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank].clone(), op=op)
                assert torch.equal(out, want.to(dtype)), ("reduce_scatter", dtype, n, op)
            if dtype in (torch.float32, torch.bfloat16, torch.float16):   # the public API's tower types
                out = torch.empty(n, dtype=dtype)
                comm.reduce_scatter_avg([full[rank].clone()], [out])
                assert torch.equal(out, (total / world).to(dtype)), ("api reduce_scatter_avg", dtype, n)
                gathered = torch.empty(n * world, dtype=dtype)
                comm.all_gather([full[rank][:n].clone()], [gathered])
                assert torch.equal(gathered, torch.cat([f[:n] for f in full])), ("api all_gather", dtype, n)


def random_bits(numel, dtype, seed):
    """Random bytes seen as `dtype` (NaNs and infinities among them): a broadcast must copy bits, so the
    comparison is of the bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)


def broadcasts(rank, world, chunk_kb, hosts):
    """A broadcast from every rank (the leader of a host or not, any host) through the torch face, sizes
    around the record's payload and the chunks, a 4-byte and a 1-byte type: every rank gets the root's
    bytes."""
    for root in range(world):
        for dtype in (torch.float32, torch.uint8):
            for n in sizes_around(dtype, chunk_kb << 10, hosts):
                want = random_bits(n, dtype, 1000 * root + n)
                b = want.clone() if rank == root else random_bits(n, dtype, 7 + rank)
                dist.broadcast(b, src=root)
                assert torch.equal(b.view(torch.uint8), want.view(torch.uint8)), (root, dtype, n)


def slices_job(rank, world, port, layout, chunk_kb):
    """slice_collectives() alone, between pretend hosts of `layout`."""
    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = str(chunk_kb)
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    alone = len(set(layout)) == len(layout)   # every process alone on its host: no channel, the group's gloo
    assert dist.group.WORLD.transport == between_hosts(alone), dist.group.WORLD.transport
    from ncclavg import Communicator
    import ncclavg.comm.gloo as gloo_backend

    gloo_backend.host_identity = lambda: f"test-host-{layout[rank]}"
    slice_collectives(rank, world, chunk_kb, Communicator.from_torch_distributed(device="cpu", timeout=60), layout)
    dist.barrier()


def broadcast_job(rank, world, port, layout, chunk_kb):
    """broadcasts() alone, between pretend hosts of `layout`."""
    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = str(chunk_kb)
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    assert dist.group.WORLD.transport == between_hosts(), dist.group.WORLD.transport
    broadcasts(rank, world, chunk_kb, layout_hosts(layout)[0])
    dist.barrier()


# exchanges_job's sizes, float32 elements: one, the most a record between two hosts carries whole (256 KiB),
# one more (the record carries its first 4 KiB, the rest goes in chunks of 16 KiB); a reduce-scatter's and
# an all-gather's slices of 2 x 2 processes the same way (two slices a host: 128 KiB of each at the edge)
EXCHANGE_SIZES = (1, 65536, 65537)
SLICE_SIZES = (1, 32768, 32769)


def exchanges_job(rank, world, port, layout, outdir):
    """What crosses the hosts for one all_reduce: the record that compares the calls and carries the first
    4 KiB, then, for a larger one, the lanes' all-reduces; no exchange of the calls alone."""
    import json

    os.environ["NCCLAVG_HOSTS_CHUNK_KB"] = "16"
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    pg = dist.group.WORLD
    spies = spy_between_hosts(pg)
    seen = {}
    for n in EXCHANGE_SIZES:   # within the record, its edge (256 KiB), past it (in chunks of 16 KiB)
        for s in spies:
            s.ops.clear()
        t = torch.ones(n)
        dist.all_reduce(t, async_op=True).wait()   # not the one-host fast path: there is none between hosts
        assert torch.equal(t, torch.full((n,), float(world)))
        seen[n] = [list(s.ops) for s in spies]
        for s in spies:
            s.ops.clear()
        b = torch.full((n,), float(rank))
        dist.broadcast(b, src=world - 1)   # from the last rank: not a host's leader where hosts have two
        assert torch.equal(b, torch.full((n,), float(world - 1)))
        seen[f"broadcast {n}"] = [list(s.ops) for s in spies]
    if pg.transport == "shm+gloo":   # reduce-scatter and all-gather: within the record, its edge, past it
        for n in SLICE_SIZES:   # (a chunk: 16 KiB through a host's channel, 1024 elements of each slice)
            for s in spies:
                s.ops.clear()
            out = torch.empty(n * world)
            dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
            assert torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(n))
            seen[f"all_gather {n}"] = [list(s.ops) for s in spies]
            for s in spies:
                s.ops.clear()
            out = torch.empty(n)
            dist.reduce_scatter_tensor(out, torch.ones(n * world))
            assert torch.equal(out, torch.full((n,), float(world)))
            seen[f"reduce_scatter {n}"] = [list(s.ops) for s in spies]
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"transport": pg.transport, "seen": seen}, f)
    dist.barrier()


def host_mismatch_job(rank, world, port, layout, outdir, counts, collective="all_reduce"):
    """The last rank's host calls `collective` (all_reduce, broadcast from the last rank, all_gather or
    reduce_scatter: `counts` then count each rank's slice) with another count than the others (`counts`: (theirs, the last rank's)): every rank fails naming both calls, within
    one exchange, no process is ended by gloo's own check of the sizes."""
    import json

    init_backend(rank, world, port, timeout_s=30, layout=layout)
    n = counts[1] if layout[rank] == layout[-1] else counts[0]
    t0 = time.monotonic()
    try:
        if collective == "broadcast":
            dist.broadcast(torch.ones(n), src=world - 1, async_op=True).wait()
        elif collective == "all_gather":   # n: each rank's slice
            dist.all_gather_into_tensor(torch.empty(n * world), torch.ones(n), async_op=True).wait()
        elif collective == "reduce_scatter":
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world), async_op=True).wait()
        else:
            dist.all_reduce(torch.ones(n), async_op=True).wait()
        res = {"error": None}
    except Exception as e:   # noqa: BLE001 (reported for the test to judge)
        res = {"error": str(e), "type": type(e).__name__}
    res["elapsed"] = time.monotonic() - t0
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    from ncclavg.comm import end_process

    end_process(0)   # the group failed: no teardown


def fast_path_job(rank, world, port, layout, lanes):
    """The small all-reduces between hosts on the native fast path (Note [Small-message fast path] in
    ncclavg/comm/fast_average.py), through both faces, with ranks that take it and ranks that take the general
    path in the same call (an asynchronous call always takes the general path there): the same bits on every
    rank, SUM within the float64 bound of any order, AVG the general path's division of that sum; on gloo's
    lanes (`lanes` "gloo") there is no fast path and every call is the general one."""
    init_backend(rank, world, port, timeout_s=60, layout=layout)
    pg = dist.group.WORLD
    from ncclavg import Communicator
    import ncclavg.comm.gloo as gloo_backend

    gloo_backend.host_identity = lambda: f"test-host-{layout[rank]}"
    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    assert pg.transport == comm.transport == between_hosts(alone=len(set(layout)) == world), pg.transport
    native = lanes == "ucx"
    assert (set(pg._fast) == {R.SUM, R.AVG}) == native and (comm._fast is not None) == native
    calls = 0
    for seed, dtype in enumerate(FLOATS):
        for n in (1, 7, 1000, 5000, 70_000):   # within one exchange (16 KiB) and past it, in chunks
            for op in (R.SUM, R.AVG):
                if op == R.AVG and dtype in (torch.float16, torch.bfloat16):
                    continue   # AVG of a 16-bit type: an fp32 sum first, never the fast path
                xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * seed + r)).to(dtype)
                      for r in range(world)]
                t = xs[rank].clone()
                fast = (calls + rank) % 2 == 0   # half the ranks on each path, alternating
                calls += 1
                if fast:
                    dist.all_reduce(t, op=op)
                else:
                    dist.all_reduce(t, op=op, async_op=True).wait()
                rows = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(rows, t)
                assert all(torch.equal(r, t) for r in rows), (dtype, n, op)
                total = sum(x.double() for x in xs)
                # the bound of summing `world` terms in any order (Higham, ch. 3) at the accumulation's unit
                # roundoff (float64's, else float32's), plus for the 16-bit types one rounding to the type per
                # host (each host's sum crosses the wire in it) and one at the end, each within its unit
                # roundoff of a partial sum no larger than sum|x|
                mag = sum(x.double().abs() for x in xs)
                u = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
                k = world - 1
                bound = k * u / (1 - k * u) * mag
                if dtype in (torch.float16, torch.bfloat16):
                    bound = bound + (len(set(layout)) + 1) * mag * (2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8)
                if op == R.SUM:
                    assert bool(((t.double() - total).abs() <= bound).all()), (dtype, n)
                else:   # the general path's division of the sum: one correctly rounded quotient
                    s = xs[rank].clone()
                    dist.all_reduce(s, op=R.SUM, async_op=True).wait()
                    assert torch.equal(t, s.div_(world)), (dtype, n)
    # the public API's all_reduce_avg: the same, its towers' dtypes
    for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        for n in (1, 1000, 70_000):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(7 + 100 * seed + r)).to(dtype)
                  for r in range(world)]
            t = xs[rank].clone()
            if (calls + rank) % 2 == 0:
                comm.all_reduce_avg([t])
            else:
                comm.all_reduce_avg_async([t]).wait()
            calls += 1
            rows = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(rows, t)
            assert all(torch.equal(r, t) for r in rows), ("api", dtype, n)
            s = xs[rank].clone()
            dist.all_reduce(s, op=R.SUM, async_op=True).wait()
            assert torch.equal(t, (s.float() / world).to(dtype)), ("api", dtype, n)
    if native:   # the fast paths ran (they keep what they saw of each tensor they took)
        assert pg._fast[R.SUM].cached > 0 and pg._fast[R.AVG].cached > 0 and comm._fast.cached > 0
    dist.barrier()
