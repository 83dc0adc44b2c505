"""Stock torch DDP and FSDP2 on the `ncclavg` torch.distributed backend against the same on gloo, in one run.

Each shape (P processes on this host, P = 2 and 4) is one spawned job. Every process initialises the
default group with backend "ncclavg" and makes a gloo group over the same ranks, then builds every
contender from the same initial weights (the models of bench/scale.py):
  ddp gloo              DistributedDataParallel over the gloo group (bucket_cap_mb 25, gradient_as_bucket_view)
  ddp ncclavg           the same over the ncclavg group: no other change to the training code
  ddp gloo+hook         DDP over gloo with ncclavg.ddp.register(model): the buckets through ncclavg
  fsdp2 gloo / ncclavg  fully_shard (each Linear, then the root) on a CPU DeviceMesh of the group
  fsdp2 gloo+comms      FSDP2 over gloo with ncclavg's custom all-gather / reduce-scatter
                        (ncclavg.process_group.fsdp_comms.use_ncclavg)
All use torch.optim.AdamW(fused=True), lr 1e-3, the global batch split over the P processes. The
contenders take turns block by block after one warm-up block each (order rotated every round, a barrier
before each block), so the machine's load falls on all alike. Reported: rank 0's median step time,
samples/s = global batch / median step, and ncclavg / gloo in samples/s for the same kind (ddp, fsdp2),
from the medians and paired round by round (> 1: ncclavg faster).

With --frameworks, frameworks that take the default group and no other (it cannot be handed a gloo group
in the same processes) are timed the same way, one spawned job per backend: every process initialises the
default group with `deepspeed.init_distributed(dist_backend=B)`, B = "ncclavg" or "gloo", and times in turn
(order rotated every round) each of:
  zero1 / zero2 / zero3  deepspeed.initialize(model, optimizer=torch.optim.AdamW(fused=True)), ZeRO stage
                         1, 2 or 3, fp32, micro batch = global batch / P, DeepSpeed's default buckets;
                         engine.backward(loss), engine.step()
  trainer                transformers' Trainer over the group (TrainingArguments(use_cpu=True), no
                         ddp_backend: Note in examples/transformers_trainer.py), optim adamw_torch_fused,
                         constant lr, the same global batches (its own DistributedSampler); a step is timed
                         from on_step_begin to on_step_end (forward, backward, DDP's all-reduces, clipping,
                         the optimizer)
one warm-up block each, then one timed block of --fw-steps steps; the two backends' jobs alternate round by
round (ncclavg first in even rounds), so a round pairs adjacent jobs. Reported as above, with the gloo job's
same contender as the reference.

    python bench/stock_ddp.py                                   # full run (~2 min on 2 cores)
    python bench/stock_ddp.py --quick                           # a tiny run, for the tests
    python bench/stock_ddp.py --json R.json --md R.md
    python bench/stock_ddp.py --kinds "" --frameworks zero1,zero2,zero3,trainer --procs 2,4
                                                                # needs deepspeed, transformers, accelerate
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
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
FRAMEWORKS = ("zero1", "zero2", "zero3", "trainer")
REFERENCE.update({f"{f} ncclavg": f"{f} gloo" for f in FRAMEWORKS})


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
            from ncclavg.process_group.fsdp_comms import use_ncclavg

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


# ------------------------------------------------------------------- frameworks on the default group
def _zero_block(stage: int, model, mine: list, warmup: int, steps: int) -> list:
    import deepspeed
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    config = {"train_micro_batch_size_per_gpu": len(mine[0][0]), "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    times = []
    for i in range(warmup + steps):
        x, y = mine[i % len(mine)]
        t0 = time.perf_counter()
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.destroy()
    return times[warmup:]


def _trainer_block(model, batches: list, world: int, warmup: int, steps: int, threads: int) -> list:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.training_args import ParallelMode

    class WithLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.m(x), labels)}

    class Samples(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.cat([x for x, _ in batches])
            self.y = torch.cat([y for _, y in batches])

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, use_cpu=True, max_steps=warmup + steps,
                                  per_device_train_batch_size=len(batches[0][1]) // world, learning_rate=1e-3,
                                  weight_decay=0.01, lr_scheduler_type="constant", optim="adamw_torch_fused",
                                  logging_steps=10 ** 6, save_strategy="no", report_to="none", disable_tqdm=True,
                                  seed=0, dataloader_num_workers=0, remove_unused_columns=False,
                                  ddp_find_unused_parameters=False)
        if targs.parallel_mode != ParallelMode.DISTRIBUTED:
            raise RuntimeError(f"Trainer sees {targs.parallel_mode}, not DISTRIBUTED")
        cb = StepTimes()
        trainer = Trainer(model=WithLoss(model), args=targs, train_dataset=Samples(), callbacks=[cb])
        torch.set_num_threads(threads)
        trainer.train()
        wrapped = type(trainer.model_wrapped).__name__
    if wrapped != "DistributedDataParallel":
        raise RuntimeError(f"Trainer did not wrap the model in DDP ({wrapped})")
    return cb.times[warmup:]


def rank_fw_main(rank: int, world: int, port: int, backend: str, spec: dict, order: list, out: str) -> None:
    threads = max(1, (os.cpu_count() or 1) // world)
    os.environ.update(OMP_NUM_THREADS=str(threads), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime
    import gc

    import deepspeed
    import torch
    import torch.distributed as dist

    import ncclavg  # noqa: F401  (registers the backend)
    from ncclavg.comm import end_process

    torch.set_num_threads(threads)
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=300))
    assert dist.get_backend() == backend, dist.get_backend()
    result: dict = {"threads": threads, "transport": getattr(dist.group.WORLD, "transport", "gloo"),
                    "workloads": {}}
    for wl in spec["workloads"]:
        batches = make_batches(wl)
        per = wl["batch"] // world
        mine = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in batches]
        times = {}
        for f in order:
            dist.barrier()
            model = build_model(wl["model"])
            if f == "trainer":
                times[f] = _trainer_block(model, batches, world, spec["fw_warmup"], spec["fw_steps"], threads)
            else:
                times[f] = _zero_block(int(f[-1]), model, mine, spec["fw_warmup"], spec["fw_steps"])
            torch.set_num_threads(threads)
            del model
            gc.collect()
        result["workloads"][wl["name"]] = times
    dist.barrier()
    if rank == 0:
        result["threads_seen"] = torch.get_num_threads()
        Path(out).write_text(json.dumps(result))
    end_process(0)   # see Note [Gloo teardown] in ncclavg/comm/dist.py


def _spawn(fn, world: int, args: tuple, timeout: float) -> dict:
    import torch.multiprocessing as mp

    from ncclavg.bench.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(fn, args=(world, port, *args, out), nprocs=world, join=False, start_method="spawn")
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


def _run_frameworks(world: int, spec: dict, timeout: float) -> tuple:
    """Alternating jobs, one per backend per round; returns (raw as rank_main's, transport of ncclavg)."""
    fws = spec["frameworks"]
    raw: dict = {"workloads": {wl["name"]: {f"{f} {b}": [] for f in fws for b in ("gloo", "ncclavg")}
                               for wl in spec["workloads"]}}
    transport = None
    for r in range(spec["fw_rounds"]):
        order = fws[r % len(fws):] + fws[:r % len(fws)]
        for b in (("ncclavg", "gloo") if r % 2 == 0 else ("gloo", "ncclavg")):
            job = _spawn(rank_fw_main, world, (b, spec, order), timeout)
            if b == "ncclavg":
                transport = job["transport"]
            for name, times in job["workloads"].items():
                for f, t in times.items():
                    raw["workloads"][name][f"{f} {b}"].append(t)
    return raw, transport


def _run_shape(world: int, spec: dict, timeout: float) -> dict:
    return _spawn(rank_main, world, (spec,), timeout)


# ----------------------------------------------------------------------------------------- report
def summarise(world: int, raw: dict, wls: list, kinds: list) -> list:
    rows = []
    for wl in wls:
        rounds = raw["workloads"][wl["name"]]
        med = {k: statistics.median([t for block in rounds[k] for t in block]) for k in kinds}
        for k in kinds:
            row = {"workload": wl["name"], "processes": world, "contender": k, "step_ms": med[k] * 1e3,
                   "samples_per_s": wl["batch"] / med[k],
                   "block_median_ms": [round(statistics.median(block) * 1e3, 3) for block in rounds[k]],
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


def _framework_versions(fws: list) -> dict:
    import importlib.metadata as md

    names = (["deepspeed"] if any(f.startswith("zero") for f in fws) else []) + (
        ["transformers", "accelerate"] if "trainer" in fws else [])
    return {n: md.version(n) for n in names}


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny run (the tests use it)")
    ap.add_argument("--procs", default="2,4", help="process counts, comma-separated (default 2,4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default 10; quick: 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of blocks (default 6; quick: 2)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="contenders, comma-separated (default: all)")
    ap.add_argument("--workloads", default=None, help="workload names, comma-separated (default: all)")
    ap.add_argument("--frameworks", default="", help="also time these on the default group, comma-separated, "
                    f"some of {', '.join(FRAMEWORKS)} (default: none; needs deepspeed / transformers)")
    ap.add_argument("--fw-steps", type=int, default=None, help="timed steps per framework block (default 30; quick: 3)")
    ap.add_argument("--fw-rounds", type=int, default=None, help="rounds of framework jobs (default 3; quick: 1)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write a markdown note here")
    args = ap.parse_args(argv)
    try:
        procs = [int(p) for p in args.procs.split(",")]
    except ValueError:
        ap.error(f"--procs: expected comma-separated integers, got {args.procs!r}")
    if any(p < 2 for p in procs):
        ap.error(f"--procs: every process count must be >= 2, got {args.procs}")
    for flag in ("steps", "rounds", "fw_steps", "fw_rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    fws = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if any(f not in FRAMEWORKS for f in fws):
        ap.error(f"--frameworks: expected some of {', '.join(FRAMEWORKS)}, got {args.frameworks!r}")
    if (not kinds and not fws) or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: expected some of {', '.join(KINDS)} (or none with --frameworks), got {args.kinds!r}")
    wls = workloads(args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        if any(n not in [w["name"] for w in wls] for n in names):
            ap.error(f"--workloads: expected some of {', '.join(w['name'] for w in wls)}, got {args.workloads!r}")
        wls = [w for w in wls if w["name"] in names]
    spec = {"workloads": wls, "kinds": kinds, "steps": args.steps or (2 if args.quick else 10),
            "rounds": args.rounds or (2 if args.quick else 6), "frameworks": fws,
            "fw_steps": args.fw_steps or (3 if args.quick else 30), "fw_warmup": 2 if args.quick else 5,
            "fw_rounds": args.fw_rounds or (1 if args.quick else 3)}
    fw_kinds = [f"{f} {b}" for f in fws for b in ("gloo", "ncclavg")]
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    rows, transports, fw_transports = [], {}, {}
    for world in procs:
        if kinds:
            raw = _run_shape(world, spec, timeout=900)
            transports[world] = raw["transport"]
            rows += summarise(world, raw, wls, kinds)
        if fws:
            raw, fw_transports[world] = _run_frameworks(world, spec, timeout=900)
            raw["transport"] = fw_transports[world]
            rows += summarise(world, raw, wls, fw_kinds)
    wall = time.monotonic() - t0
    text = table(rows)
    print(text)
    payload = {"machine": _common.machine(), "command": "python bench/stock_ddp.py " + shlex.join(argv or sys.argv[1:]),
               "wall_s": round(wall, 1), "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
               "spec": {k: v for k, v in spec.items()}, "transports": transports, "rows": rows}
    if fws:
        payload["framework_transports"] = fw_transports
        payload["framework_versions"] = _framework_versions(fws)
    _common.write_json(args.json, payload)
    if args.md:
        m = payload["machine"]
        what = " and ".join(x for x in ("Stock DDP and FSDP2" if kinds else "",
                                        "frameworks (" + ", ".join(fws) + ")" if fws else "") if x)
        all_transports = {**{f"{p} processes": t for p, t in transports.items()},
                          **{f"{p} processes (frameworks)": t for p, t in fw_transports.items()}}
        versions = ("; " + ", ".join(f"{k} {v}" for k, v in payload["framework_versions"].items())) if fws else ""
        note = (f"# {what}: backend ncclavg vs gloo, {m['date']}\n\n"
                f"Machine: {m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; torch {m['torch']}, "
                f"ncclavg {m['ncclavg']}, python {m['python']}{versions}. Load average (1 min) at start "
                f"{payload['load_average'][0]}, at end {payload['load_average'][1]} (a shared machine).\n\n"
                f"Command: `{payload['command']}` ({wall:.0f} s). Transport of the ncclavg group: "
                + ", ".join(f"{p}: {t}" for p, t in all_transports.items()) + ".\n\n"
                "Workloads (bench/scale.py's): " + "; ".join(f"{w['name']}: {w['what']}, global batch {w['batch']}"
                                                              for w in wls)
                + ".\n\nAdamW(fused=True), lr 1e-3; each process max(1, cores // processes) threads; rank 0's "
                "median step over every timed block; x gloo = ncclavg samples/s / gloo samples/s of the same "
                "kind (ddp, fsdp2" + (", " + ", ".join(fws) if fws else "") + "); paired = the median over rounds "
                "of that ratio per round."
                + (f" Frameworks: one job per backend per round ({spec['fw_rounds']} rounds, alternating), "
                   f"{spec['fw_warmup']} warm-up steps then {spec['fw_steps']} timed steps per framework per job; "
                   "a round pairs the two backends' adjacent jobs (see the docstring of bench/stock_ddp.py)."
                   if fws else "") + "\n\n" + text + "\n")
        Path(args.md).write_text(note)
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
