"""The CPU collectives of the `ncclavg` torch.distributed backend (torch_backend.py), each run on the
group's lane (backend_lane.py): through the host channel (shm.ShmTransport) where it has a path, through
the group's inner gloo backend otherwise. Arguments arrive checked.

Note [Which CPU collectives take the channel]
- SUM, AVG and PREMUL_SUM of float32, float64, float16 and bfloat16 (complex tensors as their real
  pairs): the channel's all_reduce_sum / reduce_scatter_sum, summed in rank order with fp32
  accumulation (the same bits on every rank). AVG of float16 / bfloat16 sums an fp32 copy and divides
  before the one rounding (no overflow of the sum, one rounding instead of two); float32 / float64 are
  summed in place and divided.
- Data movement (broadcast, all-gather, gather, scatter) of any dtype: the channel only copies bytes
  there, so a tensor of any dtype travels as its bytes viewed as float32 or float16 (through a padded
  copy when their count is odd).
- Integer and bool reductions, MIN, MAX, PRODUCT and the bitwise ops: every rank's input is gathered
  through the channel and reduced here, in rank order, when the gathered bytes stay under GATHER_LIMIT
  (integer sums wrap like gloo's; MIN, MAX and the bitwise ops are exact in any order; a bool SUM or MAX
  is an OR, PRODUCT or MIN an AND, as in gloo). Larger ones go through gloo.
- Without a channel (every process alone on its host, NCCLAVG_SHM=0), alltoall, a broadcast or scatter
  from a root other than 0 between hosts (the channel's several-hosts path broadcasts from rank 0),
  and sizes that differ across ranks: gloo.
"""
from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                                        BroadcastOptions, GatherOptions, ReduceOp, ReduceScatterOptions,
                                        ScatterOptions)

from . import shm
from .backend_lane import Job

GATHER_LIMIT = 16 << 20   # bytes: above, reductions the channel cannot sum go through gloo
# gloo has no kernels for these: reductions go through the next wider integer (the low bits of a wrapped
# sum, product, minimum or bitwise op are the same), data movement through the bytes
_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
R = ReduceOp.RedOpType
_SUMS = (R.SUM, R.AVG, R.PREMUL_SUM)
_HALF = (torch.float16, torch.bfloat16)


def red_kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp (or of a RedOpType)."""
    return getattr(op, "op", op)


def premul_factor(op: Any) -> float:
    f = op.factor
    return float(f.item() if isinstance(f, torch.Tensor) else f)


def _byte_wire(flat_bytes: torch.Tensor, unit: int = 0) -> torch.Tensor:
    """A channel-typed view of an even number of bytes: float32 when `unit` (default: their count) is a
    multiple of 4, else float16. A gather's input and output must be viewed alike: pass the input's count."""
    unit = unit or flat_bytes.numel()
    return flat_bytes.view(torch.float32) if unit % 4 == 0 else flat_bytes.view(torch.float16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class CpuCollectives:
    """One group's CPU collectives: `transport` its host channel (or None), `gloo` its inner gloo backend."""

    def __init__(self, transport: Any, gloo: Any, rank: int, size: int):
        self.transport, self.gloo, self.rank, self.size = transport, gloo, rank, size
        # Between hosts the channel broadcasts from rank 0 only (Note [Several hosts] in shm.py).
        self._any_root = transport is not None and transport.kind == "shm"
        # The channel's methods will take a per-call timeout; pass it as soon as they do.
        self._per_call = transport is not None and "timeout" in inspect.signature(transport.all_reduce_sum).parameters

    # ------------------------------------------------------------------ the channel's calls, waited
    def _channel(self, job: Job, method: str, *args: Any) -> None:
        fn = getattr(self.transport, method)
        work = fn(*args, sync=True, timeout=job.remaining()) if self._per_call else fn(*args, sync=True)
        work.wait(datetime.timedelta(seconds=job.remaining() + 1.0))

    def _sum(self, job: Job, t: torch.Tensor) -> None:
        self._channel(job, "all_reduce_sum", t)

    def _gather_into(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        """out_bytes (size x in_bytes, uint8) = every rank's in_bytes, in rank order, through the channel."""
        n = in_bytes.numel()
        if n % 2 == 0:
            self._channel(job, "all_gather", _byte_wire(out_bytes, n), _byte_wire(in_bytes))
            return
        padded = torch.zeros(n + 1, dtype=torch.uint8)
        padded[:n] = in_bytes
        rows = torch.empty(self.size * (n + 1), dtype=torch.uint8)
        self._channel(job, "all_gather", _byte_wire(rows, n + 1), _byte_wire(padded))
        out_bytes.view(self.size, n).copy_(rows.view(self.size, n + 1)[:, :n])

    def _broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        n = data.numel()
        if n % 2 == 0:
            self._channel(job, "broadcast", _byte_wire(data), root)
            return
        padded = torch.zeros(n + 1, dtype=torch.uint8)
        padded[:n] = data
        self._channel(job, "broadcast", _byte_wire(padded), root)
        data.copy_(padded[:n])

    def _rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        """(size, numel) tensor of every rank's `t`, through the channel."""
        out = torch.empty(self.size * t.numel() * t.element_size(), dtype=torch.uint8)
        self._gather_into(job, out, _bytes(t))
        return out.view(t.dtype).view(self.size, -1)

    def _gloo_op(self, job: Job, work: Any) -> None:
        job.wait_gloo(work)

    # ------------------------------------------------------------------ all-reduce and its relatives
    def allreduce(self, job: Job, t: torch.Tensor, op: Any) -> None:
        kind = red_kind(op)
        if t.numel() == 0:
            return
        if t.is_complex():   # SUM / AVG / PREMUL_SUM (torch refuses the others on complex tensors)
            self.allreduce(job, torch.view_as_real(t), op)
            return
        if kind == R.PREMUL_SUM:
            t.mul_(premul_factor(op))
            kind = R.SUM
        if t.is_floating_point() and kind in (R.SUM, R.AVG):
            if self.transport is not None and t.dtype in shm.TYPE_CODES:
                self._channel_sum(job, t, kind == R.AVG)
                return
            if self.transport is None:
                self._gloo_sum(job, t, kind == R.AVG)
                return
        if self.transport is not None and self.size * t.numel() * t.element_size() <= GATHER_LIMIT:
            t.copy_(reduce_rows(self._rows(job, t), kind, self.size).view_as(t))
            return
        self._gloo_allreduce(job, t, kind)

    def _channel_sum(self, job: Job, t: torch.Tensor, average: bool) -> None:
        flat = t.view(-1)
        if average and t.dtype in _HALF:
            acc = flat.to(torch.float32)
            self._sum(job, acc)
            flat.copy_(acc.div_(self.size))
            return
        self._sum(job, flat)
        if average:
            flat.div_(self.size)

    def _gloo_sum(self, job: Job, t: torch.Tensor, average: bool) -> None:
        if average and t.dtype in _HALF:
            acc = t.to(torch.float32)
            self._gloo_allreduce(job, acc, R.SUM)
            t.copy_(acc.div_(self.size))
            return
        self._gloo_allreduce(job, t, R.SUM)
        if average:
            t.div_(self.size)

    def _gloo_allreduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        if t.dtype in _GLOO_WIDER:
            wide = t.to(_GLOO_WIDER[t.dtype])
            self._gloo_allreduce(job, wide, kind)
            t.copy_(wide)
            return
        opts = AllreduceOptions()
        integer_avg = kind == R.AVG and not t.is_floating_point() and t.dtype != torch.bool
        opts.reduceOp = ReduceOp(R.SUM) if kind in (R.AVG, R.PREMUL_SUM) else ReduceOp(kind)   # bool: an OR
        self._gloo_op(job, self.gloo.allreduce([t], opts))
        if integer_avg:
            t.copy_(torch.div(t, self.size, rounding_mode="trunc"))

    def allreduce_coalesced(self, job: Job, tensors: List[torch.Tensor], op: Any) -> None:
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.allreduce(job, flat, op)
            pos = 0
            for t in group:
                t.view(-1).copy_(flat[pos:pos + t.numel()])
                pos += t.numel()

    def reduce(self, job: Job, t: torch.Tensor, root: int, op: Any) -> None:
        self.allreduce(job, t if self.rank == root else t.clone(), op)

    def reduce_scatter_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        kind = red_kind(op)
        if out.numel() == 0:
            return
        if out.is_complex():
            self.reduce_scatter_single(job, torch.view_as_real(out), torch.view_as_real(inp), op)
            return
        if kind == R.PREMUL_SUM:
            inp = inp * premul_factor(op)   # the caller's input stays as it is
            kind = R.SUM
        if out.is_floating_point() and out.dtype in shm.TYPE_CODES and kind in (R.SUM, R.AVG):
            o, i = out.view(-1), inp.reshape(-1)
            if kind == R.AVG and out.dtype in _HALF:   # an fp32 sum, one rounding (see the Note)
                acc = torch.empty(o.numel(), dtype=torch.float32)
                self._sum_scatter(job, acc, i.to(torch.float32))
                o.copy_(acc.div_(self.size))
                return
            self._sum_scatter(job, o, i)
            if kind == R.AVG:
                o.div_(self.size)
            return
        # anything else: the whole input all-reduced (by the rules above), this rank's slice kept
        whole = inp.reshape(-1).clone()
        self.allreduce(job, whole, ReduceOp(kind))
        n = out.numel()
        out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])

    def _sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.transport is not None:
            self._channel(job, "reduce_scatter_sum", out, inp)
            return
        opts = ReduceScatterOptions()
        opts.reduceOp = ReduceOp(R.SUM)
        self._gloo_op(job, self.gloo._reduce_scatter_base(out, inp, opts))

    def reduce_scatter(self, job: Job, out: torch.Tensor, inputs: List[torch.Tensor], op: Any) -> None:
        if all(x.numel() == out.numel() for x in inputs):
            self.reduce_scatter_single(job, out, torch.cat([x.reshape(-1) for x in inputs]), op)
            return
        # sizes that differ by rank: every slice all-reduced, this rank's kept
        for r, x in enumerate(inputs):
            whole = x.reshape(-1).clone()
            self.allreduce(job, whole, op)
            if r == self.rank:
                out.view(-1).copy_(whole)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, job: Job, t: torch.Tensor, root: int) -> None:
        if t.numel() == 0:
            return
        if self.transport is not None and (self._any_root or root == 0):
            self._broadcast_bytes(job, _bytes(t), root)
            return
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._gloo_op(job, self.gloo.broadcast([_bytes(t)], opts))

    def all_gather_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() == 0:
            return
        if self.transport is not None:
            self._gather_into(job, _bytes(out), _bytes(inp))
            return
        self._gloo_op(job, self.gloo._allgather_base(_bytes(out), _bytes(inp), AllgatherOptions()))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        if self.transport is None or any(o.numel() != inp.numel() for o in outs):
            self._gloo_op(job, self.gloo.allgather([[_bytes(o) for o in outs]], [_bytes(inp)], AllgatherOptions()))
            return
        rows = self._rows(job, inp) if inp.numel() else None
        for r, o in enumerate(outs):
            if rows is not None:
                o.view(-1).copy_(rows[r])

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        if self.transport is None:
            opts = GatherOptions()
            opts.rootRank = root
            self._gloo_op(job, self.gloo.gather([[_bytes(o) for o in outs]] if self.rank == root else [],
                                                [_bytes(inp)], opts))
            return
        rows = self._rows(job, inp) if inp.numel() else None
        if self.rank == root and rows is not None:
            for r, o in enumerate(outs):
                o.view(-1).copy_(rows[r])

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        if out.numel() == 0:
            return
        if self.transport is None or not (self._any_root or root == 0):
            opts = ScatterOptions()
            opts.rootRank = root
            self._gloo_op(job, self.gloo.scatter([_bytes(out)], [[_bytes(x) for x in inputs]]   # type: ignore[union-attr]
                                                 if self.rank == root else [], opts))
            return
        n = out.numel()
        if self.rank == root:
            whole = torch.cat([x.reshape(-1) for x in inputs])   # type: ignore[union-attr]
        else:
            whole = torch.empty(self.size * n, dtype=out.dtype)
        self._broadcast_bytes(job, _bytes(whole), root)
        out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self._gloo_op(job, self.gloo.alltoall_base(out, inp, out_splits, in_splits, AllToAllOptions()))

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self._gloo_op(job, self.gloo.alltoall(outs, inputs, AllToAllOptions()))

    def barrier(self, job: Job) -> None:
        if self.transport is not None:
            self._sum(job, torch.zeros(1))
            return
        self._gloo_op(job, self.gloo.barrier(BarrierOptions()))


def reduce_rows(rows: torch.Tensor, kind: Any, size: int) -> torch.Tensor:
    """rows (one per rank, rank order) reduced by `kind`, in rank order. See Note [Which CPU collectives
    take the channel]."""
    dtype = rows.dtype
    if dtype == torch.bool:
        if kind in (R.SUM, R.MAX, R.BOR, R.AVG):
            return rows.any(0)
        if kind in (R.PRODUCT, R.MIN, R.BAND):
            return rows.all(0)
        return functools.reduce(torch.bitwise_xor, list(rows))
    if kind in (R.SUM, R.AVG):
        acc = rows[0].clone()
        for r in rows[1:]:
            acc.add_(r)   # in the tensor's own dtype: integers wrap as gloo's do
        if kind == R.AVG:
            acc = acc.div_(size) if acc.is_floating_point() else torch.div(acc, size, rounding_mode="trunc")
        return acc
    if kind == R.MIN:
        return rows.amin(0)
    if kind == R.MAX:
        return rows.amax(0)
    if kind == R.PRODUCT:
        acc = rows[0].clone()
        for r in rows[1:]:
            acc.mul_(r)
        return acc
    ops = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}
    if kind in ops:
        if rows.is_floating_point():
            raise TypeError(f"op: {kind.name} needs an integer or bool tensor, got {dtype}")
        return functools.reduce(ops[kind], list(rows))
    raise ValueError(f"op: {kind} is not supported by the ncclavg backend on CPU tensors")
