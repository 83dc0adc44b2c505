"""Process helpers of the fault tests: spawn ranks that may die, collect their reports, never hang."""
import json
import os
import signal
import time

import torch.multiprocessing as mp

from _dist_util import free_port


def spawn_ranks(fn, world, args=(), timeout_s=60):
    """Runs fn(rank, world, port, *args) in `world` spawned processes and returns their exit codes
    (negative: killed by that signal). Unlike run_ranks, a rank that dies is expected, not an error.
    Every process still alive after timeout_s is killed and TimeoutError raised: a test never hangs."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        # done when every rank exited or is stopped (SIGSTOP: the "hung rank" of some tests)
        while not all(p.exitcode is not None or _is_stopped(p.pid) for p in procs):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(procs) if p.exitcode is None]
                raise TimeoutError(f"ranks {alive} did not finish within {timeout_s} s")
            time.sleep(0.05)
        return [p.exitcode if p.exitcode is not None else -signal.SIGSTOP for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _is_stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def report(directory, rank, **fields):
    """Each rank writes what happened to it as JSON (a dying rank writes nothing)."""
    tmp = os.path.join(directory, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, os.path.join(directory, f"rank{rank}.json"))


def read_reports(directory, world):
    out = {}
    for r in range(world):
        path = os.path.join(directory, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
    return out
