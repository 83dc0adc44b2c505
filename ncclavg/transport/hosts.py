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
The user's call is compared within each host by step 1's round (Note [Call signatures] in
csrc/transport/shm_calls.cpp) and between the hosts by the lane-0 processes (the hosts' leaders) beside the
first chunk's data (Note [The check beside the data] in calls.py); a leader that finds a difference
aborts its host's channel with it, so every process of every host fails naming both calls. A leader whose
host's step 1 failed says so in that exchange, and the other hosts' leaders fail at once.
reduce_scatter_sum, all_gather and broadcast run through the hosts' leaders (lane 0): (1) within the host,
(2) between the leaders, beside the check, (3) within the host again, each byte crossing the network
once: a reduce-scatter sends every other host only the slices of its ranks (one all_to_all with per-host
sizes) and sums what it receives in host order (fp32 accumulation, one rounding); an all-gather exchanges
the hosts' blocks (no padding to the largest host); a broadcast is from rank 0, the leader of the first
host. A leader whose step (2) fails aborts its host's channel with the reason, so that its host's other
processes fail at once instead of waiting out the timeout.
"""
from __future__ import annotations

import datetime
import os
from collections import deque
from typing import Any, Callable, List, Optional

import torch
from torch._C._distributed_c10d import AllreduceOptions, AllToAllOptions, BroadcastOptions, ReduceOp

from ..buffers import channel_type_code
from ..errors import is_timeout
from .calls import FOLD_BYTES, Call, CallMismatchError, exchange_record
from .reductions import as_bytes, sum_in_order
from .runner import BACKSTOP_S
from .shm import tag

# Note [The pipeline's chunk]
# CHUNK_BYTES: the bytes of one chunk of an all-reduce between hosts; DEPTH: the chunks on the wire at
# once. Measured with bench/hosts.py (docs/scaling_out.md has the figures): a chunk has a fixed cost (a
# channel round each way, a gloo operation, ~100-200 us on 2 cores) that a chunk of 1 MiB amortises to a
# few percent at 2.5 Gbit/s, and the pipeline's fill and drain cost about one chunk's wire time, which is
# why a chunk is not larger; two in flight keep each lane's connection busy while the host steps of the
# next chunk run (a gloo group runs two operations at once: its two worker threads). NCCLAVG_HOSTS_CHUNK_KB
# and NCCLAVG_HOSTS_DEPTH override them (measuring, tests of chunk boundaries).
CHUNK_BYTES = 1 << 20
DEPTH = 2


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
        stage.zero_()
        s, n = self.shard, chunk.numel()
        for l, lanes in enumerate(self.lanes_of):
            for i, k in enumerate(lanes):
                lo, hi = min(n, k * s), min(n, (k + 1) * s)
                if hi > lo:
                    at = l * self.region + i * s
                    stage[at:at + hi - lo].copy_(chunk[lo:hi])

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
        between hosts (None: the step's reader scans)."""
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        flat = t.view(-1)
        head = flat[:min(flat.numel(), FOLD_BYTES // flat.element_size())]
        self._folded_sum(head, limit, call)
        if flat.numel() > head.numel():
            self._pipelined_sum(flat[head.numel():], _Deadline(limit), call)

    def _folded_sum(self, head: torch.Tensor, limit: float, call: Optional[Call]) -> None:
        """The call's first FOLD_BYTES (all of a small one), summed in the call's first exchange between
        the hosts (Note [The check folded into the data] in calls.py): within the host through the channel,
        the leaders' records, each leader adding the hosts' sums in host order, then a round in which the
        host's other ranks take the leader's sum (or find the channel aborted: the calls differ)."""
        code = channel_type_code(head.dtype)
        self._host_step(call, limit, lambda: self._host_sum(head.data_ptr(), head.numel(), code, limit, call))
        lead = self._leaders
        if lead is not None:
            rows = self._leaders_record(call, limit, as_bytes(head))
            if rows:
                head.copy_(sum_in_order([r.view(head.dtype) for r in rows]))
        self._host_broadcast(head.data_ptr(), head.numel(), code, limit, call)

    def _pipelined_sum(self, flat: torch.Tensor, limit_at: "_Deadline", call: Optional[Call]) -> None:
        """Steps (1)-(3) of Note [Several hosts] on `flat`, chunk after chunk, DEPTH chunks in flight."""
        n, K, p = flat.numel(), self._K, len(self._mine)
        per = max(K, chunk_bytes() // flat.element_size() // K * K)   # elements of a chunk: K whole shards
        pending: deque = deque()
        stage_in = stage_out = None
        spare: List[torch.Tensor] = []
        for lo in range(0, n, per):
            chunk = flat[lo:min(n, lo + per)]
            layout = _Layout(self._lanes_of, -(-chunk.numel() // K), chunk.numel())
            if layout.direct:
                src = chunk
            else:
                stage_in = _room(stage_in, p * layout.region, flat.dtype)
                src = stage_in[:p * layout.region]
                layout.scatter_in(chunk, src)
            mine = _room(spare.pop() if spare else None, layout.region, flat.dtype)[:layout.region]
            self._host_reduce_scatter(src, mine, limit_at(), call)                                # (1)
            works = [lane.group.allreduce([mine[i * layout.shard:(i + 1) * layout.shard]], _SUM)      # (2)
                     for i, lane in enumerate(self._lanes)]
            pending.append((chunk, layout, mine, works))
            if len(pending) >= depth():
                stage_out = self._finish(pending.popleft(), limit_at, call, stage_out, spare)
        while pending:
            stage_out = self._finish(pending.popleft(), limit_at, call, stage_out, spare)

    def _finish(self, item: tuple, limit_at: "_Deadline", call: Optional[Call], stage_out: Any, spare: list) -> Any:
        """Step (2)'s end and step (3) of one chunk."""
        chunk, layout, mine, works = item
        for w in works:
            self._between_hosts("all_reduce", w, limit_at())
        p = len(self._mine)
        if layout.direct:
            self._host_all_gather(mine, chunk, limit_at(), call)                              # (3)
        else:
            stage_out = _room(stage_out, p * layout.region, chunk.dtype)
            out = stage_out[:p * layout.region]
            self._host_all_gather(mine, out, limit_at(), call)
            layout.gather_out(out, chunk)
        spare.append(mine)
        return stage_out

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
        if root != 0:
            raise ValueError(f"root: between hosts only rank 0 broadcasts, got {root}")
        if call is not None:   # (1): the host's ranks agree on the call before the hosts move data
            self._host_step(call, limit, lambda: self._host_barrier(limit, call))
        if self._leaders is not None:
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = self._leaders.labels.index(self._hosts[0][0]), 0
            self._leaders_exchange(call, limit, "broadcast", lambda g: g.broadcast([t.view(-1)], opts))
        self._host_broadcast(t.data_ptr(), t.numel(), channel_type_code(t.dtype), limit, call)

    def check(self, call: Call, limit: float) -> None:
        """(1) the host's ranks agree, (2) the leaders agree, (3) a round in which the host's other ranks
        learn the leader's verdict (it aborts the channel on a mismatch)."""
        self._host_step(call, limit, lambda: self._host_barrier(limit, call))
        self._leaders_record(call, limit)
        self._host_barrier(limit, call)

    def broadcasts_from(self, root: int) -> bool:
        return root == 0

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

    def _host_broadcast(self, ptr: int, n: int, code: int, limit: float, call: Optional[Call]) -> None:
        if self._channel is not None:
            self._channel.broadcast(ptr, n, code, 0, limit, *tag(call))

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

    def _leaders_record(self, call: Optional[Call], limit: float, payload: Optional[torch.Tensor] = None,
                        ok: bool = True) -> Optional[list]:
        """A leader's record exchange with the other hosts' leaders (Note [The check folded into the data]
        in calls.py): the call, this host's verdict and `payload`; the leaders' payloads in their order, or
        None when this process leads no host or the call was compared already (a later step of the same
        call: a plain exchange of the payloads then). A mismatch aborts this host's channel with it."""
        lead = self._leaders
        if lead is None:
            return None
        if call is None or call.checked:
            if payload is None:
                return None
            call = Call(0, payload.numel(), "payload")   # only the data: the calls were compared
        try:
            return exchange_record(lead.group, call, lead.me, len(lead.labels), max(limit - BACKSTOP_S, 1e-3),
                                   payload, labels=lead.labels, where="between the hosts' leaders", ok=ok)
        except CallMismatchError as e:
            self.abort(str(e), mismatch=True)
            raise
        except Exception as e:   # noqa: BLE001 (a step (2) failure, after the host is told)
            self._failed_between_hosts("the calls' check", e)

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


_SUM = AllreduceOptions()
_SUM.reduceOp = ReduceOp.SUM


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
