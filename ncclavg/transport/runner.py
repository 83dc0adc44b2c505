"""The one runner of ncclavg's collectives: one per channel (per torch process group, per Communicator),
the same for both faces. A collective is a `Job`; `Runner.submit` runs it at once on the caller's thread
when nothing is pending, else queues it for the runner's worker thread, and hands back a `JobWork`
(work.py); `Runner.call` does the same for a caller that waits at once, and makes no Work when the job
ran inline. The runner owns everything about a job that is not what the job does: its one deadline, the
watchdog that ends it there, the failure state that refuses every call after a failed one (in its face's
words: failure.py), the fast paths it turns off then, and the flight record.

Note [One runner]
A collective issued asynchronously returns at once and runs later on the worker; one whose caller waits
at once runs on the caller's thread when nothing is pending, so the small synchronous calls of a training
loop make no thread hop. Either way a job runs holding the runner's `order` (a native lock, _C.ShmExec,
which also counts the jobs outstanding), so jobs never overlap and complete in submission order. The
fast paths (the native all_reduce of process_group/fast_path.py, the Communicator's in comm/fast_average.py,
the Python FastCalls) run a call without a job: only through `acquire_idle`, when the lock is free and
nothing is outstanding, so they never overtake a queued job nor run beside a running one (the native ones
check the same two facts in C++: FastAllReduce::run). A job leaves the count before it completes, so
that the waiter's next synchronous call finds the runner idle, as after a call of its own.
An asynchronous call whose peers are already in it (`ready`) runs on the caller's thread too, when it is
small (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp).

Note [Calls run now]
Every fast call written in Python goes through `Runner.now`: the torch face's FastCalls (broadcast,
all_gather_into_tensor, reduce_scatter_tensor: process_group/fast_path.py) and the public API's
broadcast_tensors, all_gather and reduce_scatter_avg (comm/gloo.py). It is the one place that says when a
call may skip its job: the runner idle (acquire_idle), the profiler off (its ranges are the general
path's), and for an asynchronous call the small-size gate and the peers-ready look; and it writes the
call's flight record, as a job's would be. The native fast all-reduces (csrc/python/fast_all_reduce.cpp,
_C.GroupAllreduce) check the same facts in C++; the torch face's records through the same Recorder.done,
the public API's writes the same record into the recorder's ring in C++ (FastAllReduce::record_to).

Note [One deadline per call]
Every collective has one deadline: its timeout (the caller's, else its communicator's or process group's)
counted from when it starts to run, not from when it was queued, so that a call behind a slow one is not
charged for it. `Job.deadline` is that instant, and every other bound on the path is derived from it
here:
- the watchdog ends a job at its deadline: it names the rank the channel waits for (or the heartbeats'
  lost rank) and aborts the channel with that text, which ends this rank's wait at once and every peer's next wait with the same
  words;
- a channel step is given the limit `Job.channel_limit()`, the deadline plus BACKSTOP_S (the watchdog's
  next look, the naming, and SLACK_S for a loaded machine), so that the watchdog's words, not the
  channel's lower-level ones, are what the peers read; a gloo step waits until the deadline itself
  (`Job.wait_gloo`, `Job.remaining`). The transports' primitives are handed the job and take both from
  it at each step, between hosts too (a lane's wait on gloo, the hosts' leaders' record, the channel's
  rounds around them), so no step re-derives the deadline from a limit of its own;
- a waiter: torch's Work.wait(timeout) is the caller's patience and leaves the job running; the public
  API's waits its timeout and SLACK_S more (Job.waiter_limits), then fails the runner (work.py);
- the fast paths run a call whole on the caller's thread: there the channel's own limit (or the lanes'
  between hosts) is the deadline; a timeout of the lanes names no rank, and `failed` asks the heartbeats
  as the watchdog would have (Note [A timeout between the hosts] in csrc/transport/host_lanes.cpp).
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, Callable, List, Optional

import torch

from .._ext import _C
from . import failure as F
from . import flight, profiling
from .liveness import DIAGNOSE_S
from .stragglers import call_scopes
from .work import JobWork

# Every bound of a call is derived from its job's one deadline here (Note [One deadline per call]):
# Job.remaining, Job.channel_limit (BACKSTOP_S past it), Job.wait_gloo and Job.waiter_limits (SLACK_S).
SLACK_S = 1.0      # the scheduling margin: a loaded machine's delay between a deadline and its naming
WATCH_S = 0.2      # how often the watchdog looks at the running job
BACKSTOP_S = WATCH_S + DIAGNOSE_S + SLACK_S   # a channel step's limit past the deadline
# An asynchronous call of at most ASYNC_INLINE_BYTES runs on the caller's thread when its peers are in it
# within ASYNC_READY_S (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp).
ASYNC_INLINE_BYTES = _C.SHM_ASYNC_INLINE_BYTES
ASYNC_READY_S = 50e-6


class DeadlinePassed(TimeoutError):
    """A step of a job found its deadline passed before it started (Job.remaining)."""


class Job:
    """One collective: `body(job)` does it; `what` names it in errors; `timeout` (seconds) is its one
    deadline's length (`own_timeout`: the caller's own, not its group's); `call` (calls.Call) the user's
    call every rank compares; `result` what a torch future of it holds; `future`: make one (torch's Works
    hand it to DDP); `noting`: the step that writes the result notes whether it is all finite, in `finite`
    (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h; None: not noted). Built by
    a face, run by a Runner."""

    __slots__ = ("body", "result", "what", "timeout", "own_timeout", "call", "deadline", "ended", "expired",
                 "error", "done", "_gate", "future", "rec", "prof", "runner", "ran_inline", "started", "noting",
                 "finite", "__weakref__")

    def __init__(self, body: Optional[Callable[["Job"], None]], what: Any, timeout: float, call: Any = None,
                 result: Any = None, own_timeout: bool = False, future: bool = False):
        self.body = body
        self.describe(what, timeout, call, result, own_timeout)
        self.started: Optional[float] = None    # monotonic, when the runner starts it
        self.deadline: Optional[float] = None   # started + timeout
        self.ended: Optional[float] = None      # monotonic, once complete
        self.expired: Optional[str] = None      # the watchdog's text, once past the deadline
        self.error: Optional[BaseException] = None
        # complete: `done`, and `_gate` (held from here until then) released for the waiters. A lock, not a
        # threading.Event: an Event is a Python Condition, several microseconds per small call, and most
        # jobs run inline and complete before anyone waits
        self.done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self.future = torch.futures.Future() if future else None
        self.rec: Optional[list] = None         # its flight record (flight.py)
        self.prof: Any = None                   # its open profiler range (profiling.py)
        self.runner: Optional["Runner"] = None
        self.ran_inline = False                 # it ran on the thread that submitted it
        self.noting = False
        self.finite: Optional[bool] = None

    def describe(self, what: Any, timeout: float, call: Any = None, result: Any = None,
                 own_timeout: bool = False) -> None:
        """What the runner and the errors need of the job, besides what it does: its description, its
        deadline's length, its call, its Work's result (a typed job gets them from its face after it is made)."""
        self.what, self.timeout, self.call, self.result = what, float(timeout), call, result
        self.own_timeout = own_timeout

    def run(self) -> None:
        """What the job does: `body(job)`; a typed job (process_group/jobs.py) is a subclass that holds its
        arguments and overrides this, so that a reader finds what runs by its name."""
        self.body(self)

    ARGS: tuple = ()   # a typed job's arguments (its slots), let go of once it is complete

    def drop(self) -> None:
        """Lets go of what the job works on once complete (a Work may outlive it): the body, a typed job's
        ARGS."""
        self.body = None
        for name in self.ARGS:
            setattr(self, name, None)

    # ------------------------------------------------------------------ the deadline, for its steps
    def remaining(self) -> float:
        """Seconds left before the deadline; past it, raises the timeout error of the job's face."""
        left = (self.deadline or time.monotonic() + self.timeout) - time.monotonic()
        if left <= 0:
            raise DeadlinePassed(self.timed_out_text())
        return left

    def channel_limit(self) -> float:
        """The limit a channel step is given (Note [One deadline per call])."""
        return self.remaining() + BACKSTOP_S

    def waiter_limits(self, seconds: Optional[float]) -> tuple:
        """A public API waiter's two waits (Note [One deadline per call]): its own limit (`seconds`, else the
        job's timeout), then SLACK_S more, so that a job that started, whose deadline names the rank that
        stopped, fails first."""
        return (self.timeout if seconds is None else seconds), SLACK_S

    def wait_gloo(self, work: Any) -> None:
        """Waits for a torch.distributed work until the deadline."""
        work.wait(datetime.timedelta(seconds=self.remaining()))

    def timed_out_text(self) -> str:
        runner = self.runner
        noun = runner.face.noun if runner is not None else "group"
        whose = "the call's" if self.own_timeout else f"the {'group' if noun == 'process group' else noun}'s"
        return F.timed_out(self.what, self.timeout, whose)

    # ------------------------------------------------------------------ completion
    def wait_done(self, seconds: float) -> bool:
        """Waits at most `seconds` for the job to complete; whether it has."""
        if self.done:
            return True
        if self._gate.acquire(timeout=max(seconds, 0.0)):
            self._gate.release()   # for the next waiter
            return True
        return self.done

    def complete(self, error: Optional[BaseException]) -> None:
        if error is not None and not isinstance(error, Exception):   # a KeyboardInterrupt on the worker
            error = self._face_error(F.Kind.FAILED, f"{self.what} was interrupted: {type(error).__name__}")
        self.error = error
        self.ended = time.monotonic()
        if self.rec is not None:
            flight.finish(self.rec, error)
        if self.prof is not None:
            from . import profiling

            if error is None:
                profiling.note_arrival(self.runner)
            profiling.end(self.prof)
        self.done = True
        self._gate.release()
        if self.future is not None:
            if error is None:
                self.future.set_result(self.result)
            else:
                self.future.set_exception(error)
        self.drop()   # the closure's or the typed job's tensors

    def _face_error(self, kind: F.Kind, text: str) -> BaseException:
        runner = self.runner
        return runner.face.error_for(kind, text) if runner is not None else RuntimeError(text)


class CallNow:
    """What a transport's primitive takes of a call run now, without a job (Note [Calls run now]): its
    `call` and its limit, the channel's own (Note [One deadline per call]: on a fast path the channel's
    limit is the deadline)."""

    __slots__ = ("call", "limit")

    def __init__(self, call: Any, limit: float):
        self.call, self.limit = call, limit

    def channel_limit(self) -> float:
        return self.limit


class Runner:
    """Runs the jobs of one channel in order (Note [One runner]) under its `face` (failure.Face).
    `transport`: the channel (shm.ShmTransport; between hosts ucx.UcxHostsTransport or hosts.HostsTransport)
    the watchdog aborts, or None;
    `liveness`: the heartbeats (liveness.Liveness: `diagnose()` names the lost rank in words, " (rank 1 stopped
    responding: ...)" or "", and `mark_failed()` tells the slower survivors this rank is not lost). The first
    failure fails the runner for good: the ranks no longer agree on what comes next."""

    def __init__(self, name: str, face: F.Face, transport: Any = None, liveness: Any = None):
        self.name, self.face, self.transport = name, face, transport
        self.liveness = liveness
        self.order = _C.ShmExec()   # held while a job runs; counts the jobs outstanding (Note [One runner])
        self.failure: Optional[str] = None
        self.fast_paths: List[Any] = []          # objects with a disable(), turned off when the runner fails
        self.recorder: Optional[flight.Recorder] = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._draining = 0   # drain()s waiting on _idle
        self._queue: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._watchdog: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._current: Optional[Job] = None
        self._closed = False
        # no peers (the local backend's towers): a job queued before a failure still runs, since nothing can
        # be out of step; with peers it is refused (they no longer agree on what comes next)
        self.alone = False

    # ------------------------------------------------------------------ submitting
    def submit(self, job: Job, inline: bool = False, ready: Optional[Callable[[float], bool]] = None) -> JobWork:
        """Runs `job` now on this thread when `inline` and nothing is pending, or when `ready` (an
        asynchronous call's look for its peers, e.g. the channel's peers_ready) says its peers are in it;
        else queues it. A refused job (the runner failed or closed) completes with the refusal."""
        self.start(job, inline, ready)
        return JobWork(job)

    def call(self, job: Job, limit: float) -> None:
        """A synchronous call: `job` run (inline when nothing is pending) and waited for, at most `limit`
        s as JobWork.wait waits; raises its error. No Work object when it ran inline."""
        self.start(job, True)
        if not job.done:
            JobWork(job).wait(limit)
        elif job.error is not None:
            raise job.error

    def start(self, job: Job, inline: bool = False, ready: Optional[Callable[[float], bool]] = None) -> None:
        """submit() without its Work."""
        job.runner = self
        if ready is not None and self.acquire_idle(ready):
            self.order.add_outstanding(1)
            job.ran_inline = True
            self._execute(job, locked=True)
            return
        with self._lock:
            why = self._refusal(job)
            if why is not None:
                job.complete(self.face.error(why))
                return
            here = inline and self.order.outstanding == 0
            self.order.add_outstanding(1)
            if not here:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._worker.start()
                self._queue.put(job)
        if here:
            job.ran_inline = True
            self._execute(job)

    def ready_for(self, nbytes: int) -> Optional[Callable[[float], bool]]:
        """The look for its peers (the channel's peers_ready) of an asynchronous call that moves `nbytes`,
        when it may run on the caller's thread at all: at most ASYNC_INLINE_BYTES, on a channel. None:
        never (queue it). The one size gate in Python (the native ones: FastAllReduce::kAsyncInlineBytes)."""
        if not 0 <= nbytes <= ASYNC_INLINE_BYTES or self.transport is None:
            return None
        return getattr(self.transport, "peers_ready", None)

    def acquire_idle(self, ready: Optional[Callable[[float], bool]] = None) -> bool:
        """Takes the order lock when it is free, nothing is outstanding and the runner takes calls; with
        `ready` (an asynchronous call), only when ready(ASYNC_READY_S) also says its peers are in it. True:
        the caller holds the lock and must `self.order.release()`. The one rule of running a call on the
        caller's thread (Note [One runner])."""
        order = self.order
        if not order.acquire(False):
            return False
        if order.outstanding == 0 and self.failure is None and not self._closed and \
                (ready is None or ready(ASYNC_READY_S)):
            return True
        order.release()
        return False

    def now(self, round_: Callable[[], Any], what: Any, dtype: Any, count: int, async_bytes: int = -1) -> bool:
        """Note [Calls run now]: `round_()`, one call into the channel (or the lanes) that is a whole
        collective, on the caller's thread when the runner is idle, the profiler off and, for an asynchronous
        call (`async_bytes` >= 0: the bytes it moves), only when it moves at most ASYNC_INLINE_BYTES and its
        peers are in it already; the call is then recorded as done (flight.Recorder.done: `what` its Call or
        (collective, op, root), `dtype`, `count`) and True is returned. False: nothing was done, the general
        path runs the call. A failed round raises the channel's error (failure.CHANNEL_ERRORS), for the face
        to fail by (`failed_without_job`)."""
        if profiling.enabled():
            return False
        ready = None
        if async_bytes >= 0:
            ready = self.ready_for(async_bytes)
            if ready is None:
                return False
        if not self.acquire_idle(ready):
            return False
        try:
            round_()
        finally:
            self.order.release()
        if self.recorder is not None:
            self.recorder.done(what, dtype, count)
        return True

    def _refusal(self, job: Job) -> Optional[str]:
        if self._closed:
            return f"{job.what}: the {self.face.noun} was shut down"
        if self.failure is not None:
            return F.refusal(job.what, self.failure, self.face.noun)
        return None

    # ------------------------------------------------------------------ running
    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: Job, locked: bool = False) -> None:
        """Runs `job` under the order lock (taken here unless `locked`) and completes it. One frame between
        the caller and the job's `run` (Note [Frames of a call] in process_group/jobs.py)."""
        if not locked:
            self.order.acquire()   # free, or held for a moment by a fast path
        error: Optional[BaseException] = None
        try:
            job.started = time.monotonic()
            job.deadline = job.started + job.timeout
            if job.rec is not None:
                flight.start(job.rec)
            if self.failure is not None and not self.alone:   # failed while this job waited in the queue
                error = self.face.error(F.refusal(job.what, self.failure, self.face.noun))
            else:
                if self.transport is not None and self._watchdog is None:
                    self._start_watchdog()
                self._current = job
                grad = torch.is_grad_enabled()   # off for the in-place steps on the user's tensors (an
                torch._C._set_grad_enabled(False)  # nn.Parameter too); by hand: torch.no_grad() costs us
                # a job is one user call, however many collectives it takes: the host's channel and the lanes
                # between hosts log the ranks' arrival at its first (Note [Arrival times] in
                # csrc/transport/shm_arrivals.h, Note [Arrival times between hosts] in host_arrivals.h)
                scopes = call_scopes(self.transport)
                for scope in scopes:
                    scope.begin_one_call()
                try:
                    job.run()
                except BaseException as e:   # noqa: BLE001 (handed to the waiter)
                    error = self.failed(job, e)
                finally:
                    for scope in scopes:
                        scope.end_one_call()
                    torch._C._set_grad_enabled(grad)
                    self._current = None
        finally:
            self.order.release()
        self.order.add_outstanding(-1)
        try:
            job.complete(error)   # after it left the count (Note [One runner])
        finally:
            if self._draining:   # (read unlocked: drain() looks again every 0.1 s anyway)
                with self._lock:
                    if self.order.outstanding == 0:
                        self._idle.notify_all()

    # ------------------------------------------------------------------ failing
    def failed(self, job: Job, e: BaseException) -> BaseException:
        """The error `job` fails with after `e`, the runner failed with it (unless nothing was sent: a bad
        argument found inside the job). See Note [Failures are told by type] in failure.py."""
        if isinstance(e, (ValueError, TypeError)) and job.expired is None:
            return e   # a bad argument found on the worker: nothing was sent, the runner stays usable
        text = F.describe_error(e)
        # gloo's waits end at the deadline (Job.wait_gloo) or at gloo's own timeout, which starts later;
        # the 10 ms allow for their millisecond clocks rounding down
        past = job.expired is not None or (job.deadline is not None and time.monotonic() >= job.deadline - 0.01)
        kind = F.kind_of(e, past)
        named = isinstance(e, F.NAMES_ITSELF) and getattr(self.transport, "names_peers", True)
        who = "" if named or kind is F.Kind.MISMATCH or job.expired is not None else self._who()
        if job.expired is not None:
            msg = job.expired
        elif isinstance(e, DeadlinePassed):
            msg = f"{e}{who}"
        elif kind is F.Kind.TIMEOUT:
            msg = f"{job.timed_out_text()}{who} ({text})"
        else:   # a mismatch (both calls named), a peer that exited, an abort, a broken connection
            msg = f"{job.what} failed{who}: {text}"
        self.fail(msg, kind, job)
        err = self.face.error_for(kind, F.unusable(msg, self.face.noun))
        return err

    def failed_without_job(self, what: Any, timeout: float, call: Any, own_timeout: bool,
                           e: BaseException) -> BaseException:
        """failed() for a call a fast path ran without a job: the runner fails as that call's job would have."""
        job = Job(None, what, timeout, call, own_timeout=own_timeout)
        job.runner = self
        return self.failed(job, e)

    def _who(self) -> str:
        """The heartbeats' words for the lost rank (Note [Naming the lost rank] in liveness.py), or ""."""
        return self.liveness.diagnose() if self.liveness is not None else ""

    def fail(self, msg: str, kind: F.Kind = F.Kind.FAILED, job: Optional[Job] = None) -> None:
        """Fails the runner with `msg`: every later call is refused saying it, the fast paths are turned
        off, the channel is aborted (the peers fail at their next wait instead of at their timeout), and
        the flight recorder keeps the record (Note [What the recorder says] in flight.py)."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = msg
        if first and self.liveness is not None:   # this rank is alive: a slower survivor must not name it
            self.liveness.mark_failed()
        for fast in self.fast_paths:
            fast.disable()   # from now on every call takes the runner, which says why it refuses
        if self.transport is not None:
            try:
                self.transport.abort(msg, kind is F.Kind.MISMATCH)
            except Exception:   # noqa: BLE001 (an abort is best effort)
                pass
        if first and self.recorder is not None:   # after the abort: the peers need not wait for the dump
            self.recorder.failed(msg, job, loud=kind in (F.Kind.TIMEOUT, F.Kind.LOST, F.Kind.FAILED))

    def fail_waiter(self, job: Job, timeout: float) -> BaseException:
        """A public API waiter gave up on `job` after `timeout` s (+ SLACK_S): the runner fails with a
        timeout naming the job, and that is the error the waiter raises (Note [One deadline per call])."""
        if job.done:
            return job.error   # type: ignore[return-value]  (it completed meanwhile)
        msg = F.timed_out(job.what, timeout, "the wait's") + self._who()
        self.fail(msg, F.Kind.TIMEOUT, job)
        return self.face.timeout_error(F.unusable(msg, self.face.noun))

    # ------------------------------------------------------------------ the watchdog
    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is None and not self._closed:
                self._watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        """Ends the running job at its deadline: Note [One deadline per call]."""
        while not self._stop.wait(WATCH_S):
            job = self._current
            if job is None or job.deadline is None or job.expired is not None or time.monotonic() < job.deadline:
                continue
            # the rank the channel waits for, else the heartbeats' lost rank (Note [Naming the lost rank])
            who = self.transport.stalled_on() or self._who()
            if self._current is not job:
                continue   # it completed while the peers were looked at
            job.expired = job.timed_out_text() + who
            self.transport.abort(job.expired)

    # ------------------------------------------------------------------ state and ending
    def running(self) -> Optional[Job]:
        """The job running now, or None."""
        return self._current

    def idle(self) -> bool:
        return self.order.outstanding == 0

    def alive(self) -> bool:
        """False once the worker thread is gone while jobs still wait for it."""
        worker = self._worker
        return worker is None or worker.is_alive() or self.order.outstanding == 0

    def drain(self, timeout: float) -> bool:
        """Waits until every submitted job completed (at most `timeout` s); True when they have."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._draining += 1
            try:
                while self.order.outstanding:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle.wait(min(left, 0.1))
            finally:
                self._draining -= 1
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float) -> bool:
        """Lets the queued jobs finish (at most `timeout` s), refuses new ones, stops the threads and closes
        the transport. True when the worker ended (or never started)."""
        self.drain(timeout)
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            worker = self._worker
            if worker is not None:
                self._queue.put(None)
        for fast in self.fast_paths:
            fast.disable()
        self._stop.set()
        if worker is not None:
            worker.join(timeout)
        if self._watchdog is not None:
            self._watchdog.join(timeout)
        if self.transport is not None:
            self.transport.close()
        return worker is None or not worker.is_alive()
