#!/usr/bin/env python3
"""The end of bench/gpu_check.sh: the summary, the packing of the logs, and the check of $OUT.

    python bench/gpu_check/gpu_check_summary.py finish --out OUT --keep KEEP [--part P] [--dry-run] --seconds N --budget B
    python bench/gpu_check/gpu_check_summary.py check OUT        # does OUT come back whole from a GPU machine?
    python bench/gpu_check/gpu_check_summary.py refused LOG      # did compute-sanitizer refuse the device?

`finish` reads what the steps left in KEEP (steps.tsv, logs/<step>.log, the junit XML of every pytest
process in junit/*.xml, and pytest-gpu.xml of the older one-process layout), writes OUT/gpu_check.json
(the part, steps, per-test outcomes, device, versions, the NCCL init's modes, the RESULT line) and OUT/logs.tar.gz (all
of KEEP, each file capped so the archive stays under the size that comes back), checks OUT against the
rules of what comes back, and prints the table and, last, one RESULT line. Exit status: 0 when every step
ran and passed and OUT comes back whole, NOT_ALL_PASSED (10) when not; anything else means the helper
itself broke, and the script falls back to packing with tar.

Only the standard library: it runs under the GPU machine's python3, and under whatever python CI has.
A step's status is one of pass, fail, timeout, interrupted (these three are failures) or "not run" (cut
for time, not selected, not supported here): a step that did not run is never counted as passed.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import io
import json
import os
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

NOT_ALL_PASSED = 10
ARCHIVE = "logs.tar.gz"
SUMMARY = "gpu_check.json"

# What comes back from $OUT of a GPU machine (its README): at most 8 files, 16 MiB each, 64 MiB in all,
# no deeper than $OUT/a/b/file, every file and folder named in letters, digits, '.', '_' and '-' alone.
MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
MAX_TOTAL_BYTES = 64 << 20
MAX_FOLDER_DEPTH = 2
NAME_RE = re.compile(r"[A-Za-z0-9._-]+")

FAILED = ("fail", "timeout", "interrupted")
NOT_RUN = "not run"
STATUSES = ("pass", *FAILED, NOT_RUN)

# compute-sanitizer refusing the device or platform (seen on gVisor: "Device not supported", then error
# 999 at the first allocation). Then memcheck checked nothing, whatever its exit status says.
_REFUSED = re.compile(
    r"device (is )?not supported|not supported on this (platform|device|system|gpu)"
    r"|no supported (cuda )?devices?|(sanitizer|tool) is not supported|unsupported (gpu|device|platform)",
    re.IGNORECASE)

MESSAGE_CHARS = 200   # of a test's failure / skip message: its first line, cut here
MAX_CASES = 1500      # more test cases than this: only those that did not pass are listed


# ---------------------------------------------------------------------------------------------- steps
def read_steps(path: Path) -> list[dict]:
    """steps.tsv, one line per step: name, status, rc, seconds, limit, reason (tab separated)."""
    steps = []
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        f = line.split("\t") + [""] * 6
        name, status, rc, secs, limit, reason = (x.strip() for x in f[:6])
        s = {"step": name, "status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
             "seconds": int(secs) if secs.isdigit() else 0, "limit_s": int(limit) if limit.isdigit() else None}
        if reason:
            s["reason"] = reason
        steps.append(s)
    return steps


def _short(reason: str | None) -> str:
    """The kind of a reason ("budget: 12s left ..." -> "budget"), for the one-line RESULT."""
    return (reason or "no reason given").split(":")[0].strip()


def _grouped(steps: list[dict]) -> str:
    """'a, b (budget); c (not supported here)': names with their reason's kind, runs of one kind joined."""
    groups: list[tuple[str, list[str]]] = []
    for s in steps:
        kind = _short(s.get("reason"))
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(s["step"])
        else:
            groups.append((kind, [s["step"]]))
    return "; ".join(f"{', '.join(names)} ({kind})" for kind, names in groups)


def skipped_tests(tests: dict | None) -> str:
    """"; N GPU tests skipped (k: reason; ...)" for the RESULT line, most common reason first, or "": a
    step whose tests skipped did not check what they test (e.g. several ranks on one GPU with an NCCL too
    old for it), and the line must not read as if they had passed."""
    cases = [c for c in (tests or {}).get("cases", []) if c.get("outcome") == "skipped"]
    count = ((tests or {}).get("counts") or {}).get("skipped", len(cases))
    if not count:
        return ""
    reasons: dict[str, int] = {}
    for c in cases:
        why = c.get("message") or "no reason given"
        reasons[why] = reasons.get(why, 0) + 1
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
    more = "; ..." if len(reasons) > 3 else ""
    return f"; {count} GPU tests skipped (" + "; ".join(f"{k}: {why}" for why, k in top) + more + ")"


def verdict(steps: list[dict], out_problems: list[str] = (), tests: dict | None = None) -> tuple[bool, str]:
    """(all passed, the RESULT text). FAILED when a step failed or $OUT would not come back whole;
    else incomplete when a step did not run; "all steps passed" only when every step ran and passed.
    GPU tests that skipped are counted at the end of the text, with their commonest reasons."""
    ok, text = _verdict(steps, out_problems)
    return ok, text + skipped_tests(tests)


def _verdict(steps: list[dict], out_problems: list[str]) -> tuple[bool, str]:
    failed = [s for s in steps if s["status"] != NOT_RUN and s["status"] != "pass"]
    not_run = [s for s in steps if s["status"] == NOT_RUN]
    if failed or out_problems:
        parts = []
        if failed:
            parts.append(", ".join(s["step"] if s["status"] == "fail" else f"{s['step']} ({s['status']})"
                                   for s in failed))
        if out_problems:
            parts.append(f"$OUT would not come back whole ({len(out_problems)} problems: "
                         f"{out_problems[0]}{' ...' if len(out_problems) > 1 else ''})")
        text = "FAILED: " + "; ".join(parts)
        if not_run:
            text += "; not run: " + _grouped(not_run)
        return False, text
    if not steps:
        return False, "incomplete: no step ran"
    if not_run:
        return False, "incomplete: not run: " + _grouped(not_run)
    return True, "all steps passed"


# ---------------------------------------------------------------------------------------------- tests
def _case_id(case: ET.Element) -> str:
    """pytest's node id from a junit testcase (xunit1 has file=; else the dotted classname)."""
    name, classname, file = case.get("name", ""), case.get("classname", ""), case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        return "::".join(p for p in (file, rest.replace(".", "::"), name) if p)
    if not classname:  # a collection error: name is the module's dotted path
        return name
    return f"{classname}::{name}"


def _first_line(text: str | None) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def _collect_reason(text: str) -> str:
    """What a module-level junit entry says: a skipped module's text is its report's repr, ('path', line,
    'reason'); a module that failed to collect has a traceback."""
    try:
        value = ast.literal_eval(text.strip())
        if isinstance(value, tuple) and len(value) == 3:
            return str(value[2])
    except (ValueError, SyntaxError):
        pass
    # a module that failed to import: pytest's "E   ModuleNotFoundError: ..." line says the most
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return errors[-1] if errors else text


def parse_junit_files(paths: list[Path]) -> dict | None:
    """parse_junit over several files (one per pytest process), merged; None when there is none."""
    parts = [r for r in (parse_junit(p) for p in paths) if r is not None]
    if not parts:
        return None
    counts = dict.fromkeys(("passed", "failed", "error", "skipped", "total"), 0)
    cases, errors = [], []
    for r in parts:
        if "error" in r and "counts" not in r:
            errors.append(r["error"])
            continue
        for k in counts:
            counts[k] += r["counts"][k]
        cases.extend(r["cases"])
    if len(cases) > MAX_CASES:
        cases = [c for c in cases if c["outcome"] != "passed"][:MAX_CASES]
    doc: dict = {"counts": counts, "cases": cases}
    if errors:
        doc["unreadable"] = errors
    return doc


def parse_junit(path: Path) -> dict | None:
    """{counts: {passed, failed, error, skipped, total}, cases: [{id, outcome, message?}]} from a pytest
    junit XML; passed cases carry no message. None when the file is missing or unreadable."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        return {"error": f"unreadable junit XML: {e}"}
    cases = []
    counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = child.get("message") or child.text or ""
                if message in ("collection skipped", "collection failure") and child.text:
                    message = _collect_reason(child.text)
                break
        counts[outcome] += 1
        entry = {"id": _case_id(case), "outcome": outcome}
        if outcome != "passed" and _first_line(message):
            entry["message"] = _first_line(message)
        cases.append(entry)
    counts["total"] = len(cases)
    if len(cases) > MAX_CASES:
        cases = [c for c in cases if c["outcome"] != "passed"][:MAX_CASES]
    return {"counts": counts, "cases": cases}


# ---------------------------------------------------------------------------------------------- $OUT
def check_out(out: Path) -> tuple[list[dict], list[str]]:
    """(the files under OUT with their sizes, the problems that would keep any of it from coming back)."""
    files, problems = [], []
    out = Path(out)
    if not out.is_dir():
        return files, [f"{out} is not a folder"]
    for dirpath, dirnames, filenames in os.walk(out):
        rel = Path(dirpath).relative_to(out)
        depth = 0 if str(rel) == "." else len(rel.parts)
        for d in list(dirnames):
            p = Path(dirpath) / d
            if not NAME_RE.fullmatch(d):
                problems.append(f"folder name {str(rel / d)!r}: only letters, digits, '.', '_' and '-'")
            if p.is_symlink():
                problems.append(f"{rel / d}: a link, which does not come back")
                dirnames.remove(d)
        for f in filenames:
            p = Path(dirpath) / f
            name = str(rel / f) if depth else f
            if not NAME_RE.fullmatch(f):
                problems.append(f"file name {name!r}: only letters, digits, '.', '_' and '-'")
            if p.is_symlink() or not p.is_file():
                problems.append(f"{name}: not a plain file (a link or special file does not come back)")
                continue
            size = p.stat().st_size
            files.append({"name": name, "bytes": size})
            if depth > MAX_FOLDER_DEPTH:
                problems.append(f"{name}: {depth} folders down (at most {MAX_FOLDER_DEPTH})")
            if size > MAX_FILE_BYTES:
                problems.append(f"{name}: {size} bytes (at most {MAX_FILE_BYTES})")
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES}): "
                        + ", ".join(sorted(f["name"] for f in files)))
    total = sum(f["bytes"] for f in files)
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all (at most {MAX_TOTAL_BYTES})")
    files.sort(key=lambda f: f["name"])
    return files, problems


# ---------------------------------------------------------------------------------------------- packing
def _capped(data: bytes, cap: int) -> bytes:
    """The head and the tail of data (the tail is where errors are), at most about cap bytes."""
    if len(data) <= cap:
        return data
    head, tail = cap // 4, cap - cap // 4
    marker = f"\n[... gpu_check: {len(data) - head - tail} bytes cut here ...]\n".encode()
    return data[:head] + marker + data[-tail:]


def pack(keep: Path, archive: Path, limit: int = MAX_FILE_BYTES - (1 << 20)) -> dict:
    """Every file under KEEP into one .tar.gz, paths relative to KEEP. A file over the cap keeps its head
    and tail; the cap shrinks until the archive fits under limit. Returns {name, bytes, members, cap}."""
    paths = sorted(p for p in Path(keep).rglob("*") if p.is_file() and not p.is_symlink()) if keep.is_dir() else []
    for cap in (8 << 20, 2 << 20, 512 << 10, 64 << 10, 8 << 10):
        members = []
        with tarfile.open(archive, "w:gz") as tar:
            for p in paths:
                data = _capped(p.read_bytes(), cap)
                info = tarfile.TarInfo(str(p.relative_to(keep)))
                info.size, info.mtime, info.mode = len(data), int(p.stat().st_mtime), 0o644
                tar.addfile(info, io.BytesIO(data))
                members.append(info.name)
        size = archive.stat().st_size
        if size <= limit:
            break
    return {"name": archive.name, "bytes": size, "members": members, "cap_bytes_per_file": cap}


# ---------------------------------------------------------------------------------------------- logs
def _info_facts(text: str) -> dict:
    """NCCL and versions from the info step's log (the env report and `ncclavg info`)."""
    facts: dict = {}
    versions = {}
    for line in text.splitlines():
        if "nccl" not in facts and re.match(r"(NCCL|nccl)\s", line):
            v = line.split(None, 1)[1].strip()
            facts["nccl"] = v if len(v) < 120 else v[:117] + "..."
        m = re.match(r"(torch cuda|python|torch|cupy|pybind11|numpy|setuptools) (\S+)", line)
        if m and m.group(1) not in versions and "not importable" not in line:
            versions[m.group(1)] = m.group(2)
            m = re.search(r" nccl (\S+)$", line) if m.group(1) == "torch cuda" else None
            if m and m.group(1) != "-":
                versions["torch nccl"] = m.group(1)
        m = re.match(r"Cuda compilation tools, release ([\d.]+)", line)
        if m:
            versions["nvcc"] = m.group(1)
    if versions:
        facts["versions"] = versions
    return facts


# What NCCL's INIT/ENV lines say about the modes that decide how an abort ends (the info step's one init):
# cuMem and cuMem host allocations, runtime connect, direct mode. NCCL's wording changes between releases,
# so every line that names one is kept as it is, and a mode no line names is said to be not printed.
_INIT_TOPICS = {"cuMem": re.compile(r"cumem(?!.?host)", re.I), "cuMem host": re.compile(r"cumem.?host", re.I),
                "runtime connect": re.compile(r"runtime.?conn", re.I), "directMode": re.compile(r"direct.?mode", re.I)}
MAX_INIT_LINES = 4


def _init_facts(text: str) -> dict:
    """{topic: [NCCL's lines about it] or "not printed"} and the communicator's mode, from the info log."""
    # gpu_check.sh's own line ("nccl_init: done; ..." or "nccl_init: not run ..."), named so that
    # _info_facts' "NCCL <version>" does not take it
    said = [ln[len("nccl_init: "):][:MESSAGE_CHARS] for ln in text.splitlines() if ln.startswith("nccl_init: ")]
    nccl_lines = [ln.split("NCCL INFO", 1)[1].strip() for ln in text.splitlines() if "NCCL INFO" in ln]
    if not said and not nccl_lines:
        return {}
    facts: dict = {"result": said[-1] if said else "no result line: the init did not finish"}
    if nccl_lines:   # NCCL ran and logged: every mode is either named by its lines or said to be absent
        for topic, rx in _INIT_TOPICS.items():
            hits = list(dict.fromkeys(ln[:MESSAGE_CHARS] for ln in nccl_lines if rx.search(ln)))
            facts[topic] = hits[:MAX_INIT_LINES] or "not printed"
    return facts


def _bench_facts(out: Path) -> dict:
    facts: dict = {}
    bench = out / "gpu_bench.json"
    if bench.exists():
        try:
            b = json.loads(bench.read_text())
            facts["bench"] = {name: sec.get("status") for name, sec in b.get("sections", {}).items()}
            header = b.get("header", {})
            facts["device"] = header.get("device") or ", ".join(header.get("devices", []))
        except (ValueError, AttributeError) as e:
            facts["bench"] = f"unreadable: {e}"
    return facts


def summarize(out: Path, keep: Path, dry: bool, seconds: int, budget: int, part: str = "all") -> dict:
    steps = read_steps(keep / "steps.tsv")
    for s in steps:
        log = keep / "logs" / f"{s['step']}.log"
        if log.exists():
            s["log"] = f"{ARCHIVE}:logs/{s['step']}.log"
    doc: dict = {"part": part, "dry_run": dry, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "seconds": seconds, "budget_s": budget, "steps": steps}
    info_log = keep / "logs" / "info.log"
    if info_log.exists():
        text = info_log.read_text(errors="replace")
        doc.update(_info_facts(text))
        init = _init_facts(text)
        if init:
            doc["nccl_init"] = init
    doc.update(_bench_facts(out))
    tests = parse_junit_files(sorted((keep / "junit").glob("*.xml")) + [keep / "pytest-gpu.xml"])
    if tests is not None:
        doc["tests"] = tests
    return doc


def print_table(doc: dict, out: Path) -> None:
    print()
    print(f"gpu_check --part {doc.get('part', 'all')} {'DRY RUN ' if doc['dry_run'] else ''}summary "
          f"({doc['seconds']}s of a {doc['budget_s']}s "
          f"budget; {out / SUMMARY}, logs in {out / ARCHIVE})")
    if doc.get("device"):
        print(f"  device: {doc['device']}")
    if doc.get("nccl"):
        print(f"  NCCL:   {doc['nccl']}")
    init = doc.get("nccl_init")
    if init:
        said = "; ".join(f"{k}: {v if isinstance(v, str) else v[0]}" for k, v in init.items() if k != "result")
        print(f"  init:   {init.get('result', '?')}"[:200])
        if said:
            print(f"          {said}"[:200])
    t = (doc.get("tests") or {}).get("counts")
    if t:
        print(f"  tests:  {t['total']} collected, {t['passed']} passed, {t['failed']} failed, {t['error']} errors, "
              f"{t['skipped']} skipped")
        for c in doc["tests"]["cases"]:
            if c["outcome"] in ("failed", "error"):
                print(f"    {c['outcome']}: {c['id']}  {c.get('message', '')}"[:200])
    print(f"  files:  {', '.join(f['name'] for f in doc.get('files', []))}")
    print(f"  {'step':<11}{'status':<13}{'seconds':>7}{'limit':>7}  note")
    for s in doc["steps"]:
        note = s.get("reason") or (f"rc {s['rc']}" if s["status"] != "pass" else "")
        print(f"  {s['step']:<11}{s['status']:<13}{s['seconds']:>7}{s['limit_s'] or '-':>7}  {note}")
    for p in doc.get("out_problems", []):
        print(f"  $OUT: {p}")
    print(f"  RESULT: {doc['result']}")


def finish(out: Path, keep: Path, dry: bool, seconds: int, budget: int, part: str = "all") -> int:
    out.mkdir(parents=True, exist_ok=True)
    doc = summarize(out, keep, dry, seconds, budget, part)
    summary = out / SUMMARY
    # Written once before the check so that it is counted, and again with the check's outcome.
    summary.write_text(json.dumps(doc, indent=1))
    doc["archive"] = pack(keep, out / ARCHIVE)
    files, problems = check_out(out)
    ok, result = verdict(doc["steps"], problems, doc.get("tests"))
    doc.update(files=files, out_problems=problems, ok=ok, result=result)
    summary.write_text(json.dumps(doc, indent=1))
    print_table(doc, out)
    return 0 if ok else NOT_ALL_PASSED


def sanitizer_refusal(text: str) -> str | None:
    """The line where compute-sanitizer says it cannot work here, or None."""
    for line in text.splitlines():
        if _REFUSED.search(line):
            return line.strip().lstrip("=").strip()[:MESSAGE_CHARS]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("finish", help="summary, archive and $OUT check (the end of gpu_check.sh)")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--keep", type=Path, required=True, help="what the steps left: steps.tsv, logs/, junit XML")
    f.add_argument("--part", choices=("core", "extra", "all"), default="all", help="which call of gpu_check.sh")
    f.add_argument("--dry-run", action="store_true")
    f.add_argument("--seconds", type=int, default=0)
    f.add_argument("--budget", type=int, default=0)
    c = sub.add_parser("check", help="does OUT come back whole?")
    c.add_argument("out", type=Path)
    r = sub.add_parser("refused", help="exit 0 (and say why) when compute-sanitizer refused the device")
    r.add_argument("log", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "finish":
        return finish(args.out, args.keep, args.dry_run, args.seconds, args.budget, args.part)
    if args.cmd == "check":
        files, problems = check_out(args.out)
        for f_ in files:
            print(f"{f_['bytes']:>10}  {f_['name']}")
        for p in problems:
            print(f"problem: {p}")
        return 1 if problems else 0
    line = sanitizer_refusal(args.log.read_text(errors="replace")) if args.log.exists() else None
    if line:
        print(f"not supported here: {line}")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
