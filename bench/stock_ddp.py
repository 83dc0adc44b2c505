"""Stock torch DDP and FSDP2 on the `ncclavg` torch.distributed backend against the same on gloo, in one run.

Each shape (P processes on this host, P = 2 and 4) is one spawned job. Every process initialises the
default group with backend "ncclavg" and makes a gloo group over the same ranks, then builds every
contender from the same initial weights (the models of bench/scale.py):
  ddp gloo              DistributedDataParallel over the gloo group (bucket_cap_mb 25, gradient_as_bucket_view)
  ddp ncclavg           the same over the ncclavg group: no other change to the training code
  ddp gloo+hook         DDP over gloo with ncclavg.ddp.register(model): the buckets through ncclavg
  fsdp2 gloo / ncclavg  fully_shard (each Linear, then the root) on a CPU DeviceMesh of the group
  fsdp2 gloo+comms      FSDP2 over gloo with ncclavg's custom all-gather / reduce-scatter
                        (ncclavg.comm.fsdp_comms.use_ncclavg)
All use torch.optim.AdamW(fused=True), lr 1e-3, the global batch split over the P processes. The
contenders take turns block by block after one warm-up block each (order rotated every round, a barrier
before each block), so the machine's load falls on all alike. Reported: rank 0's median step time,
samples/s = global batch / median step, and ncclavg / gloo in samples/s for the same kind (ddp, fsdp2),
from the medians and paired round by round (> 1: ncclavg faster).

    python bench/stock_ddp.py                                   # full run (~2 min on 2 cores)
    python bench/stock_ddp.py --quick                           # a tiny run, for the tests
    python bench/stock_ddp.py --json R.json --md R.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts an in-place built checkout first on sys.path)
from scale import build_model, make_batches, workloads  # noqa: E402  (the models and data of bench/scale.py)

KINDS = ("ddp gloo", "ddp ncclavg", "ddp gloo+hook", "fsdp2 gloo", "fsdp2 ncclavg", "fsdp2 gloo+comms")
REFERENCE = {"ddp ncclavg": "ddp gloo", "ddp gloo+hook": "ddp gloo", "fsdp2 ncclavg": "fsdp2 gloo",
             "fsdp2 gloo+comms": "fsdp2 gloo"}


# ----------------------------------------------------------------------------------------- one rank
def _contender(kind: str, model, gloo, world: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ncclavg

    group = gloo if "gloo" in kind.split()[1] else dist.group.WORLD
    if kind.startswith("ddp"):
        m = DDP(model, process_group=group, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if kind.endswith("+hook"):
            ncclavg.ddp.register(m)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        m = fully_shard(model, mesh=mesh)
        if kind.endswith("+comms"):
            from ncclavg.comm.fsdp_comms import use_ncclavg

            use_ncclavg(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)


def rank_main(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    threads = max(1, (os.cpu_count() or 1) // world)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import copy
    import datetime

    import torch
    import torch.distributed as dist

    import ncclavg  # noqa: F401  (registers the backend)
    from ncclavg.comm import end_process

    torch.set_num_threads(threads)
    dist.init_process_group("ncclavg", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    transport = dist.group.WORLD.transport
    result: dict = {"threads": threads, "transport": transport, "workloads": {}}
    for wl in spec["workloads"]:
        base = build_model(wl["model"])
        batches = make_batches(wl)
        per = wl["batch"] // world
        mine = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in batches]
        kinds = spec["kinds"]
        contenders = {k: _contender(k, copy.deepcopy(base), gloo, world) for k in kinds}
        pos = {k: 0 for k in kinds}

        def block(kind: str, steps: int) -> list:
            m, opt = contenders[kind]
            times = []
            for _ in range(steps):
                x, y = mine[pos[kind] % len(mine)]
                pos[kind] += 1
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            return times

        for k in kinds:   # warm-up: DDP rebuilds its buckets after its first step, FSDP2 lazily initialises
            dist.barrier(group=gloo)
            block(k, spec["steps"])
        rounds: dict = {k: [] for k in kinds}
        order = list(kinds)
        for _ in range(spec["rounds"]):
            for k in order:
                dist.barrier(group=gloo)
                rounds[k].append(block(k, spec["steps"]))
            order = order[1:] + order[:1]
        result["workloads"][wl["name"]] = rounds
    dist.barrier(group=gloo)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    end_process(0)   # see Note [Gloo teardown] in ncclavg/comm/dist.py


def _run_shape(world: int, spec: dict, timeout: float) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(rank_main, args=(world, port, spec, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} processes did not finish within {timeout:g} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------------------- report
def summarise(world: int, raw: dict, wls: list, kinds: list) -> list:
    rows = []
    for wl in wls:
        rounds = raw["workloads"][wl["name"]]
        med = {k: statistics.median([t for block in rounds[k] for t in block]) for k in kinds}
        for k in kinds:
            row = {"workload": wl["name"], "processes": world, "contender": k, "step_ms": med[k] * 1e3,
                   "samples_per_s": wl["batch"] / med[k],
                   "transport": raw["transport"] if "ncclavg" in k or "+" in k else "gloo"}
            ref = REFERENCE.get(k)
            if ref in kinds:
                row["x_gloo"] = med[ref] / med[k]
                row["paired_x_gloo"] = statistics.median(statistics.median(a) / statistics.median(b)
                                                         for a, b in zip(rounds[ref], rounds[k]))
            rows.append(row)
    return rows


def table(rows: list) -> str:
    head = "| workload | processes | contender | step ms | samples/s | x gloo | paired x gloo |\n|---|---:|---|---:|---:|---:|---:|"
    lines = [head]
    for r in rows:
        x = f"{r['x_gloo']:.2f}x" if "x_gloo" in r else ""
        px = f"{r['paired_x_gloo']:.2f}x" if "paired_x_gloo" in r else ""
        lines.append(f"| {r['workload']} | {r['processes']} | {r['contender']} | {r['step_ms']:.2f} | "
                     f"{r['samples_per_s']:.0f} | {x} | {px} |")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny run (the tests use it)")
    ap.add_argument("--procs", default="2,4", help="process counts, comma-separated (default 2,4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default 10; quick: 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of blocks (default 6; quick: 2)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="contenders, comma-separated (default: all)")
    ap.add_argument("--workloads", default=None, help="workload names, comma-separated (default: all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write a markdown note here")
    args = ap.parse_args(argv)
    try:
        procs = [int(p) for p in args.procs.split(",")]
    except ValueError:
        ap.error(f"--procs: expected comma-separated integers, got {args.procs!r}")
    if any(p < 2 for p in procs):
        ap.error(f"--procs: every process count must be >= 2, got {args.procs}")
    for flag in ("steps", "rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: expected some of {', '.join(KINDS)}, got {args.kinds!r}")
    wls = workloads(args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        if any(n not in [w["name"] for w in wls] for n in names):
            ap.error(f"--workloads: expected some of {', '.join(w['name'] for w in wls)}, got {args.workloads!r}")
        wls = [w for w in wls if w["name"] in names]
    spec = {"workloads": wls, "kinds": kinds, "steps": args.steps or (2 if args.quick else 10),
            "rounds": args.rounds or (2 if args.quick else 6)}
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    rows, transports = [], {}
    for world in procs:
        raw = _run_shape(world, spec, timeout=900)
        transports[world] = raw["transport"]
        rows += summarise(world, raw, wls, kinds)
    wall = time.monotonic() - t0
    text = table(rows)
    print(text)
    payload = {"machine": _common.machine(), "command": "python bench/stock_ddp.py " + " ".join(argv or sys.argv[1:]),
               "wall_s": round(wall, 1), "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
               "spec": {k: v for k, v in spec.items()}, "transports": transports, "rows": rows}
    _common.write_json(args.json, payload)
    if args.md:
        m = payload["machine"]
        note = (f"# Stock DDP and FSDP2: backend ncclavg vs gloo, {m['date']}\n\n"
                f"Machine: {m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; torch {m['torch']}, "
                f"ncclavg {m['ncclavg']}, python {m['python']}. Load average (1 min) at start "
                f"{payload['load_average'][0]}, at end {payload['load_average'][1]} (a shared machine).\n\n"
                f"Command: `{payload['command']}` ({wall:.0f} s). Transport of the ncclavg group: "
                + ", ".join(f"{p} processes: {t}" for p, t in transports.items()) + ".\n\n"
                "Workloads (bench/scale.py's): " + "; ".join(f"{w['name']}: {w['what']}, global batch {w['batch']}"
                                                              for w in wls)
                + ".\n\nAdamW(fused=True), lr 1e-3; each process max(1, cores // processes) threads; rank 0's "
                "median step over every timed block; x gloo = ncclavg samples/s / gloo samples/s of the same "
                "kind (ddp, fsdp2); paired = the median over rounds of that ratio per round.\n\n" + text + "\n")
        Path(args.md).write_text(note)
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
