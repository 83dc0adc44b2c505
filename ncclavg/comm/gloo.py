"""The gloo backend: CPU towers in several processes through torch.distributed (any process group that
runs CPU tensors; gloo in practice). Each process feeds `towers` local towers; the average is over every
tower of every process. close() never destroys the process group: see Note [Gloo teardown] in dist.py.

Note [Hierarchical CPU average]
With T_p towers in process p and N = sum of T_p towers in all, one bucket is averaged in three steps:
1. the core's one-pass local average (`_C.average_`, fp32 accumulation, one rounding) leaves the mean
   m_p of this process's towers in each of them (skipped for one tower);
2. ONE all-reduce SUM over the processes, of tower 0's buffer only: P - 1 messages per bucket instead of
   N - 1, and gloo's cost is per message, not per tower;
3. one fused pass divides and copies the result into the other local towers.
The mean over towers weights each process by its towers: sum_p T_p * m_p / N. When every process has
the same number of towers that is sum_p m_p / P, so step 2 sums the m_p as they are and step 3 divides
by P; otherwise tower 0's buffer is multiplied by T_p before the sum and step 3 divides by N. predivide
moves the division before the sum (a half-precision sum cannot overflow then). The tower counts are
exchanged once, when the communicator is built.
reduce_scatter_avg and all_gather follow the same order (local first, one collective per process); the
shard of global tower g = offset_p + t, towers numbered process-major.
When every process is on one host, the collectives between processes go through the core's shared-memory
channel instead of torch.distributed (shm.py, Note [When the shared-memory channel is used]); the steps
above and their element math stay the same.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .._ext import _C
from ..buffers import as_buffer
from ..transport import calls, profiling
from ..transport.profiling import enabled as _profiling
from .base import Communicator, Work, check_count, check_timeout
from ..transport.calls import Call, average_call
from .dist import (_DistWork, _allgather_object_bounded, _debug_allgather_dist, _is_timeout, _issue_dist,
                   _raise_failure, _wait_dist)
from ..transport.liveness import Liveness
from ..transport.shm import TYPE_CODES, ShmTransport, host_identity, supports as shm_supports
from .shm_fast import CHANNEL_ERRORS, fast_average


# Note [Reduce-scatter as all_to_all]
# torch.distributed's gloo reduce_scatter_tensor ignores Work.wait(timeout) (torch 2.13: a peer 5 s late
# holds a wait with a 1 s limit for the whole 5 s; all_reduce, all_gather, broadcast and all_to_all stop
# at the limit). So the torch.distributed path sends each rank its slice of every input with one
# all_to_all (the same bytes as a reduce-scatter) and sums the received pieces here, in rank order with
# fp32 accumulation (fp64 for float64) and one rounding: the shared-memory channel's arithmetic, and the
# call's timeout holds.
def _sum_pieces(pieces: torch.Tensor, out: torch.Tensor) -> None:
    """out = pieces[0] + pieces[1] + ... in order, accumulated wide, rounded once."""
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    acc = pieces[0].to(wide, copy=True)
    for p in pieces[1:]:
        acc += p
    out.view(-1).copy_(acc)


class _ThenWork:
    """A torch.distributed work, and what to run on this thread once it has completed."""

    def __init__(self, work: Any, then: Callable[[], None]):
        self._work, self._then, self._done = work, then, False

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait(timeout=timeout)
        if not self._done:
            self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class GlooCommunicator(Communicator):
    """`towers` CPU towers in this process, averaged with every tower of every process of `group`. See
    Note [Hierarchical CPU average]. Building one is a collective: every process of the group builds
    its communicator at the same point (the tower counts are exchanged, bounded by `timeout`)."""

    backend = "gloo"

    def __init__(self, group: Any, timeout: float, predivide: bool = False, towers: int = 1):
        import torch.distributed as dist

        super().__init__()
        towers = check_count(towers, "towers")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.local_size = towers
        self.devices = ["cpu"] * towers
        self.timeout = check_timeout(timeout)
        self.predivide = bool(predivide)
        # all_gather_into_tensor was renamed in recent torch versions.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._shm: Optional[ShmTransport] = None
        found = ([(towers, "")] if self.world_size == 1 else
                 _allgather_object_bounded(self, dist, group, (towers, host_identity()), self.timeout))
        self.tower_counts: list = [int(c) for c, _ in found]
        self.size = sum(self.tower_counts)
        self.tower_offset = sum(self.tower_counts[:self.rank])   # global index of local tower 0
        self._uniform = len(set(self.tower_counts)) == 1
        # See Note [Naming the lost rank] in liveness.py
        self._liveness = Liveness.for_group(dist, group, self.rank, self.world_size) if self.world_size > 1 else None
        self._shm = ShmTransport.connect(
            self.rank, self.world_size, lambda obj: _allgather_object_bounded(self, dist, group, obj, self.timeout),
            [h for _, h in found], self.timeout, dist=dist, group=group)
        # between the processes: "shm", the shared-memory channel (one host); "shm+gloo", a channel per host
        # and torch.distributed between the hosts (Note [Several hosts] in shm.py); "gloo", torch.distributed
        self.transport = self._shm.kind if self._shm is not None else "gloo"
        # Note [Division in the channel]
        # With one host's channel over every process, an average's division by the number of towers runs
        # in the channel's sum (the same bits as the unpack scale after it), one pass less. Which
        # collective the channel runs must be the same on every rank (its signature includes the scale),
        # so this depends only on what every rank shares: the transport, and the dtype and the call.
        self._fuses_division = self._shm is not None and self._shm.channel is not None
        # one tower here and one host's channel over every process: Note [Small-message fast path]
        self._fast = (fast_average(self._fast_plan, self._shm.channel, self._shm.exec_lock)
                      if self._fuses_division and towers == 1 else None)
        self._fast_run = self._fast.run if self._fast is not None else None

    # ------------------------------------------------------------------ the collectives between processes
    # Each starts one SUM / gather / broadcast over the processes and returns a Work for _wait_dist:
    # through the shared-memory channel when there is one and it takes the dtype, else torch.distributed.
    # sync=True: the caller waits at once.
    # `call`: the user's call, compared across the ranks by the channel (Note [Call signatures] in
    # csrc/transport/shm_calls.cpp); torch.distributed's path has no such check.
    def _sum(self, what: str, t: torch.Tensor, sync: bool = True, timeout: Optional[float] = None,
             divisor: float = 1.0, call: Optional[Call] = None, finite: Optional[list] = None) -> Any:
        """divisor != 1 (one-host channel only): the channel divides the sum in the same pass. finite: a
        list that receives the one-host channel's answer (Work.finite), left empty by the other paths."""
        if self._shm is not None and shm_supports(t):
            return _issue_dist(self, what, self._shm.all_reduce_sum, t, sync, timeout, divisor, call, finite)
        assert divisor == 1.0, "only the shared-memory channel divides"
        return _issue_dist(self, what, self._dist.all_reduce, t, op=self._dist.ReduceOp.SUM, group=self.group,
                           async_op=True)

    def _sum_scatter(self, what: str, out: torch.Tensor, inp: torch.Tensor, timeout: Optional[float] = None,
                     call: Optional[Call] = None) -> Any:
        if self._shm is not None and shm_supports(out) and shm_supports(inp):
            return _issue_dist(self, what, self._shm.reduce_scatter_sum, out, inp, True, timeout, call)
        # See Note [Reduce-scatter as all_to_all]
        pieces = torch.empty(self.world_size * out.numel(), dtype=out.dtype)
        work = _issue_dist(self, what, self._dist.all_to_all_single, pieces, inp, group=self.group, async_op=True)
        return _ThenWork(work, lambda: _sum_pieces(pieces.view(self.world_size, -1), out))

    def _from_rank_0(self, what: str, t: torch.Tensor, src: int, timeout: Optional[float] = None,
                     call: Optional[Call] = None) -> Any:
        """Broadcast from the group's rank 0 (global rank `src`); the channel's ranks are the group's."""
        if self._shm is not None and shm_supports(t):
            return _issue_dist(self, what, self._shm.broadcast, t, 0, True, timeout, call)
        return _issue_dist(self, what, self._dist.broadcast, t, src=src, group=self.group, async_op=True)

    def _gather(self, what: str, out: torch.Tensor, inp: torch.Tensor, timeout: Optional[float] = None,
                call: Optional[Call] = None) -> Any:
        if self._shm is not None and shm_supports(out) and shm_supports(inp):
            return _issue_dist(self, what, self._shm.all_gather, out, inp, True, timeout, call)
        return _issue_dist(self, what, self._all_gather, out, inp, group=self.group, async_op=True)

    def _scale(self, buf: Any, scale: float, divisor: float, dsts: Optional[list] = None) -> Optional[bool]:
        """dsts (default [buf]) = buf * scale / divisor in one fused pass (the core's unpack). Returns
        whether every value it wrote is finite, None when it wrote nothing (Note [Finiteness from the pass
        that writes] in csrc/common/finite_math.h)."""
        if scale != 1.0 or divisor != 1.0 or dsts is not None:
            targets = [buf] if dsts is None else dsts
            return _C.unpack_(buf, targets, [0] * len(targets), float(scale), float(divisor), 0, True)
        return None

    def _fast_plan(self, t: torch.Tensor) -> Optional[tuple]:
        """What the fast path needs of a tensor it has not seen (Note [Small-message fast path]): its
        (data_ptr, numel, type code, divisor, call tag), after the general path's own checks and errors;
        None sends the call down the general path (NCCLAVG_DEBUG's sequence check, a failed or closed
        communicator that says why it refuses, a scale or dtype the channel's fused division lacks)."""
        if self.debug or self._failure is not None or self._closed:
            return None
        self._checked_buffers([t], "tensors")
        scale, pre_div, post_div = self._sum_factors()
        if scale != 1.0 or pre_div != 1.0 or not shm_supports(t):
            return None
        return (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], float(post_div), average_call(t).tag)

    def _sum_factors(self) -> tuple:
        """(scale, divisor) for tower 0's buffer before the SUM, and the divisor after it, when every
        local tower holds this process's mean. See Note [Hierarchical CPU average]."""
        if self._uniform:
            scale, divisor = 1.0, float(self.world_size)
        else:
            scale, divisor = float(self.local_size), float(self.size)
        return (scale, divisor, 1.0) if self.predivide else (scale, 1.0, divisor)

    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        limit = self.timeout if timeout is None else check_timeout(timeout)   # before anything starts
        if _profiling():   # Note [Profiler ranges of a Python backend] in profiling.py: no fast path then
            with profiling.span("all_reduce_avg", tensors):
                self._average(tensors, False, tag, debug_key, sync=True, timeout=limit).wait(limit)
            return
        fast = self._fast_run
        if fast is not None:   # Note [Small-message fast path]
            try:
                if fast(tensors, limit):
                    return
            except CHANNEL_ERRORS as e:   # the text names the peer
                _raise_failure(self, e, str(self._what("all_reduce_avg", tensors, tag)), limit,
                               limit if _is_timeout(e) else 0.0, "shared-memory channel", True)
        self._average(tensors, False, tag, debug_key, sync=True, timeout=limit).wait(limit)

    @profiling.ranged("all_reduce_avg_async")
    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        return self._average(tensors, defer_scale, tag, debug_key, sync=False)

    def _average(self, tensors: Sequence[torch.Tensor], defer_scale: bool, tag: Optional[str],
                 debug_key: Optional[Sequence[int]], sync: bool, timeout: Optional[float] = None) -> Work:
        tensors, bufs = self._checked_buffers(tensors, "tensors")  # dtype / contiguity in the user's terms
        what = self._what("all_reduce_avg", tensors, tag)
        self._debug_check("all_reduce_avg", tensors[0], debug_key, self.timeout)
        if self.local_size > 1:
            _C.average_(bufs, 0)
        scale, pre_div, post_div = self._sum_factors()
        self._scale(bufs[0], scale, pre_div)
        # See Note [Division in the channel]: the same choice on every rank
        fused = self._fuses_division and not defer_scale and shm_supports(tensors[0])
        finite: list = []   # the channel's check of its sum, when it writes the result (Work.finite)
        work = self._sum(what, tensors[0], sync, timeout, post_div if fused else 1.0,
                         average_call(tensors[0]), finite)
        if fused:
            post_div = 1.0
        if self.local_size == 1 and (post_div == 1.0 or defer_scale):
            return _DistWork(self, work, what, divisor=post_div, finite=finite)

        def finalize(owner: list = tensors) -> Optional[bool]:  # holds the tensors: the Buffers are only pointers
            # -> Work.finite: every tower ends with the same values, so either pass's answer is the bucket's
            copied = self._scale(bufs[0], 1.0, post_div, dsts=bufs[1:]) if len(bufs) > 1 else None
            scaled = self._scale(bufs[0], 1.0, post_div)   # the other towers first: tower 0 is their source
            return scaled if scaled is not None else copied

        return _DistWork(self, work, what, finalize=finalize)

    def _local_sum(self, inputs: list) -> torch.Tensor:
        """fp32 sum of the local towers' inputs, flat (a new tensor: the inputs are left as they are)."""
        acc = inputs[0].reshape(-1).to(torch.float32, copy=True)
        for x in inputs[1:]:
            acc += x.reshape(-1)
        return acc

    @profiling.ranged("reduce_scatter_avg")
    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                           tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                           timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_scatter_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        what = self._what("reduce_scatter_avg", inputs, tag)
        self._debug_check("reduce_scatter_avg", inputs[0], debug_key, limit)
        call = calls.make("Communicator.reduce_scatter_avg", inputs[0].dtype, count=inputs[0].numel())
        if self.local_size == 1 and self._uniform:   # one tower per process: straight into the output
            out = outputs[0].view(-1)
            work = self._sum_scatter(what, out, inputs[0].reshape(-1), limit, call)
            _wait_dist(self, work, limit, what)
            self._scale(as_buffer(out, "outputs[0]"), 1.0, float(self.size))
            return
        shard = outputs[0].numel()
        acc = self._local_sum(inputs)
        if self._uniform:   # this process's towers' shards are one contiguous chunk of the same size
            mine = torch.empty(shard * self.local_size, dtype=torch.float32)
            work = self._sum_scatter(what, mine, acc, limit, call)
            first = 0
        else:               # chunks of different sizes: reduce everything, keep this process's part
            work = self._sum(what, acc, True, limit, call=call)
            mine, first = acc, self.tower_offset * shard
        _wait_dist(self, work, limit, what)
        for t, out in enumerate(outputs):
            lo = first + t * shard
            out.view(-1).copy_(mine[lo:lo + shard].div_(self.size))

    @profiling.ranged("all_gather")
    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                   tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_gather_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        what = self._what("all_gather", inputs, tag)
        self._debug_check("all_gather", inputs[0], debug_key, limit)
        n = inputs[0].numel()
        call = calls.make("Communicator.all_gather", inputs[0].dtype, count=n)
        widest = max(self.tower_counts)
        local = inputs[0].reshape(-1) if self.local_size == 1 else torch.cat([x.reshape(-1) for x in inputs])
        if self._uniform:
            work = self._gather(what, outputs[0].view(-1), local, limit, call)
            _wait_dist(self, work, limit, what)
        else:   # gloo gathers equal sizes only: every process sends `widest` towers' worth, padded
            padded = torch.zeros(widest * n, dtype=local.dtype)
            padded[:local.numel()] = local
            gathered = torch.empty(self.world_size * widest * n, dtype=local.dtype)
            work = self._gather(what, gathered, padded, limit, call)
            _wait_dist(self, work, limit, what)
            out, pos = outputs[0].view(-1), 0
            for p, count in enumerate(self.tower_counts):
                out[pos:pos + count * n] = gathered[p * widest * n:(p * widest + count) * n]
                pos += count * n
        for out in outputs[1:]:
            out.view(-1).copy_(outputs[0].view(-1))

    # ------------------------------------------------------------------ process-level shards (ZeRO-1)
    def reduce_scatter_processes(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, *,
                                 tag: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """out = this process's 1/world_size shard (rank order) of the mean over every tower of `tensors`
        (one full buffer per local tower; numel divisible by world_size). The shards are per process, not
        per tower: ZeRO-1 across processes (ncclavg/train/sharded.py). The local towers' buffers are
        overwritten (they hold this process's mean afterwards). See Note [Hierarchical CPU average]."""
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        limit = self._timeout_arg(timeout)
        n = tensors[0].numel()
        if n % self.world_size:
            raise ValueError(f"tensors: {n} elements is not divisible by the {self.world_size} processes")
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or out.dtype != tensors[0].dtype:
            raise TypeError(f"out: expected a CPU tensor of dtype {tensors[0].dtype}")
        if out.numel() != n // self.world_size or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor of {n // self.world_size} elements, got "
                             f"{out.numel()}")
        what = self._what("reduce_scatter_processes", tensors, tag)
        if self.local_size > 1:
            _C.average_(bufs, 0)
        scale, pre_div, post_div = self._sum_factors()
        self._scale(bufs[0], scale, pre_div)
        call = calls.make("Communicator.reduce_scatter_processes", tensors[0].dtype, count=n)
        work = self._sum_scatter(what, out.view(-1), tensors[0].reshape(-1), limit, call)
        _wait_dist(self, work, limit, what)
        self._scale(as_buffer(out.view(-1), "out"), 1.0, post_div)

    def all_gather_processes(self, shard: torch.Tensor, outputs: Sequence[torch.Tensor], *,
                             tag: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Every tensor of `outputs` (e.g. one per local tower; world_size * shard.numel() elements each)
        = every process's `shard` in rank order: the inverse of reduce_scatter_processes."""
        self._check_open()
        if not isinstance(shard, torch.Tensor) or shard.device.type != "cpu":
            raise TypeError("shard: expected a CPU tensor")
        if isinstance(outputs, torch.Tensor) or not outputs:
            raise TypeError("outputs: expected a non-empty list of tensors")
        outputs = list(outputs)
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu" or o.dtype != shard.dtype:
                raise TypeError(f"outputs[{i}]: expected a CPU tensor of dtype {shard.dtype}")
            if o.numel() != shard.numel() * self.world_size or not o.is_contiguous():
                raise ValueError(f"outputs[{i}]: expected a contiguous tensor of {shard.numel() * self.world_size} "
                                 f"elements, got {o.numel()}")
        limit = self._timeout_arg(timeout)
        what = self._what("all_gather_processes", [shard], tag)
        # the shard may be a view of an output (a tower's own slice): gather from a copy
        call = calls.make("Communicator.all_gather_processes", shard.dtype, count=shard.numel())
        work = self._gather(what, outputs[0].view(-1), shard.reshape(-1).clone(), limit, call)
        _wait_dist(self, work, limit, what)
        for o in outputs[1:]:
            o.view(-1).copy_(outputs[0].view(-1))

    def sum_over_processes(self, values: Sequence[float], *, timeout: Optional[float] = None) -> list:
        return self.sum_over_processes_async(values, timeout=timeout)()

    def sum_over_processes_async(self, values: Sequence[float], *,
                                 timeout: Optional[float] = None) -> Callable[[], list]:
        self._check_open()
        limit = self._timeout_arg(timeout)
        buf = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.world_size == 1:
            return buf.tolist
        what = f"{self.transport} sum_over_processes of {buf.numel()} values (rank {self.rank} of {self.world_size})"
        call = calls.make("Communicator.sum_over_processes", buf.dtype, count=buf.numel())
        work = self._sum(what, buf, False, limit, call=call)   # overlaps the caller's work until finish()

        def finish() -> list:
            _wait_dist(self, work, limit, what)
            return buf.tolist()

        return finish

    @profiling.ranged("broadcast_tensors")
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], *, timeout: Optional[float] = None) -> None:
        self._check_open()
        limit = self._timeout_arg(timeout)
        if self.world_size == 1 or not tensors:
            return
        what = f"{self.transport} broadcast_tensors of {len(tensors)} tensors from rank 0 (rank {self.rank} of {self.world_size})"
        src = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        # one message per dtype: the tensors of a dtype travel as one flat buffer
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group_tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in group_tensors])
            call = calls.make("Communicator.broadcast_tensors", flat.dtype, count=flat.numel())
            _wait_dist(self, self._from_rank_0(what, flat, src, limit, call), limit, what)
            pos = 0
            with torch.no_grad():
                for t in group_tensors:
                    t.copy_(flat[pos:pos + t.numel()].view_as(t))
                    pos += t.numel()

    def _fail(self, reason: str) -> None:
        super()._fail(reason)
        if getattr(self, "_fast", None) is not None:
            self._fast.disable()   # the general path says why the communicator refuses

    def close(self) -> None:
        if getattr(self, "_fast", None) is not None:
            self._fast.disable()
        if getattr(self, "_liveness", None) is not None:
            self._liveness.stop()
        if getattr(self, "_shm", None) is not None:
            self._shm.close()
        super().close()

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        self._check_open()
        return _allgather_object_bounded(self, self._dist, self.group, obj, self._timeout_arg(timeout))

    def _debug_allgather(self, record: torch.Tensor, timeout: float) -> torch.Tensor:
        return _debug_allgather_dist(self, self._dist, self.group, record, timeout)
