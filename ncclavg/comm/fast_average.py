"""The small-message fast path of the gloo backend's all_reduce_avg: through a one-host shared-memory
channel (shm.py holds it), or between hosts through the core's lanes on UCX (ucx.py); gloo.py builds it.

Note [Small-message fast path]
An 8-byte all-reduce through the channel takes well under a microsecond; the general path around it
(argument checks, a work object with an event, the transport's queue, the description of the call for
errors) cost about 57 us, and the same checks written as a Python closure still 0.7 us. So a
synchronous all_reduce_avg of one tower's tensor, on a communicator whose processes all share one
channel, is one call into the core (_C.FastAllReduce, csrc/python/fast_all_reduce.cpp). The same holds
between hosts on the lanes: there the general path's Python cost a 4 KiB call 50-110 us of CPU per rank
against the lanes' 12-15 (2 emulated hosts x 2 processes on 2 cores, unshaped veth: 141 us a call
through the general path, 27 us through the lanes alone), so the lanes get the same object, which
divides after their sum (HostLanes::all_reduce_sum's `div`: the bits of the general path's unpack scale):
- the first time it sees a tensor it asks the communicator's plan (gloo.py's `_fast_plan`: the general
  path's own checks and errors, the division by the number of towers fused: Note [Division in the
  channel] in gloo.py) and keeps the
  answer under the tensor's identity (a weak reference), its version counter and its data pointer (an
  in-place resize or set_ moves the version; a storage resized under it moves the pointer);
- every call checks those three through the C API, takes the runner's native order lock only if it is
  free and nothing is outstanding (the rule of Runner.acquire_idle in transport/runner.py; otherwise the
  general path runs the call, in order behind the queued ones), and runs the channel's round with the GIL
  held unless it has to wait (ShmBlockingHook), or the lanes' call without the GIL;
- the communicator's runner disables it when it fails or closes, so that the general path says why it
  refuses.
- an asynchronous all_reduce_avg_async of one tower (no defer_scale) takes it too, on one host's channel,
  when it is at most 256 KiB and its peers are in the call already (`run_async`: the rule of Note [An
  asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp, as the torch face's): its Work is
  complete when handed back and carries the channel's note of what it wrote (Work.finite). Through the
  runner this call cost 18-25 us per call of a burst of 8 at 8 B-4 KiB (bench/torch_face.py, async x8,
  2 processes), against 9-15 us before the runner existed; now 2.5-4.7 us.
Nothing else is built; the call's description is written only for an error. Either way the channel
(or the wire) sees the same collective, so ranks may mix the two freely. Measured with 2 processes on 2 cores
(bench/mpi_peer.py): 0.7-1.1 us per 8-byte call, MPICH's MPI_Allreduce 0.7-1.1 us in the same run.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from .._ext import _C
from ..transport.flight import DONE



def fast_average(plan: Callable[[Any], Optional[tuple]], target: Any, order: Any, recorder: Any = None,
                 what: Any = None) -> Any:
    """The native fast path (_C.FastAllReduce) of one channel or of the lanes between hosts (`target`:
    a _C.ShmChannel or a _C.HostLanes): `.run(tensors, limit)` runs the call
    and returns True, or returns False when the general path must run it; it raises
    transport.failure.CHANNEL_ERRORS and
    the general path's argument errors. `plan(t)` is the communicator's bound method that answers for
    a tensor it has not seen (data_ptr, numel, type code, divisor, call tag), or None for "not this
    one"; the owner calls `.disable()` when it fails or closes. The native object keeps only a weak
    reference to the owner (weakref.WeakMethod), so that it and its communicator form no cycle that
    holds the channel's segment mapped: see FastAllReduce::disable. With a flight `recorder`, every call it
    runs is recorded there as `what` (Note [Calls run now] in transport/runner.py), in C++."""
    method = weakref.WeakMethod(plan)

    def prepare(t: Any) -> Optional[tuple]:
        bound = method()
        return None if bound is None else bound(t)

    fast = _C.FastAllReduce(target, order, prepare)
    if recorder is not None:
        fast.record_to(recorder, what, DONE)
    return fast
