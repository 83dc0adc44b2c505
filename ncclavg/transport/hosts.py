"""The transport between processes on several hosts (transport "shm+gloo"): each host's shared-memory
channel (shm.py) inside it, torch.distributed gloo between the hosts, on one group per lane. `HostsTransport`
offers the primitives of `ShmTransport` under the same names, so that the runners' jobs (paths.py) call
either; host_setup.py makes it.

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
The chunk's steps 1 and 3 run while the chunks before and after it are on the wire (DEPTH chunks in
flight), so the time approaches the larger of the wire's and the hosts' steps, not their sum (Note [The
pipeline's chunk]). Every process of every host ends with the same bits: a lane's sum is gloo's, the same
on every host, and step 3 copies it.
Lanes: K, the largest number of processes on one host. Host h with P_h processes gives lane k to its local
rank k % P_h, so on a host with fewer processes a process carries several lanes (a host of one process
carries all K); each chunk is cut into K shards. With the same P on every host a local rank owns one lane
and the chunk is reduce-scattered as it lies; otherwise every rank's lanes are first laid out side by side
(`_Layout`), padded to the same length in the host's memory, never on the wire.
The user's call is compared within each host by the channel's rounds (Note [Call signatures] in
csrc/transport/shm_calls.cpp) and between the hosts by the lane-0 processes (the hosts' leaders) in a
record of fixed size that carries the call's first 4 KiB (all of a small all-reduce: one exchange in all),
before any size that may differ goes to gloo (Note [The check folded into the data] in calls.py); a leader
that finds a difference aborts its host's channel with it, so every process of every host fails naming
both calls. A leader whose host's first step failed says so in its record, and the other hosts' leaders
fail at once.
A broadcast takes the same lanes from any root: the channel's broadcast within the root's host, the first
4 KiB in the leaders' record, then chunk by chunk each lane's carrier on the root's host sends the lane's
shard to the lane's carriers elsewhere, which all-gather the shards through their host's channel.
reduce_scatter_sum and all_gather run through the hosts' leaders (lane 0): (1) within the host, (2)
between the leaders, after their record, (3) within the host again, each byte crossing the network once:
a reduce-scatter sends every other host only the slices of its ranks (one all_to_all with per-host sizes)
and sums what it receives in host order (fp32 accumulation, one rounding); an all-gather exchanges the
hosts' blocks (no padding to the largest host). A leader whose step (2) fails aborts its host's channel
with the reason, so that its host's other processes fail at once instead of waiting out the timeout.
"""
from __future__ import annotations

import datetime
import os
from collections import deque
from typing import Any, Callable, List, Optional

import torch
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions,
                                        ReduceOp)

from ..buffers import channel_type_code
from ..errors import is_timeout
from .calls import FOLD_BYTES, Call, CallMismatchError, Record, start_record
from .reductions import as_bytes, sum_in_order
from .runner import BACKSTOP_S
from .shm import tag

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
GATHER_BYTES = 256 << 10   # a lane's shard up to which two hosts exchange it whole (Lane sums: _lane_sum)


def _env_int(name: str, default: int, lo: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got '{raw}'")
    return value


def chunk_bytes() -> int:
    return _env_int("NCCLAVG_HOSTS_CHUNK_KB", CHUNK_BYTES >> 10, 1) << 10


def chunk_plan(nbytes: int, lanes: int) -> List[int]:
    """The bytes of each chunk of a pipelined sum of `nbytes` over `lanes` lanes: chunk_bytes() each (a
    multiple of 8 x lanes, so that a chunk's shards hold whole elements of any dtype), the last cut short."""
    unit = 8 * lanes
    size = max(unit, chunk_bytes() // unit * unit)
    return [min(size, nbytes - at) for at in range(0, nbytes, size)]


def depth() -> int:
    return _env_int("NCCLAVG_HOSTS_DEPTH", DEPTH, 1)


class Lane:
    """One lane's gloo group between the hosts: `group` (a c10d process group of one process per host,
    this process among them), `me` this process's index in it, `labels` the group ranks of its members."""

    def __init__(self, index: int, group: Any, members: List[int], rank: int):
        self.index, self.group = index, group
        self.labels = sorted(members)
        self.me = self.labels.index(rank)


def owners(hosts: List[List[int]], lane: int) -> List[int]:
    """The group ranks that carry `lane`, one per host: local rank lane % P_h of host h."""
    return [h[lane % len(h)] for h in hosts]


def make_lanes(hosts: List[List[int]], rank: int, make_group: Callable[[List[int]], Any]) -> List[Lane]:
    """The lanes this process carries, their groups made in lane order (collective over each lane's
    members only)."""
    lanes = []
    for k in range(max(len(h) for h in hosts)):
        members = owners(hosts, k)
        if rank in members:
            lanes.append(Lane(k, make_group(sorted(members)), members, rank))
    return lanes


class _Layout:
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


class HostsTransport:
    """The processes of a group on several hosts: `channel` this host's (None when this process is alone
    on its host), `hosts` every host's group ranks (ascending, hosts in the order of their lowest rank),
    `lanes` the lanes this process carries (make_lanes; lane 0, when it is among them, is the hosts'
    leaders' group)."""

    kind = "shm+gloo"
    channel = None   # no one channel over every process: the fast paths are off
    # a host's channel may carry a leader's abort about a failure between the hosts, which names nobody:
    # the heartbeats are asked then (runner.py)
    names_peers = False

    def __init__(self, channel: Any, rank: int, world_size: int, hosts: List[List[int]], lanes: List[Lane]):
        self._channel = channel
        self.rank, self.world_size = rank, world_size
        self._hosts = hosts
        self._mine = next(h for h in hosts if rank in h)
        self._local = self._mine.index(rank)
        self._lanes = lanes
        self._leaders = lanes[0] if lanes and lanes[0].index == 0 else None
        self._host_of_leader = {h[0]: i for i, h in enumerate(hosts)}
        self._K = max(len(h) for h in hosts)
        # the lanes each local rank of this host carries (lane k: local rank k % P)
        p = len(self._mine)
        self._lanes_of = [[k for k in range(self._K) if k % p == l] for l in range(p)]

    # ------------------------------------------------------------------ all-reduce: Note [Several hosts]
    def all_reduce_sum(self, t: torch.Tensor, limit: float, call: Optional[Call] = None,
                       divisor: float = 1.0, check_finite: bool = False) -> None:
        """The sum over every rank of every host (Note [Several hosts]); `check_finite` is not answered
        between hosts (None: the step's reader scans). The call's first FOLD_BYTES (all of a small one)
        go in the record that compares the calls (Note [The check folded into the data] in calls.py): the
        host's sum of them, the leaders' records, each leader adding them in its group's order, then a
        round in which the host's other ranks take the leader's sum (or find the channel aborted: the
        calls differ). The rest is pipelined in chunks, once the record has compared the calls: until then
        no size that may differ between the ranks goes to gloo."""
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        flat = t.view(-1)
        head = flat[:min(flat.numel(), FOLD_BYTES // flat.element_size())]
        code = channel_type_code(head.dtype)
        limit_at = _Deadline(limit)
        self._host_step(call, limit, lambda: self._host_sum(head.data_ptr(), head.numel(), code, limit, call))   # (1)
        rows = self._leaders_record(call, limit_at(), as_bytes(head))
        if rows:
            head.copy_(sum_in_order([r.view(head.dtype) for r in rows]))
        self._host_broadcast(head.data_ptr(), head.numel(), code, limit_at(), call)
        if flat.numel() > head.numel():
            _Pipe(self, flat[head.numel():], limit_at, call).run()

    def _lane_sum(self, lane: Lane, piece: torch.Tensor) -> tuple:
        """Starts step (2) for one shard: (work, piece, rows). A shard of at most GATHER_BYTES between two
        hosts: an all-gather of the shards (the bytes of an all-reduce, in one message each way instead of
        a ring's two: half the latency), whose rows the members add in the same order, so both hold the
        same bits. Otherwise gloo's all-reduce: between two hosts it streams a large shard in pieces (its
        all-gather sends it whole), and between more it sends 2(H-1)/H of the shard each way, not H-1."""
        if len(lane.labels) == 2 and piece.numel() * piece.element_size() <= GATHER_BYTES:
            rows = torch.empty(2, piece.numel(), dtype=piece.dtype)
            return lane.group._allgather_base(rows.view(-1), piece, _GATHER), piece, rows
        return lane.group.allreduce([piece], _SUM), piece, None

    # ------------------------------------------------------------------ through the leaders
    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, limit: float, call: Optional[Call] = None,
                           divisor: float = 1.0) -> None:
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        n, code = out.numel(), channel_type_code(out.dtype)
        host_sum = inp.reshape(-1).clone()
        self._host_step(call, limit, lambda: self._host_sum(host_sum.data_ptr(), host_sum.numel(), code, limit,
                                                            call))                              # (1)
        mine = torch.empty(len(self._mine) * n, dtype=out.dtype)   # this host's ranks' slices, summed
        if self._leaders is not None:                                                            # (2)
            send = self._host_order(host_sum)
            hosts = self._hosts
            got = torch.empty(len(hosts) * mine.numel(), dtype=out.dtype)
            self._leaders_exchange(call, limit, "all_to_all", lambda g: g.alltoall_base(
                got, send, [mine.numel()] * len(hosts), [len(h) * n for h in hosts], AllToAllOptions()))
            mine.copy_(sum_in_order(list(got.view(len(hosts), -1))))
        self._host_broadcast(mine.data_ptr(), mine.numel(), code, limit, call)                   # (3)
        at = self._local * n
        out.view(-1).copy_(mine[at:at + n])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, limit: float, call: Optional[Call] = None) -> None:
        n, code = inp.numel(), channel_type_code(inp.dtype)
        mine = torch.empty(len(self._mine) * n, dtype=inp.dtype)

        def gather_host() -> None:                                                               # (1)
            if self._channel is not None:
                self._channel.all_gather(inp.data_ptr(), mine.data_ptr(), n, code, limit, *tag(call))
            else:
                mine.copy_(inp.reshape(-1))

        self._host_step(call, limit, gather_host)
        flat = out.view(-1)
        if self._leaders is not None:                                                            # (2)
            got = torch.empty(self.world_size * n, dtype=inp.dtype)
            sizes = [len(h) * n for h in self._hosts]
            self._leaders_exchange(call, limit, "all_to_all", lambda g: g.alltoall_base(
                got, mine.repeat(len(self._hosts)), sizes, [mine.numel()] * len(self._hosts), AllToAllOptions()))
            at = 0
            for members in self._hosts:
                for r in members:
                    flat[r * n:(r + 1) * n] = got[at:at + n]
                    at += n
        self._host_broadcast(flat.data_ptr(), flat.numel(), code, limit, call)                  # (3)

    def broadcast(self, t: torch.Tensor, root: int, limit: float, call: Optional[Call] = None) -> None:
        """`root`'s data to every rank of every host, as the all-reduce moves its sum (Note [Several hosts]):
        (1) within the root's host, the channel's broadcast from it (every other host: a round that compares
        its ranks' calls); the leaders' record compares the calls between the hosts and carries the first
        FOLD_BYTES from the root's host; a round in which the other ranks of each host take them (or find
        the channel aborted: the calls differ); the rest pipelined in chunks: (2) each lane's carrier on the
        root's host broadcasts the lane's shard to the lane's carriers on the other hosts, every local rank
        on the wire at once, (3) each other host all-gathers the shards through its channel."""
        flat = t.view(-1)
        code = channel_type_code(flat.dtype)
        src = next(i for i, h in enumerate(self._hosts) if root in h)
        at_root = self._mine is self._hosts[src]
        limit_at = _Deadline(limit)
        if at_root:
            self._host_step(call, limit, lambda: self._host_broadcast(flat.data_ptr(), flat.numel(), code, limit,
                                                                      call, self._mine.index(root)))   # (1)
        else:
            self._host_step(call, limit, lambda: self._host_barrier(limit, call))
        head = flat[:min(flat.numel(), FOLD_BYTES // flat.element_size())]
        rows = self._leaders_record(call, limit_at(), as_bytes(head))
        if at_root:
            self._host_barrier(limit_at(), call)
        else:
            if rows:
                head.copy_(rows[src].view(head.dtype))
            self._host_broadcast(head.data_ptr(), head.numel(), code, limit_at(), call)
        if flat.numel() > head.numel():
            _Pipe(self, flat[head.numel():], limit_at, call, source=src).run()

    def _lane_send(self, lane: Lane, piece: torch.Tensor, source: int) -> tuple:
        """Starts step (2) of a broadcast for one shard: from the lane's carrier on host `source` to the
        lane's carriers on the other hosts. (work, piece, None), as _lane_sum."""
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = lane.labels.index(owners(self._hosts, lane.index)[source]), 0
        return lane.group.broadcast([piece], opts), piece, None

    def check(self, call: Call, limit: float) -> None:
        """(1) the host's ranks agree, (2) the leaders agree, (3) a round in which the host's other ranks
        learn the leader's verdict (it aborts the channel on a mismatch)."""
        self._host_step(call, limit, lambda: self._host_barrier(limit, call))
        self._leaders_record(call, limit)
        self._host_barrier(limit, call)

    def broadcasts_from(self, root: int) -> bool:
        return 0 <= root < self.world_size

    def divides(self) -> bool:
        return False

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
    def _host_reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, limit: float, call: Optional[Call]) -> None:
        if self._channel is not None:
            self._channel.reduce_scatter_sum(src.data_ptr(), out.data_ptr(), out.numel(), channel_type_code(out.dtype),
                                             limit, 1.0, 1.0, *tag(call))
        else:
            out.copy_(src[:out.numel()])

    def _host_all_gather(self, mine: torch.Tensor, out: torch.Tensor, limit: float, call: Optional[Call]) -> None:
        if self._channel is not None:
            self._channel.all_gather(mine.data_ptr(), out.data_ptr(), mine.numel(), channel_type_code(mine.dtype),
                                     limit, *tag(call))
        else:
            out.copy_(mine)

    def _host_sum(self, ptr: int, n: int, code: int, limit: float, call: Optional[Call]) -> None:
        if self._channel is not None:
            self._channel.all_reduce_sum(ptr, n, code, limit, 1.0, 1.0, *tag(call))

    def _host_broadcast(self, ptr: int, n: int, code: int, limit: float, call: Optional[Call], root: int = 0) -> None:
        """From this host's local rank `root` (its leader unless said)."""
        if self._channel is not None:
            self._channel.broadcast(ptr, n, code, root, limit, *tag(call))

    def _host_barrier(self, limit: float, call: Optional[Call]) -> None:
        if self._channel is not None:
            self._channel.barrier(limit, *tag(call))

    def _host_order(self, per_rank: torch.Tensor) -> torch.Tensor:
        """per_rank: world_size blocks in rank order -> the same blocks grouped by host, hosts in order."""
        blocks = per_rank.view(self.world_size, -1)
        return torch.cat([blocks[h] for h in self._hosts]).reshape(-1)

    # ------------------------------------------------------------------ between the hosts' leaders
    def _host_step(self, call: Optional[Call], limit: float, step: Callable[[], None]) -> None:
        """Step (1); a leader whose step failed tells the other leaders at once (its record, ok=False)."""
        try:
            step()
        except Exception:
            self._tell_leaders(call, limit)
            raise

    def _start_record(self, call: Optional[Call], payload: Optional[torch.Tensor] = None,
                      ok: bool = True) -> Optional[Record]:
        """A leader's record exchange with the other hosts' leaders, started (Note [The check folded into
        the data] in calls.py): the call, this host's verdict and `payload`. None when this process leads no
        host, or the call was compared already and there is no payload (a later step of the same call
        sends only its data, under a call of its own)."""
        lead = self._leaders
        if lead is None:
            return None
        if call is None or call.checked:
            if payload is None:
                return None
            call = Call(0, payload.numel(), "payload")   # only the data: the calls were compared
        return start_record(lead.group, call, lead.me, len(lead.labels), payload, labels=lead.labels,
                            where="between the hosts' leaders", ok=ok)

    def _finish_record(self, record: Record, limit: float) -> list:
        """The leaders' payloads in their group's order; a mismatch aborts this host's channel with it."""
        try:
            return record.finish(max(limit - BACKSTOP_S, 1e-3))
        except CallMismatchError as e:
            self.abort(str(e), mismatch=True)
            raise
        except Exception as e:   # noqa: BLE001 (a step (2) failure, after the host is told)
            self._failed_between_hosts("the calls' check", e)
            raise   # not reached: _failed_between_hosts raises

    def _leaders_record(self, call: Optional[Call], limit: float, payload: Optional[torch.Tensor] = None,
                        ok: bool = True) -> Optional[list]:
        """_start_record, then its finish (None: no exchange)."""
        record = self._start_record(call, payload, ok)
        return None if record is None else self._finish_record(record, limit)

    def _tell_leaders(self, call: Optional[Call], limit: float) -> None:
        """This host's step (1) failed: its leader says so in the calls' exchange (best effort, bounded)."""
        try:
            self._leaders_record(call, limit, ok=False)
        except Exception:   # noqa: BLE001 (the host's own error is the one raised)
            pass

    def _leaders_exchange(self, call: Optional[Call], limit: float, what: str, start: Callable[[Any], Any]) -> None:
        """Step (2) on the leaders' group, after the record that compares the calls."""
        self._leaders_record(call, limit)
        self._between_hosts(what, start(self._leaders.group), limit)

    def _between_hosts(self, what: str, work: Any, limit: float) -> None:
        """Waits for a gloo work until the call's deadline: a primitive's `limit` is the deadline plus
        BACKSTOP_S (Note [One deadline per call] in runner.py), which only the channel's waits get."""
        try:
            work.wait(datetime.timedelta(seconds=max(limit - BACKSTOP_S, 1e-3)))
        except Exception as e:   # noqa: BLE001 (re-raised, after the host's channel is told)
            self._failed_between_hosts(what, e)

    def _failed_between_hosts(self, what: str, e: BaseException) -> None:
        role = " (the leader of its host)" if self._local == 0 else ""
        why = f"rank {self.rank}{role}: {what} between the hosts failed: {e}"
        self.abort(why)
        if is_timeout(e):
            raise TimeoutError(why) from e
        raise RuntimeError(why) from e


class _Pipe:
    """Steps (1)-(3) of Note [Several hosts] over `flat`, chunk after chunk, DEPTH chunks in flight: the
    all-reduce's sum, or with `source` a broadcast from the ranks of host `source` (which hold the data)."""

    def __init__(self, hosts: HostsTransport, flat: torch.Tensor, limit_at: "_Deadline", call: Optional[Call],
                 source: Optional[int] = None):
        self.h, self.flat, self.limit_at, self.call = hosts, flat, limit_at, call
        self.source = source
        self.sends = source is not None and hosts._mine is hosts._hosts[source]
        esize = flat.element_size()
        self.chunks: List[tuple] = []   # (first element, elements, the chunk's size is fixed by its place)
        at = 0
        for nbytes in chunk_plan(flat.numel() * esize, hosts._K):
            self.chunks.append((at, nbytes // esize))
            at += nbytes // esize
        self.pending: deque = deque()
        self.stage_in: Optional[torch.Tensor] = None
        self.stage_out: Optional[torch.Tensor] = None
        self.spare: List[torch.Tensor] = []

    def run(self) -> None:
        """Every chunk: started in order, DEPTH at most in flight, the oldest finished first."""
        for lo, n in self.chunks:
            if len(self.pending) >= depth():
                self._finish(self.pending.popleft())
            self._start(self.flat[lo:lo + n])
        while self.pending:
            self._finish(self.pending.popleft())

    def _start(self, chunk: torch.Tensor) -> None:
        """Step (1) and the start of (2) of one chunk: `mine` holds this rank's lanes' shards side by side."""
        h, K, p = self.h, self.h._K, len(self.h._mine)
        layout = _Layout(h._lanes_of, -(-chunk.numel() // K), chunk.numel())
        if self.sends and layout.direct:   # the chunk as it lies: this rank's lanes' shards are its region
            mine = chunk[h._local * layout.region:(h._local + 1) * layout.region]
        else:
            mine = _room(self.spare.pop() if self.spare else None, layout.region, chunk.dtype)[:layout.region]
        if self.source is None:                                                                  # (1)
            if layout.direct:
                h._host_reduce_scatter(chunk, mine, self.limit_at(), self.call)
            else:
                self.stage_in = _room(self.stage_in, p * layout.region, chunk.dtype)
                src = self.stage_in[:p * layout.region]
                layout.scatter_in(chunk, src)
                h._host_reduce_scatter(src, mine, self.limit_at(), self.call)
        elif self.sends and not layout.direct:   # the root's host lays its lanes' shards out (a receiver's
            layout.region_of(chunk, h._local, mine)   # `mine` is what step (2) writes)
        pieces = [(lane, mine[i * layout.shard:(i + 1) * layout.shard]) for i, lane in enumerate(h._lanes)]
        if self.source is None:                                                                  # (2)
            works = [h._lane_sum(lane, piece) for lane, piece in pieces]
        else:
            works = [h._lane_send(lane, piece, self.source) for lane, piece in pieces]
        self.pending.append((chunk, layout, mine, works))

    def _finish(self, item: tuple) -> None:
        """Step (2)'s end and step (3) of one chunk."""
        chunk, layout, mine, works = item
        h = self.h
        what = "all_reduce" if self.source is None else "broadcast"
        for work, piece, rows in works:
            h._between_hosts(what, work, self.limit_at())
            if rows is not None:   # two hosts: the lane's members add both shards, in group order
                piece.copy_(sum_in_order(list(rows)))
        if not self.sends:   # (the root's host holds the chunk already)
            p = len(h._mine)
            if layout.direct:
                h._host_all_gather(mine, chunk, self.limit_at(), self.call)                    # (3)
            else:
                self.stage_out = _room(self.stage_out, p * layout.region, chunk.dtype)
                out = self.stage_out[:p * layout.region]
                h._host_all_gather(mine, out, self.limit_at(), self.call)
                layout.gather_out(out, chunk)
        if not (self.sends and layout.direct):   # a buffer of this pipe's own, not a view of the data
            self.spare.append(mine)


_SUM = AllreduceOptions()
_SUM.reduceOp = ReduceOp.SUM
_GATHER = AllgatherOptions()


class _Deadline:
    """The limit left of a step's `limit` (seconds), as each sub-step starts."""

    def __init__(self, limit: float):
        import time

        self._clock = time.monotonic
        self._end = self._clock() + limit

    def __call__(self) -> float:
        return max(self._end - self._clock(), 1e-3)


def _room(buf: Optional[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
    """`buf` when it holds n elements of dtype, else a new buffer that does (grown, never shrunk)."""
    if buf is not None and buf.numel() >= n and buf.dtype == dtype:
        return buf
    return torch.empty(max(n, 1), dtype=dtype)
