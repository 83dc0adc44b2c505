"""ops.average_: one-pass in-place mean of N buffers, against a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ncclavg
from ncclavg import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 15, 17, 4097, 1_000_003]


def _reference(xs):
    """The float64 mean, rounded once to fp32 and then once to the storage type."""
    mean64 = torch.stack([x.double() for x in xs]).mean(0)
    return mean64, mean64.float().to(xs[0].dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("size", SIZES)
def test_random_inputs_match_float64_mean(simd_level, dtype, n, size):
    gen = torch.Generator().manual_seed(size * 31 + n)
    xs = [torch.randn(size, generator=gen).mul_(3).to(dtype) for _ in range(n)]
    mean64, expected = _reference(xs)
    # fp32 accumulation of <= 8 terms: error bounded relative to the magnitude of the terms.
    scale = torch.stack([x.double().abs() for x in xs]).mean(0) if size else torch.zeros(0)
    ncclavg.ops.average_(xs)
    for x in xs[1:]:
        assert torch.equal(x, xs[0]), "every buffer must hold the same mean"
    out = xs[0].double()
    if dtype == torch.float32:
        assert ((out - mean64).abs() <= 1e-6 * scale).all()
    else:
        # Within one rounding of the fp32 mean: equal to it, or one ulp of the half type away.
        ulp = (expected.double().abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(1e-7)
        assert ((out - expected.double()).abs() <= ulp).all()


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
    for dtype in (np.float32, np.float16):
        xs = [rng.standard_normal(4097).astype(dtype) for _ in range(3)]
        ref = np.mean(np.stack([x.astype(np.float64) for x in xs]), axis=0).astype(np.float32).astype(dtype)
        ncclavg.ops.average_(xs)
        for x in xs:
            np.testing.assert_allclose(x, ref, rtol=2 ** -23 if dtype == np.float32 else 2 ** -10,
                                       atol=1e-6)


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
