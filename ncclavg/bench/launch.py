"""Process launch for the multi-process bench backends: detect torchrun, or spawn the ranks ourselves.

`ncclavg bench --backend gloo --nproc N` re-runs itself N times with the environment torchrun would set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so a spawned rank and a
torchrun rank take the same code path. Rank 0 prints and writes the files.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from datetime import timedelta

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SPAWNED_VAR = "NCCLAVG_BENCH_SPAWNED"


def launched() -> dict | None:
    """{rank, world_size, local_rank} when this process is one rank of a launched job (torchrun or
    our own spawn), else None."""
    if not all(v in os.environ for v in _LAUNCH_VARS):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {"rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", rank))}


def init_process_group(backend: str, local_rank: int, timeout: float) -> None:
    """gloo: the bench's process group. nccl: NCCL for CUDA tensors plus gloo for the bookkeeping
    (agreeing on iteration counts, summing #wrong) on CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "gloo":
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(seconds=timeout),
                                device_id=torch.device("cuda", local_rank))


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on loopback right now, which the ranks bind a moment later.

    Taken from below the kernel's ephemeral range, not from bind(0): a port the OS picks lies in that
    range, which every outgoing connection draws its local port from too, so between this call and the
    rank's bind another job's connection (a gloo group opens one per pair) can take it and the rank's
    store fails with EADDRINUSE. Only an explicit bind takes a port below the range; a random one of
    thousands that binds now is free unless another launcher picks the same one in the same moment."""
    low = _ephemeral_low()
    first = max(10000, low - 20000)
    rng = random.SystemRandom()
    for _ in range(64) if low - first >= 1000 else ():
        port = rng.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # no room below the range: the OS's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_root() -> str:
    """The folder holding the ncclavg package in use, so the ranks import this very copy."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn_ranks(nproc: int, bench_argv: list[str], timeout: float) -> int:
    """Runs `python -m ncclavg bench <bench_argv>` as ranks 0..nproc-1 on loopback and waits for all
    of them. When one fails the others are stopped (they would wait for it until `timeout`). Returns
    the first non-zero exit code, else 0."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), **{SPAWNED_VAR: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    # Like torchrun: don't let N ranks each start one OpenMP/intra-op thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ncclavg", "bench", *bench_argv],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=None if r == 0 else subprocess.DEVNULL))
        return _wait_all(procs, timeout)
    finally:
        _stop(procs)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> int:
    # A big sweep may run for long, so there is no deadline while every rank runs. Once one rank has
    # finished cleanly the others are past their last collective: they get `timeout` (the bound on any
    # collective wait) plus a margin to follow before they count as hung.
    first_done = None
    running = set(range(len(procs)))
    while running:
        for r in sorted(running):
            rc = procs[r].poll()
            if rc is None:
                continue
            running.discard(r)
            if rc != 0:
                print(f"ncclavg bench: rank {r} exited with code {rc}; stopping the other ranks", file=sys.stderr)
                return rc if rc > 0 else 1
            first_done = first_done or time.monotonic()
        grace = timeout + 60
        if running and first_done is not None and time.monotonic() - first_done > grace:
            print(f"ncclavg bench: ranks {sorted(running)} still running {grace:.0f} s after another rank "
                  "finished; stopping them", file=sys.stderr)
            return 1
        time.sleep(0.05)
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
