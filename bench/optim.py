"""CPU optimizer step benchmark: ncclavg's fused core vs torch.optim (and DeepSpeed's CPU Adam when it
is importable), all with the same thread count, timed in interleaved rounds (medians after warm-up).

    python bench/optim.py                      # 8M and 64M params -> bench/results/optim-<machine>-<date>.json
    python bench/optim.py --sizes 1M --reps 3  # quick
    python bench/optim.py --json out.json --threads 2

Cases, per size:
  (a) "adamw": CPUAdamW.step on fp32 params with fp32 grads vs torch.optim.AdamW(fused=True) and
      (foreach=True) [and DeepSpeedCPUAdam]. ncclavg runs twice: with its default (no inf/NaN check,
      the same work as torch's) and with skip_nonfinite=True (a read-only first pass over the grads).
  (b) "avg4+adamw+bf16": average N=4 bfloat16 tower gradients + AdamW + bfloat16 copy-out of the params,
      MasterWeights.step(towers, out=bf16) vs the best of several torch sequences doing the same work
      (sum the towers into an fp32 grad, fused AdamW, cast the params to bf16).
  (c) every ncclavg row relates its achieved bandwidth (bytes read + written, each stream counted once)
      to a plain copy moving as many bytes (the fastest of torch copy_, numpy copyto and ncclavg's cast_copy,
      same threads), to a plain read of as many bytes (torch.sum, ncclavg grad_stats) and to a STREAM
      triad (torch.add(b, c, alpha, out=a)), all measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
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
    ap.add_argument("--towers", type=int, default=4, help="tower gradients averaged in case (b)")
    ap.add_argument("--json", default=None, help="output path (default bench/results/optim-<machine>-<date>.json)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    args = ap.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.threads < 1 or args.reps < 1 or args.warmup < 0 or args.towers < 1:
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
from ncclavg.optim import CPUAdamW  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

torch.set_num_threads(args.threads)


def machine_slug() -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")
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


def copy_seconds(nbytes_moved: int, reps: int) -> float:
    """Time of the fastest plain copy moving `nbytes_moved` bytes (half read, half written): the best median
    of torch copy_, numpy copyto and ncclavg's own fp32 cast_copy, so the reference is this machine's copy
    speed and not one library's."""
    import numpy as np

    n = max(1, nbytes_moved // 8)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    bs, bd = as_buffer(src), as_buffer(dst)
    med = interleaved({"torch": lambda: dst.copy_(src), "numpy": lambda: np.copyto(dst.numpy(), src.numpy()),
                       "ncclavg": lambda: ncclavg._C.cast_copy([bs], [bd])}, reps, 2)
    return min(med.values())


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


def case_adamw(size: int, ds_cls) -> dict:
    gen = torch.Generator().manual_seed(0)
    shapes = shapes_for(size)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]

    def params():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(ps, grads):
            p.grad = g  # read-only for every contender: one shared set of gradients
        return ps

    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    opts = {
        "ncclavg": CPUAdamW(params(), **hp),
        "ncclavg_check": CPUAdamW(params(), skip_nonfinite=True, **hp),
        "torch_fused": torch.optim.AdamW(params(), fused=True, **hp),
        "torch_foreach": torch.optim.AdamW(params(), foreach=True, **hp),
    }
    if ds_cls is not None:
        opts["deepspeed"] = ds_cls(params(), adamw_mode=True, **hp)
    med = timed({k: o.step for k, o in opts.items()}, isolated=("torch_foreach",))
    bytes_nocheck = size * 28  # param r/w, exp_avg r/w, exp_avg_sq r/w, grad r (fp32)
    bytes_check = size * 32    # + the first pass reading the grads again
    copy_s = copy_seconds(bytes_nocheck, args.reps)
    read_s = read_seconds(bytes_nocheck, args.reps)
    triad_s = triad_seconds(bytes_nocheck, args.reps)
    best_torch = min(med["torch_fused"], med["torch_foreach"])
    rows = []
    for name, nbytes in (("ncclavg", bytes_nocheck), ("ncclavg_check", bytes_check)):
        t = med[name]
        row = {
            "case": f"adamw {size_label(size)} params: CPUAdamW.step"
                    + (" (default, no inf/NaN check: torch's work)" if name == "ncclavg"
                       else " (skip_nonfinite=True)"),
            "size": size, "tensors": len(shapes), "time_us": t * 1e6, "torch_time_us": best_torch * 1e6,
            "torch_fused_us": med["torch_fused"] * 1e6, "torch_foreach_us": med["torch_foreach"] * 1e6,
            "speedup_vs_torch": best_torch / t, "speedup_vs_torch_fused": med["torch_fused"] / t,
            "speedup_vs_torch_foreach": med["torch_foreach"] / t,
            "bytes": nbytes, "gbps": nbytes / t / 1e9,
            "copy_time_us": copy_s * nbytes / bytes_nocheck * 1e6,
            "copy_gbps": bytes_nocheck / copy_s / 1e9,
            "fraction_of_copy_bw": (nbytes / t) / (bytes_nocheck / copy_s),
            "read_gbps": bytes_nocheck / read_s / 1e9,
            "fraction_of_read_bw": (nbytes / t) / (bytes_nocheck / read_s),
            "triad_gbps": bytes_nocheck / triad_s / 1e9,
            "fraction_of_triad_bw": (nbytes / t) / (bytes_nocheck / triad_s),
        }
        if "deepspeed" in med:
            row["deepspeed_us"] = med["deepspeed"] * 1e6
            row["speedup_vs_deepspeed"] = med["deepspeed"] / t
        rows.append(row)
    return rows


def case_avg_step_cast(size: int) -> list:
    n = args.towers
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(size, generator=gen)
    towers = [(torch.randn(size, generator=gen) * 1e-2).to(torch.bfloat16) for _ in range(n)]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

    mw = MasterWeights([init], optimizer="adamw", pin=False, **hp)
    mw_nocheck = MasterWeights([init], optimizer="adamw", pin=False, skip_nonfinite=False, **hp)
    out = torch.empty(mw.flat[0].numel(), dtype=torch.bfloat16)
    out2 = torch.empty_like(out)
    tower_lists = [[t] for t in towers]

    p = torch.nn.Parameter(init.clone())
    g = torch.empty(size)
    p.grad = g
    opt = torch.optim.AdamW([p], fused=True, **hp)
    tout = torch.empty(size, dtype=torch.bfloat16)

    def torch_add_chain():
        g.copy_(towers[0])
        for t in towers[1:]:
            g.add_(t)
        g.mul_(1.0 / n)
        opt.step()
        tout.copy_(p.detach())

    def torch_stack_sum():
        torch.sum(torch.stack(towers), 0, dtype=torch.float32, out=g)
        g.mul_(1.0 / n)
        opt.step()
        tout.copy_(p.detach())

    med = timed({
        "ncclavg": lambda: mw.step(tower_lists, out=out),
        "ncclavg_nocheck": lambda: mw_nocheck.step(tower_lists, out=out2),
        "torch_add_chain": torch_add_chain,
        "torch_stack_sum": torch_stack_sum,
    }, isolated=("torch_stack_sum",))
    best_name = min(("torch_add_chain", "torch_stack_sum"), key=med.get)
    best = med[best_name]
    bytes_nocheck = size * (24 + 2 * n + 2)  # p, m, v r/w (fp32), n bf16 grads read, bf16 copy-out written
    bytes_check = bytes_nocheck + size * 2 * n
    copy_s = copy_seconds(bytes_nocheck, args.reps)
    read_s = read_seconds(bytes_nocheck, args.reps)
    triad_s = triad_seconds(bytes_nocheck, args.reps)
    rows = []
    for name, nbytes in (("ncclavg", bytes_check), ("ncclavg_nocheck", bytes_nocheck)):
        t = med[name]
        rows.append({
            "case": f"avg{n}xbf16+adamw+bf16-out {size_label(size)}: MasterWeights.step"
                    + (" (inf/NaN check on, default)" if name == "ncclavg" else " (skip_nonfinite=False)"),
            "size": size, "towers": n, "time_us": t * 1e6, "torch_time_us": best * 1e6,
            "torch_best": best_name, "torch_add_chain_us": med["torch_add_chain"] * 1e6,
            "torch_stack_sum_us": med["torch_stack_sum"] * 1e6, "speedup_vs_torch": best / t,
            "bytes": nbytes, "gbps": nbytes / t / 1e9, "copy_time_us": copy_s * nbytes / bytes_nocheck * 1e6,
            "copy_gbps": bytes_nocheck / copy_s / 1e9, "fraction_of_copy_bw": (nbytes / t) / (bytes_nocheck / copy_s),
            "read_gbps": bytes_nocheck / read_s / 1e9, "fraction_of_read_bw": (nbytes / t) / (bytes_nocheck / read_s),
            "triad_gbps": bytes_nocheck / triad_s / 1e9,
            "fraction_of_triad_bw": (nbytes / t) / (bytes_nocheck / triad_s),
        })
    return rows


def size_label(n: int) -> str:
    return f"{n / 2**20:g}M" if n % 2**17 == 0 else str(n)


def main() -> int:
    ds_cls, ds_note = deepspeed_adam()
    info = ncclavg.build_info()
    header = {
        "benchmark": "optim",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_slug(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "threads": args.threads, "omp_threads_core": ncclavg._C.core_info()["openmp_threads"],
        "python": platform.python_version(), "torch": torch.__version__, "ncclavg": ncclavg.__version__,
        "simd_level": info.get("simd_level") if isinstance(info, dict) else None,
        "deepspeed": ds_note, "reps": args.reps, "warmup": args.warmup, "sizes": args.size_list,
        "bytes_convention": "bytes read + bytes written per step, each stream once; copy_gbps: the fastest of "
                            "torch copy_, numpy copyto and ncclavg cast_copy on fp32 moving the same bytes (half "
                            "read, half written), same threads, same run. A copy's stores cost a read for "
                            "ownership on x86 while the optimizer rewrites lines it has just read, so a step can "
                            "exceed 100% of copy",
        "timing": "medians of --reps rounds after --warmup; contenders interleaved round by round, except "
                  "torch foreach AdamW and torch.stack (they allocate and free large temporaries each step, "
                  "which slows whatever runs next), timed alone after",
        "argv": sys.argv[1:],
        "loadavg_start": list(os.getloadavg()),
    }
    rows = []
    t_start = time.time()
    for size in args.size_list:
        rows += case_adamw(size, ds_cls)
        rows += case_avg_step_cast(size)
    header["wall_s"] = round(time.time() - t_start, 1)
    header["loadavg_end"] = list(os.getloadavg())

    print(f"# ncclavg bench/optim.py  {header['cpu']}  threads={args.threads}  torch {torch.__version__}  "
          f"simd={header['simd_level']}  {ds_note}  load {header['loadavg_start'][0]:.1f}")
    print(f"{'case':<78} {'ncclavg ms':>10} {'torch ms':>9} {'x torch':>8} {'GB/s':>7} {'of copy':>8} {'of read':>8} {'of triad':>8}")
    for r in rows:
        extra = ""
        if "torch_fused_us" in r:
            extra = (f"   fused {r['torch_fused_us'] / 1e3:.2f} ms ({r['speedup_vs_torch_fused']:.2f}x)  foreach "
                     f"{r['torch_foreach_us'] / 1e3:.2f} ms ({r['speedup_vs_torch_foreach']:.2f}x)")
            if "deepspeed_us" in r:
                extra += f"  deepspeed {r['deepspeed_us'] / 1e3:.2f} ms ({r['speedup_vs_deepspeed']:.2f}x)"
        print(f"{r['case']:<78} {r['time_us'] / 1e3:>10.2f} {r['torch_time_us'] / 1e3:>9.2f} "
              f"{r['speedup_vs_torch']:>7.2f}x {r['gbps']:>7.1f} {r['fraction_of_copy_bw']:>7.0%} "
              f"{r['fraction_of_read_bw']:>7.0%} {r['fraction_of_triad_bw']:>7.0%}{extra}")
    path = Path(args.json) if args.json else (
        ROOT / "bench" / "results" / f"optim-{header['machine']}-{_dt.date.today().isoformat()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
