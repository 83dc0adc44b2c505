"""Spawns torch.distributed (gloo, loopback) jobs for the tests, with bounded waits everywhere."""
import datetime
import os
import time

import torch.multiprocessing as mp

from ncclavg.bench.launch import free_port  # noqa: F401  (the tests' one way to pick a port)


def between_hosts(alone=False):
    """The transport of a group over several (pretend) hosts: the lanes on UCX ("shm+ucx"; "ucx" when every
    process is alone on its host) unless NCCLAVG_UCX=0, then gloo's ("shm+gloo"; the group's own "gloo")."""
    if os.environ.get("NCCLAVG_UCX", "auto").strip().lower() in ("0", "off"):
        return "gloo" if alone else "shm+gloo"
    return "ucx" if alone else "shm+ucx"


def init_rank(rank, world, port, timeout_s=60):
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


# Note [Ranks from a forkserver]
# Every rank of run_ranks used to be a spawned interpreter that imported torch (~1.1 s of CPU on the 2-core
# dev VM), several per test: most of the quick suite's time. The ranks now come from multiprocessing's
# forkserver with torch imported once (set_forkserver_preload): each rank is a fork of a process that
# has imported torch and done nothing else (no threads, no ncclavg), then imports its test module and
# ncclavg itself, as a spawned rank does. A forkserver child inherits the forkserver's environment, not
# the test's, so each rank starts from the caller's os.environ as it is at the call (monkeypatch.setenv
# and the like). NCCLAVG_TEST_SPAWN=1 goes back to spawn.
_START = "spawn" if os.environ.get("NCCLAVG_TEST_SPAWN") == "1" else "forkserver"
if _START == "forkserver":
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch"])


def _run_and_end(rank, env, fn, *args):
    """A rank's body, in the caller's environment `env`: fn, then (it returned: every collective is done)
    out without teardown, see Note [Gloo teardown] in ncclavg/comm/dist.py. An exception goes back to
    the spawn harness as usual."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    fn(rank, *args)
    from ncclavg.comm import end_process

    end_process(0)


def run_ranks(fn, world, args=(), timeout_s=120):
    """Runs fn(rank, world, port, *args) in `world` spawned processes; re-raises a child's exception;
    kills everything after timeout_s."""
    port = free_port()
    env = dict(os.environ) if _START == "forkserver" else None   # Note [Ranks from a forkserver]
    ctx = mp.start_processes(_run_and_end, args=(env, fn, world, port, *args), nprocs=world, join=False,
                             start_method=_START)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
