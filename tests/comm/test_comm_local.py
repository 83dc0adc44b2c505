import threading
import time

import pytest
import torch

import ncclavg
from ncclavg import CommError, CommTimeoutError
from ncclavg.comm import Communicator, default_timeout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U = 2.0 ** -24  # float32 unit roundoff
SIZES = [0, 1, 7, 17, 4097, 70001]


def fp32_mean(xs, dtype):
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return (acc / len(xs)).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_avg_matches_float64_mean(n, dtype):
    comm = Communicator.local(n)
    assert (comm.backend, comm.size, comm.local_size, comm.rank, comm.world_size) == ("local", n, n, 0, 1)
    gen = torch.Generator().manual_seed(n * 7 + DTYPES.index(dtype))
    for numel in SIZES:
        xs = [(torch.randn(numel, generator=gen) * 10).to(dtype) for _ in range(n)]
        truth = torch.stack([x.double() for x in xs]).mean(0)
        # relative to the summands' magnitude: an elementwise ratio is meaningless where the mean cancels
        scale = torch.stack([x.double().abs() for x in xs]).mean(0)
        expect = fp32_mean(xs, dtype)
        comm.all_reduce_avg(xs)
        for x in xs:
            assert torch.equal(x, expect)
            if dtype == torch.float32:
                # n - 1 float32 additions (<= gamma_{n-1} * sum|x_i|, Higham ch. 3) and one division (u * |mean|):
                # together <= gamma_n * mean|x_i|, u = 2^-24, gamma_k = k*u / (1 - k*u).
                assert bool(((x.double() - truth).abs() <= n * U / (1 - n * U) * scale).all())
    comm.close()


def test_exact_inputs_bit_for_bit_async():
    comm = Communicator.local(4)
    base = torch.arange(-500, 500, dtype=torch.float32) * 0.25
    xs = [base * (k + 1) for k in range(4)]   # mean = base * 2.5: exact
    work = comm.all_reduce_avg_async(xs)
    work.wait()
    assert work.done() and work.elapsed is not None and work.divisor == 1.0
    for x in xs:
        assert torch.equal(x, base * 2.5)
    comm.close()


def test_wait_times_out_then_completes():
    comm = Communicator.local(2, timeout=5)
    gate = threading.Event()
    comm._submit(lambda: gate.wait(10))      # occupy the worker thread
    xs = [torch.ones(10), torch.full((10,), 3.0)]
    work = comm.all_reduce_avg_async(xs)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="did not complete within 0.05"):
        work.wait(timeout=0.05)
    assert time.monotonic() - t0 < 4
    assert not work.done()
    gate.set()
    work.wait()   # the job itself still runs to completion ...
    assert torch.equal(xs[0], torch.full((10,), 2.0))
    # ... but the communicator refuses every later call, naming the timeout
    for call in (lambda: comm.all_reduce_avg(xs), lambda: comm.all_reduce_avg_async(xs),
                 lambda: comm.allgather_object(1)):
        with pytest.raises(CommError, match="unusable: local all_reduce_avg of 40 bytes .* did not complete"):
            call()
    assert "did not complete within 0.05 s" in comm.failure
    comm.close()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_and_all_gather(n, dtype):
    comm = Communicator.local(n)
    gen = torch.Generator().manual_seed(3)
    shard = 37
    inputs = [torch.randn(shard * n, generator=gen).to(dtype) for _ in range(n)]
    saved = [x.clone() for x in inputs]
    outputs = [torch.empty(shard, dtype=dtype) for _ in range(n)]
    comm.reduce_scatter_avg(inputs, outputs)
    full = fp32_mean(inputs, dtype)
    for t in range(n):
        assert torch.equal(outputs[t], full[t * shard:(t + 1) * shard])
        assert torch.equal(inputs[t], saved[t])      # inputs untouched
    gathered = [torch.empty(shard * n, dtype=dtype) for _ in range(n)]
    comm.all_gather(outputs, gathered)
    for g in gathered:
        assert torch.equal(g, full)
    assert comm.allgather_object({"a": 1}) == [{"a": 1}]


def test_bad_input_names_argument_and_changes_nothing():
    comm = Communicator.local(2)
    a, b = torch.ones(8), torch.full((8,), 3.0)
    cases = [
        (lambda: comm.all_reduce_avg([a]), ValueError, "local_size 2"),
        (lambda: comm.all_reduce_avg([a, b, a.clone()]), ValueError, "local_size 2"),
        (lambda: comm.all_reduce_avg([a, a]), ValueError, "share memory"),
        (lambda: comm.all_reduce_avg([a, a[2:]]), ValueError, r"tensors\[1\]"),
        (lambda: comm.all_reduce_avg([a, b.to(torch.float16)]), TypeError, r"tensors\[1\]"),
        (lambda: comm.all_reduce_avg([a, b.double()]), TypeError, r"tensors\[1\]"),
        (lambda: comm.all_reduce_avg([a, b.numpy()]), TypeError, r"tensors\[1\]"),
        (lambda: comm.all_reduce_avg(a), TypeError, "tensors"),
        (lambda: comm.all_reduce_avg([a.view(2, 4).t(), b.view(2, 4).t()]), ValueError, r"tensors\[0\]"),
        (lambda: comm.all_reduce_avg([a.to("meta"), b]), ValueError, r"tensors\[0\]"),
        (lambda: comm.reduce_scatter_avg([torch.ones(7), torch.ones(7)], [torch.ones(3), torch.ones(3)]),
         ValueError, "divisible"),
        (lambda: comm.reduce_scatter_avg([a, b], [torch.ones(3), torch.ones(3)]), ValueError, "outputs"),
        (lambda: comm.all_gather([a, b], [torch.ones(8), torch.ones(16)]), ValueError, r"outputs\[0\]"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
        assert torch.equal(a, torch.ones(8)) and torch.equal(b, torch.full((8,), 3.0))
    for bad_n, exc in [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="n"):
            Communicator.local(bad_n)
    with pytest.raises(ValueError, match="timeout"):
        Communicator.local(2, timeout=0)
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce_avg([a, b])
    with pytest.raises(TypeError, match="Communicator.local"):
        Communicator()


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("NCCLAVG_TIMEOUT", "12.5")
    assert default_timeout() == 12.5 and Communicator.local(1).timeout == 12.5
    monkeypatch.setenv("NCCLAVG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NCCLAVG_TIMEOUT"):
        Communicator.local(1)
    monkeypatch.delenv("NCCLAVG_TIMEOUT")
    assert default_timeout() == 600


@pytest.mark.skipif(ncclavg.cuda_built(), reason="checks the message of a CPU-only build")
def test_nccl_backend_on_cpu_build_says_what_to_install():
    with pytest.raises(RuntimeError, match=r"NCCLAVG_CUDA=1.*nvidia-nccl"):
        Communicator.nccl([0])
