"""Which process was lost: every process of a multi-process communicator or `ncclavg` process group bumps
a counter in the group's store from one daemon thread per process; after a collective failed or timed
out, the survivor reads the counters twice and names the ranks whose counter stopped. Both faces use
this module: `Liveness.for_group` for the Communicator over torch.distributed (comm/gloo.py), a
`Liveness` in each backend group's own store for the torch backend (process_group/group.py).

Note [Naming the lost rank]
A collective that fails says only what this process saw: "Connection closed by peer" after a peer died,
nothing at all (a timeout) when a peer froze (SIGSTOP, a stuck kernel, a debugger). Which rank is gone
is what the user needs. The store torchrun (or init_process_group) set up is shared by every process
and outlives most failures, so each process adds 1 to its key `<prefix><rank>` every PERIOD_S; a
killed or frozen process stops counting. A survivor whose collective failed first marks itself failed
(`<prefix>failed/<rank>`): it is alive, and may stop counting soon because it exits with the error,
which must not make it look lost to a slower survivor. It then reads every counter, waits 2.5 periods
and reads them again (at most DIAGNOSE_S in all, on a helper thread, so a store that no longer answers,
e.g. one hosted by the dead process under init_method="tcp://", cannot prolong the failure), and names
the ranks that did not count. The cost while healthy: one store round trip per group every PERIOD_S
per process, all from one thread, off the training thread. Only a lost or frozen peer is diagnosed: a
mismatch or a bad argument is an error of its own that names both calls at once.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from . import failure as F

PERIOD_S = 0.5
DIAGNOSE_S = 2.0
# Note [Heartbeat keys per group]
# Two communicators over the same processes must not share keys, so each gets a number. A process-wide
# count would drift between ranks that build communicators over different groups (rank 0 builds one
# over ranks {0, 1}, then one over every rank; rank 2 builds only the second: 1 on rank 0, 0 on rank 2),
# and the survivors would read each other's counters under different keys and name the wrong rank. The
# members of a group build its communicators together and in the same order, so a count per member set
# gives every member the same number.
_SEQ: dict = {}
_SEQ_LOCK = threading.Lock()


def _next_index(members: str) -> int:
    """The number of communicators this process made before over the member set `members` (Note
    [Heartbeat keys per group]): the same on every member."""
    with _SEQ_LOCK:
        n = _SEQ.get(members, 0)
        _SEQ[members] = n + 1
        return n


class _Beats:
    """The process's one heartbeat thread: adds 1 to every registered (store, key) every PERIOD_S. A
    store that fails is dropped (its host is gone: nobody is left to tell)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: List[Tuple[Any, str]] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def _after_fork(self) -> None:
        """In a forked child: the parent's thread and entries are not this process's."""
        self._lock = threading.Lock()
        self._entries, self._thread, self._stop = [], None, threading.Event()

    def add(self, store: Any, key: str) -> None:
        store.add(key, 1)   # exists before the first collective can fail; raises if the store refuses
        with self._lock:
            self._entries.append((store, key))
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._beat, name="ncclavg-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, store: Any, key: str) -> None:
        with self._lock:
            self._entries = [(s, k) for s, k in self._entries if not (s is store and k == key)]

    def _drop_store(self, store: Any) -> None:
        with self._lock:
            self._entries = [(s, k) for s, k in self._entries if s is not store]

    def _beat(self) -> None:
        while not self._stop.wait(PERIOD_S):
            with self._lock:
                entries = list(self._entries)
            for store, key in entries:
                try:
                    store.add(key, 1)
                except Exception:   # noqa: BLE001 (a store that is gone has nobody left to tell)
                    self._drop_store(store)

    def count(self) -> int:
        with self._lock:
            return len(self._entries)

    def stop(self) -> None:
        """At exit: no thread of ours may touch a store while the interpreter shuts down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * PERIOD_S)


BEATS = _Beats()
os.register_at_fork(after_in_child=BEATS._after_fork)


class Liveness:
    """Heartbeats of one group's processes in `store` under `prefix`; `diagnose()` names the ranks lost.
    Raises what the store raises when it refuses the first key (callers then run without heartbeats)."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str):
        self._store = store
        self._rank, self._world = rank, world
        self._prefix = prefix
        self._stopped = False
        BEATS.add(store, self._key(rank))

    @classmethod
    def for_group(cls, dist: Any, group: Any, rank: int, world: int) -> Optional["Liveness"]:
        """A communicator's heartbeats in torch.distributed's default store, or None when there is no
        store to use (the failure messages then name no rank)."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None
        members = "world" if group is None else ",".join(map(str, dist.get_process_group_ranks(group)))
        prefix = f"ncclavg/alive/{members}/{_next_index(members)}/"   # Note [Heartbeat keys per group]
        try:
            return cls(store, rank, world, prefix)
        except RuntimeError:   # the store refused a key: run without heartbeats
            return None

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _failed_key(self, rank: int) -> str:
        return f"{self._prefix}failed/{rank}"

    def diagnose(self) -> str:
        """' (rank 2 stopped responding: heartbeat stopped)' or '' when every rank still counts, or a
        note that the store did not answer within DIAGNOSE_S. See Note [Naming the lost rank]."""
        return diagnose(self._store, self._rank, self._world, self._key, self._failed_key)

    def mark_failed(self) -> None:
        """This rank's collective failed: it is alive, and may stop beating soon because it exits with the
        error (Note [Naming the lost rank]). Bounded: on a helper thread, given up after a moment when
        the store does not answer."""
        t = threading.Thread(target=_add_quietly, args=(self._store, self._failed_key(self._rank)),
                             name="ncclavg-mark-failed", daemon=True)
        t.start()
        t.join(PERIOD_S)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            BEATS.remove(self._store, self._key(self._rank))


def _add_quietly(store: Any, key: str) -> None:
    try:
        store.add(key, 1)
    except Exception:   # noqa: BLE001 (the store's host is gone: nothing to tell)
        pass


def store_address(store: Any) -> str:
    """"host:port" of the TCP store under `store` (through PrefixStores), or "" when it has none."""
    for _ in range(16):
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host is not None and port is not None:
            return f"{host}:{port}"
        store = getattr(store, "underlying_store", None)
        if store is None:
            return ""
    return ""


def diagnose(store: Any, rank: int, world: int, key: Callable[[int], str], failed_key: Callable[[int], str]) -> str:
    """Names the ranks whose heartbeat counter `key(r)` in `store` stopped: this rank marks itself failed
    (`failed_key(rank)`), reads every counter twice, 2.5 periods apart, on a helper thread bounded by
    DIAGNOSE_S. ' (rank 2 stopped responding: heartbeat stopped)', '' when every rank still beats, or a
    note that the store did not answer. See Note [Naming the lost rank]."""
    found: list = []

    def look() -> None:
        try:
            store.add(failed_key(rank), 1)
            before = [int(store.add(key(r), 0)) for r in range(world)]
            time.sleep(2.5 * PERIOD_S)
            after = [int(store.add(key(r), 0)) for r in range(world)]
            failed = [int(store.add(failed_key(r), 0)) for r in range(world)]
        except Exception:   # noqa: BLE001 (the store's host is gone: "unknown", said by the caller)
            return
        found.append([r for r in range(world) if r != rank and after[r] == before[r] and not failed[r]])

    t = threading.Thread(target=look, name="ncclavg-diagnose", daemon=True)
    t.start()
    t.join(DIAGNOSE_S)
    if not found:   # the store's host, or the way to it, is gone: say where it was
        where = store_address(store)
        return (f" (which rank was lost is unknown: the store at {where} did not answer, so its host or the "
                "link to it was lost)" if where else " (which rank was lost is unknown: the store did not answer)")
    lost = found[0]
    if not lost:
        return ""
    return F.lost(lost, "heartbeat stopped")
