"""Bodies of tests/transport/test_async_inline.py: asynchronous collectives that run on the caller's thread
when their peers are already in them (Note [An asynchronous call whose peers wait] in
csrc/transport/shm_channel.cpp), through the torch backend and through the public API."""
import datetime
import os
import random
import time

import torch
import torch.distributed as dist

from _process_group_workers import init_backend

R = dist.ReduceOp
# The look for the peers lasts 50 us; a yield inside it can stretch it to a scheduler slice (milliseconds
# on a loaded machine). An asynchronous call that waited for a peer held back 0.8 s would take >= 0.8 s:
# 0.4 s tells the two apart with two orders of magnitude to spare below and 2x above.
LOOK_BOUND_S = 0.4
HOLD_S = 0.8


class _Faces:
    """all_reduce of one float32 tensor through the face under test: `async_(t)` returns a Work,
    `sync(t)` waits; both average over the ranks."""

    def __init__(self, face):
        self.face = face
        if face == "api":
            from ncclavg import Communicator

            self.comm = Communicator.from_torch_distributed(devices=["cpu"], timeout=60.0)

    def async_(self, t):
        if self.face == "api":
            return self.comm.all_reduce_avg_async([t])
        return dist.all_reduce(t, op=R.AVG, async_op=True)

    def ran_here(self, work):
        """The call ran on the caller's thread: what it handed back is a finished Work made for that (a
        queued one may also be complete by now, which tells nothing)."""
        job = getattr(work, "_job", None)   # a runner's job (transport/runner.py), or a fast path's DoneWork
        return job.ran_inline if job is not None else type(work).__name__ == "DoneWork"

    def sync(self, t):
        if self.face == "api":
            self.comm.all_reduce_avg([t])
        else:
            dist.all_reduce(t, op=R.AVG)


def _inputs(world, n, k):
    """Every rank's input of call k (quarters below 16: exact sums in float32) and their average: the
    sum of two or three such values is exact and so is its division by a power of two; for 3 ranks the
    division rounds once, as the reference's own division does (both divide the same exact float32 sum)."""
    vals = [(((torch.arange(n) * 5 + k + 3 * r) % 29) - 14).float() / 4 for r in range(world)]
    return vals, torch.stack(vals).sum(0) / world


def inline_when_peers_wait_job(rank, world, port, face):
    """Rank 0 issues its asynchronous call after the others are already waiting in theirs (synchronous):
    it runs on rank 0's thread, so its Work is complete when handed back, with the right values. A call
    over the inline limit is queued whatever the peers do."""
    init_backend(rank, world, port)
    faces = _Faces(face)
    from ncclavg.transport.runner import ASYNC_INLINE_BYTES

    for k, n in enumerate((1, 1000, ASYNC_INLINE_BYTES // 4, ASYNC_INLINE_BYTES // 4 + 1)):
        vals, want = _inputs(world, n, k)
        t = vals[rank].clone()
        dist.barrier()
        if rank == 0:
            time.sleep(0.3)   # the others post their round meanwhile
            work = faces.async_(t)
            small = n * 4 <= ASYNC_INLINE_BYTES
            assert faces.ran_here(work) == small, (n, type(work).__name__)
            work.wait()
        else:
            faces.sync(t)
        assert torch.equal(t, want), (k, n, t[:4], want[:4])


def api_inline_notes_finiteness_job(rank, world, port):
    """The public API's asynchronous average run at once (its peers wait) hands back the channel's note of
    what it wrote, as the queued job's Work does (Work.finite): True for finite means, False on every rank
    when one rank's input holds an inf or a NaN, for each float type the channel sums; the values are the
    queued path's."""
    init_backend(rank, world, port)
    faces = _Faces("api")
    for k, (dtype, bad) in enumerate([(d, b) for d in (torch.float32, torch.float16, torch.bfloat16)
                                      for b in (None, "inf", "nan")]):
        vals, want = _inputs(world, 100, k)
        t = vals[rank].clone().to(dtype)
        if bad is not None and rank == world - 1:
            t[7] = float(bad)
        dist.barrier()
        if rank == 0:
            time.sleep(0.3)   # the others post their round meanwhile
            work = faces.async_(t)
            assert faces.ran_here(work), (dtype, bad, type(work).__name__)
        else:
            work = faces.async_(t)   # queued: its job runs the same round on the worker
        work.wait()
        assert work.finite is (bad is None), (rank, dtype, bad, work.finite)
        if bad is None:
            assert torch.equal(t, want.to(dtype)), (dtype, t[:4], want[:4])


def torch_collectives_inline_job(rank, world, port):
    """The same for the torch backend's asynchronous broadcast, all_gather_into_tensor and
    reduce_scatter_tensor (SUM and AVG): complete when handed back when the peers wait, queued when over
    the limit, with exact values either way."""
    init_backend(rank, world, port)
    from ncclavg.transport.runner import ASYNC_INLINE_BYTES

    small, big = 12, ASYNC_INLINE_BYTES // 4 // world + 1   # elements per rank
    for k, (what, n) in enumerate([(w, n) for n in (small, big) for w in ("broadcast", "all_gather", "rs_sum", "rs_avg")]):
        vals = [(((torch.arange(n * world) * 3 + k + 5 * r) % 23) - 11).float() / 4 for r in range(world)]
        mine = vals[rank].clone()
        if what == "broadcast":
            out, want = mine, vals[k % world]
            call = lambda async_op: dist.broadcast(out, src=k % world, async_op=async_op)  # noqa: E731
        elif what == "all_gather":
            inp = vals[rank][:n].clone()
            out, want = torch.empty(n * world), torch.cat([v[:n] for v in vals])
            call = lambda async_op: dist.all_gather_into_tensor(out, inp, async_op=async_op)  # noqa: E731
        else:
            op = R.SUM if what == "rs_sum" else R.AVG
            total = torch.stack(vals).sum(0)[rank * n:(rank + 1) * n]
            out, want = torch.empty(n), total if op == R.SUM else total / world
            call = lambda async_op: dist.reduce_scatter_tensor(out, mine, op=op, async_op=async_op)  # noqa: E731
        dist.barrier()
        if rank == 0:
            time.sleep(0.3)
            work = call(True)
            assert (type(work).__name__ == "DoneWork") == (n == small), (what, n, type(work).__name__)
            work.wait()
        else:
            call(False)
        assert torch.equal(out, want), (what, n, out[:4], want[:4])


def late_peer_is_not_waited_for_job(rank, world, port, face, peer_async):
    """Rank 0's asynchronous call returns at once although rank 1 reaches its call only after rank 0 has
    passed a barrier of another group issued after the call: had rank 0 waited in the call for rank 1,
    neither could go on. Rank 1 then joins synchronously, or asynchronously (it finds rank 0's round
    announced and runs it inline while rank 0's worker runs its side)."""
    init_backend(rank, world, port)
    faces = _Faces(face)
    other = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    for k in range(3):
        vals, want = _inputs(world, 100, k)
        t = vals[rank].clone()
        if rank == 0:
            start = time.monotonic()
            work = faces.async_(t)
            took = time.monotonic() - start
            assert took < LOOK_BOUND_S, f"the asynchronous call waited {took:.3f} s for its peer"
            dist.barrier(group=other)
            work.wait()
        else:
            dist.barrier(group=other)
            time.sleep(HOLD_S if k == 0 else 0.01)
            if peer_async:
                faces.async_(t).wait()
            else:
                faces.sync(t)
        assert torch.equal(t, want), (k, t[:4], want[:4])
    dist.barrier()


def mixed_job(rank, world, port, face, calls):
    """`calls` collectives with every rank choosing at random, on its own, to wait a little or not and to
    call synchronously or not, of sizes on both sides of the inline limit, with queued broadcasts among
    them: ranks that run a call inline and ranks that queue it meet in the same round, in order, and
    every value is exact."""
    init_backend(rank, world, port)
    faces = _Faces(face)
    from ncclavg.transport.runner import ASYNC_INLINE_BYTES

    shared, own = random.Random(1234), random.Random(rank * 7919 + 1)
    sizes = (1, 3, 257, 4096, ASYNC_INLINE_BYTES // 4, ASYNC_INLINE_BYTES // 4 + 8)
    pending, inline = [], 0
    for k in range(calls):
        n = shared.choice(sizes)
        if own.random() < 0.3:
            time.sleep(own.random() * 2e-4)
        if shared.random() < 0.1:   # an asynchronous broadcast, inline or queued as the all_reduce
            b = torch.full((n,), float(rank))
            pending.append((dist.broadcast(b, src=k % world, async_op=True), b, torch.full((n,), float(k % world))))
            continue
        if face == "torch" and shared.random() < 0.1:   # an asynchronous all-gather, the same
            g = torch.empty(n * world)
            work = dist.all_gather_into_tensor(g, torch.full((n,), float(rank)), async_op=True)
            pending.append((work, g, torch.arange(world).float().repeat_interleave(n)))
            continue
        vals, want = _inputs(world, n, k)
        t = vals[rank].clone()
        if own.random() < 0.3:
            faces.sync(t)
            assert torch.equal(t, want), (k, n)
        else:
            work = faces.async_(t)
            inline += faces.ran_here(work)
            pending.append((work, t, want))
        if len(pending) > 6 or own.random() < 0.2:
            for work, got, expect in pending:
                work.wait()
                assert torch.equal(got, expect), (k, got[:4], expect[:4])
            pending = []
    for work, got, expect in pending:
        work.wait()
        assert torch.equal(got, expect)
    print(f"rank {rank}: {inline} asynchronous calls ran on the caller's thread", flush=True)
    dist.barrier()


def mismatch_inline_job(rank, world, port, outdir):
    """An asynchronous call that runs inline against a different call (4 against 5 elements) fails as
    a Work (its wait raises, naming both calls), not at the call; the group refuses what comes next."""
    import json

    init_backend(rank, world, port, timeout_s=30)
    dist.all_reduce(torch.ones(4))
    rep = {}
    bad = torch.ones(4 + (rank == 1))
    if rank == 0:
        time.sleep(0.3)   # rank 1 is in its call already
        work = dist.all_reduce(bad, async_op=True)
        rep["returned"] = True
        try:
            work.wait()
            rep["first"] = "none"
        except Exception as e:   # noqa: BLE001 (judged by the test)
            rep["first"] = f"{type(e).__name__}: {e}"
    else:
        try:
            dist.all_reduce(bad)
            rep["first"] = "none"
        except Exception as e:   # noqa: BLE001
            rep["first"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        rep["later"] = "none"
    except Exception as e:   # noqa: BLE001
        rep["later"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)
