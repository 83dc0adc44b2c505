"""Bodies of the shared-memory channel's misuse tests (spawned processes; see test_shm_misuse.py)."""
import os
import sys
import time

import torch
from _transport_shm_workers import attempt, open_channel


def impostor_joins(rank, world, name, slot, q, gate):
    """3 ranks; after the real rank 1 has joined, a 4th process (same user, right nonce) asks to join as
    rank 1: refused. The real ranks' collectives are untouched. Then rank 1 forks: the child's call on its
    parent's channel is refused, the parent goes on."""
    if rank == 3:   # the impostor
        gate.wait(30)
        attempt(q, 3, lambda: open_channel(name, 1, 3, slot))
        return
    if rank == 2:
        gate.wait(30)   # joins only after the impostor tried: the door is still open for it then
        time.sleep(0.5)
    ch = open_channel(name, rank, 3, slot)
    if rank == 1:
        gate.set()
    x = torch.full((4,), float(rank + 1))
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    q.put((rank, x.tolist(), 0.0))
    if rank == 1:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: its parent's mapping, its parent's rank
            os.close(r)
            try:
                ch.all_reduce_sum(x.data_ptr(), 4, 0, 5.0)
                msg = "no error"
            except Exception as e:   # noqa: BLE001
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode()[:4000])
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        q.put((10, os.read(r, 4096).decode(), 0.0))
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)   # the real ranks, after all that
    q.put((20 + rank, x.tolist(), 0.0))


def other_user_joins(rank, world, name, slot, q):
    """Rank 1 runs as user nobody (65534): the door refuses it. What it runs after dropping to nobody is
    imported before: the checkout may sit in a home directory only its owner can read (root's, 0700)."""
    if rank == 1:
        from ncclavg import _C  # noqa: F401  (open_channel's import then finds it loaded)

        os.setgid(65534)
        os.setuid(65534)
        attempt(q, rank, lambda: open_channel(name, 1, 2, slot))
        return
    ch = open_channel(name, 0, 2, slot)
    time.sleep(3)   # the door stays open meanwhile
    q.put((0, "done", 0.0))
    del ch


def creator_killed(rank, world, name, slot, q):
    """Rank 0 creates the channel and is then killed with SIGKILL, before anyone joined."""
    ch = open_channel(name, 0, 2, slot)   # noqa: F841 (alive until the kill)
    q.put((0, "created", 0.0))
    time.sleep(60)


def first_touch(rank, world, name, slot, q, gate):
    """Each rank reserves its own slots: before rank 1 joins, none of its slots is in memory."""
    if rank == 1:
        gate.wait(30)
        ch = open_channel(name, 1, 2, slot)
        ch.barrier(30.0)
        q.put((1, "joined", 0.0))
        ch.barrier(30.0)
        return
    ch = open_channel(name, 0, 2, slot)
    before = [ch.resident_slot_bytes(r) for r in range(2)]
    gate.set()
    ch.barrier(30.0)
    after = [ch.resident_slot_bytes(r) for r in range(2)]
    ch.barrier(30.0)
    q.put((0, (before, after), 0.0))


def namespace_job(name, slot):
    """A whole 2-rank job in one process (two threads would share a pid: two processes instead)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_namespace_rank, args=(r, name, slot, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    print("JOB", sorted(results))


def _namespace_rank(rank, name, slot, q):
    sys.path.insert(0, os.path.dirname(__file__))
    ch = open_channel(name, rank, 2, slot)
    x = torch.full((3,), float(rank + 1))
    ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
    q.put((rank, x.tolist()))


def long_job(rank, world, name, slot, q, gate):
    """A job that sets up, waits while another job runs in another pid namespace, then goes on."""
    ch = open_channel(name, rank, world, slot)
    x = torch.full((3,), float(rank + 1))
    ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
    if rank == 0:
        q.put((0, "ready", 0.0))
    gate.wait(60)
    ch.all_reduce_sum(x.data_ptr(), 3, 0, 30.0)
    q.put((10 + rank, x.tolist(), 0.0))
