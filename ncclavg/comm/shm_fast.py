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

import weakref
from typing import Any, Callable, Optional

from .dist import _is_timeout, _raise_failure
from .shm import TYPE_CODES, supports

CACHE_SIZE = 64   # tensors whose prepared call is kept (weakly: a cached tensor may still die)


def fast_average(comm: Any, transport: Any) -> Callable[[Any, float, Optional[str]], bool]:
    """comm.all_reduce_avg's fast path: a function (tensors, limit, tag) -> bool that runs the call and
    returns True, or returns False when the general path must run it. A closure over what it reads, so
    that the hot path looks up no attributes but the communicator's failure state (it costs about half
    a microsecond of Python around the channel's call)."""
    cache: dict = {}
    exec_lock = transport._exec   # held by every channel collective while it runs
    acquire, release = exec_lock.acquire, exec_lock.release

    def prepare(t: Any) -> Optional[tuple]:
        if comm.debug or comm._failure is not None or comm._closed:
            return None   # the general path checks the sequence (NCCLAVG_DEBUG) or says why it refuses
        comm._checked_buffers([t], "tensors")   # the general path's checks and errors
        scale, pre_div, post_div = comm._sum_factors()
        if scale != 1.0 or pre_div != 1.0 or not supports(t):
            return None
        call = transport.channel.prepare_all_reduce(t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], 1.0,
                                                    float(post_div))
        try:
            version = t._version
        except RuntimeError:   # an inference tensor keeps no version: run it, but never from the cache
            return (lambda: None, -1, -1, call)
        entry = (weakref.ref(t), version, t.data_ptr(), call)
        if len(cache) >= CACHE_SIZE:
            cache.pop(next(iter(cache)))   # the oldest
        cache[id(t)] = entry
        return entry

    def run(tensors: Any, limit: float, tag: Optional[str]) -> bool:
        if type(tensors) is not list or len(tensors) != 1:
            return False
        t = tensors[0]
        hit = cache.get(id(t))
        if hit is None or hit[0]() is not t or hit[1] != t._version or hit[2] != t.data_ptr():
            hit = prepare(t)
            if hit is None:
                return False
        if comm._failure is not None or comm._closed or not acquire(False):
            return False
        try:
            if transport._outstanding:
                return False
            hit[3](limit)
        except (RuntimeError, TimeoutError) as e:   # the channel's errors name the peer themselves
            _raise_failure(comm, e, str(comm._what("all_reduce_avg", tensors, tag)), limit,
                           limit if _is_timeout(e) else 0.0, "shared-memory channel", True)
        finally:
            release()
        return True

    run.cache = cache   # for the tests
    return run
