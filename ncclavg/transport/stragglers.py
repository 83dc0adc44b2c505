"""Which rank holds the others back: a report from the arrival times every collective logs, in a host's
channel (Note [Arrival times] in csrc/transport/shm_arrivals.h) and, for a group on several hosts, in the
lanes between them (Note [Arrival times between hosts] in csrc/transport/host_arrivals.h).

Note [The straggler report]
A collective cannot finish before its last rank arrives, so the time the others wait in it is the last
rank's doing. Per call the log gives each rank's lateness after the first to arrive. The report, over
a window of recent calls (the last `calls`, or those of the last `seconds`):
- a call *waited* for its last rank when that rank came more than `threshold_s` (default 5 ms) after
  the first: the threshold separates a real wait (a rank that computed longer, slept, was descheduled for
  a while) from the spread of ranks that arrive together, which on a busy machine reaches a millisecond
  or two, also because the ranks of a call between hosts finish it at different times (the lanes' pace)
  and so arrive at the next one apart; a job whose steps take microseconds chooses a smaller one;
- per rank: `last_any` the share of all calls it came last to (by any margin), `last` the calls that
  waited for it, `share_last` their part of all calls that waited,
  `median_s` / `p90_s` how late it was in them (its lateness in the calls that waited for it), and
  `waiting_share` the time the others spent waiting for it (the mean of their waits, summed over those
  calls) over the window's span. DDP's buckets show why it counts only calls that waited: a rank slowed
  in backward is late to its step's first bucket by the whole delay and on time for the others, which
  then run back to back.
- `named`: the ranks that were last in most calls that waited (share_last >= 2/3: where waits happen
  by chance, with two ranks each is last about half the time), and in at least 3 of them. On a balanced
  run nobody is.
Which ranks a report covers: one host's channel, its own ranks; the lanes between hosts on UCX, every
rank of every host, the other hosts' stamps moved onto this process's clock (their offset estimated from
the lanes' hellos; its error, tens of microseconds on a LAN, is far under the threshold). Between hosts
on gloo's lanes each host's report covers its own processes, and a process alone on its host there has
none.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

DEFAULT_THRESHOLD_S = 5e-3
_MIN_LAST = 3
_MOST = 2 / 3


@dataclass
class RankLateness:
    """One rank's lateness over the window (Note [The straggler report])."""
    rank: int
    last_any: float = 0.0
    last: int = 0
    share_last: float = 0.0
    median_s: float = 0.0
    p90_s: float = 0.0
    waiting_share: float = 0.0


@dataclass
class StragglerReport:
    """The straggler report of one arrival log (a host's channel, the lanes between hosts) over a window of
    calls (Note [The straggler report])."""
    calls: int                     # calls in the window
    logged: int                    # calls the log ever logged: a later window may start here (since=)
    waited: int                    # of them, calls whose last rank came more than threshold_s after the first
    span_s: float                  # from the window's first arrival to its last
    threshold_s: float
    ranks: List[RankLateness] = field(default_factory=list)
    named: List[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "logged": self.logged, "waited": self.waited, "span_s": self.span_s,
                "threshold_s": self.threshold_s, "named": list(self.named),
                "ranks": [vars(r).copy() for r in self.ranks]}

    def summary(self) -> str:
        """One line: who held the others back, or that nobody did."""
        if not self.named:
            return (f"stragglers: none over {self.calls} calls ({self.waited} waited more than "
                    f"{self.threshold_s * 1e3:g} ms for a rank)")
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


def arrival_source(transport: Any) -> Any:
    """What logs the arrival times of `transport`'s calls: the lanes between hosts on UCX (every rank of
    every host: Note [Arrival times between hosts] in csrc/transport/host_arrivals.h), else this host's
    channel; None when neither does (one process alone, gloo's lanes with one process per host)."""
    if transport is None:
        return None
    source = getattr(transport, "arrival_source", None)
    return source if source is not None else host_channel(transport)


def call_scopes(transport: Any) -> tuple:
    """The logs that must know which of their calls serve one user call (begin_one_call/end_one_call)."""
    if transport is None:
        return ()
    found = (host_channel(transport), getattr(transport, "arrival_source", None))
    return tuple(x for x in found if x is not None)


def dump_source(transport: Any) -> Callable[[], Optional[dict]]:
    """What a flight record asks for its `stragglers` (flight.Recorder.stragglers): the report over every
    call `transport`'s arrival log keeps (arrival_source), as a dict; it holds the transport weakly, so that a group or
    communicator and its recorder are not kept alive by each other."""
    ref = weakref.ref(transport)

    def source() -> Optional[dict]:
        log = arrival_source(ref())
        return None if log is None else report(log).as_dict()

    return source


def arrivals(log: Any, calls: int = -1) -> tuple:
    """(starts [n] int64 ns, lateness [n, ranks] int64 ns, labels, calls ever logged) of the last `calls`
    calls of `log`, a host's channel or the lanes between hosts (-1: every one kept)."""
    total, starts, late = log.arrivals(int(calls))
    labels = list(log.labels)
    s = torch.frombuffer(bytearray(starts), dtype=torch.int64) if starts else torch.zeros(0, dtype=torch.int64)
    lt = (torch.frombuffer(bytearray(late), dtype=torch.int64).view(-1, len(labels)) if late else
          torch.zeros(0, len(labels), dtype=torch.int64))
    return s, lt, labels, total


def report(log: Any, calls: Optional[int] = None, seconds: Optional[float] = None,
           threshold_s: float = DEFAULT_THRESHOLD_S, since: Optional[int] = None) -> StragglerReport:
    """Note [The straggler report] over `log`'s last `calls` calls (default: every one it keeps), of
    those only the ones that started in the last `seconds` and came after the first `since` it logged
    (an earlier report's `logged`), when given."""
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        raise ValueError(f"calls: must be a positive integer, got {calls!r}")
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"seconds: must be a positive number, got {seconds!r}")
    if not (isinstance(threshold_s, (int, float)) and threshold_s > 0):
        raise ValueError(f"threshold_s: must be a positive number of seconds, got {threshold_s!r}")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
        raise ValueError(f"since: must be a count of calls >= 0 (a report's `logged`), got {since!r}")
    starts, late, labels, logged = arrivals(log, -1 if calls is None else calls)
    if since is not None:
        recent = min(max(0, logged - since), starts.numel())
        starts, late = starts[starts.numel() - recent:], late[late.shape[0] - recent:]
    if seconds is not None and starts.numel():
        keep = starts >= starts[-1] - int(seconds * 1e9)
        starts, late = starts[keep], late[keep]
    return _report(starts, late.to(torch.float64) * 1e-9, labels, float(threshold_s), logged)


def _report(starts: torch.Tensor, late: torch.Tensor, labels: List[int], threshold_s: float,
            logged: int) -> StragglerReport:
    n = starts.numel()
    ranks = [RankLateness(rank=r) for r in labels]
    if n == 0:
        return StragglerReport(0, logged, 0, 0.0, threshold_s, ranks)
    spread = late.max(dim=1).values                       # per call: how long its first waited for its last
    span = float((starts[-1] - starts[0]).item()) * 1e-9 + float(spread[-1])
    waited = spread > threshold_s
    last = late.argmax(dim=1)
    nwaited = int(waited.sum())
    others = max(1, len(labels) - 1)
    named = []
    for i, r in enumerate(ranks):
        r.last_any = float((last == i).sum()) / n
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
        if r.share_last >= _MOST and r.last >= _MIN_LAST:
            named.append(r.rank)
    return StragglerReport(n, logged, nwaited, span, threshold_s, ranks, named)
