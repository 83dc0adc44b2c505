#!/usr/bin/env python3
"""GPU benchmarks of ncclavg, each figure next to the best torch way of doing the same work and next
to a bandwidth measured in the same run (bench/gpu_check.sh runs this; it also runs alone).

  copy       device-to-device copy bandwidth: the memory roof the kernels are compared with
  average    ops.average_ of N buffers on one device vs torch stack().mean() + copies back
  pack       ops.pack_/unpack_ of 1000 gradients (100..100k elements) vs torch flatten / unflatten+copy
  allreduce  NcclComm.all_reduce_avg over every visible device: time, algbw, busbw (nccl-tests style:
             busbw = algbw * 2(n-1)/n), #wrong from exact inputs, vs torch.distributed NCCL (one
             process, one device: ReduceOp.AVG, and all_reduce + div_) and cupy.cuda.nccl when
             importable. ncclavg rows: the default collectives (blocking after the bounded init, where
             NCCL allows) and NCCLAVG_NCCL_COLLECTIVES=nonblocking, each with the mode it really ran
             in; on one device also ncclAvg, PreMulSum and SUM + divide forced with
             NCCLAVG_TEST_REDUCTION (the default one-rank average is an in-place sum NCCL skips)
  pinned     pinned host <-> device copies at bucket sizes vs the peak of the same direction

Medians after warm-up; GPU time from CUDA events, host latency from a monotonic clock. Writes JSON
(--out, default $OUT/gpu_bench.json or ./gpu-out/gpu_bench.json) after every section (atomically: a run
killed part way keeps what it measured, the section it was in marked "running") and prints a short table
last.
--dry-run checks the arguments and the plan without touching a GPU and writes JSON marked dry_run.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if (ROOT / "ncclavg" / "__init__.py").exists() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmark the checkout this script belongs to
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# allreduce last: it is the one section that can wait on NCCL (its inits are bounded by --init-timeout);
# each section's result is written as soon as it ends, so a run stopped there keeps the others.
SECTIONS = ("copy", "average", "pack", "pinned", "allreduce")
# See Note [Blocking collectives after a bounded init] in csrc/cuda/comm_init.cpp
MODE_ENV = "NCCLAVG_NCCL_COLLECTIVES"
FORCE_ENV = "NCCLAVG_TEST_REDUCTION"
FORCED = ("avg", "premulsum", "sum_divide")   # the reductions forced on one rank (one GPU)


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 8, 64K, 16M or 1G") from None
    n = int(value * UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0")
    return n


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="check arguments and the plan; no GPU")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections ({', '.join(SECTIONS)})")
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,64M,256M", help="all-reduce sizes in bytes (K/M/G ok)")
    p.add_argument("--copy-size", default="256M", help="buffer size of the copy roofs")
    p.add_argument("--average-size", default="64M", help="bytes per buffer of the average benchmark")
    p.add_argument("--towers", default="2,4,8", help="buffer counts of the average benchmark")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--init-timeout", type=float, default=20.0,
                   help="seconds each NCCL communicator's init may take (allreduce section)")
    a = p.parse_args(argv)
    try:
        a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
        a.copy_size = parse_size(a.copy_size)
        a.average_size = parse_size(a.average_size)
        a.towers = [int(t) for t in a.towers.split(",") if t.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    if not a.sizes:
        p.error("--sizes: give at least one size")
    if any(s not in SECTIONS for s in a.only):
        p.error(f"--only: unknown section in {a.only}; choose from {', '.join(SECTIONS)}")
    if not a.towers or any(t < 1 or t > 256 for t in a.towers):
        p.error("--towers: each count must be in 1..256")
    if a.iters < 1:
        p.error("--iters must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if not a.init_timeout > 0:
        p.error("--init-timeout must be > 0 seconds")
    if a.out is None:
        a.out = str(Path(os.environ.get("OUT") or "gpu-out") / "gpu_bench.json")
    return a


# ---- timing -----------------------------------------------------------------------------------------

def gpu_ms(torch, fn, iters, warmup):
    """Median GPU time (ms) of fn() on the current stream, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, sync, iters, warmup, batched):
    """Median host time (us) per call: `batched` enqueues all iterations then syncs once (nccl-tests'
    time), otherwise every call is followed by sync (the latency a caller sees)."""
    for _ in range(warmup):
        fn()
    sync()
    if batched:
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            reps.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(reps)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


# ---- sections ---------------------------------------------------------------------------------------

def bench_copy(torch, a, res):
    n = a.copy_size // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = gpu_ms(torch, lambda: dst.copy_(src), a.iters, a.warmup)
    bw = gbps(2 * a.copy_size, ms)  # read + write
    res["rows"].append({"what": "d2d copy", "bytes": a.copy_size, "time_us": ms * 1e3, "gbps": bw})
    return bw


def bench_average(torch, a, res, copy_bw):
    from ncclavg import ops

    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        numel = a.average_size // torch.empty((), dtype=dt).element_size()
        for n in a.towers:
            bufs = [torch.randn(numel, device="cuda").to(dt) for _ in range(n)]
            moved = 2 * n * a.average_size  # every buffer read once and written once

            def torch_way(bufs=bufs, n=n):   # bound now: the loop rebinds and deletes bufs
                m = torch.stack(bufs).mean(0)
                torch._foreach_copy_(bufs, [m] * n)

            ours = gpu_ms(torch, lambda bufs=bufs: ops.average_(bufs), a.iters, a.warmup)
            theirs = gpu_ms(torch, torch_way, a.iters, a.warmup)
            res["rows"].append({
                "what": f"average_ N={n} {dtype}", "bytes_per_buffer": a.average_size, "time_us": ours * 1e3,
                "gbps": gbps(moved, ours), "pct_of_copy_bw": 100 * gbps(moved, ours) / copy_bw,
                "torch_time_us": theirs * 1e3, "speedup_vs_torch": theirs / ours})
            del bufs
    torch.cuda.empty_cache()


def bench_pack(torch, a, res, copy_bw):
    from ncclavg import ops

    if not hasattr(ops, "pack_"):
        res["status"], res["reason"] = "skipped", "ncclavg.ops.pack_ is not in this checkout"
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    gen = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(100, 100_001, (1000,), generator=gen)]
    grads = [torch.randn(s, device="cuda") for s in sizes]
    offs, used = [], 0
    for s in sizes:
        used = (used + 63) // 64 * 64  # 256-byte aligned slots, as BucketPlan lays them out
        offs.append(used)
        used += s
    bucket = torch.empty((used + 63) // 64 * 64, device="cuda")
    moved = 2 * 4 * sum(sizes)
    flat = _flatten_dense_tensors(grads)
    rows = [
        ("pack_ 1000 grads", lambda: ops.pack_(grads, bucket, offs),
         lambda: _flatten_dense_tensors(grads)),
        ("unpack_ 1000 grads", lambda: ops.unpack_(bucket, grads, offs),
         lambda: torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))),
    ]
    for what, ours_fn, torch_fn in rows:
        ours = gpu_ms(torch, ours_fn, a.iters, a.warmup)
        theirs = gpu_ms(torch, torch_fn, a.iters, a.warmup)
        res["rows"].append({"what": what, "bytes": 4 * sum(sizes), "time_us": ours * 1e3, "gbps": gbps(moved, ours),
                            "pct_of_copy_bw": 100 * gbps(moved, ours) / copy_bw, "torch_time_us": theirs * 1e3,
                            "speedup_vs_torch": theirs / ours})


@contextlib.contextmanager
def env_var(name, value):
    """os.environ[name] = value inside the block (the core reads it with getenv), restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def bench_allreduce(torch, a, res):
    from ncclavg import _ext

    n = torch.cuda.device_count()
    NcclComm = _ext.nccl_comm_class()
    comm = NcclComm.init_all(list(range(n)), a.init_timeout)
    res["n"] = n
    res["nccl"] = _ext.nccl_info()["version"]
    res["collective_mode"] = comm.collective_mode
    res["collective_mode_reason"] = comm.collective_mode_reason
    # The same collectives on non-blocking communicators, side by side: what the blocking split saves.
    comms = {"ncclavg": comm}
    try:
        with env_var(MODE_ENV, "nonblocking"):
            comms["ncclavg nonblocking"] = NcclComm.init_all(list(range(n)), a.init_timeout)
        res["nonblocking_collective_mode"] = comms["ncclavg nonblocking"].collective_mode
        res["nonblocking_collective_mode_reason"] = comms["ncclavg nonblocking"].collective_mode_reason
    except Exception as e:  # recorded, not fatal: the default row still runs
        res.setdefault("peer_errors", {})["ncclavg nonblocking"] = f"{type(e).__name__}: {e}"
    if n == 1:
        # The mean of one rank is its input, so the default communicator runs a plain in-place ncclSum,
        # which NCCL skips: force NCCL's real one-rank kernels (and ours for SUM + divide), each a
        # communicator of its own. See Note [Forcing the reduction in tests] in comm_collectives.cpp.
        for kind in FORCED:
            name = f"ncclavg {kind} (forced)"
            try:
                with env_var(FORCE_ENV, kind):
                    comms[name] = NcclComm.init_all([0], a.init_timeout)
            except Exception as e:  # e.g. an NCCL without ncclAvg / PreMulSum
                res.setdefault("peer_errors", {})[name] = f"{type(e).__name__}: {e}"
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    try:
        allreduce_rows(torch, a, res, n, comms)
    finally:
        for c in comms.values():
            c.destroy()
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()   # made for the torch rows: not left to interpreter exit
    torch.cuda.empty_cache()


def allreduce_rows(torch, a, res, n, comms):
    from ncclavg.buffers import as_buffers

    factor = 2 * (n - 1) / n
    streams = [int(torch.cuda.current_stream(d).cuda_stream) for d in range(n)]

    def sync_all():
        for d in range(n):
            torch.cuda.synchronize(d)

    peers = {}
    if n == 1:
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            peers["torch.distributed"] = dist   # ReduceOp.AVG where torch has it
            peers["torch.distributed sum+div_"] = dist   # all_reduce, then div_ (DDP's default hook)
        except Exception as e:  # recorded, not fatal
            res.setdefault("peer_errors", {})["torch.distributed"] = f"{type(e).__name__}: {e}"
    else:
        res.setdefault("peer_errors", {})["torch.distributed"] = "needs one process per device; not run"
    try:
        from cupy.cuda import nccl as cnccl

        peers["cupy.cuda.nccl"] = (cnccl, cnccl.NcclCommunicator.initAll(list(range(n))))
    except Exception as e:
        res.setdefault("peer_errors", {})["cupy.cuda.nccl"] = f"{type(e).__name__}: {e}"

    for size in a.sizes:
        count = max(1, size // 4)
        ts = [torch.empty((count,), device=f"cuda:{d}") for d in range(n)]
        bufs = as_buffers(ts)
        for name, comm in comms.items():
            # #wrong: one fresh exact all-reduce (2, 4, ..., 2n average to n + 1 exactly for SUM+divide and
            # for power-of-two n; a 1/n pre-multiply may round, hence the relative slack)
            for d, t in enumerate(ts):
                t.fill_(2.0 * (d + 1))
            comm.all_reduce_avg(bufs, streams)
            comm.wait()
            wrong = sum(int((t - (n + 1)).abs().gt(1e-6 * (n + 1)).sum().item()) for t in ts)

            def ours(comm=comm, bufs=bufs, streams=streams):
                comm.all_reduce_avg(bufs, streams)

            t_batch = host_us(ours, comm.wait, a.iters, a.warmup, batched=True)
            t_lat = host_us(ours, comm.wait, a.iters, a.warmup, batched=False)
            algbw = size / (t_batch * 1e-6) / 1e9
            res["rows"].append({"contender": name, "size_bytes": count * 4, "count": count, "n": n,
                                "time_us": t_batch, "latency_us": t_lat, "algbw_gbps": algbw,
                                "busbw_gbps": algbw * factor, "wrong": wrong, "redop": comm.reduction(0),
                                "collective_mode": comm.collective_mode})
        for name, peer in peers.items():
            if name.startswith("torch.distributed"):
                dist = peer
                op = getattr(dist.ReduceOp, "AVG", None) if name == "torch.distributed" else None
                fn = (lambda ts=ts: dist.all_reduce(ts[0], op=op)) if op is not None else \
                    (lambda ts=ts: (dist.all_reduce(ts[0]), ts[0].div_(n)))
            else:
                cnccl, ccomms = peer
                cop = getattr(cnccl, "NCCL_AVG", None)

                def fn(cnccl=cnccl, ccomms=ccomms, cop=cop, ts=ts):
                    cnccl.groupStart()
                    for d, c in enumerate(ccomms):
                        c.allReduce(ts[d].data_ptr(), ts[d].data_ptr(), count, cnccl.NCCL_FLOAT32,
                                    cop if cop is not None else cnccl.NCCL_SUM, streams[d])
                    cnccl.groupEnd()
                    if cop is None:
                        for t in ts:
                            t.div_(n)
            try:
                tb = host_us(fn, sync_all, a.iters, a.warmup, batched=True)
                tl = host_us(fn, sync_all, a.iters, a.warmup, batched=False)
                ab = size / (tb * 1e-6) / 1e9
                res["rows"].append({"contender": name, "size_bytes": count * 4, "count": count, "n": n,
                                    "time_us": tb, "latency_us": tl, "algbw_gbps": ab, "busbw_gbps": ab * factor})
            except Exception as e:
                res.setdefault("peer_errors", {})[name] = f"{type(e).__name__}: {e}"
        del ts, bufs


def bench_pinned(torch, a, res):
    sizes = sorted({1 << 20, 4 << 20, 25 << 20, a.copy_size})
    host = torch.empty(a.copy_size // 4, pin_memory=True)
    dev = torch.empty(a.copy_size // 4, device="cuda")
    peak = {}
    for direction in ("h2d", "d2h"):
        for size in sizes:
            n = size // 4
            h, d = host[:n], dev[:n]
            fn = (lambda: d.copy_(h, non_blocking=True)) if direction == "h2d" else \
                (lambda: h.copy_(d, non_blocking=True))
            ms = gpu_ms(torch, fn, a.iters, a.warmup)
            bw = gbps(size, ms)
            peak[direction] = max(peak.get(direction, 0.0), bw)
            res["rows"].append({"what": f"pinned {direction}", "bytes": size, "time_us": ms * 1e3, "gbps": bw})
    for row in res["rows"]:
        row["pct_of_peak"] = 100 * row["gbps"] / peak[row["what"].split()[1]]
    res["peak_gbps"] = peak


# ---- driver -----------------------------------------------------------------------------------------

def header(dry_run):
    h = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "machine": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
         "dry_run": dry_run}
    try:
        import ncclavg

        info = ncclavg.build_info()
        h.update(ncclavg=info["version"], cuda_built=info["cuda"], cuda_archs=info["cuda_archs"],
                 cuda_runtime=info["cuda_runtime"], driver=info["driver"], devices=info["devices"],
                 nccl=info["nccl"].get("version") or "not found", nccl_path=info["nccl"].get("path", ""),
                 torch=info["torch"], cupy=info["cupy"])
    except Exception as e:
        h["ncclavg_error"] = f"{type(e).__name__}: {e}"
    return h


def table(doc) -> str:
    lines = [f"ncclavg GPU bench  {doc['header'].get('date', '')}  devices: "
             f"{', '.join(doc['header'].get('devices', []) or ['none'])}  NCCL {doc['header'].get('nccl', '?')}"]
    if doc["header"]["dry_run"]:
        lines.append("DRY RUN (no GPU touched): planned sections")
        for name, sec in doc["sections"].items():
            lines.append(f"  {name:<10} {sec['plan']}")
        return "\n".join(lines)
    for name, sec in doc["sections"].items():
        if sec["status"] != "ok":
            lines.append(f"  {name:<10} {sec['status'].upper()}: {sec.get('reason', '')}".rstrip())
            continue
        for r in sec["rows"]:
            if name == "allreduce":
                lines.append(f"  {name:<10} {r['contender']:<20} {r['size_bytes']:>11} B  {r['time_us']:9.1f} us  "
                             f"lat {r['latency_us']:9.1f} us  busbw {r['busbw_gbps']:7.2f} GB/s"
                             + (f"  #wrong {r['wrong']}" if "wrong" in r else ""))
            else:
                extra = ""
                if "pct_of_copy_bw" in r:
                    extra = f"  {r['pct_of_copy_bw']:5.1f}% of copy  x{r['speedup_vs_torch']:.2f} vs torch"
                elif "pct_of_peak" in r:
                    extra = f"  {r['pct_of_peak']:5.1f}% of peak"
                lines.append(f"  {name:<10} {r['what']:<24} {r['gbps']:8.1f} GB/s  {r['time_us']:10.1f} us{extra}")
    return "\n".join(lines)


def plan(a):
    return {
        "copy": f"d2d copy of {a.copy_size} B",
        "average": f"average_ of N={a.towers} buffers of {a.average_size} B, float32+bfloat16, vs torch",
        "pack": "pack_/unpack_ of 1000 grads (100..100k elements) vs torch flatten/unflatten",
        "allreduce": f"all_reduce_avg sizes {a.sizes} B over all visible devices, default and {MODE_ENV}="
                     f"nonblocking collectives (one device: also {FORCE_ENV}={'/'.join(FORCED)}), vs "
                     "torch.distributed (AVG, and SUM + div_), cupy",
        "pinned": f"pinned h2d/d2h at 1M, 4M, 25M, {a.copy_size} B vs peak",
    }


def write_doc(out: Path, doc: dict) -> None:
    """The JSON in one piece: a temporary file renamed over the old one, so a kill never leaves half."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, out)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    doc = {"header": header(a.dry_run), "arguments": {k: v for k, v in vars(a).items()}, "sections": {}}
    if a.dry_run:
        for name in a.only:
            doc["sections"][name] = {"status": "planned", "plan": plan(a)[name]}
        if "ncclavg_error" in doc["header"]:
            doc["sections"] = {n: {"status": "error", "plan": plan(a)[n], "reason": doc["header"]["ncclavg_error"]}
                               for n in a.only}
        elif not doc["header"].get("cuda_built", False):
            doc["header"]["note"] = "this build has no CUDA part: a real run would fail"
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_bench: no CUDA device visible to torch", file=sys.stderr)
            return 1
        doc["header"]["device"] = torch.cuda.get_device_name(0)
        copy_bw = None
        for name in a.only:
            sec = doc["sections"][name] = {"status": "running", "rows": []}
            write_doc(out, doc)   # a run killed in this section says where it stopped
            t0 = time.perf_counter()
            try:
                if name == "copy" or (copy_bw is None and name in ("average", "pack")):
                    copy_bw = bench_copy(torch, a, sec if name == "copy" else {"rows": []})
                if name == "average":
                    bench_average(torch, a, sec, copy_bw)
                elif name == "pack":
                    bench_pack(torch, a, sec, copy_bw)
                elif name == "allreduce":
                    bench_allreduce(torch, a, sec)
                elif name == "pinned":
                    bench_pinned(torch, a, sec)
                if sec["status"] == "running":   # a section may have said "skipped" itself
                    sec["status"] = "ok"
            except Exception as e:  # one failing section must not cost the others
                sec["status"], sec["reason"] = "error", f"{type(e).__name__}: {e}"
                sec["traceback"] = traceback.format_exc()
            sec["seconds"] = time.perf_counter() - t0
            write_doc(out, doc)
    write_doc(out, doc)
    print(table(doc))
    print(f"wrote {out}")
    return 0 if all(s["status"] in ("ok", "skipped", "planned") for s in doc["sections"].values()) else 1



if __name__ == "__main__":
    sys.exit(main())
