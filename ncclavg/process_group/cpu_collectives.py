"""The CPU collectives of the `ncclavg` torch.distributed backend (group.py), each the body of a job on
the group's runner (transport/runner.py): what is the same whatever moves the data (complex tensors as
real pairs, PREMUL_SUM's factor, which reduction a dtype and op need, the pieces of a list), then one
step asked of the group's implementations in order (transport/paths.py's `Paths`: the host channel,
then the inner gloo; Note [Implementations in order] and Note [Which CPU collectives take the channel]
there). Arguments arrive checked; every job carries the user's call (`job.call`, calls.py), which every
rank compares before any data is combined (Note [Every call compared] in paths.py).
AVG of float16 / bfloat16 sums an fp32 copy and divides before the one rounding (no overflow of the sum,
one rounding instead of two).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import ReduceOp

from ..transport.paths import GATHER_LIMIT, GLOO_FLOATS, Paths
from ..transport.reductions import R, as_bytes, premul_factor, red_kind
from ..transport.runner import Job

__all__ = ["CpuCollectives", "GATHER_LIMIT"]
HALF = (torch.float16, torch.bfloat16)


class CpuCollectives:
    """One group's CPU collectives: `transport` its host channel (or None), `gloo` its inner gloo backend."""

    def __init__(self, transport: Any, gloo: Any, rank: int, size: int):
        self.transport, self.gloo, self.rank, self.size = transport, gloo, rank, size
        self.paths = Paths(transport, gloo, rank, size)   # Note [Implementations in order]

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
        if t.dtype not in GLOO_FLOATS or kind not in (R.SUM, R.AVG):
            self.paths.reduce(job, flat, kind)
        elif kind == R.AVG and flat.dtype in HALF:   # an fp32 sum, one rounding
            acc = flat.to(torch.float32)
            self.paths.taking_sum(acc).sum(job, acc)
            flat.copy_(acc.div_(self.size))
            job.finite = None   # the rounding to 16 bits may overflow what the sum noted as finite
        else:   # the commonest call: its sum one frame down (Note [Frames of a call] in jobs.py)
            divisor = float(self.size) if kind == R.AVG else 1.0
            left = self.paths.taking_sum(flat).sum(job, flat, divisor)
            if left != 1.0:
                flat.div_(left)

    def sparse_allreduce(self, job: Job, t: torch.Tensor) -> None:
        """SUM of sparse COO tensors, as gloo's: every rank's indices and values gathered (padded to the
        largest count of nonzeros), the ranks' tensors added in rank order, `t` replaced by the sum."""
        s = t.coalesce()
        idx, val = s.indices(), s.values()
        nnz = idx.shape[1]
        counts = self.paths.rows(job, torch.tensor([nnz], dtype=torch.int64)).view(-1).tolist()
        most = max(counts)
        idx_pad = torch.zeros(idx.shape[0], most, dtype=torch.int64)
        idx_pad[:, :nnz] = idx
        val_pad = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
        val_pad[:nnz] = val
        idx_rows = self.paths.rows(job, idx_pad.reshape(-1)).view(self.size, idx.shape[0], most)
        val_rows = self.paths.rows(job, val_pad.reshape(-1)).view((self.size, most) + tuple(val.shape[1:]))
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
        if out.dtype in GLOO_FLOATS and kind in (R.SUM, R.AVG):
            o, i = out.view(-1), inp.reshape(-1)
            if kind == R.AVG and out.dtype in HALF:   # an fp32 sum, one rounding (see the module's doc)
                acc = torch.empty(o.numel(), dtype=torch.float32)
                self.paths.sum_scatter(job, acc, i.to(torch.float32))
                o.copy_(acc.div_(self.size))
                return
            left = self.paths.sum_scatter(job, o, i, float(self.size) if kind == R.AVG else 1.0)
            if left != 1.0:
                o.div_(left)
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
        self.paths.broadcast_bytes(job, as_bytes(t), root)

    def all_gather_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.paths.all_gather_bytes(job, as_bytes(out), as_bytes(inp))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        self.paths.allgather(job, outs, inp)

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        self.paths.gather(job, outs, inp, root)

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        self.paths.scatter(job, out, inputs, root)

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self.paths.alltoall_single(job, out, inp, out_splits, in_splits)

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self.paths.alltoall(job, outs, inputs)

    def barrier(self, job: Job) -> None:
        # a channel round of its own, or the gloo all-gather of the calls: both wait for every rank
        self.paths.check(job)


def _premultiply(t: torch.Tensor, factor: float) -> None:
    """t *= factor in place, rounded once (through float32 for the types torch cannot multiply, float8)."""
    if t.dtype in GLOO_FLOATS or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float32).mul_(factor))
