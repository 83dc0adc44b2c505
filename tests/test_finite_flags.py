"""The finiteness that the host passes note while they write (Note [Finiteness from the pass that writes] in
csrc/common/finite_math.h): ops.average_, pack_ and unpack_ with check_finite=True, at every SIMD level,
against a float64 model of what they write.

The model: each kernel adds in float32 (sources in order), divides or scales in float32, and rounds once to
the storage type. A float64 sum of two float32 values is exact, so rounding it to float32 IS the float32
add; a float64 quotient or product of two float32 values rounded to float32 is the correctly rounded float32
one (53 >= 2 * 24 + 2 bits: the double rounding is innocuous). So the model gives the written values bit
for bit (NaN payloads aside), and the flag must be exactly `not all(isfinite(model))`.
"""
from __future__ import annotations

import pytest
import torch

import ncclavg
from ncclavg import _C

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# not multiples of any vector width (1, 8, 16 lanes; two vectors per iteration in the pack loop), and one
# above the parallel threshold (65536 elements), so two threads each check a part
SIZES = [1, 7, 15, 17, 33, 4097, 70_001]
PLANTS = [float("nan"), float("inf"), float("-inf")]


def f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the float64 value of its float32 rounding (round to nearest even)."""
    return x.to(torch.float32).to(torch.float64)


def model_mean(xs: list, dtype: torch.dtype) -> torch.Tensor:
    acc = xs[0].double()
    for x in xs[1:]:
        acc = f32(acc + x.double())
    return f32(acc / len(xs)).to(dtype)


def model_scale(x: torch.Tensor, mul: float, div: float, dtype: torch.dtype) -> torch.Tensor:
    y = x.double()
    if mul != 1.0:
        y = f32(y * mul)
    if div != 1.0:
        y = f32(y / div)
    return y.to(dtype)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN matches any NaN (a quieted NaN is still a NaN)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].double(), b[~nan].double()) and torch.equal(torch.signbit(a[~nan]),
                                                                         torch.signbit(b[~nan]))


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def towers(n: int, size: int, dtype: torch.dtype, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen).mul_(3).to(dtype) for _ in range(n)]


def large(dtype: torch.dtype) -> float:
    """A finite value whose double overflows the float32 accumulator (float32, bfloat16); float16's
    largest (its mean with itself stays finite: the float32 sum does not overflow)."""
    return {torch.float32: 3e38, torch.bfloat16: 3.0e38, torch.float16: 65504.0}[dtype]


# ---- ops.average_

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_average_finite_inputs(simd_level, dtype, size):
    xs = towers(3, size, dtype, size)
    want = model_mean(xs, dtype)
    assert ncclavg.ops.average_(xs, check_finite=True) is True
    assert all(same_values(x, want) for x in xs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("plant", PLANTS)
def test_average_flags_a_planted_value_in_any_tower_at_any_place(simd_level, dtype, size, plant):
    for tower in range(3):
        for where in sorted({0, size // 2, size - 1}):
            xs = towers(3, size, dtype, size + tower)
            xs[tower][where] = plant
            want = model_mean(xs, dtype)
            assert not all_finite(want)
            assert ncclavg.ops.average_(xs, check_finite=True) is False, (tower, where)
            assert same_values(xs[0], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 17, 70_001])
def test_average_flags_an_overflow_of_finite_inputs(simd_level, dtype, size):
    """Two large finite values: the float32 sum overflows (float32, bfloat16) and the written mean is inf
    although no input is; float16's largest values average to a finite mean, and the flag says so."""
    for where in sorted({0, size - 1}):
        xs = towers(2, size, dtype, size)
        for x in xs:
            x[where] = large(dtype)
        want = model_mean(xs, dtype)
        assert all(all_finite(x) for x in xs)
        got = ncclavg.ops.average_(xs, check_finite=True)
        assert got is all_finite(want), (where, want[where])
        assert got is (dtype == torch.float16)
        assert same_values(xs[0], want)


def test_average_of_one_buffer_writes_nothing_and_says_nothing():
    x = torch.tensor([1.0, float("nan")])
    assert ncclavg.ops.average_([x], check_finite=True) is None
    assert ncclavg.ops.average_([x, x.clone()]) is None   # not asked


# ---- ops.unpack_ / ops.pack_ (casts, scales, plain copies)

def narrowing_cases(dtype: torch.dtype) -> list:
    """float32 values around `dtype`'s overflow limit (see the Note): the first rounds to the largest
    finite value, the second to inf."""
    if dtype == torch.float16:
        return [65519.99609375, 65520.0]
    if dtype == torch.bfloat16:
        limit = torch.tensor([0x7F7F8000], dtype=torch.int32).view(torch.float32).item()
        below = torch.tensor([0x7F7F7FFF], dtype=torch.int32).view(torch.float32).item()
        return [below, limit]
    return []


@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("scale", [(1.0, 1.0), (1.0, 3.0), (0.5, 1.0), (2.0, 3.0)])
def test_unpack_flags_what_it_writes(simd_level, dst, size, scale):
    mul, div = scale
    gen = torch.Generator().manual_seed(size)
    bucket = torch.randn(size + 5, generator=gen) * 100
    cases = [(None, None)] + [(v, w) for v in PLANTS + narrowing_cases(dst) for w in sorted({0, size - 1})]
    for value, where in cases:
        b = bucket.clone()
        if value is not None:
            b[3 + where] = value
        out = torch.empty(size, dtype=dst)
        got = ncclavg.ops.unpack_(b, [out], [3], scale=mul, divisor=div, check_finite=True)
        want = model_scale(b[3:3 + size], mul, div, dst)
        assert same_values(out, want), (value, where)
        assert got is all_finite(want), (value, where, got)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_pack_flags_a_scale_that_overflows(simd_level, src, size):
    """1e38 * 4 overflows float32: every value finite in the tensors, the bucket gets an inf."""
    gen = torch.Generator().manual_seed(size)
    parts = [torch.randn(size, generator=gen).to(src), torch.randn(3, generator=gen).to(src)]
    bucket = torch.zeros(size + 3)
    assert ncclavg.ops.pack_(parts, bucket, [0, size], scale=4.0, check_finite=True) is True
    if src != torch.float16:
        parts[0][size - 1] = 1e38
        got = ncclavg.ops.pack_(parts, bucket, [0, size], scale=4.0, check_finite=True)
        want = model_scale(parts[0], 4.0, 1.0, torch.float32)
        assert got is False and same_values(bucket[:size], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_checked_plain_copy_keeps_every_bit(simd_level, dtype, size):
    """Same dtype, no scale: the checked copy must write what memcpy writes (a signalling NaN stays one,
    payloads stay) and flag an inf/NaN pattern anywhere."""
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    gen = torch.Generator().manual_seed(size)
    src = torch.randn(size, generator=gen).to(dtype)
    snan = {torch.float32: 0x7F800001, torch.bfloat16: 0x7F81, torch.float16: 0x7C01}[dtype]
    sign = 1 << (8 * s_bytes(dtype) - 1)
    for value in (None, snan, snan - sign, "inf"):   # snan - sign: the same pattern with the sign bit set
        s = src.clone()
        if value == "inf":
            s[size - 1] = float("-inf")
        elif value is not None:
            s.view(bits)[size // 2] = value
        out = torch.empty_like(s)
        got = ncclavg.ops.unpack_(s, [out], [0], check_finite=True)
        assert torch.equal(out.view(bits), s.view(bits)), value
        assert got is all_finite(s), value


def s_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def test_not_asked_returns_none():
    b = torch.ones(4)
    out = torch.empty(4, dtype=torch.bfloat16)
    assert ncclavg.ops.unpack_(b, [out], [0]) is None
    assert ncclavg.ops.pack_([out], b, [0]) is None


def test_levels_agree_on_the_flag():
    """The same inputs give the same flag and bits at every level (the scalar one is the reference)."""
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        src = [torch.randn(10_007, generator=gen).to(dtype) for _ in range(3)]
        src[1][10_006] = float("inf")
        src[2][10_006] = float("-inf")
        seen = {}
        for level in _C.simd_levels_supported():
            _C.set_simd_level(level)
            xs = [s.clone() for s in src]
            seen[level] = (ncclavg.ops.average_(xs, check_finite=True), xs[0])
        _C.set_simd_level("auto")
        for level, (flag, x) in seen.items():
            assert flag is False and same_values(x, seen["scalar"][1]), level
