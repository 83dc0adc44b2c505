"""The core's shared-memory channel (csrc/transport/shm_channel.cpp) on its own: spawned processes meet in one
segment, no torch.distributed. Results are compared bit for bit with the arithmetic the channel
defines (Note [Shared-memory channel]: rank order, fp32 accumulation, one rounding), so no tolerance is
involved; failures must name the peer and end within their bounds."""
import os
import sys

import _transport_shm_workers
import pytest
from _transport_shm_util import channel_name as _name, left_behind, run

from ncclavg import _C
from ncclavg.errors import CommError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


# slot 64 KiB: fp32 chunks of 16384 elements, the split sum above 8192; sizes cover 0, odd sizes (the
# SIMD lanes' scalar tails), both sides of the split threshold, one slot plus a little, and many rounds
SIZES = (0, 1, 33, 8191, 8193, 16389, 70001)


# 3 ranks (an odd world: uneven reduce-scatter shards) in the quick suite, 2 in the slow run
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_collectives_bit_for_bit(world):
    out = run(_transport_shm_workers.collectives, world, 64 << 10, SIZES)
    assert [m[1] for m in out] == ["ok"] * world, out
    assert {m[2] for m in out} == {4 * 8 * len(SIZES)}
    assert len({m[3] for m in out}) == 1, "the ranks disagree on the number of rounds"


def test_smallest_slot_many_rounds():
    out = run(_transport_shm_workers.collectives, 2, 4096, (1, 1023, 5000))
    assert [m[1] for m in out] == ["ok", "ok"], out


# Each case: what every rank's error must mention. A broadcast whose ranks disagree on the root, and a
# count-0 call beside real ones, used to pass silently (a stale value, or a round paired with the next).
MISMATCHES = {
    "op": (2, ("all_reduce_sum of 10", "all_gather of 10")),
    "root": (3, ("broadcast of 10 float32 from root 0", "broadcast of 10 float32 from root 1")),
    "zero": (2, ("all_reduce_sum of 0 float32", "all_reduce_sum of 10 float32")),
    "scale": (2, ("all_reduce_sum of 10 float32 (scaled)",)),
    # the same bytes on the wire, different user calls (Note [Call signatures] in csrc/transport/shm_calls.cpp)
    "tag": (2, ("all_reduce(MAX) of 10 float32", "all_gather of 10 float32")),
    "tag_root": (2, ("reduce(SUM) of 10 float32 to root 0", "reduce(SUM) of 10 float32 to root 1")),
    "tag_count": (2, ("all_reduce_coalesced(SUM) of 10 float32", "all_reduce_coalesced(SUM) of 11 float32")),
    "tag_barrier": (2, ("barrier", "all_reduce(SUM) of 1 float32")),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_collectives_out_of_step_fail_on_every_rank(case):
    world, names = MISMATCHES[case]
    msgs = run(_transport_shm_workers.out_of_step, world, 64 << 10, case, expect=2 * world)
    first = {}
    for rank, text, elapsed in msgs:
        first.setdefault(rank, []).append(text)
    for rank, (text, later) in first.items():
        assert text.startswith("ShmMismatchError") and "out of step" in text, (rank, text)
        assert all(n in text for n in names) or "aborted by rank" in text, (rank, text)
        assert later.startswith("ShmMismatchError"), (rank, later)   # a failed channel stays failed, and says why
    assert any(all(n in t for n in names) for t, _ in first.values()), first


def test_zero_count_calls_pair_with_each_other():
    out = run(_transport_shm_workers.zero_count_then_sum, 2, 64 << 10)
    assert [m[1] for m in out] == [[30.0] * 4, [30.0] * 4], out


@pytest.mark.parametrize("labels", [(), (4, 9)])
def test_peer_exit_is_named_quickly(labels):
    out = run(_transport_shm_workers.peer_exits, 2, 64 << 10, labels, expect=2)
    (_, first, elapsed), (_, second, _) = out
    lost = labels[1] if labels else 1   # a channel over some of a group's processes names group ranks
    assert first.startswith("ShmPeerError") and f"rank {lost} stopped responding (pid" in first, first
    assert "exited" in first, first
    # found by the 100 ms liveness check, not by the 30 s timeout
    assert elapsed < 5.0, elapsed
    # a failed channel stays failed, and says why
    survivor = labels[0] if labels else 0
    assert second.startswith("ShmPeerError") and f"aborted by rank {survivor}" in second and "exited" in second, second


@pytest.mark.slow   # waits out a timeout (~6 s)
def test_late_peer_times_out_and_finds_the_channel_aborted():
    out = run(_transport_shm_workers.peer_freezes, 2, 64 << 10)
    (_, first, elapsed0), (_, late, elapsed1) = out
    # the channel's own timeout: a CommTimeoutError that names the rank it waited for (its own type, so that a
    # runner tells it from a timeout that names nobody: Note [Failures are told by type])
    assert issubclass(_C.ShmTimeoutError, _C.CommTimeoutError)
    assert first.startswith("ShmTimeoutError") and "timed out after 1 s" in first and "rank 1 stopped responding" in first, first
    assert elapsed0 < 3.5, elapsed0   # 1 s deadline, checked every few hundred microseconds
    assert late.startswith("ShmPeerError") and "aborted by rank 0" in late and "timed out" in late, late
    assert elapsed1 < 1.0, elapsed1


def test_abort_reason_reaches_the_peer():
    out = run(_transport_shm_workers.aborts, 2, 64 << 10)
    for rank, text, _ in out:
        assert "aborted by rank 0" in text and "the user gave up" in text, (rank, text)


def test_bad_arguments_name_the_argument():
    ch = _C.ShmChannel(_name(), 0, 1, 4096, 1)
    with pytest.raises(TypeError, match="'type'"):
        ch.all_reduce_sum(0, 0, 7, 1.0)
    with pytest.raises(ValueError, match="'count'"):
        ch.all_reduce_sum(0, -1, 0, 1.0)
    with pytest.raises(ValueError, match="'data'"):
        ch.all_reduce_sum(0, 5, 0, 1.0)
    with pytest.raises(ValueError, match="'root'"):
        ch.broadcast(0, 0, 0, 1, 1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="'timeout_s'"):
            ch.all_reduce_sum(0, 0, 0, bad)
    with pytest.raises(ValueError, match="'mul/div'"):
        ch.all_reduce_sum(0, 0, 0, 1.0, 1.0, 0.0)
    for kwargs, arg in [(dict(name=""), "name"), (dict(name="has space"), "name"), (dict(name="x" * 101), "name"),
                        (dict(rank=2), "rank"), (dict(nranks=0), "nranks"), (dict(slot_bytes=1000), "slot_bytes"),
                        (dict(slot_bytes=(256 << 20) + 64), "slot_bytes"), (dict(slot_bytes=1 << 52), "slot_bytes"),
                        (dict(nranks=128, slot_bytes=4096), "slot_bytes"), (dict(labels=[3]), "labels")]:
        full = dict(name=_name(), rank=0, nranks=2, slot_bytes=4096, nonce=1) | kwargs
        with pytest.raises(ValueError, match=f"'{arg}'"):
            _C.ShmChannel(**full)


def test_one_rank_channel_is_the_identity():
    import torch

    ch = _C.ShmChannel(_name(), 0, 1, 4096, 1)
    x = torch.randn(3000)
    y = x.clone()
    ch.all_reduce_sum(y.data_ptr(), y.numel(), 0, 1.0)
    assert torch.equal(x, y)


def test_a_segment_too_large_for_memory_fails_cleanly():
    # 2 x 4096 ranks x 256 MiB: a valid slot, but 2 TiB in all; refused before any memory is taken
    name = _name()
    with pytest.raises(ValueError, match="'slot_bytes'.*does not fit in half of this machine's memory"):
        _C.ShmChannel(name, 0, 4096, 256 << 20, 1)
    assert not left_behind(name)


def test_door_checks_who_joins():
    name = _name()
    ch = _C.ShmChannel(name, 0, 3, 4096, 11)
    try:
        with pytest.raises(RuntimeError, match="cannot open its door"):
            _C.ShmChannel(name, 0, 2, 4096, 11)          # the name is this channel's
        with pytest.raises(RuntimeError, match="refused rank 1: the request does not carry this channel's nonce"):
            _C.ShmChannel(name, 1, 3, 4096, 12)          # another job's nonce
        with pytest.raises(RuntimeError, match="refused rank 1: the request is for 2 ranks"):
            _C.ShmChannel(name, 1, 2, 4096, 11)          # another group size
    finally:
        ch.close_door()
    with pytest.raises(RuntimeError, match="no door is open"):
        _C.ShmChannel(name, 1, 3, 4096, 11)              # closed: nobody joins any more
    del ch
    assert not left_behind(name)


def test_transport_settings(monkeypatch):
    from ncclavg.transport import shm

    monkeypatch.setenv("NCCLAVG_SHM", "maybe")
    with pytest.raises(ValueError, match="NCCLAVG_SHM"):
        shm.setting()
    for bad in ("2", str(1 << 52), str((256 << 10) + 1), "lots"):   # a huge value once wrapped the size
        monkeypatch.setenv("NCCLAVG_SHM_SLOT_KB", bad)
        with pytest.raises(ValueError, match=r"NCCLAVG_SHM_SLOT_KB must be an integer in \[4, 262144\]"):
            shm.slot_bytes(2)
    monkeypatch.setenv("NCCLAVG_SHM_SLOT_KB", "96")
    assert shm.slot_bytes(2) == 96 << 10
    # default: 1 MiB up to 16 processes, then the segment stays at 32 MiB, the slot at least 64 KiB
    monkeypatch.delenv("NCCLAVG_SHM_SLOT_KB")
    assert [shm.slot_bytes(p) for p in (2, 16, 64, 1024)] == [1 << 20, 1 << 20, 256 << 10, 64 << 10]
    assert shm.host_identity() == shm.host_identity()


def test_processes_on_different_hosts_keep_gloo(monkeypatch):
    from ncclavg.transport.host_setup import connect

    # connect() decides before any exchange when the identities differ: it is handed none (with UCX off: its
    # lanes would start between the hosts, tests/transport/test_ucx_lanes.py)
    monkeypatch.setenv("NCCLAVG_UCX", "0")
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    assert connect(0, 2, None, ["host-a", "host-b"], 5.0) is None
    monkeypatch.setenv("NCCLAVG_SHM", "1")
    with pytest.raises(CommError, match="no two processes of this group are on one host"):
        connect(0, 2, None, ["host-a", "host-b"], 5.0)
    monkeypatch.setenv("NCCLAVG_SHM", "0")
    assert connect(0, 2, None, ["host-a", "host-a"], 5.0) is None


def test_exec_lock_orders_calls_across_threads():
    # The transport's execution lock (native, read by the fast path): a second thread blocks in
    # acquire() without the GIL until the holder releases, from whichever thread.
    import threading

    ex = _C.ShmExec()
    assert ex.acquire(False) and not ex.acquire(False)
    got = []
    t = threading.Thread(target=lambda: got.append(ex.acquire()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got   # still waiting (and this thread still runs: no GIL held)
    ex.release()
    t.join(10)
    assert got == [True]
    ex.release()
    with ex:
        assert not ex.acquire(False)
    assert ex.acquire(False)
    ex.release()
    ex.add_outstanding(2)
    ex.add_outstanding(-1)
    assert ex.outstanding == 1


def test_fast_average_refuses_when_busy_or_disabled():
    import torch

    ch = _C.ShmChannel(_name(), 0, 1, 4096, 1)
    ex = _C.ShmExec()
    seen = []

    def prepare(t):
        seen.append(t)
        return (t.data_ptr(), t.numel(), 0, 2.0, 0) if t.dtype == torch.float32 else None

    fast = _C.FastAllReduce(ch, ex, prepare)
    x = torch.full((5,), 3.0)
    assert fast.run([x], 5.0) and torch.equal(x, torch.full((5,), 1.5))   # one rank: the sum, halved
    assert fast.run([x], 5.0) and len(seen) == 1 and fast.cached == 1     # the second call from the cache
    x.add_(1.0)                                                             # in place: the version moves
    assert fast.run([x], 5.0) and len(seen) == 2
    assert not fast.run([torch.ones(2, dtype=torch.float16)], 5.0)          # prepare said no
    assert not fast.run((x,), 5.0) and not fast.run([x, x], 5.0)            # one tensor, in a list
    ex.add_outstanding(1)                                                   # something queued: not now
    assert not fast.run([x], 5.0)
    ex.add_outstanding(-1)
    ex.acquire()                                                            # something running: not now
    assert not fast.run([x], 5.0)
    ex.release()
    fast.disable()
    assert not fast.run([x], 5.0)
    # disabled for good: it lets go of prepare (and so of what prepare holds) and of its cache
    assert fast.cached == 0 and sys.getrefcount(prepare) == 2


def test_peers_ready_sees_an_announcement_or_a_post():
    # Note [An asynchronous call whose peers wait]: a look with nobody there says False after its window
    # (20 ms; the bound leaves a loaded machine a second), an announced round or a posted one says True,
    # an aborted channel says False at once; the calls that follow meet with the right sums.
    out = run(_transport_shm_workers.peers_ready, 2, 64 << 10, gate=True)
    (_, r0, x0), (_, r1, x1) = out
    assert r0[0] is False and 0.02 <= r0[1] < 1.0, r0
    assert r1 == [True], r1
    assert r0[2] is True and r0[3] is False, r0
    assert x0 == x1 == [6.0, 6.0, 6.0], (x0, x1)   # 1 + 2, then 3 + 3
