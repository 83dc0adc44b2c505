"""In-place average of N equal buffers: ncclavg's one-pass kernel vs torch, vs the copy bandwidth.

    python bench/average.py [--mib 64] [--n 2 4 8] [--dtype float32] [--json bench/results/average.json]

Bytes counted for every contender: the work's minimum, N reads + N writes of the buffer. Contenders:
  ncclavg   ops.average_(bufs)                       (one pass: read each once, write each once)
  stack     torch.stack(bufs).mean(0), then copy back into each buffer
  add_chain acc = b0.clone(); acc.add_(bi)...; acc.mul_(1/N); bi.copy_(acc) for each
Copy bandwidth: torch copy_ of one buffer (read + write), measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import copy_bandwidth_gbps, machine, median_seconds, same_threads_everywhere, write_json  # noqa: E402,I001

import torch  # noqa: E402

import ncclavg  # noqa: E402


def torch_stack_mean(bufs):
    mean = torch.stack(bufs).mean(0)
    for b in bufs:
        b.copy_(mean)


def torch_add_chain(bufs):
    acc = bufs[0].clone()
    for b in bufs[1:]:
        acc.add_(b)
    acc.mul_(1.0 / len(bufs))
    for b in bufs:
        b.copy_(acc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="size of each buffer in MiB (default 64)")
    p.add_argument("--n", type=int, nargs="+", default=[2, 4, 8], help="buffer counts (default 2 4 8)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.mib <= 0 or any(n < 2 for n in args.n):
        p.error("--mib must be > 0 and every --n >= 2")

    threads = same_threads_everywhere()
    dtype = getattr(torch, args.dtype)
    nbytes = args.mib << 20
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    copy_gbps = copy_bandwidth_gbps(nbytes, reps=args.reps)
    print(f"# {machine()['cpu']}, {threads} threads, SIMD {ncclavg.build_info()['simd_level']}, "
          f"{args.mib} MiB {args.dtype} buffers; copy bandwidth {copy_gbps:.1f} GB/s")
    print(f"{'N':>3} {'ncclavg GB/s':>13} {'stack GB/s':>11} {'add_ GB/s':>10} "
          f"{'x stack':>8} {'x add_':>7} {'% copy bw':>10}")
    rows = []
    for n in args.n:
        bufs = [torch.randn(numel).to(dtype) for _ in range(n)]
        work = 2 * n * nbytes
        t_ours = median_seconds(lambda bufs=bufs: ncclavg.ops.average_(bufs), reps=args.reps)
        t_stack = median_seconds(lambda bufs=bufs: torch_stack_mean(bufs), reps=args.reps)
        t_chain = median_seconds(lambda bufs=bufs: torch_add_chain(bufs), reps=args.reps)
        row = {
            "n": n, "dtype": args.dtype, "buffer_bytes": nbytes, "bytes_counted": work,
            "ncclavg_gbps": work / t_ours / 1e9, "stack_gbps": work / t_stack / 1e9,
            "add_chain_gbps": work / t_chain / 1e9, "copy_gbps": copy_gbps,
            "ncclavg_s": t_ours, "stack_s": t_stack, "add_chain_s": t_chain,
        }
        row["case"] = f"average_ N={n} {args.mib} MiB {args.dtype} (in place)"
        row["time_us"] = t_ours * 1e6
        row["torch_time_us"] = min(t_stack, t_chain) * 1e6
        row["speedup_vs_torch"] = min(t_stack, t_chain) / t_ours
        row["speedup_vs_stack"] = t_stack / t_ours
        row["speedup_vs_add_chain"] = t_chain / t_ours
        row["fraction_of_copy_bw"] = row["ncclavg_gbps"] / copy_gbps
        rows.append(row)
        print(f"{n:>3} {row['ncclavg_gbps']:>13.1f} {row['stack_gbps']:>11.1f} {row['add_chain_gbps']:>10.1f} "
              f"{row['speedup_vs_stack']:>7.2f}x {row['speedup_vs_add_chain']:>6.2f}x "
              f"{100 * row['fraction_of_copy_bw']:>9.0f}%")
        del bufs
    write_json(args.json, {"header": {"benchmark": "average", "machine": machine(), "args": vars(args),
                                      "copy_gbps": copy_gbps, "bytes_convention": "N reads + N writes"},
                           "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
