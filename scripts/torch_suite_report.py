#!/usr/bin/env python3
"""Markdown summary of scripts/torch_suite.py's JSON results: counts per configuration, and every
test that passes on gloo but not on the other backend at the same world size, with its first error
line and a reviewer's note on whether it asserts something gloo-only.

    python scripts/torch_suite_report.py bench/results/torch_suite/*.json \
        --notes bench/results/torch_suite/notes.json > bench/results/torch_suite.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def label(config: dict) -> str:
    lifted = "gloo gates lifted" if config["lift_gates"] else "as is"
    if config.get("lift_profiling"):
        lifted += " + profiling"
    return f"{config['backend']}, {config['world_size']} ranks, {lifted}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def gloo_only_passes(runs: list[dict]) -> list[tuple[dict, str, str, dict]]:
    """(run, test, gloo's outcome, the run's entry) for each test that passed on gloo at the run's
    world size and did not pass in the run."""
    gloo = {r["config"]["world_size"]: r for r in runs if r["config"]["backend"] == "gloo"}
    rows = []
    for run in runs:
        ref = gloo.get(run["config"]["world_size"])
        if run["config"]["backend"] == "gloo" or ref is None:
            continue
        for name, entry in sorted(run["tests"].items()):
            if ref["tests"].get(name, {}).get("outcome") == "passed" and entry["outcome"] != "passed":
                rows.append((run, name, "passed", entry))
    return rows


def render(runs: list[dict], notes: dict[str, str]) -> str:
    runs = sorted(runs, key=lambda r: (r["config"]["world_size"], r["config"]["backend"] != "gloo",
                                       r["config"]["lift_gates"]))
    out = ["| configuration | passed | failed | skipped | selected | wall time |", "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        c = r["counts"]
        selected = r["config"]["selected"]
        if not r.get("complete", True):
            selected = f"{len(r['tests'])} of {selected} (cut short)"
        out.append(f"| {label(r['config'])} | {c['passed']} | {c['failed']} | {c['skipped']} | "
                   f"{selected} | {r['wall_seconds'] / 60:.1f} min |")
    out += ["", "Tests that pass on gloo and fail or skip on the other backend, same world size:", ""]
    rows = gloo_only_passes(runs)
    if not rows:
        out.append("(none)")
    else:
        out += ["| configuration | test | outcome | first error line (or skip reason) | gloo-only? |",
                "|---|---|---|---|---|"]
        for run, name, _, entry in rows:
            why = entry.get("error") or entry.get("reason", "")
            out.append(f"| {label(run['config'])} | `{name}` | {entry['outcome']} | {_cell(why[:300])} | "
                       f"{_cell(notes.get(name, ''))} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--notes", type=Path, help="JSON: test name -> note (is what it asserts gloo-only?)")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.results]
    notes = json.loads(args.notes.read_text()) if args.notes and args.notes.exists() else {}
    sys.stdout.write(render(runs, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
