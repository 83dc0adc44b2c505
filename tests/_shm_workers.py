"""Bodies of the shared-memory channel tests: spawned processes that meet in one segment, no
torch.distributed (a module of its own so spawned children can import it)."""
import os
import time

import torch

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def open_channel(name, rank, world, slot, nonce=1234, labels=()):
    """Rank 0 creates the segment; the others retry until it exists (bounded)."""
    from ncclavg import _C

    deadline = time.monotonic() + 30
    while True:
        try:
            return _C.ShmChannel(name, rank, world, slot, nonce, list(labels))
        except RuntimeError:
            if rank == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def inputs(world, numel, dtype, seed):
    """Every rank's input, the same on every process; values of mixed sign and magnitude."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** (r - 1)).to(dtype) for r in range(world)]


def rank_order_sum(parts):
    """The channel's arithmetic, written with torch: rank order, accumulated in fp32 (fp64 for float64),
    rounded once to the storage type (round to nearest even, as the core's conversions)."""
    acc_type = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_type).clone()
    for p in parts[1:]:
        acc += p.to(acc_type)
    return acc.to(parts[0].dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def collectives(rank, world, name, slot, sizes, q):
    """Every collective, every dtype, sizes around the slot and the split threshold: bit for bit against
    rank_order_sum / plain copies."""
    ch = open_channel(name, rank, world, slot)
    checked = 0
    for seed, dtype in enumerate(CODES):
        code = CODES[dtype]
        for numel in sizes:
            xs = inputs(world, numel, dtype, seed * 1000 + numel)
            mine = xs[rank].clone()
            ch.all_reduce_sum(mine.data_ptr(), numel, code, 30.0)
            assert same_bits(mine, rank_order_sum(xs)), ("all_reduce_sum", dtype, numel)

            full = inputs(world, numel * world, dtype, seed * 1000 + numel + 1)
            out = torch.full((numel,), 7.0, dtype=dtype)
            ch.reduce_scatter_sum(full[rank].data_ptr(), out.data_ptr(), numel, code, 30.0)
            want = rank_order_sum([f[rank * numel:(rank + 1) * numel] for f in full])
            assert same_bits(out, want), ("reduce_scatter_sum", dtype, numel)

            gathered = torch.empty(numel * world, dtype=dtype)
            ch.all_gather(xs[rank].data_ptr(), gathered.data_ptr(), numel, code, 30.0)
            assert same_bits(gathered, torch.cat(xs)), ("all_gather", dtype, numel)

            root = world - 1
            data = xs[rank].clone()
            ch.broadcast(data.data_ptr(), numel, code, root, 30.0)
            assert same_bits(data, xs[root]), ("broadcast", dtype, numel)
            checked += 4
    q.put((rank, "ok", checked, ch.collectives))


def mismatch(rank, world, name, slot, q):
    ch = open_channel(name, rank, world, slot)
    x = torch.zeros(10)
    out = torch.zeros(10 * world)
    if rank == 0:
        attempt(q, rank, lambda: ch.all_reduce_sum(x.data_ptr(), 10, 0, 30.0))
    else:
        attempt(q, rank, lambda: ch.all_gather(x.data_ptr(), out.data_ptr(), 10, 0, 30.0))


def attempt(q, rank, call):
    """Runs call(); queues (rank, "no error" or "<ExceptionType>: <message>", seconds it took)."""
    t0 = time.monotonic()
    try:
        call()
        q.put((rank, "no error", time.monotonic() - t0))
    except Exception as e:
        q.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))


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
