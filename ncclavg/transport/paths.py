"""The ways a CPU collective step can move its data, for both faces: `ChannelPaths` through one host's
channel over the whole group (shm.ShmTransport), `HostsPaths` between hosts (each host's channel and the
lanes between them: ucx.UcxHostsTransport, else hosts.HostsTransport over gloo), `GlooPaths` through a
torch.distributed process group (gloo in practice), and `Paths`, which holds them in order and picks one
per step. Every step runs inside a runner's job (runner.py) and gets it: its one deadline, its call
compared across ranks.

Note [Implementations in order]
A collective does what is the same whatever moves the data (complex tensors as real pairs, PREMUL_SUM's
factor, which reduction a dtype and op need, the pieces of a list, a Communicator's towers), then asks
`Paths` for one primitive step: `sum`, `reduce`, `sum_scatter`, `all_gather_bytes`, `rows`,
`broadcast_bytes`, `allgather`, `gather`, `scatter`, `alltoall_single`, `alltoall`, `check`. Each of
those methods walks the same ordered list, the channel's or the hosts' implementation (when the group
has one), then gloo's, and runs the first that takes the arguments (its `takes_<step>`): gloo's takes
everything.
Adding a transport is adding an implementation to the list, not a branch to every collective (as
Horovod's operation_manager keeps an ordered list of implementations per operation).

Note [Which CPU collectives take the channel]
- SUM of float32, float64, float16 and bfloat16: the channel's all_reduce_sum / reduce_scatter_sum,
  summed in rank order with fp32 accumulation (the same bits on every rank). A division by the ranks or
  towers runs in the channel's pass where it can (one host's channel over every process: the same bits
  as a division after it); `sum` returns the division still to do.
- Data movement (broadcast, all-gather, gather, scatter) of any dtype: the channel only copies bytes
  there, so a tensor of any dtype travels as its bytes (reductions.byte_wire).
- Every other reduction (integers, bool, MIN, MAX, PRODUCT, the bitwise ops): every rank's input is
  gathered through the channel, in pieces of at most GATHER_LIMIT bytes, and reduced here in rank order
  (Note [Reductions of gathered rows] in reductions.py).
- Without a channel (NCCLAVG_SHM=0; every process alone on its host and no UCX lanes) and for alltoall:
  gloo. Between hosts a broadcast or scatter leaves from any root (HostsPaths.takes_root).
- Count 0 is a call like any other: it runs a round (or the check below), so that a rank whose tensor
  is empty cannot pair with its peers' next collective.

Note [Every call compared]
Ranks that called different collectives fail on every rank with both calls named, before any result is
written (Note [Call signatures] in csrc/transport/shm_calls.cpp): a channel step carries `job.call` in its
rounds' signatures; before a gloo step the call is compared by a round of its own (`check`: one channel
round on one host) or, without a channel, by one all-gather of three words over gloo (the torch face;
the public API's gloo path compares nothing: NCCLAVG_DEBUG's sequence check does). One comparison per
collective is enough: what it moves after that follows from the call and the arguments every rank
checked alike.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                        GatherOptions, ReduceOp, ScatterOptions)

from . import profiling
from .calls import exchange_record, fold_limit, folded
from .reductions import R, as_bytes, byte_wire, exact_mean, padded, reduce_rows, sum_in_order
from .runner import Job
from .shm import supports

GATHER_LIMIT = 16 << 20   # bytes gathered at once by a reduction the channel cannot sum (all ranks' rows)
# What gloo reduces natively (and the channel sums); the others go through a wider type or a bit view.
GLOO_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_GLOO_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _checked(job: Job) -> None:
    if job.call is not None:
        job.call.checked = True


class ChannelPaths:
    """The steps through one host's channel over every process of the group (`transport`: a
    shm.ShmTransport). Each primitive is handed the job: the channel's limit is the job's
    `channel_limit()` (the runner's watchdog ends the step at the job's deadline, the channel's own limit
    is the backstop: Note [One deadline per call] in runner.py) and the call its rounds compare."""

    # a sum is divided by the ranks or towers in the channel's own pass (the same bits as after it)
    divides = True

    def __init__(self, transport: Any, rank: int, size: int):
        self.transport, self.rank, self.size = transport, rank, size
        self.kind = transport.kind

    # ------------------------------------------------------------------ which steps it takes
    def takes_sum(self, t: torch.Tensor) -> bool:
        """The channel sums float32, float64, float16 and bfloat16, contiguous on the CPU."""
        return supports(t)

    def takes_root(self, root: int) -> bool:
        """Every process reads the root's slot: any root."""
        return True

    # ------------------------------------------------------------------ the steps
    def check(self, job: Job) -> None:
        """The ranks' calls compared by a round of their own (a barrier's whole work)."""
        call = job.call
        if call is None or call.checked:
            return
        with profiling.step(job, self.kind, "check"):
            self.transport.check(job)
        call.checked = True

    def sum(self, job: Job, flat: torch.Tensor, divisor: float = 1.0) -> float:
        """flat = the SUM over the ranks (a channel dtype), divided by `divisor` in the same pass where the
        channel can; returns the division still to do (1.0 or `divisor`)."""
        fused = divisor != 1.0 and self.divides
        with profiling.step(job, self.kind, "all_reduce_sum"):
            noted = self.transport.all_reduce_sum(flat, job, divisor if fused else 1.0, job.noting)
        # a division after it (by a count of ranks or towers, >= 1) keeps every value finite or not as it was
        job.finite = noted
        _checked(job)
        return 1.0 if fused else divisor

    def sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor, divisor: float = 1.0) -> float:
        """out = this rank's slice of the SUM over the ranks of inp; as `sum` for the division."""
        fused = divisor != 1.0 and self.divides
        with profiling.step(job, self.kind, "reduce_scatter_sum"):
            self.transport.reduce_scatter_sum(out, inp, job, divisor if fused else 1.0)
        _checked(job)
        return 1.0 if fused else divisor

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

    def all_gather_bytes(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        """out_bytes (size x in_bytes, uint8) = every rank's in_bytes, in rank order."""
        n = in_bytes.numel()
        if n % 2 == 0:
            self._all_gather(job, byte_wire(out_bytes, n), byte_wire(in_bytes, n))
            return
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = in_bytes
        rows = torch.empty(self.size * padded(n), dtype=torch.uint8)
        self._all_gather(job, byte_wire(rows, n), byte_wire(pad, n))
        out_bytes.view(self.size, n).copy_(rows.view(self.size, padded(n))[:, :n])

    def _all_gather(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        with profiling.step(job, self.kind, "all_gather"):
            self.transport.all_gather(out, inp, job)
        _checked(job)

    def all_gather_typed(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out = every rank's inp in rank order, for a channel dtype (no byte view needed)."""
        self._all_gather(job, out, inp)

    def rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        """(size, numel) tensor of every rank's `t`."""
        out = torch.empty(self.size * t.numel() * t.element_size(), dtype=torch.uint8)
        self.all_gather_bytes(job, out, as_bytes(t))
        return out.view(t.dtype).view(self.size, -1)

    def broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        n = data.numel()
        if n % 2 == 0:
            self._broadcast(job, byte_wire(data, n), root)
            return
        pad = torch.zeros(padded(n), dtype=torch.uint8)
        pad[:n] = data
        self._broadcast(job, byte_wire(pad, n), root)
        data.copy_(pad[:n])

    def _broadcast(self, job: Job, t: torch.Tensor, root: int) -> None:
        with profiling.step(job, self.kind, "broadcast"):
            self.transport.broadcast(t, root, job)
        _checked(job)

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        rows = self.rows(job, inp)
        for r, o in enumerate(outs):
            o.view(-1).copy_(rows[r])

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        rows = self.rows(job, inp)
        if self.rank == root:
            for r, o in enumerate(outs):
                o.view(-1).copy_(rows[r])

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        """The root's whole list broadcast, this rank's piece kept."""
        n = out.numel()
        if self.rank == root:
            whole = torch.cat([x.reshape(-1) for x in inputs])   # type: ignore[union-attr]
        else:
            whole = torch.empty(self.size * n, dtype=out.dtype)
        self.broadcast_bytes(job, as_bytes(whole), root)
        out.view(-1).copy_(whole[self.rank * n:(self.rank + 1) * n])


class HostsPaths(ChannelPaths):
    """The steps between hosts (`transport`: ucx.UcxHostsTransport, the core's lanes on UCX, "shm+ucx" /
    "ucx"; or hosts.HostsTransport, gloo's lanes, "shm+gloo"): each host's channel within it, the lanes
    between the hosts, one job's deadline over both (the transport derives every step's limit from the
    job). The same steps as one host's channel, and what they take:"""

    # the lanes add the hosts' sums in host order after the channel's; a division goes after them
    divides = False
    # takes_sum: ChannelPaths's (the lanes sum what the hosts' channels sum: the wire moves their dtypes)

    def takes_root(self, root: int) -> bool:
        """A broadcast leaves from any rank's host (the lanes' carriers there send its shards)."""
        return 0 <= root < self.size


class GlooPaths:
    """The steps through the torch.distributed process group `gloo` (its c10d methods: allreduce,
    _allgather_base, ...): every step, for any arguments. `compare`: compare the ranks' calls once per job
    (Note [Every call compared]): one channel round where the group has a channel, else the first exchange
    of the step, a record of fixed size that carries the call and, for a sum, its first data (Note [The
    check folded into the data] in calls.py)."""

    def __init__(self, gloo: Any, rank: int, size: int, channel: Optional[ChannelPaths], compare: bool = True):
        self.gloo, self.rank, self.size = gloo, rank, size
        self._channel = channel
        self._compare = compare

    def takes_sum(self, t: torch.Tensor) -> bool:
        return True

    def takes_root(self, root: int) -> bool:
        return True

    def check(self, job: Job) -> None:
        """The ranks' calls compared (a barrier's whole work, or before a step of gloo's)."""
        self._compared(job)

    def _compared(self, job: Job, payload: Optional[torch.Tensor] = None,
                  payloads: Optional[list] = None) -> Optional[list]:
        """Compares the job's call when it still has to be; the payloads the ranks sent this one when a
        record carried `payload` (or `payloads`, one per rank) (None when nothing was exchanged over gloo)."""
        call = job.call
        if call is None or call.checked or not self._compare:
            return None
        if self.size == 1:   # nothing to compare a call with
            call.checked = True
            return None
        if self._channel is not None:
            self._channel.check(job)
            return None
        with profiling.step(job, "gloo", "check"):
            return exchange_record(self.gloo, call, self.rank, self.size, job.remaining, payload,
                                   payloads=payloads)

    def _wait(self, job: Job, work: Any) -> None:
        # the wait only: gloo's work was issued by the caller's argument (and gloo records its own range,
        # `gloo:all_reduce`, on its thread when the issuing thread is profiled)
        with profiling.step(job, "gloo", job.call.collective if job.call is not None else "wait"):
            job.wait_gloo(work)

    # ------------------------------------------------------------------ reductions
    def sum(self, job: Job, t: torch.Tensor, divisor: float = 1.0) -> float:
        flat = t.view(-1)
        job.finite = None   # gloo's sum is not checked: the step's reader scans
        if self._scatter_sum(job, flat):
            return divisor
        done = self._fold_sum(job, flat)
        if flat.numel() > done:
            self._allreduce(job, flat[done:], R.SUM)
        return divisor

    def _scatter_sum(self, job: Job, flat: torch.Tensor) -> bool:
        """A sum over three ranks or more too large for one record, whose slices (one per rank) each fit
        one: the call's record is its reduce-scatter, carrying to each rank its slice of every rank's
        `flat`, which it adds in rank order; gloo's all-gather of the sums then gives every rank the same
        bits. Two exchanges, each moving (size-1)/size of the bytes, against the record and gloo's ring
        all-reduce's 2(size-1) dependent steps. (Between two ranks one record carries a sum twice this large
        whole.) False where it does not apply or no record is exchanged (the call compared already)."""
        size, n, esize = self.size, flat.numel(), flat.element_size()
        per = -(-n // size)
        limit = fold_limit(size)
        if size <= 2 or n * esize <= limit or per * esize > limit:
            return False
        pieces = torch.zeros(size * per, dtype=flat.dtype)   # the last rank's slice padded: all one length
        pieces[:n] = flat
        rows = self._compared(job, payloads=[as_bytes(p) for p in pieces.view(size, per)])
        if rows is None:
            return False
        mine = sum_in_order([r.view(flat.dtype) for r in rows])
        self._wait(job, self.gloo._allgather_base(as_bytes(pieces), as_bytes(mine), AllgatherOptions()))
        flat.copy_(pieces[:n])
        return True

    def _fold_sum(self, job: Job, flat: torch.Tensor) -> int:
        """The call's check, with `flat` summed in it when it goes over gloo (all of it where it fits the
        record, else its first FOLD_BYTES: `folded` in calls.py): the ranks' payloads added in rank order,
        accumulated wide and rounded once. Returns the number of leading elements done."""
        k = folded(flat, self.size)
        rows = self._compared(job, as_bytes(flat[:k]))
        if not rows or not k:
            return 0
        sum_in_order([r.view(flat.dtype) for r in rows], out=flat[:k])
        return k

    def _allreduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(kind)
        self._wait(job, self.gloo.allreduce([t], opts))

    def reduce(self, job: Job, t: torch.Tensor, kind: Any) -> None:
        self._compared(job)
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
                self._float_mean(job, t)
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
        self._allreduce(job, t, kind)

    def _float_mean(self, job: Job, t: torch.Tensor) -> None:
        """AVG of a floating tensor: float32 / float64 summed and divided; the others through an fp32 sum,
        one rounding."""
        if t.dtype in (torch.float32, torch.float64):
            self._allreduce(job, t, R.SUM)
            t.div_(self.size)
            return
        acc = t.to(torch.float32)
        self._reduce(job, acc, R.SUM)
        t.copy_(acc.div_(self.size))

    def _integer_mean(self, job: Job, t: torch.Tensor) -> None:
        """AVG of integers over gloo, exact (Note [Reductions of gathered rows]): up to 32 bits, an int64
        sum; int64 and uint64, the rows gathered piece by piece and averaged here."""
        if t.element_size() <= 4:
            total = t.to(torch.int64)
            self._allreduce(job, total, R.SUM)
            t.copy_(torch.div(total, self.size, rounding_mode="trunc"))
            return
        per = max(1, GATHER_LIMIT // (self.size * 8))
        for start in range(0, t.numel(), per):
            piece = t[start:start + per]
            rows = torch.empty(self.size * piece.numel(), dtype=torch.int64)
            self._wait(job, self.gloo._allgather_base(rows, piece.view(torch.int64), AllgatherOptions()))
            mean = exact_mean(rows.view(t.dtype).view(self.size, -1).numpy())
            piece.copy_(torch.from_numpy(mean))

    def sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor, divisor: float = 1.0) -> float:
        """Note [Reduce-scatter as all_to_all]: each rank's slice of every input with one all_to_all (the
        bytes of a reduce-scatter), summed here in rank order, accumulated wide and rounded once (the
        channel's arithmetic). torch's gloo reduce_scatter ignores Work.wait(timeout) (torch 2.13: a peer 5 s
        late holds a wait with a 1 s limit for the whole 5 s); all_to_all stops at the deadline. Slices that
        fit the call's record ride in it, each peer's its own: one exchange."""
        n = out.numel()
        w = n * out.element_size()
        fits = w <= fold_limit(self.size)
        whole = as_bytes(inp.reshape(-1))
        rows = self._compared(job, payloads=[whole[j * w:(j + 1) * w] for j in range(self.size)] if fits else None)
        if fits and rows is not None:
            if n:
                sum_in_order([r.view(out.dtype) for r in rows], out=out.view(-1))
            return divisor
        if n:
            pieces = torch.empty(self.size * out.numel(), dtype=out.dtype)
            self._wait(job, self.gloo.alltoall_base(pieces, inp.reshape(-1), [], [], AllToAllOptions()))
            sum_in_order(list(pieces.view(self.size, -1)), out=out.view(-1))
        return divisor

    # ------------------------------------------------------------------ data movement (as bytes: gloo lacks some dtypes)
    def all_gather_bytes(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        """An input that fits the call's record rides in it: one exchange."""
        fits = in_bytes.numel() <= fold_limit(self.size)
        rows = self._compared(job, in_bytes if fits else None)
        if fits and rows is not None:
            if in_bytes.numel():
                out_bytes.view(self.size, -1).copy_(torch.stack(rows))
            return
        if in_bytes.numel():
            self._wait(job, self.gloo._allgather_base(out_bytes, in_bytes, AllgatherOptions()))

    def all_gather_typed(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.all_gather_bytes(job, as_bytes(out), as_bytes(inp))

    def rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        rows = torch.empty(self.size * t.numel(), dtype=t.dtype)
        self.all_gather_bytes(job, as_bytes(rows), as_bytes(t))
        return rows.view(self.size, -1)

    def broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        """The call's check carries the root's data (all of it where it fits the record, else the first
        FOLD_BYTES: one exchange for a small broadcast, as for the sum); gloo's broadcast sends the rest."""
        k = folded(data, self.size)
        rows = self._compared(job, data[:k] if self.rank == root else data[:0])   # (the root's alone: needed)
        done = 0
        if rows and k:
            data[:k].copy_(rows[root])
            done = k
        if data.numel() > done:
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            self._wait(job, self.gloo.broadcast([data[done:]], opts))

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        self._compared(job)
        if inp.numel():
            self._wait(job, self.gloo.allgather([[as_bytes(o) for o in outs]], [as_bytes(inp)], AllgatherOptions()))

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        self._compared(job)
        if inp.numel():
            opts = GatherOptions()
            opts.rootRank = root
            self._wait(job, self.gloo.gather([[as_bytes(o) for o in outs]] if self.rank == root else [],
                                             [as_bytes(inp)], opts))

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        self._compared(job)
        if out.numel():
            opts = ScatterOptions()
            opts.rootRank = root
            self._wait(job, self.gloo.scatter([as_bytes(out)], [[as_bytes(x) for x in inputs]]   # type: ignore[union-attr]
                                              if self.rank == root else [], opts))

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self._compared(job)
        if out.numel() or inp.numel():   # splits count rows of dim 0
            row_out = out.element_size() * (out.numel() // out.shape[0] if out.shape[0] else 0)
            row_in = inp.element_size() * (inp.numel() // inp.shape[0] if inp.shape[0] else 0)
            self._wait(job, self.gloo.alltoall_base(as_bytes(out), as_bytes(inp), [s * row_out for s in out_splits],
                                                    [s * row_in for s in in_splits], AllToAllOptions()))

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self._compared(job)
        if any(t.numel() for t in list(outs) + list(inputs)):
            self._wait(job, self.gloo.alltoall([as_bytes(o) for o in outs], [as_bytes(i) for i in inputs],
                                               AllToAllOptions()))


class Paths:
    """One group's implementations of each step, in order (Note [Implementations in order]): one host's
    channel or the path between hosts when the group has one, then gloo's. Each method runs the first
    implementation that takes its arguments."""

    def __init__(self, transport: Any, gloo: Any, rank: int, size: int, compare: bool = True):
        self.channel: Optional[ChannelPaths] = None
        if transport is not None:
            self.channel = (HostsPaths if transport.between_hosts else ChannelPaths)(transport, rank, size)
        self.gloo = GlooPaths(gloo, rank, size, self.channel, compare)
        self.impls: List[Any] = ([self.channel] if self.channel is not None else []) + [self.gloo]

    def check(self, job: Job) -> None:
        self.impls[0].check(job)

    def taking_sum(self, flat: torch.Tensor) -> Any:
        """The first implementation that sums `flat` (gloo's takes every sum)."""
        for impl in self.impls:   # (a loop, not next(genexpr): this is on every small call's path)
            if impl.takes_sum(flat):
                return impl
        raise AssertionError("the gloo path takes every sum")

    def sum(self, job: Job, flat: torch.Tensor, divisor: float = 1.0) -> float:
        return self.taking_sum(flat).sum(job, flat, divisor)

    def sum_scatter(self, job: Job, out: torch.Tensor, inp: torch.Tensor, divisor: float = 1.0) -> float:
        impl = next(i for i in self.impls if i.takes_sum(out) and i.takes_sum(inp))
        return impl.sum_scatter(job, out, inp, divisor)

    def reduce(self, job: Job, flat: torch.Tensor, kind: Any) -> None:
        self.impls[0].reduce(job, flat, kind)

    def all_gather_bytes(self, job: Job, out_bytes: torch.Tensor, in_bytes: torch.Tensor) -> None:
        self.impls[0].all_gather_bytes(job, out_bytes, in_bytes)

    def all_gather_typed(self, job: Job, out: torch.Tensor, inp: torch.Tensor) -> None:
        impl = next(i for i in self.impls if i.takes_sum(out) and i.takes_sum(inp))
        impl.all_gather_typed(job, out, inp)

    def rows(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        return self.impls[0].rows(job, t)

    def broadcast_bytes(self, job: Job, data: torch.Tensor, root: int) -> None:
        for impl in self.impls:
            if impl.takes_root(root):
                return impl.broadcast_bytes(job, data, root)
        raise AssertionError("the gloo path takes every root")

    def allgather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor) -> None:
        self.impls[0].allgather(job, outs, inp)

    def gather(self, job: Job, outs: List[torch.Tensor], inp: torch.Tensor, root: int) -> None:
        self.impls[0].gather(job, outs, inp, root)

    def scatter(self, job: Job, out: torch.Tensor, inputs: Optional[List[torch.Tensor]], root: int) -> None:
        next(i for i in self.impls if i.takes_root(root)).scatter(job, out, inputs, root)

    def alltoall_single(self, job: Job, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int],
                        in_splits: List[int]) -> None:
        self.gloo.alltoall_single(job, out, inp, out_splits, in_splits)   # the channel has no all_to_all

    def alltoall(self, job: Job, outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> None:
        self.gloo.alltoall(job, outs, inputs)
