"""Which rank holds the others back: a report from the arrival times every collective of a host's channel
logs (Note [Arrival times] in csrc/transport/shm_arrivals.h).

Note [The straggler report]
A collective cannot finish before its last rank arrives, so the time the others wait in it is the last
rank's doing. Per call the log gives each rank's lateness after the first to arrive. The report, over
a window of recent calls (the last `calls`, or those of the last `seconds`):
- a call *waited* when its last rank came more than `floor_s` after its first: the floor separates a
  real wait (a rank that computed longer, slept, was descheduled for a while) from the jitter of ranks
  that arrive together; it is `threshold_s` / 4, or 20x the jitter of a loaded machine where that is
  more: the median over the window of how late the second-to-last rank came (with three ranks or more:
  the spread of the ranks that were not last, which one slow rank does not widen);
- per rank: `last` the calls that waited for it, `share_last` their part of all calls that waited,
  `median_s` / `p90_s` how late it was in them (its lateness in the calls that waited for it), and
  `waiting_share` the time the others spent waiting for it (the mean of their waits, summed over those
  calls) over the window's span. DDP's buckets show why it counts only calls that waited: a rank slowed
  in backward is late to its step's first bucket by the whole delay and on time for the others, which
  then run back to back.
- `named`: the ranks that were last in most calls that waited (share_last >= 2/3: with two ranks on a
  balanced run each is last about half the time), at least 3 of them, with a median lateness over
  `threshold_s`. On a balanced run nobody is.
One host's channel sees its own ranks: between hosts each host's report covers its processes (ranks of
other hosts are not in it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

DEFAULT_THRESHOLD_S = 1e-3
_JITTER_FACTOR = 20.0
_MIN_LAST = 3
_MOST = 2 / 3


@dataclass
class RankLateness:
    """One rank's lateness over the window (Note [The straggler report])."""
    rank: int
    last: int = 0
    share_last: float = 0.0
    median_s: float = 0.0
    p90_s: float = 0.0
    waiting_share: float = 0.0


@dataclass
class StragglerReport:
    """The straggler report of one host's channel over a window of calls (Note [The straggler report])."""
    calls: int                     # calls in the window
    waited: int                    # of them, calls whose last rank came after the floor
    span_s: float                  # from the window's first arrival to its last
    floor_s: float
    threshold_s: float
    ranks: List[RankLateness] = field(default_factory=list)
    named: List[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "waited": self.waited, "span_s": self.span_s, "floor_s": self.floor_s,
                "threshold_s": self.threshold_s, "named": list(self.named),
                "ranks": [vars(r).copy() for r in self.ranks]}

    def summary(self) -> str:
        """One line: who held the others back, or that nobody did."""
        if not self.named:
            return (f"stragglers: none over {self.calls} calls ({self.waited} waited more than "
                    f"{self.floor_s * 1e3:.2f} ms for a rank)")
        parts = []
        for r in self.ranks:
            if r.rank in self.named:
                parts.append(f"rank {r.rank} was last in {r.last} of {self.waited} calls that waited, "
                             f"late by {r.median_s * 1e3:.1f} ms (median; p90 {r.p90_s * 1e3:.1f} ms), "
                             f"the others waiting for it {r.waiting_share:.0%} of the time")
        return "stragglers: " + "; ".join(parts)


def host_channel(transport: Any) -> Any:
    """The channel of this process's host under `transport`, or None (alone on its host, or no transport)."""
    return getattr(transport, "host_channel", None) if transport is not None else None


def arrivals(channel: Any, calls: int = -1) -> tuple:
    """(starts [n] int64 ns, lateness [n, ranks] int64 ns, labels, calls ever logged) of the last `calls`
    calls of `channel` (-1: every one kept)."""
    total, starts, late = channel.arrivals(int(calls))
    labels = list(channel.labels)
    s = torch.frombuffer(bytearray(starts), dtype=torch.int64) if starts else torch.zeros(0, dtype=torch.int64)
    lt = (torch.frombuffer(bytearray(late), dtype=torch.int64).view(-1, len(labels)) if late else
          torch.zeros(0, len(labels), dtype=torch.int64))
    return s, lt, labels, total


def report(channel: Any, calls: Optional[int] = None, seconds: Optional[float] = None,
           threshold_s: float = DEFAULT_THRESHOLD_S) -> StragglerReport:
    """Note [The straggler report] over `channel`'s last `calls` calls (default: every one it keeps), and of
    those only the ones that started in the last `seconds` when given."""
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        raise ValueError(f"calls: must be a positive integer, got {calls!r}")
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"seconds: must be a positive number, got {seconds!r}")
    if not (isinstance(threshold_s, (int, float)) and threshold_s > 0):
        raise ValueError(f"threshold_s: must be a positive number of seconds, got {threshold_s!r}")
    starts, late, labels, _ = arrivals(channel, -1 if calls is None else calls)
    if seconds is not None and starts.numel():
        keep = starts >= starts[-1] - int(seconds * 1e9)
        starts, late = starts[keep], late[keep]
    return _report(starts, late.to(torch.float64) * 1e-9, labels, float(threshold_s))


def _report(starts: torch.Tensor, late: torch.Tensor, labels: List[int], threshold_s: float) -> StragglerReport:
    n = starts.numel()
    ranks = [RankLateness(rank=r) for r in labels]
    if n == 0:
        return StragglerReport(0, 0, 0.0, threshold_s / 4, threshold_s, ranks)
    ordered = late.sort(dim=1).values
    spread = ordered[:, -1]                               # per call: how long its first waited for its last
    jitter = float(ordered[:, -2].median()) if len(labels) >= 3 else 0.0
    floor = max(threshold_s / 4, _JITTER_FACTOR * jitter)
    span = float((starts[-1] - starts[0]).item()) * 1e-9 + float(spread[-1])
    waited = spread > floor
    last = late.argmax(dim=1)
    nwaited = int(waited.sum())
    others = max(1, len(labels) - 1)
    named = []
    for i, r in enumerate(ranks):
        mine = waited & (last == i)
        r.last = int(mine.sum())
        if r.last == 0:
            continue
        lateness = late[mine, i]
        r.share_last = r.last / nwaited
        r.median_s = float(lateness.median())
        r.p90_s = float(torch.quantile(lateness, 0.9))
        # the others' waits in those calls: this rank's lateness minus each other's, averaged over them
        waits = (late[mine, i].unsqueeze(1) - late[mine]).sum(dim=1) / others
        r.waiting_share = float(waits.sum()) / span if span > 0 else 0.0
        if r.share_last >= _MOST and r.last >= _MIN_LAST and r.median_s > threshold_s:
            named.append(r.rank)
    return StragglerReport(n, nwaited, span, floor, threshold_s, ranks, named)
