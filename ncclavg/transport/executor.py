"""The one executor of ncclavg's collectives: a queue, a worker thread, inline execution when idle, jobs
run one at a time in the order they were submitted. The torch backend's lanes (process_group/lane.py),
the shared-memory channel's own calls (shm.py) and the local backend's asynchronous averages
(comm/local.py) are built on it; what a job is, how it fails and when it times out is theirs.

Note [One executor]
A collective issued asynchronously returns at once and runs later on the worker; one whose caller waits
at once runs on the caller's thread when nothing is pending, so the small synchronous calls of a training
loop make no thread hop. Either way a job runs holding the executor's `order` lock, so jobs never
overlap and complete in submission order. For the channel, `order` is its native lock (_C.ShmExec),
which also counts the jobs outstanding: the small-message fast paths (fast_path.py, shm_fast.py) take
the lock only when that count is 0, so they never overtake a queued job, and an executor that shares
the channel (a Communicator over an ncclavg group) runs inline only when no job of either is
outstanding. A job leaves the count before its completion is announced (`finished`), so that the
waiter's next synchronous call finds the executor idle, as after a call of its own.

Note [One deadline per call]
Every collective has one deadline: its timeout (the caller's, else its communicator's or process group's)
counted from when it starts to run, not from when it was queued, so that a call behind a slow one is not
charged for it. One thing ends the call at that deadline, and every other bound is a backstop set later,
so that the deadline's own error (the one that names the rank that stopped) is the one every rank reads:
- a channel call of the public API, or of a torch backend's fast path (process_group/fast_path.py, run on
  the caller's thread without a lane): the channel itself, given the limit as the call starts (shm.py);
- a job of the torch backend's lanes (process_group/lane.py): the lane's watchdog, which names the lost
  rank from the heartbeats and aborts the channel; the channel's own limit comes BACKSTOP_S later, and a
  gloo step waits at most until the deadline;
- a waiter: a public API Work waits the caller's timeout and SLACK_S more before it gives up itself
  (shm._ShmWork); a torch Work's wait(timeout) is the caller's own patience, as on torch's backends, and
  leaves the call running to its deadline;
- an asynchronous average of the local backend (comm/local.py) waits for nobody; its close() waits for
  the queued ones at most the communicator's timeout.
SLACK_S is the one margin both faces add for scheduling on a loaded machine.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Optional


SLACK_S = 1.0   # Note [One deadline per call]


class ExecutorClosed(RuntimeError):
    """submit() after close()."""


class Executor:
    """Runs jobs in order (Note [One executor]). Subclasses (or the `run` argument) say what running and
    completing a job means: `run(job)` returns its error (None on success) and never
    raises; `finished(job, error)` is called after the order lock was released. `refusal(job)` (checked
    under the executor's lock at submission, the executor closed too) names a reason not to take the job,
    or None."""

    def __init__(self, name: str, order: Any = None, run: Any = None):
        self.name = name
        self._order = order if order is not None else threading.Lock()   # held while a job runs
        self._counted = order if hasattr(order, "add_outstanding") else None   # _C.ShmExec: shared counts
        if run is not None:
            self._run = run
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._pending = 0   # submitted and not yet finished
        self._worker: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ what a job is (overridden)
    def _run(self, job: Any) -> Optional[BaseException]:
        try:
            job()
        except BaseException as e:   # noqa: BLE001 (the job's to report)
            return e
        return None

    def _finished(self, job: Any, error: Optional[BaseException]) -> None:
        pass

    def _refusal(self, job: Any) -> Optional[str]:
        return f"{self.name} is closed" if self._closed else None

    def _started(self) -> None:
        """Called (under the executor's lock) when the worker thread starts."""

    # ------------------------------------------------------------------ submitting and running
    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: Any, inline: bool = False) -> Optional[str]:
        """Queues `job`, or runs it now on this thread when `inline` and nothing is pending. Returns why it
        was not taken (the executor is closed, or `_refusal`), else None."""
        with self._lock:
            why = self._refusal(job)
            if why is not None:
                return why
            if self._counted is not None:
                here = inline and self._counted.outstanding == 0
                self._counted.add_outstanding(1)
            else:
                here = inline and self._pending == 0
            self._pending += 1
            if here:
                self._order.acquire()   # free, or held for a moment by a fast-path call
            else:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._worker.start()
                    self._started()
                self._queue.put(job)
        if here:
            self._execute(job, locked=True)
        return None

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: Any, locked: bool = False) -> None:
        if not locked:
            self._order.acquire()
        try:
            error = self._run(job)
        finally:
            self._order.release()
        if self._counted is not None:
            self._counted.add_outstanding(-1)
        try:
            self._finished(job, error)
        finally:
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()

    # ------------------------------------------------------------------ state and ending
    def idle(self) -> bool:
        """Nothing queued or running."""
        return self._pending == 0

    def alive(self) -> bool:
        """False once the worker thread is gone while jobs still wait for it."""
        worker = self._worker
        return worker is None or worker.is_alive() or self._pending == 0

    def drain(self, timeout: float) -> bool:
        """Waits until every submitted job finished (at most `timeout` s); True when they have."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Refuses new jobs and stops the worker once the queued ones ran (joined for at most `timeout`
        s). True when the worker ended (or never started); False when it is still running a job."""
        with self._lock:
            if self._closed:
                worker = None
            else:
                self._closed = True
                worker = self._worker
                if worker is not None:
                    self._queue.put(None)
        if worker is None:
            return True
        worker.join(timeout)
        return not worker.is_alive()
