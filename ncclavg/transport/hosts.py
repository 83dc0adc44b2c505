"""The transport between processes on several hosts (transport "shm+gloo"): each host's shared-memory
channel (shm.py) inside it, torch.distributed between the hosts' leaders. `HostsTransport` offers the
primitives of `ShmTransport` under the same names, so that the runners' jobs (paths.py) call either.

Note [Several hosts]
When the processes span several hosts, a collective runs in three steps, inside a job like any other:
(1) within each host, through its channel; (2) between the hosts' leaders (the lowest rank of each
host), through torch.distributed on a group of the leaders alone; (3) within each host again, from its
leader. So each host sends one message per collective over the network instead of one per process.
- all_reduce_sum: (1) sums the host's processes in rank order, (2) sums the hosts' sums (gloo's order),
  (3) broadcasts the result from the leader: every process of every host gets the leader's bits, so
  they all agree.
- reduce_scatter_sum: (1) sums the host's inputs, (2) each leader sends every other leader only the
  slices of that host's ranks (one all_to_all with per-host sizes) and sums what it receives in host
  order (fp32 accumulation, one rounding), (3) hands each process of its host its slice. The network
  carries each slice once, not the whole vector twice as an all-reduce would.
- all_gather: (1) gathers each host's inputs, (2) the leaders exchange the hosts' blocks with one
  all_to_all whose sizes are the hosts' own (no padding to the largest host) and put them in rank order,
  (3) broadcasts the whole result.
- broadcast is from rank 0, the leader of the first host.
A leader whose step (2) fails aborts its host's channel with the reason, so that its host's other
processes fail at once instead of waiting out the timeout.
The user's call (Note [Call signatures] in csrc/transport/shm_calls.cpp) is compared within each host by
step (1)'s round, and between the hosts by the leaders (one all-gather of two words, before the first
step (2) of the call); a leader that finds a difference aborts its host's channel with it, so every
process of every host fails naming both calls.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch

from ..buffers import channel_type_code
from ..errors import is_timeout
from .calls import Call, CallMismatchError, check_over_gloo
from .shm import stalled_text, tag


class HostsTransport:
    """The processes of a group on several hosts: `channel` this host's (None when this process is alone
    on its host), `hosts` every host's group ranks (ascending, hosts in the order of their lowest rank),
    `leaders` the leaders' process group (this process leads its host) or None, `dist` the
    torch.distributed functions the leaders meet through, `group` the group whose ranks these are."""

    kind = "shm+gloo"
    # a host's channel may carry a leader's abort about a failure between the hosts, which names nobody:
    # the heartbeats are asked then (runner.py)
    names_peers = False
    channel = None   # no one channel over every process: the fast paths are off

    def __init__(self, channel: Any, rank: int, world_size: int, hosts: list, leaders: Any, dist: Any, group: Any):
        self._channel = channel
        self.rank, self.world_size = rank, world_size
        self._hosts, self._leaders, self._dist, self._group = hosts, leaders, dist, group
        self._mine = next(h for h in hosts if rank in h)

    # ------------------------------------------------------------------ the primitives
    def all_reduce_sum(self, t: torch.Tensor, limit: float, call: Optional[Call] = None,
                       divisor: float = 1.0) -> None:
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the channel does not divide")
        ptr, n, code = t.data_ptr(), t.numel(), channel_type_code(t.dtype)
        self._host_step(call, limit, lambda: self._host_sum(ptr, n, code, limit, call))            # (1)
        if self._leaders is not None:                                                            # (2)
            self._between_hosts("all_reduce", lambda: self._dist.all_reduce(
                t, op=self._dist.ReduceOp.SUM, group=self._leaders, async_op=True), limit)
        self._host_broadcast(ptr, n, code, limit, call)                                         # (3)

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
            got = torch.empty(len(self._hosts) * mine.numel(), dtype=out.dtype)
            self._between_hosts("all_to_all", lambda: self._dist.all_to_all_single(
                got, send, [mine.numel()] * len(self._hosts), [len(h) * n for h in self._hosts],
                group=self._leaders, async_op=True), limit)
            parts = got.view(len(self._hosts), -1)
            acc = parts[0].to(torch.float64 if out.dtype == torch.float64 else torch.float32, copy=True)
            for part in parts[1:]:
                acc += part
            mine.copy_(acc)
        self._host_broadcast(mine.data_ptr(), mine.numel(), code, limit, call)                   # (3)
        at = self._mine.index(self.rank) * n
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
            self._between_hosts("all_to_all", lambda: self._dist.all_to_all_single(
                got, mine.repeat(len(self._hosts)), sizes, [mine.numel()] * len(self._hosts),
                group=self._leaders, async_op=True), limit)
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
            src = self._dist.get_global_rank(self._group, 0) if self._group is not None else 0
            self._between_hosts("broadcast", lambda: self._dist.broadcast(
                t, src=src, group=self._leaders, async_op=True), limit)
        self._host_broadcast(t.data_ptr(), t.numel(), channel_type_code(t.dtype), limit, call)

    def check(self, call: Call, limit: float) -> None:
        """(1) the host's ranks agree, (2) the leaders agree, (3) a round in which the host's other ranks
        learn the leader's verdict (it aborts the channel on a mismatch)."""
        self._host_step(call, limit, lambda: self._host_barrier(limit, call))
        self._host_barrier(limit, call)

    def broadcasts_from(self, root: int) -> bool:
        return root == 0

    def divides(self) -> bool:
        return False

    def stalled_on(self) -> str:
        """Words naming the rank of this host a collective of this process waits for now, or "" (a wait
        between the hosts is gloo's: the heartbeats name the lost rank)."""
        return stalled_text(self._channel) if self._channel is not None else ""

    def abort(self, why: str, mismatch: bool = False) -> None:
        if self._channel is not None:
            self._channel.abort(why, mismatch)

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ within the host
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
        """Step (1), then (on a leader) the leaders' check of the call, which runs even when step (1)
        failed: the other hosts' leaders then fail at once instead of at their timeout."""
        try:
            step()
        except Exception as e:   # noqa: BLE001 (re-raised below)
            self._leaders_check(call, limit, ok=False)
            raise e
        self._leaders_check(call, limit)

    def _leaders_check(self, call: Optional[Call], limit: float, ok: bool = True) -> None:
        if call is None or call.checked or self._leaders is None:
            return
        backend = getattr(self._leaders, "backend", self._leaders)   # a group of the backend's setup, or a group
        leaders = [h[0] for h in self._hosts]
        try:
            check_over_gloo(backend, call, leaders.index(self.rank), len(leaders), limit, labels=leaders,
                            where="between the hosts' leaders", ok=ok)
        except CallMismatchError as e:
            self.abort(str(e), mismatch=True)
            raise
        except Exception as e:   # noqa: BLE001 (a step (2) failure, after the host is told)
            if ok:
                self._failed_between_hosts("the calls' check", e)

    def _between_hosts(self, what: str, start: Callable[[], Any], limit: float) -> None:
        try:
            start().wait(timeout=datetime.timedelta(seconds=limit))
        except Exception as e:   # noqa: BLE001 (re-raised, after the host's channel is told)
            self._failed_between_hosts(what, e)

    def _failed_between_hosts(self, what: str, e: BaseException) -> None:
        why = f"rank {self.rank} (the leader of its host): {what} between the hosts failed: {e}"
        self.abort(why)
        if is_timeout(e):
            raise TimeoutError(why) from e
        raise RuntimeError(why) from e
