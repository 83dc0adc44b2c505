"""The small-message fast path of the gloo backend's all_reduce_avg through a one-host shared-memory
channel (gloo.py builds it; shm.py holds the channel).

Note [Small-message fast path]
An 8-byte all-reduce through the channel takes well under a microsecond; the general path around it
(argument checks, a work object with an event, the transport's queue, the description of the call for
errors) cost about 57 us, and the same checks written as a Python closure still 0.7 us. So a
synchronous all_reduce_avg of one tower's tensor, on a communicator whose processes all share one
channel, is one call into the core (_C.ShmFastAverage, csrc/python/shm_fast_average.cpp):
- the first time it sees a tensor it asks `prepare` (below: the general path's own checks and errors,
  the division by the number of towers fused: Note [Division in the channel] in gloo.py) and keeps the
  answer under the tensor's identity (a weak reference), its version counter and its data pointer (an
  in-place resize or set_ moves the version; a storage resized under it moves the pointer);
- every call checks those three through the C API, takes the transport's native execution lock only if
  it is free and nothing is outstanding (otherwise the general path runs the call, in order behind the
  queued ones), and runs the channel's round with the GIL held unless it has to wait (ShmBlockingHook);
- the communicator disables it when it fails or closes, so that the general path says why it refuses.
Nothing else is built; the call's description is written only for an error. Either way the channel
sees the same collective, so ranks may mix the two freely. Measured with 2 processes on 2 cores
(bench/mpi_peer.py): 0.7-1.1 us per 8-byte call, MPICH's MPI_Allreduce 0.7-1.1 us in the same run.
"""
from __future__ import annotations

import weakref
from typing import Any, NoReturn, Optional

from .._ext import _C
from ..transport.calls import average_call
from .dist import _is_timeout, _raise_failure
from ..transport.shm import TYPE_CODES, supports


CHANNEL_ERRORS = (_C.ShmPeerError, _C.CommTimeoutError)   # what the channel raises for a failed round


def fast_average(comm: Any, transport: Any) -> Any:
    """comm.all_reduce_avg's fast path: `.run(tensors, limit)` runs the call and returns True, or
    returns False when the general path must run it; it raises CHANNEL_ERRORS (see channel_failed)
    and the general path's argument errors. The communicator calls `.disable()` when it fails or
    closes. The checks of every call are the core's (_C.ShmFastAverage): the same in Python cost about
    twice the channel's own round."""

    owner = weakref.ref(comm)   # not the communicator itself: see ShmFastAverage::disable

    def prepare(t: Any) -> Optional[tuple]:
        """(data_ptr, numel, type code, divisor, call tag) of a tensor the fast path may take, else None."""
        comm = owner()
        if comm is None or comm.debug or comm._failure is not None or comm._closed:
            return None   # the general path checks the sequence (NCCLAVG_DEBUG) or says why it refuses
        comm._checked_buffers([t], "tensors")   # the general path's checks and errors
        scale, pre_div, post_div = comm._sum_factors()
        if scale != 1.0 or pre_div != 1.0 or not supports(t):
            return None
        return (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], float(post_div), average_call(t).tag)

    return _C.ShmFastAverage(transport.channel, transport._exec, prepare)


def channel_failed(comm: Any, e: BaseException, tensors: Any, tag: Optional[str], limit: float) -> NoReturn:
    """The communicator's failure for a fast-path call that failed with `e` (its text names the peer)."""
    _raise_failure(comm, e, str(comm._what("all_reduce_avg", tensors, tag)), limit,
                   limit if _is_timeout(e) else 0.0, "shared-memory channel", True)
