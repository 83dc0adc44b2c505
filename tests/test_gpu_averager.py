"""The Python layer on GPUs: Communicator.nccl over every visible device, GradientAverager with CUDA
towers (zero-copy views, CUDA pack/unpack fallback, grad_dtype), from_torch_distributed with several
ranks on ONE GPU (NCCL >= 2.30), and the local backend with several towers sharing cuda:0 (the CUDA
average kernel, no NCCL; see Note [Towers sharing one GPU] in ncclavg/comm/local.py). Skips with the
reason on machines without CUDA / NCCL."""
from __future__ import annotations

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _gpu import (HALF_SUBNORMAL, TORCH_DTYPES, assert_close_to_mean, eps, exact_rank_inputs,  # noqa: E402
                  nccl_version, require_cuda, require_nccl_comm)

pytestmark = pytest.mark.gpu


def devices():
    require_nccl_comm()
    import torch

    return list(range(torch.cuda.device_count()))


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_nccl_communicator_all_devices(dtype):
    import torch
    from ncclavg import Communicator

    devs = devices()
    n = len(devs)
    dt = getattr(torch, dtype)
    with Communicator.nccl(devs, timeout=60) as comm:
        assert (comm.backend, comm.size, comm.local_size, comm.world_size) == ("nccl", n, n, 1)
        for numel in (0, 1, 17, 4097, 1 << 20):
            x = exact_rank_inputs(n, numel, seed=numel)
            ts = [torch.tensor(x[i], dtype=dt, device=f"cuda:{d}") for i, d in enumerate(devs)]
            comm.all_reduce_avg(ts)
            want = torch.tensor(x.mean(0), dtype=dt)
            for t in ts:
                assert torch.equal(t.cpu(), want), (dtype, numel)
        ts = [torch.tensor(exact_rank_inputs(n, 999, 3)[i], dtype=dt, device=f"cuda:{d}") for i, d in enumerate(devs)]
        work = comm.all_reduce_avg_async(ts)
        work.wait()
        assert work.done()
        shard = 33
        x = exact_rank_inputs(n, shard * n, 5)
        ins = [torch.tensor(x[i], dtype=dt, device=f"cuda:{d}") for i, d in enumerate(devs)]
        outs = [torch.empty(shard, dtype=dt, device=f"cuda:{d}") for d in devs]
        comm.reduce_scatter_avg(ins, outs)
        mean = torch.tensor(x.mean(0), dtype=dt)
        for i, o in enumerate(outs):
            assert torch.equal(o.cpu(), mean[i * shard:(i + 1) * shard])
        full = [torch.empty(shard * n, dtype=dt, device=f"cuda:{d}") for d in devs]
        comm.all_gather(outs, full)
        for f in full:
            assert torch.equal(f.cpu(), mean)
        with pytest.raises(ValueError, match="local_size"):
            comm.all_reduce_avg(ts[:-1] + ts if n > 1 else ts + ts)


class MLP:
    @staticmethod
    def make(torch):
        nn = torch.nn
        return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))


def sgd_noise_floor(init, batches, n, ref):
    """A measured noise floor, as in Note [Tolerance of training equivalence tests] (tests/train/
    test_trainer.py): the largest distance from the reference `ref` of equally valid runs on the same GPU
    (the batch's gradient accumulated over 2 and n slices: the GPU's matmuls sum in another order then; and
    the float64 run, the reference's own float32 error). n towers are one more such run, so within 2 floors
    of the reference (triangle inequality); never below one fp32 ulp (2^-23 relative)."""
    import torch

    runs = [sgd_reference(init, batches, chunks) for chunks in sorted({2, n})]
    runs.append(sgd_reference(init, batches, dtype=torch.float64))
    return max(2.0 ** -23, max(max_rel(a, b) for run in runs for a, b in zip(run, ref.parameters())))


def max_rel(a, b):
    """max |a - b| / max |b| (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def sgd_reference(model, batches, chunks=1, dtype=None):
    """SGD(lr=0.1) of a copy of `model` (on its device) on the full batches, each batch's gradient
    accumulated over `chunks` equal slices (each slice's mean loss / chunks), in `dtype` (default float32)."""
    import torch

    dtype = dtype or torch.float32
    m = copy.deepcopy(model).to(dtype)
    dev = next(m.parameters()).device
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        for c in range(chunks):
            sl = slice(c * len(y) // chunks, (c + 1) * len(y) // chunks)
            loss = torch.nn.functional.cross_entropy(m(x[sl].to(dev, dtype)), y[sl].to(dev)) / chunks
            loss.backward()
        opt.step()
    return list(m.parameters())


@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_towers_equal_one_model_on_full_batch(overlap):
    import torch
    from ncclavg import Communicator, GradientAverager

    devs = devices()
    n = len(devs)
    torch.manual_seed(0)
    ref = MLP.make(torch).cuda(devs[0])
    init = copy.deepcopy(ref)
    towers = [copy.deepcopy(ref).cuda(d) for d in devs]
    comm = Communicator.nccl(devs, timeout=60)
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.01, first_bucket_mb=0.005, overlap=overlap)
    assert all(b.device.startswith("cuda") for b in avg.plan.buckets)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opts = [torch.optim.SGD(t.parameters(), lr=0.1) for t in towers]
    gen = torch.Generator().manual_seed(1)
    batch = 8 * n
    batches = []
    for step in range(5):
        x = torch.randn(batch, 12, generator=gen)
        y = torch.randint(0, 3, (batch,), generator=gen)
        batches.append((x, y))
        opt_ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x.cuda(devs[0])), y.cuda(devs[0])).backward()
        opt_ref.step()
        for t, (tower, opt) in enumerate(zip(towers, opts)):
            opt.zero_grad()
            sl = slice(t * 8, (t + 1) * 8)
            torch.nn.functional.cross_entropy(tower(x[sl].cuda(devs[t])), y[sl].cuda(devs[t])).backward()
        avg.average()
        for opt in opts:
            opt.step()
    torch.cuda.synchronize()
    floor = sgd_noise_floor(init, batches, n, ref)
    for p_ref, *ps in zip(ref.parameters(), *[t.parameters() for t in towers]):
        for p in ps:
            assert torch.equal(p.cpu(), ps[0].cpu())
        assert max_rel(ps[0], p_ref) <= 2 * floor, (max_rel(ps[0], p_ref), floor)
    avg.close()
    comm.close()


@pytest.mark.parametrize("grad_dtype", [None, "bfloat16"])
def test_cuda_fallback_pack_and_grad_dtype(grad_dtype):
    import torch
    from ncclavg import Communicator, GradientAverager

    devs = devices()
    n = len(devs)
    shapes = [(3, 5), (0,), (1,), (4097,), (7, 7)]
    towers = [[torch.zeros(s, device=f"cuda:{d}", requires_grad=True) for s in shapes] for d in devs]
    comm = Communicator.nccl(devs, timeout=60)
    avg = GradientAverager(comm, towers, grad_dtype=grad_dtype)
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in devs]
        for t, d in enumerate(devs):
            for p, g in zip(towers[t], grads[t]):
                p.grad = g.cuda(d)          # user-provided grads: the fused CUDA pack path
            sum((p * 0).sum() for p in towers[t]).backward()
        avg.average()
        gdt = torch.bfloat16 if grad_dtype else torch.float32
        for i in range(len(shapes)):
            stack = torch.stack([grads[t][i].to(gdt).double() for t in range(n)])
            for t in range(n):
                got = towers[t][i].grad
                assert got.dtype == torch.float32
                # NCCL's mean in the bucket dtype: the bound of assert_close_to_mean (the 1/n pre-multiply, n
                # roundings of partial sums, one of the result), against the float64 mean of the packed inputs
                assert_close_to_mean(got.cpu().double().numpy(), stack.mean(0).numpy(),
                                     stack.abs().amax(0).numpy(), n, "bfloat16" if grad_dtype else "float32",
                                     f"step {step} param {i} tower {t}")
    assert avg.stats["fallback_packs"] > 0
    avg.close()
    comm.close()


def _ranks_on_one_gpu(rank, world, port):
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from _dist_util import init_rank

    init_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    from ncclavg import Communicator, GradientAverager

    comm = Communicator.from_torch_distributed(device="cuda:0", timeout=60)
    assert (comm.backend, comm.size, comm.rank, comm.local_size) == ("nccl", world, rank, 1)
    for dtype in ("float32", "float16", "bfloat16"):
        x = exact_rank_inputs(world, 4097, seed=11)
        t = torch.tensor(x[rank], dtype=getattr(torch, dtype), device="cuda:0")
        comm.all_reduce_avg([t])
        assert torch.equal(t.cpu(), torch.tensor(x.mean(0), dtype=getattr(torch, dtype))), dtype
    torch.manual_seed(0)
    model = MLP.make(torch).cuda(0)
    avg = GradientAverager(comm, [model], bucket_cap_mb=0.01, first_bucket_mb=0.005)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
    local = [p.grad.detach().cpu().clone() for p in model.parameters()]
    avg.average()
    everyone = [None] * world
    dist.all_gather_object(everyone, local)   # gloo: the reference mean
    for i, p in enumerate(model.parameters()):
        want = sum(e[i].double() for e in everyone) / world
        absmax = torch.stack([e[i].double().abs() for e in everyone]).amax(0)
        assert_close_to_mean(p.grad.cpu().double().numpy(), want.numpy(), absmax.numpy(), world, "float32", str(i))
    avg.close()
    comm.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_from_torch_distributed_ranks_on_one_gpu(world):
    require_nccl_comm()
    if nccl_version() < (2, 30, 0):
        pytest.skip("several ranks on one GPU need NCCL >= 2.30; loaded " + ".".join(map(str, nccl_version())))
    from _dist_util import run_ranks

    run_ranks(_ranks_on_one_gpu, world, timeout_s=240)


# ---------------------------------------------------------------- towers sharing one GPU (local backend)
def local_on_gpu(n):
    """`n` towers on cuda:0 through the local backend (no NCCL needed)."""
    require_cuda()
    from ncclavg.comm import LocalCommunicator

    return LocalCommunicator(n, timeout=60, device="cuda:0")


def gamma(k, u=2.0 ** -24):
    """gamma_k = k*u / (1 - k*u): the relative error bound of k float32 roundings (Higham, ch. 3)."""
    return k * u / (1 - k * u)


def assert_local_mean(out, xs, dtype, what):
    """The local kernel's error against the float64 mean: n - 1 float32 additions and one float32 division
    (<= gamma_n * mean|x_i|, as in tests/comm/test_comm_local.py), then, for 16-bit types, one rounding to
    the element type (<= u_dtype * |fp32 mean| or half a subnormal spacing). Tighter than
    assert_close_to_mean, which also allows NCCL's roundings of partial sums in the element type."""
    import torch

    stack = torch.stack([x.detach().cpu().double() for x in xs])
    ref, mag = stack.mean(0), stack.abs().mean(0)
    u = 0.0 if dtype == "float32" else eps(dtype) / 2
    bound = u * ref.abs() + (1 + u) * gamma(len(xs)) * mag + (HALF_SUBNORMAL[dtype] if u else 0.0)
    err = (out.detach().cpu().double() - ref).abs()
    bad = torch.nonzero(err > bound).flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} elements off the float64 mean, first at {int(bad[0])}: "
                              f"{float(out.flatten()[bad[0]])} vs {float(ref.flatten()[bad[0]])}")


@pytest.mark.parametrize("n", [2, 3, 4])   # 3: a divisor whose reciprocal is inexact
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_local_backend_on_one_gpu_collectives(n, dtype):
    import torch
    from ncclavg import Communicator

    comm = local_on_gpu(n)
    dt = getattr(torch, dtype)
    assert (comm.backend, comm.size, comm.local_size, comm.devices) == ("local", n, n, ["cuda:0"] * n)
    cpu = Communicator.local(n)
    gen = torch.Generator().manual_seed(n)
    for numel in (0, 1, 17, 4097, (1 << 20) + 3):
        x = exact_rank_inputs(n, numel, seed=numel)   # exact mean: bit for bit
        ts = [torch.tensor(x[i], dtype=dt, device="cuda:0") for i in range(n)]
        comm.all_reduce_avg(ts)
        want = torch.tensor(x.mean(0), dtype=dt)
        assert all(torch.equal(t.cpu(), want) for t in ts), (dtype, numel)
        # random inputs, async: the same arithmetic as the CPU path (fp32 sum in tower order, one division,
        # one rounding), so bit for bit equal to it, and within the float64 bound
        xs = [(torch.randn(numel, generator=gen) * 10).to(dt) for _ in range(n)]
        ts = [x.to("cuda:0") for x in xs]
        work = comm.all_reduce_avg_async(ts, tag="r")
        work.wait_stream()        # ordered on the device; the host reads below through the same stream
        on_cpu = [x.clone() for x in xs]
        cpu.all_reduce_avg(on_cpu)
        for t in ts:
            assert torch.equal(t.cpu(), on_cpu[0]), (dtype, numel)
            assert_local_mean(t, xs, dtype, f"{dtype} numel {numel}")
        work.wait()
        assert work.done() and work.elapsed is not None and work.divisor == 1.0
    shard = 33
    x = exact_rank_inputs(n, shard * n, 5)
    ins = [torch.tensor(x[i], dtype=dt, device="cuda:0") for i in range(n)]
    outs = [torch.empty(shard, dtype=dt, device="cuda:0") for _ in range(n)]
    comm.reduce_scatter_avg(ins, outs)
    mean = torch.tensor(x.mean(0), dtype=dt)
    for i, o in enumerate(outs):
        assert torch.equal(o.cpu(), mean[i * shard:(i + 1) * shard])
    full = [torch.empty(shard * n, dtype=dt, device="cuda:0") for _ in range(n)]
    comm.all_gather(outs, full)
    assert all(torch.equal(f.cpu(), mean) for f in full)
    # random inputs: the reduce-scatter divides (not multiplies by 1/n) on the GPU too, so it equals the CPU path
    xs = [(torch.randn(shard * n, generator=gen) * 10).to(dt) for _ in range(n)]
    cpu_outs = [torch.empty(shard, dtype=dt) for _ in range(n)]
    cpu.reduce_scatter_avg(xs, cpu_outs)
    comm.reduce_scatter_avg([x.to("cuda:0") for x in xs], outs)
    assert all(torch.equal(o.cpu(), c) for o, c in zip(outs, cpu_outs)), dtype
    comm.close()
    cpu.close()


def test_local_backend_on_one_gpu_wait_is_bounded():
    import torch
    from ncclavg import CommError, CommTimeoutError

    comm = local_on_gpu(2)
    ts = [torch.ones(1000, device="cuda:0"), torch.full((1000,), 3.0, device="cuda:0")]
    torch.cuda._sleep(2 ** 31 - 1)   # about a second of device time: the stream does not reach the kernel
    work = comm.all_reduce_avg_async(ts)
    with pytest.raises(CommTimeoutError, match="did not complete within 0.05 s"):
        work.wait(timeout=0.05)
    torch.cuda.synchronize()
    assert work.done() and torch.equal(ts[0].cpu(), torch.full((1000,), 2.0))
    with pytest.raises(CommError, match="unusable: local all_reduce_avg of 4000 bytes .* did not complete"):
        comm.all_reduce_avg(ts)


class ParamsTimesInput:
    """A module whose gradient is exactly its input: forward(cs) = sum_i (p_i * c_i).sum()."""

    @staticmethod
    def make(torch, shapes, dtype):
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes])

            def forward(self, cs):
                return sum((p * c).sum() for p, c in zip(self.ps, cs))
        return M()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("overlap", [True, False])
def test_averager_towers_sharing_one_gpu_match_float64(n, dtype, overlap):
    import torch
    from ncclavg import Communicator, GradientAverager

    comm = local_on_gpu(n)
    dt = getattr(torch, dtype)
    shapes = [(300,), (17, 5), (1,), (0,), (4097,), (64, 64), (3,)]
    towers = [ParamsTimesInput.make(torch, shapes, dt).to("cuda:0") for _ in range(n)]
    # several buckets, so that with overlap=True some are averaged by the hooks while backward goes on
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.005, first_bucket_mb=0.002, overlap=overlap,
                           check_finite=True)
    assert len(avg.plan.buckets) >= 3
    cpu = Communicator.local(n)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        cs = [[(torch.randn(s, generator=gen) * 4).to(dt) for s in shapes] for _ in range(n)]
        if step == 1:   # exact inputs: the mean is bit for bit the float64 one
            x = exact_rank_inputs(n, sum(torch.Size(s).numel() for s in shapes), seed=step)
            cs, off = [[None] * len(shapes) for _ in range(n)], 0
            for i, s in enumerate(shapes):
                k = torch.Size(s).numel()
                for t in range(n):
                    cs[t][i] = torch.tensor(x[t, off:off + k], dtype=dt).view(s)
                off += k
        avg.zero_grad()
        for t in range(n):
            towers[t]([c.to("cuda:0") for c in cs[t]]).backward()
        avg.average()
        assert avg.nonfinite() == []
        for i in range(len(shapes)):
            xs = [cs[t][i].clone() for t in range(n)]
            cpu.all_reduce_avg(xs)          # the CPU path's result: the same arithmetic
            for t in range(n):
                g = towers[t].ps[i].grad
                assert g.device == torch.device("cuda:0")
                assert torch.equal(g.cpu(), xs[0]), (step, i, t)
                assert_local_mean(g, [cs[u][i] for u in range(n)], dtype, f"step {step} param {i} tower {t}")
                if step == 1:
                    assert torch.equal(g.cpu().double(), torch.stack([cs[u][i].double() for u in range(n)]).mean(0))
    # a tower with an inf: found before the average (read without waiting for the averages), on its bucket
    avg.zero_grad()
    cs = [[torch.ones(s, dtype=dt) for s in shapes] for _ in range(n)]
    cs[n - 1][4][7] = float("inf")
    for t in range(n):
        towers[t]([c.to("cuda:0") for c in cs[t]]).backward()
    avg.average(block=True)
    assert avg.nonfinite() == [(n - 1, avg.plan.slots[4].bucket)]
    avg.close()
    comm.close()
    cpu.close()


@pytest.mark.parametrize("n", [2, 4])
def test_towers_sharing_one_gpu_equal_one_model_on_full_batch(n):
    import torch
    from ncclavg import GradientAverager

    comm = local_on_gpu(n)
    torch.manual_seed(0)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False   # float32 runs of one training, as the reference
    try:
        ref = MLP.make(torch).cuda(0)
        init = copy.deepcopy(ref)
        towers = [copy.deepcopy(ref) for _ in range(n)]
        avg = GradientAverager(comm, towers, bucket_cap_mb=0.01, first_bucket_mb=0.005)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        opts = [torch.optim.SGD(t.parameters(), lr=0.1) for t in towers]
        gen = torch.Generator().manual_seed(1)
        batches = []
        for step in range(5):
            x, y = torch.randn(8 * n, 12, generator=gen), torch.randint(0, 3, (8 * n,), generator=gen)
            batches.append((x, y))
            opt_ref.zero_grad()
            torch.nn.functional.cross_entropy(ref(x.cuda(0)), y.cuda(0)).backward()
            opt_ref.step()
            for t, (tower, opt) in enumerate(zip(towers, opts)):
                opt.zero_grad()
                sl = slice(t * 8, (t + 1) * 8)
                torch.nn.functional.cross_entropy(tower(x[sl].cuda(0)), y[sl].cuda(0)).backward()
            avg.average()           # stream-ordered: the optimizers below run after it on the same stream
            for opt in opts:
                opt.step()
        torch.cuda.synchronize()
        floor = sgd_noise_floor(init, batches, n, ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    for p_ref, *ps in zip(ref.parameters(), *[t.parameters() for t in towers]):
        for p in ps:
            assert torch.equal(p.cpu(), ps[0].cpu())
        assert max_rel(ps[0], p_ref) <= 2 * floor, (max_rel(ps[0], p_ref), floor)
    avg.close()
    comm.close()
