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
When processes share a host, the collectives between processes go through the core's shared-memory
channel instead of torch.distributed (transport/shm.py, Note [When the shared-memory channel is used]);
the steps above and their element math stay the same. Each collective is one job on the communicator's
runner (transport/runner.py: in order, inline when idle, one deadline, the watchdog, the flight record),
whose steps go to the channel, then torch.distributed, in that order (transport/paths.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .._ext import _C
from ..buffers import as_buffer, channel_type_code
from ..transport import calls, flight, host_setup, profiling, stragglers
from ..transport.calls import average_call
from ..transport.failure import CHANNEL_ERRORS
from ..transport.liveness import Liveness
from ..transport.paths import Paths
from ..transport.profiling import enabled as _profiling
from ..transport.reductions import as_bytes, byte_wire
from ..transport.runner import ASYNC_READY_S, CallNow
from ..transport.shm import host_identity, supports as shm_supports
from ..transport.work import JobWork, Work, done_work
from . import jobs as J
from .base import Communicator, check_count, check_timeout
from .dist import allgather_object, debug_allgather
from .fast_average import fast_average


_AVERAGE = ("Communicator.all_reduce_avg", None, None)   # the flight record's (collective, op, root)


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
        found = ([(towers, "")] if self.world_size == 1 else
                 allgather_object(self, dist, group, (towers, host_identity()), self.timeout))
        self.tower_counts: list = [int(c) for c, _ in found]
        self.size = sum(self.tower_counts)
        self.tower_offset = sum(self.tower_counts[:self.rank])   # global index of local tower 0
        self._uniform = len(set(self.tower_counts)) == 1
        # See Note [Naming the lost rank] in liveness.py
        self._liveness = Liveness.for_group(dist, group, self.rank, self.world_size) if self.world_size > 1 else None
        self._runner.liveness = self._liveness
        transport = host_setup.connect(
            self.rank, self.world_size, lambda obj: allgather_object(self, dist, group, obj, self.timeout),
            [h for _, h in found], self.timeout, make_group=host_setup.dist_group_maker(dist, group, self.timeout))
        self._runner.transport = transport
        # between the processes: "shm", the shared-memory channel (one host); "shm+gloo", a channel per host
        # and torch.distributed between the hosts (Note [Several hosts] in transport/hosts.py); "gloo",
        # torch.distributed
        self.transport = transport.kind if transport is not None else "gloo"
        c10d = group if group is not None else dist.group.WORLD
        # the steps: the channel, then torch.distributed (whose path compares no calls: NCCLAVG_DEBUG does)
        self._paths = Paths(transport, c10d, self.rank, self.world_size, compare=False)
        self._runner.recorder = flight.for_group(f"communicator-{self.backend}", self.rank, self.world_size,
                                                 dist.get_rank(), self.transport)
        if self._runner.recorder is not None and stragglers.arrival_source(transport) is not None:
            self._runner.recorder.stragglers = stragglers.dump_source(transport)
        # Note [Division in the channel]
        # With one host's channel over every process, an average's division by the number of towers runs
        # in the channel's sum (the same bits as the unpack scale after it), one pass less. Which
        # collective the channel runs must be the same on every rank (its signature includes the scale),
        # so this depends only on what every rank shares: the transport, and the dtype and the call.
        self._channel = transport.channel if transport is not None else None
        self._fuses_division = self._channel is not None
        # one tower here, and one host's channel over every process or the lanes between the hosts (the
        # lanes divide after their sum, as the general path's unpack scale does): Note [Small-message fast path]
        target = transport.fast_target if transport is not None else None
        self._fast = (fast_average(self._fast_plan, target, self._runner.order, self._runner.recorder, _AVERAGE)
                      if target is not None and towers == 1 else None)
        self._fast_run = self._fast.run if self._fast is not None else None
        if self._fast is not None:
            self._runner.fast_paths.append(self._fast)

    # ------------------------------------------------------------------ jobs
    def _submit(self, what: Any, job: J.CommJob, call: Any, timeout: Optional[float], sync: bool,
                like: Sequence[torch.Tensor], inline_bytes: int = -1) -> JobWork:
        """`job` (jobs.py) described as `what` and run on this communicator's runner: now when `sync` and
        nothing is pending, else queued; an asynchronous call of at most `inline_bytes` bytes runs now too
        when its peers are in it already (Note [One runner] in transport/runner.py). `like`: the tensors its
        flight record describes (Note [What a job records] in process_group/face.py)."""
        limit = self.timeout if timeout is None else timeout
        self._describe_job(job, what, call, limit, like)
        ready = None if sync or self._channel is None else self._runner.ready_for(inline_bytes)
        return self._runner.submit(job, inline=sync, ready=ready)

    def _describe_job(self, job: J.CommJob, what: Any, call: Any, limit: float, like: Sequence[torch.Tensor]) -> None:
        job.describe(what, limit, call, own_timeout=limit != self.timeout)
        if self._runner.recorder is not None and call is not None:
            job.rec = self._runner.recorder.issue(call, like)

    def _run(self, what: Any, job: J.CommJob, call: Any, limit: float, like: Sequence[torch.Tensor]) -> None:
        """A synchronous collective: `job` described as `what` and run, waited for (bounded by `limit`)."""
        self._describe_job(job, what, call, limit, like)
        self._runner.call(job, limit)

    # Note [The public API's other fast calls]
    # A synchronous broadcast_tensors, all_gather or reduce_scatter_avg with one tower per process, on a
    # communicator whose processes share one channel, is the channel transport's primitive called on the
    # caller's thread through Runner.now (Note [Calls run now] in transport/runner.py: when the runner is
    # idle; no Job, no Work; recorded), as the torch face's FastCalls (process_group/fast_path.py) and the
    # native all_reduce_avg (Note [Small-message fast path] in fast_average.py) do. It is the primitive the
    # general path's job calls (the same wire type, count and call signature), with the call's own limit
    # instead of the job's (CallNow), so ranks that take different ways still meet in it. Measured: a
    # runner job costs a small call 4-8 us more (bench/results/torch_face-one-runner-*.md).
    def _channel_now(self, what: Any, call: Any, limit: float, step: Callable[[Any], None], like: torch.Tensor) -> bool:
        """Note [The public API's other fast calls]: `step(transport)` run now when this communicator's
        processes share one channel (Runner.now decides when; `like` is the tensor its record describes);
        False (nothing done) sends the call down the general path. A failed round fails the communicator as
        the runner's job would have."""
        if self._channel is None:
            return False
        transport = self._runner.transport
        try:
            return self._runner.now(lambda: step(transport, CallNow(call, limit)), call, like.dtype, like.numel())
        except CHANNEL_ERRORS as e:
            raise self._runner.failed_without_job(what, limit, call, limit != self.timeout, e) from None

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
        if self.debug or self.failure is not None or self._closed:
            return None
        self._checked_buffers([t], "tensors")
        scale, pre_div, post_div = self._sum_factors()
        if scale != 1.0 or pre_div != 1.0 or not shm_supports(t):
            return None
        return (t.data_ptr(), t.numel(), channel_type_code(t.dtype), float(post_div), average_call(t).tag)

    def _sum_factors(self) -> tuple:
        """(scale, divisor) for tower 0's buffer before the SUM, and the divisor after it, when every
        local tower holds this process's mean. See Note [Hierarchical CPU average]."""
        if self._uniform:
            scale, divisor = 1.0, float(self.world_size)
        else:
            scale, divisor = float(self.local_size), float(self.size)
        return (scale, divisor, 1.0) if self.predivide else (scale, 1.0, divisor)

    # ------------------------------------------------------------------ the average
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
                if fast(tensors, limit):   # (recorded by the native object: Note [Calls run now])
                    return
            except CHANNEL_ERRORS as e:   # the communicator fails as the runner's job would have
                raise self._runner.failed_without_job(self._what("all_reduce_avg", tensors, tag), limit,
                                                      average_call(tensors[0]), limit != self.timeout, e) from None
        self._average(tensors, False, tag, debug_key, sync=True, timeout=limit).wait(limit)

    @profiling.ranged("all_reduce_avg_async")
    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        fast = self._fast
        if fast is not None and not defer_scale and not _profiling():
            # Note [Small-message fast path]: small, on one host's channel, its peers in it already (Note
            # [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp): done now, in C++,
            # its Work complete, with the channel's finiteness note as the job's would have
            try:
                finite = fast.run_async(tensors, self.timeout, ASYNC_READY_S)
            except CHANNEL_ERRORS as e:   # the communicator fails as the runner's job would have; wait() says so
                return done_work(error=self._runner.failed_without_job(
                    self._what("all_reduce_avg", tensors, tag), self.timeout, average_call(tensors[0]), False, e))
            if finite is not None:   # (recorded by the native object: Note [Calls run now])
                work = done_work()
                work.finite = finite
                return work
        return self._average(tensors, defer_scale, tag, debug_key, sync=False)

    def _average(self, tensors: Sequence[torch.Tensor], defer_scale: bool, tag: Optional[str],
                 debug_key: Optional[Sequence[int]], sync: bool, timeout: Optional[float] = None) -> JobWork:
        tensors, bufs = self._checked_buffers(tensors, "tensors")  # dtype / contiguity in the user's terms
        what = self._what("all_reduce_avg", tensors, tag)
        self._debug_check("all_reduce_avg", tensors[0], debug_key, self.timeout)
        scale, pre_div, post_div = self._sum_factors()
        # See Note [Division in the channel]: the same choice on every rank
        fused = self._fuses_division and not defer_scale and shm_supports(tensors[0])
        defer = defer_scale and self.local_size == 1
        flat = tensors[0].view(-1)
        job = J.Average(self, list(tensors), bufs, flat, (scale, pre_div, post_div), fused, defer)
        work = self._submit(what, job, average_call(tensors[0]), timeout, sync, tensors[:1],
                            inline_bytes=flat.numel() * flat.element_size() if shm_supports(flat) else -1)
        if defer:
            work.divisor = 1.0 if fused else post_div
        return work

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
        shard = outputs[0].numel()
        if self.local_size == 1 and self._uniform and shm_supports(outputs[0]) and shm_supports(inputs[0]):
            out, inp = outputs[0], inputs[0]   # ReduceScatterAvg's first branch, its channel step as ShmTransport's
            if self._channel_now(what, call, limit, lambda tr, now: tr.reduce_scatter_sum(out, inp, now), inp):
                self._scale(as_buffer(out, "outputs[0]"), 1.0, float(self.size))
                return

        self._run(what, J.ReduceScatterAvg(self, inputs, outputs, shard), call, limit, inputs[:1])

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
        if self.local_size == 1 and self._uniform and shm_supports(outputs[0]) and shm_supports(inputs[0]):
            out, inp = outputs[0], inputs[0]   # AllGather's typed all-gather, as ShmTransport's
            if self._channel_now(what, call, limit, lambda tr, now: tr.all_gather(out, inp, now), inp):
                return

        self._run(what, J.AllGather(self, inputs, outputs, n, widest), call, limit, inputs[:1])

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
        call = calls.make("Communicator.reduce_scatter_processes", tensors[0].dtype, count=n)

        self._run(what, J.ReduceScatterProcesses(self, tensors, bufs, out), call, limit, tensors[:1])

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
        call = calls.make("Communicator.all_gather_processes", shard.dtype, count=shard.numel())

        self._run(what, J.AllGatherProcesses(self, shard, outputs), call, limit, [shard])

    # ------------------------------------------------------------------ small exchanges
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
        # overlaps the caller's work until finish()
        work = self._submit(what, J.SumOverProcesses(self, buf), call, limit, False, [buf],
                            inline_bytes=buf.numel() * 8)

        def finish() -> list:
            work.wait(limit)
            return buf.tolist()

        return finish

    @profiling.ranged("broadcast_tensors")
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], *, timeout: Optional[float] = None) -> None:
        self._check_open()
        limit = self._timeout_arg(timeout)
        if self.world_size == 1 or not tensors:
            return
        what = f"{self.transport} broadcast_tensors of {len(tensors)} tensors from rank 0 (rank {self.rank} of {self.world_size})"
        # one message per dtype: the tensors of a dtype travel as one flat buffer
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group_tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in group_tensors])
            call = calls.make("Communicator.broadcast_tensors", flat.dtype, count=flat.numel())
            data = as_bytes(flat)
            # the bytes as ChannelPaths.broadcast_bytes puts them on the channel (an odd count: its padding)
            wire = byte_wire(data, data.numel()) if data.numel() % 2 == 0 else None
            if wire is None or not self._channel_now(what, call, limit,
                                                     lambda tr, now, wire=wire: tr.broadcast(wire, 0, now), flat):
                self._run(what, J.BroadcastBytes(self, data), call, limit, [flat])
            pos = 0
            with torch.no_grad():
                for t in group_tensors:
                    t.copy_(flat[pos:pos + t.numel()].view_as(t))
                    pos += t.numel()

    def close(self) -> None:
        if getattr(self, "_liveness", None) is not None:
            self._liveness.stop()
        if getattr(self, "_runner", None) is not None:
            self._runner.close(self.timeout)
        super().close()

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        self._check_open()
        return allgather_object(self, self._dist, self.group, obj, self._timeout_arg(timeout))

    def _debug_allgather(self, record: torch.Tensor, timeout: float) -> torch.Tensor:
        return debug_allgather(self, self._dist, self.group, record, timeout)
