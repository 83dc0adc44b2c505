"""Runs every CPU benchmark of the project and gathers their ratios in one JSON and one markdown table.

    python bench/cpu_suite.py                 # -> bench/results/cpu-<date>.json and cpu-<date>.md
    python bench/cpu_suite.py --quick         # smaller sweeps, for a smoke run
    python bench/cpu_suite.py --only average sweep-local

What runs: bench/average.py, bench/pack.py, bench/optim.py (its case (b) is the fused average + optimizer
step + cast pipeline), any other bench/*.py that follows the contract below (except gpu_* scripts), and the
`ncclavg bench` sweeps for the local (4 towers) and gloo (2 ranks) backends. A script that does not exist
yet is listed as "missing" with a note; one that fails is listed with its exit code and last stderr line.
The suite also measures the machine's copy bandwidth itself, at its start and at its end, and reports
every benchmark against it.

Contract for a benchmark script bench/<name>.py
-----------------------------------------------
1. `python bench/<name>.py --json PATH` runs its CPU default configuration in under 2 minutes on a
   2-core machine, exits 0, and writes PATH. It runs from the repository root (the suite sets the
   working directory and PYTHONPATH so `import ncclavg` finds this checkout).
2. PATH holds one JSON object: {"header": {machine, versions, arguments, ...}, "rows": [{...}, ...]};
   more keys are allowed.
3. Rows meant for the summary carry a "case" (or "name") string saying what was measured, and either
   times measured in the same run:
       "time_us"        ncclavg's time for the case
       "torch_time_us"  the best torch way of doing the same work
       "copy_time_us"   a plain copy of the same bytes (each byte ncclavg must read/write, moved once)
   or the ratios directly:
       "speedup_vs_torch"     torch time / ncclavg time        (> 1: ncclavg is faster)
       "fraction_of_copy_bw"  copy time / ncclavg time         (1.0: ncclavg runs at copy speed)
   Optionally "gbps": ncclavg's bandwidth in the copy convention (bytes moved, counted once, per ns),
   which the suite also relates to its own copy measurement.
   `ncclavg bench --json` files (rows per contender and size) are understood as they are.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KNOWN_SCRIPTS = [
    ("average", "average.py", "ncclavg.ops.average_ (one-pass host average) vs torch"),
    ("pack", "pack.py", "pack/unpack of gradients into flat buckets vs torch.cat / split copies"),
    ("optim", "optim.py", "CPUAdamW / CPUSGD vs torch.optim (foreach / fused)"),
]
SCRIPT_TIMEOUT_S = 300
TORCH_TIME_KEYS = ("torch_time_us", "torch_us", "time_torch_us")
COPY_TIME_KEYS = ("copy_time_us", "copy_us", "time_copy_us", "memcpy_time_us")
SPEEDUP_KEYS = ("speedup_vs_torch", "vs_torch", "ratio_vs_torch", "torch_ratio")
COPY_FRACTION_KEYS = ("fraction_of_copy_bw", "frac_copy_bw", "of_copy_bw", "copy_fraction", "vs_copy")


def sweep_commands(quick: bool) -> list[tuple[str, list[str], str]]:
    top = "4M" if quick else "64M"
    common = ["-b", "1K", "-e", top, "-f", "4", "--compare", "--quiet"]
    return [
        ("sweep-local", ["-m", "ncclavg", "bench", "--backend", "local", "--towers", "4", *common],
         "ncclavg bench: local backend, 4 towers, vs torch and copy"),
        ("sweep-gloo", ["-m", "ncclavg", "bench", "--backend", "gloo", "--nproc", "2", *common],
         "ncclavg bench: gloo backend, 2 ranks, vs torch.distributed and copy"),
    ]


def measure_copy_gbps(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Median memcpy bandwidth (bytes copied per second / 1e9) of a buffer far larger than the caches:
    numpy.copyto, i.e. libc memcpy, the same plain copy as `ncclavg bench`'s bandwidth reference."""
    import numpy as np

    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    for _ in range(2):
        np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def script_command(path: Path, quick: bool) -> tuple[list[str], str]:
    """(argv, output flag) for a bench script: `--json` per the contract; a script that only knows
    `--out PATH` still runs (and is flagged); `--quick` is passed on when the script has it."""
    text = path.read_text()
    argv = [f"bench/{path.name}"] + (["--quick"] if quick and "--quick" in text else [])
    return argv, "--json" if "--json" in text or "--out" not in text else "--out"


def run_script(name: str, argv: list[str], timeout: float, out_flag: str = "--json") -> dict:
    """Runs `python <argv> <out_flag> <tmp>`; returns {status, seconds, command, result | error}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="ncclavg-suite-") as tmp:
        out = Path(tmp) / f"{name}.json"
        shown = " ".join(["python", *argv, out_flag, "OUT.json"])
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, *argv, out_flag, str(out)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "command": shown, "seconds": round(time.monotonic() - t0, 1),
                    "error": f"timed out after {timeout:.0f} s"}
        entry = {"command": shown, "seconds": round(time.monotonic() - t0, 1)}
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            return {**entry, "status": "failed", "error": f"exit code {proc.returncode}: {last}"}
        try:
            entry["result"] = _replace_str(json.loads(out.read_text()), str(out), "OUT.json")
        except ValueError as e:
            return {**entry, "status": "failed", "error": f"--json output is not JSON: {e}"}
    entry["status"] = "ok"
    return entry


def _replace_str(obj, old: str, new: str):
    """obj with every string equal to `old` replaced (the temporary --json path must not end up in the
    committed results)."""
    if isinstance(obj, dict):
        return {k: _replace_str(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_str(v, old, new) for v in obj]
    return new if obj == old else obj


def _first(row: dict, keys) -> float | None:
    for k in keys:
        v = row.get(k)
        if isinstance(v, (int, float)) and v == v:
            return float(v)
    return None


def summary_rows(result: dict, copy_gbps: float) -> list[dict]:
    """The suite's view of one benchmark's JSON: one entry per case with the two ratios."""
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list):
        return _ratio_leaves(result)
    if rows and isinstance(rows[0], dict) and "contender" in rows[0] and "size_bytes" in rows[0]:
        return _sweep_summary(result)   # an `ncclavg bench` sweep; other rows that name a contender: below
    out = []
    for r in rows:
        if not isinstance(r, dict):
            continue
        t = _first(r, ("time_us", "ncclavg_time_us"))
        speedup = _first(r, SPEEDUP_KEYS)
        frac = _first(r, COPY_FRACTION_KEYS)
        tt, ct = _first(r, TORCH_TIME_KEYS), _first(r, COPY_TIME_KEYS)
        if speedup is None and t and tt:
            speedup = tt / t
        if frac is None and t and ct:
            frac = ct / t
        gbps = _first(r, ("gbps", "ncclavg_gbps"))
        if speedup is None and frac is None and gbps is None:
            continue
        case = str(r.get("case") or r.get("name") or ", ".join(f"{k}={v}" for k, v in r.items()
                                                               if isinstance(v, (str, int)) and k not in ("wrong",))[:60])
        out.append({"case": case, "time_us": t, "speedup_vs_torch": speedup, "fraction_of_copy_bw": frac,
                    "gbps": gbps, "fraction_of_suite_copy_bw": gbps / copy_gbps if gbps and copy_gbps else None})
    return out


def _ratio_leaves(obj, path: str = "") -> list[dict]:
    """For JSON without "rows": every number whose key names a speedup vs torch or a fraction of the
    copy bandwidth, wherever it sits, labelled by its path."""
    out: list[dict] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                key = str(k).lower()
                if "speedup" in key or "vs_torch" in key:
                    out.append(_case(where, speedup=float(v)))
                elif "of_copy" in key or "copy_fraction" in key:
                    out.append(_case(where, frac=float(v)))
            else:
                out += _ratio_leaves(v, where)
    return out


def _case(case: str, speedup=None, frac=None) -> dict:
    return {"case": case, "time_us": None, "speedup_vs_torch": speedup, "fraction_of_copy_bw": frac,
            "gbps": None, "fraction_of_suite_copy_bw": None}


def _sweep_summary(result: dict) -> list[dict]:
    """An `ncclavg bench` file: ncclavg vs the best torch peer and vs copy, medians over size ranges."""
    by_size: dict[int, dict[str, dict]] = {}
    for r in result["rows"]:
        by_size.setdefault(r["size_bytes"], {})[r["contender"]] = r
    torch_keys = {"torch_stack_mean", "torch_add_loop", "torch_dist"}
    out = []
    for label, pick in (("sizes >= 1 MiB", lambda s: s >= 1 << 20), ("sizes < 1 MiB", lambda s: s < 1 << 20)):
        speedups, fracs, times = [], [], []
        for size, c in sorted(by_size.items()):
            if not pick(size) or "ncclavg" not in c:
                continue
            t = c["ncclavg"]["time_us"]
            peers = [c[k]["time_us"] for k in torch_keys if k in c]
            if peers:
                speedups.append(min(peers) / t)
            if "copy" in c:
                fracs.append(c["copy"]["time_us"] / t)
            times.append(t)
        if times:
            out.append({"case": f"{label} (median of {len(times)})", "time_us": None,
                        "speedup_vs_torch": statistics.median(speedups) if speedups else None,
                        "fraction_of_copy_bw": statistics.median(fracs) if fracs else None,
                        "gbps": None, "fraction_of_suite_copy_bw": None})
    big = max(by_size) if by_size else None
    if big is not None and "ncclavg" in by_size[big]:
        r = by_size[big]["ncclavg"]
        out.append({"case": f"{big >> 20} MiB busbw {r['busbw_gbps']:.2f} GB/s", "time_us": r["time_us"],
                    "speedup_vs_torch": None, "fraction_of_copy_bw": None, "gbps": None,
                    "fraction_of_suite_copy_bw": None})
    return out


def to_markdown(doc: dict) -> str:
    m, v = doc["machine"], doc["versions"]
    lines = [
        f"# CPU benchmarks, {doc['date']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, SIMD {m['simd_level']}, "
        f"OpenMP threads {m['openmp_threads']}, load average at start {m.get('load_avg_1m')}; "
        f"torch {v['torch']}, ncclavg {v['ncclavg']}, python {v['python']}"
        + (f"; environment: {' '.join(f'{k}={x}' for k, x in doc['env'].items())}." if doc.get("env") else "."),
        f"Copy bandwidth measured by the suite: {doc['copy_gbps_start']:.2f} GB/s at the start, "
        f"{doc['copy_gbps_end']:.2f} GB/s at the end ({doc['arguments']['copy_mib']} MiB memcpy, bytes copied per second).",
        "",
        "x torch = torch time / ncclavg time (> 1: ncclavg is faster, vs the best torch way measured);",
        "% copy = copy time / ncclavg time for the same bytes in the same benchmark run (an in-place",
        "pass can exceed 100%: a copy's stores also read the destination's cache lines first);",
        "% suite copy = the benchmark's reported bandwidth over the suite's own memcpy bandwidth.",
        "",
        "| benchmark | case | ncclavg time (us) | x torch | % copy | % suite copy |",
        "|---|---|---:|---:|---:|---:|",
    ]

    def f(x, fmt):
        return "" if x is None else fmt.format(x)

    for name, b in doc["benchmarks"].items():
        if b["status"] != "ok":
            lines.append(f"| {name} | {b['status']}: {b.get('note') or b.get('error')} | | | | |")
            continue
        if not b["summary"]:
            lines.append(f"| {name} | ran ({b['seconds']} s); no rows with ratio fields (see the contract) | | | | |")
        for r in b["summary"]:
            lines.append(f"| {name} | {r['case']} | {f(r['time_us'], '{:.1f}')} | {f(r['speedup_vs_torch'], '{:.2f}x')} | "
                         f"{f(r['fraction_of_copy_bw'], '{:.0%}')} | {f(r['fraction_of_suite_copy_bw'], '{:.0%}')} |")
    lines.append("")
    return "\n".join(lines)


def _shown_path(path: str) -> str:
    """A path as recorded in the results: relative to the checkout, never this machine's absolute path."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else "(a folder outside the checkout)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for cpu-<date>.json/.md")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (names as in the table)")
    p.add_argument("--quick", action="store_true", help="smaller sweeps (smoke run)")
    p.add_argument("--timeout", type=float, default=SCRIPT_TIMEOUT_S, help="seconds per benchmark")
    p.add_argument("--copy-mib", type=int, default=256, help="buffer of the suite's own copy measurement")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from ncclavg.bench import report as bench_report

    plan: list[tuple[str, list[str] | None, str, str]] = []
    for name, script, what in KNOWN_SCRIPTS:
        path = ROOT / "bench" / script
        plan.append((name, *script_command(path, args.quick), what) if path.exists() else (name, None, "", what))
    known = {s for _, s, _ in KNOWN_SCRIPTS} | {"cpu_suite.py"}
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name not in known and not path.name.startswith(("gpu", "_")) and "--json" in path.read_text():
            plan.append((path.stem, *script_command(path, args.quick), "found in bench/ (follows the --json contract)"))
    plan += [(name, cmd, "--json", what) for name, cmd, what in sweep_commands(args.quick)]
    if args.only:
        unknown = set(args.only) - {e[0] for e in plan}
        if unknown:
            p.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}; "
                    f"known: {', '.join(e[0] for e in plan)}")
        plan = [e for e in plan if e[0] in args.only]

    machine = bench_report.machine_info()
    doc = {"date": _dt.date.today().isoformat(), "machine": machine, "versions": bench_report.versions(),
           "env": bench_report.timing_env(),
           "arguments": vars(args) | {"out": _shown_path(args.out)},
           "copy_gbps_start": measure_copy_gbps(args.copy_mib << 20), "benchmarks": {}}
    for name, cmd, out_flag, what in plan:
        if cmd is None:
            print(f"[cpu_suite] {name}: skipped, bench/{name}.py does not exist yet", file=sys.stderr)
            doc["benchmarks"][name] = {"status": "missing", "what": what,
                                       "note": f"bench/{name}.py does not exist in this checkout"}
            continue
        print(f"[cpu_suite] {name}: {' '.join(cmd)} ...", file=sys.stderr, flush=True)
        entry = run_script(name, cmd, args.timeout, out_flag)
        entry["what"] = what
        if out_flag != "--json":
            entry["note"] = f"takes {out_flag} instead of --json (see the contract)"
        entry["summary"] = summary_rows(entry.get("result", {}), doc["copy_gbps_start"]) if entry["status"] == "ok" else []
        print(f"[cpu_suite] {name}: {entry['status']} in {entry['seconds']} s"
              + (f" ({entry['error']})" if entry["status"] != "ok" else ""), file=sys.stderr, flush=True)
        doc["benchmarks"][name] = entry
    doc["copy_gbps_end"] = measure_copy_gbps(args.copy_mib << 20)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu-{doc['date']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    md = to_markdown(doc)
    stem.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    failed = [n for n, b in doc["benchmarks"].items() if b["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
