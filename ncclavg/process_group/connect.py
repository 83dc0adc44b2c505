"""Setting up the `ncclavg` torch.distributed backend's transports (group.py): the host channel a
process group's CPU collectives use (transport/host_setup.py's `connect`, exactly as GlooCommunicator
chooses it) and the runner over it, one per group; and the heartbeats that name a lost rank.

Note [One channel per group]
Each process group of the backend is created by torch (init_process_group, new_group, a DeviceMesh),
every member calling the backend's creator at the same point, and each gets a runner and a host channel
of its own, also when its members are those of an earlier group: torch lets two groups with the same
members be used at the same time from different threads (DDP's reducer thread and the user's, pipeline
schedules, FSDP's streams of collectives), each group's collectives in its own order, as gloo's
separate connections allow. One channel shared by such groups would pair the collectives of one group
on one rank with those of the other on another. A channel costs a segment of about 2 x processes x slot
(Note [When the shared-memory channel is used] in shm.py), freed when its group is destroyed.

The setup runs before torch has registered the group, so torch.distributed's functions cannot be used
on it: host_setup.connect's exchanges (the host identities, the segment's name, each rank's outcome)
go through the group's store (`_store_exchange`), and across hosts the lanes' gloo groups are gloo
backends made over the same store (`_gloo_group_maker`).

Note [Naming the lost rank from the backend]
The channel names a peer that exited itself (it watches the pids). A frozen peer, or one lost across
hosts, is named from heartbeats, the communicators' own (ncclavg/transport/liveness.py, Note [Naming the
lost rank]): every process adds 1 to `ncclavg/alive/<group rank>` in each of its groups' stores every
PERIOD_S (the one heartbeat thread of the process, for every group and communicator); a survivor whose
collective failed marks itself failed, reads the counters twice 2.5 periods apart (bounded, on a helper
thread: the store may be gone with rank 0) and names the ranks whose counter stopped.
"""
from __future__ import annotations

import datetime
import itertools
import pickle
import weakref
from typing import Any, Callable, List, Optional

from torch._C._distributed_c10d import PrefixStore

from ..transport import host_pipes, host_setup, shm
from ..transport.liveness import Liveness
from ..transport.runner import BACKSTOP_S, Runner
from .face import FACE, BackendError

host_identity = shm.host_identity   # the tests replace it to pretend several hosts


# ---------------------------------------------------------------------------------------------- heartbeats
def heartbeats(store: Any, rank: int, size: int) -> Optional[Liveness]:
    """The heartbeats of one process group in its own store (Note [Naming the lost rank from the
    backend]), or None for a group of one or a store that refuses keys (errors then name nobody)."""
    if size < 2:
        return None
    try:
        return Liveness(store, rank, size, "ncclavg/alive/")
    except Exception:   # noqa: BLE001 (any store error: run without heartbeats)
        return None


# ---------------------------------------------------------------------------------------------- the channel
def _gloo_group_maker(store: Any, rank: int, timeout: datetime.timedelta) -> Callable[[List[int]], Any]:
    """host_setup.connect's make_group: a gloo backend of the given group ranks over the group's store (the
    group is not registered with torch yet: see the module's notes), its timeout the group's own (a lane
    must not wait longer than its group does)."""
    def make(ranks: List[int]) -> Any:
        ranks = sorted(ranks)
        store_of = PrefixStore("ncclavg-lane/" + ",".join(map(str, ranks)) + "/", store)
        return host_setup.gloo_backend(store_of, ranks.index(rank), len(ranks), timeout, host_pipes.depth())
    return make


def _store_exchange(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Callable[[Any], list]:
    """host_setup.connect's exchange over the group's store: round k of every rank under
    `ncclavg/setup/<k>/<rank>`, waited for within the group's timeout (the store's wait raises then)."""
    rounds = itertools.count()

    def exchange(obj: Any) -> list:
        keys = [f"ncclavg/setup/{next(rounds)}/{r}" for r in range(size)]
        store.set(keys[rank], pickle.dumps(obj))
        store.wait(keys, timeout)
        return [pickle.loads(store.get(k)) for k in keys]

    return exchange


def connect_channel(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """Collective over the group: its host channel (transport "shm" or "shm+gloo"), or None (every
    process alone on its host, NCCLAVG_SHM=0, or a failed setup under NCCLAVG_SHM=auto)."""
    if size < 2 or shm.setting() == "off":
        return None
    try:
        exchange = _store_exchange(store, rank, size, timeout)
        identities = exchange(host_identity())
        # the transport's own limit, for what it runs without a call's limit (its setup between hosts): the
        # group's timeout and the backstop; every collective passes its job's (Note [One deadline per call])
        limit = timeout.total_seconds() + BACKSTOP_S
        return host_setup.connect(rank, size, exchange, identities, limit,
                                  make_group=_gloo_group_maker(store, rank, timeout))
    except BackendError:
        raise
    except Exception as e:   # noqa: BLE001 (the reason, in the backend's words)
        raise BackendError(f"ncclavg backend: rank {rank} of {size} could not set up its host channel: {e}") from e


# ---------------------------------------------------------------------------------------------- the runners
_ALL_RUNNERS: "weakref.WeakSet[Runner]" = weakref.WeakSet()


def runner_for(store: Any, rank: int, size: int, timeout: datetime.timedelta,
               liveness: Optional[Liveness]) -> Runner:
    """A new runner over a new host channel for one process group (a collective over the group). See Note
    [One channel per group]; `liveness`: the group's heartbeats, which name a lost rank."""
    transport = connect_channel(store, rank, size, timeout)
    runner = Runner(f"ncclavg-pg-{rank}of{size}", FACE, transport, liveness)
    _ALL_RUNNERS.add(runner)
    return runner


def live_runners() -> List[Runner]:
    return list(_ALL_RUNNERS)
