"""What torch.profiler shows of the `ncclavg` backend (group.py): each
collective under the name torch's backends give it (`c10d::allreduce_`, ...), with the transport step
inside it as a child range (`ncclavg:shm:all_reduce_sum`, `ncclavg:gloo:all_reduce`).

Note [Profiler ranges of a Python backend]
torch records `c10d::allreduce_` when it dispatches a collective to a C++ backend, and the backend
records its own event, `gloo:all_reduce` for gloo, from issue to completion, begun on the calling thread
and ended on gloo's worker thread (torch's profiler marks such an event async). A backend written in
Python (Note [A ProcessGroup, not a Backend] in group.py) is called past the dispatcher, so
nothing is recorded unless the backend records it. So `_submit`, which every collective of the runner passes,
records both, under the same names as gloo's with `ncclavg` for `gloo` (NAMES), each with
the inputs (their shapes and dtypes when `record_shapes=True`):
- the dispatcher's range `c10d::<op>` around the issue, on the calling thread (as torch's dispatcher
  records it, it ends when the call returns its Work);
- the backend's range `ncclavg:<title>` from issue to completion, ended by the job when it completes.
  While the profiler runs a collective runs on the runner's worker thread, a synchronous one too (the fast
  paths and the inline run step aside), so that range always ends on another thread than it began, as
  gloo's does: tools and torch's own tests tell a communication event by that (`is_async`).
Point-to-point calls go straight to gloo's own send and recv; while the profiler runs they are wrapped
(P2PWork) so that they record `ncclavg:send`, `ncclavg:recv` and `ncclavg:recvAnySource` the same way.
It is a torch RecordFunction (`_RecordFunctionFast`), which may be ended on another thread than the one
that began it: its start took the profiler's callbacks of the issuing thread, and its end only writes
the end time.
The transport steps (`ncclavg:shm:<step>`, `ncclavg:gloo:<op>`) are children of the backend's range
where they run. A collective that went through a host's channel ends with one more child,
`ncclavg:last_rank:<rank>:late<=<bound>`: the rank that arrived last at it (Note [Arrival times] in
csrc/transport/shm_arrivals.h) and how long the first waited for it, rounded up to a power of two of
microseconds or milliseconds (a few dozen names at most, so torch's tables of events stay short); the
exact numbers are its args where the profiler records the thread's inputs (`late_us`, and
`late_us_rank<r>` each rank's). It is recorded where the call completes (the runner's thread: seen with
profile_all_threads=True, as the steps). A trace shows per call who the others waited for; the straggler
report (stragglers.py) says the same over a window. On the runner's worker thread torch's profiler records them only when asked to record every
thread (`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`): a Python
thread does not inherit the profiler's thread-local callbacks. The collective's ranges are there in
either case.
With no profiler running the cost is one check per collective (`enabled()`, ~20 ns: torch's own
process-wide flag, which torch's record_function reads too), and one `job.prof is None` per step.
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from typing import Any, Callable, Sequence

import torch
import torch.autograd.profiler as _torch_profiler
from torch._C._profiler import _RecordFunctionFast


def enabled() -> bool:
    """Is torch's profiler running? Its process-wide flag, set by every profiler torch starts: the
    thread-local `torch._C._autograd._profiler_enabled()` is False on every thread while a profiler
    records all threads (`profile_all_threads=True`), and on every thread but the one that started it."""
    return _torch_profiler._is_profiler_enabled


_NOTHING = contextlib.nullcontext()   # reusable: entering it does nothing
# The op names of group.py's _submit -> (the name torch 2.13's dispatcher records for the same
# collective on gloo, the title of the backend's own event `ncclavg:<title>`: gloo's titles for its works,
# `gloo:all_reduce`, ..., which torch's distributed tests look for as `<backend>:<title>`). Profiled:
# dist.all_gather_into_tensor dispatches _allgather_base_, reduce_scatter_tensor _reduce_scatter_base_.
# An op missing here is recorded as "ncclavg::<op>" and titled with its own name.
NAMES = {
    "allreduce": ("c10d::allreduce_", "all_reduce"),
    "sparse allreduce": ("c10d::allreduce_", "sparse_all_reduce"),
    "allreduce_coalesced": ("c10d::allreduce_coalesced_", "all_reduce_coalesced"),
    "reduce": ("c10d::reduce_", "reduce"),
    "reduce_scatter": ("c10d::reduce_scatter_", "reduce_scatter"),
    "reduce_scatter_single": ("c10d::_reduce_scatter_base_", "reduce_scatter_tensor"),
    "reduce_scatter_single_coalesced": ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor_coalesced"),
    "broadcast": ("c10d::broadcast_", "broadcast"),
    "allgather": ("c10d::allgather_", "all_gather"),
    "all_gather_single": ("c10d::_allgather_base_", "all_gather_into_tensor"),
    "all_gather_single_coalesced": ("c10d::allgather_into_tensor_coalesced_", "all_gather_into_tensor_coalesced"),
    "allgather_coalesced": ("c10d::allgather_coalesced_", "all_gather_coalesced"),
    "gather": ("c10d::gather_", "gather"),
    "scatter": ("c10d::scatter_", "scatter"),
    "all_to_all_single": ("c10d::alltoall_base_", "all_to_all"),
    "alltoall": ("c10d::alltoall_", "all_to_all"),
    "barrier": ("c10d::barrier", "barrier"),
    "coalesced collectives": ("c10d::end_coalescing", "end_coalescing"),
    "send": ("c10d::send", "send"),
    "recv": ("c10d::recv_", "recv"),
    "recv_anysource": ("c10d::recv_any_source_", "recvAnySource"),
}


def dispatched(op: str, tensors: Sequence[Any]) -> Any:
    """The dispatcher's range of one collective, a context around its issue (the profiler is on)."""
    return _RecordFunctionFast(NAMES[op][0] if op in NAMES else f"ncclavg::{op}", list(tensors))


def begin(op: str, tensors: Sequence[Any]) -> Any:
    """The backend's open range of one collective or point-to-point call (the profiler is on), from issue
    to completion: end it with end(), on another thread (Note [Profiler ranges of a Python backend])."""
    rf = _RecordFunctionFast(f"ncclavg:{NAMES[op][1] if op in NAMES else op}", list(tensors))
    rf.__enter__()
    return rf


def end(rf: Any) -> None:
    rf.__exit__(None, None, None)


def note_arrival(runner: Any) -> None:
    """While a profiled collective's range is open: its `ncclavg:last_rank:<rank>` event when the host's
    channel logged a call since the runner last looked (Note [Profiler ranges of a Python backend])."""
    from .stragglers import arrival_source, arrivals

    log = arrival_source(getattr(runner, "transport", None))
    if log is None:
        return
    _, late, labels, logged = arrivals(log, 1)
    if logged == getattr(runner, "arrivals_seen", 0) or late.shape[0] == 0:
        return
    runner.arrivals_seen = logged
    row = late[0]
    last = int(row.argmax())
    args = {"late_us": float(row[last]) / 1e3, **{f"late_us_rank{r}": float(x) / 1e3 for r, x in zip(labels, row)}}
    with _RecordFunctionFast(f"ncclavg:last_rank:{labels[last]}:late<={_bound(args['late_us'])}", [], args):
        pass


def _bound(us: float) -> str:
    """The power of two of microseconds (below 1 ms) or milliseconds at or above `us`: "4us", "64ms"."""
    unit, value = ("us", us) if us <= 512 else ("ms", us / 1e3)
    bound = 1
    while bound < value:
        bound *= 2
    return f"{bound}{unit}"


class _Closer:
    """One long-lived thread that ends ranges handed to it. A range ended by a thread that then exits
    loses its end thread once the range object is freed (torch 2.13 then reports it as not async: seen
    with short-lived threads, never with long-lived ones), so a short-lived waiter ends its range here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Any = None
        self._pid = 0

    def end(self, rf: Any) -> None:
        """Ends `rf` on the closer's thread and returns once it has."""
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()   # a forked child starts afresh
                self._thread = threading.Thread(target=self._serve, args=(self._queue,),
                                                name="ncclavg-profile-closer", daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            q = self._queue
        done = threading.Event()
        q.put((rf, done))
        done.wait()

    @staticmethod
    def _serve(q: Any) -> None:
        while True:
            rf, done = q.get()
            try:
                end(rf)
            finally:
                done.set()


end_elsewhere = _Closer().end


def step(job: Any, transport: str, what: str) -> Any:
    """The child range of one transport step of `job`, or a no-op when the collective was issued with no
    profiler running (its `prof` is None)."""
    if job.prof is None:
        return _NOTHING
    return _RecordFunctionFast(f"ncclavg:{transport}:{what}")



# ---------------------------------------------------------------------- the public API and the trainer
def ranged(name: str) -> Callable:
    """Decorates a Communicator method `fn(self, tensors, ...)`: while the profiler runs, the call is the
    range `ncclavg::<name>` with `tensors` (a sequence of tensors) as its inputs. It spans the call on the
    calling thread: all of a synchronous collective, the issue of an asynchronous one (the averager's
    buckets: one per bucket, with its shape). Off, it costs the check and one call."""
    label = f"ncclavg::{name}"

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return fn(self, tensors, *args, **kwargs)
            with _RecordFunctionFast(label, [t for t in tensors if isinstance(t, torch.Tensor)]):
                return fn(self, tensors, *args, **kwargs)
        return inner
    return wrap


def span(name: str, tensors: Sequence[Any]) -> Any:
    """The range `ncclavg::<name>` with `tensors` as inputs (call it only while the profiler runs)."""
    return _RecordFunctionFast(f"ncclavg::{name}", [t for t in tensors if isinstance(t, torch.Tensor)])


def phase(name: str) -> Any:
    """A context: the range `ncclavg:<name>` while the profiler runs (the trainer's phases), else nothing."""
    return _RecordFunctionFast(f"ncclavg:{name}") if enabled() else _NOTHING
