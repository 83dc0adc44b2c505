"""The heartbeats both faces use (ncclavg/transport/liveness.py): one thread per process beats for every
group and communicator, a stopped one stops counting, a store that fails is dropped without a word, a
forked child starts its own thread, and the diagnosis names exactly the ranks whose counter stopped.
Stores here are in-process stand-ins with torch's `add` semantics (add returns the new value)."""
import os
import threading
import time

import pytest

from ncclavg.transport import liveness as L


class DictStore:
    def __init__(self):
        self.values, self.lock, self.fail = {}, threading.Lock(), False

    def add(self, key, n):
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        with self.lock:
            self.values[key] = self.values.get(key, 0) + n
            return self.values[key]


def _threads():
    return [t for t in threading.enumerate() if t.name == "ncclavg-heartbeat"]


def _wait_until(cond, limit=10 * L.PERIOD_S):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition not met within the bound"
        time.sleep(L.PERIOD_S / 10)


@pytest.mark.slow   # ~4 s of heartbeats
def test_one_thread_beats_for_every_group():
    stores = [DictStore() for _ in range(3)]
    beats = [L.Liveness(s, 0, 2, f"ncclavg/alive/g{i}/") for i, s in enumerate(stores)]
    try:
        assert len(_threads()) == 1
        _wait_until(lambda: all(s.values[f"ncclavg/alive/g{i}/0"] >= 3 for i, s in enumerate(stores)))
        beats[1].stop()
        frozen = stores[1].values["ncclavg/alive/g1/0"]
        _wait_until(lambda: stores[0].values["ncclavg/alive/g0/0"] >= frozen + 3)
        # a beat already under way when stop() came may land once more, no further
        assert stores[1].values["ncclavg/alive/g1/0"] <= frozen + 1
        stores[2].fail = True   # its host is gone: dropped, nothing printed, the others go on
        n = stores[0].values["ncclavg/alive/g0/0"]
        _wait_until(lambda: stores[0].values["ncclavg/alive/g0/0"] >= n + 2)
        assert len(_threads()) == 1
    finally:
        for b in beats:
            b.stop()


def test_a_store_that_refuses_the_first_key_raises():
    store = DictStore()
    store.fail = True
    with pytest.raises(RuntimeError):
        L.Liveness(store, 0, 2, "p/")


def test_the_diagnosis_names_the_rank_that_stopped():
    store = DictStore()
    me = L.Liveness(store, 0, 3, "x/")
    other = L.Liveness(store, 2, 3, "x/")   # rank 2 beats from this process too; rank 1 never does
    store.add("x/1", 1)
    try:
        assert me.diagnose() == " (rank 1 stopped responding: heartbeat stopped)"
        other.stop()
        assert me.diagnose() == " (ranks 1, 2 stopped responding: heartbeat stopped)"
        store.add("x/failed/1", 1)   # a survivor that failed first is not lost
        assert me.diagnose() == " (rank 2 stopped responding: heartbeat stopped)"
    finally:
        me.stop()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_beats_from_its_own_thread():
    parent = L.Liveness(DictStore(), 0, 2, "parent/")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: the parent's thread did not come along; a new group gets one
        ok = 0
        try:
            store = DictStore()
            mine = L.Liveness(store, 1, 2, "child/")
            end = time.monotonic() + 10 * L.PERIOD_S
            while store.values["child/1"] < 3 and time.monotonic() < end:
                time.sleep(L.PERIOD_S / 10)
            ok = int(store.values["child/1"] >= 3 and L.BEATS.count() == 1)
            mine.stop()
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    parent.stop()
    assert got == b"\x01"
