"""The CPU collectives of the `ncclavg` torch.distributed backend (group.py), each run on the
group's lane (lane.py): through the host channel (shm.ShmTransport) where it has a path, through
the group's inner gloo backend otherwise. Arguments arrive checked; every job carries the user's call
(`job.call`, calls.py), which every rank compares before any data is combined.

Note [Which CPU collectives take the channel]
- SUM, AVG and PREMUL_SUM of float32, float64, float16 and bfloat16 (complex tensors as their real
  pairs): the channel's all_reduce_sum / reduce_scatter_sum, summed in rank order with fp32
  accumulation (the same bits on every rank). AVG of float32 / float64 on one host divides in the
  channel's pass; AVG of float16 / bfloat16 sums an fp32 copy and divides before the one rounding (no
  overflow of the sum, one rounding instead of two).
- Data movement (broadcast, all-gather, gather, scatter) of any dtype: the channel only copies bytes
  there, so a tensor of any dtype travels as its bytes (reductions.byte_wire).
- Every other reduction (integers, bool, MIN, MAX, PRODUCT, the bitwise ops, sums of other floating
  types): every rank's input is gathered through the channel, in pieces of at most GATHER_LIMIT bytes
  gathered, and reduced here in rank order (Note [Reductions of gathered rows] in reductions.py).
- Without a channel (every process alone on its host, NCCLAVG_SHM=0), alltoall, a broadcast or scatter
  from a root other than 0 between hosts (the channel's several-hosts path broadcasts from rank 0), and
  lists whose sizes differ from rank to rank: gloo.
- Count 0 is a call like any other: it runs a round (or the check below), so that a rank whose tensor
  is empty cannot pair with its peers' next collective.

Note [Every call compared]
Ranks that called different collectives fail on every rank with both calls named, before any result is
written (Note [Call signatures] in csrc/transport/shm_calls.cpp): a channel step carries `job.call` in its
rounds' signatures; before a gloo step the call is compared by a round of its own (`transport.check`,
one channel round on one host) or, without a channel, by one all-gather of two words over gloo. One
comparison per collective is enough: what it moves after that follows from the call and the arguments
every rank checked alike.
"""
from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                        GatherOptions, ReduceOp, ReduceScatterOptions, ScatterOptions)

from ..transport import profiling, shm
from .lane import Job
from .reductions import R, as_bytes, byte_wire, exact_mean, padded, premul_factor, red_kind, reduce_rows
from ..transport.calls import check_over_gloo

GATHER_LIMIT = 16 << 20   # bytes gathered at once by a reduction the channel cannot sum (all ranks' rows)
_HALF = (torch.float16, torch.bfloat16)
# What gloo reduces natively; the others go through a wider type or a bit view (_gloo_allreduce).
_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_GLOO_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class CpuCollectives:
    """One group's CPU collectives: `transport` its host channel (or None), `gloo` its inner gloo backend."""

    def __init__(self, transport: Any, gloo: Any, rank: int, size: int):
        self.transport, self.gloo, self.rank, self.size = transport, gloo, rank, size
        # One host's channel over every process: any root broadcasts, and an average divides in the
        # channel's pass. Between hosts the channel broadcasts from rank 0 only (Note [Several hosts] in shm.py).
        self._one_host = transport is not None and transport.kind == "shm"

    # ------------------------------------------------------------------ steps
    def _channel(self, job: Job, method: str, *args: Any, **kwargs: Any) -> None:
        """One channel collective of this job; the lane's watchdog ends it at the job's deadline (Note
        [Per-collective deadlines] in lane.py), the channel's own limit is the backstop."""
        limit = job.channel_limit()
        with profiling.step(job, self.transport.kind, method):   # Note [Profiler ranges of a Python backend]
            work = getattr(self.transport, method)(*args, sync=True, timeout=limit, call=job.call, **kwargs)
            work.wait(datetime.timedelta(seconds=limit + 1.0))
        if job.call is not None:
            job.call.checked = True

    def _checked(self, job: Job) -> None:
        """Before a gloo step: the ranks' calls compared (Note [Every call compared])."""
        call = job.call
        if call is None or call.checked:
            return
        if self.size == 1:   # nothing to compare a call with
            call.checked = True
            return
        if self.transport is not None:
            limit = job.channel_limit()
            with profiling.step(job, self.transport.kind, "check"):
                work = self.transport.check(call, sync=True, timeout=limit)
                work.wait(datetime.timedelta(seconds=limit + 1.0))
            call.checked = True
        else:
            with profiling.step(job, "gloo", "check"):
                check_over_gloo(self.gloo, call, self.rank, self.size, job.remaining())

    def _gloo(self, job: Job, work: Any) -> None:
        # the wait only: gloo's work was issued by the caller's argument (and gloo records its own range,
        # `gloo:all_reduce`, on its thread when the issuing thread is profiled)
        with profiling.step(job, "gloo", job.call.collective if job.call is not None else "wait"):
            job.wait_gloo(work)

    def _gather_into(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        """out_bytes (size x in_bytes, uint8) = every rank's in_bytes, in rank order, through the channel."""
        n = in_bytes.numel()
        if n % 2 == 0:
            self._channel(job, "all_gather", byte_wire(out_bytes, n), byte_wire(in_bytes, n))
            return
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = in_bytes
        rows = torch.empty(self.size * padded(n), dtype=torch.uint8)
        self._channel(job, "all_gather", byte_wire(rows, n), byte_wire(pad, n))
        out_bytes.view(self.size, n).copy_(rows.view(self.size, padded(n))[:, :n])

    def _broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        n = data.numel()
        if n % 2 == 0:
            self._channel(job, "broadcast", byte_wire(data, n), root)
            return
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = data
        self._channel(job, "broadcast", byte_wire(pad, n), root)
        data.copy_(pad[:n])

    def _rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        """(size, numel) tensor of every rank's `t`, through the channel."""
        out = torch.empty(self.size * t.numel() * t.element_size(), dtype=torch.uint8)
        self._gather_into(job, out, as_bytes(t))
        return out.view(t.dtype).view(self.size, -1)

    # ------------------------------------------------------------------ all-reduce and its relatives
    def allreduce(self, job: Job, t: torch.Tensor, op: Any) -> None:
        kind = red_kind(op)
        if t.is_complex():   # SUM / AVG / PREMUL_SUM (torch refuses the others on complex tensors)
            self.allreduce(job, torch.view_as_real(t), op)
            return
        if kind == R.PREMUL_SUM:
            _premultiply(t, premul_factor(op))
            kind = R.SUM
        flat = t.view(-1)
        if t.dtype in _GLOO_FLOATS and kind in (R.SUM, R.AVG):
            if self.transport is not None:
                self._channel_sum(job, flat, kind == R.AVG)
            else:
                self._checked(job)
                if flat.numel():
                    self._gloo_sum(job, flat, kind == R.AVG)
            return
        if self.transport is not None:
            self._reduce_gathered(job, flat, kind)
            return
        self._checked(job)
        if flat.numel():
            self._gloo_allreduce(job, flat, kind)

    def _channel_sum(self, job: Job, flat: torch.Tensor, average: bool) -> None:
        if average and flat.dtype in _HALF:
            acc = flat.to(torch.float32)
            self._channel(job, "all_reduce_sum", acc)
            flat.copy_(acc.div_(self.size))
        elif average and self._one_host:   # the division in the channel's pass: the same bits as div_ after it
            self._channel(job, "all_reduce_sum", flat, divisor=float(self.size))
        else:
            self._channel(job, "all_reduce_sum", flat)
            if average:
                flat.div_(self.size)

    def _reduce_gathered(self, job: Job, flat: torch.Tensor, kind: Any) -> None:
        """Every rank's `flat` gathered through the channel, piece by piece, and reduced here."""
        per = max(1, GATHER_LIMIT // (self.size * flat.element_size()))
        start = 0
        while True:   # at least once: a count-0 call runs its round too
            piece = flat[start:start + per]
            rows = self._rows(job, piece)
            if piece.numel():
                piece.copy_(reduce_rows(rows, kind, self.size))
            start += per
            if start >= flat.numel():
                return

    def _gloo_sum(self, job: Job, t: torch.Tensor, average: bool) -> None:
        if average and t.dtype not in (torch.float32, torch.float64):   # an fp32 sum, one rounding
            acc = t.to(torch.float32)
            self._gloo_allreduce(job, acc, R.SUM)
            t.copy_(acc.div_(self.size))
            return
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(R.SUM)
        self._gloo(job, self.gloo.allreduce([t], opts))
        if average:
            t.div_(self.size)

    def _gloo_allreduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        """In place over gloo, for the dtypes gloo lacks through a wider type or a bit view."""
        if t.dtype == torch.bool:   # as uint8: OR is MAX, AND is MIN (Note [Reductions of gathered rows])
            as_int = t.to(torch.uint8)
            bool_op = {R.SUM: R.MAX, R.AVG: R.MAX, R.BOR: R.MAX, R.MAX: R.MAX, R.PRODUCT: R.MIN, R.MIN: R.MIN,
                       R.BAND: R.MIN}
            self._gloo_allreduce(job, as_int, bool_op.get(kind, kind))
            t.copy_(as_int.bool() if kind != R.BXOR else (as_int & 1).bool())
            return
        if kind == R.AVG:
            if t.is_floating_point():
                self._gloo_sum(job, t, True)
            else:
                self._gloo_integer_mean(job, t)
            return
        if t.dtype in _GLOO_WIDER:
            wide = t.to(_GLOO_WIDER[t.dtype])
            self._gloo_allreduce(job, wide, kind)
            t.copy_(wide)   # the low bits: a wrapped sum or product, an exact MIN, MAX or bitwise op
            return
        if t.dtype == torch.uint64:   # as int64 bits; MIN / MAX with the sign bit flipped keep the order
            bits = t.view(torch.int64)
            flip = kind in (R.MIN, R.MAX)
            if flip:
                bits.bitwise_xor_(torch.iinfo(torch.int64).min)
            self._gloo_allreduce(job, bits, kind)
            if flip:
                bits.bitwise_xor_(torch.iinfo(torch.int64).min)
            return
        if t.is_floating_point() and t.dtype not in _GLOO_FLOATS:   # float8: through float32, one rounding
            wide = t.to(torch.float32)
            self._gloo_allreduce(job, wide, kind)
            t.copy_(wide)
            return
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(kind)
        self._gloo(job, self.gloo.allreduce([t], opts))

    def _gloo_integer_mean(self, job: Job, t: torch.Tensor) -> None:
        """AVG of integers over gloo, exact (Note [Reductions of gathered rows]): up to 32 bits, an int64
        sum; int64 and uint64, the rows gathered piece by piece and averaged here."""
        if t.element_size() <= 4:
            total = t.to(torch.int64)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp(R.SUM)
            self._gloo(job, self.gloo.allreduce([total], opts))
            t.copy_(torch.div(total, self.size, rounding_mode="trunc"))
            return
        per = max(1, GATHER_LIMIT // (self.size * 8))
        for start in range(0, t.numel(), per):
            piece = t[start:start + per]
            rows = torch.empty(self.size * piece.numel(), dtype=torch.int64)
            self._gloo(job, self.gloo._allgather_base(rows, piece.view(torch.int64), AllgatherOptions()))
            mean = exact_mean(rows.view(t.dtype).view(self.size, -1).numpy())
            piece.copy_(torch.from_numpy(mean))

    def sparse_allreduce(self, job: Job, t: torch.Tensor) -> None:
        """SUM of sparse COO tensors, as gloo's: every rank's indices and values gathered (padded to the
        largest count of nonzeros), the ranks' tensors added in rank order, `t` replaced by the sum."""
        s = t.coalesce()
        idx, val = s.indices(), s.values()
        nnz = idx.shape[1]
        counts = self._gather_rows(job, torch.tensor([nnz], dtype=torch.int64)).view(-1).tolist()
        most = max(counts)
        idx_pad = torch.zeros(idx.shape[0], most, dtype=torch.int64)
        idx_pad[:, :nnz] = idx
        val_pad = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
        val_pad[:nnz] = val
        idx_rows = self._gather_rows(job, idx_pad.reshape(-1)).view(self.size, idx.shape[0], most)
        val_rows = self._gather_rows(job, val_pad.reshape(-1)).view((self.size, most) + tuple(val.shape[1:]))
        total = None
        for r, n in enumerate(counts):
            part = torch.sparse_coo_tensor(idx_rows[r][:, :n], val_rows[r][:n], t.shape, check_invariants=True)
            total = part if total is None else total + part
        t.copy_(total.coalesce())

    def _gather_rows(self, job: Job, flat: torch.Tensor) -> torch.Tensor:
        """(size, numel) of every rank's flat tensor (the same size on every rank), through the channel or gloo."""
        if self.transport is not None:
            return self._rows(job, flat)
        self._checked(job)
        rows = torch.empty(self.size * flat.numel(), dtype=flat.dtype)
        if flat.numel():
            self._gloo(job, self.gloo._allgather_base(as_bytes(rows), as_bytes(flat), AllgatherOptions()))
        return rows.view(self.size, -1)

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
        if not by_dtype:
            self._checked(job)

    def reduce(self, job: Job, t: torch.Tensor, root: int, op: Any) -> None:
        self.allreduce(job, t if self.rank == root else t.clone(), op)

    def reduce_scatter_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        kind = red_kind(op)
        if out.is_complex():
            self.reduce_scatter_single(job, torch.view_as_real(out), torch.view_as_real(inp), op)
            return
        if kind == R.PREMUL_SUM:
            inp = inp.clone()   # the caller's input stays as it is
            _premultiply(inp, premul_factor(op))
            kind = R.SUM
        if out.dtype in shm.TYPE_CODES and kind in (R.SUM, R.AVG):
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
        self._checked(job)
        if out.numel():
            opts = ReduceScatterOptions()
            opts.reduceOp = ReduceOp(R.SUM)
            self._gloo(job, self.gloo._reduce_scatter_base(out, inp, opts))

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
        if self.transport is not None and (self._one_host or root == 0):
            self._broadcast_bytes(job, as_bytes(t), root)
            return
        self._checked(job)
        if t.numel():
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            self._gloo(job, self.gloo.broadcast([as_bytes(t)], opts))

    def all_gather_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.transport is not None:
            self._gather_into(job, as_bytes(out), as_bytes(inp))
            return
        self._checked(job)
        if inp.numel():
            self._gloo(job, self.gloo._allgather_base(as_bytes(out), as_bytes(inp), AllgatherOptions()))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        if self.transport is not None:
            rows = self._rows(job, inp)
            for r, o in enumerate(outs):
                o.view(-1).copy_(rows[r])
            return
        self._checked(job)
        if inp.numel():
            self._gloo(job, self.gloo.allgather([[as_bytes(o) for o in outs]], [as_bytes(inp)], AllgatherOptions()))

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        if self.transport is not None:
            rows = self._rows(job, inp)
            if self.rank == root:
                for r, o in enumerate(outs):
                    o.view(-1).copy_(rows[r])
            return
        self._checked(job)
        if inp.numel():
            opts = GatherOptions()
            opts.rootRank = root
            self._gloo(job, self.gloo.gather([[as_bytes(o) for o in outs]] if self.rank == root else [],
                                             [as_bytes(inp)], opts))

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        n = out.numel()
        if self.transport is not None and (self._one_host or root == 0):
            if self.rank == root:
                whole = torch.cat([x.reshape(-1) for x in inputs])   # type: ignore[union-attr]
            else:
                whole = torch.empty(self.size * n, dtype=out.dtype)
            self._broadcast_bytes(job, as_bytes(whole), root)
            out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])
            return
        self._checked(job)
        if n:
            opts = ScatterOptions()
            opts.rootRank = root
            self._gloo(job, self.gloo.scatter([as_bytes(out)], [[as_bytes(x) for x in inputs]]   # type: ignore[union-attr]
                                              if self.rank == root else [], opts))

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self._checked(job)
        if out.numel() or inp.numel():   # as bytes (gloo lacks some dtypes); splits count rows of dim 0
            row_out = out.element_size() * (out.numel() // out.shape[0] if out.shape[0] else 0)
            row_in = inp.element_size() * (inp.numel() // inp.shape[0] if inp.shape[0] else 0)
            self._gloo(job, self.gloo.alltoall_base(as_bytes(out), as_bytes(inp), [s * row_out for s in out_splits],
                                                    [s * row_in for s in in_splits], AllToAllOptions()))

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self._checked(job)
        if any(t.numel() for t in list(outs) + list(inputs)):   # as bytes: gloo lacks some dtypes
            self._gloo(job, self.gloo.alltoall([as_bytes(o) for o in outs], [as_bytes(i) for i in inputs],
                                               AllToAllOptions()))

    def barrier(self, job: Job) -> None:
        # a channel round of its own, or the gloo all-gather of the calls: both wait for every rank
        self._checked(job)


def _premultiply(t: torch.Tensor, factor: float) -> None:
    """t *= factor in place, rounded once (through float32 for the types torch cannot multiply, float8)."""
    if t.dtype in _GLOO_FLOATS or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float32).mul_(factor))
