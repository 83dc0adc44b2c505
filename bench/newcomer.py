"""A newcomer's two first runs, timed as a user runs them: `ncclavg train` against the README's "For a
trainer author" snippet pasted into a file, the same work (2 CPU towers, the CNN, digits, 10 epochs,
batch 64, AdamW at 3e-3 with a cosine schedule, the test set evaluated after every epoch; the snippet
also saves and reloads a checkpoint).

Each run is a fresh `python` process in an empty directory, timed from its start to its exit (imports
included, as a user waits for them). One untimed run of each first (the page cache), then --runs rounds,
each running both in an order that alternates from round to round, so that load arriving during the
measurement hits both alike. Reported: the median wall time of each, the ratio snippet / CLI (the
target: at most 1.3), every run's time, both summary lines and the load average around the runs.

    python bench/newcomer.py                         # 5 rounds; writes bench/results/newcomer-cpu-<date>.{json,md}
    python bench/newcomer.py --runs 3 --tag quiet    # ... newcomer-cpu-<date>-quiet.{json,md}

The snippet is read from README.md each time, so the measurement follows the README as it is.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = 1.3   # the snippet's median at most this many times the CLI's
SUMMARY = re.compile(r"^summary: .*$", re.M)


def readme_snippet(readme: Path = ROOT / "README.md") -> str:
    """The first ```python block under the README's "## For a trainer author" heading, verbatim."""
    text = readme.read_text()
    start = text.index("## For a trainer author")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    if m is None:
        raise SystemExit("README.md: no ```python block under '## For a trainer author'")
    return m.group(1)


def environment() -> dict:
    """The caller's environment; the checkout first on PYTHONPATH when its core is built in place."""
    env = dict(os.environ)
    if list((ROOT / "ncclavg").glob("_C*.so")):
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_once(cmd: list[str], env: dict) -> dict:
    """One run in a fresh empty directory: wall seconds, the summary line, the load average after."""
    with tempfile.TemporaryDirectory(prefix="ncclavg-newcomer-") as cwd:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    found = SUMMARY.findall(proc.stdout)
    return {"wall_s": round(wall, 3), "summary": found[-1] if found else None,
            "load_1m_after": round(os.getloadavg()[0], 2)}


def machine() -> dict:
    import platform

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = subprocess.run([sys.executable, "-c", "import torch, ncclavg; print(torch.__version__, "
                               "ncclavg.__version__)"], env=environment(), capture_output=True, text=True)
    torch_v, ncclavg_v = (versions.stdout.split() + ["?", "?"])[:2]
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(), "torch": torch_v,
            "ncclavg": ncclavg_v, "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed rounds (each runs both once; default 5)")
    ap.add_argument("--tag", default="", help="appended to the results file names, e.g. quiet or loaded")
    ap.add_argument("--out", default=None, help="results path without extension (default "
                    "bench/results/newcomer-cpu-<date>[-<tag>])")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs: must be >= 1")
    date = dt.date.today().isoformat()
    out = Path(args.out) if args.out else RESULTS / f"newcomer-cpu-{date}{'-' + args.tag if args.tag else ''}"

    env = environment()
    with tempfile.TemporaryDirectory(prefix="ncclavg-newcomer-") as tmp:
        snippet = Path(tmp) / "snippet.py"
        snippet.write_text(readme_snippet())
        contenders = {"cli": [sys.executable, "-m", "ncclavg", "train", "--no-progress"],
                      "snippet": [sys.executable, str(snippet)]}
        load_before = round(os.getloadavg()[0], 2)
        for name, cmd in contenders.items():   # untimed: the page cache, the first import
            run_once(cmd, env)
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for r in range(args.runs):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                runs[name].append(run_once(contenders[name], env))
                print(f"round {r + 1}/{args.runs} {name}: {runs[name][-1]['wall_s']:.2f} s", flush=True)
    med = {name: statistics.median(x["wall_s"] for x in rs) for name, rs in runs.items()}
    ratio = med["snippet"] / med["cli"]
    loads = [x["load_1m_after"] for rs in runs.values() for x in rs]
    result = {
        "bench": "newcomer", "date": date, "machine": machine(),
        "command": " ".join(["python bench/newcomer.py", *(argv if argv is not None else sys.argv[1:])]),
        "contenders": {name: " ".join(cmd[1:]) if name == "cli" else "python snippet.py (README.md, "
                       "'For a trainer author')" for name, cmd in contenders.items()},
        "load_1m": {"before": load_before, "min": min(loads), "max": max(loads)},
        "median_s": {k: round(v, 3) for k, v in med.items()}, "ratio_snippet_over_cli": round(ratio, 3),
        "target": TARGET, "within_target": ratio <= TARGET, "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0


def markdown(r: dict) -> str:
    m = r["machine"]
    rows = "\n".join(f"| {name} | {r['median_s'][name]:.2f} | " + ", ".join(f"{x['wall_s']:.2f}" for x in rs) + " |"
                     for name, rs in r["runs"].items())
    lines = [
        f"# A newcomer's first runs: `ncclavg train` against the README snippet's `fit()` ({r['date']})",
        "",
        f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, ncclavg {m['ncclavg']}, Python {m['python']}.",
        f"Command: `{r['command']}`. Load average (1 min): {r['load_1m']['before']} before, "
        f"{r['load_1m']['min']}-{r['load_1m']['max']} during.",
        "",
        "| run | median wall s | every run, s |",
        "|---|---:|---|",
        rows,
        "",
        f"Snippet / CLI: **{r['ratio_snippet_over_cli']:.2f}x** (target <= {r['target']}x: "
        f"{'met' if r['within_target'] else 'missed'}). Wall time of the whole process, imports included.",
        "",
        "Last summary lines:",
        "",
        *(f"- {name}: `{rs[-1]['summary']}`" for name, rs in r["runs"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
