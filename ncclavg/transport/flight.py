"""The flight recorder of the `ncclavg` backend: the last N collectives of each process group, kept in a
ring, written to a JSON file per rank when a collective of the group fails (a timeout, a lost peer, an
abort) and on demand (`dump()`, or SIGUSR1 with NCCLAVG_TRACE_SIGNAL=1). `ncclavg trace DUMP...`
(flight_reader.py) merges the ranks' files and says where they diverge.

Settings: NCCLAVG_TRACE_BUFFER_SIZE (collectives kept per group, default 2000; 0 turns the recorder
off), NCCLAVG_TRACE_DIR (where the files go; without it a failure prints a few lines to stderr),
NCCLAVG_TRACE_SIGNAL=1 (SIGUSR1 dumps every group of the process, when nothing else handles SIGUSR1).

Note [A ring of plain lists]
A training loop issues thousands of collectives a second, so recording one must cost about as little as
the Python around it already does (~1 us): one list of nine slots per collective, stored at seq % N of a
list allocated once, and three stores of times and states as the runner starts and completes it. No lock:
the sequence number comes from itertools.count (one C call, atomic under the GIL), a slot is written by
one thread at a time (the issuing thread, then the runner's), and a dump copies the ring, reading slots
that may change under it (a dump is a snapshot of a moving thing anyway). The descriptions (dtype name,
the call in words, the root) are worked out from the stored objects only when a dump is written.
The numbering is per group and per rank: the n-th collective this rank issued on the group. Ranks that
issue the same collectives in the same order (what every collective requires) give the same number to
the same collective, which is what lets the reader line the ranks up. A synchronous all_reduce that
takes a fast path (fast_path.py) makes no Job: it is recorded by `Recorder.done` (one list, the Call
made only when a dump is written), so that its number is the same whichever path a rank took.

Note [What the recorder says]
A collective that failed because of a timeout or a lost peer is the case a recorder is for: which
collective each rank was in when it stopped. Then, with NCCLAVG_TRACE_DIR set, the group's record is
written there and one line names the file; without it, a short summary goes to stderr, in one write so
that the ranks' summaries do not interleave. A mismatch (the ranks called different collectives) is the
caller's mistake, found at once, and its error already names both calls: the recorder keeps the record
(and writes the file when NCCLAVG_TRACE_DIR is set) but prints nothing, so the error's sentence is said
once, by the exception.

Note [Dumps are written whole]
A dump is written to a temporary file in the target directory and renamed over the final name
(os.replace): a reader, or a job killed while it dumps, never sees half a file. One file per rank and
group (`ncclavg-trace-rank<global rank>-group<name>.json`); a later dump of the same group replaces the
earlier one (the last is the one that shows the failure).
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

from ..errors import UsageError

ENV_SIZE, ENV_DIR, ENV_SIGNAL = "NCCLAVG_TRACE_BUFFER_SIZE", "NCCLAVG_TRACE_DIR", "NCCLAVG_TRACE_SIGNAL"
DEFAULT_SIZE = 2000
FORMAT = 1   # the dump's "format": bumped when a field changes meaning
# the slots of one record (Note [A ring of plain lists])
SEQ, CALL, DTYPE, COUNT, ISSUED, STARTED, ENDED, STATE, ERROR = range(9)
QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"

_now = time.time   # wall clock: the ranks' times compare on one host (and roughly across hosts)
_RECORDERS: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


def buffer_size() -> int:
    """NCCLAVG_TRACE_BUFFER_SIZE, or the default; raises UsageError naming the variable when it is bad."""
    raw = os.environ.get(ENV_SIZE, "").strip()
    if not raw:
        return DEFAULT_SIZE
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise UsageError(f"{ENV_SIZE}={raw!r}: expected a number of collectives >= 0 (0 turns the recorder off)")
    return n


class Recorder:
    """The ring of one process group on one rank (Note [A ring of plain lists])."""

    def __init__(self, group: str, rank: int, size: int, global_rank: int, transport: str, capacity: int):
        self.group, self.rank, self.size, self.global_rank = group, rank, size, global_rank
        self.transport, self.capacity = transport, capacity
        self.ring: List[Optional[list]] = [None] * capacity
        self._seq = itertools.count(1)
        self.last_seq = 0
        self.failure: Optional[str] = None
        # what the dump says of the group's stragglers: a callable returning the report's dict (set by the
        # group when a channel logs its arrivals: Note [The straggler report] in stragglers.py), or None
        self.stragglers: Optional[Any] = None
        _RECORDERS.add(self)

    def issue(self, call: Any, tensors: Any) -> list:
        """The record of a collective issued now: `call` a calls.Call (or the collective's name)."""
        seq = next(self._seq)
        n = len(tensors)
        rec = [seq, call, tensors[0].dtype if n else None,
               tensors[0].numel() if n == 1 else sum(t.numel() for t in tensors), _now(), 0.0, 0.0, QUEUED, None]
        self.ring[seq % self.capacity] = rec
        self.last_seq = seq
        return rec

    def done(self, what: tuple, dtype: Any, count: int) -> None:
        """A collective that completed on a fast path (fast_path.py) as it was issued: `what` is
        (collective, op or None, root or None), made into a calls.Call only when a dump describes it (the
        hot path stores one list; Note [A ring of plain lists])."""
        seq = next(self._seq)
        now = _now()
        # a tuple, not a list: it holds no container the collector must follow, so it stops being
        # tracked at the first collection (thousands of lists in the ring made every call ~2 us slower)
        self.ring[seq % self.capacity] = (seq, what, dtype, count, now, now, now, DONE, None)
        self.last_seq = seq

    # ------------------------------------------------------------------ dumps
    def snapshot(self, reason: str) -> Dict[str, Any]:
        recs = sorted((r for r in list(self.ring) if r is not None), key=lambda r: r[SEQ])
        return {"format": FORMAT, "reason": reason, "time": _now(), "host": socket.gethostname(), "pid": os.getpid(),
                "group": self.group, "rank": self.rank, "size": self.size, "global_rank": self.global_rank,
                "transport": self.transport, "buffer_size": self.capacity, "last_seq": self.last_seq,
                "failure": self.failure, "stragglers": self._stragglers(), "entries": [_entry(r) for r in recs]}

    def _stragglers(self) -> Optional[Dict[str, Any]]:
        if self.stragglers is None:
            return None
        try:
            return self.stragglers()
        except Exception as e:   # noqa: BLE001 (a dump is written whatever else fails)
            return {"error": f"{type(e).__name__}: {e}"}

    def file_name(self) -> str:
        return f"ncclavg-trace-rank{self.global_rank}-group{re.sub(r'[^A-Za-z0-9_.-]', '_', self.group)}.json"

    def dump(self, reason: str, path: Optional[str] = None) -> Optional[str]:
        """Writes the ring to `path` (a file or a directory), else to NCCLAVG_TRACE_DIR, atomically (Note
        [Dumps are written whole]); returns the file written, or None when neither is given: then a
        summary goes to stderr."""
        snap = self.snapshot(reason)
        target = path or os.environ.get(ENV_DIR, "").strip()
        if not target:
            say(summary(snap))
            return None
        if os.path.isdir(target) or not target.endswith(".json"):
            os.makedirs(target, exist_ok=True)
            target = os.path.join(target, self.file_name())
        write_atomically(target, snap)
        return target

    def failed(self, msg: str, job: Any = None, loud: bool = True) -> None:
        """The group failed with `msg` (runner.Runner.fail), during `job` (a runner.Job) or none: recorded
        once (Note [What the recorder says]); a failure to dump is a line on stderr, never an exception on
        the failing path. A job without a record (a fast path's failure) is recorded now. `loud`: a
        timeout or a lost peer, which the summary or the file's path is printed for."""
        if self.failure is not None:
            return
        self.failure = msg
        rec = None if job is None else job.rec
        if rec is None and job is not None and job.call is not None:
            rec = self.issue(job.call, ())
            rec[COUNT] = job.call.count
        if rec is not None:
            rec[STATE], rec[ERROR], rec[ENDED] = FAILED, msg, _now()
        try:
            if not os.environ.get(ENV_DIR, "").strip():
                if loud:
                    say(summary(self.snapshot(f"the group failed: {msg}")))
                return
            where = self.dump(f"the group failed: {msg}")
            if loud:
                say(f"ncclavg: rank {self.global_rank}: the last {self.capacity} collectives of group {self.group} "
                    f"are in {where} (read them with `ncclavg trace`)")
        except Exception as e:   # noqa: BLE001 (reported, the failure itself goes on)
            say(f"ncclavg: rank {self.global_rank}: the flight recorder could not write its dump: {e}")


# ---------------------------------------------------------------------- the runner's and the fast paths' hooks
def start(rec: list) -> None:
    rec[STARTED], rec[STATE] = _now(), RUNNING


def finish(rec: list, error: Optional[BaseException]) -> None:
    rec[ENDED] = _now()
    if error is None:
        rec[STATE] = DONE
    else:
        rec[STATE], rec[ERROR] = FAILED, str(error)


def for_group(group: str, rank: int, size: int, global_rank: int, transport: str) -> Optional[Recorder]:
    """The recorder of a new group, or None when NCCLAVG_TRACE_BUFFER_SIZE=0; installs the signal
    handler when NCCLAVG_TRACE_SIGNAL asks for it."""
    n = buffer_size()
    if os.environ.get(ENV_SIGNAL, "").strip() not in ("", "0"):
        install_signal()
    return Recorder(group, rank, size, global_rank, transport, n) if n > 0 else None


# ---------------------------------------------------------------------- on demand
def dump(group: Any = None, path: Optional[str] = None, reason: str = "on demand") -> List[str]:
    """Writes the flight record of `group` (a ProcessGroup of the ncclavg backend; None: every group of
    this process) to `path` (a directory, or a .json file for one group), else NCCLAVG_TRACE_DIR, else a
    summary to stderr. Returns the files written."""
    if group is not None:
        rec = getattr(group, "_flight", None)
        if rec is None:
            import torch.distributed as dist   # a group torch wraps: the backend object behind it

            try:
                rec = getattr(group._get_backend(dist.get_default_backend_for_device("cpu")), "_flight", None)
            except Exception:   # noqa: BLE001
                rec = None
        if rec is None:
            raise ValueError("group: not a process group of the ncclavg backend with its flight recorder on "
                             f"({ENV_SIZE}=0 turns it off)")
        recorders = [rec]
    else:
        recorders = sorted(_RECORDERS, key=lambda r: r.group)
    out = []
    for rec in recorders:
        where = rec.dump(reason, path)
        if where is not None:
            out.append(where)
    return out


_signal_lock = threading.Lock()
_signal_installed = False


def install_signal(signum: int = signal.SIGUSR1) -> bool:
    """SIGUSR1 dumps every group's record (reason "signal"), if nothing else handles it and this is the
    main thread. The handler runs when the main thread next runs Python code: within a second in a
    wait on a Work (it waits in slices), after the call when a synchronous collective is blocked inside
    the channel (the failure at its timeout dumps anyway)."""
    global _signal_installed
    with _signal_lock:
        if _signal_installed:
            return True
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signum) not in (signal.SIG_DFL, None):
            return False
        signal.signal(signum, lambda *_: dump(reason="signal"))
        _signal_installed = True
        return True


# ---------------------------------------------------------------------- writing out
def _entry(r: list) -> Dict[str, Any]:
    from .calls import Call, describe

    call, dtype = r[CALL], r[DTYPE]
    if isinstance(call, tuple):   # a fast path's (collective, op, root): Recorder.done
        from .calls import make

        collective, op, root = call
        call = make(collective, dtype, op, root, r[COUNT])
    e: Dict[str, Any] = {"seq": r[SEQ], "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
                         "count": r[COUNT], "issued": r[ISSUED], "started": r[STARTED] or None,
                         "ended": r[ENDED] or None, "state": r[STATE], "error": r[ERROR]}
    if isinstance(call, Call):
        field = (call.tag >> 24) & 0xFFFFF
        e.update(op=call.collective, root=field - 1 if field else None, call=describe(call.tag, call.count))
    else:
        e.update(op=str(call), root=None, call=str(call))
    return e


def say(text: str) -> None:
    """`text` on stderr in one write(2) (a pipe takes up to 4 KiB at once): the summaries of two ranks that
    share a terminal or a launcher's pipe never interleave line by line."""
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    data = (text.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # a replaced stderr (pytest's capture): its own write
        sys.stderr.write(data.decode("utf-8"))
        return
    while data:
        n = os.write(fd, data)
        data = data[n:]


def write_atomically(path: str, obj: Any) -> None:
    """JSON to `path` through a temporary file in the same directory and os.replace."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def summary(snap: Dict[str, Any]) -> str:
    """A few lines of a dump for stderr: the last completed collective and those not complete."""
    entries = snap["entries"]
    done = [e for e in entries if e["state"] == DONE]
    open_ = [e for e in entries if e["state"] != DONE]
    head = (f"ncclavg flight recorder, group {snap['group']} rank {snap['rank']} of {snap['size']} (global "
            f"rank {snap['global_rank']}, pid {snap['pid']}): {snap['reason']}")
    lines = [head, "  last completed: " + (f"seq {done[-1]['seq']} {done[-1]['call']}" if done else "none")]
    for e in open_[-5:]:
        lines.append(f"  seq {e['seq']} {e['call']}: {e['state']}" + (f" ({e['error']})" if e["error"] else ""))
    lines.append(f"  (set {ENV_DIR} to keep the last {snap['buffer_size']} collectives as a file for `ncclavg trace`)")
    return "\n".join(lines)
