"""Run as the first process of a new pid namespace (unshare --pid --fork --mount-proc, as root): rank 1
of a 2-rank channel exits, its pid goes to a new process (through ns_last_pid), then rank 0 calls a
collective with a 20 s limit. The channel must see that rank 1's process is gone (its pid now belongs to
a process with another start time) at its next liveness check, not at the deadline. Prints one line:
RESULT <pid reused: True/False> <seconds rank 0's call took> <its error>."""
import multiprocessing as mp
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SLOT = 64 << 10


def rank0(name, go, q):
    import torch
    from _transport_shm_workers import open_channel

    ch = open_channel(name, 0, 2, SLOT)
    x = torch.ones(4)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    q.put("joined")
    go.wait(60)
    t0 = time.monotonic()
    try:
        ch.all_reduce_sum(x.data_ptr(), 4, 0, 20.0)
        q.put(("no error", time.monotonic() - t0))
    except Exception as e:   # noqa: BLE001
        q.put((f"{type(e).__name__}: {e}", time.monotonic() - t0))


def rank1(name):
    import torch
    from _transport_shm_workers import open_channel

    ch = open_channel(name, 1, 2, SLOT)
    x = torch.ones(4)
    ch.all_reduce_sum(x.data_ptr(), 4, 0, 30.0)
    os._exit(0)


def main():
    name = sys.argv[1]
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    p0 = ctx.Process(target=rank0, args=(name, go, q))
    p1 = ctx.Process(target=rank1, args=(name,))
    p0.start()
    p1.start()
    assert q.get(timeout=60) == "joined"
    p1.join(30)   # exited and reaped: its pid is free
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(p1.pid - 1))
    sleeper = subprocess.Popen(["sleep", "120"])
    reused = sleeper.pid == p1.pid
    go.set()
    text, elapsed = q.get(timeout=60)
    sleeper.kill()
    p0.join(30)
    print("RESULT", reused, f"{elapsed:.2f}", text, flush=True)


if __name__ == "__main__":
    main()
