"""What noting finiteness costs the passes that write the gradients: each host pass with and without its
check (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h), the best torch way of
doing the same work (the pass, then torch's own check of what it wrote), and the copy bandwidth, all timed
in the same interleaved rounds (a load that comes and goes hits every contender alike).

    python bench/finite_check.py                         # 32 MiB of fp32 per buffer, every SIMD level
    python bench/finite_check.py --quick                 # 4 MiB, 3 rounds (a smoke run, in cache)
    python bench/finite_check.py --json bench/results/finite_check-<machine>-<date>.json

Passes (bytes counted: what the pass must read + write, each stream once):
  average N   ops.average_ of N towers in place (N reads + N writes), fp32 and bf16; torch: the add chain
              into an fp32 accumulator, the division, the copies back, then torch.isfinite(mean).all()
  unpack /N   in-place division of an fp32 bucket (the averager's last pass over gloo): 1 read + 1 write;
              torch: div_, then isfinite().all()
  unpack cast bf16 bucket -> fp32 grads with /N (the cast-back of grad_dtype buckets): 2 + 4 bytes
  copy        a plain fp32 copy: the checked copy (the channel's copy of the slices other ranks summed)
              vs memcpy
"checked / plain" is the time ratio at the same SIMD level (1.00 = the check costs nothing measurable);
"of copy" the pass's bandwidth over the fastest copy (numpy copyto, torch copy_) of the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, same_threads_everywhere, write_json  # noqa: E402,I001

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ncclavg  # noqa: E402
from ncclavg import _C  # noqa: E402
from ncclavg.buffers import as_buffer, as_buffers  # noqa: E402


def interleaved(contenders: dict, reps: int, warmup: int) -> dict:
    """Median seconds per contender; every round runs every contender once."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times: dict = {k: [] for k in contenders}
    for _ in range(reps):
        for k, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def at_level(level: str, fn):
    def run():
        _C.set_simd_level(level)
        return fn()
    return run


def copy_refs(nbytes: int) -> dict:
    src = torch.ones(max(1, nbytes // 8))   # half read, half written
    dst = torch.empty_like(src)
    return {"copy:numpy": lambda: np.copyto(dst.numpy(), src.numpy()), "copy:torch": lambda: dst.copy_(src)}


def case_average(n: int, numel: int, dtype: torch.dtype, levels: list) -> dict:
    gen = torch.Generator().manual_seed(n)
    xs = [(torch.randn(numel, generator=gen) * 1e-2).to(dtype) for _ in range(n)]
    bufs = as_buffers(xs, "xs")
    acc = torch.empty(numel)

    def torch_way():
        acc.copy_(xs[0])
        for x in xs[1:]:
            acc.add_(x)
        acc.div_(n)
        for x in xs:
            x.copy_(acc)
        return bool(torch.isfinite(xs[0]).all())

    c = {"torch": torch_way}
    for lv in levels:
        c[f"plain@{lv}"] = at_level(lv, lambda: _C.average_(bufs, 0, False))
        c[f"checked@{lv}"] = at_level(lv, lambda: _C.average_(bufs, 0, True))
    return {"what": f"average {n} x {str(dtype)[6:]} ({numel} elements)", "bytes": 2 * n * numel * xs[0].element_size(),
            "contenders": c}


def case_unpack_div(numel: int, levels: list) -> dict:
    x = torch.randn(numel) * 1e-2
    b = as_buffer(x, "x")

    def torch_way():
        x.div_(1.0)   # /1: the values stay; the same traffic as /N
        return bool(torch.isfinite(x).all())

    c = {"torch": torch_way}
    for lv in levels:
        c[f"plain@{lv}"] = at_level(lv, lambda: _C.unpack_(b, [b], [0], 1.0, 1.0000001, 0, False))
        c[f"checked@{lv}"] = at_level(lv, lambda: _C.unpack_(b, [b], [0], 1.0, 1.0000001, 0, True))
    return {"what": f"unpack /N in place, float32 ({numel} elements)", "bytes": 8 * numel, "contenders": c}


def case_unpack_cast(numel: int, levels: list) -> dict:
    src = (torch.randn(numel) * 1e-2).to(torch.bfloat16)
    dst = torch.empty(numel)
    bs, bd = as_buffer(src, "src"), as_buffer(dst, "dst")

    def torch_way():
        torch.div(src, 4.0, out=dst)
        return bool(torch.isfinite(dst).all())

    c = {"torch": torch_way}
    for lv in levels:
        c[f"plain@{lv}"] = at_level(lv, lambda: _C.unpack_(bs, [bd], [0], 1.0, 4.0, 0, False))
        c[f"checked@{lv}"] = at_level(lv, lambda: _C.unpack_(bs, [bd], [0], 1.0, 4.0, 0, True))
    return {"what": f"unpack bf16 -> fp32 /N ({numel} elements)", "bytes": 6 * numel, "contenders": c}


def case_copy(numel: int, levels: list) -> dict:
    src = torch.randn(numel)
    dst = torch.empty(numel)
    bs, bd = as_buffer(src, "src"), as_buffer(dst, "dst")

    def torch_way():
        dst.copy_(src)
        return bool(torch.isfinite(dst).all())

    c = {"torch": torch_way}
    for lv in levels:
        c[f"plain@{lv}"] = at_level(lv, lambda: _C.unpack_(bs, [bd], [0], 1.0, 1.0, 0, False))   # memcpy
        c[f"checked@{lv}"] = at_level(lv, lambda: _C.unpack_(bs, [bd], [0], 1.0, 1.0, 0, True))
    return {"what": f"plain copy, float32 ({numel} elements)", "bytes": 8 * numel, "contenders": c}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=32, help="fp32 MiB per buffer (default 32)")
    p.add_argument("--towers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--simd", default="all", help="all (every level this CPU has), or a comma-separated list")
    p.add_argument("--quick", action="store_true", help="4 MiB per buffer, 3 rounds")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.reps, args.warmup = 4, 3, 1
    threads = same_threads_everywhere()
    have = list(_C.simd_levels_supported())
    levels = have if args.simd == "all" else [lv.strip() for lv in args.simd.split(",")]
    if any(lv not in have for lv in levels):
        p.error(f"--simd: this CPU has {', '.join(have)}")
    numel = int(args.mib * (1 << 20)) // 4
    load0 = os.getloadavg()
    cases = [case_average(n, numel, dt, levels) for dt in (torch.float32, torch.bfloat16) for n in args.towers]
    cases += [case_unpack_div(numel, levels), case_unpack_cast(numel, levels), case_copy(numel, levels)]
    before = _C.simd_level()
    rows = []
    try:
        for case in cases:
            med = interleaved({**case["contenders"], **copy_refs(case["bytes"])}, args.reps, args.warmup)
            copy_s = min(v for k, v in med.items() if k.startswith("copy:"))
            for lv in levels:   # one row per level, in bench/cpu_suite.py's contract
                plain, checked = med[f"plain@{lv}"], med[f"checked@{lv}"]
                rows.append({"case": f"{case['what']}, checked", "simd": lv, "bytes": case["bytes"],
                             "time_us": checked * 1e6, "plain_time_us": plain * 1e6,
                             "checked_over_plain": checked / plain, "torch_time_us": med["torch"] * 1e6,
                             "speedup_vs_torch": med["torch"] / checked, "copy_time_us": copy_s * 1e6,
                             "fraction_of_copy_bw": copy_s / checked, "copy_gbps": case["bytes"] / copy_s / 1e9})
    finally:
        _C.set_simd_level(before)
    load1 = os.getloadavg()
    print(f"# bench/finite_check.py  {machine()['cpu']}  threads={threads}  {numel * 4 >> 20} MiB fp32 per buffer  "
          f"load {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"{'pass':<44} {'simd':>6} {'plain ms':>9} {'checked ms':>10} {'checked/plain':>13} {'of copy':>8} "
          f"{'x torch':>8}")
    for r in rows:
        print(f"{r['case'][:-9]:<44} {r['simd']:>6} {r['plain_time_us'] / 1e3:>9.2f} {r['time_us'] / 1e3:>10.2f} "
              f"{r['checked_over_plain']:>13.3f} {r['fraction_of_copy_bw']:>7.0%} {r['speedup_vs_torch']:>7.2f}x")
    print("checked/plain: time ratio at the same level; of copy: checked pass bandwidth / fastest copy of the run; "
          "x torch: the torch way (the pass, then torch.isfinite(...).all()) / checked")
    write_json(args.json, {"header": {"benchmark": "finite_check", "machine": machine(), "threads": threads,
                                      "argv": sys.argv[1:], "loadavg_start": list(load0),
                                      "loadavg_end": list(load1), "mib": args.mib, "reps": args.reps},
                           "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
