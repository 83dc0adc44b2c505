"""Bodies of the multi-process tests of the `ncclavg` torch.distributed backend (spawned children import
this module by name). Each rank initialises the default group with backend "ncclavg" and, for reference,
a gloo group over the same ranks, and compares every result with gloo's in the same process."""
import datetime
import functools
import os

import torch
import torch.distributed as dist

from _comm_gloo_workers import gamma
from _dist_util import between_hosts

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def init_backend(rank, world, port, timeout_s=60, layout=None, init="tcp"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import ncclavg  # noqa: F401  (registers the backend)

    if layout:   # pretend hosts: Note [When the shared-memory channel is used] in ncclavg/transport/shm.py
        import ncclavg.process_group.connect as setup

        setup.host_identity = lambda: f"test-host-{layout[rank]}"
    method = f"tcp://127.0.0.1:{port}" if init == "tcp" else init
    dist.init_process_group("ncclavg", init_method=method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def expected_transport(layout, world):
    hosts = set(layout) if layout else {0}
    if os.environ.get("NCCLAVG_SHM") == "0" or len(hosts) == 1 == world:
        return "gloo"
    if len(hosts) == 1:
        return "shm"
    return between_hosts(alone=len(hosts) == world)


def exact_input(rank, numel, dtype, seed, lo=-8, hi=8):
    """Values whose sums, maxima and the like are exact in any order: small integers (times 1/4 for floats)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, hi, (numel,), generator=g).to(dtype)
    x = torch.randint(lo, hi, (numel,), generator=g)
    if dtype.is_complex:
        return torch.complex(x * 0.25, x.flip(0) * 0.5).to(dtype)
    return (x * 0.25).to(dtype) if dtype.is_floating_point else x.to(dtype)


def product_input(rank, numel, dtype, seed):
    """Inputs whose products are exact: +-1, +-2 and 1/2 (0 and 1 for bool, small for integers)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    choices = torch.tensor([1.0, -1.0, 2.0, 0.5, -2.0]) if dtype.is_floating_point else torch.tensor([1, -1, 2, 3])
    if dtype == torch.uint8:
        choices = torch.tensor([1, 2, 3])
    return choices[torch.randint(0, len(choices), (numel,), generator=g)].to(dtype)


def same(a, b):
    """Bit for bit (NaN-free inputs): equal values and dtypes."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def check_all_reduce(rank, world, gloo):
    ops = {"SUM": R.SUM, "AVG": R.AVG, "MIN": R.MIN, "MAX": R.MAX, "PRODUCT": R.PRODUCT}
    for dtype in FLOATS + INTS + [torch.bool, torch.complex64]:
        for name, op in ops.items():
            if dtype.is_complex and name not in ("SUM", "AVG"):
                continue
            for numel in (1, 7, 1001):
                make = product_input if name == "PRODUCT" else exact_input
                x = make(rank, numel, dtype, seed=numel)
                ours, ref = x.clone(), x.clone()
                dist.all_reduce(ours, op=op)
                try:
                    dist.all_reduce(ref, op=op, group=gloo)
                except (RuntimeError, ValueError):   # gloo has no such op for the dtype: our own definition
                    xs = [make(r, numel, dtype, seed=numel) for r in range(world)]
                    ref = _reference(xs, name, world)
                assert same(ours, ref), (dtype, name, numel, ours[:8], ref[:8])
    # bitwise ops on integers and bool
    for dtype in INTS + [torch.bool]:
        for op in (R.BAND, R.BOR, R.BXOR):
            x = exact_input(rank, 33, dtype, seed=5, lo=0)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours, op=op)
            try:
                dist.all_reduce(ref, op=op, group=gloo)
            except RuntimeError:   # gloo has no int16 kernels
                fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
                ref = functools.reduce(fn, [exact_input(r, 33, dtype, seed=5, lo=0) for r in range(world)])
            assert same(ours, ref), (dtype, op)
    # random float32 / bfloat16 against the float64 sum: the channel sums in rank order with fp32
    # accumulation and rounds once (|err| <= gamma_{world-1} * sum|x| for float32 (Higham, ch. 3), plus
    # one bfloat16 rounding, u = 2^-8, of the result for bfloat16); gloo adds in bfloat16, world - 1
    # roundings: gamma_{world-1} with u = 2^-8; across hosts each host's sum is rounded once, then the
    # hosts' sums are added by gloo in bfloat16: at most world roundings, gamma_world with u = 2^-8
    transport = dist.group.WORLD.transport
    bf16 = {"shm": gamma(world - 1) + 2.0 ** -8, "gloo": gamma(world - 1, 2.0 ** -8)}.get(transport,
                                                                                         gamma(world, 2.0 ** -8))
    for dtype, bound in ((torch.float32, gamma(world - 1)), (torch.bfloat16, bf16)):
        xs = [torch.randn(4099, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
        ours = xs[rank].clone()
        dist.all_reduce(ours)
        truth = sum(x.double() for x in xs)
        scale = sum(x.double().abs() for x in xs)
        assert bool(((ours.double() - truth).abs() <= bound * scale).all()), dtype


def _reference(xs, name, world):
    """The result gloo would give where gloo has no kernel (e.g. int16, integer AVG), computed apart from
    the backend's code: integer results in int64, then cast back (no overflow with these inputs)."""
    stack = torch.stack(xs)
    dtype = stack.dtype
    if dtype == torch.bool:
        return stack.any(0) if name in ("SUM", "MAX", "AVG") else stack.all(0)
    wide = stack.to(torch.int64) if not (dtype.is_floating_point or dtype.is_complex) else stack
    if name == "SUM":
        out = wide.sum(0)
    elif name == "AVG":   # integers: C's division (truncation toward zero), as NCCL's ncclAvg
        out = torch.div(wide.sum(0), world, rounding_mode="trunc") if wide.dtype == torch.int64 else wide.sum(0) / world
    elif name == "MIN":
        out = wide.min(0).values
    elif name == "MAX":
        out = wide.max(0).values
    else:
        out = wide.prod(0)
    return out.to(dtype)


def check_data_movement(rank, world, gloo):
    """Broadcast, all-gather, gather and scatter move bytes: the expected result is every rank's input as
    it was (each rank can compute every rank's input), for every dtype, gloo's or not (gloo has no int16)."""
    for dtype in FLOATS + INTS + [torch.bool, torch.complex64]:
        for numel in (1, 5, 4097):   # odd byte counts for the 1-byte dtypes: the padded path
            xs = [exact_input(r, numel, dtype, seed=numel + 1) for r in range(world)]
            x = xs[rank]
            for root in range(world):
                ours = x.clone()
                dist.broadcast(ours, src=root)
                assert same(ours, xs[root]), (dtype, numel, root)
            out = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            assert same(out, torch.cat(xs)), (dtype, numel)
            outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, x)
            assert all(same(a, b) for a, b in zip(outs, xs)), (dtype, numel)
            root = world - 1
            gl = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(x, gl, dst=root)
            if rank == root:
                assert all(same(a, b) for a, b in zip(gl, xs)), (dtype, numel)
            sl = [exact_input(r + 10, numel, dtype, seed=3) for r in range(world)]
            o1 = torch.empty(numel, dtype=dtype)
            dist.scatter(o1, sl if rank == 0 else None, src=0)
            assert same(o1, sl[rank]), (dtype, numel)
    # and the same calls through gloo for a dtype it has, as a check of the check
    x = exact_input(rank, 6, torch.float32, seed=1)
    a, b = x.clone(), x.clone()
    dist.broadcast(a, src=world - 1)
    dist.broadcast(b, src=world - 1, group=gloo)
    assert same(a, b)


def check_sparse(rank, world, gloo):
    """Sparse COO all_reduce (SUM), as gloo's: ranks with different nonzeros (and none at all on rank 0),
    1-D and with a dense dimension; the result equals gloo's."""
    for shape, dense in (((40,), ()), ((12, 3), (3,))):
        g = torch.Generator().manual_seed(rank)
        nnz = 0 if rank == 0 else 3 + rank
        idx = torch.randint(0, shape[0], (1, nnz), generator=g)
        vals = (torch.randint(-8, 8, (nnz,) + dense, generator=g) * 0.25)
        x = torch.sparse_coo_tensor(idx, vals, shape)
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=gloo)
        assert ours.is_sparse and torch.equal(ours.to_dense(), ref.to_dense()), (shape, rank)


def check_reduce_scatter_and_more(rank, world, gloo):
    for dtype in FLOATS + [torch.int32, torch.int64]:
        for op in (R.SUM, R.AVG, R.MAX, R.MIN):
            shard = 9
            x = exact_input(rank, shard * world, dtype, seed=11)
            ours, ref = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
            dist.reduce_scatter_tensor(ours, x, op=op)
            try:
                dist.reduce_scatter_tensor(ref, x, op=op, group=gloo)
            except (RuntimeError, ValueError):
                whole = _reference([exact_input(r, shard * world, dtype, seed=11) for r in range(world)], "AVG", world)
                ref = whole[rank * shard:(rank + 1) * shard]
            assert same(ours, ref), (dtype, op)
            lst = list(x.chunk(world))
            o1, o2 = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
            dist.reduce_scatter(o1, lst, op=op)
            if op != R.AVG:
                dist.reduce_scatter(o2, lst, op=op, group=gloo)
                assert same(o1, o2), (dtype, op)
            else:
                assert same(o1, ours), (dtype, op)
    # reduce (to each root), all_reduce_coalesced, alltoall, all_to_all_single, send/recv, barrier
    for root in range(world):
        x = exact_input(rank, 17, torch.float32, seed=root)
        ours, ref = x.clone(), x.clone()
        dist.reduce(ours, dst=root)
        dist.reduce(ref, dst=root, group=gloo)
        if rank == root:
            assert same(ours, ref)
        else:
            assert same(ours, x)   # a non-root's tensor is left as it was
    ts = [exact_input(rank, n, torch.float32, seed=n) for n in (3, 4, 5)]
    refs = [t.clone() for t in ts]
    dist.all_reduce_coalesced(ts)
    for r in refs:
        dist.all_reduce(r, group=gloo)
    assert all(same(a, b) for a, b in zip(ts, refs))
    x = exact_input(rank, 2 * world, torch.float32, seed=2)
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(o1, x)
    dist.all_to_all_single(o2, x, group=gloo)
    assert same(o1, o2)
    ins = [exact_input(rank * world + k, 3, torch.int64, seed=4) for k in range(world)]
    outs, refs = [torch.empty(3, dtype=torch.int64) for _ in range(world)], [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, ins)
    dist.all_to_all(refs, ins, group=gloo)
    assert all(same(a, b) for a, b in zip(outs, refs))
    # point to point, around the ring, the receive posted first
    got = torch.empty(4)
    req = dist.irecv(got, src=(rank - 1) % world)
    dist.send(torch.full((4,), float(rank)), dst=(rank + 1) % world)
    req.wait()
    assert same(got, torch.full((4,), float((rank - 1) % world)))
    dist.barrier()


def check_async_and_functional(rank, world):
    import torch.distributed._functional_collectives as fc

    works, ts = [], []
    for k in range(5):   # issued back to back, completed in order by the runner
        t = torch.full((1000,), float(rank + k))
        ts.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    fut = works[-1].get_future()
    for k, w in enumerate(works):
        assert w.wait(timeout=datetime.timedelta(seconds=30))
        assert w.is_completed()
        assert same(ts[k], torch.full((1000,), float(sum(r + k for r in range(world)))))
    assert same(fut.wait()[0], ts[-1])
    y = fc.all_reduce(torch.ones(3), "sum", dist.group.WORLD)
    assert same(fc.wait_tensor(y) if hasattr(fc, "wait_tensor") else y, torch.full((3,), float(world)))
    z = fc.all_gather_single(torch.full((2,), float(rank)), 0, dist.group.WORLD) \
        if hasattr(fc, "all_gather_single") else fc.all_gather_tensor(torch.full((2,), float(rank)), 0, dist.group.WORLD)
    assert same(z, torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    with dist._coalescing_manager(async_ops=True) as cm:
        a, b = torch.ones(3), torch.full((2,), 2.0)
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert same(a, torch.full((3,), float(world))) and same(b, torch.full((2,), 2.0 * world))


def check_bad_arguments(rank, world):
    """Every bad argument raises before anything is sent, naming the argument; the group stays usable."""
    cases = [
        (ValueError, "contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t())),
        (ValueError, "output_tensor", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))),
        (ValueError, "input_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world + 1))),
        (TypeError, "input_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world).double())),
        (ValueError, "op", lambda: dist.all_reduce(torch.ones(2), op=R.BAND)),
        (ValueError, "tensor_list", lambda: dist.all_gather([torch.empty(2)], torch.ones(2))),
        # uneven outputs (gloo refuses them too): refused before anything moves, the group stays usable
        (ValueError, "tensor_list", lambda: dist.all_gather([torch.empty(2)] * (world - 1) + [torch.empty(3)],
                                                            torch.ones(2))),
        (TypeError, "dense tensors", lambda: dist.all_reduce(torch.ones(2, 2).to_sparse_csr())),
        (ValueError, "op", lambda: dist.all_reduce(torch.ones(2).to_sparse(), op=R.MAX)),   # sparse: SUM only
    ]
    pg = dist.group.WORLD
    from torch._C._distributed_c10d import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = world
    cases.append((ValueError, "src", lambda: pg.broadcast([torch.ones(2)], opts)))
    for cls, name, call in cases:
        try:
            call()
        except cls as e:
            assert name in str(e), (name, str(e))
        else:
            raise AssertionError(f"expected {cls.__name__} naming {name}")
    t = torch.ones(2)
    dist.all_reduce(t)
    assert same(t, torch.full((2,), float(world)))


def collectives_job(rank, world, port, layout=None):
    init_backend(rank, world, port, layout=layout)
    pg = dist.group.WORLD
    assert type(pg).__name__ == "ProcessGroupNcclavg" and dist.get_backend() == "ncclavg"
    assert pg.transport == expected_transport(layout, world), pg.transport
    gloo = dist.new_group(backend="gloo")
    check_all_reduce(rank, world, gloo)
    check_data_movement(rank, world, gloo)
    check_reduce_scatter_and_more(rank, world, gloo)
    check_sparse(rank, world, gloo)
    check_async_and_functional(rank, world)
    check_bad_arguments(rank, world)
    # a group over every rank has a lane and a channel of its own (Note [One channel per group])
    again = dist.new_group()
    assert again._runner is not pg._runner and again.transport == pg.transport
    t = torch.ones(3)
    dist.all_reduce(t, group=again)
    assert same(t, torch.full((3,), float(world)))
    dist.barrier()


def subgroups_job(rank, world, port):
    """world 4: two subgroups of two ranks (a channel each), a group of three, and gloo twins of each."""
    init_backend(rank, world, port)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs_gloo = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    three, three_gloo = dist.new_group([1, 2, 3]), dist.new_group([1, 2, 3], backend="gloo")
    mine, mine_gloo = pairs[rank // 2], pairs_gloo[rank // 2]
    assert mine._runner is not dist.group.WORLD._runner and mine.transport == "shm"
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        x = exact_input(rank, 101, dtype, seed=7)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=mine)
        dist.all_reduce(b, group=mine_gloo)
        assert same(a, b), dtype
        a, b = x.clone(), x.clone()
        src = 1 + 2 * (rank // 2)   # a global rank of my pair
        dist.broadcast(a, src=src, group=mine)
        dist.broadcast(b, src=src, group=mine_gloo)
        assert same(a, b), dtype
        if rank != 0:
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=R.MAX, group=three)
            dist.all_reduce(b, op=R.MAX, group=three_gloo)
            assert same(a, b), dtype
            out = torch.empty(3 * 101, dtype=dtype)
            ref = torch.empty(3 * 101, dtype=dtype)
            dist.all_gather_into_tensor(out, x, group=three)
            dist.all_gather_into_tensor(ref, x, group=three_gloo)
            assert same(out, ref), dtype
    # a 2 x 2 DeviceMesh: its row and column groups are groups of the backend too
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        t = torch.full((4,), float(rank))
        dist.all_reduce(t, group=g)
        members = dist.get_process_group_ranks(g)
        assert same(t, torch.full((4,), float(sum(members)))), (dim, members)
    dist.barrier()


def mismatch_job(rank, world, port):
    """Ranks that call a collective with different sizes fail with an error naming both, never hang."""
    from ncclavg.process_group.face import BackendError

    init_backend(rank, world, port, timeout_s=20)
    t = torch.ones(10 + rank)
    try:
        dist.all_reduce(t)
        raise AssertionError("expected an error")
    except BackendError as e:
        assert isinstance(e, dist.DistBackendError), type(e).__mro__
        text = str(e)
        # the channel compares every round's collective: both calls named, on both ranks
        assert "out of step" in text and "10 float32" in text and "11 float32" in text, text
    try:
        dist.all_reduce(torch.ones(2))
        raise AssertionError("expected the group to stay failed")
    except BackendError as e:
        assert "earlier collective failed" in str(e), str(e)


def peer_lost_job(rank, world, port, outdir, victim, how, timeout, mode):
    """The victim is killed (SIGKILL) or frozen (SIGSTOP) after a few good collectives; every survivor's
    next collective (a plain all_reduce, or a DDP step) must fail naming it, within the timeout."""
    import signal
    import time

    from _fault_util import report

    init_backend(rank, world, port, timeout_s=timeout)
    model = None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 2)))
    for _ in range(3):
        t = torch.ones(1000)
        dist.all_reduce(t)
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)
    time.sleep(0.2)   # the victim is gone (or frozen) before the survivors' next call
    t0 = time.monotonic()
    try:
        for _ in range(3):
            if model is not None:
                model(torch.randn(4, 8)).sum().backward()
            else:
                dist.all_reduce(torch.ones(1000))
        report(outdir, rank, type="none", msg="no error", elapsed=time.monotonic() - t0)
    except Exception as e:   # noqa: BLE001 (reported for the test to judge)
        later = ""
        try:
            dist.all_reduce(torch.ones(2))
        except Exception as e2:   # noqa: BLE001
            later = f"{type(e2).__name__}: {e2}"
        report(outdir, rank, type=type(e).__name__, classes=[c.__name__ for c in type(e).__mro__], msg=str(e),
               elapsed=time.monotonic() - t0, later=later)
    # rank 0 hosts the store (tcp://): it stays until every survivor has named the lost rank through it
    deadline = time.monotonic() + 30
    survivors = [r for r in range(world) if r != victim]
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(outdir, f"rank{r}.json"))
                                                  for r in survivors):
        time.sleep(0.05)
    from ncclavg.comm import end_process

    end_process(0)


def reinit_job(rank, world, port, files):
    """file:// initialisation; destroy_process_group() lets the queued work finish and closes the channel;
    a second init_process_group in the same processes gets a new one."""
    for k, path in enumerate(files):
        init_backend(rank, world, port, init=f"file://{path}")
        pg = dist.group.WORLD
        works = [dist.all_reduce(torch.full((100,), float(rank + k)), async_op=True) for _ in range(4)]
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        assert same(t, torch.full((3,), float(sum(range(world)))))
        assert all(w.is_completed() for w in works)   # issued before, completed in order
        runner = pg._runner
        dist.destroy_process_group()
        assert runner.closed


def own_timeout_job(rank, world, port, outdir):
    """Each collective keeps its own group's timeout: a group made with timeout=2 s gives up after 2 s
    while the default group's is 60 s (Note [One deadline per call] in ncclavg/transport/runner.py)."""
    import time

    from _fault_util import report

    init_backend(rank, world, port, timeout_s=60)
    short = dist.new_group(timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(3), group=short)
    if rank == 1:
        time.sleep(6)   # late, not lost: its heartbeat goes on
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3), group=short)
        report(outdir, rank, type="none", msg="", elapsed=time.monotonic() - t0)
    except Exception as e:   # noqa: BLE001 (reported for the test to judge)
        report(outdir, rank, type=type(e).__name__, msg=str(e), elapsed=time.monotonic() - t0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(outdir, f"rank{r}.json"))
                                                  for r in range(world)):
        time.sleep(0.05)
