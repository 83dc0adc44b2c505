"""Bodies of the multi-process gloo tests (a module of its own so spawned children can import it)."""
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_util import between_hosts, init_rank

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gamma(k, u=2.0 ** -24):
    """gamma_k = k*u / (1 - k*u): the relative error bound of k roundings of unit roundoff u (float32: 2^-24,
    bfloat16: 2^-8). Any order of summing n terms is within gamma_{n-1} * sum|x_i| (Higham, ch. 3)."""
    return k * u / (1 - k * u)


def rank_inputs(world, numel, dtype, seed):
    """Every rank's input, computable on every rank: exact values (small integers times 1/4)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 100 + r)
        out.append((torch.randint(-64, 64, (numel,), generator=g) * 0.25).to(dtype))
    return out


class MLP(nn.Module):
    def __init__(self, hidden=24):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Linear(hidden, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.net(x)


def rank_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)


def ddp_grads(model, rank, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = rank_batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        out.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
    return out


def local_grads(model, rank, step):
    """The gradient `rank` computes at `step` from `model`'s params (any rank can: the params are replicated)."""
    m = copy.deepcopy(model)
    x, y = rank_batch(rank, step)
    nn.functional.cross_entropy(m(x), y).backward()
    return [p.grad for p in m.parameters()]


def ours_grads(comm, model, rank, steps, **kw):
    """The averaged grads of every step, and per step and parameter (float64 mean of every rank's local gradient
    at the step's params, mean of their magnitudes): what the average must be, and its scale."""
    from ncclavg import GradientAverager

    m = copy.deepcopy(model)
    avg = GradientAverager(comm, [m], bucket_cap_mb=0.002, first_bucket_mb=0.001, **kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    out, means = [], []
    for step in range(steps):
        local = [torch.stack(gs).double() for gs in zip(*(local_grads(m, r, step) for r in range(comm.world_size)))]
        means.append([(gs.mean(0), gs.abs().mean(0)) for gs in local])
        opt.zero_grad()
        x, y = rank_batch(rank, step)
        nn.functional.cross_entropy(m(x), y).backward()
        avg.average()
        out.append([p.grad.clone() for p in m.parameters()])
        opt.step()
    avg.close()
    return out, means, avg


def expected_transport(layout, world):
    """Note [When the shared-memory channel is used]: layout[r] = the host of rank r (None: one host)."""
    hosts = set(layout) if layout else {0}
    if os.environ.get("NCCLAVG_SHM") == "0" or len(hosts) == 1 == world:
        return "gloo"
    if len(hosts) == 1:
        return "shm"
    return between_hosts(alone=len(hosts) == world)


def pretend_hosts(rank, layout):
    """Every process of this test runs on one machine: say which "host" rank r is on instead (the
    identity the communicator compares), so that several hosts' code paths run here."""
    if layout:
        import ncclavg.comm.gloo as gloo_backend

        gloo_backend.host_identity = lambda: f"test-host-{layout[rank]}"


def spy_between_hosts(comm):
    """Between hosts (shm+gloo): records what the hosts' leaders send on their lane-0 group: ("send",
    bytes) of each message of the records that compare the calls and carry a small call's data, and
    ("all_to_all_single", output splits, input splits) or the name of any other data operation there; None
    on other transports or on a process that leads no host."""
    if comm.transport != "shm+gloo" or comm._runner.transport._leaders is None:
        return None
    calls, lane = [], comm._runner.transport._leaders
    real = lane.group

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name == "send":
                def sent(tensors, dst, tag):
                    calls.append(("send", tensors[0].numel()))
                    return fn(tensors, dst, tag)
                return sent
            if name == "alltoall_base":
                def record(out, inp, out_splits, in_splits, opts):
                    calls.append(("all_to_all_single", list(out_splits), list(in_splits)))
                    return fn(out, inp, out_splits, in_splits, opts)
                return record
            if name in ("allreduce", "broadcast", "_allgather_base"):
                def other(*a, **kw):
                    calls.append((name,))
                    return fn(*a, **kw)
                return other
            return fn

    lane.group = Spy()
    return calls


def collectives_and_ddp(rank, world, port, layout=None):
    init_rank(rank, world, port)
    pretend_hosts(rank, layout)
    import ncclavg
    from ncclavg import Communicator, LayoutMismatchError

    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    assert (comm.backend, comm.size, comm.local_size, comm.rank, comm.world_size) == ("gloo", world, 1, rank, world)
    assert comm.transport == expected_transport(layout, world), comm.transport

    # all_reduce_avg: exact inputs -> bit-for-bit mean, every dtype, sizes that are not vector multiples
    for seed, dtype in enumerate(DTYPES):
        for numel in (0, 1, 17, 4097):
            xs = rank_inputs(world, numel, dtype, seed)
            mine = xs[rank].clone()
            comm.all_reduce_avg([mine])
            expect = (sum(x.double() for x in xs) / world).to(dtype)
            assert torch.equal(mine, expect), (dtype, numel)
    # random fp32 vs the float64 mean
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mine = xs[rank].clone()
    work = comm.all_reduce_avg_async([mine])
    work.wait()
    assert work.done()
    truth = torch.stack([x.double() for x in xs]).mean(0)
    scale = torch.stack([x.double().abs() for x in xs]).mean(0)
    # gloo's float32 SUM (world - 1 additions, in its own order: <= gamma_{world-1} * sum|x|), then one float32
    # division (u * |mean|): together <= gamma_world * mean|x|. A wrong divisor is off by ~|mean|.
    assert bool(((mine.double() - truth).abs() <= gamma(world) * scale).all())
    # defer_scale leaves the SUM (<= gamma_{world-1} * sum|x|) and reports the divisor
    mine = xs[rank].clone()
    work = comm.all_reduce_avg_async([mine], defer_scale=True)
    work.wait()
    assert work.divisor == world
    assert bool(((mine.double() - truth * world).abs() <= gamma(world - 1) * scale * world).all())
    # predivide: divide first, then SUM (same result for exact inputs)
    pre = Communicator.from_torch_distributed(device="cpu", timeout=60, predivide=True)
    xs = rank_inputs(world, 33, torch.float16, 7)
    mine = xs[rank].clone()
    pre.all_reduce_avg([mine])
    assert torch.equal(mine, (sum(x.double() for x in xs) / world).to(torch.float16))
    # reduce_scatter_avg / all_gather
    shard = 5
    full = rank_inputs(world, shard * world, torch.float32, 9)
    out = torch.empty(shard)
    between = spy_between_hosts(comm)
    comm.reduce_scatter_avg([full[rank].clone()], [out])
    mean = sum(full) / world
    assert torch.equal(out, mean[rank * shard:(rank + 1) * shard])
    gathered = torch.empty(shard * world)
    comm.all_gather([out], [gathered])
    assert torch.equal(gathered, mean)
    if between is not None and layout[rank] not in layout[:rank]:   # a host's leader: what crossed hosts
        hosts = [[r for r in range(world) if layout[r] == h] for h in sorted(set(layout), key=layout.index)]
        most = max(len(h) for h in hosts)
        # small: each call is its record alone, one message to each other host's leader (a 32-byte header and
        # the data): a reduce-scatter sends that host's ranks' slices of this host's sum, not the vector; an
        # all-gather this host's inputs; both padded to the largest host's count of slices
        one = [("send", 32 + 4 * most * shard)] * (len(hosts) - 1)
        assert between == one + one, between
    assert comm.allgather_object({"rank": rank}) == [{"rank": r} for r in range(world)]
    # bad input: one tensor per local tower
    try:
        comm.all_reduce_avg([torch.ones(3), torch.ones(3)])
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "local_size 1" in str(e)

    # GradientAverager == DDP(gloo), overlap on and off. Every step, the averaged grads are the float32 mean of
    # the ranks' local grads at the step's params: within gamma_world * mean|g_r| of the float64 mean (as
    # above). DDP (which may divide before its SUM: the same bound) starts from the same params, so at step 0
    # the two are within 2 such bounds; later steps' params differ by float32 rounding, and so do the grads.
    torch.manual_seed(0)
    model = MLP()
    ref = ddp_grads(model, rank, steps=3)
    for overlap in (True, False):
        got, means, avg = ours_grads(comm, model, rank, steps=3, overlap=overlap)
        assert len(avg.plan.buckets) > 1
        for step, (gs, ms) in enumerate(zip(got, means)):
            for g, (mean, scale) in zip(gs, ms):
                assert bool(((g.double() - mean).abs() <= gamma(world) * scale).all()), (overlap, step)
        for g, r, (_, scale) in zip(got[0], ref[0], means[0]):
            assert bool(((g.double() - r.double()).abs() <= 2 * gamma(world) * scale).all()), overlap
    # bfloat16 communication: each rank's grad rounded to bfloat16 (u = 2^-8: <= 2^-8 * mean|g_r| over the
    # ranks), world - 1 bfloat16 additions (gamma_{world-1} * sum|g_r|): together gamma_world (bf16) *
    # mean|g_r|; then one float32 division, u * |mean| (2^-23 * mean|g_r| covers it with the sum's error).
    got, means, _ = ours_grads(comm, model, rank, steps=1, grad_dtype="bfloat16")
    for g, (mean, scale) in zip(got[0], means[0]):
        assert g.dtype == torch.float32
        assert bool(((g.double() - mean).abs() <= (gamma(world, 2.0 ** -8) + 2.0 ** -23) * scale).all())

    # a layout that differs on one rank: LayoutMismatchError on every rank, naming the parameter
    other = MLP(hidden=24 if rank != world - 1 else 25)
    try:
        ncclavg.GradientAverager(comm, [other])
        raise AssertionError("expected LayoutMismatchError")
    except LayoutMismatchError as e:
        assert f"rank {world - 1}" in str(e) and "parameter 0 ('net.0.weight')" in str(e), str(e)
    # a local argument error on rank 0 also surfaces on the other ranks instead of hanging them
    m = MLP()
    towers = [[m.net[0].weight, m.net[0].weight]] if rank == 0 else [list(m.parameters())]
    try:
        ncclavg.GradientAverager(comm, towers)
        raise AssertionError("expected an error")
    except LayoutMismatchError as e:
        assert rank != 0 and "rank 0 could not build its bucket plan" in str(e), str(e)
    except ValueError as e:
        assert rank == 0 and "same tensor" in str(e), str(e)
    dist.barrier()   # and no destroy_process_group(): see Note [Gloo teardown] in ncclavg/comm/dist.py


def timeout_job(rank, world, port):
    init_rank(rank, world, port)
    from ncclavg import CommTimeoutError, Communicator

    comm = Communicator.from_torch_distributed(device="cpu", timeout=1.0)
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm.all_reduce_avg([torch.ones(10)])
            raise AssertionError("expected CommTimeoutError")
        except CommTimeoutError as e:
            assert "did not complete within 1 s" in str(e), str(e)
        assert time.monotonic() - t0 < 10
    else:
        time.sleep(3)  # never joins the collective (rank 0 gives up after 1 s)
    os._exit(0)  # the group is unusable after a timeout: skip its teardown


def per_call_timeout_job(rank, world, port, op):
    """A call's own timeout bounds it on every transport, even when it is far below the communicator's:
    rank 1 comes 6 s late, rank 0's call (timeout=1) must fail after about 1 s, not 6 s (nor 60)."""
    init_rank(rank, world, port)
    from ncclavg import CommTimeoutError, Communicator

    comm = Communicator.from_torch_distributed(device="cpu", timeout=60.0)
    comm.all_reduce_avg([torch.ones(4)])   # both ranks are here
    calls = {
        "all_reduce_avg": lambda t: comm.all_reduce_avg([torch.ones(10)], timeout=t),
        "reduce_scatter_avg": lambda t: comm.reduce_scatter_avg([torch.ones(2 * world)], [torch.empty(2)], timeout=t),
        "all_gather": lambda t: comm.all_gather([torch.ones(2)], [torch.empty(2 * world)], timeout=t),
        "broadcast_tensors": lambda t: comm.broadcast_tensors([torch.ones(3)], timeout=t),
    }
    if rank == 0:
        t0 = time.monotonic()
        try:
            calls[op](1.0)
            raise AssertionError("expected CommTimeoutError")
        except CommTimeoutError as e:
            assert "did not complete within 1 s" in str(e), str(e)
            # the channel names the late rank; gloo cannot (its heartbeats still beat: it is only late)
            assert "rank 1 stopped responding" in str(e) or os.environ["NCCLAVG_SHM"] == "0", str(e)
        elapsed = time.monotonic() - t0
        assert elapsed < 4.0, f"{op} with timeout=1 took {elapsed:.1f} s"   # the peer came after 6 s
    else:
        time.sleep(6)
    os._exit(0)  # the group is unusable after a timeout: skip its teardown


def shm_setup_fails_job(rank, world, port, required):
    """The shared-memory channel cannot be set up (a real limit: RLIMIT_FSIZE below the segment's size, so
    rank 0 cannot size its memory file): with NCCLAVG_SHM=auto every rank warns and stays on
    torch.distributed, results unchanged; with =1 every rank raises CommError naming the cause."""
    import resource
    import signal
    import warnings

    init_rank(rank, world, port)
    from ncclavg import CommError, Communicator

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the failing ftruncate returns EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    os.environ["NCCLAVG_SHM_SLOT_KB"] = "1024"   # a segment of 2 x world slots of 1 MiB: above the limit
    if required:
        os.environ["NCCLAVG_SHM"] = "1"
        try:
            Communicator.from_torch_distributed(device="cpu", timeout=30)
            raise AssertionError("expected CommError")
        except CommError as e:
            assert "could not be set up" in str(e) and "ftruncate" in str(e), str(e)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = Communicator.from_torch_distributed(device="cpu", timeout=30)
    assert comm.transport == "gloo"
    assert any("stays on torch.distributed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    x = torch.full((5,), float(rank))
    comm.all_reduce_avg([x])
    assert torch.equal(x, torch.full((5,), (world - 1) / 2))


def fast_path_job(rank, world, port):
    """The small-message fast path (Note [Small-message fast path]) against what can change under its
    cache: a tensor resized or set_ to other memory, freed and replaced, an inference tensor, a call made
    while an asynchronous one is queued; every result exact (small integers), bad input as the general
    path says it."""
    init_rank(rank, world, port)
    from ncclavg import Communicator

    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    assert comm.transport == "shm" and comm._fast is not None
    mean = (world - 1) / 2

    def check(t, n):
        assert t.numel() == n and torch.equal(t, torch.full((n,), mean, dtype=t.dtype)), (t, n)

    x = torch.full((4,), float(rank))
    comm.all_reduce_avg([x])
    check(x, 4)
    for _ in range(3):   # the cached call, again and again
        x.fill_(rank)
        comm.all_reduce_avg([x])
        check(x, 4)
    x.resize_(9000)   # other memory, other size (the version moves)
    x.fill_(rank)
    comm.all_reduce_avg([x])
    check(x, 9000)
    x.set_(torch.full((3,), float(rank)))
    comm.all_reduce_avg([x])
    check(x, 3)
    for dtype in (torch.bfloat16, torch.float16):
        for _ in range(2):
            y = torch.full((5,), float(rank), dtype=dtype)   # a new tensor, often at a freed one's id
            comm.all_reduce_avg([y])
            check(y, 5)
            del y
    with torch.inference_mode():
        z = torch.full((6,), float(rank))
        comm.all_reduce_avg([z])
        check(z, 6)
    a, b = torch.full((70000,), float(rank)), torch.full((2,), float(rank))
    work = comm.all_reduce_avg_async([a])   # queued on the worker: the next call must run after it
    comm.all_reduce_avg([b])
    work.wait()
    check(a, 70000)
    check(b, 2)
    try:
        comm.all_reduce_avg([torch.ones(3, dtype=torch.float64)])
        raise AssertionError("expected TypeError")
    except TypeError as e:
        assert "tensors" in str(e), str(e)
    try:
        comm.all_reduce_avg([torch.ones(6)[::2]])
        raise AssertionError("expected an error for a non-contiguous tensor")
    except (TypeError, ValueError) as e:
        assert "tensors" in str(e) and "contiguous" in str(e), str(e)
    comm.all_reduce_avg([x], timeout=5.0)   # still in step after the refused calls
    check(x, 3)
    # a fast-path call that has to wait gives the GIL up: another thread of this process keeps running
    import threading

    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    if rank == 0:
        counter = threading.Thread(target=count)
        counter.start()
        x.fill_(rank)
        before = ticks[0]
        comm.all_reduce_avg([x])   # rank 1 is 1.5 s late
        during = ticks[0] - before
        stop.set()
        counter.join()
        # about 10 M counts a second when it runs; held out by the GIL, none
        assert during > 100000, f"the counting thread ran {during} times while rank 0 waited 1.5 s"
    else:
        time.sleep(1.5)
        x.fill_(rank)
        comm.all_reduce_avg([x])
    check(x, 3)


def api_fast_calls_job(rank, world, port, outdir):
    """The public API's synchronous broadcast_tensors, all_gather and reduce_scatter_avg on one host's
    channel (Note [The public API's other fast calls] in ncclavg/comm/gloo.py): taken at once when the
    runner is idle (no job), through the general path when it is not (an asynchronous average queued) or
    when the payload is an odd number of bytes; the two ways meet in the same round (one rank fast, the
    other general) with exact results; a different call through them fails every rank naming both."""
    import json

    init_rank(rank, world, port)
    from ncclavg import Communicator
    from ncclavg.errors import CommError

    comm = Communicator.from_torch_distributed(device="cpu", timeout=30)
    assert comm.transport == "shm", comm.transport
    general = []   # the calls that went down the general path (a job of the runner)
    run = comm._run
    comm._run = lambda what, *a, **kw: (general.append(str(what).split(" of ")[0]), run(what, *a, **kw))[1]

    def calls(busy):
        """Every collective in three dtypes and sizes; `busy`: this rank has an average queued first."""
        for dtype, n in ((torch.float32, 5), (torch.float16, 3), (torch.bfloat16, 4096), (torch.uint8, 7),
                         (torch.float64, 2)):
            big = torch.full((1 << 17,), float(rank))   # 512 KiB: an asynchronous call of it is queued
            work = comm.all_reduce_avg_async([big]) if busy else None
            if not busy:
                if rank != 0:
                    time.sleep(0.2)   # rank 0's average is still queued when it calls the broadcast
                comm.all_reduce_avg([big])   # the same round as the other rank's queued average
            b = torch.full((n,), rank + 1).to(dtype)
            comm.broadcast_tensors([b])
            assert torch.equal(b, torch.full((n,), 1).to(dtype)), (dtype, n, b)
            if work is not None:
                work.wait()
            assert torch.equal(big, torch.full((1 << 17,), (world - 1) / 2)), big
            if dtype in (torch.uint8, torch.float64):
                continue   # the public API's all_gather / reduce_scatter_avg take float32 / 16-bit floats
            mine = torch.arange(n, dtype=torch.float32).mul_(rank + 1).to(dtype)
            out = torch.empty(n * world, dtype=dtype)
            comm.all_gather([mine], [out])
            want = torch.cat([torch.arange(n, dtype=torch.float32).mul_(r + 1).to(dtype) for r in range(world)])
            assert torch.equal(out, want), (dtype, out, want)
            # small integers (at most 7 x world): every sum and its halving exact in every type here
            full = (torch.arange(n * world) % 8).mul_(rank + 1).to(dtype)
            shard = torch.empty(n, dtype=dtype)
            comm.reduce_scatter_avg([full], [shard])
            total = sum((torch.arange(n * world) % 8).double() * (r + 1) for r in range(world)) / world
            assert torch.equal(shard, total[rank * n:(rank + 1) * n].to(dtype)), (dtype, shard)

    calls(busy=False)
    idle = list(general)
    general.clear()
    calls(busy=rank == 0)   # rank 0's calls queue behind its average, rank 1's go straight in
    busy = list(general)
    # a different broadcast on each rank, both straight into the channel: both fail naming both calls
    try:
        comm.broadcast_tensors([torch.ones(4 + rank)])
        err = None
    except CommError as e:
        err = {"type": type(e).__name__, "msg": str(e)}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"idle": idle, "busy": busy, "error": err}, f)
    from ncclavg.comm import end_process

    end_process(0)   # the communicator failed: no teardown
