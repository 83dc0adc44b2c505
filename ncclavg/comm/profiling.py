"""What torch.profiler shows of the `ncclavg` backend (torch_backend.py): each
collective under the name torch's backends give it (`c10d::allreduce_`, ...), with the transport step
inside it as a child range (`ncclavg:shm:all_reduce_sum`, `ncclavg:gloo:all_reduce`).

Note [Profiler ranges of a Python backend]
torch records `c10d::allreduce_` when it dispatches a collective to a C++ backend; a backend written in
Python (Note [A ProcessGroup, not a Backend] in torch_backend.py) is called past the dispatcher, so
nothing is recorded unless the backend records it. So `_submit`, which every lane collective passes,
opens a range named as gloo's (COLLECTIVES) with the inputs (their shapes and dtypes when
`record_shapes=True`), and the job closes it when it completes: the range spans issue to completion, an
async collective's too. It is a torch RecordFunction (`_RecordFunctionFast`), which may be ended on
another thread (the lane's worker) than the one that began it: its start took the profiler's callbacks
of the issuing thread, and its end only writes the end time.
The transport steps run where the lane runs the job: on the caller's thread for a synchronous call on
an idle lane (Note [Backend lanes]), where they are recorded as children of the collective; on the
lane's worker thread otherwise, which torch's profiler records only when asked to record every thread
(`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`): a Python
thread does not inherit the profiler's thread-local callbacks. The collective's range is there in
either case.
With no profiler running the cost is one check per collective (`enabled()`, ~45 ns: torch's own
thread-local flag), and one `job.prof is None` per step.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
from torch._C._autograd import _profiler_enabled as enabled   # noqa: F401  (re-exported: the check)
from torch._C._profiler import _RecordFunctionFast

_NOTHING = contextlib.nullcontext()   # reusable: entering it does nothing
# The op names of torch_backend.py's _submit -> the name torch 2.13's dispatcher records for the same
# collective on gloo (profiled: dist.all_gather_into_tensor is _allgather_base_, reduce_scatter_tensor is
# _reduce_scatter_base_); an op missing here is recorded as "ncclavg::<op>".
COLLECTIVES = {
    "allreduce": "c10d::allreduce_",
    "sparse allreduce": "c10d::allreduce_",
    "allreduce_coalesced": "c10d::allreduce_coalesced_",
    "reduce": "c10d::reduce_",
    "reduce_scatter": "c10d::reduce_scatter_",
    "reduce_scatter_single": "c10d::_reduce_scatter_base_",
    "reduce_scatter_single_coalesced": "c10d::reduce_scatter_tensor_coalesced_",
    "broadcast": "c10d::broadcast_",
    "allgather": "c10d::allgather_",
    "all_gather_single": "c10d::_allgather_base_",
    "all_gather_single_coalesced": "c10d::allgather_into_tensor_coalesced_",
    "allgather_coalesced": "c10d::allgather_coalesced_",
    "gather": "c10d::gather_",
    "scatter": "c10d::scatter_",
    "all_to_all_single": "c10d::alltoall_base_",
    "alltoall": "c10d::alltoall_",
    "barrier": "c10d::barrier",
    "coalesced collectives": "c10d::end_coalescing",
}


def begin(op: str, tensors: Sequence[Any]) -> Any:
    """The open range of one collective (the profiler is on): end it with end(), on any thread."""
    rf = _RecordFunctionFast(COLLECTIVES.get(op) or f"ncclavg::{op}", list(tensors))
    rf.__enter__()
    return rf


def end(rf: Any) -> None:
    rf.__exit__(None, None, None)


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
