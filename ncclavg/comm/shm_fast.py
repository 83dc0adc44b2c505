"""The small-message fast path of the gloo backend's all_reduce_avg through a one-host shared-memory
channel (gloo.py builds it; shm.py holds the channel).

Note [Small-message fast path]
An 8-byte all-reduce through the channel takes well under a microsecond; the general path around it
(argument checks, a work object with an event, the transport's queue, the description of the call for
errors) cost about 57 us. So a synchronous all_reduce_avg of one tower's tensor, on a communicator
whose processes all share one channel, is one call into the core: a call prepared once per tensor
(arguments checked by the same code as the general path, the division by the number of towers fused:
Note [Division in the channel] in gloo.py) and cached under the tensor's identity, its version counter
and its data pointer (an in-place resize or set_ bumps the version; a storage resized under it changes
the pointer), run on the caller's thread with the call's timeout and the GIL held unless it has to wait
(ShmBlockingHook). Nothing else is built; the call's description is written only for an error. It
applies only when nothing is queued on the channel (the transport's lock is free and no work is
outstanding); otherwise the general path runs it, in order. Either way the channel sees the same
collective, so ranks may mix the two freely.
"""
from __future__ import annotations

from typing import Any, NoReturn, Optional

from .._ext import _C
from .dist import _is_timeout, _raise_failure
from .shm import TYPE_CODES, supports


CHANNEL_ERRORS = (_C.ShmPeerError, _C.CommTimeoutError)   # what the channel raises for a failed round


def fast_average(comm: Any, transport: Any) -> Any:
    """comm.all_reduce_avg's fast path: `.run(tensors, limit)` runs the call and returns True, or
    returns False when the general path must run it; it raises CHANNEL_ERRORS (see channel_failed)
    and the general path's argument errors. The communicator calls `.disable()` when it fails or
    closes. The checks of every call are the core's (_C.ShmFastAverage): the same in Python cost about
    twice the channel's own round."""

    def prepare(t: Any) -> Optional[tuple]:
        """(data_ptr, numel, type code, divisor) of a tensor the fast path may take, else None."""
        if comm.debug or comm._failure is not None or comm._closed:
            return None   # the general path checks the sequence (NCCLAVG_DEBUG) or says why it refuses
        comm._checked_buffers([t], "tensors")   # the general path's checks and errors
        scale, pre_div, post_div = comm._sum_factors()
        if scale != 1.0 or pre_div != 1.0 or not supports(t):
            return None
        return (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], float(post_div))

    return _C.ShmFastAverage(transport.channel, transport._exec, prepare)


def channel_failed(comm: Any, e: BaseException, tensors: Any, tag: Optional[str], limit: float) -> NoReturn:
    """The communicator's failure for a fast-path call that failed with `e` (its text names the peer)."""
    _raise_failure(comm, e, str(comm._what("all_reduce_avg", tensors, tag)), limit,
                   limit if _is_timeout(e) else 0.0, "shared-memory channel", True)
