"""Gradient bucket benchmarks on the CPU.

1. Fused pack/unpack: 1000 gradients of 100..100k float32 elements packed into one bucket and back, vs
   torch's `_flatten_dense_tensors` (allocates a new flat tensor) / unflatten + copy, vs the best
   torch way into a preallocated bucket (`torch.cat(out=)` and `torch._foreach_copy_`), and vs one
   contiguous copy of the same bytes (the memory-bandwidth limit), all in the same run. Also the
   float32 -> bfloat16 pack (compressed communication) vs torch's cat + cast.
2. Per-step Python overhead of `GradientAverager.average()` on a ResNet-50-shaped parameter list
   (161 tensors, 25.6 M parameters), 2 local towers: (a) exactly, with a communicator whose reduction
   does nothing (what is left is the averager's own work), (b) as the difference between average()
   and the raw `all_reduce_avg` of the same buckets.
3. Many small buckets: `average()` per bucket with 128 buckets of 0.1-4 KiB (64 layers of 32x32 + bias,
   2 local towers, real reduction), next to the raw synchronous `all_reduce_avg` of the same buckets:
   the per-bucket cost of the averager and the communicator for models made of small layers.

Contenders are timed in interleaved rounds (outside load hits them alike); figures are medians after
warm-up. Writes bench/results/pack.json. Usage: python bench/pack.py [--reps N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ncclavg  # noqa: E402
from ncclavg import Communicator, GradientAverager, ops  # noqa: E402
from ncclavg._ext import _C  # noqa: E402
from ncclavg.bench.report import cpu_model  # noqa: E402
from ncclavg.buffers import as_buffer, as_buffers  # noqa: E402
from ncclavg.comm import LocalCommunicator, CompletedWork  # noqa: E402


def rounds(contenders: dict, reps: int, warmup: int = 2) -> dict:
    """Median seconds per contender, timed round-robin."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times = {k: [] for k in contenders}
    for _ in range(reps):
        for k, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_pack(n_grads: int, reps: int) -> dict:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(100, 100_001, (n_grads,), generator=gen).tolist()
    grads = [torch.randn(n, generator=gen) for n in sizes]
    total = sum(sizes)
    nbytes = total * 4
    offsets, used = [], 0
    for n in sizes:
        used = (used + 63) // 64 * 64  # 256-byte slots, as in a BucketPlan
        offsets.append(used)
        used += n
    bucket = torch.zeros(used)
    bucket_bf16 = torch.zeros(used, dtype=torch.bfloat16)
    dense = torch.zeros(total)          # torch's layout: no padding
    src_flat, dst_flat = torch.randn(total), torch.zeros(total)
    views = _unflatten_dense_tensors(dense, grads)
    src_bufs = as_buffers(grads, "srcs")
    bucket_buf = as_buffer(bucket, "bucket")

    # correctness in the same run: the round trip is exact
    ops.pack_(grads, bucket, offsets)
    outs = [torch.empty_like(g) for g in grads]
    ops.unpack_(bucket, outs, offsets)
    assert all(torch.equal(a, b) for a, b in zip(grads, outs))

    t = rounds({
        "ncclavg_pack": lambda: ops.pack_(grads, bucket, offsets),
        "ncclavg_pack_core_only": lambda: _C.pack_(src_bufs, bucket_buf, offsets, 1.0, 1.0, 0),
        "ncclavg_unpack": lambda: ops.unpack_(bucket, grads, offsets),
        "ncclavg_pack_bf16": lambda: ops.pack_(grads, bucket_bf16, offsets),
        "torch_flatten": lambda: _flatten_dense_tensors(grads),
        "torch_unflatten_copy": lambda: [g.copy_(v) for g, v in zip(grads, _unflatten_dense_tensors(dense, grads))],
        "torch_cat_out": lambda: torch.cat(grads, out=dense),
        "torch_foreach_copy_unpack": lambda: torch._foreach_copy_(grads, views),
        "torch_flatten_then_bf16": lambda: _flatten_dense_tensors(grads).to(torch.bfloat16),
        "torch_copy_contiguous": lambda: dst_flat.copy_(src_flat),
        "ncclavg_copy_contiguous": lambda: ops.pack_([src_flat], dst_flat, [0]),
    }, reps)
    copy_best = min(t["torch_copy_contiguous"], t["ncclavg_copy_contiguous"])
    torch_round_trip = t["torch_flatten"] + min(t["torch_unflatten_copy"], t["torch_foreach_copy_unpack"])
    ours_round_trip = t["ncclavg_pack"] + t["ncclavg_unpack"]
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    return {
        "n_grads": n_grads, "elements": total, "bytes": nbytes,
        "seconds": t, "GB_per_s_copied": gbs,
        "copy_bandwidth_GB_per_s": nbytes / copy_best / 1e9,
        "ratios": {
            "pack_speedup_vs_torch_flatten": t["torch_flatten"] / t["ncclavg_pack"],
            "pack_speedup_vs_torch_cat_out": t["torch_cat_out"] / t["ncclavg_pack"],
            "unpack_speedup_vs_torch_unflatten_copy": t["torch_unflatten_copy"] / t["ncclavg_unpack"],
            "unpack_speedup_vs_torch_foreach_copy": t["torch_foreach_copy_unpack"] / t["ncclavg_unpack"],
            "round_trip_speedup_vs_torch": torch_round_trip / ours_round_trip,
            "pack_bf16_speedup_vs_torch_flatten_then_bf16": t["torch_flatten_then_bf16"] / t["ncclavg_pack_bf16"],
            "pack_fraction_of_copy_bandwidth": copy_best / t["ncclavg_pack"],
            "unpack_fraction_of_copy_bandwidth": copy_best / t["ncclavg_unpack"],
        },
    }


def resnet50_shapes() -> list:
    """Parameter shapes of torchvision's resnet50, in registration order (161 tensors)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


class NullLocalCommunicator(LocalCommunicator):
    """The local communicator's checks and bookkeeping, with a reduction that does nothing."""

    def all_reduce_avg_async(self, tensors, defer_scale=False, **kwargs):
        self._check_group(tensors, "tensors")
        return CompletedWork()


def bench_average_overhead(reps: int) -> dict:
    shapes = resnet50_shapes()
    towers = [[torch.zeros(s, requires_grad=True) for s in shapes] for _ in range(2)]
    n_params = sum(p.numel() for p in towers[0])
    out = {"tensors": len(shapes), "params": n_params, "towers": 2, "bucket_cap_mb": 25, "first_bucket_mb": 1}

    def simulate_backward(avg: GradientAverager) -> None:
        # What autograd's post-accumulate hooks call, tower after tower, in backward order.
        for t in range(2):
            for i in reversed(range(len(shapes))):
                avg._grad_ready(t, i)

    def step(avg: GradientAverager) -> None:
        simulate_backward(avg)
        avg.average()

    results = {}
    for overlap in (False, True):
        null_avg = GradientAverager(NullLocalCommunicator(2), towers, overlap=overlap)
        # hooks + average() with no reduction: the averager's own per-step cost
        t_null = rounds({"step": lambda: step(null_avg),
                         "hooks_only": lambda: (simulate_backward(null_avg), null_avg._reset_step())}, reps * 20)
        null_avg.close()
        results[f"overlap={overlap}"] = {
            "hooks_plus_average_s": t_null["step"],
            "hooks_s": t_null["hooks_only"],
            "average_call_s": t_null["step"] - t_null["hooks_only"],
        }
    out["null_reduction"] = results
    out["buckets"] = len(null_avg.plan.buckets)

    # real reduction: average() vs the raw all_reduce_avg of the same buckets (includes the memory traffic)
    comm = Communicator.local(2)
    avg = GradientAverager(comm, towers, overlap=False)
    storages = [[avg.bucket_storage(t, b) for t in range(2)] for b in range(len(avg.plan.buckets))]
    t_real = rounds({"average_step": lambda: step(avg),
                     "raw_all_reduce_avg": lambda: [comm.all_reduce_avg(s) for s in storages]}, reps)
    out["real_reduction"] = {**t_real, "difference_s": t_real["average_step"] - t_real["raw_all_reduce_avg"],
                             "reduced_GB_per_s": 2 * avg.plan.total_bytes / t_real["raw_all_reduce_avg"] / 1e9}
    avg.close()
    comm.close()
    return out


def bench_small_buckets(reps: int) -> dict:
    shapes = [s for _ in range(64) for s in ((32, 32), (32,))]
    towers = [[torch.zeros(s, requires_grad=True) for s in shapes] for _ in range(2)]
    comm = Communicator.local(2)
    # a cap below one 4 KiB weight: every parameter is its own bucket
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.004, first_bucket_mb=0.004, overlap=False)
    nb = len(avg.plan.buckets)
    storages = [[avg.bucket_storage(t, b) for t in range(2)] for b in range(nb)]

    def step() -> None:
        for t in range(2):
            for i in reversed(range(len(shapes))):
                avg._grad_ready(t, i)
        avg.average()

    t = rounds({"average_step": step, "raw_all_reduce_avg": lambda: [comm.all_reduce_avg(s) for s in storages]},
               reps * 20)
    avg.close()
    comm.close()
    return {"buckets": nb, "towers": 2, "seconds": t,
            "average_us_per_bucket": t["average_step"] / nb * 1e6,
            "raw_all_reduce_avg_us_per_bucket": t["raw_all_reduce_avg"] / nb * 1e6}


def machine() -> dict:
    cpu = cpu_model(default="")   # no model name: platform.processor()'s answer, even an empty one
    info = ncclavg.build_info()
    return {"cpu": cpu, "cores": os.cpu_count(), "simd_level": info["simd_level"],
            "openmp_threads": info["openmp_threads"], "torch_threads": torch.get_num_threads(),
            "ncclavg": info["version"], "torch": torch.__version__, "python": platform.python_version(),
            "compiler": info["compiler"], "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="100 grads, 3 reps (smoke test)")
    ap.add_argument("--json", "--out", dest="out", default=str(Path(__file__).resolve().parent / "results" / "pack.json"))
    args = ap.parse_args(argv)
    reps = 3 if args.quick else args.reps
    result = {"machine": machine(), "pack": bench_pack(100 if args.quick else 1000, reps),
              "average_overhead": bench_average_overhead(reps), "small_buckets": bench_small_buckets(reps)}

    p = result["pack"]
    print(f"pack of {p['n_grads']} grads, {p['bytes'] / 2**20:.0f} MiB fp32 "
          f"(copy bandwidth {p['copy_bandwidth_GB_per_s']:.2f} GB/s in this run)")
    for k, v in p["seconds"].items():
        print(f"  {k:28s} {v * 1e3:8.2f} ms  {p['GB_per_s_copied'][k]:6.2f} GB/s")
    for k, v in p["ratios"].items():
        print(f"  {k:48s} {v:6.2f}x")
    a = result["average_overhead"]
    print(f"average() on ResNet-50 shapes ({a['tensors']} tensors, {a['params'] / 1e6:.1f} M params, "
          f"{a['buckets']} buckets, 2 local towers)")
    for k, v in a["null_reduction"].items():
        print(f"  {k}: hooks {v['hooks_s'] * 1e3:.3f} ms + average() {v['average_call_s'] * 1e3:.3f} ms "
              f"= {v['hooks_plus_average_s'] * 1e3:.3f} ms per step (reduction excluded)")
    r = a["real_reduction"]
    print(f"  real: average step {r['average_step'] * 1e3:.2f} ms vs raw all_reduce_avg "
          f"{r['raw_all_reduce_avg'] * 1e3:.2f} ms (difference {r['difference_s'] * 1e3:+.2f} ms, noisy; "
          f"{r['reduced_GB_per_s']:.2f} GB/s of towers' buckets)")
    sb = result["small_buckets"]
    print(f"average() with {sb['buckets']} small buckets, 2 local towers: {sb['average_us_per_bucket']:.1f} us "
          f"per bucket, raw all_reduce_avg {sb['raw_all_reduce_avg_us_per_bucket']:.1f} us per bucket")
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
