"""The torch face against the public API: each collective through `torch.distributed` on a group of the
`ncclavg` backend, beside the same work through ncclavg's own Communicator and through torch's gloo, in
the same processes, one size at a time, with one timing rule.

Collectives (size = the bytes each rank hands in):
  all_reduce        public API comm.all_reduce_avg([x]); torch dist.all_reduce(x, AVG) on the ncclavg
                    group; gloo dist.all_reduce(x) (SUM: gloo has no AVG); and "torch floor":
                    dist.all_reduce on a Python ProcessGroup that does nothing and returns a finished
                    Work, the part of torch no Python backend can avoid.
  broadcast         comm.broadcast_tensors([x]) (from process 0); dist.broadcast(x, 0).
  all_gather        comm.all_gather([x], [out]); dist.all_gather_into_tensor(out, x).
  reduce_scatter    comm.reduce_scatter_avg([x], [out]); dist.reduce_scatter_tensor(out, x, AVG) (gloo: SUM).
  async x8          8 async all-reduces issued back to back, then waited in order, per call:
                    comm.all_reduce_avg_async; dist.all_reduce(x, AVG, async_op=True).
Timing rule (the same for all): for each size, rounds in which every contender runs once, in turn, the
order rotating from round to round; before each contender's timed batch every rank passes the channel's
own barrier (a tight one: gloo's barrier alone costs ~50 us and would hide small sizes); a batch is
enough back-to-back calls to last ~5 ms; the slowest rank's per-call time is the sample; the median over
rounds is reported. Beside it, the copy bandwidth (torch copy_, read + write) of the same size, measured
in the same run, and each contender's algbw (bytes / time).

    python bench/torch_face.py                          # 2 processes, 8 B to 64 MiB, every collective
    python bench/torch_face.py --procs 4 --sizes 8,65536 --collectives all_reduce,broadcast --md R.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts an in-place built checkout first on sys.path)

SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "async x8")
CONTENDERS = ("public API", "torch ncclavg", "torch gloo", "torch floor")
BATCH_S = 5e-3
ROUNDS = 11
ASYNC_BURST = 8


def _floor_group(dist, rank: int, size: int):
    """A ProcessGroup that does nothing: its all_reduce returns a finished Work at once."""
    class Done(dist.Work):
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

    class Nothing(dist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            return Done()

        def getBackendName(self):
            return "nothing"

    return Nothing(rank, size)


def _calls(collective: str, n: int, comm, group, floor, size: int):
    """{contender: fn} for one collective on n float32 elements per rank."""
    import torch
    import torch.distributed as dist

    AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    x = torch.ones(n)
    if collective == "all_reduce":
        return {"public API": lambda: comm.all_reduce_avg([x]),
                "torch ncclavg": lambda: dist.all_reduce(x, op=AVG, group=group),
                "torch gloo": lambda: dist.all_reduce(x, op=SUM),
                "torch floor": lambda: dist.all_reduce(x, group=floor)}
    if collective == "broadcast":
        return {"public API": lambda: comm.broadcast_tensors([x]),
                "torch ncclavg": lambda: dist.broadcast(x, 0, group=group),
                "torch gloo": lambda: dist.broadcast(x, 0)}
    if collective == "all_gather":
        out = torch.empty(n * size)
        return {"public API": lambda: comm.all_gather([x], [out]),
                "torch ncclavg": lambda: dist.all_gather_into_tensor(out, x, group=group),
                "torch gloo": lambda: dist.all_gather_into_tensor(out, x)}
    if collective == "reduce_scatter":
        m = max(1, n // size)
        inp, out = torch.ones(m * size), torch.empty(m)
        return {"public API": lambda: comm.reduce_scatter_avg([inp], [out]),
                "torch ncclavg": lambda: dist.reduce_scatter_tensor(out, inp, op=AVG, group=group),
                "torch gloo": lambda: dist.reduce_scatter_tensor(out, inp, op=SUM)}
    if collective == "async x8":
        def api():
            for w in [comm.all_reduce_avg_async([x]) for _ in range(ASYNC_BURST)]:
                w.wait()

        def ours(g=group, op=AVG):
            for w in [dist.all_reduce(x, op=op, group=g, async_op=True) for _ in range(ASYNC_BURST)]:
                w.wait()
        return {"public API": api, "torch ncclavg": ours, "torch gloo": lambda: ours(None, SUM)}
    raise ValueError(f"collective: unknown {collective!r}")


def worker(rank: int, size: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import ncclavg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=300))
    comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"], timeout=300.0)
    assert comm.transport == "shm", comm.transport
    channel = comm._channel
    group = dist.new_group(backend="ncclavg")
    assert group.transport == "shm", group.transport
    floor = _floor_group(dist, rank, size)

    def slowest(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    rows = []
    for collective in args.collectives:
        for nbytes in args.sizes:
            n = max(1, nbytes // 4)
            calls = {c: f for c, f in _calls(collective, n, comm, group, floor, size).items()}
            for c in list(calls):
                try:
                    calls[c]()
                except (RuntimeError, ValueError) as e:   # a collective gloo lacks: no entry
                    if rank == 0:
                        print(f"  {collective} {c}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                    del calls[c]
            names = [c for c in CONTENDERS if c in calls]
            est = {}
            for c in names:
                channel.barrier(300.0)
                one = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    calls[c]()
                    one.append(time.perf_counter() - t0)
                est[c] = slowest(statistics.median(one))
            batch = {c: max(1, min(2000, int(BATCH_S / max(est[c], 1e-7)))) for c in names}
            rounds = max(3, min(ROUNDS, int(args.budget / max(sum(est[c] * batch[c] for c in names), 1e-6))))
            samples = {c: [] for c in names}
            for i in range(rounds):
                for c in names[i % len(names):] + names[:i % len(names)]:
                    channel.barrier(300.0)
                    t0 = time.perf_counter()
                    for _ in range(batch[c]):
                        calls[c]()
                    samples[c].append(slowest((time.perf_counter() - t0) / batch[c]))
            copy_gbps = _common.copy_bandwidth_gbps(n * 4)
            per = ASYNC_BURST if collective == "async x8" else 1
            for c in names:
                t = statistics.median(samples[c]) / per
                rows.append({"procs": size, "collective": collective, "size_bytes": n * 4, "contender": c,
                             "time_us": t * 1e6, "algbw_gbps": n * 4 / t / 1e9, "copy_gbps": copy_gbps,
                             "batch": batch[c], "rounds": rounds})
            if rank == 0:
                print(f"  P={size} {collective} {_common.human(n * 4)}: " + ", ".join(
                    f"{c} {statistics.median(samples[c]) / per * 1e6:.1f} us" for c in names), file=sys.stderr,
                    flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    from ncclavg.comm import end_process
    end_process(0)   # no teardown of the gloo group: Note [Gloo teardown] in ncclavg/comm/dist.py


def _spawn_entry(rank: int, size: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    worker(rank, size, port, args, out_path)


def launch(procs: int, args: argparse.Namespace) -> list:
    import tempfile

    import torch.multiprocessing as mp

    from ncclavg.bench.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        print(f"P={procs} ...", file=sys.stderr, flush=True)
        mp.start_processes(_spawn_entry, args=(procs, port, args, out), nprocs=procs, start_method="spawn")
        return json.loads(Path(out).read_text())


def table(rows: list) -> list:
    head = ("| P | collective | size | public API us | torch ncclavg us | torch gloo us | torch floor us | "
            "ncclavg/API | gloo/API | API algbw GB/s | ncclavg algbw GB/s | copy GB/s |")
    lines = [head, "|" + "---|" * 12]
    keys = sorted({(r["procs"], COLLECTIVES.index(r["collective"]), r["size_bytes"]) for r in rows})
    for p, ci, b in keys:
        col = COLLECTIVES[ci]
        got = {r["contender"]: r for r in rows if (r["procs"], r["collective"], r["size_bytes"]) == (p, col, b)}
        t = {c: got[c]["time_us"] if c in got else None for c in CONTENDERS}
        fmt = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
        ratio = lambda c: "-" if t[c] is None or t["public API"] is None else f"{t[c] / t['public API']:.2f}x"  # noqa: E731
        bw = lambda c: "-" if c not in got else f"{got[c]['algbw_gbps']:.2f}"   # noqa: E731
        copy = next(iter(got.values()))["copy_gbps"]
        lines.append(f"| {p} | {col} | {_common.human(b)} | {fmt(t['public API'])} | {fmt(t['torch ncclavg'])} "
                     f"| {fmt(t['torch gloo'])} | {fmt(t['torch floor'])} | {ratio('torch ncclavg')} "
                     f"| {ratio('torch gloo')} | {bw('public API')} | {bw('torch ncclavg')} | {copy:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="2", help="process counts, comma-separated (default 2)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank, comma-separated")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES),
                    help=f"comma-separated, of: {', '.join(COLLECTIVES)}")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timed rounds per size and collective")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the table (markdown) here")
    args = ap.parse_args()
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    args.collectives = [c.strip() for c in args.collectives.split(",")]
    bad = [c for c in args.collectives if c not in COLLECTIVES]
    if bad:
        ap.error(f"--collectives: unknown {bad}; choose from {', '.join(COLLECTIVES)}")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("NCCLAVG_SHM", "auto")
    rows = []
    for p in [int(v) for v in args.procs.split(",")]:
        rows += launch(p, args)
    lines = table(rows)
    print("\n".join(lines))
    m = _common.machine()
    load = os.getloadavg()
    payload = {"machine": m, "load_average": load, "rule": "median over rounds of the slowest rank's per-call "
               "time in a ~5 ms batch after the channel's barrier; contenders interleaved, the order rotating "
               "per round", "rows": rows}
    _common.write_json(args.json, payload)
    if args.md:
        head = [f"# The torch face against the public API, per collective ({m['date']})", "",
                f"{m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; torch {m['torch']}; load average at the "
                f"end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}.",
                "Command: `python bench/torch_face.py " + " ".join(sys.argv[1:]) + "`", "",
                "Timing rule: " + payload["rule"] + ". async x8: per call of a burst of 8 waited in order.", ""]
        Path(args.md).write_text("\n".join(head + lines) + "\n")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
