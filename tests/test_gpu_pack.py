"""The CUDA pack/unpack kernel (a segment table in the launch parameters): bit-for-bit equal to the CPU
kernel and to the float32 reference (the element math is shared; NaNs compared as NaNs, see
tests/_bits.py), close to float64, exact on crafted inputs, padding untouched, many tensors per call,
unaligned views and in-place scales (the element path next to the 16-byte one), ordered on the bucket's
current stream, bad input."""
from __future__ import annotations

import pytest

from _bits import assert_same_bits
from _gpu import TORCH_DTYPES, require_cuda, tdtype
from ncclavg import ops

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 7, 15, 17, 4097, 70001, 1_000_003]
MODES = [(1.0, 1.0), (0.25, 1.0), (1.0, 3.0), (1.5, 7.0)]
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
SUBNORMAL_SPACING = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


def require_pack():
    torch = require_cuda()
    if not hasattr(ops, "pack_") or not hasattr(ops, "unpack_"):
        pytest.skip("ncclavg.ops.pack_/unpack_ are not in this checkout")
    return torch


def layout(sizes, itemsize):
    align = 256 // itemsize
    offs, used = [], 0
    for n in sizes:
        used = (used + align - 1) // align * align
        offs.append(used)
        used += n
    return offs, (used + align - 1) // align * align


def reference(x, dtype, scale, divisor):
    """The kernel's arithmetic on the CPU in float32 (mul, then div, each rounded), rounded to dtype."""
    y = x.float().cpu()
    if scale != 1.0:
        y = y * scale
    if divisor != 1.0:
        y = y / divisor
    return y.to(dtype)


@pytest.mark.parametrize("src", TORCH_DTYPES)
@pytest.mark.parametrize("dst", TORCH_DTYPES)
def test_pack_unpack_gpu_matches_cpu_and_reference(src, dst):
    torch = require_pack()
    sdt, ddt = tdtype(torch, src), tdtype(torch, dst)
    gen = torch.Generator().manual_seed(TORCH_DTYPES.index(src) * 3 + TORCH_DTYPES.index(dst))
    host = [(torch.randn(n, generator=gen) * 3).to(sdt) for n in SIZES]
    host[1][0] = float("nan")
    host[2][:4] = torch.tensor([float("inf"), -float("inf"), 1e-40, -0.0]).to(sdt)
    offs, total = layout(SIZES, torch.empty((), dtype=ddt).element_size())
    devs = [h.cuda() for h in host]
    for scale, divisor in MODES:
        bucket = torch.full((total,), 7.0, dtype=ddt, device="cuda")
        ops.pack_(devs, bucket, offs, scale=scale, divisor=divisor)
        cpu_bucket = torch.full((total,), 7.0, dtype=ddt)
        ops.pack_(host, cpu_bucket, offs, scale=scale, divisor=divisor)
        got = bucket.cpu()
        assert_same_bits(got, cpu_bucket, f"{src}->{dst} {scale}/{divisor}: GPU vs CPU")
        mask = torch.ones(total, dtype=torch.bool)
        for h, o in zip(host, offs):
            assert_same_bits(got[o:o + h.numel()], reference(h, ddt, scale, divisor), f"{src}->{dst} vs reference")
            # Its roundings of the float64 truth (scale and divisor are exact): a float32 multiply and divide,
            # then the cast to dst, each (1 + delta), |delta| <= the unit roundoff; plus at most one subnormal
            # spacing of dst for a result that underflows (1e-40 among the inputs).
            truth = h.double() * scale / divisor
            rtol = (1 + UNIT_ROUNDOFF["float32"]) ** 2 * (1 + UNIT_ROUNDOFF[dst]) - 1
            ok = torch.isclose(got[o:o + h.numel()].double(), truth, rtol=rtol, atol=SUBNORMAL_SPACING[dst],
                               equal_nan=True)
            assert bool(ok.all()), f"{src}->{dst}: off the float64 value"
            mask[o:o + h.numel()] = False
        assert bool((got[mask] == 7.0).all()), "padding between slots was written"
        outs = [torch.full_like(d, -1.0) for d in devs]
        ops.unpack_(bucket, outs, offs, scale=scale, divisor=divisor)
        for out, o, h in zip(outs, offs, host):
            assert_same_bits(out, reference(got[o:o + h.numel()], sdt, scale, divisor), f"unpack {dst}->{src}")


@pytest.mark.parametrize("src", TORCH_DTYPES)
@pytest.mark.parametrize("dst", TORCH_DTYPES)
def test_unaligned_views_match_cpu(src, dst):
    # Views starting 0..8 elements into their storage, and bucket offsets that are not 256-byte aligned:
    # co-aligned pairs take the 16-byte path after a head, the others go element by element. Sizes
    # around the vector widths and across chunks (8192 elements). All must equal the CPU bit for bit.
    torch = require_pack()
    sdt, ddt = tdtype(torch, src), tdtype(torch, dst)
    gen = torch.Generator().manual_seed(11 + TORCH_DTYPES.index(src) * 3 + TORCH_DTYPES.index(dst))
    sizes = [1, 3, 4, 5, 8, 9, 15, 16, 17, 31, 8191, 8192, 8193, 20001]
    base = (torch.randn(sum(sizes) + 9 * len(sizes), generator=gen) * 5).to(sdt)
    host, at = [], 0
    for k, n in enumerate(sizes):
        at += k % 9
        host.append(base[at:at + n])
        at += n
    offs, used = [], 0
    for k, n in enumerate(sizes):
        used += (3 * k) % 8
        offs.append(used)
        used += n
    dev_base = base.cuda()
    devs = [dev_base[h.storage_offset():h.storage_offset() + h.numel()] for h in host]
    for scale, divisor in MODES:
        bucket = torch.full((used + 5,), 7.0, dtype=ddt, device="cuda")
        ops.pack_(devs, bucket, offs, scale=scale, divisor=divisor)
        cpu_bucket = torch.full((used + 5,), 7.0, dtype=ddt)
        ops.pack_(host, cpu_bucket, offs, scale=scale, divisor=divisor)
        assert_same_bits(bucket, cpu_bucket, f"pack {src}->{dst} {scale}/{divisor}")
        outs = [torch.full_like(d, -1.0) for d in devs]
        cpu_outs = [torch.full_like(h, -1.0) for h in host]
        ops.unpack_(bucket, outs, offs, scale=scale, divisor=divisor)
        ops.unpack_(cpu_bucket, cpu_outs, offs, scale=scale, divisor=divisor)
        for k, (o, c) in enumerate(zip(outs, cpu_outs)):
            assert_same_bits(o, c, f"unpack {dst}->{src} {scale}/{divisor} tensor {k} ({sizes[k]} elements)")


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_in_place_scale_of_bucket_views(dtype):
    # A tensor that IS its bucket slot (same dtype) is scaled in place: the kernel's aliasing path.
    torch = require_pack()
    dt = tdtype(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 7, 4097, 70001]
    offs, total = layout(sizes, torch.empty((), dtype=dt).element_size())
    offs[1] += 1   # one slot not 16-byte aligned: the element path in place
    host = (torch.randn(total, generator=gen) * 3).to(dt)
    for scale, divisor in MODES[1:]:
        bucket = host.cuda()
        views = [bucket[o:o + n] for o, n in zip(offs, sizes)]
        ops.unpack_(bucket, views, offs, scale=scale, divisor=divisor)
        cpu = host.clone()
        ops.unpack_(cpu, [cpu[o:o + n] for o, n in zip(offs, sizes)], offs, scale=scale, divisor=divisor)
        assert_same_bits(bucket, cpu, f"in-place {dtype} {scale}/{divisor}")


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_many_tensors_exact_round_trip(dtype):
    torch = require_pack()
    dt = tdtype(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    # 2,100 tensors (about 1/3000 of them empty): two full large tables and part of a third, or 18 small
    # ones on a driver without large kernel parameters (See Note [Pack chunk table])
    sizes = [int(s) for s in torch.randint(0, 3000, (2100,), generator=gen)]
    srcs = [(torch.randint(-64, 64, (n,), generator=gen) * 2.0 ** torch.randint(-4, 4, (n,), generator=gen))
            .float().cuda() for n in sizes]
    offs, total = layout(sizes, torch.empty((), dtype=dt).element_size())
    bucket = torch.zeros(total, dtype=dt, device="cuda")
    ops.pack_(srcs, bucket, offs, scale=4.0)
    back = [torch.zeros_like(s) for s in srcs]
    ops.unpack_(bucket, back, offs, divisor=4.0)
    torch.cuda.synchronize()
    for s, b in zip(srcs, back):
        assert torch.equal(s, b)


def test_pack_runs_on_the_buckets_current_stream():
    torch = require_pack()
    side = torch.cuda.Stream()
    srcs = [torch.zeros(1 << 20, device="cuda") for _ in range(3)]
    offs, total = layout([s.numel() for s in srcs], 4)
    bucket = torch.zeros(total, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        for s in srcs:
            s.fill_(5.0)
        ops.pack_(srcs, bucket, offs, divisor=5.0)
        ok = bool(torch.all(bucket[offs[2]:offs[2] + srcs[2].numel()] == 1.0).item())
    assert ok


def test_pack_bad_input_on_gpu():
    torch = require_pack()
    srcs = [torch.ones(10, device="cuda"), torch.ones(20, device="cuda")]
    b = torch.zeros(128, device="cuda")
    for fn, exc, match in [
        (lambda: ops.pack_(srcs, b, [0, 5]), ValueError, "offsets"),
        (lambda: ops.pack_([srcs[0].cpu(), srcs[1]], b, [0, 64]), ValueError, r"srcs\[0\]"),
        (lambda: ops.pack_(srcs, b, [0, 120]), ValueError, "offsets"),
        (lambda: ops.pack_(srcs, b, [0, 64], divisor=0), ValueError, "divisor"),
    ]:
        with pytest.raises(exc, match=match):
            fn()
    torch.cuda.synchronize()
    assert bool((b == 0).all())
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError):
            ops.pack_([srcs[0].to("cuda:1")], b, [0])
