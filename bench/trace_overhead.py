"""What the flight recorder and torch.profiler cost the `ncclavg` backend: `dist.all_reduce` of 8 B and
1 MiB of float32 on 2 processes of this host, in interleaved blocks in the same processes:

  off       the group's recorder detached (as NCCLAVG_TRACE_BUFFER_SIZE=0), no profiler
  recorder  the recorder on (the default), no profiler
  profiler  the recorder on, inside torch.profiler.profile(record_shapes=True)

each for the call the runner runs (async_op=True, then wait: every such call is a Job, where the recorder
and the profiler hook in) and the synchronous call (the fast path where it takes it, which records
its call with Recorder.done; under the profiler it steps aside and the call runs on the runner's worker).
Prints us per call and the ratios to `off` (the median of the ratios of blocks run side by side), and
the hooks' own cost measured alone in this process (ns per call: the profiler check every collective
makes, recording one lane collective, recording one fast-path call); --out writes JSON.

    python bench/trace_overhead.py --out bench/results/trace_overhead-cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import _common  # noqa: F401  (a checkout's built core first)

SIZES = {"8 B": 2, "1 MiB": 262144}
CONFIGS = ("off", "recorder", "profiler")


def _block(dist, torch, pg, numel, iters, sync):
    t = torch.ones(numel)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if sync:
            dist.all_reduce(t)
        else:
            dist.all_reduce(t, async_op=True).wait()
    return (time.perf_counter() - t0) / iters


def _rank(rank, port, blocks, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import ncclavg  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("ncclavg", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    pg = dist.group.WORLD
    recorder = pg._flight
    times = {}
    for _ in range(blocks):
        for size, numel in SIZES.items():
            iters = 400 if numel < 1000 else 40
            for sync in (False, True):
                for cfg in CONFIGS:
                    pg._flight = pg._runner.recorder = None if cfg == "off" else recorder
                    if cfg == "profiler":
                        with torch.profiler.profile(record_shapes=True):
                            s = _block(dist, torch, pg, numel, iters, sync)
                    else:
                        s = _block(dist, torch, pg, numel, iters, sync)
                    times.setdefault(f"{size} {'sync' if sync else 'async+wait'}", {}).setdefault(cfg, []).append(s)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.barrier()
    from ncclavg.comm import end_process

    end_process(0)


def hook_costs(n: int = 200000) -> dict:
    """ns per call of the check and of one collective's record (issue, start, finish), in-process."""
    import timeit

    import torch

    from ncclavg.transport import calls, flight, profiling

    rec = flight.Recorder("bench", 0, 2, 0, "shm", flight.DEFAULT_SIZE)
    t, call = torch.ones(2), calls.make("all_reduce", torch.float32, count=2)
    tensors = [t]

    def record():
        r = rec.issue(call, tensors)
        flight.start(r)
        flight.finish(r, None)

    what = ("all_reduce", None, None)

    def record_fast():
        rec.done(what, torch.float32, 2)

    return {"profiler check": min(timeit.repeat(profiling.enabled, number=n, repeat=5)) / n * 1e9,
            "record one collective": min(timeit.repeat(record, number=n, repeat=5)) / n * 1e9,
            "record one fast-path call": min(timeit.repeat(record_fast, number=n, repeat=5)) / n * 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=7, help="interleaved blocks per configuration (default 7)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    from ncclavg.bench.launch import free_port

    port = free_port()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "times.json")
        mp.spawn(_rank, args=(port, args.blocks, raw), nprocs=2)
        with open(raw) as f:
            times = json.load(f)
    load_after = os.getloadavg()
    rows = {}
    print(f"{'case':<22}" + "".join(f"{c + ' us':>14}" for c in CONFIGS) + f"{'recorder/off':>14}{'profiler/off':>14}")
    for case, by_cfg in times.items():
        med = {c: statistics.median(v) * 1e6 for c, v in by_cfg.items()}
        # paired per block: the ratio of each block to the `off` block run next to it
        ratio = {c: statistics.median(a / b for a, b in zip(by_cfg[c], by_cfg["off"])) for c in CONFIGS[1:]}
        rows[case] = {"us": med, "ratio_to_off": ratio}
        print(f"{case:<22}" + "".join(f"{med[c]:>14.2f}" for c in CONFIGS) +
              f"{ratio['recorder']:>14.3f}{ratio['profiler']:>14.3f}")
    costs = hook_costs()
    from ncclavg.bench.report import cpu_model

    print("alone: " + ", ".join(f"{k} {v:.0f} ns" for k, v in costs.items()))
    cpu = cpu_model(_common.UNKNOWN_CPU)
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; cpu: {cpu}")
    if args.out:
        _common.write_json(args.out, {"machine": _common.machine(), "load_before": load_before,
                                      "load_after": load_after, "blocks": args.blocks, "results": rows,
                                      "hook_ns": costs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
