"""The NaN-aware bit-for-bit comparer of the GPU tests (tests/_bits.py), on the CPU: it must catch one
flipped bit and a NaN on one side only, and accept NaNs whose payloads differ (the GPU returns the
canonical NaN, the CPU keeps the input's payload)."""
from __future__ import annotations

import numpy as np
import pytest

from _bits import assert_same_bits, bits_mismatch, nan_mask, raw_bits

# (format, the CPU path's NaN for a quiet-NaN input, CUDA's canonical NaN, a negative quiet NaN, 1.0)
CASES = [
    ("float32", 0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0x3F800000),
    ("float16", 0x7E00, 0x7FFF, 0xFE00, 0x3C00),
    ("bfloat16", 0x7FC0, 0x7FFF, 0xFFC0, 0x3F80),
]


def words(fmt, values):
    return np.array(values, dtype=np.uint32 if fmt == "float32" else np.uint16)


@pytest.mark.parametrize("fmt,cpu_nan,gpu_nan,neg_nan,one", CASES)
def test_differing_nan_payloads_are_equal(fmt, cpu_nan, gpu_nan, neg_nan, one):
    got = words(fmt, [one, gpu_nan, 0, gpu_nan])
    want = words(fmt, [one, cpu_nan, 0, neg_nan])
    assert bits_mismatch(got, want, fmt) is None
    assert_same_bits(got, want, "payloads", fmt)


@pytest.mark.parametrize("fmt,cpu_nan,gpu_nan,neg_nan,one", CASES)
def test_one_flipped_bit_is_caught(fmt, cpu_nan, gpu_nan, neg_nan, one):
    want = words(fmt, [one, cpu_nan, one, 0])
    for bit in range(16 if fmt != "float32" else 32):
        got = want.copy()
        got[2] ^= want.dtype.type(1 << bit)
        why = bits_mismatch(got, want, fmt)
        assert why is not None and "first at 2" in why, (bit, why)
    with pytest.raises(AssertionError, match="first at 2"):
        got = want.copy()
        got[2] ^= want.dtype.type(1)
        assert_same_bits(got, want, "flip", fmt)


@pytest.mark.parametrize("fmt,cpu_nan,gpu_nan,neg_nan,one", CASES)
def test_nan_on_one_side_only_is_caught(fmt, cpu_nan, gpu_nan, neg_nan, one):
    inf = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[fmt]
    for other in (one, 0, inf):  # a NaN must not match a number, zero or infinity
        why = bits_mismatch(words(fmt, [one, gpu_nan]), words(fmt, [one, other]), fmt)
        assert why is not None and "NaN on one side only" in why, (hex(other), why)
        why = bits_mismatch(words(fmt, [one, other]), words(fmt, [one, cpu_nan]), fmt)
        assert why is not None and "NaN on one side only" in why, (hex(other), why)


def test_signed_zero_infinity_and_subnormal_are_bits():
    pos, neg = np.array([0.0, np.inf, 1e-40], np.float32), np.array([-0.0, np.inf, 1e-40], np.float32)
    assert bits_mismatch(pos, neg) is not None          # +0 vs -0 differ in a bit
    assert bits_mismatch(pos, pos.copy()) is None
    assert nan_mask(raw_bits(np.array([np.inf, -np.inf, np.nan], np.float32))[0], "float32").tolist() == \
        [False, False, True]


def test_sizes_and_formats_must_match():
    assert "sizes differ" in bits_mismatch(np.zeros(3, np.float32), np.zeros(4, np.float32))
    assert "formats differ" in bits_mismatch(np.zeros(3, np.float32), np.zeros(3, np.float16))
    with pytest.raises(TypeError, match="x"):
        raw_bits(np.zeros(3, np.float64))


def test_torch_tensors_of_every_dtype():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.tensor([1.0, float("nan"), -0.0, float("inf")], dtype=dtype)
        b = a.clone()
        # a NaN with another payload: flip the lowest mantissa bit of the NaN
        view = torch.int32 if dtype == torch.float32 else torch.int16
        b.view(view)[1] ^= 1
        assert not torch.equal(a.view(view), b.view(view))
        assert_same_bits(a, b, str(dtype))
        b[2] = 0.0   # -0.0 -> +0.0: one bit
        assert "first at 2" in bits_mismatch(a, b)
