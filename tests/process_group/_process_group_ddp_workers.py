"""Bodies of the DDP / FSDP2 tests of the `ncclavg` backend and of the ncclavg.ddp hook: stock torch DDP
(and FSDP2) on "ncclavg" against the same on gloo, in the same processes, from the same weights and data."""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _process_group_workers import init_backend
from _comm_gloo_workers import gamma

STEPS = 4


class Net(nn.Module):
    """Linear layers and a BatchNorm, whose running statistics DDP broadcasts from rank 0 each step."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(),
                                 nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)


def state_of(model):
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def train(ddp, rank, steps, sync_from=None, check=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        if sync_from is not None:   # start the step where the reference model is (see ddp_job)
            with torch.no_grad():
                for mine, ref in zip(list(ddp.module.parameters()) + list(ddp.module.buffers()),
                                     list(sync_from[step][0])):
                    mine.copy_(ref)
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if check is not None:
            check(step, ddp)
        opt.step()


def grad_scale(model, state, rank, world, step, gloo):
    """Per element, sum_r |g_r| / world over every rank's local gradient at `state`: the scale of the
    rounding error of a sum of the world predivided gradients."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p, v in zip(list(m.parameters()) + list(m.buffers()), state):
            p.copy_(v)
    x, y = batch(rank, step)
    nn.functional.cross_entropy(m(x), y).backward()
    out = []
    for p in m.parameters():
        a = p.grad.abs()
        dist.all_reduce(a, group=gloo)
        out.append(a / world)
    return out


def ddp_job(rank, world, port, hook=None):
    """Stock DDP over gloo (the reference) and over ncclavg (or with the ncclavg hook, on either group),
    STEPS steps of SGD with momentum. World 2: weights and BatchNorm buffers bit for bit (both add the two
    predivided gradients, a + b, one rounding). World 3 and 4: gloo's ring adds in another order, so
    every step starts both models from the reference's weights, and each gradient must be within
    2 gamma_{world-1} sum_r |g_r / world| of the reference (each sum of world terms is within
    gamma_{world-1} of the exact one, Higham ch. 3); wire="bfloat16" adds the roundings of the wire
    (see the bound below)."""
    init_backend(rank, world, port)
    import ncclavg

    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = Net()
    ref = DDP(copy.deepcopy(model), process_group=gloo)
    # the reference records, for each step, the state it started from and its gradients
    ref_states, snapshots = [], []
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        ref_states.append(state_of(ref.module))
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ref(x), y).backward()
        snapshots.append([p.grad.clone() for p in ref.module.parameters()])
        opt.step()
    final_ref = state_of(ref.module)

    if hook is None:
        ours = DDP(copy.deepcopy(model))
    else:
        group, wire = hook
        ours = DDP(copy.deepcopy(model), process_group=gloo if group == "gloo" else None)
        ncclavg.ddp.register(ours, wire=wire)
    wire = hook[1] if hook else None
    exact = world == 2 and wire is None
    if exact:
        train(ours, rank, STEPS)
        got = state_of(ours.module)
        for a, b in zip(got, final_ref):
            assert torch.equal(a, b), (a - b).abs().max()
        dist.barrier()
        return

    def scale_at(step):
        return grad_scale(model, ref_states[step], rank, world, step, gloo)

    # float32 wire: 2 gamma_{world-1} (both sums). bfloat16 wire: each term rounded to bfloat16 (2^-8
    # relative), the fp32 sum (gamma_{world-1}), one rounding of the sum to bfloat16 (2^-8 of the sum's
    # magnitude, <= the scale), and the reference's own sum: 2^-7 + 2^-8 more.
    # The hook divides after its sum, stock DDP before (each predivided term rounded, u = 2^-24 of
    # |g_r| / world): 2u more.
    bound = 2 * gamma(world - 1) + (3 * 2.0 ** -8 + 2.0 ** -23 if wire == "bfloat16" else 0.0)
    if hook is not None:
        bound += 2 * 2.0 ** -24

    def check(step, m):
        scales = scale_at(step)
        for p, want, s in zip(m.module.parameters(), snapshots[step], scales):
            # BatchNorm: the running statistics came from rank 0's broadcast in both runs
            assert bool(((p.grad - want).abs() <= bound * s + 1e-30).all()), (step, (p.grad - want).abs().max())

    train(ours, rank, STEPS, sync_from=[(s,) for s in ref_states], check=check)
    dist.barrier()


def fsdp2_job(rank, world, port):
    """FSDP2 (fully_shard on a CPU mesh) on ncclavg against FSDP2 on gloo, from the same weights and data.
    Both reduce-scatter the gradients with AVG. World 2: STEPS steps, weights bit for bit (a + b either
    way). Otherwise one SGD step (w - lr g, no momentum): the gradients differ by at most
    2 gamma_{world-1} sum_r |g_r| / world (two sums of world terms in different orders), so the weights by
    lr times that plus one rounding of each update (2^-24 |w| each)."""
    init_backend(rank, world, port)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = Net()
    gloo = dist.new_group(backend="gloo")
    steps = STEPS if world == 2 else 1
    results = []
    # FSDP2 on ncclavg, on gloo (the reference), and on gloo with ncclavg's custom comms (fsdp_comms.py)
    for group, custom in ((dist.group.WORLD, False), (gloo, False), (gloo, True)):
        mesh = DeviceMesh.from_group(group, "cpu")
        m = copy.deepcopy(base)
        for layer in m.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if custom:
            from ncclavg.process_group.fsdp_comms import use_ncclavg

            assert use_ncclavg(m) == 4
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        results.append([p.full_tensor().detach().clone() for p in m.parameters()])
    ours, ref, custom = results
    if world == 2:
        for a, b, c in zip(ours, ref, custom):
            assert torch.equal(a, b), (a - b).abs().max()
            assert torch.equal(c, b), (c - b).abs().max()
    else:
        scales = grad_scale(base, state_of(base), rank, world, 0, gloo)
        for a, b, c, s in zip(ours, ref, custom, scales):
            tol = 0.1 * 2 * gamma(world - 1) * s + 2 * 2.0 ** -24 * b.abs()
            assert bool(((a - b).abs() <= tol).all()), (a - b).abs().max()
            assert torch.equal(a, c)   # the same collectives of the same channel
    dist.barrier()


def checkpoint_job(rank, world, port, outdir):
    """torch.distributed.checkpoint saves and loads an FSDP2 model's sharded state through the backend
    (its object gathers and broadcasts), and the object collectives work: the loaded weights equal the
    saved ones bit for bit."""
    init_backend(rank, world, port)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=world - 1)
    assert box == [f"from {world - 1}"], box

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = Net()
    fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    saved = [p.full_tensor().detach().clone() for p in m.parameters()]
    dcp.save({"model": m.state_dict()}, checkpoint_id=outdir)
    torch.manual_seed(1)
    other = Net()
    fully_shard(other, mesh=mesh)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=outdir)
    other.load_state_dict(state["model"])
    for a, b in zip(saved, (p.full_tensor() for p in other.parameters())):
        assert torch.equal(a, b)
    dist.barrier()


class SparseNet(nn.Module):
    """An embedding with sparse gradients (DDP then all-reduces them as sparse tensors) and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def sparse_ddp_job(rank, world, port):
    """Stock DDP over an nn.Embedding(sparse=True) on ncclavg, against the same on gloo: the same weights
    after each step (world 2: gloo and ncclavg both add the two ranks' gradients once, a + b)."""
    init_backend(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = SparseNet()
    ref, ours = DDP(copy.deepcopy(model), process_group=gloo), DDP(copy.deepcopy(model))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours)]
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        idx, y = torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(m(idx), y).backward()
            opt.step()
        for a, b in zip(state_of(ref.module), state_of(ours.module)):
            assert torch.equal(a, b), (step, (a - b).abs().max())
    dist.barrier()
