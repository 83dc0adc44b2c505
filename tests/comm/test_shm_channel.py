"""The core's shared-memory channel (csrc/cpu/shm_channel.cpp) on its own: spawned processes meet in one
segment, no torch.distributed. Results are compared bit for bit with the arithmetic the channel
defines (Note [Shared-memory channel]: rank order, fp32 accumulation, one rounding), so no tolerance is
involved; failures must name the peer and end within their bounds."""
import os
import secrets
import time

import _shm_workers
import pytest
import torch.multiprocessing as mp

from ncclavg import _C
from ncclavg.errors import CommError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


def _name():
    return f"/ncclavg-test-{os.getpid()}-{secrets.token_hex(6)}"


def run(body, world, *args, expect=None, timeout_s=120):
    """Runs body(rank, world, name, *args, queue) in `world` spawned processes; returns the messages they
    queued (`expect` of them, world by default), and checks that no segment was left behind."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = _name()
    procs = [ctx.Process(target=body, args=(r, world, name, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < (expect or world):
            out.append(q.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not os.path.exists("/dev/shm" + name), "the segment outlived its processes"
    return sorted(out, key=lambda m: m[0])


# slot 64 KiB: fp32 chunks of 16384 elements, the split sum above 8192; sizes cover 0, odd sizes,
# both sides of the split threshold, one slot plus a little, and many rounds
SIZES = (0, 1, 33, 8191, 8193, 16389, 70001)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_bit_for_bit(world):
    out = run(_shm_workers.collectives, world, 64 << 10, SIZES)
    assert [m[1] for m in out] == ["ok"] * world, out
    assert {m[2] for m in out} == {4 * 4 * len(SIZES)}
    assert len({m[3] for m in out}) == 1, "the ranks disagree on the number of rounds"


def test_smallest_slot_many_rounds():
    out = run(_shm_workers.collectives, 2, 4096, (1, 1023, 5000))
    assert [m[1] for m in out] == ["ok", "ok"], out


def test_collectives_out_of_step_fail_on_both_ranks():
    out = run(_shm_workers.mismatch, 2, 64 << 10)
    for rank, text, _ in out:
        assert text.startswith("ShmPeerError"), text
        assert "out of step" in text and "all_reduce_sum" in text and "all_gather" in text, text


@pytest.mark.parametrize("labels", [(), (4, 9)])
def test_peer_exit_is_named_quickly(labels):
    out = run(_shm_workers.peer_exits, 2, 64 << 10, labels, expect=2)
    (_, first, elapsed), (_, second, _) = out
    lost = labels[1] if labels else 1   # a channel over some of a group's processes names group ranks
    assert first.startswith("ShmPeerError") and f"rank {lost} stopped responding (pid" in first, first
    assert "exited" in first, first
    # found by the 100 ms liveness check, not by the 30 s timeout
    assert elapsed < 5.0, elapsed
    # a failed channel stays failed, and says why
    survivor = labels[0] if labels else 0
    assert second.startswith("ShmPeerError") and f"aborted by rank {survivor}" in second and "exited" in second, second


def test_late_peer_times_out_and_finds_the_channel_aborted():
    out = run(_shm_workers.peer_freezes, 2, 64 << 10)
    (_, first, elapsed0), (_, late, elapsed1) = out
    assert first.startswith("CommTimeoutError") and "timed out after 1 s" in first and "rank 1 stopped responding" in first, first
    assert elapsed0 < 3.5, elapsed0   # 1 s deadline, checked every few hundred microseconds
    assert late.startswith("ShmPeerError") and "aborted by rank 0" in late and "timed out" in late, late
    assert elapsed1 < 1.0, elapsed1


def test_abort_reason_reaches_the_peer():
    out = run(_shm_workers.aborts, 2, 64 << 10)
    for rank, text, _ in out:
        assert "aborted by rank 0" in text and "the user gave up" in text, (rank, text)


def test_bad_arguments_name_the_argument():
    ch = _C.ShmChannel(_name(), 0, 1, 4096, 1)
    ch.unlink_name()
    with pytest.raises(TypeError, match="'type'"):
        ch.all_reduce_sum(0, 0, 7, 1.0)
    with pytest.raises(ValueError, match="'count'"):
        ch.all_reduce_sum(0, -1, 0, 1.0)
    with pytest.raises(ValueError, match="'data'"):
        ch.all_reduce_sum(0, 5, 0, 1.0)
    with pytest.raises(ValueError, match="'root'"):
        ch.broadcast(0, 0, 0, 1, 1.0)
    for kwargs, arg in [(dict(name="no-slash"), "name"), (dict(rank=2), "rank"), (dict(nranks=0), "nranks"),
                        (dict(slot_bytes=1000), "slot_bytes"), (dict(labels=[3]), "labels")]:
        full = dict(name=_name(), rank=0, nranks=2, slot_bytes=4096, nonce=1) | kwargs
        with pytest.raises(ValueError, match=f"'{arg}'"):
            _C.ShmChannel(**full)


def test_one_rank_channel_is_the_identity():
    import torch

    ch = _C.ShmChannel(_name(), 0, 1, 4096, 1)
    ch.unlink_name()
    x = torch.randn(3000)
    y = x.clone()
    ch.all_reduce_sum(y.data_ptr(), y.numel(), 0, 1.0)
    assert torch.equal(x, y)


def test_a_segment_too_large_for_dev_shm_fails_cleanly():
    name = _name()
    # 2 x 2 slots of 2**40 bytes: more than any /dev/shm; reserved up front, so it fails here (not SIGBUS)
    with pytest.raises(RuntimeError, match="/dev/shm too small"):
        _C.ShmChannel(name, 0, 2, 1 << 40, 1)
    assert not os.path.exists("/dev/shm" + name)


def test_existing_name_and_wrong_nonce_are_refused():
    name = _name()
    ch = _C.ShmChannel(name, 0, 2, 4096, 11)
    try:
        with pytest.raises(RuntimeError, match="shm_open"):
            _C.ShmChannel(name, 0, 2, 4096, 11)          # rank 0 creates, never reuses
        with pytest.raises(RuntimeError, match="not the one rank 0 created"):
            _C.ShmChannel(name, 1, 2, 4096, 12)          # another job's segment
        with pytest.raises(RuntimeError, match="unexpected size"):
            _C.ShmChannel(name, 1, 3, 4096, 11)          # another group size
    finally:
        ch.unlink_name()
    assert not os.path.exists("/dev/shm" + name)


def test_transport_settings(monkeypatch):
    from ncclavg.comm import shm

    monkeypatch.setenv("NCCLAVG_SHM", "maybe")
    with pytest.raises(ValueError, match="NCCLAVG_SHM"):
        shm.setting()
    monkeypatch.setenv("NCCLAVG_SHM_SLOT_KB", "2")
    with pytest.raises(ValueError, match="NCCLAVG_SHM_SLOT_KB"):
        shm.slot_bytes(2)
    monkeypatch.setenv("NCCLAVG_SHM_SLOT_KB", "96")
    assert shm.slot_bytes(2) == 96 << 10
    # default: 1 MiB up to 16 processes, then the segment stays at 32 MiB, the slot at least 64 KiB
    monkeypatch.delenv("NCCLAVG_SHM_SLOT_KB")
    assert [shm.slot_bytes(p) for p in (2, 16, 64, 1024)] == [1 << 20, 1 << 20, 256 << 10, 64 << 10]
    assert shm.host_identity() == shm.host_identity()


def test_processes_on_different_hosts_keep_gloo(monkeypatch):
    from ncclavg.comm.shm import ShmTransport

    class Comm:   # connect() decides before any collective when the identities differ
        rank, world_size, backend = 0, 2, "gloo"

    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    assert ShmTransport.connect(Comm(), None, None, ["host-a", "host-b"], 5.0) is None
    monkeypatch.setenv("NCCLAVG_SHM", "1")
    with pytest.raises(CommError, match="no two processes of this group are on one host"):
        ShmTransport.connect(Comm(), None, None, ["host-a", "host-b"], 5.0)
    monkeypatch.setenv("NCCLAVG_SHM", "0")
    assert ShmTransport.connect(Comm(), None, None, ["host-a", "host-a"], 5.0) is None


def test_stale_segment_names_are_removed(tmp_path):
    from ncclavg.comm import shm

    dead = tmp_path / "ncclavg-999999999-0123abcd"          # no such pid
    alive = tmp_path / f"ncclavg-{os.getpid()}-0123abcd"     # this process: in use
    fresh = tmp_path / "ncclavg-999999998-0123abcd"          # too recent: maybe mid-setup
    other = tmp_path / "someone-else-999999999"
    for p in (dead, alive, fresh, other):
        p.write_bytes(b"x")
    old = time.time() - 2 * shm.STALE_S
    for p in (dead, alive, other):
        os.utime(p, (old, old))
    assert shm.remove_stale_segments(str(tmp_path)) == [dead.name]
    assert not dead.exists() and alive.exists() and fresh.exists() and other.exists()
