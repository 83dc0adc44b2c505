"""Bodies of the several-towers-per-process gloo tests (spawned children import this module)."""
import copy

import torch
import torch.nn as nn

from _dist_util import init_rank
from _comm_gloo_workers import MLP, gamma, rank_inputs


def _towers_of(rank, counts):
    """Global indices of this process's towers: process-major."""
    first = sum(counts[:rank])
    return list(range(first, first + counts[rank]))


def collectives(rank, world, port, counts, predivide):
    init_rank(rank, world, port)
    from ncclavg import Communicator

    comm = Communicator.from_torch_distributed(devices=["cpu"] * counts[rank], timeout=60, predivide=predivide)
    n = sum(counts)
    mine = _towers_of(rank, counts)
    assert (comm.backend, comm.size, comm.local_size, comm.world_size) == ("gloo", n, counts[rank], world)
    assert comm.tower_counts == list(counts) and comm.tower_offset == mine[0]
    uniform = len(set(counts)) == 1

    # all_reduce_avg against the float64 mean over every tower. Error: the local mean (exact fp32 sum of
    # quarter-integers, one division), at most one multiplication by T_p, gloo's SUM over the processes
    # (<= gamma_{P-1} of the sum of magnitudes) and one division: <= gamma_{P+3} * mean|x| in all.
    # Where every step is exact (uniform, power-of-two counts) the result must be bit for bit.
    exact = uniform and all(c & (c - 1) == 0 for c in counts) and world & (world - 1) == 0
    for seed, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16]):
        for numel in (0, 1, 17, 4099):
            xs = rank_inputs(n, numel, dtype, seed)
            ts = [xs[g].clone() for g in mine]
            work = comm.all_reduce_avg_async(ts, defer_scale=(seed == 1))
            work.wait()
            for t in ts:   # defer_scale may leave a divisor for the caller: apply it as the averager does
                t.div_(work.divisor)
            truth = torch.stack([x.double() for x in xs]).mean(0) if numel else torch.zeros(0, dtype=torch.float64)
            scale = torch.stack([x.double().abs() for x in xs]).mean(0) if numel else truth
            u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
            for t in ts:
                assert torch.equal(t, ts[0]), "local towers must hold the same mean"
                if exact:
                    assert torch.equal(t, truth.to(dtype)), (dtype, numel, counts)
                else:
                    bound = gamma(world + 3, u) * scale + 1e-300
                    assert bool(((t.double() - truth).abs() <= bound).all()), (dtype, numel, counts, predivide)

    # reduce_scatter_avg: tower g gets the mean of shard g; all_gather puts every tower's shard back in
    # global order. Inputs are quarter-integers whose fp32 sums are exact: one division by N rounds.
    shard = 3
    full = rank_inputs(n, shard * n, torch.float32, 11)
    outs = [torch.empty(shard) for _ in mine]
    comm.reduce_scatter_avg([full[g].clone() for g in mine], outs)
    mean = (torch.stack([x.double() for x in full]).sum(0) / n).float()
    for t, g in enumerate(mine):
        assert torch.equal(outs[t], mean[g * shard:(g + 1) * shard]), (counts, g)
    gathered = [torch.empty(shard * n) for _ in mine]
    comm.all_gather(outs, gathered)
    for gth in gathered:
        assert torch.equal(gth, mean), counts
    # inputs are left as they were
    ins = [full[g].clone() for g in mine]
    comm.reduce_scatter_avg(ins, [torch.empty(shard) for _ in mine])
    assert all(torch.equal(a, full[g]) for a, g in zip(ins, mine))

    # wrong number of tensors names the argument and the local size
    try:
        comm.all_reduce_avg([torch.zeros(3)] * (counts[rank] + 1))
    except ValueError as e:
        assert "tensors" in str(e) and f"local_size {counts[rank]}" in str(e), e
    else:
        raise AssertionError("a wrong tensor count must raise")
    assert comm.failure is None   # argument errors leave the communicator usable
    comm.all_reduce_avg([torch.ones(2) for _ in mine])


def averager(rank, world, port, counts):
    """GradientAverager over this process's towers matches the float64 mean of every tower's gradient."""
    init_rank(rank, world, port)
    from ncclavg import Communicator, GradientAverager

    comm = Communicator.from_torch_distributed(devices=["cpu"] * counts[rank], timeout=60)
    n = sum(counts)
    mine = _towers_of(rank, counts)
    torch.manual_seed(0)   # the same initial weights in every process
    model = MLP()
    towers = [copy.deepcopy(model) for _ in mine]
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.002, first_bucket_mb=0.001)
    assert len(avg.plan.buckets) > 1

    def batch(g, step):
        gen = torch.Generator().manual_seed(1000 * step + g)
        return torch.randn(5, 10, generator=gen), torch.randint(0, 4, (5,), generator=gen)

    for step in range(3):
        for tower, g in zip(towers, mine):
            tower.zero_grad()
            x, y = batch(g, step)
            nn.functional.cross_entropy(tower(x), y).backward()
        avg.average()
        refs = []
        for g in range(n):
            m = MLP()   # not a deepcopy of a tower: that would copy the averager's hooks too
            m.load_state_dict(towers[0].state_dict())
            x, y = batch(g, step)
            nn.functional.cross_entropy(m(x), y).backward()
            refs.append([p.grad.double() for p in m.parameters()])
        for i, p in enumerate(towers[0].parameters()):
            stack = torch.stack([r[i] for r in refs])
            truth, scale = stack.mean(0), stack.abs().mean(0)
            # The reference recomputes every tower's float32 gradient with the same ops, so only the
            # average's own error remains: local mean, x T_p, SUM over processes, one division:
            # <= gamma_{P+3} * mean|g| (see collectives above)
            assert bool(((p.grad.double() - truth).abs() <= gamma(world + 3) * scale + 1e-30).all()), (step, i)
            for other in towers[1:]:
                assert torch.equal(list(other.parameters())[i].grad, p.grad)
        with torch.no_grad():
            for tower in towers:
                for p in tower.parameters():
                    p -= 0.1 * p.grad
    avg.close()
