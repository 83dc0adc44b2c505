"""Bodies of the multi-process gloo tests (a module of its own so spawned children can import it)."""
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_util import init_rank

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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


def ours_grads(comm, model, rank, steps, **kw):
    from ncclavg import GradientAverager

    m = copy.deepcopy(model)
    avg = GradientAverager(comm, [m], bucket_cap_mb=0.002, first_bucket_mb=0.001, **kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = rank_batch(rank, step)
        nn.functional.cross_entropy(m(x), y).backward()
        avg.average()
        out.append([p.grad.clone() for p in m.parameters()])
        opt.step()
    avg.close()
    return out, avg


def collectives_and_ddp(rank, world, port):
    init_rank(rank, world, port)
    import ncclavg
    from ncclavg import Communicator, LayoutMismatchError

    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    assert (comm.backend, comm.size, comm.local_size, comm.rank, comm.world_size) == ("gloo", world, 1, rank, world)

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
    assert ((mine.double() - truth).abs() / scale).max() < 1e-6
    # defer_scale leaves the SUM and reports the divisor
    mine = xs[rank].clone()
    work = comm.all_reduce_avg_async([mine], defer_scale=True)
    work.wait()
    assert work.divisor == world and torch.allclose(mine.double(), truth * world, rtol=1e-6, atol=1e-6)
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
    comm.reduce_scatter_avg([full[rank].clone()], [out])
    mean = sum(full) / world
    assert torch.equal(out, mean[rank * shard:(rank + 1) * shard])
    gathered = torch.empty(shard * world)
    comm.all_gather([out], [gathered])
    assert torch.equal(gathered, mean)
    assert comm.allgather_object({"rank": rank}) == [{"rank": r} for r in range(world)]
    # bad input: one tensor per local tower
    try:
        comm.all_reduce_avg([torch.ones(3), torch.ones(3)])
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "local_size 1" in str(e)

    # GradientAverager == DDP(gloo), overlap on and off
    torch.manual_seed(0)
    model = MLP()
    ref = ddp_grads(model, rank, steps=3)
    for overlap in (True, False):
        got, avg = ours_grads(comm, model, rank, steps=3, overlap=overlap)
        assert len(avg.plan.buckets) > 1
        for step, (gs, rs) in enumerate(zip(got, ref)):
            for g, r in zip(gs, rs):
                assert torch.allclose(g, r, rtol=1e-6, atol=1e-7), (overlap, step, (g - r).abs().max())
    # bfloat16 communication: close to DDP's fp32 grads at bf16 precision
    got, _ = ours_grads(comm, model, rank, steps=1, grad_dtype="bfloat16")
    for g, r in zip(got[0], ref[0]):
        assert g.dtype == torch.float32
        assert torch.allclose(g, r, rtol=2e-2, atol=2e-3 * r.abs().max().item()), (g - r).abs().max()

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
