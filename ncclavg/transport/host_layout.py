"""Which process carries which lane between hosts: `HostsLayout`, the one layout both engines between
hosts read (UCX's native lanes in the core, gloo's lanes in hosts.py and host_pipes.py). The rule itself is
the core's (`_C.LaneLayout`, csrc/transport/host_lanes.h), so that the two engines cannot disagree on it;
this object keeps the lists the Python pipelines ask for on every chunk, made once.

Note [Lanes and their carriers]
K, the number of lanes, is the largest number of processes on one host. Host h with P_h processes gives
lane k to its local rank k % P_h (its carrier), so on a host with fewer processes a process carries
several lanes, and a host of one process carries all K. Each chunk of an all-reduce or broadcast is cut into
K shards, shard k on lane k. A reduce-scatter or an all-gather moves slices instead: lane k carries the
slice of local rank k of every host that has one (its "slice owner"), so a rank's own slice goes on the
wire from the process that holds it.
"""
from __future__ import annotations

from typing import List, Optional

from .._ext import _C


class HostsLayout:
    """The lanes of a group on several hosts, seen from group rank `rank`. `hosts`: every host's group
    ranks (ascending, hosts in the order of their lowest rank); `host`, `mine`, `local`: this process's
    host, that host's ranks and its index among them; `lanes`: K; `lanes_of[l]`: the lanes local rank l of
    this host carries; `slots[l]`: the slices those lanes carry, in order (the pipelines' regions)."""

    def __init__(self, hosts: List[List[int]], rank: int):
        self.core = _C.LaneLayout(hosts, rank)   # raises ValueError naming `hosts` or `rank`
        self.hosts = [list(h) for h in hosts]
        self.rank, self.host, self.local = rank, self.core.host, self.core.local
        self.mine = self.hosts[self.host]
        self.lanes = self.core.lanes
        self.world_size = sum(len(h) for h in self.hosts)
        self.lanes_of = [self.core.lanes_of(l) for l in range(len(self.mine))]
        self.slots = [[r for k in ks for r in self.slices(k) if r is not None] for ks in self.lanes_of]

    def owners(self, lane: int) -> List[int]:
        """The group ranks that carry `lane`, one per host, in host order."""
        return [self.core.carrier(h, lane) for h in range(len(self.hosts))]

    def slices(self, lane: int) -> List[Optional[int]]:
        """Whose slice each member of `lane`'s group (its ranks ascending, the order of a gloo group over
        them) carries: local rank `lane` of the member's host, None where that host has no such process."""
        by_rank = sorted(range(len(self.hosts)), key=lambda h: self.core.carrier(h, lane))
        return [o if (o := self.core.slice_owner(h, lane)) >= 0 else None for h in by_rank]
