import numpy as np
import pytest
import torch

from ncclavg import ops
from ncclavg._ext import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LEVELS = list(_C.simd_levels_supported())
SIZES = [0, 1, 7, 15, 17, 33, 4097, 70001]  # 70001: above the OpenMP threshold, odd tail
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SUBNORMAL_SPACING = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}


@pytest.fixture
def simd_level(request):
    _C.set_simd_level(request.param)
    yield request.param
    _C.set_simd_level("auto")


def align(n, dtype):
    a = 256 // torch.empty((), dtype=dtype).element_size()
    return (n + a - 1) // a * a


def layout(sizes, dtype):
    offs, used = [], 0
    for n in sizes:
        used = align(used, dtype)
        offs.append(used)
        used += n
    return offs, align(used, dtype)


def reference(x, dst_dtype, scale, divisor):
    """The kernel's arithmetic in float32 torch ops (mul, then div), rounded once to dst_dtype."""
    y = x.float()
    if scale != 1.0:
        y = y * scale
    if divisor != 1.0:
        y = y / divisor
    return y.to(dst_dtype)


def rand(n, dtype, gen):
    return (torch.randn(n, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("simd_level", LEVELS, indirect=True)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_pack_unpack_matches_reference(simd_level, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(100 * LEVELS.index(simd_level) + 10 * DTYPES.index(src_dtype) + DTYPES.index(dst_dtype))
    srcs = [rand(n, src_dtype, gen) for n in SIZES]
    offs, total = layout(SIZES, dst_dtype)
    modes = [(1.0, 1.0), (0.25, 1.0), (1.0, 3.0), (1.5, 7.0)]
    # every mode once per (level, dtype pair) family keeps the run short; the scalar level gets all four
    for scale, divisor in (modes if simd_level == "scalar" else modes[(DTYPES.index(src_dtype) + DTYPES.index(dst_dtype)) % 2::2]):
        bucket = torch.full((total,), 7.0, dtype=dst_dtype)
        ops.pack_(srcs, bucket, offs, scale=scale, divisor=divisor)
        for s, o in zip(srcs, offs):
            got = bucket[o:o + s.numel()]
            assert torch.equal(got, reference(s, dst_dtype, scale, divisor))
            # and within its roundings of the float64 truth (scale and divisor are exact): a float32 multiply
            # and divide, then the cast to dst_dtype, each (1 + delta) with |delta| <= the unit roundoff; plus,
            # for a result that underflows, at most one subnormal spacing of dst_dtype (it rounds to half of it).
            truth = s.double() * scale / divisor
            rtol = (1 + UNIT_ROUNDOFF[torch.float32]) ** 2 * (1 + UNIT_ROUNDOFF[dst_dtype]) - 1
            assert torch.allclose(got.double(), truth, rtol=rtol, atol=SUBNORMAL_SPACING[dst_dtype])
        # padding between slots is untouched
        mask = torch.ones(total, dtype=torch.bool)
        for s, o in zip(srcs, offs):
            mask[o:o + s.numel()] = False
        assert bool((bucket[mask] == 7.0).all())
        outs = [torch.full_like(s, -1.0) for s in srcs]
        ops.unpack_(bucket, outs, offs, scale=scale, divisor=divisor)
        for out, o, s in zip(outs, offs, srcs):
            assert torch.equal(out, reference(bucket[o:o + s.numel()], src_dtype, scale, divisor))


@pytest.mark.parametrize("dtype", DTYPES)
def test_simd_levels_bit_identical_to_scalar(dtype):
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 31, 100, 4099, 100003]
    srcs = [torch.randn(n, generator=gen) * 1e3 for n in sizes]
    srcs[0][0] = float("nan")
    srcs[1][:4] = torch.tensor([float("inf"), -float("inf"), 1e-40, -0.0])  # inf, denormal, -0
    offs, total = layout(sizes, dtype)
    results = {}
    for level in LEVELS:
        _C.set_simd_level(level)
        try:
            b = torch.zeros(total, dtype=dtype)
            ops.pack_(srcs, b, offs, divisor=3.0)
            back = [torch.zeros(n) for n in sizes]
            ops.unpack_(b, back, offs, scale=0.5)
        finally:
            _C.set_simd_level("auto")
        results[level] = (b.view(torch.int16 if dtype != torch.float32 else torch.int32), back)
    ref_b, ref_back = results["scalar"]
    for level, (b, back) in results.items():
        assert torch.equal(b, ref_b), level
        for x, y in zip(back, ref_back):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), level
    assert torch.isnan(ref_back[0][0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_crafted_inputs_round_trip(dtype):
    # small integers times powers of two: exact in every dtype, and /4 stays exact
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 64, 129, 1000]
    srcs = [(torch.randint(-64, 64, (n,), generator=gen) * 2.0 ** torch.randint(-4, 4, (n,), generator=gen)).float()
            for n in sizes]
    offs, total = layout(sizes, dtype)
    b = torch.zeros(total, dtype=dtype)
    ops.pack_(srcs, b, offs, scale=4.0)
    back = [torch.zeros(n) for n in sizes]
    ops.unpack_(b, back, offs, divisor=4.0)
    for x, y in zip(srcs, back):
        assert torch.equal(x, y)


def test_in_place_scale_of_bucket():
    b = torch.arange(1000, dtype=torch.float32)
    ops.unpack_(b, [b], [0], divisor=4.0)
    assert torch.equal(b, torch.arange(1000, dtype=torch.float32) / 4)
    view = b[64:128]
    ops.unpack_(b, [view], [64], scale=4.0)   # exact alias of a sub-range
    assert torch.equal(b[64:128], torch.arange(64, 128, dtype=torch.float32))


def test_numpy_buffers():
    srcs = [np.arange(5, dtype=np.float32), np.ones(3, dtype=np.float32)]
    b = np.zeros(128, dtype=np.float16)
    ops.pack_(srcs, b, [0, 64], divisor=2)
    assert b[:5].tolist() == [0, 0.5, 1, 1.5, 2] and b[64:67].tolist() == [0.5] * 3


def test_empty_lists_and_empty_bucket():
    ops.pack_([], torch.zeros(0), [])
    ops.unpack_(torch.zeros(0), [torch.zeros(0, 3)], [0])


def test_bad_input_raises_and_changes_nothing():
    srcs = [torch.ones(10), torch.ones(20)]
    b = torch.zeros(128)
    before = b.clone()
    cases = [
        (lambda: ops.pack_(srcs, b, [0]), ValueError, "offsets"),
        (lambda: ops.pack_(srcs, b, [0, 120]), ValueError, "offsets"),           # out of range
        (lambda: ops.pack_(srcs, b, [0, -1]), ValueError, "offsets"),
        (lambda: ops.pack_(srcs, b, [0, 5]), ValueError, "offsets"),             # overlapping slots
        (lambda: ops.pack_(srcs, b, [0, "a"]), TypeError, r"offsets\[1\]"),
        (lambda: ops.pack_(srcs, b, [0, 64], divisor=0), ValueError, "divisor"),
        (lambda: ops.pack_(srcs, b, [0, 64], scale=float("nan")), ValueError, "scale"),
        (lambda: ops.pack_([torch.ones(3, dtype=torch.float64)], b, [0]), TypeError, r"srcs\[0\]"),
        (lambda: ops.pack_([torch.ones(4, 4).t()], b, [0]), ValueError, r"srcs\[0\]"),
        (lambda: ops.pack_([b[60:68]], b, [64]), ValueError, "srcs"),             # reads what it writes
        (lambda: ops.pack_([b[:8].to(torch.float16)], b[:100], [0]), None, None),  # fine: separate memory
    ]
    for fn, exc, match in cases:
        if exc is None:
            fn()
            b.copy_(before)
            continue
        with pytest.raises(exc, match=match):
            fn()
        assert torch.equal(b, before)
    outs = [torch.zeros(10), torch.zeros(20)]
    with pytest.raises(ValueError, match="dsts"):
        ops.unpack_(b, [outs[0], outs[0]], [0, 64])                               # same tensor twice
    with pytest.raises(ValueError, match="dsts"):
        ops.unpack_(b, [b[60:70]], [64])                                          # writes what it reads
    with pytest.raises(ValueError, match="dsts"):
        ops.unpack_(b, [b[0:10].view(torch.int16)[:10].view(torch.bfloat16)], [0])  # alias, other dtype
    ro = np.zeros(128, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dst"):
        ops.pack_([np.ones(3, dtype=np.float32)], ro, [0])
    assert all(float(o.abs().sum()) == 0 for o in outs)
