"""Bodies of the shared-memory channel tests: spawned processes that meet in one segment, no
torch.distributed (a module of its own so spawned children can import it)."""
import os
import time

import torch

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def open_channel(name, rank, world, slot, nonce=1234, labels=()):
    """Rank 0 creates the channel; the others retry until its door is open (bounded)."""
    from ncclavg import _C

    deadline = time.monotonic() + 30
    while True:
        try:
            ch = _C.ShmChannel(name, rank, world, slot, nonce, list(labels))
            return ch
        except RuntimeError as e:
            if rank == 0 or "no door is open" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def inputs(world, numel, dtype, seed):
    """Every rank's input, the same on every process; values of mixed sign and magnitude."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** (r - 1)).to(dtype) for r in range(world)]


def rank_order_sum(parts, div=1.0):
    """The channel's arithmetic, written with torch: rank order, accumulated in fp32 (fp64 for float64),
    rounded once to the storage type (round to nearest even, as the core's conversions), then divided
    and rounded again (Note [Pack scale modes]: a division, correctly rounded)."""
    acc_type = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_type).clone()
    for p in parts[1:]:
        acc += p.to(acc_type)
    out = acc.to(parts[0].dtype)
    if div != 1.0:
        out = (out.to(acc_type) / torch.tensor(div, dtype=acc_type)).to(parts[0].dtype)
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def collectives(rank, world, name, slot, sizes, q):
    """Every collective, every dtype, sizes around the slot and the split threshold (count 0 included),
    plain and averaged: bit for bit against rank_order_sum / plain copies."""
    ch = open_channel(name, rank, world, slot)
    checked = 0
    for seed, dtype in enumerate(CODES):
        code = CODES[dtype]
        for numel in sizes:
            xs = inputs(world, numel, dtype, seed * 1000 + numel)
            mine = xs[rank].clone()
            ch.all_reduce_sum(mine.data_ptr(), numel, code, 30.0)
            assert same_bits(mine, rank_order_sum(xs)), ("all_reduce_sum", dtype, numel)
            mine = xs[rank].clone()
            ch.all_reduce_sum(mine.data_ptr(), numel, code, 30.0, 1.0, float(world))
            assert same_bits(mine, rank_order_sum(xs, world)), ("all_reduce_sum / world", dtype, numel)

            full = inputs(world, numel * world, dtype, seed * 1000 + numel + 1)
            out = torch.full((numel,), 7.0, dtype=dtype)
            ch.reduce_scatter_sum(full[rank].data_ptr(), out.data_ptr(), numel, code, 30.0)
            want = [f[rank * numel:(rank + 1) * numel] for f in full]
            assert same_bits(out, rank_order_sum(want)), ("reduce_scatter_sum", dtype, numel)
            ch.reduce_scatter_sum(full[rank].data_ptr(), out.data_ptr(), numel, code, 30.0, 1.0, float(world))
            assert same_bits(out, rank_order_sum(want, world)), ("reduce_scatter_sum / world", dtype, numel)

            gathered = torch.empty(numel * world, dtype=dtype)
            ch.all_gather(xs[rank].data_ptr(), gathered.data_ptr(), numel, code, 30.0)
            assert same_bits(gathered, torch.cat(xs)), ("all_gather", dtype, numel)
            inplace = torch.cat(xs) if numel else torch.empty(0, dtype=dtype)   # in = out's own block
            own = inplace[rank * numel:(rank + 1) * numel]
            ch.all_gather(own.data_ptr(), inplace.data_ptr(), numel, code, 30.0)
            assert same_bits(inplace, torch.cat(xs)), ("all_gather in place", dtype, numel)

            root = world - 1
            data = xs[rank].clone()
            ch.broadcast(data.data_ptr(), numel, code, root, 30.0)
            assert same_bits(data, xs[root]), ("broadcast", dtype, numel)
            ch.barrier(30.0)
            checked += 8
    # limits far beyond any wait: no deadline, and no overflow of the nanosecond clock (expired at once)
    x = torch.ones(3)
    for limit in (1e10, 1e300, float("inf")):
        ch.all_reduce_sum(x.data_ptr(), 3, 0, limit)
    assert torch.equal(x, torch.full((3,), float(world) ** 3))
    q.put((rank, "ok", checked, ch.collectives))


def attempt(q, rank, call):
    """Runs call(); queues (rank, "no error" or "<ExceptionType>: <message>", seconds it took)."""
    t0 = time.monotonic()
    try:
        call()
        q.put((rank, "no error", time.monotonic() - t0))
    except Exception as e:
        q.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


def out_of_step(rank, world, name, slot, case, q):
    """The ranks make different calls: every rank must fail, naming both calls, within the timeout."""
    ch = open_channel(name, rank, world, slot)
    x = torch.arange(10, dtype=torch.float32) + rank
    out = torch.zeros(10 * world)
    ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0)   # one good round first
    if case == "op":
        call = (lambda: ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0)) if rank == 0 else \
               (lambda: ch.all_gather(x.data_ptr(), out.data_ptr(), 10, 0, 30.0))
    elif case == "root":   # rank 2 names another root than ranks 0 and 1
        root = 1 if rank == 2 else 0
        call = lambda: ch.broadcast(x.data_ptr(), 10, 0, root, 30.0)   # noqa: E731
    elif case == "zero":   # rank 0 reduces nothing, the others 10 elements
        n = 0 if rank == 0 else 10
        call = lambda: ch.all_reduce_sum(x.data_ptr(), n, 0, 30.0)   # noqa: E731
    elif case == "scale":   # rank 0 sums, the others average
        div = 1.0 if rank == 0 else float(world)
        call = lambda: ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0, 1.0, div)   # noqa: E731
    elif case.startswith("tag"):   # the same channel call, made for different user calls
        from ncclavg.transport import calls

        R = torch.distributed.ReduceOp
        if case == "tag":
            c = calls.make("all_reduce", torch.float32, R.MAX, count=10) if rank == 0 else \
                calls.make("all_gather", torch.float32, count=10)
        elif case == "tag_root":
            c = calls.make("reduce", torch.float32, R.SUM, root=rank, count=10)
        elif case == "tag_count":   # a list of 10 elements on the wire, 10 or 11 in the user's call
            c = calls.make("all_reduce_coalesced", torch.float32, R.SUM, count=10 + rank)
        else:
            c = calls.make("barrier") if rank == 0 else calls.make("all_reduce", torch.float32, R.SUM, count=1)
        call = lambda: ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0, 1.0, 1.0, c.tag, c.count)   # noqa: E731
    attempt(q, rank, call)
    # later rounds: all of them again (a rank that failed must not pair with its peers' next call)
    attempt(q, rank, lambda: ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0))


def zero_count_then_sum(rank, world, name, slot, q):
    """Every rank makes a count-0 call, then a real one: the real ones pair with each other."""
    ch = open_channel(name, rank, world, slot)
    x = torch.full((4,), float(rank + 1) * 10)
    empty = torch.empty(0)
    if rank == 0:
        time.sleep(0.3)   # rank 1 runs ahead: its zero-count round must wait for rank 0's
    ch.all_reduce_sum(empty.data_ptr(), 0, 0, 30.0)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    q.put((rank, x.tolist(), 0.0))


def peer_exits(rank, world, name, slot, labels, q):
    ch = open_channel(name, rank, world, slot, labels=labels)
    x = torch.ones(4)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)   # both alive: works
    if rank == 1:
        os._exit(3)
    time.sleep(0.2)
    attempt(q, rank, lambda: ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0))
    attempt(q, rank, lambda: ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0))   # after the failure


def peer_freezes(rank, world, name, slot, q):
    """Rank 1 comes 4 s late: rank 0's 1 s deadline passes, and rank 1 then finds the channel aborted."""
    ch = open_channel(name, rank, world, slot)
    x = torch.ones(4)
    if rank == 1:
        time.sleep(4)
    attempt(q, rank, lambda: ch.all_reduce_sum(x.data_ptr(), 4, 0, 1.0))


def aborts(rank, world, name, slot, q):
    ch = open_channel(name, rank, world, slot)
    x = torch.ones(4)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    if rank == 0:
        ch.abort("the user gave up")
    else:
        time.sleep(0.2)
    attempt(q, rank, lambda: ch.broadcast(x.data_ptr(), 4, 0, 0, 30.0))


def waits_idle(rank, world, name, slot, late_s, q):
    """Rank 1 waits for rank 0, which comes late_s late: rank 1's CPU time and voluntary context switches
    over that wait (a spinning waiter burns the whole wait; a sleeping one about nothing)."""
    import resource

    ch = open_channel(name, rank, world, slot)
    x = torch.ones(4)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    if rank == 0:
        time.sleep(late_s)
        ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
        q.put((rank, 0.0, 0, 0.0))
        return
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    q.put((rank, cpu, after.ru_nvcsw - before.ru_nvcsw, time.monotonic() - wall))


def peers_ready(rank, world, name, slot, q, gate):
    """The announcement of Note [An asynchronous call whose peers wait], on the channel alone. Round 1:
    rank 0 looks while rank 1 has not come (False, after its window), then rank 1 finds rank 0's
    announcement (True) although rank 0 has posted nothing, and runs the call; rank 0 then runs the call
    it announced, and the two meet. Round 2: rank 1 posts first (a plain call); rank 0 finds the post
    (True). After an abort a look says False at once."""
    ch = open_channel(name, rank, world, slot)
    x = torch.full((3,), float(rank + 1))
    got = []
    if rank == 0:
        start = time.monotonic()
        got.append(ch.peers_ready(0.02))           # rank 1 waits on the gate: nobody there
        got.append(time.monotonic() - start)
        gate.set()
        ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)   # the announced call, as a queued worker would run it
        time.sleep(0.2)                                # rank 1 posts round 2 meanwhile
        got.append(ch.peers_ready(0.0))
        ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
        ch.abort("done")
        got.append(ch.peers_ready(1.0))
    else:
        gate.wait(30)
        got.append(ch.peers_ready(0.0))            # rank 0 announced round 1 and went on
        ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
        ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
    q.put((rank, got, x.tolist()))
