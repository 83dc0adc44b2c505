"""One rank of bench/hosts.py: times all-reduces (or broadcasts from rank 0, all-gathers, reduce-scatters:
--collective) of each size, one contender per launch, and writes what it measured to a JSON file of its own. Started by torchrun inside each emulated host (gloo, ncclavg,
ncclavg-api) or by Open MPI's mpirun across them (mpi); see bench/hosts.py for the timing rule.

Contenders (float32, in place, every rank the same size):
  gloo          dist.all_reduce(x) on a gloo default group (SUM)
  ncclavg       dist.all_reduce(x) on an `ncclavg` default group (SUM): the torch backend
  ncclavg-api   comm.all_reduce_avg([x]), comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"])
  mpi, mpi-tcp  MPI_Allreduce(MPI_IN_PLACE, x, SUM) through mpi4py (numpy buffer); the two differ only
                in how they are launched (Note [Two Open MPI contenders] in hosts_launch.py)
A broadcast: dist.broadcast(x, 0), comm.broadcast_tensors([x]), MPI_Bcast(x, root 0).
An all-gather into x (each rank's slice: 1/world of it): dist.all_gather_into_tensor, comm.all_gather,
MPI_Allgather; a reduce-scatter of x (SUM; the API: AVG): dist.reduce_scatter_tensor, comm.reduce_scatter_avg,
MPI_Reduce_scatter_block.
Each one's sync is its all-reduce on 2 float32 (8 bytes). Every contender runs this file (the MPI ones
under the Open MPI venv's python), so each rank measures its process CPU time the same way (`measure`).

Which NIC a rank's gloo binds (GLOO_SOCKET_IFNAME, set here from --ifnames before the group exists):
  one        every rank NIC 0 (what one GLOO_SOCKET_IFNAME for the whole job gives)
  per-rank   local rank r binds NIC r % N: each local rank's connections start on its own NIC
  all        every NIC listed (gloo makes one device per NIC and spreads its pairs over them)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

NIC_USES = ("one", "per-rank", "all")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
TORCH_CONTENDERS = ("gloo", "ncclavg", "ncclavg-gloo", "ncclavg-api")
MPI_CONTENDERS = ("mpi", "mpi-tcp")


def gloo_ifname(ifnames: list[str], nic_use: str, local_rank: int) -> str:
    """GLOO_SOCKET_IFNAME for a local rank (module docstring)."""
    if nic_use == "one":
        return ifnames[0]
    if nic_use == "per-rank":
        return ifnames[local_rank % len(ifnames)]
    if nic_use == "all":
        return ",".join(ifnames)
    raise ValueError(f"nic_use: {nic_use!r} is not one of {', '.join(NIC_USES)}")


def read_counters(ifnames: list[str]) -> dict[str, dict[str, int]]:
    """This host's NICs' byte counters (this namespace's /sys: `ip netns exec` mounts its own)."""
    got = {}
    for name in ifnames:
        base = Path("/sys/class/net") / name / "statistics"
        got[name] = {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes")}
    return got


def diff(after: dict, before: dict) -> dict:
    return {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}


class Torch:
    """The torch contenders: the group (and Communicator) and the two calls."""

    def __init__(self, args: argparse.Namespace):
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.host = int(os.environ["GROUP_RANK"])
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname(args.ifnames, args.nic_use, self.local_rank)
        timeout = datetime.timedelta(seconds=args.timeout)
        backend = "ncclavg" if args.contender in ("ncclavg", "ncclavg-gloo") else "gloo"
        if args.contender == "ncclavg-gloo":   # the ncclavg backend with gloo's lanes between the hosts
            os.environ["NCCLAVG_UCX"] = "0"
        dist.init_process_group(backend, timeout=timeout)
        self.comm = None
        if args.contender == "ncclavg-api":
            import ncclavg

            self.comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"], timeout=args.timeout)
        self.tiny = torch.zeros(2)
        self.collective = args.collective
        self.transport = self._transport(args.contender)
        self.slices: dict = {}

    def _transport(self, contender: str) -> str | None:
        """How ncclavg moves the data between these processes ("shm+gloo": a channel in each host and gloo
        between them; "gloo": every process alone on its host), as the group or Communicator says."""
        if self.comm is not None:
            return getattr(self.comm, "transport", None)
        if contender not in ("ncclavg", "ncclavg-gloo"):
            return "gloo"
        pg = self.dist.group.WORLD
        try:
            backend = pg._get_backend(self.torch.device("cpu"))
        except (AttributeError, RuntimeError):
            backend = pg
        return getattr(backend, "transport", None) or getattr(pg, "transport", None)

    def buffer(self, n: int):
        return self.torch.zeros(max(n, self.world))

    def slice_of(self, x):
        """This rank's slice of x for an all-gather or reduce-scatter (one per buffer size), and the part of
        x that is whole slices."""
        per = x.numel() // self.world
        if per not in self.slices:
            self.slices[per] = self.torch.zeros(per)
        return self.slices[per], x[:per * self.world]

    def op(self, x) -> None:
        c, api = self.collective, self.comm
        if c == "broadcast":
            api.broadcast_tensors([x]) if api is not None else self.dist.broadcast(x, 0)
        elif c == "all_gather":
            mine, whole = self.slice_of(x)
            api.all_gather([mine], [whole]) if api is not None else self.dist.all_gather_into_tensor(whole, mine)
        elif c == "reduce_scatter":
            mine, whole = self.slice_of(x)
            api.reduce_scatter_avg([whole], [mine]) if api is not None else self.dist.reduce_scatter_tensor(mine, whole)
        else:
            self._all_reduce(x)

    def _all_reduce(self, x) -> None:
        if self.comm is not None:
            self.comm.all_reduce_avg([x])
        else:
            self.dist.all_reduce(x)

    def sync(self) -> None:
        self._all_reduce(self.tiny)

    def check(self, n: int) -> int:
        """Elements that differ from the exact result when rank r holds r + 1 (SUM; the API: AVG)."""
        return wrong_elements(self, self.buffer(n), self.comm is not None)

    def gather(self, obj) -> list | None:
        got = [None] * self.world
        self.dist.all_gather_object(got, obj)
        return got

    def finish(self) -> None:
        self.dist.barrier()
        from ncclavg.comm import end_process

        end_process(0)   # no teardown of the gloo group: Note [Gloo teardown] in ncclavg/comm/dist.py


class Mpi:
    """The MPI contender (mpi4py, numpy buffers: no torch needed in its venv)."""

    def __init__(self, args: argparse.Namespace):
        import numpy as np
        from mpi4py import MPI

        self.np, self.MPI = np, MPI
        self.world_comm = MPI.COMM_WORLD
        self.rank, self.world = self.world_comm.Get_rank(), self.world_comm.Get_size()
        self.local_rank = self.world_comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        self.host = args.hostnames.index(socket.gethostname())
        self.tiny = np.zeros(2, dtype=np.float32)
        self.comm = None
        self.transport = None
        self.collective = args.collective
        self.slices: dict = {}

    def buffer(self, n: int):
        return self.np.zeros(max(n, self.world), dtype=self.np.float32)

    def slice_of(self, x):
        per = x.size // self.world
        if per not in self.slices:
            self.slices[per] = self.np.zeros(per, dtype=self.np.float32)
        return self.slices[per], x[:per * self.world]

    def op(self, x) -> None:
        c, comm = self.collective, self.world_comm
        if c == "broadcast":
            comm.Bcast(x, root=0)
        elif c == "all_gather":
            mine, whole = self.slice_of(x)
            comm.Allgather(mine, whole)
        elif c == "reduce_scatter":
            mine, whole = self.slice_of(x)
            comm.Reduce_scatter_block(whole, mine, op=self.MPI.SUM)
        else:
            comm.Allreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM)

    def sync(self) -> None:
        self.world_comm.Allreduce(self.MPI.IN_PLACE, self.tiny, op=self.MPI.SUM)

    def check(self, n: int) -> int:
        return wrong_elements(self, self.buffer(n), False)

    def gather(self, obj) -> list:
        return self.world_comm.allgather(obj)

    def library(self) -> str:
        # Open MPI's string carries its C terminator (a NUL after the date): what precedes it, first line
        return self.MPI.Get_library_version().split("\x00")[0].splitlines()[0].strip()

    def finish(self) -> None:
        self.world_comm.Barrier()
        self.MPI.Finalize()   # Open MPI's launcher calls a rank that exits without it a failure
        sys.stdout.flush()
        os._exit(0)


def wrong_elements(side, x, averages: bool) -> int:
    """Runs side's collective once with rank r holding r + 1 (in x, or in its slice for an all-gather) and
    counts the elements that differ from the exact result: a sum (`averages`: the API's mean), rank 0's 1
    (a broadcast), every rank's r + 1 in rank order (an all-gather)."""
    c, rank, world = side.collective, side.rank, side.world
    total = world * (world + 1) / 2 / (world if averages else 1)
    if c in ("all_gather", "reduce_scatter"):
        mine, whole = side.slice_of(x)
        mine[:] = rank + 1
        whole[:] = rank + 1
        side.op(x)
        if c == "reduce_scatter":
            return int((mine != total).sum())
        per = mine.shape[0]
        return sum(int((whole[r * per:(r + 1) * per] != r + 1).sum()) for r in range(world))
    x[:] = rank + 1
    side.op(x)
    return int((x != (1 if c == "broadcast" else total)).sum())


def measure(side, args: argparse.Namespace) -> dict:
    """Per size: every call's time on this rank; (local rank 0) the NICs' bytes over N synced calls and
    over N syncs alone (their difference, divided by N, is the call's bytes on the wire); and this
    process's CPU time over the same two spans (the CPU of the call, the same way).

    time.process_time() is the CPU time (user + system) of every thread of the process: the backend's
    own threads (gloo's, UCX's, Open MPI's) count with the caller's. Each span starts and ends right
    after a counters read, so both hold one read (local rank 0) and their difference holds none."""
    counters = side.local_rank == 0
    out = {}
    for nbytes in args.sizes:
        n = max(1, nbytes // 4)
        x = side.buffer(n)
        for _ in range(args.warmup):
            side.sync()
            side.op(x)
        side.sync()
        c0 = read_counters(args.ifnames) if counters else None
        p0 = time.process_time()
        times = []
        for _ in range(args.calls):
            side.sync()
            t0 = time.perf_counter()
            side.op(x)
            times.append(time.perf_counter() - t0)
        side.sync()
        c1 = read_counters(args.ifnames) if counters else None
        p1 = time.process_time()
        for _ in range(args.calls):
            side.sync()
        side.sync()
        c2 = read_counters(args.ifnames) if counters else None
        p2 = time.process_time()
        wrong = side.check(n)
        out[str(nbytes)] = {"times_s": [round(t, 7) for t in times], "wrong": wrong,
                            "calls_bytes": diff(c1, c0) if counters else None,
                            "syncs_bytes": diff(c2, c1) if counters else None,
                            "calls_cpu_s": round(p1 - p0, 7), "syncs_cpu_s": round(p2 - p1, 7)}
        if side.rank == 0:
            print(f"  {args.contender} {nbytes} B: median {sorted(times)[len(times) // 2] * 1e3:.3f} ms on rank 0",
                  flush=True)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="one rank of bench/hosts.py")
    ap.add_argument("--contender", required=True, choices=(*TORCH_CONTENDERS, *MPI_CONTENDERS))
    ap.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    ap.add_argument("--sizes", required=True, type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--calls", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ifnames", required=True, type=lambda s: s.split(","))
    ap.add_argument("--nic-use", choices=NIC_USES, default="one")
    ap.add_argument("--hostnames", type=lambda s: s.split(","), default=[])
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--result", required=True, help="rank 0 writes every rank's measures here (JSON)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    side = Mpi(args) if args.contender in MPI_CONTENDERS else Torch(args)
    got = {"rank": side.rank, "host": side.host, "local_rank": side.local_rank, "sizes": measure(side, args)}
    everyone = side.gather(got)
    if side.rank == 0:
        library = side.library() if args.contender in MPI_CONTENDERS else None
        Path(args.result).write_text(json.dumps({"contender": args.contender, "world": side.world, "library": library,
                                                 "transport": side.transport, "ranks": everyone}))
    side.finish()


if __name__ == "__main__":
    main()
