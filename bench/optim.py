"""CPU optimizer step benchmark: ncclavg's fused core vs torch.optim (and DeepSpeed's CPU Adam when it
is importable), all with the same thread count, timed in interleaved rounds (medians after warm-up).

    python bench/optim.py                      # 8M and 64M params -> bench/results/optim-<machine>-<date>.json
    python bench/optim.py --sizes 1M --reps 3  # quick
    python bench/optim.py --simd all --towers 1,4,8 --grad-dtypes bf16,fp16   # every SIMD level side by side

Cases, per size:
  (a) "adamw": CPUAdamW.step on fp32 params with fp32 grads vs torch.optim.AdamW(fused=True) and
      (foreach=True) [and DeepSpeedCPUAdam]. ncclavg runs three times: with its default (no inf/NaN
      check, the same work as torch's), with skip_nonfinite=True (a read-only first pass over the grads),
      and with skip_nonfinite=True fed by the averaging path: the grads are views of a flat bucket whose
      last pass (the averager's division of a sum by the processes, ops.unpack_) noted their finiteness,
      given to step(grads_finite=...), so the check reads nothing (Note [Finiteness of the averaged
      gradients] in ncclavg/averager.py).
  (b) "avgN": average N tower gradients (--towers, bfloat16 or float16: --grad-dtypes) + AdamW + a copy-out
      of the params in the towers' dtype, MasterWeights.step(towers, out=...) vs the best of several torch
      sequences doing the same work (sum the towers into an fp32 grad, fused AdamW, cast the params).
      ncclavg runs with its default inf/NaN check (the scan), without it (skip_nonfinite=False), and with
      it fed by the pass that wrote the towers' buckets (the core's checked pack of each tower's fp32
      gradient into its 16-bit bucket, as a grad_dtype bucket is filled or a device gradient copied:
      step(grads_finite=...)); "check cost" is the share of the checked step's time that the check adds.
  At the end, the targets of the free check side by side: the fed CPUAdamW vs torch's fused AdamW, the
  check's cost per tower count, and the fed fused MasterWeights.step against the copy bandwidth.
  (c) every ncclavg row relates its achieved bandwidth (bytes read + written, each stream counted once)
      to a plain copy moving as many bytes (the fastest of torch copy_, numpy copyto and ncclavg's cast_copy,
      same threads, timed in the same interleaved rounds as the steps), to a plain read of as many bytes
      (torch.sum, ncclavg grad_stats) and to a STREAM triad (torch.add(b, c, alpha, out=a)), the last two
      measured right after.
  --simd all runs ncclavg's contenders once per SIMD level the CPU has (scalar, avx2, avx512; scalar, neon, sve on aarch64), switched
  call by call inside the same interleaved rounds, so each level's ratios come from the same run; every
  row names its level.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 8M or 1000000")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8M,64M", help="comma-separated parameter counts (default 8M,64M)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every contender")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--towers", default="4", help="comma-separated tower counts for case (b) (default 4)")
    ap.add_argument("--grad-dtypes", default="bf16", help="tower gradient dtypes for case (b): bf16, fp16 "
                    "(comma-separated; default bf16)")
    ap.add_argument("--simd", default="auto", help="SIMD levels of ncclavg's kernels: auto (the default "
                    "choice), all (every level this CPU has), or a comma-separated list")
    ap.add_argument("--no-adamw", action="store_true", help="skip case (a)")
    ap.add_argument("--json", default=None, help="output path (default bench/results/optim-<machine>-<date>.json)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    args = ap.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    try:
        args.tower_list = [int(t) for t in args.towers.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--towers: {args.towers!r} is not a comma-separated list of integers")
    args.dtype_list = [d.strip() for d in args.grad_dtypes.split(",") if d.strip()]
    if any(d not in ("bf16", "fp16") for d in args.dtype_list) or not args.dtype_list:
        ap.error("--grad-dtypes: use bf16 and/or fp16")
    if args.threads < 1 or args.reps < 1 or args.warmup < 0 or not args.tower_list or min(args.tower_list) < 1:
        ap.error("--threads, --reps, --towers must be >= 1 and --warmup >= 0")
    return args


args = parse_args()
# One OpenMP runtime serves torch and ncclavg in this process: fix its thread count before either starts.
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
import ncclavg  # noqa: E402
from ncclavg import MasterWeights  # noqa: E402
from ncclavg.buffers import as_buffer  # noqa: E402
from ncclavg.bench.report import cpu_model  # noqa: E402
from ncclavg.optim import CPUAdamW  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import UNKNOWN_CPU  # noqa: E402

torch.set_num_threads(args.threads)


def simd_levels() -> list:
    """The SIMD levels asked for (--simd), each checked against this CPU."""
    have = list(ncclavg._C.simd_levels_supported())
    if args.simd == "auto":
        return [ncclavg._C.simd_level()]
    if args.simd == "all":
        return have
    levels = [lv.strip() for lv in args.simd.split(",") if lv.strip()]
    missing = [lv for lv in levels if lv not in have]
    if missing:
        sys.exit(f"--simd: this CPU does not support {', '.join(missing)} (it has {', '.join(have)})")
    return levels


LEVELS = simd_levels()


def at_level(level: str, fn):
    """fn run with ncclavg's kernels at `level` (one cheap call into the core before each step)."""
    def run():
        ncclavg._C.set_simd_level(level)
        return fn()
    return run


def machine_slug() -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model(UNKNOWN_CPU).lower()).strip("-")
    slug = re.sub(r"-(r|tm|cpu|processor)(?=-|$)", "", slug)
    return f"{slug[:40].strip('-')}-{os.cpu_count()}c"


def timed(contenders: dict, isolated: tuple = ()) -> dict:
    """Medians: the contenders run interleaved, except those in `isolated` (they allocate and free large
    temporaries every step, which slows whatever runs next), which are timed after, one at a time."""
    med = interleaved({k: f for k, f in contenders.items() if k not in isolated}, args.reps, args.warmup)
    for k in isolated:
        med.update(interleaved({k: contenders[k]}, args.reps, args.warmup))
    return med


def interleaved(contenders: dict, reps: int, warmup: int) -> dict:
    """Median seconds per contender, each round running every contender once (outside load hits all)."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times = {name: [] for name in contenders}
    for _ in range(reps):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_contenders(nbytes_moved: int) -> dict:
    """Plain copies moving `nbytes_moved` bytes (half read, half written): torch copy_, numpy copyto and
    ncclavg's own fp32 cast_copy (at the best level), so the reference is this machine's copy speed and
    not one library's. They run in the same interleaved rounds as the step they are the reference of
    (a load that comes and goes hits both); the fastest median is the copy time."""
    import numpy as np

    n = max(1, nbytes_moved // 8)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    bs, bd = as_buffer(src), as_buffer(dst)
    best = ncclavg._C.simd_levels_supported()[-1]
    return {"copy:torch": lambda: dst.copy_(src), "copy:numpy": lambda: np.copyto(dst.numpy(), src.numpy()),
            "copy:ncclavg": at_level(best, lambda: ncclavg._C.cast_copy([bs], [bd]))}


def copy_seconds(med: dict) -> float:
    return min(v for k, v in med.items() if k.startswith("copy:"))


def read_seconds(nbytes_read: int, reps: int) -> float:
    """Time of the fastest plain read of `nbytes_read` bytes of fp32 (torch.sum, ncclavg grad_stats):
    a second reference, closer to a step's mix (mostly reads, stores to lines just read)."""
    n = max(1, nbytes_read // 4)
    src = torch.ones(n, dtype=torch.float32)
    bs = as_buffer(src)
    med = interleaved({"torch": lambda: src.sum(), "ncclavg": lambda: ncclavg._C.grad_stats([[bs]])}, reps, 2)
    return min(med.values())


def triad_seconds(nbytes_moved: int, reps: int) -> float:
    """Time of a STREAM-triad a = b + s*c (two read streams, one write) moving `nbytes_moved` bytes:
    several streams in flight, the access pattern closest to an optimizer step."""
    n = max(1, nbytes_moved // 12)
    b, c = torch.ones(n), torch.ones(n)
    a = torch.empty(n)
    return interleaved({"triad": lambda: torch.add(b, c, alpha=0.5, out=a)}, reps, 2)["triad"]


def shapes_for(total: int) -> list:
    """A model-like mix: 1M-element matrices, a remainder, and small odd-sized vectors."""
    small = [4097, 1000, 768, 17, 3]
    rest = total - sum(small)
    shapes = [(1024, 1024)] * (rest // (1 << 20))
    if rest % (1 << 20):
        shapes.append((rest % (1 << 20),))
    return shapes + [(s,) for s in small]


def deepspeed_adam():
    if args.no_deepspeed:
        return None, "skipped (--no-deepspeed)"
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}"
    except Exception as e:  # not installed, or its op cannot be built here
        return None, f"not available: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def bandwidth_refs(nbytes: int, copy_s: float) -> dict:
    """The references of (c) for a step moving `nbytes` (its bytes without an inf/NaN check): the copy
    timed with the step (copy_s), the read and the triad right after, with ncclavg's own contenders
    (grad_stats) at the best level this CPU has."""
    ncclavg._C.set_simd_level(ncclavg._C.simd_levels_supported()[-1])
    read_s = read_seconds(nbytes, args.reps)
    triad_s = triad_seconds(nbytes, args.reps)
    return {"bytes_ref": nbytes, "copy_gbps": nbytes / copy_s / 1e9, "read_gbps": nbytes / read_s / 1e9,
            "triad_gbps": nbytes / triad_s / 1e9}


def bandwidth_fields(t: float, nbytes: int, refs: dict) -> dict:
    gbps = nbytes / t / 1e9
    return {"bytes": nbytes, "gbps": gbps, "copy_gbps": refs["copy_gbps"],
            "copy_time_us": nbytes / refs["copy_gbps"] / 1e3, "fraction_of_copy_bw": gbps / refs["copy_gbps"],
            "read_gbps": refs["read_gbps"], "fraction_of_read_bw": gbps / refs["read_gbps"],
            "triad_gbps": refs["triad_gbps"], "fraction_of_triad_bw": gbps / refs["triad_gbps"]}


def averaged_grads(shapes: list, gen: torch.Generator) -> tuple:
    """Gradients as the averager leaves them with one tower per process: views of a flat bucket that held
    the sum over 2 processes, divided in place by its last pass, which noted their finiteness. Returns
    (grads, finite)."""
    numel = [math.prod(s) for s in shapes]
    flat = torch.empty(sum(numel))
    flat.copy_(torch.randn(flat.numel(), generator=gen) * 2e-2)   # the sum of 2 processes' gradients
    finite = ncclavg.ops.unpack_(flat, [flat], [0], divisor=2.0, check_finite=True)
    grads, pos = [], 0
    for s, n in zip(shapes, numel):
        grads.append(flat[pos:pos + n].view(s))
        pos += n
    return grads, finite


def case_adamw(size: int, ds_cls) -> list:
    gen = torch.Generator().manual_seed(0)
    shapes = shapes_for(size)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads, finite = averaged_grads(shapes, gen)
    assert finite is True

    def params():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(ps, grads):
            p.grad = g  # read-only for every contender: one shared set of gradients
        return ps

    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    # One optimizer per variant, stepped at every level in turn: the levels compute the same bits.
    ours = {"ncclavg": CPUAdamW(params(), **hp), "ncclavg_check": CPUAdamW(params(), skip_nonfinite=True, **hp)}
    contenders = {f"{name}@{lv}": at_level(lv, opt.step) for lv in LEVELS for name, opt in ours.items()}
    fed = CPUAdamW(params(), skip_nonfinite=True, **hp)
    contenders.update({f"ncclavg_fed@{lv}": at_level(lv, lambda: fed.step(grads_finite=finite)) for lv in LEVELS})
    theirs = {"torch_fused": torch.optim.AdamW(params(), fused=True, **hp),
              "torch_foreach": torch.optim.AdamW(params(), foreach=True, **hp)}
    if ds_cls is not None:
        theirs["deepspeed"] = ds_cls(params(), adamw_mode=True, **hp)
    contenders.update({k: o.step for k, o in theirs.items()})
    bytes_nocheck = size * 28  # param r/w, exp_avg r/w, exp_avg_sq r/w, grad r (fp32)
    bytes_check = size * 32    # + the first pass reading the grads again
    med = timed({**contenders, **copy_contenders(bytes_nocheck)}, isolated=("torch_foreach",))
    refs = bandwidth_refs(bytes_nocheck, copy_seconds(med))
    best_torch = min(med["torch_fused"], med["torch_foreach"])
    rows = []
    labels = {"ncclavg": " (default, no inf/NaN check: torch's work)", "ncclavg_check": " (skip_nonfinite=True)",
              "ncclavg_fed": " (skip_nonfinite=True, fed by the averaging path)"}
    for lv in LEVELS:
        for name, nbytes in (("ncclavg", bytes_nocheck), ("ncclavg_check", bytes_check),
                             ("ncclavg_fed", bytes_nocheck)):
            t = med[f"{name}@{lv}"]
            row = {
                "case": f"adamw {size_label(size)} params: CPUAdamW.step" + labels[name], "variant": name,
                "simd": lv, "size": size, "tensors": len(shapes), "time_us": t * 1e6,
                "torch_time_us": best_torch * 1e6,
                "torch_fused_us": med["torch_fused"] * 1e6, "torch_foreach_us": med["torch_foreach"] * 1e6,
                "speedup_vs_torch": best_torch / t, "speedup_vs_torch_fused": med["torch_fused"] / t,
                "speedup_vs_torch_foreach": med["torch_foreach"] / t, **bandwidth_fields(t, nbytes, refs),
            }
            if name != "ncclavg":
                row["check_cost"] = 1.0 - med[f"ncclavg@{lv}"] / t
            if "deepspeed" in med:
                row["deepspeed_us"] = med["deepspeed"] * 1e6
                row["speedup_vs_deepspeed"] = med["deepspeed"] / t
            rows.append(row)
    return rows


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def case_avg_step_cast(size: int, n: int, dname: str) -> list:
    dtype = DTYPES[dname]
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(size, generator=gen)
    towers = [(torch.randn(size, generator=gen) * 1e-2).to(dtype) for _ in range(n)]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

    mw = MasterWeights([init], optimizer="adamw", pin=False, **hp)
    mw_nocheck = MasterWeights([init], optimizer="adamw", pin=False, skip_nonfinite=False, **hp)
    mw_fed = MasterWeights([init], optimizer="adamw", pin=False, **hp)
    out = torch.empty(mw.flat[0].numel(), dtype=dtype)
    out2 = torch.empty_like(out)
    out3 = torch.empty_like(out)
    tower_lists = [[t] for t in towers]
    # the towers' buckets as a checked pass writes them: each tower's fp32 gradient packed (cast) into its
    # 16-bit bucket by the core, which notes whether it wrote an inf/NaN
    fed_towers = [torch.empty(size, dtype=dtype) for _ in range(n)]
    fed_flags = [ncclavg.ops.pack_([t.float()], b, [0], check_finite=True) for t, b in zip(towers, fed_towers)]
    fed_finite = all(f is True for f in fed_flags)
    assert fed_finite and all(torch.equal(a, b) for a, b in zip(fed_towers, towers))
    fed_lists = [[t] for t in fed_towers]

    p = torch.nn.Parameter(init.clone())
    g = torch.empty(size)
    p.grad = g
    opt = torch.optim.AdamW([p], fused=True, **hp)
    tout = torch.empty(size, dtype=dtype)

    def torch_add_chain():
        g.copy_(towers[0])
        for t in towers[1:]:
            g.add_(t)
        if n > 1:
            g.mul_(1.0 / n)
        opt.step()
        tout.copy_(p.detach())

    def torch_stack_sum():
        torch.sum(torch.stack(towers), 0, dtype=torch.float32, out=g)
        g.mul_(1.0 / n)
        opt.step()
        tout.copy_(p.detach())

    contenders = {}
    for lv in LEVELS:
        contenders[f"ncclavg@{lv}"] = at_level(lv, lambda: mw.step(tower_lists, out=out))
        contenders[f"ncclavg_nocheck@{lv}"] = at_level(lv, lambda: mw_nocheck.step(tower_lists, out=out2))
        contenders[f"ncclavg_fed@{lv}"] = at_level(lv, lambda: mw_fed.step(fed_lists, out=out3,
                                                                           grads_finite=fed_finite))
    contenders["torch_add_chain"] = torch_add_chain
    isolated = ()
    if n > 1:  # one tower: nothing to stack
        contenders["torch_stack_sum"] = torch_stack_sum
        isolated = ("torch_stack_sum",)
    bytes_nocheck = size * (24 + 2 * n + 2)  # p, m, v r/w (fp32), n 16-bit grads read, 16-bit copy-out written
    bytes_check = bytes_nocheck + size * 2 * n  # + the inf/NaN scan reading the grads once more
    med = timed({**contenders, **copy_contenders(bytes_nocheck)}, isolated=isolated)
    best_name = min((k for k in ("torch_add_chain", "torch_stack_sum") if k in med), key=med.get)
    best = med[best_name]
    refs = bandwidth_refs(bytes_nocheck, copy_seconds(med))
    rows = []
    labels = {"ncclavg": " (inf/NaN check on, default)", "ncclavg_nocheck": " (skip_nonfinite=False)",
              "ncclavg_fed": " (check on, fed by the pass)"}
    for lv in LEVELS:
        for name, nbytes in (("ncclavg", bytes_check), ("ncclavg_nocheck", bytes_nocheck),
                             ("ncclavg_fed", bytes_nocheck)):
            t = med[f"{name}@{lv}"]
            row = {
                "case": f"avg{n}x{dname}+adamw+{dname}-out {size_label(size)}: MasterWeights.step" + labels[name],
                "variant": name,
                "simd": lv, "size": size, "towers": n, "grad_dtype": dname, "time_us": t * 1e6,
                "torch_time_us": best * 1e6, "torch_best": best_name,
                "torch_add_chain_us": med["torch_add_chain"] * 1e6,
                "torch_stack_sum_us": med["torch_stack_sum"] * 1e6 if "torch_stack_sum" in med else None,
                "speedup_vs_torch": best / t, **bandwidth_fields(t, nbytes, refs),
            }
            if name != "ncclavg_nocheck":
                row["check_cost"] = 1.0 - med[f"ncclavg_nocheck@{lv}"] / t
            rows.append(row)
    return rows


def print_targets(rows: list) -> None:
    """The free check's targets, side by side: the fed CPUAdamW vs torch's fused AdamW (>= 1.0x), the
    check's cost as a share of the fed fused step per tower count (<= 3% at 1 tower, <= 5% at 4 and 8),
    and the fed fused MasterWeights.step's bandwidth over the copy of the same run (>= 100% at 4 and 8)."""
    print("targets of the free inf/NaN check (fed by the pass that wrote the gradients; the scan in brackets):")
    for lv in LEVELS:
        fed = [r for r in rows if r["simd"] == lv and r.get("variant") == "ncclavg_fed"]
        scan = {(r["size"], r.get("towers"), r.get("grad_dtype")): r for r in rows
                if r["simd"] == lv and r.get("variant") in ("ncclavg_check", "ncclavg")
                and r.get("check_cost") is not None}
        for r in fed:
            key = (r["size"], r.get("towers"), r.get("grad_dtype"))
            old = scan.get(key)
            if "towers" not in r:
                print(f"  {lv:>6} CPUAdamW(skip_nonfinite=True) {size_label(r['size']):>4}: "
                      f"{r['speedup_vs_torch_fused']:.2f}x torch fused AdamW (target >= 1.00)"
                      + (f" [scan {old['speedup_vs_torch_fused']:.2f}x]" if old else ""))
            else:
                goal = 0.03 if r["towers"] == 1 else 0.05
                print(f"  {lv:>6} MasterWeights.step {r['towers']} x {r['grad_dtype']} {size_label(r['size']):>4}: "
                      f"check cost {r['check_cost']:+.1%} (target <= {goal:.0%})"
                      + (f" [scan {old['check_cost']:+.1%}]" if old else "")
                      + f", {r['fraction_of_copy_bw']:.0%} of copy bw (target >= 100% at 4 and 8 towers)"
                      + (f" [scan {old['fraction_of_copy_bw']:.0%}]" if old else ""))


def size_label(n: int) -> str:
    return f"{n / 2**20:g}M" if n % 2**17 == 0 else str(n)


def main() -> int:
    ds_cls, ds_note = deepspeed_adam()
    info = ncclavg.build_info()
    header = {
        "benchmark": "optim",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_slug(), "cpu": cpu_model(UNKNOWN_CPU), "cpu_count": os.cpu_count(),
        "threads": args.threads, "omp_threads_core": ncclavg._C.core_info()["openmp_threads"],
        "python": platform.python_version(), "torch": torch.__version__, "ncclavg": ncclavg.__version__,
        "simd_level": info.get("simd_level") if isinstance(info, dict) else None,
        "simd_levels": LEVELS, "simd_levels_supported": list(ncclavg._C.simd_levels_supported()),
        "deepspeed": ds_note, "reps": args.reps, "warmup": args.warmup, "sizes": args.size_list,
        "towers": args.tower_list, "grad_dtypes": args.dtype_list,
        "bytes_convention": "bytes read + bytes written per step, each stream once (an inf/NaN check reads the "
                            "gradients once more and counts them again); copy_gbps: the fastest of "
                            "torch copy_, numpy copyto and ncclavg cast_copy on fp32 moving the same bytes (half "
                            "read, half written), same threads, timed in the steps' interleaved rounds; read "
                            "and triad references right after. A copy's stores cost a read for "
                            "ownership on x86 while the optimizer rewrites lines it has just read, so a step can "
                            "exceed 100% of copy",
        "timing": "medians of --reps rounds after --warmup; contenders interleaved round by round (each SIMD "
                  "level a contender of its own), except torch foreach AdamW and torch.stack (they allocate "
                  "and free large temporaries each step, which slows whatever runs next), timed alone after",
        "argv": sys.argv[1:],
        "loadavg_start": list(os.getloadavg()),
    }
    before = ncclavg._C.simd_level()
    rows = []
    t_start = time.time()
    try:
        for size in args.size_list:
            if not args.no_adamw:
                rows += case_adamw(size, ds_cls)
            for dname in args.dtype_list:
                for n in args.tower_list:
                    rows += case_avg_step_cast(size, n, dname)
    finally:
        ncclavg._C.set_simd_level(before)
    header["wall_s"] = round(time.time() - t_start, 1)
    header["loadavg_end"] = list(os.getloadavg())

    print(f"# ncclavg bench/optim.py  {header['cpu']}  threads={args.threads}  torch {torch.__version__}  "
          f"simd={','.join(LEVELS)}  {ds_note}  load {header['loadavg_start'][0]:.1f}")
    print(f"{'case':<78} {'simd':>6} {'ncclavg ms':>10} {'torch ms':>9} {'x torch':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'of read':>8} {'of triad':>8} {'check':>6}")
    for r in rows:
        extra = ""
        if "torch_fused_us" in r:
            extra = (f"   fused {r['torch_fused_us'] / 1e3:.2f} ms ({r['speedup_vs_torch_fused']:.2f}x)  foreach "
                     f"{r['torch_foreach_us'] / 1e3:.2f} ms ({r['speedup_vs_torch_foreach']:.2f}x)")
            if "deepspeed_us" in r:
                extra += f"  deepspeed {r['deepspeed_us'] / 1e3:.2f} ms ({r['speedup_vs_deepspeed']:.2f}x)"
        check = f"{r['check_cost']:>6.0%}" if "check_cost" in r else f"{'':>6}"
        print(f"{r['case']:<78} {r['simd']:>6} {r['time_us'] / 1e3:>10.2f} {r['torch_time_us'] / 1e3:>9.2f} "
              f"{r['speedup_vs_torch']:>7.2f}x {r['gbps']:>7.1f} {r['fraction_of_copy_bw']:>7.0%} "
              f"{r['fraction_of_read_bw']:>7.0%} {r['fraction_of_triad_bw']:>7.0%} {check}{extra}")
    print("check: the share of the checked step's time that the inf/NaN check adds (1 - unchecked / checked)")
    print_targets(rows)
    path = Path(args.json) if args.json else (
        ROOT / "bench" / "results" / f"optim-{header['machine']}-{_dt.date.today().isoformat()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
