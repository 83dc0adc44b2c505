"""NCCL's real arithmetic on a one-rank communicator (Note [Forcing the reduction in tests] in
csrc/cuda/comm_collectives.cpp): NCCLAVG_TEST_REDUCTION makes an average use ncclAvg, PreMulSum(1/d) or
SUM + divide by d whatever the size, so one GPU runs NCCL's one-rank kernels and the divide kernel, with
results predicted bit for bit; and the divide kernel through its own binding. The switch's parser is
checked on the CPU too."""
from __future__ import annotations

import numpy as np
import pytest

import ncclavg
from _gpu import DTYPE_CODE, TORCH_DTYPES, bits, nccl_version, require_cuda, require_nccl_comm, tdtype
from ncclavg.buffers import as_buffer, as_buffers

SIZES = [1, 7, 4097, 1_000_003]


def _cpu_expected(torch, x, kind, divisor):
    """What one rank's "average" is under the forced reduction, computed on the CPU."""
    if kind == "avg":
        return x.clone()   # the mean of one rank
    if kind == "premulsum":   # NCCL multiplies by the scalar rounded to the element type: one rounding
        s = torch.tensor(1.0 / divisor, dtype=torch.float64).to(x.dtype).float()
        return (x.float() * s).to(x.dtype)   # the product of two such values is exact in fp32
    return (x.float() / divisor).to(x.dtype)   # the divide kernel: fp32 division, one rounding


@pytest.mark.skipif(not ncclavg.cuda_built(), reason="the switch's parser is part of the CUDA build")
@pytest.mark.parametrize("value,want", [("avg", ("avg", 0)), ("premulsum:3", ("premulsum", 3)),
                                        ("sum_divide:7", ("sum_divide", 7)), ("sum_divide", ("sum_divide", 0))])
def test_the_switch_parses(value, want):
    from ncclavg import _C

    assert tuple(_C.nccl_parse_test_reduction(value)) == want


@pytest.mark.skipif(not ncclavg.cuda_built(), reason="the switch's parser is part of the CUDA build")
@pytest.mark.parametrize("value", ["", "mean", "avg:", "premulsum:0", "premulsum:-3", "sum_divide:3.5",
                                   "sum_divide:2000000", "premulsum:3:4"])
def test_a_bad_switch_names_the_variable(value):
    from ncclavg import _C

    with pytest.raises(ValueError, match="NCCLAVG_TEST_REDUCTION"):
        _C.nccl_parse_test_reduction(value)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["avg", "premulsum:3", "premulsum:1", "sum_divide:3", "sum_divide:7"])
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_one_rank_runs_nccls_arithmetic(value, dtype, monkeypatch):
    NcclComm = require_nccl_comm()
    import torch

    kind, _, d = value.partition(":")
    divisor = int(d) if d else 1
    if kind == "avg" and nccl_version() < (2, 10, 0) or kind == "premulsum" and nccl_version() < (2, 11, 0):
        pytest.skip(f"{kind} needs a newer NCCL than {nccl_version()}")
    monkeypatch.setenv("NCCLAVG_TEST_REDUCTION", value)
    dt = tdtype(torch, dtype)
    with NcclComm.init_all([0], 60.0) as c:
        name = c.reduction(DTYPE_CODE[dtype], False, "avg", True)
        assert name == {"avg": "ncclAvg", "premulsum": f"PreMulSum(1/{divisor})",
                        "sum_divide": f"ncclSum + divide by {divisor}"}[kind], name
        stream = [int(torch.cuda.current_stream(0).cuda_stream)]
        gen = torch.Generator().manual_seed(divisor)
        for size in SIZES:
            x = (torch.randn(size, generator=gen) * 4).to(dt)
            t = x.to("cuda:0")
            seq = c.all_reduce_avg(as_buffers([t]), stream, tag=f"{value} {size}")
            c.stream_wait(stream, seq)
            c.wait(60.0, seq)
            want = _cpu_expected(torch, x, kind, divisor)
            assert np.array_equal(bits(t.cpu()), bits(want)), (value, dtype, size)
            # the reduce-scatter of one rank: the whole input is the output
            out = torch.empty_like(t)
            src = x.to("cuda:0")   # named: a Buffer holds only its pointer, NCCL reads it on its own stream
            seq = c.reduce_scatter_avg(as_buffers([src]), as_buffers([out]), stream)
            c.stream_wait(stream, seq)
            c.wait(60.0, seq)
            assert np.array_equal(bits(out.cpu()), bits(want)), ("reduce_scatter", value, dtype, size)


@pytest.mark.gpu
def test_avg_with_another_divisor_is_refused(monkeypatch):
    NcclComm = require_nccl_comm()
    monkeypatch.setenv("NCCLAVG_TEST_REDUCTION", "avg:3")
    with pytest.raises(ValueError, match="NCCLAVG_TEST_REDUCTION.*avg divides by the number of ranks"):
        NcclComm.init_all([0], 10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("divisor", [3.0, 7.0, 0.5])
def test_divide_kernel_through_its_binding(dtype, divisor):
    """Every misalignment of the 16-byte path (element offsets 0..7), sizes around the vector width."""
    torch = require_cuda()
    from ncclavg import _C

    dt = tdtype(torch, dtype)
    gen = torch.Generator().manual_seed(11)
    for offset in range(8):
        for size in (0, 1, 7, 8, 9, 31, 33, 4097, 100_003):
            base = (torch.randn(offset + size, generator=gen) * 8).to(dt)
            x = base[offset:]
            dev = base.to("cuda:0")[offset:]
            _C.divide_(as_buffer(dev), divisor, int(torch.cuda.current_stream(0).cuda_stream))
            torch.cuda.synchronize()
            want = (x.float() / divisor).to(dt)
            assert np.array_equal(bits(dev.cpu()), bits(want)), (dtype, divisor, offset, size)
    with pytest.raises(ValueError, match="divisor"):
        _C.divide_(as_buffer(torch.ones(4, device="cuda:0")), 0.0, 0)
    with pytest.raises(ValueError, match="device buffer"):
        _C.divide_(as_buffer(torch.ones(4)), 2.0, 0)
