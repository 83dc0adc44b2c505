"""Bodies of the multi-process tests of the finiteness noted by the passes that write the gradients (Note
[Finiteness from the pass that writes] in csrc/common/finite_math.h): the channel's checked sums, the
gloo communicator's Work.finite, GradientAverager.grads_finite and the steps that use it, the DDP hook.
Every rank checks its own answer against what it holds, and that a step it skips leaves its state
bit-identical; the harness checks that every rank agrees."""
import os

import torch

PLANTS = (float("nan"), float("inf"), float("-inf"))


def channel_sums(rank, world, name, slot, q):
    """all_reduce_sum / reduce_scatter_sum with check_finite=True: every size around the direct path's
    32 KiB and the slot (its own slice summed, the others' copied, several rounds), a NaN / inf / -inf
    planted on one rank at a time at the first, middle or last element, and two large finite values whose
    float32 sum overflows: the flag is the finiteness of what the rank holds, the same on every rank."""
    from _transport_shm_workers import open_channel

    ch = open_channel(name, rank, world, slot)
    codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
    big = {torch.float32: 3e38, torch.float16: 6e4, torch.bfloat16: 3e38, torch.float64: 1.7e308}
    answers = []
    for dtype, code in codes.items():
        for numel in (1, 33, 8191, 9000, 70001):
            cases = [None] + [(v, r, w) for v in PLANTS for r in range(world) for w in sorted({0, numel // 2, numel - 1})]
            cases.append("overflow")
            for case in cases:
                gen = torch.Generator().manual_seed(numel + rank)
                x = torch.randn(numel, generator=gen).to(dtype)
                if case == "overflow":
                    x[numel - 1] = big[dtype]
                elif case is not None and case[1] == rank:
                    x[case[2]] = case[0]
                got = ch.all_reduce_sum(x.data_ptr(), numel, code, 30.0, 1.0, float(world), 0, 0, True)
                assert got is bool(torch.isfinite(x).all()), ("all_reduce_sum", dtype, numel, case, got)
                want_bad = case is not None and (case != "overflow" or dtype != torch.float16 or world * 6e4 > 65504)
                assert got is not want_bad, ("all_reduce_sum expected", dtype, numel, case, got)
                answers.append(got)
            full = torch.randn(numel * world, generator=torch.Generator().manual_seed(rank)).to(dtype)
            full[numel * world - 1] = float("nan") if rank == 0 else 1.0   # in the last rank's slice only
            out = torch.empty(numel, dtype=dtype)
            got = ch.reduce_scatter_sum(full.data_ptr(), out.data_ptr(), numel, code, 30.0, 1.0, 1.0, 0, 0, True)
            assert got is bool(torch.isfinite(out).all()) and got is (rank != world - 1), ("reduce_scatter", got)
    ones = torch.ones(3)   # alive while the channel writes it
    assert ch.all_reduce_sum(ones.data_ptr(), 3, 0, 30.0) is None   # not asked
    q.put((rank, "ok", answers))


def _towers(ntowers, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37,), (5, 7), (300,), (3,), (129,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    return [[torch.nn.Parameter(x.clone().to(dtype)) for x in init] for _ in range(ntowers)], shapes


def _master_state(mw):
    return [t.clone() for t in mw.flat] + [t.clone() for t in mw.exp_avg + mw.exp_avg_sq] + [list(mw.steps)]


def averager_job(rank, world, port, ntowers, shm, dtype_name):
    """GradientAverager over every tower of every process: a value planted in one tower of one rank (each
    rank, each bucket in turn), or large values on two ranks whose sum overflows, makes grads_finite False
    on every rank, and MasterWeights.step(grads_finite=...) skips there with its state unchanged; clean
    gradients give True and the same step as the scan, bit for bit."""
    os.environ["NCCLAVG_SHM"] = shm
    from _dist_util import init_rank

    init_rank(rank, world, port)
    import ncclavg
    from ncclavg import GradientAverager, MasterWeights

    dtype = getattr(torch, dtype_name)
    comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"] * ntowers)
    assert comm.transport == ("shm" if shm == "1" else "gloo"), comm.transport
    towers, shapes = _towers(ntowers, dtype, 0)
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    nb = len(avg.plan.buckets)
    assert nb > 2
    cases = [None, "overflow"] + [(v, r, i) for v in PLANTS for r in range(world) for i in (0, len(shapes) - 1, 2)]
    for step, case in enumerate(cases):
        avg.zero_grad()
        gen = torch.Generator().manual_seed(100 * step + rank)
        grads = [[(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in shapes] for _ in range(ntowers)]
        if case == "overflow" and rank < 2:   # in every tower: the first float32 sum overflows, local or not
            for t in range(ntowers):
                grads[t][2].view(-1)[-1] = 3e38 if dtype != torch.float16 else 6e4
        elif isinstance(case, tuple) and case[1] == rank:
            grads[ntowers - 1][case[2]].view(-1)[-1 if step % 2 else 0] = case[0]
        for ps, gs in zip(towers, grads):
            sum((p * g).sum() for p, g in zip(ps, gs)).backward()
        avg.average()
        held = all(bool(torch.isfinite(avg.bucket_storage(t, b)).all()) for t in range(ntowers) for b in range(nb))
        assert avg.grads_finite is held, (case, avg.bucket_finite)
        if case is None:
            assert held
        elif case != "overflow" or dtype != torch.float16:
            assert not held, case
        storages = [[avg.bucket_storage(t, b) for b in range(nb)] for t in range(ntowers)]
        mws = [MasterWeights([p.detach().float() for p in towers[0]], plan=avg.plan, pin=False) for _ in range(2)]
        for mw, known in zip(mws, (avg.grads_finite, None)):
            before = _master_state(mw)
            info = mw.step(storages, grads_finite=known)
            assert info["skipped"] is (not held), (case, known, info)
            if not held:
                assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                           for a, b in zip(before, _master_state(mw))), (case, known)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(_master_state(mws[0]), _master_state(mws[1]))), case
    # a deferred division left to the caller: the channel's sum is the result, and its check comes back
    x = torch.full((5000,), 1.0)
    if rank == world - 1:
        x[4999] = float("inf")
    bufs = [x] + [x.clone() for _ in range(ntowers - 1)]
    work = comm.all_reduce_avg_async(bufs, defer_scale=True)
    work.wait()
    if ntowers == 1:
        assert work.finite is (False if shm == "1" else None), work.finite   # torch.distributed: not checked
    else:
        assert work.finite is False   # the finishing scale into the other towers checks
    comm.close()


def ddp_hook_job(rank, world, port):
    """ncclavg.ddp over DDP on gloo: after backward, the hook state says whether every averaged bucket is
    finite (the same on every rank); CPUAdamW(skip_nonfinite=True).step(grads_finite=...) then skips on
    every rank when one rank's input made a gradient NaN, with params and state unchanged."""
    from _dist_util import init_rank

    init_rank(rank, world, port)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ncclavg
    from ncclavg.optim import CPUAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)   # several buckets
    state = ncclavg.ddp.register(ddp)
    assert state.grads_finite is None
    opt = CPUAdamW(ddp.parameters(), skip_nonfinite=True, lr=1e-2)
    for step, poison in enumerate((None, 1, None, 0)):
        opt.zero_grad()
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step * 10 + rank))
        if poison == rank:
            x[3, 2] = float("nan")
        ddp(x).square().sum().backward()
        flag = state.grads_finite
        assert flag is (poison is None), (step, flag, state._finite)
        before = [p.detach().clone() for p in model.parameters()] + \
            [v.clone() for s in opt.state.values() for v in s.values()]
        info = opt.step(grads_finite=flag)
        assert info["skipped"] is (poison is not None)
        if poison is not None:
            after = [p.detach().clone() for p in model.parameters()] + \
                [v.clone() for s in opt.state.values() for v in s.values()]
            assert all(torch.equal(a, b) for a, b in zip(before, after))
    # every rank holds the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(rows, flat)
    assert all(torch.equal(r, rows[0]) for r in rows)


def trainer_job(rank, world, port, overlap):
    """TowerTrainer(master="cpu") over processes: the engine hands the master step the finiteness its
    reduction noted (True on clean steps; False when one rank's gradient turns NaN), and a poisoned step
    is skipped on every rank with the master weights and state unchanged."""
    from _dist_util import init_rank

    init_rank(rank, world, port)
    from ncclavg import TowerTrainer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    tr = TowerTrainer(net, devices=["cpu"], optimizer="adamw", lr=1e-2, master="cpu", timeout=60,
                      bucket_cap_mb=0.002, first_bucket_mb=0.001, overlap=overlap)
    seen = []
    step = tr.engine.master.step

    def recording_step(*args, **kw):
        seen.append(kw.get("grads_finite"))
        return step(*args, **kw)

    tr.engine.master.step = recording_step
    armed = []
    first = next(iter(tr.towers[0].parameters()))
    first.register_hook(lambda g: torch.full_like(g, float("nan")) if armed and rank == world - 1 else None)
    g = torch.Generator().manual_seed(rank)
    for k in range(4):
        if k == 2:
            armed.append(True)
            before = tr.engine.master_state()
        rec = tr.train_step((torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)))
        if k == 2:
            armed.clear()
            assert rec["skipped"], rec
            after = tr.engine.master_state()
            assert torch.equal(torch.cat([p.reshape(-1) for p in before["params"]]),
                               torch.cat([p.reshape(-1) for p in after["params"]]))
        else:
            assert not rec["skipped"], (k, rec)
    assert seen == [True, True, False, True], seen
    tr.close()
