"""`ncclavg trace DUMP...`: reads the flight recorder's dumps (flight.py) of the ranks of a job, lines
them up by sequence number and says where they diverge. Plain Python (json only): it reads dumps from
another machine too.

Note [Reading the ranks' dumps]
Every rank numbers the collectives it issues on a group 1, 2, 3, ... (Note [A ring of plain lists] in
flight.py), so seq n of one rank and seq n of another are the same collective when the ranks were in
step. The verdict, per group, first that applies:
- a seq whose collective (op, dtype, count, root) differs between ranks that both recorded it: the ranks
  called different collectives; the first such seq is named, with each rank's call;
- ranks whose last issued seq is lower than the others': they are behind; each is named with its last
  completed collective, and the others with the first collective it never issued (where they wait);
- every rank issued the same last seq: the ranks agree; a collective not complete on every rank is named
  (the ranks were in step and the collective itself stalled: a frozen process, the transport), and a
  rank that issued it LATE_S or more after another (the wall clocks of one host, roughly those of two).
A seq older than a rank's ring (NCCLAVG_TRACE_BUFFER_SIZE) is not compared; the verdict says so.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, List, Sequence

PATTERN = "ncclavg-trace-*.json"
LATE_S = 1.0   # a rank that issued a collective this much after another is named as late


def load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The dumps in `paths` (files, or directories holding ncclavg-trace-*.json); ValueError naming a file
    that is no dump."""
    files: List[str] = []
    for p in paths:
        files.extend(sorted(glob.glob(os.path.join(p, PATTERN))) if os.path.isdir(p) else [p])
    if not files:
        raise ValueError(f"no dumps in {', '.join(paths)} (expected files named {PATTERN})")
    out = []
    for f in files:
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: not a readable dump ({e})") from None
        if not isinstance(d, dict) or "entries" not in d or "rank" not in d:
            raise ValueError(f"{f}: not a flight recorder dump (no 'rank' and 'entries')")
        d["_file"] = f
        out.append(d)
    return out


def _call(e: Dict[str, Any]) -> str:
    return e.get("call") or f"{e['op']} of {e['count']} x {e['dtype']}"


def _key(e: Dict[str, Any]) -> tuple:
    return (e["op"], e.get("dtype"), e.get("count"), e.get("root"))


def _where(e: Dict[str, Any]) -> str:
    text = f"seq {e['seq']} ({_call(e)}, {e['state']}"
    if e.get("error"):
        text += f": {e['error']}"
    return text + ")"


def verdict(dumps: Sequence[Dict[str, Any]]) -> List[str]:
    """The lines of the verdict, one block per group (Note [Reading the ranks' dumps])."""
    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for d in dumps:
        groups.setdefault(str(d.get("group", "")), {})[int(d["rank"])] = d   # a later dump of a rank wins
    lines: List[str] = []
    for name in sorted(groups):
        lines.extend(_group_verdict(name, groups[name]))
    return lines


def _group_verdict(name: str, ranks: Dict[int, Dict[str, Any]]) -> List[str]:
    size = max(int(d.get("size", 0)) for d in ranks.values())
    head = f"group {name or '?'}: dumps of ranks {sorted(ranks)}" + (f" of {size}" if size else "")
    out = [head]
    missing = [r for r in range(size) if r not in ranks]
    if missing:
        out.append(f"  no dump of rank(s) {missing}: they are not compared")
    by_seq = {r: {e["seq"]: e for e in d["entries"]} for r, d in ranks.items()}
    last = {r: int(d.get("last_seq", max(by_seq[r], default=0))) for r, d in ranks.items()}
    oldest = {r: min(by_seq[r], default=last[r] + 1) for r in ranks}
    done = {r: max((s for s, e in by_seq[r].items() if e["state"] == "done"), default=0) for r in ranks}

    # 1. the same seq, different collectives
    for seq in sorted(set().union(*[set(s) for s in by_seq.values()])):
        have = {r: by_seq[r][seq] for r in ranks if seq in by_seq[r]}
        if len({_key(e) for e in have.values()}) > 1:
            out.append(f"  the ranks called different collectives at seq {seq}:")
            out.extend(f"    rank {r}: {_call(e)} ({e['state']})" for r, e in sorted(have.items()))
            return out

    def last_done(r: int) -> str:
        if done[r] == 0:
            return f"rank {r} completed no collective" + (" in its buffer" if oldest[r] > 1 else "")
        return f"rank {r} last completed seq {done[r]} ({_call(by_seq[r][done[r]])})"

    # 2. ranks behind the others
    low, high = min(last.values()), max(last.values())
    if low < high:
        for r in sorted(x for x in ranks if last[x] == low):
            text = last_done(r)
            if low > done[r] and low in by_seq[r]:
                text += f" and waits in {_where(by_seq[r][low])}"
            out.append(f"  {text}; it issued nothing after seq {low}")
            for a in sorted(x for x in ranks if last[x] > low):
                nxt = by_seq[a].get(low + 1)
                if nxt is None:
                    out.append(f"  rank {a} issued seq {low + 1} but it is no longer in its buffer "
                               f"(its oldest is seq {oldest[a]})")
                else:
                    state = {"done": "went on past", "failed": "failed in"}.get(nxt["state"], "waits in")
                    out.append(f"  rank {a} {state} {_where(nxt)}, which rank {r} never issued")
        return out

    # 3. in step
    stuck = {r: by_seq[r][low] for r in ranks if low in by_seq[r] and by_seq[r][low]["state"] != "done"}
    if not stuck:
        out.append(f"  all ranks agree: every rank issued and completed seq {low}" +
                   (f" ({_call(by_seq[min(ranks)][low])})" if low in by_seq[min(ranks)] else ""))
        return out
    out.append(f"  the ranks are in step (every rank issued seq {low}); it is not complete on rank(s) "
               f"{sorted(stuck)}:")
    out.extend(f"    rank {r}: {_where(e)}" for r, e in sorted(stuck.items()))
    issued = {r: by_seq[r][low].get("issued") for r in ranks if low in by_seq[r]}
    if len(issued) > 1 and all(isinstance(t, (int, float)) for t in issued.values()):
        first, late = min(issued, key=issued.get), max(issued, key=issued.get)
        gap = issued[late] - issued[first]
        if gap >= LATE_S:
            out.append(f"  rank {late} issued seq {low} {gap:.1f} s after rank {first}: it was held up before it "
                       "(compute, data loading, a lock), not in a collective")
    return out


def table(dumps: Sequence[Dict[str, Any]], last: int = 3) -> List[str]:
    """Each dump in a line or two: who, why it was written, its last `last` collectives."""
    out = []
    for d in sorted(dumps, key=lambda d: (str(d.get("group")), int(d["rank"]))):
        out.append(f"{os.path.basename(d['_file'])}: group {d.get('group')} rank {d['rank']} of {d.get('size')} "
                   f"(pid {d.get('pid')} on {d.get('host')}, {d.get('transport')}): {d.get('reason')}")
        for e in d["entries"][-last:]:
            out.append(f"    {_where(e)}")
        out.extend(_straggler_lines(d.get("stragglers")))
    return out


def _straggler_lines(rep: Any) -> List[str]:
    """The dump's straggler report (Note [The straggler report] in stragglers.py) in a line: the ranks it
    covers (this rank's host's, or between hosts on UCX every rank) that held the others back in its recent
    collectives, if any did."""
    if not isinstance(rep, dict) or "ranks" not in rep:
        return []
    named = set(rep.get("named") or [])
    ranks = [r["rank"] for r in rep["ranks"]]
    among = f"among ranks {_span(ranks)}"
    if not named:
        return [f"    stragglers {among}: none over its last {rep.get('calls')} calls"]
    return [f"    stragglers {among}: rank {r['rank']} was last in {r['last']} of {rep.get('waited')} calls that "
            f"waited, late by {r['median_s'] * 1e3:.1f} ms (median)" for r in rep["ranks"] if r["rank"] in named]


def _span(ranks: List[int]) -> str:
    """"0-3" for consecutive ranks, else "0,2,5"."""
    if ranks and ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def main(paths: Sequence[str], last: int = 3) -> int:
    dumps = load(paths)
    print("\n".join(table(dumps, last) + [""] + verdict(dumps)))
    return 0
