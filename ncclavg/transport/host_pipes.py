"""The pipelines of the collectives between hosts (Note [Several hosts] in hosts.py): each cuts its data in
chunks and keeps DEPTH of them in flight, so that a chunk's steps within the hosts run while the chunks
before and after it are on the wire. `Pipe`: the all-reduce's sum and the broadcast, chunks of the tensor;
`SlicePipe`: the reduce-scatter and the all-gather, chunks of every rank's slice at once. They drive a
`HostsTransport` (hosts.py) through its public parts: its `layout` (host_layout.HostsLayout: who carries
which lane), its `lane_groups` (the lanes' gloo groups), its steps within the host (`host_reduce_scatter`,
`host_all_gather`) and between the hosts (`lane_sum`, `lane_send`, `wait_lane`), each given the runner's
job, whose one deadline bounds every step (Note [One deadline per call] in runner.py)."""
from __future__ import annotations

import os
from collections import deque
from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from .reductions import sum_in_order
from .runner import Job

# Note [The pipeline's chunk]
# CHUNK_BYTES: the bytes of one chunk of an all-reduce between hosts; DEPTH: the chunks on the wire at
# once. Measured with bench/hosts.py, 2 hosts x 2 processes, 2500 Mbit/s + 0.1 ms, a quiet 2-core AMD EPYC
# (medians of 2 launches x 8 calls, ms at 4 MiB / 32 MiB): chunks of 256 KiB 49 / 315, 1 MiB 21.0 / 137.7,
# 2 MiB 18.5 / 123.4, 4 MiB 20.2 / 120.9, 8 MiB 19.6 / 123.2 (gloo 24-25 / 166). A chunk has a fixed cost
# (two channel rounds, a gloo operation per lane: about a network round trip and gloo's own ~0.5 ms
# here), which small chunks pay many times over; the pipeline's fill and drain cost about one chunk's
# time, which large chunks make long. Two in flight keep each lane's connection busy while the host steps
# of the next chunk run (a gloo group runs as many operations at once as its worker threads, two); four
# in flight, or chunks sent beside the calls' record before it compared them, measured no better on 2
# cores (more threads than cores). NCCLAVG_HOSTS_CHUNK_KB and NCCLAVG_HOSTS_DEPTH override them.
CHUNK_BYTES = 2 << 20
DEPTH = 2


def env_int(name: str, default: int, lo: int, hi: int | None = None) -> int:
    """The integer setting `name` of the environment in [lo, hi], else `default` when it is unset; a
    ValueError naming it otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {bound}, got '{raw}'")
    return value


def chunk_bytes(default: int = CHUNK_BYTES) -> int:
    """NCCLAVG_HOSTS_CHUNK_KB, else `default` (gloo's lanes': CHUNK_BYTES; UCX's: ucx.CHUNK_BYTES)."""
    return env_int("NCCLAVG_HOSTS_CHUNK_KB", default >> 10, 1) << 10


def chunk_plan(nbytes: int, lanes: int) -> List[int]:
    """The bytes of each chunk of a pipelined sum of `nbytes` over `lanes` lanes: chunk_bytes() each (a
    multiple of 8 x lanes, so that a chunk's shards hold whole elements of any dtype), the last cut short."""
    unit = 8 * lanes
    size = max(unit, chunk_bytes() // unit * unit)
    return [min(size, nbytes - at) for at in range(0, nbytes, size)]


def depth(default: int = DEPTH) -> int:
    return env_int("NCCLAVG_HOSTS_DEPTH", default, 1)


class ShardLayout:
    """Where the shards of one chunk lie in the channel's reduce-scatter: local rank l's lanes side by side
    in its region (`region` shards long, zeros after its last), regions in local-rank order. With as many
    lanes as processes on this host and a chunk of K whole shards, the chunk itself is that layout."""

    def __init__(self, lanes_of: List[List[int]], shard: int, chunk: int):
        self.lanes_of, self.shard = lanes_of, shard
        self.region = max(len(k) for k in lanes_of) * shard
        self.direct = all(len(k) == 1 for k in lanes_of) and shard * len(lanes_of) == chunk

    def scatter_in(self, chunk: torch.Tensor, stage: torch.Tensor) -> None:
        """stage (P x region) = the chunk's shards in layout order."""
        for l in range(len(self.lanes_of)):
            self.region_of(chunk, l, stage[l * self.region:(l + 1) * self.region])

    def region_of(self, chunk: torch.Tensor, local: int, out: torch.Tensor) -> None:
        """out (region) = local rank `local`'s lanes' shards of the chunk, side by side (scatter_in's region)."""
        out.zero_()
        s, n = self.shard, chunk.numel()
        for i, k in enumerate(self.lanes_of[local]):
            lo, hi = min(n, k * s), min(n, (k + 1) * s)
            if hi > lo:
                out[i * s:i * s + hi - lo].copy_(chunk[lo:hi])

    def gather_out(self, stage: torch.Tensor, chunk: torch.Tensor) -> None:
        """The inverse: the chunk's shards back in order from stage (P x region)."""
        s, n = self.shard, chunk.numel()
        for l, lanes in enumerate(self.lanes_of):
            for i, k in enumerate(lanes):
                lo, hi = min(n, k * s), min(n, (k + 1) * s)
                if hi > lo:
                    at = l * self.region + i * s
                    chunk[lo:hi].copy_(stage[at:at + hi - lo])


class _Chunks:
    """Chunks started in order (`_start`), depth() at most in flight, the oldest finished first (`_finish`)."""

    chunks: List[tuple]

    def run(self) -> None:
        pending: deque = deque()
        for chunk in self.chunks:
            if len(pending) >= depth():
                self._finish(pending.popleft())
            pending.append(self._start(*chunk))
        while pending:
            self._finish(pending.popleft())

    def _start(self, lo: int, n: int) -> tuple:
        raise NotImplementedError

    def _finish(self, item: tuple) -> None:
        raise NotImplementedError


class Pipe(_Chunks):
    """Steps (1)-(3) of Note [Several hosts] over `flat`, chunk after chunk, DEPTH chunks in flight: the
    all-reduce's sum, or with `source` a broadcast from the ranks of host `source` (which hold the data)."""

    def __init__(self, hosts: Any, flat: torch.Tensor, job: Job, source: Optional[int] = None):
        self.h, self.flat, self.job = hosts, flat, job
        self.source = source
        self.sends = source is not None and hosts.layout.host == source
        esize = flat.element_size()
        self.chunks: List[tuple] = []   # (first element, elements): the chunk's size is fixed by its place
        at = 0
        for nbytes in chunk_plan(flat.numel() * esize, hosts.layout.lanes):
            self.chunks.append((at, nbytes // esize))
            at += nbytes // esize
        self.stage_in: Optional[torch.Tensor] = None
        self.stage_out: Optional[torch.Tensor] = None
        self.spare: List[torch.Tensor] = []

    def _start(self, lo: int, n: int) -> tuple:
        """Step (1) and the start of (2) of one chunk: `mine` holds this rank's lanes' shards side by side."""
        chunk = self.flat[lo:lo + n]
        h, L = self.h, self.h.layout
        p = len(L.mine)
        layout = ShardLayout(L.lanes_of, -(-chunk.numel() // L.lanes), chunk.numel())
        if self.sends and layout.direct:   # the chunk as it lies: this rank's lanes' shards are its region
            mine = chunk[L.local * layout.region:(L.local + 1) * layout.region]
        else:
            mine = room(self.spare.pop() if self.spare else None, layout.region, chunk.dtype)[:layout.region]
        if self.source is None:                                                                  # (1)
            if layout.direct:
                h.host_reduce_scatter(chunk, mine, self.job)
            else:
                self.stage_in = room(self.stage_in, p * layout.region, chunk.dtype)
                src = self.stage_in[:p * layout.region]
                layout.scatter_in(chunk, src)
                h.host_reduce_scatter(src, mine, self.job)
        elif self.sends and not layout.direct:   # the root's host lays its lanes' shards out (a receiver's
            layout.region_of(chunk, L.local, mine)   # `mine` is what step (2) writes)
        pieces = [(lane, mine[i * layout.shard:(i + 1) * layout.shard]) for i, lane in enumerate(h.lane_groups)]
        if self.source is None:                                                                  # (2)
            works = [h.lane_sum(lane, piece) for lane, piece in pieces]
        else:
            works = [h.lane_send(lane, piece, self.source) for lane, piece in pieces]
        return chunk, layout, mine, works

    def _finish(self, item: tuple) -> None:
        """Step (2)'s end and step (3) of one chunk."""
        chunk, layout, mine, works = item
        h = self.h
        what = "all_reduce" if self.source is None else "broadcast"
        for work, piece, rows in works:
            h.wait_lane(what, work, self.job)
            if rows is not None:   # two hosts: the lane's members add both shards, in group order
                sum_in_order(list(rows), out=piece)
        if not self.sends:   # (the root's host holds the chunk already)
            p = len(h.layout.mine)
            if layout.direct:
                h.host_all_gather(mine, chunk, self.job)                                        # (3)
            else:
                self.stage_out = room(self.stage_out, p * layout.region, chunk.dtype)
                out = self.stage_out[:p * layout.region]
                h.host_all_gather(mine, out, self.job)
                layout.gather_out(out, chunk)
        if not (self.sends and layout.direct):   # a buffer of this pipe's own, not a view of the data
            self.spare.append(mine)

class SlicePipe(_Chunks):
    """The reduce-scatter (`gather` False: rank r gets the sum over the ranks of their slice r) and the
    all-gather (`gather` True: every rank gets every rank's slice) between hosts, each of `n` elements a
    slice: Note [Several hosts], steps (1)-(3) over chunks of elements [lo, lo + c) of every slice at once.
    Lane k carries the slices of local rank k of each host that has one (Note [Lanes and their carriers]
    in host_layout.py): so a rank's own slice goes on the wire from it, and its reduce-scatter's result
    lands on it. In the host's channel, a rank's region holds the chunks of the slices its lanes carry
    (`HostsLayout.slots`), every region `units` chunks long."""

    def __init__(self, hosts: Any, gather: bool, out: torch.Tensor, inp: torch.Tensor, n: int, job: Job,
                 start: int = 0):
        self.h, self.gather, self.out, self.inp, self.n = hosts, gather, out, inp, n
        self.job = job
        # a chunk of every slice: about chunk_bytes() through each host's channel, as the all-reduce's; the
        # slices' elements from `start` (those before it rode in the calls' record)
        per = max(1, chunk_bytes() // (inp.element_size() * hosts.world_size))
        self.chunks = [(lo, min(per, n - lo)) for lo in range(start, n, per)]
        self.units = max(len(s) for s in hosts.layout.slots)
        self.stage: Optional[torch.Tensor] = None
        self.spare: List[torch.Tensor] = []

    def _start(self, lo: int, c: int) -> tuple:
        """Step (1) of a reduce-scatter (the host's sums of the slices this rank's lanes carry, through the
        channel's reduce-scatter) and the start of step (2): one exchange per lane."""
        h, units = self.h, self.units
        mine = room(self.spare.pop() if self.spare else None, units * c, self.out.dtype)[:units * c]
        if not self.gather:                                                                      # (1)
            p = len(h.layout.mine)
            src = mine
            if p > 1:
                self.stage = room(self.stage, p * units * c, mine.dtype)
                src = self.stage[:p * units * c]
            for l, ranks in enumerate(h.layout.slots):
                region = src[l * units * c:(l + 1) * units * c]
                for u, r in enumerate(ranks):
                    region[u * c:(u + 1) * c].copy_(self.inp[r * self.n + lo:r * self.n + lo + c])
                region[len(ranks) * c:].zero_()   # (summed: never garbage)
            if p > 1:
                h.host_reduce_scatter(src, mine, self.job)
        works, at = [], 0
        for lane, members in zip(h.lane_groups, h.lane_slices):                                      # (2)
            m = sum(r is not None for r in members)
            works.append(self._exchange(lane, members, mine[at * c:(at + m) * c], lo, c))
            at += m
        return lo, c, mine, works

    def _exchange(self, lane: Any, members: list, region: torch.Tensor, lo: int, c: int) -> tuple:
        """Starts one lane's exchange of a chunk: (work, the rows this rank sums, or None). `members`: the
        slice each member of the lane's group carries (None: its host has no process lane.index)."""
        to_each = [c if r is not None else 0 for r in members]
        own = lane.index == self.h.layout.local   # this rank's own slice is on this lane
        if self.gather:   # every member's slice to every member: `region` gets them in group order
            mine = self.inp[lo:lo + c]
            if all(to_each):
                return lane.group._allgather_base(region, mine, _GATHER), None
            send = mine.repeat(len(members)) if own else mine[:0]
            return lane.group.alltoall_base(region, send, to_each, [c if own else 0] * len(members),
                                            AllToAllOptions()), None
        # a reduce-scatter: each member gets this host's sum of its slice; this rank gets every host's sum
        # of its own
        got = torch.empty(len(members) * c if own else 0, dtype=region.dtype)
        work = lane.group.alltoall_base(got, region, [c if own else 0] * len(members), to_each, AllToAllOptions())
        return work, got if own else None

    def _finish(self, item: tuple) -> None:
        """Step (2)'s end (a reduce-scatter adds the hosts' sums, in the lane's group order) and step (3) of
        an all-gather (the channel's all-gather of every rank's region, each slice's chunk to its place)."""
        lo, c, mine, works = item
        h, units, n = self.h, self.units, self.n
        what = "all_gather" if self.gather else "reduce_scatter"
        for work, got in works:
            h.wait_lane(what, work, self.job)
            if got is not None:
                sum_in_order(list(got.view(-1, c)), out=self.out[lo:lo + c])
        if self.gather:                                                                          # (3)
            p = len(h.layout.mine)
            every = mine
            if p > 1:
                self.stage = room(self.stage, p * units * c, mine.dtype)
                every = self.stage[:p * units * c]
                h.host_all_gather(mine, every, self.job)
            for l, ranks in enumerate(h.layout.slots):
                for u, r in enumerate(ranks):
                    at = (l * units + u) * c
                    self.out[r * n + lo:r * n + lo + c].copy_(every[at:at + c])
        self.spare.append(mine)


_GATHER = AllgatherOptions()

def room(buf: Optional[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
    """`buf` when it holds n elements of dtype, else a new buffer that does (grown, never shrunk)."""
    if buf is not None and buf.numel() >= n and buf.dtype == dtype:
        return buf
    return torch.empty(max(n, 1), dtype=dtype)
