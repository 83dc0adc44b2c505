"""The CPU collectives of the `ncclavg` torch.distributed backend (group.py), each run on the
group's lane (lane.py): through the host channel (shm.ShmTransport) where it has a path, through
the group's inner gloo backend otherwise (the two implementations: cpu_paths.py). Arguments arrive
checked; every job carries the user's call (`job.call`, calls.py), which every rank compares before
any data is combined.

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

Note [Implementations in order]
The rules above are not branches in each collective. A collective here does what is the same whatever
moves the data (complex tensors as real pairs, PREMUL_SUM's factor, which reduction a dtype and op
need, the pieces of a list), then asks for one primitive step (`sum`, `reduce`, `sum_scatter`, `rows`,
`all_gather_bytes`, `broadcast_bytes`, `allgather`, `gather`, `scatter`, `alltoall(_single)`, `check`)
from the group's implementations in order: the channel's (when the group has one), then gloo's. The
first that has the step and does not answer NotImplemented for these arguments runs it. Adding a
transport is adding an implementation to the list, not a branch to every collective.

Note [Every call compared]
Ranks that called different collectives fail on every rank with both calls named, before any result is
written (Note [Call signatures] in csrc/transport/shm_calls.cpp): a channel step carries `job.call` in its
rounds' signatures; before a gloo step the call is compared by a round of its own (`transport.check`,
one channel round on one host) or, without a channel, by one all-gather of two words over gloo. One
comparison per collective is enough: what it moves after that follows from the call and the arguments
every rank checked alike.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import ReduceOp

from ..transport import shm
from .cpu_paths import GATHER_LIMIT, GLOO_FLOATS, HALF, ChannelPaths, GlooPaths
from .lane import Job
from .reductions import R, as_bytes, premul_factor, red_kind

__all__ = ["CpuCollectives", "GATHER_LIMIT"]


class CpuCollectives:
    """One group's CPU collectives: `transport` its host channel (or None), `gloo` its inner gloo backend."""

    def __init__(self, transport: Any, gloo: Any, rank: int, size: int):
        self.transport, self.gloo, self.rank, self.size = transport, gloo, rank, size
        channel = ChannelPaths(transport, rank, size) if transport is not None else None
        # Note [Implementations in order]
        self.paths: List[Any] = ([channel] if channel is not None else []) + [GlooPaths(gloo, rank, size, channel)]

    def _step(self, name: str, *args: Any) -> Any:
        """The primitive step `name` run by the first implementation that takes these arguments."""
        for impl in self.paths:
            fn = getattr(impl, name, None)
            if fn is not None:
                out = fn(*args)
                if out is not NotImplemented:
                    return out
        raise AssertionError(f"no implementation of {name!r}")   # gloo has every step

    # ------------------------------------------------------------------ all-reduce and its relatives
    def allreduce(self, job: Job, t: torch.Tensor, op: Any, finite: Optional[list] = None) -> None:
        """finite: a list that receives whether every value left in `t` is finite, where the pass that
        wrote them noted it (the one-host channel's sum; see ChannelPaths.sum), else stays empty."""
        kind = red_kind(op)
        if t.is_complex():   # SUM / AVG / PREMUL_SUM (torch refuses the others on complex tensors)
            self.allreduce(job, torch.view_as_real(t), op, finite)
            return
        if kind == R.PREMUL_SUM:
            _premultiply(t, premul_factor(op))
            kind = R.SUM
        flat = t.view(-1)
        if t.dtype in GLOO_FLOATS and kind in (R.SUM, R.AVG):
            self._step("sum", job, flat, kind == R.AVG, finite)
        else:
            self._step("reduce", job, flat, kind)

    def sparse_allreduce(self, job: Job, t: torch.Tensor) -> None:
        """SUM of sparse COO tensors, as gloo's: every rank's indices and values gathered (padded to the
        largest count of nonzeros), the ranks' tensors added in rank order, `t` replaced by the sum."""
        s = t.coalesce()
        idx, val = s.indices(), s.values()
        nnz = idx.shape[1]
        counts = self._step("rows", job, torch.tensor([nnz], dtype=torch.int64)).view(-1).tolist()
        most = max(counts)
        idx_pad = torch.zeros(idx.shape[0], most, dtype=torch.int64)
        idx_pad[:, :nnz] = idx
        val_pad = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
        val_pad[:nnz] = val
        idx_rows = self._step("rows", job, idx_pad.reshape(-1)).view(self.size, idx.shape[0], most)
        val_rows = self._step("rows", job, val_pad.reshape(-1)).view((self.size, most) + tuple(val.shape[1:]))
        total = None
        for r, n in enumerate(counts):
            part = torch.sparse_coo_tensor(idx_rows[r][:, :n], val_rows[r][:n], t.shape, check_invariants=True)
            total = part if total is None else total + part
        t.copy_(total.coalesce())

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
            self.barrier(job)

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
            if kind == R.AVG and out.dtype in HALF:   # an fp32 sum, one rounding (see the Note)
                acc = torch.empty(o.numel(), dtype=torch.float32)
                self._step("sum_scatter", job, acc, i.to(torch.float32))
                o.copy_(acc.div_(self.size))
                return
            self._step("sum_scatter", job, o, i, kind == R.AVG)
            return
        # anything else: the whole input all-reduced (by the rules above), this rank's slice kept
        whole = inp.reshape(-1).clone()
        self.allreduce(job, whole, ReduceOp(kind))
        n = out.numel()
        out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])

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
        self._step("broadcast_bytes", job, as_bytes(t), root)

    def all_gather_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._step("all_gather_bytes", job, as_bytes(out), as_bytes(inp))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        self._step("allgather", job, outs, inp)

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        self._step("gather", job, outs, inp, root)

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        self._step("scatter", job, out, inputs, root)

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self._step("alltoall_single", job, out, inp, out_splits, in_splits)

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self._step("alltoall", job, outs, inputs)

    def barrier(self, job: Job) -> None:
        # a channel round of its own, or the gloo all-gather of the calls: both wait for every rank
        self._step("check", job)


def _premultiply(t: torch.Tensor, factor: float) -> None:
    """t *= factor in place, rounded once (through float32 for the types torch cannot multiply, float8)."""
    if t.dtype in GLOO_FLOATS or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float32).mul_(factor))
