"""The torch backend's small-message fast path: a synchronous `dist.all_reduce` of one dense CPU tensor
(SUM, or AVG of float32 / float64) on a group whose processes share one channel, or whose hosts are joined
by the core's lanes on UCX; and the same, written in Python (FastCalls), for synchronous broadcast,
all_gather_into_tensor and reduce_scatter_tensor on one channel.

Note [The backend's fast path]
Below ~1 MiB the cost of `dist.all_reduce` on this backend was the Python around the channel, not the
channel: a Job with its Future and Event, the runner, the call's description, the transport's Work,
~40 us against the channel's ~1 us round. torch's own part (dist.all_reduce, the dispatcher, the call
into this ProcessGroup and the Work handed back) costs ~2 us and cannot be avoided from a Python
backend. So for the commonest call, the one a training loop makes for a loss, a metric or a flag, the
group does what the public API does (Note [Small-message fast path] in fast_average.py): one native object
per reduction (_C.FastAllReduce: the channel's all-reduce with a divisor) that checks the tensor it
has seen before (identity, version counter, data pointer) and runs the channel's round at once when the
group's runner is idle: the runner holds the same native lock while its jobs run and counts its queued
jobs where the fast path looks (Note [One runner] in transport/runner.py), so a fast call never
overtakes a queued one and never runs beside a running one. What it sends is what the general path
sends for the same call (the same channel call, divisor and call signature), so ranks may take either
path for a call and still meet; anything else (a first sight the checks would refuse, another dtype or
op, an async_op=True call whose peers are not in it yet or over 256 KiB (Note [An asynchronous call
whose peers wait] in csrc/transport/shm_channel.cpp), a failed or shut group) returns False and the
general path runs the call, with its errors. A failure of the round fails the group as the runner's
would (BackendTimeoutError and the rest).

The all_reduce itself is answered in C++ (_C.GroupAllreduce, installed as the group's own `allreduce`
attribute, so torch's dist.all_reduce calls it with no Python frame between): it reads the options,
picks SUM or AVG by the ReduceOp's hash, runs the round, records it and hands back a finished Work. In
Python those steps cost ~2.3 us; torch's own part is ~1.6 us. Two details carry most of the saving: the
record names the op by its RedOpType (a ReduceOp read from the options is a new pybind11 object, and
freeing one from the flight ring cost ~0.3 us), and the finished Work is reused while nobody but the
group holds it (making and freeing a Python subclass of a pybind11 type costs ~0.4 us).
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Dict, Optional

import torch
import torch.autograd.profiler as _torch_profiler
import torch.distributed as dist

from .._ext import _C
from ..buffers import channel_type_code
from ..transport.calls import make
from ..transport.reductions import R
from ..transport.runner import ASYNC_READY_S, Runner
from ..transport.shm import supports
from ..transport.work import done_work

# What the general path sends as one channel all-reduce with the divisor given (transport/paths.py's
# ChannelPaths.sum): SUM of every float type the channel adds; AVG of float32 and float64 with the division
# in the pass (the 16-bit types average through float32 there, another call).
_SUM_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_AVG_TYPES = (torch.float32, torch.float64)


def fast_paths(pg: Any, runner: Runner) -> Dict[Any, Any]:
    """{RedOpType: _C.FastAllReduce} for the group `pg` over its runner, on its one channel or its lanes
    between hosts (the transport's `fast_target`); empty when it has neither (gloo's lanes, or no channel)."""
    transport = runner.transport
    target = transport.fast_target if transport is not None else None
    if target is None:
        return {}
    size = pg.size()
    owner = weakref.ref(pg)   # not the group itself: the native object holds `prepare` (no cycle to collect)

    def preparer(kind: Any, types: tuple, divisor: float) -> Any:
        def prepare(t: Any) -> Optional[tuple]:
            """(data_ptr, numel, type code, divisor, call tag) of a tensor the fast path may take, else
            None: the general path then runs the call and raises what it raises."""
            pg = owner()
            if pg is None or pg._shut or pg._runner.failure is not None or not isinstance(t, torch.Tensor):
                return None
            if t.dtype not in types or t.layout != torch.strided or not supports(t):
                return None
            call = make("all_reduce", t.dtype, kind, count=t.numel())
            if call.count != t.numel():
                return None
            return (t.data_ptr(), t.numel(), channel_type_code(t.dtype), divisor, call.tag)
        return prepare

    paths = {
        R.SUM: _C.FastAllReduce(target, runner.order, preparer(R.SUM, _SUM_TYPES, 1.0)),
        R.AVG: _C.FastAllReduce(target, runner.order, preparer(R.AVG, _AVG_TYPES, float(size))),
    }
    return paths


def _op_hashes() -> Optional[tuple]:
    """(hash of ReduceOp SUM, hash of ReduceOp AVG) when each differs from every other op's hash (torch
    hashes a ReduceOp by its kind, so the native path tells the two apart by one hash), else None."""
    others = [hash(dist.ReduceOp(k)) for k in (R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)]
    others.append(hash(dist._make_nccl_premul_sum(1.0)))
    pair = (hash(dist.ReduceOp(R.SUM)), hash(dist.ReduceOp(R.AVG)))
    return pair if pair[0] != pair[1] and not set(pair) & set(others) else None


def native_allreduce(pg: Any, paths: Dict[Any, Any], recorder: Any, default_s: float, unset: Any) -> Any:
    """The group's `allreduce` for the calls its fast paths take, whole in C++ (_C.GroupAllreduce): the
    same checks, call, record and Work as the Python it replaces, without ~2 us of bytecode around a
    ~0.7 us round. It calls `pg._allreduce(tensors, opts)` for every other call and
    `pg._fast_allreduce_failed` when a round fails. None when the group has no fast paths."""
    hashes = _op_hashes()
    if not paths or hashes is None:
        return None
    hooks = types.SimpleNamespace(
        group=weakref.ref(pg),   # the group holds this object: a strong reference would be a cycle
        done_work=done_work, record=recorder.done if recorder is not None else None, profiler=_torch_profiler,
        unset=unset, default_s=float(default_s), async_ready_s=ASYNC_READY_S,
        sum_hash=hashes[0], avg_hash=hashes[1], sum_kind=R.SUM, avg_kind=R.AVG,
        errors=(_C.ShmMismatchError, _C.ShmPeerError, _C.ShmTimeoutError, _C.CommTimeoutError))
    return _C.GroupAllreduce(paths[R.SUM], paths[R.AVG], hooks)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: Any) -> bool:
    """A dense contiguous CPU tensor whose bytes are its values (no subclass with its own storage rules,
    no lazy conjugate or negation bit): what the fast path moves by its data pointer."""
    return (type(t) in _PLAIN_TYPES and t.is_cpu and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


class FastCalls:
    """Synchronous broadcast, all_gather_into_tensor and reduce_scatter_tensor (SUM, or AVG of float32 /
    float64) of contiguous CPU tensors, straight into the channel when the group's runner is idle: Note [The
    backend's fast path], in Python (these calls are rarer than all_reduce's; one dict lookup and the
    channel call, against the general path's Job, Work and description). Each method returns True when
    the call is done, False when the general path must run it (it then also raises what it raises); a
    failure of the round raises the channel's error (CHANNEL_ERRORS) for the group to fail by. With
    `async_op` the call is asynchronous: it runs here only when it moves at most ASYNC_INLINE_BYTES and its
    peers are in it already (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp).

    What goes to the channel is what the general path sends for the same call (cpu_collectives.py): a
    broadcast and an all-gather move bytes viewed as float32 words when the payload is a multiple of 4
    bytes, as float16 halves when it is even (an odd payload is padded there: left to the general path);
    a reduce-scatter adds in the tensors' own dtype, and AVG divides in the same pass. The signature is the same Call."""

    def __init__(self, runner: Runner, size: int):
        self._runner, self._channel, self._size = runner, runner.transport.channel, size
        self._bytes_calls: Dict[tuple, tuple] = {}   # (collective, dtype, numel, root) -> wire + signature
        self._sum_calls: Dict[tuple, tuple] = {}     # (dtype, numel, op) -> signature

    # Each call below goes through Runner.now (Note [Calls run now] in transport/runner.py: the idle check,
    # the small-async gate, the flight record) and calls the channel's binding by pointer with the wire
    # cached per shape: the transport's primitives take tensors, and the byte view a broadcast or an
    # all-gather would need costs ~1 us a call (t.view(uint8).view(float32), timeit on this machine)
    def _bytes_call(self, collective: str, t: torch.Tensor, root: Optional[int]) -> Optional[tuple]:
        key = (collective, t.dtype, t.numel(), root)
        got = self._bytes_calls.get(key)
        if got is None:
            nbytes = t.numel() * t.element_size()
            if nbytes % 2:
                return None
            wire = (channel_type_code(torch.float32), nbytes // 4) if nbytes % 4 == 0 else (channel_type_code(torch.float16),
                                                                                       nbytes // 2)
            call = make(collective, t.dtype, None, root, t.numel())
            got = wire + (call.tag, call.count)
            if len(self._bytes_calls) < 256:
                self._bytes_calls[key] = got
        return got

    def broadcast(self, t: Any, root: int, limit: float, async_op: bool = False) -> bool:
        if not _plain(t):
            return False
        got = self._bytes_call("broadcast", t, root)
        return got is not None and self._runner.now(
            lambda: self._channel.broadcast(t.data_ptr(), got[1], got[0], root, limit, got[2], got[3]),
            ("broadcast", None, root), t.dtype, t.numel(), t.nbytes if async_op else -1)

    def all_gather(self, out: Any, inp: Any, limit: float, async_op: bool = False) -> bool:
        if not (_plain(out) and _plain(inp) and out.dtype == inp.dtype and out.numel() == inp.numel() * self._size):
            return False
        got = self._bytes_call("all_gather_into_tensor", inp, None)
        return got is not None and self._runner.now(
            lambda: self._channel.all_gather(inp.data_ptr(), out.data_ptr(), got[1], got[0], limit, got[2], got[3]),
            ("all_gather_into_tensor", None, None), inp.dtype, inp.numel(), out.nbytes if async_op else -1)

    def reduce_scatter(self, out: Any, inp: Any, op: Any, limit: float, async_op: bool = False) -> bool:
        """op: R.SUM (every channel type) or R.AVG (float32 and float64: divided in the channel's pass, as
        the general path does on one host)."""
        if not (_plain(out) and _plain(inp) and out.dtype == inp.dtype and inp.numel() == out.numel() * self._size):
            return False
        types = _SUM_TYPES if op == R.SUM else _AVG_TYPES
        if out.dtype not in types:
            return False
        key = (out.dtype, out.numel(), op)
        got = self._sum_calls.get(key)
        if got is None:
            call = make("reduce_scatter_tensor", out.dtype, op, count=out.numel())
            got = (channel_type_code(out.dtype), call.tag, call.count)
            if len(self._sum_calls) < 256:
                self._sum_calls[key] = got
        divisor = float(self._size) if op == R.AVG else 1.0
        return self._runner.now(
            lambda: self._channel.reduce_scatter_sum(inp.data_ptr(), out.data_ptr(), out.numel(), got[0], limit, 1.0,
                                                     divisor, got[1], got[2]),
            ("reduce_scatter_tensor", op, None), out.dtype, out.numel(), inp.nbytes if async_op else -1)


def fast_calls(runner: Runner, size: int) -> Optional[FastCalls]:
    """The FastCalls of a group over its runner; None when its processes do not share one channel."""
    if runner.transport is None or runner.transport.channel is None:
        return None
    return FastCalls(runner, size)
