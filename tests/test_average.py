"""ops.average_: one-pass in-place mean of N buffers, against a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ncclavg
from ncclavg import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 15, 17, 4097, 1_000_003]


UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HALF_SUBNORMAL = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}  # half the spacing below the normals


def mean_error_bound(mean64, scale, n, dtype):
    """Bound on |average_ - float64 mean| per element (scale: mean |x_i|). The core adds the n values in
    float32 (n - 1 roundings: <= gamma_{n-1} * sum|x_i|, Higham ch. 3) and divides once (u * |mean|):
    within gamma_n * scale, u = 2^-24, gamma_n = n*u / (1 - n*u). A float16/bfloat16 result is then
    rounded to its type: its unit roundoff times that value, or half a subnormal spacing where it underflows.
    A wrong divisor or a dropped buffer is off by ~|mean|, ~scale."""
    u = UNIT_ROUNDOFF[torch.float32]
    err32 = n * u / (1 - n * u) * scale
    if dtype == torch.float32:
        return err32
    return err32 + UNIT_ROUNDOFF[dtype] * (mean64.abs() + err32) + HALF_SUBNORMAL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("size", SIZES)
def test_random_inputs_match_float64_mean(simd_level, dtype, n, size):
    gen = torch.Generator().manual_seed(size * 31 + n)
    xs = [torch.randn(size, generator=gen).mul_(3).to(dtype) for _ in range(n)]
    mean64 = torch.stack([x.double() for x in xs]).mean(0)
    # relative to the magnitude of the terms: an elementwise ratio is meaningless where the mean cancels
    scale = torch.stack([x.double().abs() for x in xs]).mean(0) if size else torch.zeros(0, dtype=torch.float64)
    ncclavg.ops.average_(xs)
    for x in xs[1:]:
        assert torch.equal(x, xs[0]), "every buffer must hold the same mean"
    assert bool(((xs[0].double() - mean64).abs() <= mean_error_bound(mean64, scale, n, dtype)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_exact_inputs_bit_for_bit(simd_level, dtype, n):
    # Small integers times a power of two, sum divisible by n: inputs and mean are exact in every
    # dtype (|values| < 256 fit bfloat16's 8-bit significand).
    size = 4097
    gen = torch.Generator().manual_seed(n)
    base = torch.randint(-16, 16, (n, size), generator=gen).double()
    base[-1] = -base[:-1].sum(0) + n * torch.randint(-8, 8, (size,), generator=gen).double()
    xs = [(row * 0.25).to(dtype) for row in base]
    expected = (base.sum(0) / n * 0.25).to(dtype)
    ncclavg.ops.average_(xs)
    for x in xs:
        assert torch.equal(x, expected)


def test_levels_agree_bitwise_with_scalar():
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        src = [torch.randn(10_007, generator=gen).to(dtype) for _ in range(3)]
        results = {}
        for level in _C.simd_levels_supported():
            _C.set_simd_level(level)
            xs = [s.clone() for s in src]
            ncclavg.ops.average_(xs)
            results[level] = xs[0]
        _C.set_simd_level("auto")
        for level, r in results.items():
            assert torch.equal(r.view(torch.int16) if dtype != torch.float32 else r.view(torch.int32),
                               results["scalar"].view(r.view(torch.int16).dtype if dtype != torch.float32
                                                      else torch.int32)), level


def test_nan_and_inf_propagate(simd_level):
    for dtype in DTYPES:
        a = torch.tensor([1.0, float("nan"), float("inf"), 2.0] * 5, dtype=dtype)
        b = torch.tensor([1.0, 0.0, 1.0, float("-inf")] * 5, dtype=dtype)
        ncclavg.ops.average_([a, b])
        assert torch.isnan(a[1::4]).all() and torch.isinf(a[2::4]).all() and torch.isinf(a[3::4]).all()


def test_numpy_inputs():
    rng = np.random.default_rng(0)
    for dtype, tdtype in ((np.float32, torch.float32), (np.float16, torch.float16)):
        xs = [rng.standard_normal(4097).astype(dtype) for _ in range(3)]
        stack = torch.from_numpy(np.stack([x.astype(np.float64) for x in xs]))
        mean64, scale = stack.mean(0), stack.abs().mean(0)
        ncclavg.ops.average_(xs)
        for x in xs:
            got = torch.from_numpy(x.astype(np.float64))
            assert bool(((got - mean64).abs() <= mean_error_bound(mean64, scale, 3, tdtype)).all())


def test_views_into_one_storage_are_fine_when_disjoint():
    flat = torch.arange(30, dtype=torch.float32)
    a, b, c = flat[0:10], flat[10:20], flat[20:30]
    ncclavg.ops.average_([a, b, c])
    assert torch.equal(a, torch.arange(10, 20, dtype=torch.float32))
    assert torch.equal(flat[20:30], a)


def test_parallel_path_large_buffer():
    # Large enough for the OpenMP split; checks slice boundaries are all covered.
    n = 3 * (1 << 16) + 13
    xs = [torch.full((n,), float(i)) for i in range(4)]
    ncclavg.ops.average_(xs)
    assert torch.equal(xs[2], torch.full((n,), 1.5))
