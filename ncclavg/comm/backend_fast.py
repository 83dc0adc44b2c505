"""The torch backend's small-message fast path: a synchronous `dist.all_reduce` of one dense CPU tensor
(SUM, or AVG of float32 / float64) on a group whose processes share one channel.

Note [The backend's fast path]
Below ~1 MiB the cost of `dist.all_reduce` on this backend was the Python around the channel, not the
channel: a Job with its Future and Event, the lane, the call's description, the transport's Work,
~40 us against the channel's ~1 us round. torch's own part (dist.all_reduce, the dispatcher, the call
into this ProcessGroup and the Work handed back) costs ~2 us and cannot be avoided from a Python
backend. So for the commonest call, the one a training loop makes for a loss, a metric or a flag, the
group does what the public API does (Note [Small-message fast path] in shm_fast.py): one native object
per reduction (_C.ShmFastAverage: the channel's all-reduce with a divisor) that checks the tensor it
has seen before (identity, version counter, data pointer) and runs the channel's round at once when the
group's lane is idle: the lane holds the same native lock while its jobs run and counts its queued jobs
where the fast path looks (Note [An order held by the caller] in shm.py), so a fast call never
overtakes a queued one and never runs beside a running one. What it sends is what the general path
sends for the same call (the same channel call, divisor and call signature), so ranks may take either
path for a call and still meet; anything else (a first sight the checks would refuse, another dtype or
op, async_op=True, a failed or shut group) returns False and the general path runs the call, with its
errors. A failure of the round fails the group as the lane's would (BackendTimeoutError and the rest).
"""
from __future__ import annotations

import datetime
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .._ext import _C
from .backend_math import R
from .calls import make
from .shm import TYPE_CODES, supports

# What the general path sends as one channel all-reduce with the divisor given (backend_cpu._channel_sum):
# SUM of every float type the channel adds; AVG of float32 and float64 with the division in the pass (the
# 16-bit types average through float32 there, another call).
_SUM_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_AVG_TYPES = (torch.float32, torch.float64)


class DoneWork(dist.Work):
    """The Work of a collective that completed before it was handed out."""

    def __init__(self, result: List[torch.Tensor]):
        super().__init__()
        self._result = result

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> List[torch.Tensor]:
        return list(self._result)

    def synchronize(self) -> None:
        pass

    def get_future(self) -> Any:
        fut = torch.futures.Future()
        fut.set_result(list(self._result))
        return fut


def fast_paths(pg: Any, transport: Any) -> Dict[Any, Any]:
    """{RedOpType: _C.ShmFastAverage} for the group `pg` over `transport`; empty when its processes do not
    share one channel (several hosts, or none)."""
    if transport is None or transport.channel is None:
        return {}
    size = pg.size()
    owner = weakref.ref(pg)   # not the group itself: the native object holds `prepare` (no cycle to collect)

    def preparer(kind: Any, types: tuple, divisor: float) -> Any:
        def prepare(t: Any) -> Optional[tuple]:
            """(data_ptr, numel, type code, divisor, call tag) of a tensor the fast path may take, else
            None: the general path then runs the call and raises what it raises."""
            pg = owner()
            if pg is None or pg._shut or pg._lane.failure is not None or not isinstance(t, torch.Tensor):
                return None
            if t.dtype not in types or t.layout != torch.strided or not supports(t):
                return None
            call = make("all_reduce", t.dtype, kind, count=t.numel())
            if call.count != t.numel():
                return None
            return (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], divisor, call.tag)
        return prepare

    paths = {
        R.SUM: _C.ShmFastAverage(transport.channel, transport.exec_lock, preparer(R.SUM, _SUM_TYPES, 1.0)),
        R.AVG: _C.ShmFastAverage(transport.channel, transport.exec_lock, preparer(R.AVG, _AVG_TYPES, float(size))),
    }
    return paths
