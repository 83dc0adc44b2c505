"""Bodies of tests/process_group/test_backend_lifecycle.py: groups with the same members used from several threads
at once, tensors that require grad, ncclavg's Communicator over a group of the `ncclavg` backend, and
communicators built and closed again and again (nothing may stay mapped or grow)."""
import datetime
import gc
import os
import threading

import torch
import torch.distributed as dist

from _process_group_workers import init_backend
from _dist_util import init_rank

R = dist.ReduceOp


def threads_job(rank, world, port, groups=3, iters=300):
    """`groups` groups with the same members, each driven by its own thread with its own sizes, dtypes
    and ops; every result is checked exactly (Note [One channel per group])."""
    init_backend(rank, world, port, timeout_s=120)
    gs = [dist.new_group() for _ in range(groups)]
    specs = [(R.SUM, torch.float32), (R.MAX, torch.int64), (R.SUM, torch.float64), (R.MIN, torch.int32),
             (R.AVG, torch.float32)]
    wrong = [0] * groups
    errors = []

    def drive(i, g):
        op, dtype = specs[i % len(specs)]
        try:
            for k in range(iters):
                n = 1 + (k * (i + 3)) % 97 + i   # sizes that differ from thread to thread and call to call
                vals = [torch.arange(n, dtype=torch.float64) * (r + 1) + k + i for r in range(world)]
                t = vals[rank].to(dtype)
                want = {R.SUM: sum(vals), R.MAX: vals[-1], R.MIN: vals[0], R.AVG: sum(vals) / world}[op].to(dtype)
                work = dist.all_reduce(t, op=op, group=g, async_op=k % 2 == 1)
                if work is not None:
                    work.wait()
                if not torch.equal(t, want):
                    wrong[i] += 1
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(f"thread {i}: {e}")

    threads = [threading.Thread(target=drive, args=(i, g)) for i, g in enumerate(gs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert wrong == [0] * groups, wrong
    dist.barrier()


def requires_grad_job(rank, world, port):
    """Reductions into a tensor that requires grad (an nn.Parameter) work as on gloo and keep the group."""
    init_backend(rank, world, port)
    premul = dist._make_nccl_premul_sum(0.5)
    for op, want in ((R.MAX, float(world)), (R.MIN, 1.0), (R.PRODUCT, float(torch.arange(1, world + 1).prod())),
                     (R.AVG, (world + 1) / 2), (R.SUM, world * (world + 1) / 2), (premul, world * (world + 1) / 4)):
        p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
        dist.all_reduce(p, op=op)
        assert p.requires_grad and torch.equal(p.detach(), torch.full((3,), want)), (op, p)
    p = torch.nn.Parameter(torch.full((4,), float(rank)))
    dist.broadcast(p, src=world - 1)
    assert torch.equal(p.detach(), torch.full((4,), float(world - 1)))
    dist.barrier()


def communicator_on_backend_job(rank, world, port, mode):
    """Communicator.from_torch_distributed over a group of the `ncclavg` backend: its own channel, its
    collectives interleaved with the group's (sync and async), a TowerTrainer step on it."""
    import ncclavg

    init_backend(rank, world, port)
    comm = ncclavg.Communicator.from_torch_distributed(device="cpu")
    assert comm.backend == "gloo" and comm.transport == dist.group.WORLD.transport, comm.transport
    for k in range(20):
        t = torch.full((1000 + k,), float(rank + k))
        w = dist.all_reduce(torch.ones(7), async_op=True) if mode == "async" else None
        comm.all_reduce_avg([t])
        assert torch.equal(t, torch.full_like(t, (world - 1) / 2 + k)), k
        u = torch.full((5,), float(rank))
        dist.all_reduce(u)
        assert torch.equal(u, torch.full((5,), float(world * (world - 1) / 2)))
        if w is not None:
            w.wait()
    model = torch.nn.Linear(4, 2)
    trainer = ncclavg.TowerTrainer(model, devices=["cpu"], comm=comm, lr=0.1)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)), torch.randint(0, 2, (8,))
    trainer.fit([(x, y)], epochs=1)
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "the replicas differ after a step"
    comm.close()
    dist.barrier()


def _channel_mappings():
    with open("/proc/self/maps") as f:
        return sum("ncclavg-shm-channel" in line for line in f)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def create_close_job(rank, world, port, cycles, outdir):
    """Communicators built and closed `cycles` times (gloo group, one host: each builds a channel): after
    each close nothing stays mapped, and the resident memory stays flat."""
    import json

    import ncclavg

    init_rank(rank, world, port)
    baseline = _channel_mappings()
    rss = []
    mapped = []
    for k in range(cycles):
        comm = ncclavg.Communicator.from_torch_distributed(device="cpu")
        assert comm.transport == "shm", comm.transport
        t = torch.full((4096,), float(rank))
        comm.all_reduce_avg([t])         # the fast path (Note [Small-message fast path]) is built and used
        comm.all_reduce_avg([t.clone()])
        comm.close()
        del comm, t
        mapped.append(_channel_mappings() - baseline)   # without a collection: freed by reference counts
        rss.append(_rss_bytes())
    gc.collect()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"mapped": mapped, "rss": rss, "after_gc": _channel_mappings() - baseline}, f)
    dist.barrier()


def barrier_timeout_job(rank, world, port, outdir, timeout_s):
    """Only rank 0 enters a barrier of a group with a short timeout: it fails at the deadline, not before,
    with a timeout's words (" timeout ", as gloo's and NCCL's errors say it, which torch's own tests and
    launchers match), as a BackendTimeoutError."""
    import re
    import time

    from _fault_util import report

    init_backend(rank, world, port, timeout_s=60)
    g = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.barrier(group=g)
            report(outdir, rank, type="none", msg="", elapsed=time.monotonic() - t0, matches=False)
        except Exception as e:   # noqa: BLE001 (judged by the test)
            report(outdir, rank, type=type(e).__name__, msg=str(e), elapsed=time.monotonic() - t0,
                   matches=bool(re.search(" (Timed out|closed|timeout) ", str(e))))
    else:
        report(outdir, rank, type="none", msg="", elapsed=0.0, matches=False)
    # the default group goes on (wait until rank 0 is done with its failed group first)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(outdir, "rank0.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()


class _InnerNccl:
    """Stands for the inner ProcessGroupNCCL (a CPU build of torch has none): records how it was ended."""

    def __init__(self, log):
        self.log = log

    def shutdown(self):
        self.log.append("shutdown")

    def abort(self):
        self.log.append("abort")


def inner_nccl_ended_job(rank, world, port, outdir):
    """destroy_process_group shuts the inner NCCL group down; abort() aborts it (then shuts it down)."""
    import json

    init_backend(rank, world, port)
    log = []
    g = dist.new_group()
    g._nccl = _InnerNccl(log)
    dist.destroy_process_group(g)
    destroyed = list(log)
    log.clear()
    h = dist.new_group()
    h._nccl = _InnerNccl(log)
    h.abort()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"destroyed": destroyed, "aborted": list(log)}, f)
    dist.barrier()
