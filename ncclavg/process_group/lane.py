"""How the `ncclavg` torch.distributed backend (group.py) runs its CPU collectives: a Lane executes
the collectives of one process group, one after another in the order they were issued, each to
completion; BackendWork is the torch `Work` handed back for each; the errors
a failed collective raises are torch's DistBackendError and ncclavg's CommError at once.

Note [Backend lanes]
torch.distributed lets a caller issue a collective and wait for it later (DDP issues one all-reduce per
bucket while backward goes on). A lane is a worker thread and a queue: a collective issued with
async_op=True (and every collective DDP, FSDP2 or a functional collective issues from C++) is queued and
returns at once (except a small all_reduce, broadcast, all-gather or reduce-scatter whose peers are
already in it, which runs at once on the caller's thread: Note [An asynchronous call whose peers wait] in
csrc/transport/shm_channel.cpp); the worker runs the queued collectives in order, each to completion,
through the shared-memory channel (which releases the GIL while it works, so backward keeps computing) or
through the group's inner gloo. A collective whose caller waits at once (async_op=False) runs on the
caller's thread when nothing is queued: no thread hop for the small synchronous calls of a training loop
(except while torch's profiler runs: Note [Profiler ranges of a Python backend] in profiling.py). Every
CPU collective of a group goes through its lane, the gloo fallbacks too, so they complete in the
order they were issued, as the ranks issued them (point-to-point calls do not: a recv that waits for a
later send would block the lane, see group.py). With a channel, the lane's order is the
channel's: it holds the channel's own lock while a job runs and counts its queued jobs where the
small-message fast path looks (Note [An order held by the caller] in shm.py; fast_path.py).

Note [Backend works and futures]
torch hands a Work to its callers; DDP's reducer and the functional collectives call getFuture() and
wait on the torch Future from C++. A Python future completed with set_exception holds the exception as
its *value*, which C++ takes for a result (and DDP crashes reading it as tensors). So the future handed
out is `inner.then(value)`: the lane completes `inner` (result or exception), and the callback's raise
marks the outer future failed the way C++ understands. Through such a future the error reaches C++
waiters (DDP's backward) as a RuntimeError carrying the message; `Work.wait()` from Python raises the
BackendError itself.

Note [Per-collective deadlines]
Every collective has a deadline: the `timeout` of its process group (or the per-call opts.timeout),
from when the lane starts it. A gloo step waits at most until the deadline. A channel step is ended
by the lane's watchdog, which checks the running collective every WATCH_S: past its deadline, it names
the lost rank (the group's heartbeats) and aborts the channel with that text, which ends this rank's
wait at once and fails every peer's next wait with the same words: the user's call and the group's
timeout, on every rank. The channel's own limit is a backstop BACKSTOP_S later (Job.channel_limit), so
that its lower-level text ("all_reduce_sum timed out after 1.998 s") is not the one the peers read.

Note [What a job records]
A job issued with a flight recorder on carries its record (`rec`, flight.py) and, when issued while
torch's profiler runs, its open profiler range (`prof`, profiling.py): the lane marks the record running
when it starts the job; completing the job marks it done or failed and ends the range, on whichever
thread completes it. The lane's first failure (`_fail`) hands the recorder the failure and the job it
happened in, and the recorder writes its dump then: every timeout, lost peer, mismatch and abort leaves
the group's last collectives behind (Note [Dumps are written whole] in flight.py).
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from .._ext import _C
from ..errors import BackendError, BackendMismatchError, BackendTimeoutError  # noqa: F401  (re-exported)
from ..transport import flight, profiling
from ..transport.executor import SLACK_S, Executor
from ..transport.liveness import DIAGNOSE_S

WATCH_S = 0.2      # how often the watchdog looks at the running collective
# after the deadline: the watchdog's next look, its naming of the lost rank (bounded by DIAGNOSE_S), and
# the scheduling slack of Note [One deadline per call] in transport/executor.py
BACKSTOP_S = WATCH_S + DIAGNOSE_S + SLACK_S


def timed_out(what: str, timeout: float, own: bool = False) -> str:
    """A timeout's words, with " timeout " as gloo's and NCCL's say it (launchers, tools and torch's own
    tests look for it), and the limit; `own`: the call's own timeout (torch's per-call options), not
    its group's."""
    return f"{what} did not complete within {timeout:g} s: {'the call' if own else 'the group'}'s timeout expired"


class Job:
    """One collective: `run(job)` does it on the lane; `result` is what its future holds (the output
    tensors); `what` names it in errors; `call` (calls.Call) is the user's call every rank compares
    (Note [Every call compared] in cpu_collectives.py); `namer` names the lost rank after a timeout."""

    __slots__ = ("run", "result", "what", "timeout", "own_timeout", "namer", "call", "deadline", "expired", "error",
                 "event", "future", "rec", "prof", "__weakref__")

    def __init__(self, run: Callable[["Job"], None], result: Any, what: str, timeout: float,
                 namer: Optional[Callable[[], str]] = None, call: Any = None, own_timeout: bool = False):
        self.run, self.result, self.what, self.timeout, self.namer = run, result, what, float(timeout), namer
        self.own_timeout = own_timeout   # the call's own limit (torch's per-call options), not the group's
        self.call = call
        self.deadline: Optional[float] = None   # monotonic, set when the lane starts it
        self.expired: Optional[str] = None      # the watchdog's text, once past the deadline
        self.error: Optional[BaseException] = None
        self.event = threading.Event()
        self.future = torch.futures.Future()
        self.rec: Optional[list] = None   # Note [What a job records]
        self.prof: Any = None

    def remaining(self) -> float:
        """Seconds left before the deadline (raises BackendTimeoutError when none are)."""
        left = (self.deadline or time.monotonic() + self.timeout) - time.monotonic()
        if left <= 0:
            raise BackendTimeoutError(timed_out(self.what, self.timeout, self.own_timeout))
        return left

    def channel_limit(self) -> float:
        """The limit a channel step of this job is given: the deadline plus BACKSTOP_S (Note
        [Per-collective deadlines]); raises BackendTimeoutError past the deadline, as remaining()."""
        return self.remaining() + BACKSTOP_S

    def wait_gloo(self, work: Any) -> None:
        """Waits for a gloo work until this job's deadline."""
        work.wait(datetime.timedelta(seconds=self.remaining()))

    def _complete(self, error: Optional[BaseException]) -> None:
        if error is not None and not isinstance(error, Exception):   # a KeyboardInterrupt on the lane
            error = BackendError(f"{self.what} was interrupted: {type(error).__name__}")
        self.error = error
        if self.rec is not None:
            flight.finish(self.rec, error)
        if self.prof is not None:
            profiling.end(self.prof)
        self.event.set()
        if error is None:
            self.future.set_result(self.result)
        else:
            self.future.set_exception(error)
        self.run = None   # type: ignore[assignment]  (drops the closure's tensors)


def _value(fut: Any) -> Any:
    return fut.value()   # raises the lane's exception: the outer future fails (Note [Backend works and futures])


class BackendWork(dist.Work):
    """The torch Work of one lane collective: wait(timeout), is_completed(), get_future(), exception()."""

    def __init__(self, job: Job, lane: Optional["Lane"] = None):
        super().__init__()
        self._job = job
        self._lane = lane
        self._outer: Optional[Any] = None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Waits until the collective is complete and raises its error. Without a timeout (torch passes 0
        for none) it waits as long as the collective and those queued before it take: each of them is
        bounded by its own deadline (Note [Per-collective deadlines])."""
        job = self._job
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        if seconds > 0:
            if not job.event.wait(seconds):
                raise BackendTimeoutError(f"{job.what}: wait() gave up after {seconds:g} s (the collective goes "
                                          f"on until its own timeout of {job.timeout:g} s)")
        else:
            while not job.event.wait(1.0):
                if self._lane is not None and not self._lane.alive():
                    raise BackendError(f"{job.what}: the process group's worker thread is gone")
        if job.error is not None:
            raise job.error
        return True

    def is_completed(self) -> bool:
        return self._job.event.is_set()

    def is_success(self) -> bool:
        return self._job.event.is_set() and self._job.error is None

    def exception(self) -> Optional[BaseException]:
        return self._job.error

    def result(self) -> List[torch.Tensor]:
        res = self._job.result
        return list(res) if isinstance(res, (list, tuple)) else [res]

    def synchronize(self) -> None:
        pass

    def get_future(self) -> Any:
        if self._outer is None:
            self._outer = self._job.future.then(_value)
        return self._outer


def issued_elsewhere(job: Job) -> None:
    """The run of a Job that the lane never runs (a point-to-point call gloo runs: P2PWork)."""
    raise AssertionError(f"{job.what} is gloo's to run, not the lane's")


class P2PWork(BackendWork):
    """gloo's work of a point-to-point call issued while torch's profiler runs: the job's range ends
    when gloo's work completes, seen by a thread of its own that waits for it (gloo's send and recv works
    offer no future to hang a callback on), and wait() returns once it has ended (Note [Profiler ranges
    of a Python backend] in profiling.py). Costs a thread per call, only while profiling."""

    def __init__(self, work: Any, job: Job):
        super().__init__(job)
        self._inner = work
        threading.Thread(target=self._await, name="ncclavg-p2p-profile", daemon=True).start()

    def _await(self) -> None:
        error: Optional[BaseException] = None
        try:
            self._inner.wait()   # bounded by the group's timeout (gloo's own)
        except BaseException as e:   # noqa: BLE001 (handed to the waiter)
            error = e
        job = self._job
        if job.prof is not None:   # on a long-lived thread: this one ends now (profiling._Closer)
            profiling.end_elsewhere(job.prof)
            job.prof = None
        job._complete(error)

    def _source_rank(self) -> int:
        return self._inner._source_rank()


class Lane(Executor):
    """Runs jobs in order on one worker thread (or inline, see Note [Backend lanes]), on the executor of
    both faces (Note [One executor] in transport/executor.py); the first failure fails every later job (a
    failed lane stays failed: the ranks no longer agree on what comes next). `transport` is the group's
    host channel (shm.ShmTransport), or None; with one, the lane's order is the channel's own lock and
    count. `fast_paths`: objects with a disable() (fast_path.py) that the lane turns off when it fails or
    closes."""

    def __init__(self, transport: Any, label: str):
        super().__init__(f"ncclavg-lane-{label}", order=transport.exec_lock if transport is not None else None)
        self.transport = transport
        self.label = label
        self.failure: Optional[str] = None
        self._current: Optional[Job] = None
        self.fast_paths: List[Any] = []
        self.recorder: Optional[flight.Recorder] = None   # set by the group (Note [What a job records])
        self._watchdog: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ submitting
    def submit(self, job: Job, inline: bool = False) -> BackendWork:  # type: ignore[override]
        work = BackendWork(job, self)
        refuse = super().submit(job, inline)
        if refuse is not None:
            job._complete(BackendError(refuse))
        return work

    def _refusal(self, job: Job) -> Optional[str]:
        if self._closed:
            return f"{job.what}: the process group was shut down"
        if self.failure is not None:
            return (f"{job.what} refused: an earlier collective failed ({self.failure}); the process "
                    "group is unusable now")
        return None

    def _started(self) -> None:
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        if self._watchdog is None and self.transport is not None:
            self._watchdog = threading.Thread(target=self._watch, name=f"ncclavg-watch-{self.label}", daemon=True)
            self._watchdog.start()

    # ------------------------------------------------------------------ running
    def _run(self, job: Job) -> Optional[BaseException]:
        """One job, holding the lane's order (the executor calls it); its error, or None."""
        job.deadline = time.monotonic() + job.timeout
        if job.rec is not None:
            flight.start(job.rec)
        if self.failure is not None:   # failed while this job waited in the queue
            return BackendError(f"{job.what} refused: an earlier collective failed ({self.failure}); the "
                                "process group is unusable now")
        if self.transport is not None and self._watchdog is None:
            with self._lock:
                self._start_watchdog()
        self._current = job
        if self.transport is not None:
            self.transport.held(True)
        try:
            # the in-place steps on the user's tensors (an nn.Parameter too) are not autograd's
            with torch.no_grad():
                job.run(job)
        except BaseException as e:   # noqa: BLE001 (handed to the waiter)
            return self._failed(job, e)
        finally:
            self._current = None
            if self.transport is not None:
                self.transport.held(False)
        return None

    def _finished(self, job: Job, error: Optional[BaseException]) -> None:
        # after the job left the count where the fast paths look (Note [One executor]), so that a
        # synchronous call its waiter makes next takes them, as after a call of its own
        job._complete(error)

    def _failed(self, job: Job, e: BaseException) -> BaseException:
        """The error a failed job raises, and the lane failed with it unless nothing was sent. A mismatch
        names both calls and the channel's own errors name the lost or aborting rank, so neither asks the
        heartbeats; anything else (gloo's "connection closed", gloo's own timeout) asks them which rank
        was lost (it takes a moment). A failure at or past the deadline is a timeout whatever raised it."""
        if isinstance(e, (ValueError, TypeError)) and job.expired is None and not isinstance(e, BackendError):
            return e   # a bad argument found on the lane: nothing was sent, the lane stays usable
        text = str(e).strip() or type(e).__name__
        mismatch = isinstance(e, _C.ShmMismatchError)
        # gloo's waits end at the deadline (Job.wait_gloo) or at gloo's own timeout, which starts later;
        # the 10 ms allow for their millisecond clocks rounding down
        past_deadline = job.deadline is not None and time.monotonic() >= job.deadline - 0.01
        timed_out_now = not mismatch and (job.expired is not None or past_deadline or
                                          bool(getattr(e, "is_timeout", False)) or
                                          isinstance(e, (TimeoutError, _C.CommTimeoutError)))
        names_itself = mismatch or "stopped responding" in text or \
            (isinstance(e, _C.ShmPeerError) and not timed_out_now)
        who = "" if names_itself or job.namer is None else job.namer()
        if job.expired is not None:
            msg = job.expired
        elif timed_out_now:
            msg = f"{timed_out(job.what, job.timeout, job.own_timeout)}{who} ({text})"
        else:   # a mismatch (both calls named), a peer that exited, an abort, a broken connection
            msg = f"{job.what} failed{who}: {text}"
        self._fail(msg, mismatch, job)
        cls = BackendTimeoutError if timed_out_now else BackendMismatchError if mismatch else BackendError
        return cls(msg + "; the process group is unusable now")

    def _fail(self, msg: str, mismatch: bool = False, job: Optional[Job] = None) -> None:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = msg
        self._disable_fast_paths()
        if self.transport is not None:
            try:
                self.transport.abort(msg, mismatch)   # the peers fail at their next wait instead of at their timeout
            except Exception:   # noqa: BLE001 (an abort is best effort)
                pass
        if first and self.recorder is not None:   # after the abort: the peers need not wait for the dump
            self.recorder.failed(msg, job)

    def _watch(self) -> None:
        """See Note [Per-collective deadlines]."""
        while not self._stop.wait(WATCH_S):
            job = self._current
            if job is None or job.deadline is None or job.expired is not None or time.monotonic() < job.deadline:
                continue
            who = job.namer() if job.namer is not None else ""
            if self._current is not job:
                continue   # it completed while the peers were looked at
            job.expired = f"{timed_out(job.what, job.timeout, job.own_timeout)}{who}"
            self.transport.abort(job.expired)

    # ------------------------------------------------------------------ ending
    def _disable_fast_paths(self) -> None:
        for fast in self.fast_paths:
            fast.disable()   # from now on every call takes the lane, which says why it refuses

    def close(self, timeout: float = 10.0) -> None:  # type: ignore[override]
        """Lets the queued jobs finish (at most `timeout` s), then stops the threads and the channel."""
        self.drain(timeout)
        if self._closed:
            return
        super().close(timeout)
        self._disable_fast_paths()
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout)
        if self.transport is not None:
            self.transport.close()
