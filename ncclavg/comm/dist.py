"""The torch.distributed plumbing every multi-process backend uses (gloo.py, nccl.py), with every wait
bounded: issue and wait for async works (failures recorded on the communicator, see Note [A failed
communicator stays failed] in base.py), an allgather_object that cannot outwait the communicator's
timeout, the debug-mode record exchange, and end_process for leaving without torch's teardown.

Note [Gloo teardown]
With torch 2.13 a gloo rank whose run has finished sometimes dies on its way out: it prints its
results, then "terminate called without an active exception" (SIGABRT, exit -6), and torchrun or a
test harness reports the whole run as failed. Measured on a loaded 2-core AMD EPYC with plain torch DDP
over gloo: 2 runs in 30 with destroy_process_group() at the end, 1 in 30 with a barrier before it, 0 in
30 without it; here (Intel Xeon, 2 cores) ncclavg's gloo test job, ending with a barrier and no
destroy, still aborted once in about 15 runs while other test processes loaded the machine.
The cause, from a core dump of plain torch DDP over gloo (run 37 of 37 under load, Python 3.11.7): a
process group's worker thread (ProcessGroupGloo::runLoop) drops its reference to a finished work
(AsyncAllreduceWork) after the waiter has been told it completed. When that is the last reference, the
work's tensors die on the worker thread, and a tensor that Python has seen decrements its Python object
there, which needs the GIL (pybind11 gil_scoped_acquire). If the main thread has meanwhile returned and
is in Py_FinalizeEx, CPython 3.11 ends any thread that asks for the GIL with pthread_exit. The forced
unwind crosses the work's noexcept destructor, and std::terminate aborts the process. So the race is
between the interpreter's exit and the gloo threads letting go of completed works; a barrier or
destroy_process_group() only moves the window, because the group has several worker threads. ncclavg
therefore keeps out of teardown altogether:
- it never destroys a gloo group: `Communicator.close()` leaves the process group alone, whether
  from_torch_distributed() created it (from torchrun's environment) or the user did;
- its own multi-process programs (`ncclavg bench` ranks, examples/torchrun_gloo.py, the test workers)
  end with `end_process(code)` once every rank is past its last collective: it flushes stdout, stderr
  and logging and leaves with os._exit, so no destructor runs; the kernel closes the sockets.
Groups with an NCCL backend are still destroyed: NCCL communicators must be torn down.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable, NoReturn, Optional

import torch

from ..errors import CommError, CommTimeoutError, is_timeout
from .base import Communicator, Work, check_timeout


def end_process(code: int = 0) -> None:
    """Ends this process now with exit status `code`, after flushing stdout, stderr and logging, without
    running Python's or C++'s teardown. For a rank whose collectives are all complete (after a
    barrier): see Note [Gloo teardown]. Never returns."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed or replaced streams
            pass
    logging.shutdown()
    os._exit(int(code))


_is_timeout = is_timeout   # the one rule (errors.py), under the name this package uses


def _lost(comm: Any) -> str:
    """Which peer stopped, when the communicator keeps heartbeats: Note [Naming the lost rank]."""
    liveness = getattr(comm, "_liveness", None)
    return liveness.diagnose() if liveness is not None and comm.failure is None else ""


def _wait_dist(comm: Any, work: Any, timeout: float, what: str) -> None:
    """Bounded wait for a torch.distributed work; every failure marks `comm` unusable. See Note [A failed
    communicator stays failed]."""
    # a shared-memory work (shm.py) may have run, and timed out, on this thread before the wait
    t0 = getattr(work, "started", None) or time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        elapsed = time.monotonic() - t0   # before the diagnosis, which may take seconds
        # (names_peers is read after the wait: it may change)
        _raise_failure(comm, e, what, timeout, elapsed, getattr(work, "source", "torch.distributed"),
                       getattr(work, "names_peers", False))


def _raise_failure(comm: Any, e: BaseException, what: Any, timeout: float, elapsed: float, source: str,
                   named: bool) -> NoReturn:
    """Marks `comm` unusable and raises CommTimeoutError / CommError for collective `what` that failed
    with `e` after `elapsed` seconds in `source`. `named`: e's text names the lost rank itself (the
    shared-memory channel's does, without the store, which a dead rank 0 takes along); otherwise the
    heartbeats are asked. Either way the failure that every later call repeats names it."""
    who = "" if named else _lost(comm)
    if _is_timeout(e):
        # the process group's own (shorter) timeout may fire first: say which one did
        msg = (f"{what} did not complete within {timeout:g} s" if elapsed >= 0.9 * timeout else
               f"{what} timed out after {elapsed:.1f} s in {source} (the process group's own "
               f"timeout, shorter than this communicator's {timeout:g} s)")
        msg += f" ({source}: {e})" if named else who
        comm._fail(msg)
        raise CommTimeoutError(f"{msg}; the communicator is unusable now"
                               + ("" if named else f" ({source}: {e})")) from None
    msg = f"{what} failed{who}: {e}"
    comm._fail(msg)
    raise CommError(msg + "; the communicator is unusable now (did a peer process die?)") from e


def _issue_dist(comm: Any, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Starts a torch.distributed async op; a failure to even start it (a peer's connection already
    closed) marks `comm` unusable like a failed wait."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        msg = f"{what} could not start{_lost(comm)}: {e}"
        comm._fail(msg)
        raise (CommTimeoutError if _is_timeout(e) else CommError)(msg + "; the communicator is unusable now") from e


def _allgather_object_bounded(comm: Any, dist: Any, group: Any, obj: Any, timeout: float,
                              device: Any = "cpu") -> list:
    """torch.distributed.all_gather_object, but every wait bounded by `timeout` (the torch version waits
    as long as the process group's own timeout, 30 min by default): sizes first, then the padded bytes."""
    what = f"{comm.backend} allgather_object (rank {comm.rank} of {comm.world_size})"
    payload = pickle.dumps(obj)
    world = comm.world_size
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, sizes, size, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (sizes)")
    counts = [int(x.item()) for x in sizes]
    longest = max(counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, outs, mine, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (payload)")
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, counts)]


def _debug_allgather_dist(comm: Any, dist: Any, group: Any, record: torch.Tensor, timeout: float,
                          device: Any = "cpu") -> torch.Tensor:
    what = f"{comm.backend} debug sequence check (rank {comm.rank} of {comm.world_size})"
    rows = [torch.empty_like(record, device=device) for _ in range(comm.world_size)]
    work = _issue_dist(comm, what, dist.all_gather, rows, record.to(device), group=group, async_op=True)
    _wait_dist(comm, work, timeout, what)
    return torch.stack([r.cpu() for r in rows])


class _DistWork(Work):
    """A torch.distributed async op, plus the in-place scale to run once it has completed."""

    def __init__(self, comm: "Communicator", work: Any, what: str, finalize: Optional[Callable] = None,
                 divisor: float = 1.0, finite: Optional[list] = None):
        self._comm = comm
        self._work = work
        self._what = what
        self._finalize = finalize
        self._finite = finite   # filled by a checked channel sum: Work.finite once done
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._finished = False
        self.divisor = divisor

    def wait(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._finished:
                return
            t = check_timeout(timeout) if timeout is not None else self._comm.timeout
            _wait_dist(self._comm, self._work, t, self._what)
            if self._finalize is not None:
                self.finite = self._finalize()   # a checked pass's answer (Work.finite), or None
            elif self._finite:
                self.finite = self._finite[0]
            self.elapsed = time.perf_counter() - self._t0
            self._finished = True

    def done(self) -> bool:
        return self._finished or bool(self._work.is_completed())
