"""Setting up a group's host channels (Note [When the shared-memory channel is used] in shm.py): one
`ShmTransport` when every process is on one host; across several hosts the lanes on UCX
(ucx.UcxHostsTransport, Note [Choosing UCX between hosts] in ucx.py), else a `HostsTransport` (hosts.py,
its lanes' gloo groups between the hosts) when some processes share a host, else None (every process alone
on its host: torch.distributed's gloo). Both faces call `connect`: the Communicator over its torch.distributed group, the
torch backend over its group's store.
"""
from __future__ import annotations

import datetime
import os
import secrets
import warnings
from typing import Any, Callable, Optional, Union

from .._ext import _C
from ..errors import CommError
from .host_pipes import depth
from .host_layout import HostsLayout
from .hosts import HostsTransport, make_lanes
from .liveness import _next_index
from .shm import ShmTransport, setting, slot_bytes
from .ucx import UcxHostsTransport, start as start_ucx


def gloo_backend(store: Any, me: int, size: int, timeout: datetime.timedelta, threads: int) -> Any:
    """A gloo backend (torch's ProcessGroupGloo) of `size` ranks over `store`, this process `me`, with
    `threads` worker threads: a lane keeps DEPTH operations on the wire at once, and gloo runs as many at
    once as it has threads (Note [The pipeline's chunk] in host_pipes.py). Its devices as torch makes them:
    the interfaces GLOO_SOCKET_IFNAME names (comma-separated), else the hostname's."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    opts._devices = ([dist.ProcessGroupGloo.create_device(interface=n.strip()) for n in names] if names else
                     [dist.ProcessGroupGloo.create_default_device()])
    opts._threads = max(2, int(threads))
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, me, size, opts)


def dist_group_maker(dist: Any, group: Any, timeout: float) -> Callable[[list], Any]:
    """make_group for `connect` through torch.distributed: a gloo backend of the given ranks of `group`
    over torch.distributed's default store, under a prefix of this communicator's own (Note [Heartbeat
    keys per group] in liveness.py). Not dist.new_group: with use_local_synchronization its group name
    counts the groups each process made before, which differs between the processes of a lane whenever
    one of them carries several lanes."""
    store = dist.distributed_c10d._get_default_store()
    members = "world" if group is None else ",".join(map(str, dist.get_process_group_ranks(group)))
    prefix = f"ncclavg/lanes/{members}/{_next_index('lanes ' + members)}/"

    def make(ranks: list) -> Any:
        ranks = sorted(ranks)
        lane_store = dist.PrefixStore(prefix + ",".join(map(str, ranks)) + "/", store)
        return gloo_backend(lane_store, ranks.index(dist.get_rank(group)), len(ranks),
                            datetime.timedelta(seconds=timeout), depth())
    return make


def hosts_of(identities: list) -> list:
    """Group ranks per host (host identities equal), hosts in the order of their lowest rank."""
    hosts: list = []
    for r, ident in enumerate(identities):
        found = next((h for h in hosts if identities[h[0]] == ident), None)
        if found is None:
            hosts.append([r])
        else:
            found.append(r)
    return hosts


def connect(rank: int, world: int, exchange: Callable[[Any], list], identities: list, timeout: float,
            make_group: Optional[Callable[[list], Any]] = None
            ) -> Optional[Union[ShmTransport, HostsTransport, UcxHostsTransport]]:
    """Collective: a transport when processes of the group share hosts, else None. `exchange(obj)`: every
    rank's `obj`, in rank order (one object per rank, all ranks calling; the caller bounds it), the
    setup's only exchange on one host; `identities`: every rank's shm.host_identity(); `make_group(ranks)`:
    a c10d process group (gloo) of those group ranks, called by them alone (several hosts: the lanes)."""
    mode = setting()
    if mode == "off" or world < 2:
        return None
    hosts = hosts_of(identities)
    if len(hosts) == world:
        if mode == "on":
            raise CommError("NCCLAVG_SHM=1 but no two processes of this group are on one host (or in one "
                            "network namespace): the shared-memory channel needs that")
        return start_ucx(hosts, rank, None, exchange, timeout)
    mine = next(h for h in hosts if rank in h)
    local, leader = mine.index(rank), mine[0]
    size = slot_bytes(len(mine))
    # every host's leader creates its host's segment (a host of one process has none), then the others
    # open it; one exchange for the names, one for the outcome: every process decides the same
    channel, error, offer = None, "", None
    if local == 0 and len(mine) > 1:
        offer = (f"ncclavg-{secrets.token_hex(8)}", secrets.randbits(63))
        try:
            channel = _C.ShmChannel(offer[0], 0, len(mine), size, offer[1], mine)   # errors name group ranks
        except (RuntimeError, ValueError) as e:
            error = f"rank {rank}: {e}"
    offers = exchange((offer, error))
    if local > 0 and not offers[leader][1]:
        name, nonce = offers[leader][0]
        try:
            channel = _C.ShmChannel(name, local, len(mine), size, nonce, mine)
        except (RuntimeError, ValueError) as e:
            error = f"rank {rank}: {e}"
    errors = [e for e in exchange(error) if e]
    if local == 0 and channel is not None:
        channel.close_door()   # everyone has joined (or given up)
    lanes: list = []
    if not errors and len(hosts) > 1:
        native = start_ucx(hosts, rank, channel, exchange, timeout)
        if native is not None:
            return native
        try:
            lanes = make_lanes(HostsLayout(hosts, rank), make_group)
        except Exception as e:   # noqa: BLE001 (the others fail at their next collective, bounded)
            raise CommError(f"rank {rank}: the gloo groups between the hosts could not be made: {e}") from e
    if errors:
        if mode == "on":
            raise CommError(f"NCCLAVG_SHM=1 but the shared-memory channel could not be set up: {errors[0]}")
        warnings.warn(f"ncclavg: the gloo backend stays on torch.distributed; the shared-memory channel "
                      f"could not be set up: {errors[0]}", RuntimeWarning, stacklevel=3)
        return None
    if len(hosts) == 1:
        return ShmTransport(channel, rank, world)
    return HostsTransport(channel, HostsLayout(hosts, rank), lanes)
