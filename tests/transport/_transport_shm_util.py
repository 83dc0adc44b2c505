"""Runs the shared-memory channel's test bodies in spawned processes, and finds what a channel left."""
import os
import secrets
import time

import torch.multiprocessing as mp


def channel_name():
    return f"ncclavg-test-{os.getpid()}-{secrets.token_hex(6)}"


def run(body, world, *args, expect=None, timeout_s=120, gate=False, name=None):
    """Runs body(rank, world, name, *args, queue[, gate]) in `world` spawned processes; returns the messages
    they queued (`expect` of them, world by default), sorted by their first item, and checks that the
    channel left nothing behind. gate=True passes an Event the bodies share."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = name or channel_name()
    extra = (ctx.Event(),) if gate else ()
    procs = [ctx.Process(target=body, args=(r, world, name, *args, q, *extra)) for r in range(world)]
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
    assert not left_behind(name), "the channel left a name behind"
    return sorted(out, key=lambda m: m[0])


def left_behind(name):
    """What the channel `name` would leave after its processes: a file in /dev/shm, or its door (an
    abstract unix socket, listed in /proc/net/unix as @ncclavg/<name>)."""
    found = [p for p in os.listdir("/dev/shm") if name.strip("/") in p]
    with open("/proc/net/unix") as f:
        found += [line.split()[-1] for line in f if line.rstrip().endswith("@ncclavg/" + name)]
    return found
