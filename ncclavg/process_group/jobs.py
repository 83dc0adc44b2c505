"""The jobs of the `ncclavg` torch backend's CPU collectives: one class per collective, named after it,
holding the arguments the group checked (group.py) and running the group's CpuCollectives step of the
same name (cpu_collectives.py) on its runner (transport/runner.py). A reader follows a tensor by names
alone: `ProcessGroupNcclavg.allreduce` makes an `AllReduce`, whose `run` calls `CpuCollectives.allreduce`,
which asks the group's paths for the implementation that sums it (transport/paths.py).

Note [Frames of a call]
The general path of `dist.all_reduce` on one host, from the group's method to the channel's binding,
is 8 Python frames: ProcessGroupNcclavg.allreduce -> _submit -> Runner.start -> Runner._execute ->
AllReduce.run -> CpuCollectives.allreduce -> ChannelPaths.sum -> ShmTransport.all_reduce_sum (the
implementation is picked by Paths.taking_sum, which returns before it runs; the device is picked in the
method itself: Note [Device types] in devices.py). A job queued behind another runs on the runner's
worker: Runner._serve -> _execute -> the same frames. tests/process_group/test_frames.py counts them.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..transport.runner import Job
from .cpu_collectives import CpuCollectives

__all__ = ["AllGather", "AllGatherCoalesced", "AllGatherSingle", "AllGatherSingleCoalesced", "AllReduce",
           "AllReduceCoalesced", "AllToAll", "AllToAllSingle", "Barrier", "Broadcast", "Gather", "Marker",
           "Reduce", "ReduceScatter", "ReduceScatterSingle", "ReduceScatterSingleCoalesced", "Scatter",
           "SparseAllReduce", "TorchJob"]


class TorchJob(Job):
    """A job of the torch face: `cpu` the group's CpuCollectives; a torch future (its Work's); the group
    describes it (Job.describe) before its runner runs it. A subclass lists its arguments in ARGS (dropped
    once the job is complete: Job.drop) and runs its step in `run`."""

    __slots__ = ("cpu",)

    def __init__(self, cpu: CpuCollectives):
        super().__init__(None, None, 0.0, future=True)
        self.cpu = cpu


# ---------------------------------------------------------------------- the all-reduce family
class AllReduce(TorchJob):
    """dist.all_reduce: `t` reduced by `op` over the group, in place."""
    __slots__ = ARGS = ("t", "op")

    def __init__(self, cpu: CpuCollectives, t: torch.Tensor, op: Any):
        super().__init__(cpu)
        self.t, self.op = t, op

    def run(self) -> None:
        self.cpu.allreduce(self, self.t, self.op)


class SparseAllReduce(TorchJob):
    """dist.all_reduce of a sparse COO tensor `t` (SUM)."""
    __slots__ = ARGS = ("t",)

    def __init__(self, cpu: CpuCollectives, t: torch.Tensor):
        super().__init__(cpu)
        self.t = t

    def run(self) -> None:
        self.cpu.sparse_allreduce(self, self.t)


class AllReduceCoalesced(TorchJob):
    """dist.all_reduce_coalesced: every tensor of `tensors` reduced by `op`, in place."""
    __slots__ = ARGS = ("tensors", "op")

    def __init__(self, cpu: CpuCollectives, tensors: List[torch.Tensor], op: Any):
        super().__init__(cpu)
        self.tensors, self.op = list(tensors), op

    def run(self) -> None:
        self.cpu.allreduce_coalesced(self, self.tensors, self.op)


class Reduce(TorchJob):
    """dist.reduce: `t` reduced by `op` onto rank `root` (the others' tensors are left as they were)."""
    __slots__ = ARGS = ("t", "root", "op")

    def __init__(self, cpu: CpuCollectives, t: torch.Tensor, root: int, op: Any):
        super().__init__(cpu)
        self.t, self.root, self.op = t, root, op

    def run(self) -> None:
        self.cpu.reduce(self, self.t, self.root, self.op)


class ReduceScatterSingle(TorchJob):
    """dist.reduce_scatter_tensor: `out` = this rank's slice of `inp` reduced by `op`."""
    __slots__ = ARGS = ("out", "inp", "op")

    def __init__(self, cpu: CpuCollectives, out: torch.Tensor, inp: torch.Tensor, op: Any):
        super().__init__(cpu)
        self.out, self.inp, self.op = out, inp, op

    def run(self) -> None:
        self.cpu.reduce_scatter_single(self, self.out, self.inp, self.op)


class ReduceScatterSingleCoalesced(TorchJob):
    """reduce_scatter_tensor_coalesced: ReduceScatterSingle for each (output, input) pair, in order."""
    __slots__ = ARGS = ("outs", "inps", "op")

    def __init__(self, cpu: CpuCollectives, outs: List[torch.Tensor], inps: List[torch.Tensor], op: Any):
        super().__init__(cpu)
        self.outs, self.inps, self.op = list(outs), list(inps), op

    def run(self) -> None:
        for o, i in zip(self.outs, self.inps):
            self.cpu.reduce_scatter_single(self, o, i, self.op)
        if not self.outs:
            self.cpu.barrier(self)


class ReduceScatter(TorchJob):
    """dist.reduce_scatter: `out` = the reduction by `op` of every rank's `inputs[rank]`."""
    __slots__ = ARGS = ("out", "inputs", "op")

    def __init__(self, cpu: CpuCollectives, out: torch.Tensor, inputs: List[torch.Tensor], op: Any):
        super().__init__(cpu)
        self.out, self.inputs, self.op = out, inputs, op

    def run(self) -> None:
        self.cpu.reduce_scatter(self, self.out, self.inputs, self.op)


# ---------------------------------------------------------------------- data movement
class Broadcast(TorchJob):
    """dist.broadcast: `t` = rank `root`'s."""
    __slots__ = ARGS = ("t", "root")

    def __init__(self, cpu: CpuCollectives, t: torch.Tensor, root: int):
        super().__init__(cpu)
        self.t, self.root = t, root

    def run(self) -> None:
        self.cpu.broadcast(self, self.t, self.root)


class AllGatherSingle(TorchJob):
    """dist.all_gather_into_tensor: `out` = every rank's `inp`, in rank order."""
    __slots__ = ARGS = ("out", "inp")

    def __init__(self, cpu: CpuCollectives, out: torch.Tensor, inp: torch.Tensor):
        super().__init__(cpu)
        self.out, self.inp = out, inp

    def run(self) -> None:
        self.cpu.all_gather_single(self, self.out, self.inp)


class AllGatherSingleCoalesced(TorchJob):
    """all_gather_into_tensor_coalesced: AllGatherSingle for each (output, input) pair, in order."""
    __slots__ = ARGS = ("outs", "inps")

    def __init__(self, cpu: CpuCollectives, outs: List[torch.Tensor], inps: List[torch.Tensor]):
        super().__init__(cpu)
        self.outs, self.inps = list(outs), list(inps)

    def run(self) -> None:
        for o, i in zip(self.outs, self.inps):
            self.cpu.all_gather_single(self, o, i)
        if not self.inps:
            self.cpu.barrier(self)


class AllGather(TorchJob):
    """dist.all_gather: `outs[r]` = rank r's `inp`."""
    __slots__ = ARGS = ("outs", "inp")

    def __init__(self, cpu: CpuCollectives, outs: List[torch.Tensor], inp: torch.Tensor):
        super().__init__(cpu)
        self.outs, self.inp = outs, inp

    def run(self) -> None:
        self.cpu.allgather(self, self.outs, self.inp)


class AllGatherCoalesced(TorchJob):
    """all_gather_coalesced: `output_lists[r][k]` = rank r's `inputs[k]`, one all-gather per input."""
    __slots__ = ARGS = ("output_lists", "inputs")

    def __init__(self, cpu: CpuCollectives, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor]):
        super().__init__(cpu)
        self.output_lists, self.inputs = output_lists, list(inputs)

    def run(self) -> None:
        for k, inp in enumerate(self.inputs):
            self.cpu.allgather(self, [outs[k] for outs in self.output_lists], inp)
        if not self.inputs:
            self.cpu.barrier(self)


class Gather(TorchJob):
    """dist.gather: on rank `root`, `outs[r]` = rank r's `inp`."""
    __slots__ = ARGS = ("outs", "inp", "root")

    def __init__(self, cpu: CpuCollectives, outs: List[torch.Tensor], inp: torch.Tensor, root: int):
        super().__init__(cpu)
        self.outs, self.inp, self.root = outs, inp, root

    def run(self) -> None:
        self.cpu.gather(self, self.outs, self.inp, self.root)


class Scatter(TorchJob):
    """dist.scatter: `out` = rank `root`'s `inputs[rank]` (`inputs` None on the other ranks)."""
    __slots__ = ARGS = ("out", "inputs", "root")

    def __init__(self, cpu: CpuCollectives, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int):
        super().__init__(cpu)
        self.out, self.inputs, self.root = out, inputs, root

    def run(self) -> None:
        self.cpu.scatter(self, self.out, self.inputs, self.root)


class AllToAllSingle(TorchJob):
    """dist.all_to_all_single, by the splits (empty: even)."""
    __slots__ = ARGS = ("out", "inp", "out_splits", "in_splits")

    def __init__(self, cpu: CpuCollectives, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                 in_splits: List[int]):
        super().__init__(cpu)
        self.out, self.inp, self.out_splits, self.in_splits = out, inp, list(out_splits), list(in_splits)

    def run(self) -> None:
        self.cpu.alltoall_single(self, self.out, self.inp, self.out_splits, self.in_splits)


class AllToAll(TorchJob):
    """dist.all_to_all: `outs[r]` = rank r's `inputs[rank]`."""
    __slots__ = ARGS = ("outs", "inputs")

    def __init__(self, cpu: CpuCollectives, outs: List[torch.Tensor], inputs: List[torch.Tensor]):
        super().__init__(cpu)
        self.outs, self.inputs = list(outs), list(inputs)

    def run(self) -> None:
        self.cpu.alltoall(self, self.outs, self.inputs)


class Barrier(TorchJob):
    """dist.barrier: a round that waits for every rank (and compares the calls)."""
    __slots__ = ()

    def run(self) -> None:
        self.cpu.barrier(self)


class Marker(TorchJob):
    """The end of a coalescing block: nothing sent; complete once every job before it is."""
    __slots__ = ()

    def run(self) -> None:
        pass
