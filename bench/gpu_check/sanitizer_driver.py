#!/usr/bin/env python3
"""Every CUDA kernel of ncclavg over a few small tensors, each result checked: the program that
bench/gpu_check.sh's sanitizer step runs under compute-sanitizer's memcheck.

    python bench/gpu_check/sanitizer_driver.py [--device cuda|cpu]

Small on purpose: memcheck slows every kernel down by one to two orders of magnitude, torch's start-up
too, and a step of 45 s must finish. What it drives, and what memcheck then watches:
- pack and unpack for every dtype pair, tensors that start 0-3 elements past an allocation (the kernel's
  element heads and 16-byte bodies), slots with gaps, a scale and a divisor; an in-place scale of bucket
  views; buckets of 130 and 1,030 tensors (one and two launches of the large segment table where the driver
  allows it, 2 and 9 small ones where not);
- the average of 1 to 5 buffers, aligned and misaligned, with inputs whose mean is exact;
- the divide kernel (CUDA only: it has no CPU twin).
Each result is compared with what it must be (float32 arithmetic rounded once, or exact by construction),
so the driver also fails on a wrong answer. `--device cpu` runs the same calls on CPU tensors: the dry run
of gpu_check.sh checks the driver itself that way.
Exit status: 0 when every check holds, 1 when one does not, 86 with a last line "not run: ..." when this
machine cannot run it (gpu_check.sh's convention).
"""
from __future__ import annotations

import argparse
import sys
import time

NOT_RUN_RC = 86
DTYPES = ("float32", "bfloat16", "float16")


def reference(torch, x, dtype, scale, divisor):
    """The pack kernel's element math: float32 multiply, then float32 divide, rounded to dtype."""
    y = x.float().cpu()
    if scale != 1.0:
        y = y * scale
    if divisor != 1.0:
        y = y / divisor
    return y.to(dtype)


def exact_inputs(torch, n, numel, gen):
    """n buffers whose mean is exact in every dtype and summation order: a mean in quarter steps plus
    zero-sum deviations (pairs +d/-d), every partial sum a multiple of 1/4 below 64 (bfloat16's 8 bits)."""
    m = torch.randint(-8, 9, (numel,), generator=gen).double() / 4
    xs = [None] * n
    for r in range(n // 2):
        d = torch.randint(-8, 9, (numel,), generator=gen).double() / 4
        xs[r], xs[n - 1 - r] = m + d, m - d
    if n % 2:
        xs[n // 2] = m.clone()
    return xs, m


class Checks:
    def __init__(self):
        self.done, self.failed = 0, []

    def equal(self, got, want, what):
        self.done += 1
        g, w = got.detach().cpu(), want.detach().cpu()
        if g.dtype != w.dtype or g.shape != w.shape or not bool((g == w).all()):
            self.failed.append(what)
            print(f"WRONG: {what}", flush=True)


def shifted(torch, n, dtype, shift, device, gen):
    """n random elements starting `shift` elements into their own allocation."""
    base = torch.empty(n + 4, dtype=dtype, device=device)
    x = base[shift:shift + n]
    x.copy_((torch.randn(n, generator=gen) * 3).to(dtype))
    return x


def check_pack(torch, ops, device, c):
    gen = torch.Generator().manual_seed(1)
    sizes, shifts = [1, 7, 33, 1000], [0, 1, 3, 2]
    for sname in DTYPES:
        for dname in DTYPES:
            sdt, ddt = getattr(torch, sname), getattr(torch, dname)
            srcs = [shifted(torch, n, sdt, s, device, gen) for n, s in zip(sizes, shifts)]
            offs, used = [], 0
            for k, n in enumerate(sizes):
                used += k % 3   # gaps, and slots off the 16-byte grid
                offs.append(used)
                used += n
            bucket = torch.full((used + 2,), 7.0, dtype=ddt, device=device)
            ops.pack_(srcs, bucket, offs, scale=0.5, divisor=3.0)
            for k, (s, o) in enumerate(zip(srcs, offs)):
                c.equal(bucket[o:o + s.numel()], reference(torch, s, ddt, 0.5, 3.0), f"pack {sname}->{dname} tensor {k}")
            c.equal(bucket[-2:], torch.full((2,), 7.0, dtype=ddt), f"pack {sname}->{dname}: padding untouched")
            outs = [torch.zeros_like(s) for s in srcs]
            ops.unpack_(bucket, outs, offs, scale=2.0)
            for k, (out, o) in enumerate(zip(outs, offs)):
                c.equal(out, reference(torch, bucket[o:o + out.numel()], sdt, 2.0, 1.0),
                        f"unpack {dname}->{sname} tensor {k}")
    # in place: tensors that ARE their bucket slots
    bucket = shifted(torch, 1100, torch.bfloat16, 1, device, gen)
    before = bucket.clone()
    offs = [0, 9, 100]
    views = [bucket[o:o + n] for o, n in zip(offs, [9, 91, 1000])]
    ops.unpack_(bucket, views, offs, scale=0.25, divisor=3.0)
    c.equal(bucket[:1100], reference(torch, before, torch.bfloat16, 0.25, 3.0), "in-place scale of bucket views")
    # many tensors: one or two large tables (or several small ones)
    for count in (130, 1030):
        srcs = [shifted(torch, 1 + k % 8, torch.float32, k % 3, device, gen) for k in range(count)]
        offs, used = [], 0
        for s in srcs:
            offs.append(used)
            used += s.numel()
        bucket = torch.zeros(used, dtype=torch.float16, device=device)
        ops.pack_(srcs, bucket, offs, divisor=2.0)
        want = torch.cat([reference(torch, s, torch.float16, 1.0, 2.0) for s in srcs])
        c.equal(bucket, want, f"pack of {count} tensors")


def check_average(torch, ops, device, c):
    gen = torch.Generator().manual_seed(2)
    for name in DTYPES:
        dt = getattr(torch, name)
        for n in range(1, 6):
            for numel, shift in ((1, 0), (7, 1), (1000, 0), (1000, 3)):
                xs, mean = exact_inputs(torch, n, numel, gen)
                bufs = []
                for x in xs:
                    b = torch.empty(numel + 4, dtype=dt, device=device)[shift:shift + numel]
                    b.copy_(x.to(dt))
                    bufs.append(b)
                ops.average_(bufs)
                for k, b in enumerate(bufs):
                    c.equal(b, mean.to(dt), f"average of {n} {name} x {numel} (+{shift}) buffer {k}")


def check_divide(torch, device, c):
    from ncclavg import _C
    from ncclavg.buffers import as_buffer

    gen = torch.Generator().manual_seed(3)
    for name in DTYPES:
        dt = getattr(torch, name)
        for numel, shift in ((1, 0), (7, 1), (1000, 0), (1001, 2)):
            x = shifted(torch, numel, dt, shift, "cpu", gen)
            dev = torch.empty(numel + 4, dtype=dt, device=device)[shift:shift + numel]
            dev.copy_(x)
            _C.divide_(as_buffer(dev), 3.0, int(torch.cuda.current_stream(dev.device).cuda_stream))
            c.equal(dev, (x.float() / 3.0).to(dt), f"divide {name} x {numel} (+{shift})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    import ncclavg
    from ncclavg import ops

    if args.device == "cuda":
        if not ncclavg.cuda_built():
            print("not run: this build of ncclavg has no CUDA part")
            return NOT_RUN_RC
        if not torch.cuda.is_available():
            print("not run: torch sees no CUDA device")
            return NOT_RUN_RC
    device = "cuda:0" if args.device == "cuda" else "cpu"
    c = Checks()
    check_pack(torch, ops, device, c)
    check_average(torch, ops, device, c)
    if args.device == "cuda":
        check_divide(torch, device, c)
        torch.cuda.synchronize()
    else:
        print("divide: CUDA only (no CPU twin): not driven")
    print(f"{c.done} checks on {device}, {len(c.failed)} wrong, {time.perf_counter() - t0:.1f} s")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
