"""The two ways a CPU collective of the `ncclavg` backend can move its data, tried in order by
cpu_collectives.py (Note [Implementations in order] there): `ChannelPaths` through the group's host
channel (shm.ShmTransport), `GlooPaths` through its inner gloo backend. Both offer the same primitive
steps under the same names; a step the channel has no path for is absent from ChannelPaths or returns
NotImplemented for the arguments it cannot take, and the next implementation runs it. Every step gets
the lane's job (its deadline, its call compared across ranks: Note [Every call compared]).
"""
from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                        GatherOptions, ReduceOp, ReduceScatterOptions, ScatterOptions)

from ..transport import profiling
from ..transport.calls import check_over_gloo
from .lane import Job
from .reductions import R, as_bytes, byte_wire, exact_mean, padded, reduce_rows

GATHER_LIMIT = 16 << 20   # bytes gathered at once by a reduction the channel cannot sum (all ranks' rows)
HALF = (torch.float16, torch.bfloat16)
# What gloo reduces natively; the others go through a wider type or a bit view (GlooPaths.reduce).
GLOO_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


class ChannelPaths:
    """The steps through the host channel `transport` ("shm": one host; "shm+gloo": a channel per host)."""

    def __init__(self, transport: Any, rank: int, size: int):
        self.transport, self.rank, self.size = transport, rank, size
        # One host's channel over every process: any root broadcasts, and an average divides in the
        # channel's pass. Between hosts the channel broadcasts from rank 0 only (Note [Several hosts] in shm.py).
        self._one_host = transport.kind == "shm"

    def _run(self, job: Job, method: str, *args: Any, **kwargs: Any) -> None:
        """One channel collective of this job; the lane's watchdog ends it at the job's deadline (Note
        [Per-collective deadlines] in lane.py), the channel's own limit is the backstop."""
        limit = job.channel_limit()
        with profiling.step(job, self.transport.kind, method):   # Note [Profiler ranges of a Python backend]
            work = getattr(self.transport, method)(*args, sync=True, timeout=limit, call=job.call, **kwargs)
            work.wait(datetime.timedelta(seconds=limit + 1.0))
        if job.call is not None:
            job.call.checked = True

    def check(self, job: Job) -> None:
        """The ranks' calls compared by a round of their own (a barrier's whole work)."""
        call = job.call
        if call is None or call.checked:
            return
        limit = job.channel_limit()
        with profiling.step(job, self.transport.kind, "check"):
            work = self.transport.check(call, sync=True, timeout=limit)
            work.wait(datetime.timedelta(seconds=limit + 1.0))
        call.checked = True

    # ------------------------------------------------------------------ reductions
    def sum(self, job: Job, flat: torch.Tensor, average: bool, finite: Optional[list] = None) -> None:
        """flat = the SUM (or AVG) over the ranks of a float32 / float64 / float16 / bfloat16 tensor.
        finite: receives the one-host channel's check of its sum where that sum writes the result (Note
        [Finiteness from the pass that writes] in csrc/common/finite_math.h); stays empty otherwise."""
        if average and flat.dtype in HALF:   # an fp32 sum, one rounding
            acc = flat.to(torch.float32)
            self._run(job, "all_reduce_sum", acc)
            flat.copy_(acc.div_(self.size))
        elif average and self._one_host:   # the division in the channel's pass: the same bits as div_ after it
            self._run(job, "all_reduce_sum", flat, divisor=float(self.size), finite=finite)
        else:
            self._run(job, "all_reduce_sum", flat, finite=None if average else finite)
            if average:
                flat.div_(self.size)

    def reduce(self, job: Job, flat: torch.Tensor, kind: Any) -> None:
        """Any other reduction: every rank's `flat` gathered piece by piece and reduced here, in rank order."""
        per = max(1, GATHER_LIMIT // (self.size * flat.element_size()))
        start = 0
        while True:   # at least once: a count-0 call runs its round too
            piece = flat[start:start + per]
            rows = self.rows(job, piece)
            if piece.numel():
                piece.copy_(reduce_rows(rows, kind, self.size))
            start += per
            if start >= flat.numel():
                return

    def sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor, average: bool = False) -> None:
        """out = this rank's slice of the SUM (or AVG: float32 / float64) over the ranks of inp."""
        if average and self._one_host:   # the division in the channel's pass: the same bits as div_ after it
            self._run(job, "reduce_scatter_sum", out, inp, divisor=float(self.size))
            return
        self._run(job, "reduce_scatter_sum", out, inp)
        if average:
            out.div_(self.size)

    # ------------------------------------------------------------------ data movement (bytes)
    def all_gather_bytes(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        """out_bytes (size x in_bytes, uint8) = every rank's in_bytes, in rank order."""
        n = in_bytes.numel()
        if n % 2 == 0:
            self._run(job, "all_gather", byte_wire(out_bytes, n), byte_wire(in_bytes, n))
            return
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = in_bytes
        rows = torch.empty(self.size * padded(n), dtype=torch.uint8)
        self._run(job, "all_gather", byte_wire(rows, n), byte_wire(pad, n))
        out_bytes.view(self.size, n).copy_(rows.view(self.size, padded(n))[:, :n])

    def rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        """(size, numel) tensor of every rank's `t`."""
        out = torch.empty(self.size * t.numel() * t.element_size(), dtype=torch.uint8)
        self.all_gather_bytes(job, out, as_bytes(t))
        return out.view(t.dtype).view(self.size, -1)

    def broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> Any:
        if not (self._one_host or root == 0):
            return NotImplemented
        n = data.numel()
        if n % 2 == 0:
            self._run(job, "broadcast", byte_wire(data, n), root)
            return None
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = data
        self._run(job, "broadcast", byte_wire(pad, n), root)
        data.copy_(pad[:n])
        return None

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        rows = self.rows(job, inp)
        for r, o in enumerate(outs):
            o.view(-1).copy_(rows[r])

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        rows = self.rows(job, inp)
        if self.rank == root:
            for r, o in enumerate(outs):
                o.view(-1).copy_(rows[r])

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> Any:
        """The root's whole list broadcast, this rank's piece kept."""
        if not (self._one_host or root == 0):
            return NotImplemented
        n = out.numel()
        if self.rank == root:
            whole = torch.cat([x.reshape(-1) for x in inputs])   # type: ignore[union-attr]
        else:
            whole = torch.empty(self.size * n, dtype=out.dtype)
        self.broadcast_bytes(job, as_bytes(whole), root)
        out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])
        return None


class GlooPaths:
    """The steps through the group's inner gloo backend: every step, for any arguments. The ranks'
    calls are compared before the first one (`check`), since gloo moves bytes without comparing."""

    def __init__(self, gloo: Any, rank: int, size: int, channel: Optional[ChannelPaths]):
        self.gloo, self.rank, self.size = gloo, rank, size
        self._channel = channel   # compares the calls in one channel round where there is one

    def check(self, job: Job) -> None:
        """The ranks' calls compared before a gloo step (Note [Every call compared])."""
        call = job.call
        if call is None or call.checked:
            return
        if self.size == 1:   # nothing to compare a call with
            call.checked = True
        elif self._channel is not None:
            self._channel.check(job)
        else:
            with profiling.step(job, "gloo", "check"):
                check_over_gloo(self.gloo, call, self.rank, self.size, job.remaining())

    def _wait(self, job: Job, work: Any) -> None:
        # the wait only: gloo's work was issued by the caller's argument (and gloo records its own range,
        # `gloo:all_reduce`, on its thread when the issuing thread is profiled)
        with profiling.step(job, "gloo", job.call.collective if job.call is not None else "wait"):
            job.wait_gloo(work)

    # ------------------------------------------------------------------ reductions
    def sum(self, job: Job, t: torch.Tensor, average: bool, finite: Optional[list] = None) -> None:
        """`finite` stays empty: gloo's sum is not checked."""
        self.check(job)
        if t.numel():
            self._sum(job, t, average)

    def _sum(self, job: Job, t: torch.Tensor, average: bool) -> None:
        if average and t.dtype not in (torch.float32, torch.float64):   # an fp32 sum, one rounding
            acc = t.to(torch.float32)
            self._reduce(job, acc, R.SUM)
            t.copy_(acc.div_(self.size))
            return
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(R.SUM)
        self._wait(job, self.gloo.allreduce([t], opts))
        if average:
            t.div_(self.size)

    def reduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        self.check(job)
        if t.numel():
            self._reduce(job, t, kind)

    def _reduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        """In place over gloo, for the dtypes gloo lacks through a wider type or a bit view."""
        if t.dtype == torch.bool:   # as uint8: OR is MAX, AND is MIN (Note [Reductions of gathered rows])
            as_int = t.to(torch.uint8)
            bool_op = {R.SUM: R.MAX, R.AVG: R.MAX, R.BOR: R.MAX, R.MAX: R.MAX, R.PRODUCT: R.MIN, R.MIN: R.MIN,
                       R.BAND: R.MIN}
            self._reduce(job, as_int, bool_op.get(kind, kind))
            t.copy_(as_int.bool() if kind != R.BXOR else (as_int & 1).bool())
            return
        if kind == R.AVG:
            if t.is_floating_point():
                self._sum(job, t, True)
            else:
                self._integer_mean(job, t)
            return
        if t.dtype in _GLOO_WIDER:
            wide = t.to(_GLOO_WIDER[t.dtype])
            self._reduce(job, wide, kind)
            t.copy_(wide)   # the low bits: a wrapped sum or product, an exact MIN, MAX or bitwise op
            return
        if t.dtype == torch.uint64:   # as int64 bits; MIN / MAX with the sign bit flipped keep the order
            bits = t.view(torch.int64)
            flip = kind in (R.MIN, R.MAX)
            if flip:
                bits.bitwise_xor_(torch.iinfo(torch.int64).min)
            self._reduce(job, bits, kind)
            if flip:
                bits.bitwise_xor_(torch.iinfo(torch.int64).min)
            return
        if t.is_floating_point() and t.dtype not in GLOO_FLOATS:   # float8: through float32, one rounding
            wide = t.to(torch.float32)
            self._reduce(job, wide, kind)
            t.copy_(wide)
            return
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(kind)
        self._wait(job, self.gloo.allreduce([t], opts))

    def _integer_mean(self, job: Job, t: torch.Tensor) -> None:
        """AVG of integers over gloo, exact (Note [Reductions of gathered rows]): up to 32 bits, an int64
        sum; int64 and uint64, the rows gathered piece by piece and averaged here."""
        if t.element_size() <= 4:
            total = t.to(torch.int64)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp(R.SUM)
            self._wait(job, self.gloo.allreduce([total], opts))
            t.copy_(torch.div(total, self.size, rounding_mode="trunc"))
            return
        per = max(1, GATHER_LIMIT // (self.size * 8))
        for start in range(0, t.numel(), per):
            piece = t[start:start + per]
            rows = torch.empty(self.size * piece.numel(), dtype=torch.int64)
            self._wait(job, self.gloo._allgather_base(rows, piece.view(torch.int64), AllgatherOptions()))
            mean = exact_mean(rows.view(t.dtype).view(self.size, -1).numpy())
            piece.copy_(torch.from_numpy(mean))

    def sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor, average: bool = False) -> None:
        self.check(job)
        if out.numel():
            opts = ReduceScatterOptions()
            opts.reduceOp = ReduceOp(R.SUM)
            self._wait(job, self.gloo._reduce_scatter_base(out, inp, opts))
            if average:
                out.div_(self.size)

    # ------------------------------------------------------------------ data movement (as bytes: gloo lacks some dtypes)
    def all_gather_bytes(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        self.check(job)
        if in_bytes.numel():
            self._wait(job, self.gloo._allgather_base(out_bytes, in_bytes, AllgatherOptions()))

    def rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        rows = torch.empty(self.size * t.numel(), dtype=t.dtype)
        self.all_gather_bytes(job, as_bytes(rows), as_bytes(t))
        return rows.view(self.size, -1)

    def broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        self.check(job)
        if data.numel():
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            self._wait(job, self.gloo.broadcast([data], opts))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        self.check(job)
        if inp.numel():
            self._wait(job, self.gloo.allgather([[as_bytes(o) for o in outs]], [as_bytes(inp)], AllgatherOptions()))

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        self.check(job)
        if inp.numel():
            opts = GatherOptions()
            opts.rootRank = root
            self._wait(job, self.gloo.gather([[as_bytes(o) for o in outs]] if self.rank == root else [],
                                             [as_bytes(inp)], opts))

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        self.check(job)
        if out.numel():
            opts = ScatterOptions()
            opts.rootRank = root
            self._wait(job, self.gloo.scatter([as_bytes(out)], [[as_bytes(x) for x in inputs]]   # type: ignore[union-attr]
                                              if self.rank == root else [], opts))

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self.check(job)
        if out.numel() or inp.numel():   # splits count rows of dim 0
            row_out = out.element_size() * (out.numel() // out.shape[0] if out.shape[0] else 0)
            row_in = inp.element_size() * (inp.numel() // inp.shape[0] if inp.shape[0] else 0)
            self._wait(job, self.gloo.alltoall_base(as_bytes(out), as_bytes(inp), [s * row_out for s in out_splits],
                                                    [s * row_in for s in in_splits], AllToAllOptions()))

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self.check(job)
        if any(t.numel() for t in list(outs) + list(inputs)):
            self._wait(job, self.gloo.alltoall([as_bytes(o) for o in outs], [as_bytes(i) for i in inputs],
                                               AllToAllOptions()))
