"""_C.NcclComm in one process over every visible device (one on a single-GPU machine): all-reduce
average (exact inputs bit for bit, random inputs vs float64), fp16 predivide, reduce-scatter and
all-gather, stream ordering, the watchdog's bookkeeping, bad input and abort/destroy."""
from __future__ import annotations

import numpy as np
import pytest

from _gpu import (DTYPE_CODE, TORCH_DTYPES, assert_close_to_mean, bits, exact_rank_inputs, expected_average,
                  nccl_version, require_nccl_comm, tdtype, to_f64)
from ncclavg import CommTimeoutError, NcclError
from ncclavg.buffers import as_buffers

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 4097, 1_000_003]


@pytest.fixture(scope="module")
def comm():
    NcclComm = require_nccl_comm()
    import torch

    c = NcclComm.init_all(list(range(torch.cuda.device_count())), 120.0)
    yield c
    c.destroy()


def streams_of(torch, n):
    return [int(torch.cuda.current_stream(d).cuda_stream) for d in range(n)]


def skip_unsupported(dtype):
    if dtype == "bfloat16" and nccl_version() < (2, 10, 0):
        pytest.skip(f"bfloat16 collectives need NCCL >= 2.10, loaded {nccl_version()}")


def all_reduce(torch, c, tensors, **kw):
    seq = c.all_reduce_avg(as_buffers(tensors, "tensors"), streams_of(torch, c.local_size), **kw)
    c.stream_wait(streams_of(torch, c.local_size))
    return seq


def test_properties(comm):
    import torch

    n = torch.cuda.device_count()
    assert comm.size == n and comm.local_size == n and comm.rank == 0
    assert comm.ranks == list(range(n)) and comm.devices == list(range(n))
    assert comm.nccl_version == 10000 * nccl_version()[0] + 100 * nccl_version()[1] + nccl_version()[2]
    assert not comm.aborted and not comm.destroyed and comm.timeout == 120.0
    assert len(comm.streams) == n and all(s != 0 for s in comm.streams)
    assert "NcclComm(size=" in repr(comm)
    # the comm streams have the device's greatest priority (numerically the lowest), like DDP's; torch's
    # own pools stop at a few levels, so the comm stream's is at least as high as torch's highest
    for d, s in zip(comm.devices, comm.streams):
        with torch.cuda.device(d):
            torch_highest = torch.cuda.Stream(priority=-100).priority   # torch clamps to what it has
            got = torch.cuda.ExternalStream(s).priority
            assert got < 0 and got <= torch_highest, (d, got, torch_highest)
    # See Note [Connections inside the bounded init]: blocking collectives make their connections at init
    if comm.collective_mode == "blocking" and nccl_version() >= (2, 22, 0):
        assert "NCCL_RUNTIME_CONNECT" in comm.collective_mode_reason, comm.collective_mode_reason


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_all_reduce_avg_exact_inputs_bit_for_bit(comm, dtype):
    import torch

    skip_unsupported(dtype)
    n, dt = comm.size, tdtype(torch, dtype)
    reduction = comm.reduction(DTYPE_CODE[dtype])
    # A 1/n pre-multiply (ncclAvg, PreMulSum) is only exact for powers of two; SUM + divide always is.
    exact = (n & (n - 1)) == 0 or "divide" in reduction
    for size in SIZES:
        x = exact_rank_inputs(n, size, seed=size)
        ts = [torch.from_numpy(x[r]).to(dt).to(f"cuda:{r}") for r in range(n)]
        all_reduce(torch, comm, ts, tag=f"exact {size}")
        want = torch.from_numpy(x.mean(axis=0)).to(dt)
        for r, t in enumerate(ts):
            torch.cuda.synchronize(r)
            if exact:
                assert np.array_equal(bits(t), bits(want)), f"{dtype} size={size} device {r} ({reduction})"
            else:
                assert_close_to_mean(to_f64(t), x.mean(axis=0), np.abs(x).max(axis=0), n, dtype, reduction)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_all_reduce_avg_random_vs_float64(comm, dtype):
    import torch

    skip_unsupported(dtype)
    n, dt = comm.size, tdtype(torch, dtype)
    for size in SIZES:
        gen = torch.Generator().manual_seed(size)
        host = [(torch.randn(size, generator=gen) * 2).to(dt) for _ in range(n)]
        ts = [h.to(f"cuda:{r}") for r, h in enumerate(host)]
        seq = all_reduce(torch, comm, ts)
        comm.wait(60.0, seq)
        assert comm.done(seq)
        x = np.stack([to_f64(h) for h in host])
        for r, t in enumerate(ts):
            assert_close_to_mean(to_f64(t), x.mean(axis=0), np.abs(x).max(axis=0), n, dtype, f"{dtype} {size}")
            assert np.array_equal(bits(t), bits(ts[0])), "devices disagree"


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_predivide_and_sum(comm, dtype):
    import torch

    skip_unsupported(dtype)
    n, dt = comm.size, tdtype(torch, dtype)
    big = 40000.0 if dtype == "float16" else 1e30  # 40000 + 50000 overflows fp16 without predivide
    host = [torch.full((4097,), big * (1 + 0.25 * (r % 2))).to(dt) for r in range(n)]
    x = np.stack([to_f64(h) for h in host])
    ts = [h.to(f"cuda:{r}") for r, h in enumerate(host)]
    all_reduce(torch, comm, ts, predivide=True)
    for t in ts:
        out = to_f64(t)
        assert np.all(np.isfinite(out)), comm.reduction(DTYPE_CODE[dtype], True)
        assert_close_to_mean(out, x.mean(axis=0), np.abs(x).max(axis=0), n, dtype, "predivide")
    # op="sum" is the plain sum
    y = exact_rank_inputs(n, 1000, seed=5)
    ts = [torch.from_numpy(y[r]).to(dt).to(f"cuda:{r}") for r in range(n)]
    comm.all_reduce_sum(as_buffers(ts), streams_of(torch, n))
    comm.stream_wait(streams_of(torch, n))
    for t in ts:
        assert np.array_equal(bits(t), bits(torch.from_numpy(y.sum(axis=0)).to(dt)))


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_scatter_and_all_gather(comm, dtype, in_place):
    import torch

    skip_unsupported(dtype)
    n, dt = comm.size, tdtype(torch, dtype)
    for shard in (1, 7, 4097):
        x = exact_rank_inputs(n, n * shard, seed=shard)
        full = [torch.from_numpy(x[r]).to(dt).to(f"cuda:{r}") for r in range(n)]
        keep = [f.clone() for f in full]
        if in_place:
            outs = [full[r][comm.ranks[r] * shard:(comm.ranks[r] + 1) * shard] for r in range(n)]
        else:
            outs = [torch.full((shard,), 99.0, dtype=dt, device=f"cuda:{r}") for r in range(n)]
        comm.reduce_scatter_avg(as_buffers(full), as_buffers(outs), streams_of(torch, n))
        comm.wait(60.0)
        mean = x.mean(axis=0)
        for r in range(n):
            k = comm.ranks[r]
            want = mean[k * shard:(k + 1) * shard]
            if (n & (n - 1)) == 0 or "divide" in comm.reduction(DTYPE_CODE[dtype], all_reduce=False):
                assert np.array_equal(bits(outs[r]), bits(torch.from_numpy(want).to(dt))), (dtype, shard, r)
            else:
                assert_close_to_mean(to_f64(outs[r]), want, np.abs(x).max(axis=0)[k * shard:(k + 1) * shard],
                                     n, dtype, "reduce_scatter")
            if not in_place:
                assert torch.equal(full[r], keep[r]), "reduce_scatter modified its input"
        # all_gather is the inverse: every device gets every shard
        gathered = full if in_place else [torch.empty(n * shard, dtype=dt, device=f"cuda:{r}") for r in range(n)]
        comm.all_gather(as_buffers(outs), as_buffers(gathered), streams_of(torch, n))
        comm.wait(60.0)
        cat = torch.cat([outs[comm.ranks.index(k)].cpu() for k in range(n)])
        for g in gathered:
            assert np.array_equal(bits(g), bits(cat))


def test_ordering_after_the_callers_stream_and_before_the_readers(comm):
    import torch

    n = comm.size
    side = [torch.cuda.Stream(device=r) for r in range(n)]
    ts = [torch.zeros(1 << 20, device=f"cuda:{r}") for r in range(n)]
    for r in range(n):
        with torch.cuda.stream(side[r]):
            torch.cuda._sleep(50_000_000)  # a late producer: a missing wait would reduce the zeros
            ts[r].fill_(float(r + 1))
    comm.all_reduce_avg(as_buffers(ts), [int(s.cuda_stream) for s in side])
    comm.stream_wait([int(s.cuda_stream) for s in side])
    # (n + 1) / 2; under a forced reduction (gpu_check.sh's forced step) the sum over its divisor, which
    # on one rank differs from the input, so that a collective that ran before the fill shows
    want = expected_average([r + 1 for r in range(n)], n)
    for r in range(n):
        with torch.cuda.stream(side[r]):
            ok = bool(torch.all(ts[r] == want).item())
        assert ok, f"device {r}: the collective did not wait for the producing stream"


def test_wait_done_pending(comm):
    import torch

    n = comm.size
    ts = [torch.ones(1 << 16, device=f"cuda:{r}") for r in range(n)]
    seqs = [comm.all_reduce_avg(as_buffers(ts), streams_of(torch, n), tag=f"op {i}") for i in range(5)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    comm.wait(60.0, seqs[2])
    assert comm.done(seqs[2])
    comm.wait(60.0)
    assert comm.pending == 0 and all(comm.done(s) for s in seqs)
    empty = [torch.empty(0, device=f"cuda:{r}") for r in range(n)]
    assert comm.all_reduce_avg(as_buffers(empty), streams_of(torch, n)) == 0


def test_bad_input_names_the_argument_and_keeps_the_comm_usable(comm):
    import torch

    n = comm.size
    ts = [torch.full((64,), 3.0, device=f"cuda:{r}") for r in range(n)]
    st = streams_of(torch, n)
    cases = [
        (lambda: comm.all_reduce_avg(as_buffers(ts + ts[:1]), st), ValueError, "buffers"),
        (lambda: comm.all_reduce_avg(as_buffers([t.cpu() for t in ts]), st), ValueError, r"buffers\[0\]"),
        (lambda: comm.all_reduce_avg(as_buffers(ts), st + [0]), ValueError, "after_streams"),
        (lambda: comm.all_reduce_avg(as_buffers(ts), st, timeout_s=0.0), ValueError, "timeout_s"),
        (lambda: comm.all_reduce_avg(as_buffers(ts), st, timeout_s=-1.0), ValueError, "timeout_s"),
        (lambda: comm.wait(0.0), ValueError, "timeout_s"),
        (lambda: comm.wait(5.0, 10 ** 9), ValueError, "seq"),
        (lambda: comm.stream_wait([]), ValueError, "streams"),
        (lambda: comm.reduce_scatter_avg(as_buffers(ts), as_buffers([t[:5] for t in ts]), st), ValueError, "inputs"),
        (lambda: comm.all_gather(as_buffers(ts), as_buffers([t[:10] for t in ts]), st), ValueError, "outputs"),
        (lambda: comm.reduction(7), TypeError, "dtype"),
    ]
    if n > 1:
        cases += [
            (lambda: comm.all_reduce_avg(as_buffers([ts[0]] + [t.half() for t in ts[1:]]), st), TypeError,
             r"buffers\[1\]"),
            (lambda: comm.all_reduce_avg(as_buffers([ts[0]] + [t[:10] for t in ts[1:]]), st), ValueError,
             r"buffers\[1\]"),
            (lambda: comm.all_reduce_avg(as_buffers(list(reversed(ts))), st), ValueError, r"buffers\[0\]"),
        ]
    for call, exc, name in cases:
        with pytest.raises(exc, match=name):
            call()
    torch.cuda.synchronize()
    assert all(torch.all(t == 3.0) for t in ts), "a rejected call modified a buffer"
    assert not comm.aborted
    all_reduce(torch, comm, ts)
    assert all(torch.all(t == 3.0) for t in ts)


def test_abort_then_every_call_says_so():
    NcclComm = require_nccl_comm()
    import torch

    n = torch.cuda.device_count()
    c = NcclComm.init_all(list(range(n)), 60.0)
    ts = [torch.ones(8, device=f"cuda:{r}") for r in range(n)]
    c.all_reduce_avg(as_buffers(ts), streams_of(torch, n))
    c.abort()
    assert c.aborted and "abort() was called" in c.abort_reason
    for call in (lambda: c.all_reduce_avg(as_buffers(ts), streams_of(torch, n)), lambda: c.wait(1.0),
                 lambda: c.done(), lambda: c.stream_wait(streams_of(torch, n))):
        with pytest.raises(NcclError, match="communicator was aborted after abort"):
            call()
    c.abort()
    c.destroy()  # both idempotent
    assert c.aborted


def test_destroy_and_context_manager():
    NcclComm = require_nccl_comm()
    import torch

    n = torch.cuda.device_count()
    with NcclComm.init_all(list(range(n)), 60.0) as c:
        ts = [torch.ones(8, device=f"cuda:{r}") for r in range(n)]
        c.all_reduce_avg(as_buffers(ts), streams_of(torch, n))
    assert c.destroyed and not c.aborted
    with pytest.raises(NcclError, match="destroyed"):
        c.all_reduce_avg(as_buffers(ts), streams_of(torch, n))
    c.destroy()
    # dropping a communicator with work in flight neither hangs nor crashes
    c2 = NcclComm.init_all(list(range(n)), 60.0)
    c2.all_reduce_avg(as_buffers(ts), streams_of(torch, n))
    del c2


def test_collective_mode_follows_the_nccl_version(comm):
    # See Note [Blocking collectives after a bounded init] in csrc/cuda/comm_init.cpp.
    import os

    if os.environ.get("NCCLAVG_NCCL_COLLECTIVES") == "nonblocking":
        want = "nonblocking"
    elif nccl_version() >= (2, 18, 0) or nccl_version() < (2, 14, 0):
        want = "blocking"
    else:
        want = "nonblocking"
    assert comm.collective_mode == want, comm.collective_mode_reason
    assert comm.collective_mode_reason
    assert f"{want} collectives" in repr(comm)


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_both_collective_modes_reduce_exactly(mode, monkeypatch):
    NcclComm = require_nccl_comm()
    import torch

    if nccl_version() < (2, 18, 0):
        pytest.skip(f"both modes need ncclCommSplit (NCCL >= 2.18), loaded {nccl_version()}")
    monkeypatch.setenv("NCCLAVG_NCCL_COLLECTIVES", mode)
    n = torch.cuda.device_count()
    with NcclComm.init_all(list(range(n)), 60.0) as c:
        assert c.collective_mode == mode, c.collective_mode_reason
        for size in (1, 4097):
            x = exact_rank_inputs(n, size, seed=size + 1)
            ts = [torch.from_numpy(x[r]).float().to(f"cuda:{r}") for r in range(n)]
            seq = all_reduce(torch, c, ts, tag=f"{mode} {size}")
            c.wait(60.0, seq)
            want = torch.from_numpy(x.mean(axis=0)).float()
            for t in ts:
                assert np.array_equal(bits(t), bits(want)), (mode, size)
        # the reduce-scatter with predivide takes the PreMulSum path (or ncclAvg) on either mode
        full = [torch.full((4 * n,), 2.0, device=f"cuda:{r}") for r in range(n)]
        part = [torch.empty(4, device=f"cuda:{r}") for r in range(n)]
        c.reduce_scatter_avg(as_buffers(full), as_buffers(part), streams_of(torch, n), predivide=True)
        c.wait(60.0)
        assert all(torch.all(p == 2.0) for p in part)


def test_bad_collective_mode_names_the_variable(monkeypatch):
    NcclComm = require_nccl_comm()
    monkeypatch.setenv("NCCLAVG_NCCL_COLLECTIVES", "sometimes")
    with pytest.raises(ValueError, match="NCCLAVG_NCCL_COLLECTIVES"):
        NcclComm.init_all([0], 10.0)


def test_init_arguments(monkeypatch):
    NcclComm = require_nccl_comm()
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    import torch

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=r"devices\[0\]"):
        NcclComm.init_all([n], 10.0)
    with pytest.raises(ValueError, match=r"devices\[1\].*NCCL_MULTI_RANK_GPU_ENABLE"):
        NcclComm.init_all([0, 0], 10.0)   # a second rank on one GPU, without NCCL_MULTI_RANK_GPU_ENABLE
    with pytest.raises(ValueError, match="device"):
        NcclComm.init_rank(bytes(128), 1, 0, n, 10.0)
    assert issubclass(CommTimeoutError, TimeoutError)
