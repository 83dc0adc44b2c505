"""The transport between processes on several hosts over gloo (transport "shm+gloo"; the fallback of the
UCX lanes, ucx.py): each host's shared-memory channel (shm.py) inside it, torch.distributed gloo between the
hosts, on one group per lane. `HostsTransport` offers the primitives of `ShmTransport` under the same
names, so that the runners' jobs (paths.py's HostsPaths) call either; host_setup.py makes it.

Note [Several hosts]
An all-reduce between hosts runs as Horovod's hierarchical all-reduce and oneCCL's "2d" algorithm do,
pipelined in chunks:
1. within each host, the channel's reduce-scatter: local rank l holds the host's sum of its lanes' shards
   of the chunk;
2. between the hosts, every local rank at once all-reduces its shards with the processes that hold the
   same lanes on the other hosts (one gloo group per lane, made once at setup: gloo is the engine between
   hosts), so every local rank carries 1/P of the bytes, on its own connection (its own NIC when
   GLOO_SOCKET_IFNAME differs by local rank);
3. within each host, the channel's all-gather puts the chunk together on every local rank.
The chunk's steps 1 and 3 run while the chunks before and after it are on the wire (DEPTH chunks in flight,
host_pipes.py), so the time approaches the larger of the wire's and the hosts' steps, not their sum (Note [The
pipeline's chunk] there). Every process of every host ends with the same bits: a lane's sum is gloo's, the
same on every host, and step 3 copies it.
Lanes: which process carries which (Note [Lanes and their carriers] in host_layout.py, the same rule as UCX's
lanes). With the same P on every host a local rank owns one lane and the chunk is reduce-scattered as it
lies; otherwise every rank's lanes are first laid out side by side (`ShardLayout` in host_pipes.py), padded
to the same length in the host's memory, never on the wire.
The user's call is compared within each host by the channel's rounds (Note [Call signatures] in
csrc/transport/shm_calls.cpp) and between the hosts by the lane-0 processes (the hosts' leaders) in a record
that carries the call's data (all of it up to 256 KiB between two hosts, else its first 4 KiB: a small
collective is one exchange in all), before any size that may differ goes to a gloo collective (Note [The check
folded into the data] in calls.py); a leader that finds a difference aborts its host's channel with it, so
every process of every host fails naming both calls. A leader whose host's first step failed says so in its
record, and the other hosts' leaders fail at once.
A broadcast takes the same lanes from any root: the channel's broadcast within the root's host, the data in
the leaders' record as for the all-reduce, then chunk by chunk each lane's carrier on the root's host sends
the lane's shard to the lane's carriers elsewhere, which all-gather the shards through their host's channel.
A reduce-scatter and an all-gather move slices (every rank's `n` elements): lane k carries the slices of
local rank k of every host that has one, chunk [lo, lo + c) of every slice at once (`SlicePipe`). An
all-gather: (2) on each lane, each rank's own slice to every other host (gloo's all-gather, or its
all_to_all where some hosts have no process k), (3) within each host, the channel's all-gather of what each
local rank received. A reduce-scatter: (1) within each host, the channel's reduce-scatter gives local rank
l the host's sums of the slices its lanes carry, (2) on each lane an all_to_all sends each host the sum of
its rank's slice and gives rank k every host's sum of its own, which it adds in the lane's group order
(fp32 accumulation, one rounding): its result lands where it is wanted, with no step (3). Each byte crosses
the network once, every local rank on the wire. The first elements of every slice (all of a small call: the
largest host's slices fit the record) go in the leaders' record: (1) the host's sum or all-gather of them
through its channel, (2) the record, (3) a round that hands each rank its part; the pipeline takes the rest.
A step (2) that fails aborts its host's channel with the reason, so that the host's other processes fail
at once instead of waiting out the timeout.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions, ReduceOp

from ..errors import is_timeout
from .calls import FOLD_BYTES, Call, CallMismatchError, Record, fold_limit, folded, start_record
from .host_layout import HostsLayout
from .host_pipes import Pipe, SlicePipe
from .reductions import as_bytes, sum_in_order
from .runner import Job
from .shm import ShmTransport

GATHER_BYTES = 256 << 10   # a lane's shard up to which two hosts exchange it whole (LaneGroup sums: lane_sum)


class LaneGroup:
    """One lane's gloo group between the hosts: `group` (a c10d process group of one process per host,
    this process among them), `me` this process's index in it, `labels` the group ranks of its members."""

    def __init__(self, index: int, group: Any, members: List[int], rank: int):
        self.index, self.group = index, group
        self.labels = sorted(members)
        self.me = self.labels.index(rank)


def make_lanes(layout: HostsLayout, make_group: Callable[[List[int]], Any]) -> List[LaneGroup]:
    """The gloo groups of the lanes this process carries, made in lane order (collective over each lane's
    members only)."""
    lanes = []
    for k in range(layout.lanes):
        members = layout.owners(k)
        if layout.rank in members:
            lanes.append(LaneGroup(k, make_group(sorted(members)), members, layout.rank))
    return lanes


class HostsTransport:
    """The processes of a group on several hosts: `channel` this host's (None when this process is alone
    on its host), `layout` which process carries which lane (host_layout.HostsLayout), `lanes` the gloo
    groups of the lanes this process carries (make_lanes; lane 0, when it is among them, is the hosts'
    leaders' group). Its primitives are ShmTransport's, each given the runner's job: the channel's steps
    take `job.channel_limit()`, the waits on gloo `job.remaining()` (Note [One deadline per call] in
    runner.py). The pipelines (host_pipes.py) drive it through `layout`, `lane_groups` and its step methods."""

    kind = "shm+gloo"
    channel = None   # no one channel over every process: the channel's fast paths are off
    fast_target = None   # and the native fast all-reduce (comm/fast_average.py): gloo's steps are Python
    # a host's channel may carry a leader's abort about a failure between the hosts, which names nobody:
    # the heartbeats are asked then (runner.py)
    names_peers = False

    between_hosts = True

    def __init__(self, channel: Any, layout: HostsLayout, lanes: List[LaneGroup]):
        self._channel = channel
        self.host_channel = channel   # this host's, None when alone (stragglers.py reads it)
        # the host's steps: one host's channel primitives, over this host's processes (None: alone)
        self._host = ShmTransport(channel, layout.local, len(layout.mine)) if channel is not None else None
        self.layout, self.lane_groups = layout, lanes
        self.rank, self.world_size = layout.rank, layout.world_size
        self._leaders = lanes[0] if lanes and lanes[0].index == 0 else None
        # the slices each of this process's lanes carries, in its group's order (SlicePipe)
        self.lane_slices = [layout.slices(lane.index) for lane in lanes]

    # ------------------------------------------------------------------ all-reduce: Note [Several hosts]
    def all_reduce_sum(self, t: torch.Tensor, job: Job, divisor: float = 1.0, check_finite: bool = False) -> None:
        """The sum over every rank of every host (Note [Several hosts]); `check_finite` is not answered between
        hosts (None: the step's reader scans). The call's data (all of it where it fits the record, else its
        first FOLD_BYTES: `folded`) goes in the record that compares the calls (Note [The check folded into the
        data] in calls.py): the host's sum of them, the leaders' records, each leader adding them in its group's
        order, then a round in which the host's other ranks take the leader's sum (or find the channel aborted:
        the calls differ). The rest is pipelined in chunks, once the record has compared the calls: until then
        no size that may differ between the ranks goes to gloo."""
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        flat = t.view(-1)
        head = flat[:folded(flat, len(self.layout.hosts))]
        self._host_step(job, lambda: self._host_sum(head, job))   # (1)
        rows = self._leaders_record(job, as_bytes(head))
        if rows:
            sum_in_order([r.view(head.dtype) for r in rows], out=head)
        self._host_broadcast(head, job)
        if flat.numel() > head.numel():
            Pipe(self, flat[head.numel():], job).run()

    def lane_sum(self, lane: LaneGroup, piece: torch.Tensor) -> tuple:
        """Starts step (2) for one shard: (work, piece, rows). A shard of at most GATHER_BYTES between two
        hosts: an all-gather of the shards (the bytes of an all-reduce, in one message each way instead of
        a ring's two: half the latency), whose rows the members add in the same order, so both hold the
        same bits. Otherwise gloo's all-reduce: between two hosts it streams a large shard in pieces (its
        all-gather sends it whole), and between more it sends 2(H-1)/H of the shard each way, not H-1."""
        if len(lane.labels) == 2 and piece.numel() * piece.element_size() <= GATHER_BYTES:
            rows = torch.empty(2, piece.numel(), dtype=piece.dtype)
            return lane.group._allgather_base(rows.view(-1), piece, _GATHER), piece, rows
        return lane.group.allreduce([piece], _SUM), piece, None

    # ------------------------------------------------------------------ the slices: Note [Several hosts]
    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, job: Job, divisor: float = 1.0) -> None:
        """out = the sum over every rank of every host of its slice `rank` of inp (world_size slices of
        out.numel()). The first `_slice_head` elements of every slice (all of a small call) go in the record
        that compares the calls: the host's sums of them through its channel, each leader's record carries
        to each other host's leader the sums for that host's ranks, each leader adds what it gets in its
        group's order, a round gives each rank of its host its part (one exchange between hosts); the rest
        in SlicePipe."""
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        n = out.numel()
        h = self._slice_head(n, out.element_size())
        L = self.layout
        host_sum = torch.empty(self.world_size, h, dtype=out.dtype)   # every slice's head, summed in place
        host_sum.copy_(inp.reshape(self.world_size, n)[:, :h])
        self._host_step(job, lambda: self._host_sum(host_sum, job))   # (1)
        # host j's leader gets this host's sums of host j's ranks' heads (padded to the largest host's)
        blocks = torch.zeros(len(L.hosts), L.lanes * h, dtype=out.dtype)
        for j, members in enumerate(L.hosts):
            blocks[j, :len(members) * h] = host_sum[members].reshape(-1)
        rows = self._leaders_record(job, payloads=[as_bytes(b) for b in blocks])              # (2)
        mine = blocks[L.host]
        if rows:
            sum_in_order([r.view(out.dtype) for r in rows], out=mine)
        self._host_broadcast(mine, job)                                                          # (3)
        out.view(-1)[:h].copy_(mine[L.local * h:(L.local + 1) * h])
        if h < n:
            SlicePipe(self, False, out.view(-1), inp.reshape(-1), n, job, start=h).run()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, job: Job) -> None:
        """out = every rank's inp, in rank order. The first `_slice_head` elements of every rank's (all of a
        small call) go in the record that compares the calls: the host's gathered through its channel, the
        leaders' records carry them, a round gives them to the host's other ranks (one exchange between
        hosts); the rest in SlicePipe."""
        n = inp.numel()
        h = self._slice_head(n, inp.element_size())
        flat, mine = out.view(-1), inp.reshape(-1)[:h]
        block = torch.zeros(self.layout.lanes * h, dtype=inp.dtype)   # this host's heads, padded to the largest host's
        self._host_step(job, lambda: self.host_all_gather(mine, block[:len(self.layout.mine) * h], job))   # (1)
        rows = self._leaders_record(job, as_bytes(block))                                       # (2)
        heads = flat.view(self.world_size, n) if h == n else torch.empty(self.world_size, h, dtype=inp.dtype)
        if rows:
            for members, row in zip(self.layout.hosts, rows):
                heads[members] = row.view(inp.dtype)[:len(members) * h].view(len(members), h)
        self._host_broadcast(heads, job)                                                        # (3)
        if h < n:
            flat.view(self.world_size, n)[:, :h] = heads
            SlicePipe(self, True, flat, inp.reshape(-1), n, job, start=h).run()

    def _slice_head(self, n: int, esize: int) -> int:
        """The leading elements of every slice of a reduce-scatter or all-gather that ride in the record:
        all of them where the largest host's slices fit it (fold_limit), else as many as the largest
        host's fill FOLD_BYTES with."""
        if self.layout.lanes * n * esize <= fold_limit(len(self.layout.hosts)):
            return n
        return min(n, FOLD_BYTES // (self.layout.lanes * esize))

    def broadcast(self, t: torch.Tensor, root: int, job: Job) -> None:
        """`root`'s data to every rank of every host, as the all-reduce moves its sum (Note [Several hosts]):
        (1) within the root's host, the channel's broadcast from it (every other host: a round that compares its
        ranks' calls); the leaders' record compares the calls between the hosts and carries the data from the
        root's host (all of it where it fits, else its first FOLD_BYTES); a round in which the other ranks of
        each host take them (or find the channel aborted: the calls differ); the rest pipelined in chunks: (2)
        each lane's carrier on the root's host broadcasts the lane's shard to the lane's carriers on the other
        hosts, every local rank on the wire at once, (3) each other host all-gathers the shards through its
        channel."""
        flat = t.view(-1)
        L = self.layout
        src = next(i for i, h in enumerate(L.hosts) if root in h)
        at_root = L.host == src
        if at_root:
            self._host_step(job, lambda: self._host_broadcast(flat, job, L.mine.index(root)))   # (1)
        else:
            self._host_step(job, lambda: self._host_barrier(job))
        head = flat[:folded(flat, len(L.hosts))]
        rows = self._leaders_record(job, as_bytes(head if at_root else head[:0]))   # (the root's alone)
        if at_root:
            self._host_barrier(job)
        else:
            if rows:
                head.copy_(rows[src].view(head.dtype))
            self._host_broadcast(head, job)
        if flat.numel() > head.numel():
            Pipe(self, flat[head.numel():], job, source=src).run()

    def lane_send(self, lane: LaneGroup, piece: torch.Tensor, source: int) -> tuple:
        """Starts step (2) of a broadcast for one shard: from the lane's carrier on host `source` to the
        lane's carriers on the other hosts. (work, piece, None), as lane_sum."""
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = lane.labels.index(self.layout.owners(lane.index)[source]), 0
        return lane.group.broadcast([piece], opts), piece, None

    def check(self, job: Job) -> None:
        """(1) the host's ranks agree, (2) the leaders agree, (3) a round in which the host's other ranks
        learn the leader's verdict (it aborts the channel on a mismatch)."""
        self._host_step(job, lambda: self._host_barrier(job))
        self._leaders_record(job)
        self._host_barrier(job)

    def stalled_on(self) -> str:
        """"": the rank this host's channel waits for may itself be waiting on another host (a leader in its
        record exchange), and is then not lost; the heartbeats name the lost rank (Note [Naming the lost
        rank] in liveness.py)."""
        return ""

    def abort(self, why: str, mismatch: bool = False) -> None:
        if self._channel is not None:
            self._channel.abort(why, mismatch)

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ within the host
    def host_reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, job: Job) -> None:
        if self._host is not None:
            self._host.reduce_scatter_sum(out, src, job)
        else:
            out.copy_(src[:out.numel()])

    def host_all_gather(self, mine: torch.Tensor, out: torch.Tensor, job: Job) -> None:
        if self._host is not None:
            self._host.all_gather(out, mine, job)
        else:
            out.copy_(mine)

    def _host_sum(self, t: torch.Tensor, job: Job) -> None:
        if self._host is not None:
            self._host.all_reduce_sum(t.view(-1), job)

    def _host_broadcast(self, t: torch.Tensor, job: Job, root: int = 0) -> None:
        """From this host's local rank `root` (its leader unless said)."""
        if self._host is not None:
            self._host.broadcast(t.view(-1), root, job)

    def _host_barrier(self, job: Job) -> None:
        if self._host is not None:
            self._host.check(job)

    # ------------------------------------------------------------------ between the hosts' leaders
    def _host_step(self, job: Job, step: Callable[[], None]) -> None:
        """Step (1); a leader whose step failed tells the other leaders at once (its record, ok=False)."""
        try:
            step()
        except Exception:
            self._tell_leaders(job)
            raise

    def _start_record(self, call: Optional[Call], payload: Optional[torch.Tensor] = None,
                      ok: bool = True, payloads: Optional[list] = None) -> Optional[Record]:
        """A leader's record exchange with the other hosts' leaders, started (Note [The check folded into
        the data] in calls.py): the call, this host's verdict and `payload`. None when this process leads no
        host, or the call was compared already and there is no payload (a later step of the same call
        sends only its data, under a call of its own)."""
        lead = self._leaders
        if lead is None:
            return None
        if call is None or call.checked:
            data = payload if payloads is None else payloads[0]
            if data is None:
                return None
            call = Call(0, 0, "payload")   # only the data: the calls were compared
        return start_record(lead.group, call, lead.me, len(lead.labels), payload, labels=lead.labels,
                            where="between the hosts' leaders", ok=ok, payloads=payloads)

    def _finish_record(self, record: Record, job: Job) -> list:
        """The leaders' payloads in their group's order; a mismatch aborts this host's channel with it."""
        try:
            return record.finish(job.remaining)
        except CallMismatchError as e:
            self.abort(str(e), mismatch=True)
            raise
        except Exception as e:   # noqa: BLE001 (a step (2) failure, after the host is told)
            self._failed_between_hosts("the calls' check", e)
            raise   # not reached: _failed_between_hosts raises

    def _leaders_record(self, job: Job, payload: Optional[torch.Tensor] = None, ok: bool = True,
                        payloads: Optional[list] = None) -> Optional[list]:
        """_start_record, then its finish (None: no exchange)."""
        record = self._start_record(job.call, payload, ok, payloads)
        return None if record is None else self._finish_record(record, job)

    def _tell_leaders(self, job: Job) -> None:
        """This host's step (1) failed: its leader says so in the calls' exchange (best effort, bounded)."""
        try:
            self._leaders_record(job, ok=False)
        except Exception:   # noqa: BLE001 (the host's own error is the one raised)
            pass

    def wait_lane(self, what: str, work: Any, job: Job) -> None:
        """Waits for a gloo work until the call's deadline (Note [One deadline per call] in runner.py)."""
        try:
            job.wait_gloo(work)
        except Exception as e:   # noqa: BLE001 (re-raised, after the host's channel is told)
            self._failed_between_hosts(what, e)

    def _failed_between_hosts(self, what: str, e: BaseException) -> None:
        role = " (the leader of its host)" if self.layout.local == 0 else ""
        why = f"rank {self.rank}{role}: {what} between the hosts failed: {e}"
        self.abort(why)
        if is_timeout(e):
            raise TimeoutError(why) from e
        raise RuntimeError(why) from e


_SUM = AllreduceOptions()
_SUM.reduceOp = ReduceOp.SUM
_GATHER = AllgatherOptions()
