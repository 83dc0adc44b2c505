"""The DDP comm hook of ncclavg (users call it as `ncclavg.ddp`): DDP's gradient buckets averaged through
ncclavg's transports, whatever backend the DDP model was built over, with an optional low-precision wire.

Note [The DDP hook's engine]
A hook gets DDP's process group. When it is a group of the `ncclavg` backend, the hook uses it as it is.
Otherwise (DDP over gloo) `register` makes an `ncclavg` group over the same ranks (a collective, like the
DDP constructor: every rank registers at the same point), with a host channel of its own (Note [One
channel per group] in connect.py). A CPU bucket is then one
job on that group's runner (transport/runner.py): every step of it, compression included, runs on the
runner's thread while backward goes on, and its torch future holds the bucket's one tensor, as DDP requires. A
CUDA bucket goes through the same `ncclavg` group, whose CUDA half is NCCL (Note [A ProcessGroup, not a
Backend] in group.py), stream-ordered, the future completing after the last step: never through
DDP's own group, which may be gloo (no ReduceOp.AVG there, and no fast path for CUDA tensors).

Note [Low-precision wire with fp32 accumulation]
wire="bfloat16" or "float16" sends the bucket in that dtype but adds in float32. Through one host's
shared-memory channel that is the channel's own sum: rank order, fp32 accumulation, one rounding.
Elsewhere (gloo between hosts, NCCL) the sum of a low-precision all-reduce would round at every step, so
the hook does it in two collectives instead: an all-to-all hands each rank its shard of every rank's
compressed bucket, the rank adds them in float32 in rank order and rounds once, and an all-gather of the
compressed shards completes the bucket: the bytes of one all-reduce, one rounding. predivide (the
default for float16, whose range is small) divides by the world size before compressing, so the sum
cannot overflow; otherwise the division runs in float32 after the sum.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..averager import all_finite
from ..transport import calls
from ..transport.reductions import R
from ..transport.runner import Job
from .cpu_collectives import CpuCollectives
from .jobs import TorchJob
from .group import NAME, ProcessGroupNcclavg

_WIRES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}


class HookState:
    """What the hook needs: DDP's group, the `ncclavg` group it averages through (Note [The DDP hook's
    engine]), the wire dtype (None: the bucket's own) and whether to divide before the sum."""

    def __init__(self, process_group: Any = None, wire: Any = None, predivide: Optional[bool] = None,
                 timeout: Optional[float] = None):
        if wire not in _WIRES:
            raise ValueError(f"wire: expected None, 'float32', 'bfloat16' or 'float16', got {wire!r}")
        if predivide is not None and not isinstance(predivide, bool):
            raise TypeError(f"predivide: expected a bool or None, got {type(predivide).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        if not dist.is_initialized():
            raise RuntimeError("ncclavg.ddp: torch.distributed is not initialized")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.wire = _WIRES[wire]
        self.predivide = (self.wire == torch.float16) if predivide is None else predivide
        if isinstance(self.group, ProcessGroupNcclavg):
            self.engine = self.group
        else:
            kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
            self.engine = dist.new_group(ranks=dist.get_process_group_ranks(self.group), backend=NAME,
                                         use_local_synchronization=True, **kw)
        self._finite: dict = {}    # bucket index -> what the pass that wrote it noted (None: nothing)
        self._last_seen = False    # the last bucket of a backward was launched

    def __getstate__(self) -> dict:   # DDP pickles hook states when it is pickled: keep the settings only
        return {"wire": self.wire, "predivide": self.predivide, "size": self.size}

    @property
    def grads_finite(self) -> Optional[bool]:
        """After a backward: whether every averaged bucket is finite, as the pass that wrote it noted it
        (one host's channel, float32/float64 buckets, no low-precision wire: the channel's sum checks
        what it writes), for the optimizer's step(grads_finite=...) (Note [Finiteness of the averaged
        gradients] in ncclavg/averager.py); None when some bucket was not noted. Every rank receives the
        same bits, so every rank gets the same answer."""
        if not getattr(self, "_last_seen", False):
            return None
        return all_finite(list(self._finite.values()))

    def _launched(self, index: int, last: bool) -> None:
        """Bucket `index` starts; the first bucket after a backward's last forgets that backward's flags."""
        if self._last_seen:
            self._finite, self._last_seen = {}, False
        self._finite[index] = None
        self._last_seen = last


def allreduce_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """A DDP comm hook: the bucket averaged over DDP's ranks (DDP itself does not divide)."""
    buf = bucket.buffer()
    if getattr(state, "_finite", None) is not None:
        state._launched(bucket.index(), bucket.is_last())
    if buf.device.type == "cuda":
        return _cuda_average(state, buf)
    call = calls.make("all_reduce", buf.dtype, dist.ReduceOp.AVG, count=buf.numel())   # DDP's bucket, averaged
    index = bucket.index()
    engine = state.engine
    return engine.submit_custom(HookAverage(engine.cpu, state, buf, index), "ddp hook average", [buf], buf,
                                call).get_future()


class HookAverage(TorchJob):
    """The comm hook's job: DDP's bucket `buf` (number `index`) averaged over the group, on the group's
    runner as its collectives are."""
    __slots__ = ARGS = ("state", "buf", "index")

    def __init__(self, cpu: CpuCollectives, state: HookState, buf: torch.Tensor, index: int):
        super().__init__(cpu)
        self.state, self.buf, self.index = state, buf, index

    def run(self) -> None:
        _cpu_average(self.state, self.cpu, self, self.buf, self.index)


def _cpu_average(state: HookState, cpu: CpuCollectives, job: Job, buf: torch.Tensor, index: int = 0) -> None:
    world = state.size
    flat = buf.view(-1)
    wire = state.wire
    if wire is None or wire == buf.dtype or not buf.is_floating_point():
        job.noting = True   # the channel's check of the sum it writes: HookState.grads_finite
        if state.predivide:
            flat.div_(world)
            cpu.allreduce(job, flat, dist.ReduceOp(R.SUM))
        else:
            cpu.allreduce(job, flat, dist.ReduceOp(R.AVG))
        if getattr(state, "_finite", None) is not None:
            state._finite[index] = job.finite
        return
    low = (flat / world if state.predivide else flat).to(wire)
    if cpu.transport is not None and cpu.transport.kind == "shm":
        cpu.allreduce(job, low, dist.ReduceOp(R.SUM))   # the channel adds in fp32 and rounds once
    else:
        low = _sum_by_shards(low, world, lambda out, inp: cpu.alltoall_single(job, out, inp, [], []),
                             lambda out, inp: cpu.all_gather_single(job, out, inp))
    flat.copy_(low)
    if not state.predivide:
        flat.div_(world)


def _sum_by_shards(low: torch.Tensor, world: int, all_to_all: Any, all_gather: Any) -> torch.Tensor:
    """The sum over ranks of `low` (a low-precision flat tensor), added in float32: Note [Low-precision
    wire with fp32 accumulation]. Returns a new tensor of low's size and dtype."""
    n = low.numel()
    shard = -(-n // world)
    padded = torch.zeros(shard * world, dtype=low.dtype, device=low.device)
    padded[:n] = low
    parts = torch.empty_like(padded)
    all_to_all(parts, padded)                       # parts[r * shard:...] = rank r's copy of my shard
    rows = parts.view(world, shard)
    acc = rows[0].to(torch.float32)
    for r in range(1, world):
        acc += rows[r]
    mine = acc.to(low.dtype)
    whole = torch.empty_like(padded)
    all_gather(whole, mine)
    return whole[:n]


def _cuda_average(state: HookState, buf: torch.Tensor) -> torch.futures.Future:
    # The engine, not DDP's group: See Note [The DDP hook's engine].
    group, world = state.engine, state.size
    flat = buf.view(-1)
    wire = state.wire
    if wire is None or wire == buf.dtype:
        op = dist.ReduceOp.SUM if state.predivide else dist.ReduceOp.AVG
        if state.predivide:
            flat.div_(world)
        work = dist.all_reduce(flat, op=op, group=group, async_op=True)
        return work.get_future().then(lambda _f: buf)
    low = (flat / world if state.predivide else flat).to(wire)

    def all_to_all(out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_to_all_single(out, inp, group=group, async_op=True).wait()   # orders the stream, no host wait

    works: list = []

    def all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        works.append(gather(out, inp, group=group, async_op=True))

    summed = _sum_by_shards(low, world, all_to_all, all_gather)

    def finish(_f: Any) -> torch.Tensor:
        flat.copy_(summed)
        if not state.predivide:
            flat.div_(world)
        return buf

    return works[0].get_future().then(finish)


def register(model: Any, *, wire: Any = None, predivide: Optional[bool] = None, timeout: Optional[float] = None) -> HookState:
    """Registers the hook on a DistributedDataParallel `model` (before its first backward, on every rank):
    buckets averaged through ncclavg, optionally on a bfloat16 / float16 wire with fp32 accumulation
    (Note [Low-precision wire with fp32 accumulation]). Returns the hook's state."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model: expected a torch DistributedDataParallel model, got {type(model).__name__}")
    state = HookState(getattr(model, "process_group", None), wire=wire, predivide=predivide, timeout=timeout)
    model.register_comm_hook(state, allreduce_hook)
    return state
