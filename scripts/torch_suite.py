#!/usr/bin/env python3
"""Run PyTorch's own distributed test suite on a backend, with a per-test timeout, to a JSON summary.

    python scripts/torch_suite.py --backend ncclavg --world-size 2 --lift-gates \
        -k "test_all_reduce* or test_broadcast*" --timeout 120 --out bench/results/x.json

The suite is torch/testing/_internal/distributed/distributed_test.py, run as torch's
test/distributed/test_distributed_spawn.py runs it (BACKEND, WORLD_SIZE, TEMP_DIR, spawn start
method) by scripts/torch_suite_driver.py, which imports the backend's package in every rank.
--lift-gates holds a plugin backend to the tests the suite runs only for gloo (see
scripts/torch_suite_lift.py); the installed torch is never edited.

A batch of tests runs in one driver process (one torch import per batch, not per test); the driver
writes one JSON line per test start and end. The suite's own join timeout (set to --timeout) ends a
test whose ranks hang; if the driver itself stops answering, this runner kills its process group
after --timeout plus a grace, records the test as failed (hung) and goes on with the rest.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRIVER = Path(__file__).with_name("torch_suite_driver.py")
# Past the suite's own timeout, how long the driver may take to report before it is killed: the
# suite asks hung ranks for tracebacks (5 s each) and terminates them before it reports.
GRACE_S = 45


# ---- -k expressions, as pytest reads them: terms joined by and/or/not and parentheses --------------
_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def keyword_matcher(expr: str | None):
    """A predicate on test names. A term matches as a substring, or as a glob if it holds * ? or [;
    case-insensitive as in pytest. Raises ValueError on a malformed expression."""
    if not expr or not expr.strip():
        return lambda name: True
    tokens = _TOKEN.findall(expr)
    terms: list[str] = []
    code = []
    for tok in tokens:
        if tok in ("and", "or", "not", "(", ")"):
            code.append(tok)
        else:
            terms.append(tok.lower())
            code.append(f"_t[{len(terms) - 1}]")
    source = " ".join(code)
    try:
        compiled = compile(source, "<-k>", "eval")
    except SyntaxError as e:
        raise ValueError(f"bad -k expression {expr!r}") from e

    def match(name: str) -> bool:
        low = name.lower()
        hits = [fnmatch.fnmatchcase(low, t) if any(c in t for c in "*?[") else t in low for t in terms]
        return bool(eval(compiled, {"__builtins__": {}}, {"_t": hits}))

    match("")  # a bad shape (e.g. "a b") fails now, not on the first test
    return match


# ---- the first line worth reading of a failure -----------------------------------------------------
# The first block follows "RuntimeError: " on the parent's exception line, the others start lines.
_RANK_BLOCK = re.compile(r"\bProcess (\d+) exited with error code \d+ and exception:$", re.M)


def last_exception_line(text: str) -> str:
    """The exception line of the last traceback in `text` (the line after its frames), else the
    first non-empty line."""
    lines = text.splitlines()
    found = ""
    i = 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last):"):
            i += 1
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                i += 1
            if i < len(lines):
                found = lines[i].strip()
        i += 1
    if found:
        return found
    return next((ln.strip() for ln in lines if ln.strip()), "")


def error_head(detail: str) -> str:
    """For a failure of the suite: "rank R: <exception line>" for the lowest rank that raised, as the
    parent's report holds each rank's traceback; otherwise the parent's own exception line (a rank
    that timed out, crashed, or exited with an unexpected code)."""
    blocks = list(_RANK_BLOCK.finditer(detail))
    if not blocks:
        return last_exception_line(detail)
    first = blocks[0]
    end = blocks[1].start() if len(blocks) > 1 else len(detail)
    return f"rank {first.group(1)}: {last_exception_line(detail[first.end():end])}"


def trim_detail(detail: str, limit: int = 4000) -> str:
    """The ranks' part of a failure (the parent's own frames say nothing), at most `limit` chars."""
    blocks = list(_RANK_BLOCK.finditer(detail))
    body = detail[blocks[0].start():] if blocks else detail
    return body if len(body) <= limit else body[:limit // 2] + "\n[...]\n" + body[-limit // 2:]


# ---- running batches of tests ----------------------------------------------------------------------
def driver_env(args, temp_root: Path) -> dict:
    env = dict(os.environ)
    lift = ["gates"] if args.lift_gates else []
    if args.lift_profiling:
        lift.append("profiling")
    temp_dir = temp_root / "suite"
    (temp_dir / "barrier").mkdir(parents=True, exist_ok=True)
    (temp_dir / "test_dir").mkdir(exist_ok=True)
    env.update(BACKEND=args.backend, WORLD_SIZE=str(args.world_size), TEMP_DIR=str(temp_dir),
               TORCH_SUITE_LIFT=",".join(lift), TORCH_SUITE_TIMEOUT=str(args.timeout),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout),
               # The suite's tempfiles (init files, stores) go where this run cleans up.
               TMPDIR=str(temp_root), PYTHONUNBUFFERED="1")
    # torch's run_test.py runs the spawn suite twice: with INIT_METHOD=file://TEMP_DIR/ and without
    # (env://). The suite's decorators read it once, at import; with file:// they also run the
    # tests that re-initialize the default group (test_barrier_timeout_global). Each test's setUp
    # then points INIT_METHOD at a fresh init file of its own, as in both of torch's runs.
    if args.init_method == "file":
        env["INIT_METHOD"] = f"file://{temp_dir}/"
    else:
        env.pop("INIT_METHOD", None)
    # The checkout first, so the driver's ranks import the backend from it.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def list_tests(env: dict) -> dict:
    out = subprocess.run([sys.executable, str(DRIVER), "--list"], env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the driver could not load the suite:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _read_events(path: Path, offset: int):
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        data = f.read()
    complete = data[:data.rfind("\n") + 1]
    return [json.loads(ln) for ln in complete.splitlines() if ln.strip()], offset + len(complete.encode())


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every rank it spawned
    except ProcessLookupError:
        pass
    proc.wait()


def run_tests(names: list[str], env: dict, args, log, progress, results: dict | None = None) -> dict:
    """Run `names`, a batch per driver process, restarting after a hang or a crash. -> name: result
    (filled into `results` as they come, before `progress` is called)."""
    results = {} if results is None else results
    events_path = Path(env["TMPDIR"]) / "events.jsonl"
    events_path.touch()
    offset = 0
    pending = list(names)
    while pending:
        batch = pending[:args.batch] if args.batch else list(pending)
        proc = subprocess.Popen([sys.executable, str(DRIVER), "--events", str(events_path), *batch],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        current, started = None, time.monotonic()
        while True:
            events, offset = _read_events(events_path, offset)
            for ev in events:
                if ev["event"] == "start":
                    current, started = ev["test"], time.monotonic()
                elif ev["event"] == "end":
                    results[ev["test"]] = {"outcome": ev["outcome"], "seconds": ev["seconds"],
                                           "detail": ev["detail"]}
                    progress(ev["test"], results[ev["test"]])
                    current = None
            if proc.poll() is not None and not events:
                break
            if current is not None and time.monotonic() - started > args.timeout + GRACE_S:
                _kill(proc)
                results[current] = {"outcome": "failed", "seconds": round(time.monotonic() - started, 1),
                                    "detail": f"hung: no result {args.timeout + GRACE_S} s after the test "
                                              "started; the runner killed the driver and its ranks"}
                progress(current, results[current])
                break
            time.sleep(0.5)
        if proc.returncode is None:
            _kill(proc)
        left = [n for n in batch if n not in results]
        if left and proc.returncode not in (None, 0) and current is not None and current not in results:
            # The driver died inside a test (a segfault of the parent): that test fails, the rest go on.
            results[current] = {"outcome": "failed", "seconds": round(time.monotonic() - started, 1),
                                "detail": f"driver exited with {proc.returncode} during the test"}
            progress(current, results[current])
            left.remove(current)
        if left and len(left) == len(batch):
            # Nothing in the batch ran at all: the driver cannot start; do not loop on it.
            for n in left:
                results[n] = {"outcome": "failed", "seconds": 0.0,
                              "detail": f"driver exited with {proc.returncode} before the test (see the log)"}
                progress(n, results[n])
        pending = [n for n in pending if n not in results]
    return results


# Paths in tracebacks, shortened so that a committed summary names no directory of the machine it ran on.
_SITE = re.compile(r"""(?:[A-Za-z]:)?[^\s"'<>]*[/\\](?:site|dist)-packages[/\\]""")


def scrub(text: str, roots: tuple[str, ...] = ()) -> str:
    """`text` with each root (the checkout, the run's temp dir) and any site-packages prefix cut."""
    for root in sorted((r for r in roots if r), key=len, reverse=True):
        text = text.replace(root.rstrip("/") + "/", "").replace(root, "")
    return _SITE.sub("", text)


def summarize(config: dict, lift_report: dict, results: dict, wall_s: float,
              roots: tuple[str, ...] = ()) -> dict:
    counts = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in ("passed", "failed", "skipped")}
    tests = {}
    for name in sorted(results):
        r = results[name]
        entry = {"outcome": r["outcome"], "seconds": r["seconds"]}
        if r["outcome"] == "failed":
            entry["error"] = scrub(error_head(r["detail"]), roots)
            entry["detail"] = scrub(trim_detail(r["detail"]), roots)
        elif r["outcome"] == "skipped":
            entry["reason"] = scrub(r["detail"], roots)
        tests[name] = entry
    return {"config": config, "lift": lift_report, "wall_seconds": round(wall_s, 1),
            "counts": counts, "tests": tests}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, help="gloo, ncclavg, or any registered backend name")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--lift-gates", action="store_true",
                   help="also run, for this backend, the tests the suite gates on gloo")
    p.add_argument("--lift-profiling", action="store_true",
                   help="with --lift-gates: also expect the backend's profiler events")
    p.add_argument("-k", dest="keyword", default=None,
                   help='select tests as pytest -k does: "test_all_reduce* or test_broadcast and not cuda"')
    p.add_argument("--init-method", choices=("file", "env"), default="file",
                   help="INIT_METHOD as torch's run_test.py sets it for the suite (default file)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per test (default 120)")
    p.add_argument("--batch", type=int, default=0, help="tests per driver process (default: all)")
    p.add_argument("--out", type=Path, help="JSON summary to write")
    p.add_argument("--log", type=Path, help="the driver's raw output (default: next to --out, .log)")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    args = p.parse_args(argv)
    if args.lift_profiling and not args.lift_gates:
        p.error("--lift-profiling needs --lift-gates")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    match = keyword_matcher(args.keyword)
    temp_root = Path(tempfile.mkdtemp(prefix="torch-suite-"))
    try:
        env = driver_env(args, temp_root)
        listing = list_tests(env)
        names = [n for n in listing["tests"] if match(n)]
        if args.list:
            print("\n".join(names))
            return 0
        config = {"backend": args.backend, "world_size": args.world_size, "lift_gates": args.lift_gates,
                  "lift_profiling": args.lift_profiling, "keyword": args.keyword,
                  "init_method": args.init_method, "timeout_s": args.timeout,
                  "torch": listing["torch"], "selected": len(names), "suite_tests": len(listing["tests"])}
        label = f"{args.backend} ws={args.world_size}{' lifted' if args.lift_gates else ''}"
        print(f"{label}: {len(names)} of {len(listing['tests'])} tests", flush=True)
        log_path = args.log or (args.out.with_suffix(".log") if args.out else temp_root / "driver.log")
        done = [0]

        def progress(name, r):
            done[0] += 1
            head = f"  {error_head(r['detail'])[:150]}" if r["outcome"] == "failed" else ""
            print(f"[{done[0]:4d}/{len(names)}] {r['outcome']:7s} {r['seconds']:7.1f}s {name}{head}", flush=True)

        t0 = time.monotonic()
        results: dict[str, dict] = {}
        roots = (str(Path(__file__).resolve().parent.parent), str(temp_root), tempfile.gettempdir())

        def write(complete: bool) -> dict:
            summary = summarize(config, listing["lift"], results, time.monotonic() - t0, roots)
            summary["complete"] = complete
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(summary, indent=1) + "\n")
            return summary

        def progress_and_save(name, r):
            progress(name, r)
            write(complete=False)  # a run cut short still leaves what it found

        with open(log_path, "w", encoding="utf-8") as log:
            run_tests(names, env, args, log, progress_and_save, results)
        summary = write(complete=True)
        c = summary["counts"]
        print(f"{label}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped "
              f"in {summary['wall_seconds']:.0f} s", flush=True)
        return 0
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
