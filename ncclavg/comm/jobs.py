"""The jobs of the public API's collectives: one class per collective, named after it, holding the
arguments its Communicator method checked and doing the collective in `run` on the communicator's runner
(transport/runner.py). A reader follows a tensor by names alone: `GlooCommunicator.all_reduce_avg` makes an
`Average`, whose `run` asks the communicator's paths for the sum (transport/paths.py); the local backend's
asynchronous average is a `LocalAverage`; the bounded gloo exchanges of setup and NCCLAVG_DEBUG are
`GlooAllGather`s.
"""
from __future__ import annotations

from typing import Any, List

import torch

from .._ext import _C
from ..buffers import as_buffer
from ..transport.runner import Job


class CommJob(Job):
    """A job of the public API: `comm` its communicator; described by it (Job.describe) before its runner
    runs it. A subclass lists its arguments in ARGS (dropped once the job is complete: Job.drop; the
    Buffers are only pointers, so a job holds the tensors they point into until then)."""

    __slots__ = ("comm",)

    def __init__(self, comm: Any):
        super().__init__(None, None, 0.0)
        self.comm = comm


class Average(CommJob):
    """all_reduce_avg(_async) of a GlooCommunicator: Note [Hierarchical CPU average] in gloo.py. `bufs` the
    towers' Buffers over `tensors`, `flat` tower 0's tensor flat; (scale, pre_div) tower 0's scale before
    the sum, `post_div` the division after it, in the channel's pass when `fused`; `defer` leaves the
    division to the caller (Work.divisor)."""
    __slots__ = ARGS = ("tensors", "bufs", "flat", "scale", "pre_div", "post_div", "fused", "defer")

    def __init__(self, comm: Any, tensors: List[torch.Tensor], bufs: List[Any], flat: torch.Tensor,
                 factors: tuple, fused: bool, defer: bool):
        super().__init__(comm)
        self.tensors, self.bufs, self.flat = tensors, bufs, flat
        self.scale, self.pre_div, self.post_div = factors
        self.fused, self.defer = fused, defer

    def run(self) -> None:
        comm, bufs = self.comm, self.bufs
        if comm.local_size > 1:
            _C.average_(bufs, 0)
        comm._scale(bufs[0], self.scale, self.pre_div)
        self.noting = True   # Work.finite: the channel's sum notes what it writes, and so do the scales
        comm._paths.sum(self, self.flat, self.post_div if self.fused else 1.0)
        if self.defer:
            return
        left = 1.0 if self.fused else self.post_div
        # every tower ends with the same values, so either pass's answer is the bucket's
        copied = comm._scale(bufs[0], 1.0, left, dsts=bufs[1:]) if len(bufs) > 1 else None
        scaled = comm._scale(bufs[0], 1.0, left)   # the other towers first: tower 0's buffer is their source
        noted = scaled if scaled is not None else copied
        if noted is not None:
            self.finite = noted


class ReduceScatterAvg(CommJob):
    """reduce_scatter_avg of a GlooCommunicator: each output = its tower's shard of the mean over every
    tower, `shard` elements."""
    __slots__ = ARGS = ("inputs", "outputs", "shard")

    def __init__(self, comm: Any, inputs: List[torch.Tensor], outputs: List[torch.Tensor], shard: int):
        super().__init__(comm)
        self.inputs, self.outputs, self.shard = inputs, outputs, shard

    def run(self) -> None:
        comm, inputs, outputs, shard = self.comm, self.inputs, self.outputs, self.shard
        if comm.local_size == 1 and comm._uniform:   # one tower per process: straight into the output
            out = outputs[0].view(-1)
            comm._paths.sum_scatter(self, out, inputs[0].reshape(-1))
            comm._scale(as_buffer(out, "outputs[0]"), 1.0, float(comm.size))
            return
        acc = comm._local_sum(inputs)
        if comm._uniform:   # this process's towers' shards are one contiguous chunk of the same size
            mine = torch.empty(shard * comm.local_size, dtype=torch.float32)
            comm._paths.sum_scatter(self, mine, acc)
            first = 0
        else:               # chunks of different sizes: reduce everything, keep this process's part
            comm._paths.sum(self, acc)
            mine, first = acc, comm.tower_offset * shard
        for t, out in enumerate(outputs):
            lo = first + t * shard
            out.view(-1).copy_(mine[lo:lo + shard].div_(comm.size))


class AllGather(CommJob):
    """all_gather of a GlooCommunicator: each output = every tower's input (`n` elements each), in tower
    order; processes with fewer towers than `widest` send padding (gloo gathers equal sizes only)."""
    __slots__ = ARGS = ("inputs", "outputs", "n", "widest")

    def __init__(self, comm: Any, inputs: List[torch.Tensor], outputs: List[torch.Tensor], n: int, widest: int):
        super().__init__(comm)
        self.inputs, self.outputs, self.n, self.widest = inputs, outputs, n, widest

    def run(self) -> None:
        comm, inputs, outputs, n, widest = self.comm, self.inputs, self.outputs, self.n, self.widest
        local = inputs[0].reshape(-1) if comm.local_size == 1 else torch.cat([x.reshape(-1) for x in inputs])
        if comm._uniform:
            comm._paths.all_gather_typed(self, outputs[0].view(-1), local)
        else:
            padded = torch.zeros(widest * n, dtype=local.dtype)
            padded[:local.numel()] = local
            gathered = torch.empty(comm.world_size * widest * n, dtype=local.dtype)
            comm._paths.all_gather_typed(self, gathered, padded)
            out, pos = outputs[0].view(-1), 0
            for p, count in enumerate(comm.tower_counts):
                out[pos:pos + count * n] = gathered[p * widest * n:(p * widest + count) * n]
                pos += count * n
        for out in outputs[1:]:
            out.view(-1).copy_(outputs[0].view(-1))


class ReduceScatterProcesses(CommJob):
    """reduce_scatter_processes of a GlooCommunicator: `out` = this process's shard of the mean over every
    tower of `tensors` (their Buffers `bufs`)."""
    __slots__ = ARGS = ("tensors", "bufs", "out")

    def __init__(self, comm: Any, tensors: List[torch.Tensor], bufs: List[Any], out: torch.Tensor):
        super().__init__(comm)
        self.tensors, self.bufs, self.out = tensors, bufs, out

    def run(self) -> None:
        comm, bufs = self.comm, self.bufs
        if comm.local_size > 1:
            _C.average_(bufs, 0)
        scale, pre_div, post_div = comm._sum_factors()
        comm._scale(bufs[0], scale, pre_div)
        comm._paths.sum_scatter(self, self.out.view(-1), self.tensors[0].reshape(-1))
        comm._scale(as_buffer(self.out.view(-1), "out"), 1.0, post_div)


class AllGatherProcesses(CommJob):
    """all_gather_processes of a GlooCommunicator: each output = every process's `shard`, in rank order."""
    __slots__ = ARGS = ("shard", "outputs")

    def __init__(self, comm: Any, shard: torch.Tensor, outputs: List[torch.Tensor]):
        super().__init__(comm)
        self.shard, self.outputs = shard, outputs

    def run(self) -> None:
        outputs = self.outputs
        # the shard may be a view of an output (a tower's own slice): gather from a copy
        self.comm._paths.all_gather_typed(self, outputs[0].view(-1), self.shard.reshape(-1).clone())
        for o in outputs[1:]:
            o.view(-1).copy_(outputs[0].view(-1))


class SumOverProcesses(CommJob):
    """sum_over_processes(_async): `buf` (float64) = its sum over the processes."""
    __slots__ = ARGS = ("buf",)

    def __init__(self, comm: Any, buf: torch.Tensor):
        super().__init__(comm)
        self.buf = buf

    def run(self) -> None:
        self.comm._paths.sum(self, self.buf)


class BroadcastBytes(CommJob):
    """broadcast_tensors' message of one dtype: `data` (its bytes) = rank 0's."""
    __slots__ = ARGS = ("data",)

    def __init__(self, comm: Any, data: torch.Tensor):
        super().__init__(comm)
        self.data = data

    def run(self) -> None:
        self.comm._paths.broadcast_bytes(self, self.data, 0)


class LocalAverage(Job):
    """all_reduce_avg_async of the local backend's CPU towers: the core's one-pass average of `bufs`, which
    notes whether a mean it wrote is inf/NaN (Work.finite: Note [Finiteness from the pass that writes] in
    csrc/common/finite_math.h). `tensors` keeps the towers' tensors alive until it ran."""
    __slots__ = ARGS = ("bufs", "tensors")

    def __init__(self, bufs: List[Any], tensors: List[torch.Tensor], what: Any, timeout: float):
        super().__init__(None, what, timeout)
        self.bufs, self.tensors = bufs, tensors

    def run(self) -> None:
        self.finite = _C.average_(self.bufs, 0, True)


class GlooAllGather(Job):
    """A bounded torch.distributed all_gather of `inp` into `outs` over `group` (setup's exchanges and
    NCCLAVG_DEBUG's sequence check: dist.py), waited for until the job's deadline."""
    __slots__ = ARGS = ("dist", "group", "outs", "inp")

    def __init__(self, dist: Any, group: Any, outs: List[torch.Tensor], inp: torch.Tensor, what: Any,
                 timeout: float, own_timeout: bool):
        super().__init__(None, what, timeout, own_timeout=own_timeout)
        self.dist, self.group, self.outs, self.inp = dist, group, outs, inp

    def run(self) -> None:
        self.wait_gloo(self.dist.all_gather(self.outs, self.inp, group=self.group, async_op=True))
