"""Scaling of TowerTrainer over processes x towers on CPUs, next to torch DDP over gloo, in one run.

Contenders (the same model, initial weights, data and global batch; AdamW, lr 1e-3, no weight decay):
  ncclavg PxT        TowerTrainer(devices=["cpu"] * T) in each of P processes (1x4, 2x2, 4x1): 4 towers in
                     all, averaged hierarchically (one-pass local average, one all-reduce per bucket per
                     process), fused CPU AdamW on the master weights. See Note [Towers of several
                     processes] in ncclavg/train/distributed.py. Every process is on this host, so the
                     all-reduces between processes go through the shared-memory channel (Note [When the
                     shared-memory channel is used] in ncclavg/comm/shm.py).
  ncclavg PxT tcp    the same with NCCLAVG_SHM=0: torch.distributed (gloo over loopback TCP) between the
                     processes, as between hosts; P > 1 only.
  ncclavg PxT+shard  the same with shard_master=True (ZeRO-1 across processes: each process steps 1/P of
                     the master weights), on the shapes with P > 1, when this build has the option.
  ddp 4x1 (fused / foreach)
                     torch DistributedDataParallel over gloo, one tower per process (P = 4), bucket_cap_mb
                     25 and gradient_as_bucket_view, torch.optim.AdamW with fused=True (torch's fastest CPU
                     AdamW) and with foreach=True. Ratios are taken against the faster of the two.
The process groups (P = 1, 2, 4) are launched here, all at once, and take turns block by block after
warm-up (Note [Interleaving process groups]). Reported per contender: median step time on rank 0,
samples/s = global batch / median step, per-phase medians (metrics.PHASES + "other"), ratios ncclavg/DDP
in samples/s (> 1: ncclavg is faster) from the medians and paired round by round, and the optimizer phase
against a memcpy-speed pass over the AdamW state, the memcpy bandwidth measured in this run.

Threads: every process gets max(1, cores // (processes * towers per process)) torch and OpenMP threads.

    python bench/scale.py                              # full run (~40 s on 2 cores)
    python bench/scale.py --quick --json /tmp/s.json   # tiny, for the tests
    python bench/scale.py --json R.json --plot R.png --md R.md
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts an in-place built checkout first on sys.path)

ROOT = Path(__file__).resolve().parent.parent
ADAMW_BYTES_PER_PARAM = 28   # grad read (4) + param, exp_avg, exp_avg_sq read and written (24)
DDP_KINDS = ("ddp_fused", "ddp_foreach")
PHASE_KEYS = ("compute", "reduce", "offload", "optimizer", "broadcast")
LR = 1e-3


# ----------------------------------------------------------------------------------------- configuration
def workloads(quick: bool) -> list[dict]:
    if quick:
        return [{"name": "mlp-tiny", "model": {"in": 32, "hidden": [64, 64]}, "data": "synthetic", "batch": 32,
                 "batches": 4, "what": "MLP 32-64-64-10 on synthetic inputs with random labels"}]
    return [
        # large enough that the reduce and optimizer phases matter next to compute
        {"name": "mlp-3M", "model": {"in": 1024, "hidden": [1024, 1024, 1024]}, "data": "synthetic",
         "batch": 256, "batches": 16, "what": "MLP 1024-1024-1024-1024-10 on synthetic inputs with random labels"},
        # the `ncclavg train` demo model on its data: per-step overheads dominate
        {"name": "digits-mlp", "model": "digits-mlp", "data": "digits", "batch": 256, "batches": 5,
         "what": "the `ncclavg train` MLP (64-128-64-10) on scikit-learn's digits"},
    ]


def shard_available() -> bool:
    from ncclavg.train.trainer import TowerTrainer

    return "shard_master" in inspect.signature(TowerTrainer).parameters


def plan_groups(shard: bool) -> list[dict]:
    """Process groups: {processes, contenders: [{id, kind, towers, shard, shm}]}. shm: NCCLAVG_SHM while
    the contender's communicator is built ("0": torch.distributed between the processes, the rows marked
    "tcp"; "auto": the shared-memory channel on this host, see ncclavg/comm/shm.py)."""
    def nc(p, t, s=False, shm="auto"):
        return {"id": f"ncclavg {p}x{t}" + ("+shard" if s else "") + (" tcp" if shm == "0" else ""),
                "kind": "ncclavg", "processes": p, "towers": t, "shard": s, "shm": shm}
    return [{"processes": 1, "contenders": [nc(1, 4)]},
            {"processes": 2, "contenders": [nc(2, 2), nc(2, 2, shm="0")] + ([nc(2, 2, True)] if shard else [])},
            {"processes": 4, "contenders": [nc(4, 1), nc(4, 1, shm="0")] + ([nc(4, 1, True)] if shard else [])
             + [{"id": f"ddp 4x1 ({k[4:]})", "kind": k, "processes": 4, "towers": 1, "shard": False}
                for k in DDP_KINDS]}]


def not_available(wls: list[dict], shard: bool) -> list[dict]:
    """The rows this build cannot run, said as such (never numbers made up for them)."""
    return [] if shard else [{"workload": wl["name"], "name": f"ncclavg {s}+shard",
                              "status": "not available in this build"} for wl in wls for s in ("2x2", "4x1")]


def threads_for(cores: int, processes: int, towers: int) -> int:
    return max(1, cores // (processes * towers))


# ----------------------------------------------------------------------------------------- the ranks
def build_model(spec):
    from ncclavg.train.models import DigitsMLP, build_model as _build

    if spec == "digits-mlp":
        return _build("mlp", seed=0)
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DigitsMLP(num_classes=10, in_features=spec["in"], hidden=spec["hidden"])


def make_batches(wl: dict) -> list:
    """The same global batches in every process (same seeds): a fixed cycle of wl['batches'] batches.

    Synthetic inputs get labels drawn independently of them: nothing to learn but memorising. With the
    learnable clusters of data.synthetic the 3 M MLP's loss reaches 0 within ~15 steps, the gradients go
    subnormal and every step slows down up to 8x (subnormal floats take a slow path on x86): the bench
    would time that, not training."""
    import torch

    from ncclavg.train import data

    n, B = wl["batch"] * wl["batches"], wl["batch"]
    if wl["data"] == "digits":
        d = data.load_digits()
        reps = -(-n // len(d.y_train))
        x, y = torch.cat([d.x_train] * reps)[:n], torch.cat([d.y_train] * reps)[:n]
    else:
        x = data.synthetic(num_samples=n + 1, input_shape=(wl["model"]["in"],), test_fraction=1 / (n + 1)).x_train
        y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(1))
    return [(x[i:i + B].contiguous(), y[i:i + B].contiguous()) for i in range(0, n, B)]


class NcclavgContender:
    def __init__(self, c: dict, wl: dict, timeout: float):
        from ncclavg.train.trainer import TowerTrainer

        extra = {"shard_master": True} if c["shard"] else {}
        before = os.environ.get("NCCLAVG_SHM")
        os.environ["NCCLAVG_SHM"] = c.get("shm", "auto")   # read when the trainer builds its communicator
        try:
            self.trainer = TowerTrainer(build_model(wl["model"]), devices=["cpu"] * c["towers"], optimizer="adamw",
                                        lr=LR, weight_decay=0.0, timeout=timeout, **extra)
        finally:
            if before is None:
                os.environ.pop("NCCLAVG_SHM", None)
            else:
                os.environ["NCCLAVG_SHM"] = before
        comm = self.trainer.comm
        self.transport = comm.transport if comm is not None else "none (one process)"
        self.params = self.trainer.plan.param_numel

    def step(self, batch) -> dict:
        rec = self.trainer.train_step(batch)
        return {"loss": rec["loss"], **{k[2:]: rec[k] for k in rec if k.startswith("t_")}}

    def close(self) -> None:
        self.trainer.close()


class DdpContender:
    """torch DDP over the default (gloo) group, one tower per process, this rank's slice of the batch."""

    def __init__(self, c: dict, wl: dict, timeout: float):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from ncclavg.train.towers import split_sizes

        self.torch, self.split_sizes = torch, split_sizes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = build_model(wl["model"])
        self.params = sum(p.numel() for p in model.parameters())
        self.ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        flavour = {"fused": True} if c["kind"] == "ddp_fused" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=LR, weight_decay=0.0, **flavour)

    def step(self, batch) -> dict:
        x, y = batch
        sizes = self.split_sizes(len(y), self.world)
        lo = sum(sizes[:self.rank])
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = self.torch.nn.functional.cross_entropy(self.ddp(x[lo:lo + sizes[self.rank]]),
                                                      y[lo:lo + sizes[self.rank]])
        loss.backward()          # DDP's bucket all-reduces overlap with it and complete inside it
        t1 = time.perf_counter()
        self.opt.step()
        return {"compute": t1 - t0, "optimizer": time.perf_counter() - t1, "loss": float(loss)}

    def close(self) -> None:   # nothing to release (the process group stays: Note [Gloo teardown])
        pass


def run_rank(spec: dict) -> None:
    """One process of a group. It waits for the launcher's orders on stdin, one JSON line each
    (build a workload's contenders, warm them up, time one block of one contender, finish), so that the
    groups, all alive at once, take turns: see Note [Interleaving process groups]. After each order rank 0
    writes <tmp>/p<P>-done-<n>."""
    import torch

    torch.set_num_threads(spec["threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist = None
    if world > 1:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    from ncclavg.comm import end_process

    out: dict = {"workloads": {}}
    made: dict = {}
    wl, batches, seen = None, [], {}
    for n in range(1 << 30):
        line = sys.stdin.readline()
        if not line:          # the launcher is gone
            end_process(3)
        order = json.loads(line)
        if dist is not None:
            dist.barrier()    # every rank has its order: the block starts together
        if order["op"] in ("build", "finish"):
            for con in made.values():
                con.close()
            made = {}
        if order["op"] == "build":
            wl = spec["workloads"][order["workload"]]
            batches = make_batches(wl)
            for c in spec["contenders"]:   # in the same order everywhere: construction is collective
                kind = NcclavgContender if c["kind"] == "ncclavg" else DdpContender
                made[c["id"]] = kind(c, wl, spec["timeout"])
            seen = {cid: 0 for cid in made}   # per contender: every one trains on the same batches
            out["workloads"][wl["name"]] = {cid: {"params": con.params, "steps": [], "block_step_s": [],
                                                  "transport": getattr(con, "transport", "gloo (DDP)")}
                                            for cid, con in made.items()}
        elif order["op"] == "warmup":
            for cid, con in made.items():
                for _ in range(spec["warmup"]):
                    con.step(batches[seen[cid] % len(batches)])
                    seen[cid] += 1
        elif order["op"] == "block":
            cid = order["contender"]
            con, rec = made[cid], out["workloads"][wl["name"]][cid]
            t_block = time.perf_counter()
            for _ in range(spec["steps"]):
                t0 = time.perf_counter()
                phases = con.step(batches[seen[cid] % len(batches)])
                rec["steps"].append({"step_s": time.perf_counter() - t0, **phases})
                seen[cid] += 1
            rec["block_step_s"].append((time.perf_counter() - t_block) / spec["steps"])
        elif order["op"] == "finish" and rank == 0:
            Path(spec["out"]).write_text(json.dumps(out))
        if dist is not None:
            dist.barrier()    # after "finish": every rank is past its last collective
        if rank == 0:
            Path(spec["done"].format(n=n)).write_text("")
        if order["op"] == "finish":
            end_process(0)    # See Note [Gloo teardown] in ncclavg/comm/dist.py


# ----------------------------------------------------------------------------------------- the launcher
# Note [Interleaving process groups]
# The machine's load changes while the benchmark runs (other jobs), and each shape needs its own process
# group, so timing the groups one after the other would hand each shape a different machine. All groups
# (1 + 2 + 4 processes) are therefore started at once and take turns: the launcher orders one block of
# `steps` steps of one contender at a time, every contender of every group in each round (the order
# rotated from round to round), and waits for it. A group not ordered waits in a blocking read of its
# stdin and uses no CPU (a heartbeat thread per communicator wakes every 0.5 s), so each block has the
# machine to itself apart from outside load. Every wait is bounded: a rank that exits early or an order
# that does not complete within the timeout stops the whole run with the rank's last output.
def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no output)"


class Group:
    """The running processes of one group and their order count."""

    def __init__(self, group: dict, base: dict, tmp: Path):
        self.P = P = group["processes"]
        self.contenders = group["contenders"]
        self.threads = threads_for(base["cores"], P, self.contenders[0]["towers"])
        self.spec = dict(base, contenders=self.contenders, out=str(tmp / f"result-p{P}.json"),
                         done=str(tmp / f"p{P}-done-{{n}}"), threads=self.threads)
        spec_path = tmp / f"spec-p{P}.json"
        spec_path.write_text(json.dumps(self.spec))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT", "NCCLAVG_DEBUG")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = str(self.threads)
        if P > 1:
            from ncclavg.bench.launch import free_port

            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(P),
                       LOCAL_WORLD_SIZE=str(P))
            if sys.platform.startswith("linux"):
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp / f"p{P}-rank{r}.log" for r in range(P)]
        self.orders = 0
        for r in range(P):
            with open(self.logs[r], "w") as f:
                rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r)) if P > 1 else env
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--_rank", str(spec_path)], env=rank_env,
                    stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, text=True))

    def _check(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{self.P}-process group: rank {r} exited with code {p.returncode}:\n"
                                   f"{_tail(self.logs[r])}")

    def order(self, timeout: float, **order) -> None:
        """Sends `order` to every rank and waits (bounded) until rank 0 says it is done."""
        self._check()
        for r, p in enumerate(self.procs):
            try:
                p.stdin.write(json.dumps(order) + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                p.wait(5)
                self._check()
                raise RuntimeError(f"{self.P}-process group: rank {r} is gone:\n{_tail(self.logs[r])}") from None
        done = Path(self.spec["done"].format(n=self.orders))
        deadline = time.monotonic() + timeout
        while not done.exists():
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.P}-process group: order {order} did not complete within "
                                   f"{timeout:.0f} s; rank 0's log:\n{_tail(self.logs[0])}")
            time.sleep(0.003)
        self.orders += 1

    def finish(self, timeout: float) -> dict:
        self.order(timeout, op="finish")
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.P}-process group: ranks still running {timeout:.0f} s after the last order")
            time.sleep(0.02)
        self._check()
        return json.loads(Path(self.spec["out"]).read_text())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            try:
                p.stdin.close()
            except OSError:
                pass


def run_groups(plan: list[dict], base: dict, timeout: float, log=print) -> dict:
    """Starts every group, runs the orders (see Note [Interleaving process groups]) and returns
    {processes: rank 0's result} plus the threads each group used."""
    with tempfile.TemporaryDirectory(prefix="ncclavg-scale-") as tmp:
        groups: list[Group] = []
        try:
            for g in plan:
                groups.append(Group(g, base, Path(tmp)))
            by_id = {c["id"]: grp for grp in groups for c in grp.contenders}
            ids = list(by_id)
            for w, wl in enumerate(base["workloads"]):
                t0 = time.monotonic()
                for grp in groups:
                    grp.order(timeout, op="build", workload=w)
                    grp.order(timeout, op="warmup")
                for r in range(base["rounds"]):
                    for cid in ids[r % len(ids):] + ids[:r % len(ids)]:   # rotated: none always follows another
                        by_id[cid].order(timeout, op="block", contender=cid)
                log(f"  {wl['name']}: {len(ids)} contenders x {base['rounds']} rounds in "
                    f"{time.monotonic() - t0:.1f} s", flush=True)
            return {grp.P: {**grp.finish(timeout), "threads": grp.threads} for grp in groups}
        finally:
            for grp in groups:
                grp.stop()


# ----------------------------------------------------------------------------------------- the report
def summarise(c: dict, raw: dict, batch: int, threads: int, copy_gbps: float, per_block: int) -> dict:
    """One row. Its label is "name", not "contender": bench/cpu_suite.py reads rows with a "contender" as
    an `ncclavg bench` sweep."""
    steps = raw["steps"]
    step_s = statistics.median(s["step_s"] for s in steps)
    phases = {k: statistics.median(s[k] for s in steps) for k in PHASE_KEYS if k in steps[0]}
    # what no phase covers: for TowerTrainer zero_grad and the per-step loss/accuracy exchange between the
    # processes; for DDP (timed as compute + optimizer) next to nothing
    phases["other"] = statistics.median(s["step_s"] - sum(s[k] for k in PHASE_KEYS if k in s) for s in steps)
    stepped = raw["params"] / c["processes"] if c["shard"] else raw["params"]
    opt_bound_s = ADAMW_BYTES_PER_PARAM * stepped / (copy_gbps * 1e9)
    blocks = [statistics.median(s["step_s"] for s in steps[i:i + per_block]) for i in range(0, len(steps), per_block)]
    return {"name": c["id"], "kind": "ddp" if c["kind"] in DDP_KINDS else "ncclavg",
            "optimizer": {"ncclavg": "ncclavg fused CPU AdamW (master='cpu')", "ddp_fused": "torch AdamW fused=True",
                          "ddp_foreach": "torch AdamW foreach=True"}[c["kind"]],
            "shape": f"{c['processes']}x{c['towers']}", "processes": c["processes"],
            "transport": raw.get("transport"),   # between the processes: shm, gloo, or DDP's gloo
            "towers_per_process": c["towers"], "shard_master": c["shard"], "threads_per_process": threads,
            "params": raw["params"], "global_batch": batch, "steps_timed": len(steps),
            "step_s": step_s, "mean_step_s": statistics.mean(raw["block_step_s"]),
            "samples_per_s": batch / step_s, "phases_s": phases, "time_us": step_s * 1e6,
            "block_median_s": blocks, "steps_s": [round(s["step_s"], 6) for s in steps],
            # a run whose loss reaches ~0 times subnormal arithmetic (see make_batches); DDP: rank 0's slice
            "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
            # the least disturbed round: on a shared machine, close to what the step costs when alone
            "best_round_step_s": min(blocks), "best_round_samples_per_s": batch / min(blocks),
            "optimizer_fraction_of_copy_bw": opt_bound_s / phases["optimizer"] if phases.get("optimizer") else None}


def add_ratios(rows: list[dict]) -> None:
    """Per workload: ratio = ncclavg samples/s / DDP samples/s (= DDP median step / ncclavg median step),
    against each DDP row and against the faster one (the suite's speedup_vs_torch); and paired: the
    median over rounds of DDP's block median / ncclavg's block median in the same round (blocks of one
    round ran seconds apart, so outside load that changes between rounds cancels)."""
    for wl in {r["workload"] for r in rows}:
        mine = [r for r in rows if r["workload"] == wl]
        ddp = {r["name"]: r for r in mine if r["kind"] == "ddp"}
        if not ddp:
            continue
        best = min(ddp.values(), key=lambda r: r["step_s"])
        for r in mine:
            if r["kind"] != "ncclavg":
                continue
            r["case"] = (f"{wl} ({r['params'] / 1e6:.2f} M params, batch {r['global_batch']}): TowerTrainer "
                         f"{r['name'][8:]} step vs {best['name']}")
            r["torch_time_us"] = best["time_us"]
            r["speedup_vs_torch"] = best["step_s"] / r["step_s"]
            r["best_ddp"] = best["name"]
            r["ratio_vs_ddp"] = {cid: d["step_s"] / r["step_s"] for cid, d in ddp.items()}
            r["paired_ratio_vs_ddp"] = {cid: statistics.median(a / b for a, b in zip(d["block_median_s"],
                                                                                     r["block_median_s"]))
                                        for cid, d in ddp.items()}


def table(rows: list[dict], missing: list[dict]) -> str:
    ddp_ids = sorted({r["name"] for r in rows if r["kind"] == "ddp"})
    short = {d: "ddp " + d.split("(")[-1].rstrip(")") for d in ddp_ids}
    phases = [p for p in PHASE_KEYS + ("other",) if any(r["phases_s"].get(p) for r in rows)]   # offload: GPUs only
    head = (["workload", "contender", "step ms", "samples/s", "best round ms"] + [f"{p} ms" for p in phases]
            + ["opt %copy"]
            + [f"x {short[d]}" for d in ddp_ids] + [f"paired x {short[d]}" for d in ddp_ids])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]

    def ms(v):
        return "" if v is None else f"{v * 1e3:.1f}"
    for r in rows:
        cells = [r["workload"], r["name"], ms(r["step_s"]), f"{r['samples_per_s']:.0f}",
                 ms(r["best_round_step_s"])]
        cells += [ms(r["phases_s"].get(p)) for p in phases]
        f = r.get("optimizer_fraction_of_copy_bw")
        cells.append("" if f is None else f"{f * 100:.0f}%")
        for key in ("ratio_vs_ddp", "paired_ratio_vs_ddp"):
            cells += [f"{r[key][d]:.2f}x" if key in r else "" for d in ddp_ids]
        lines.append("| " + " | ".join(cells) + " |")
    for m in missing:
        lines.append("| " + " | ".join([m["workload"], m["name"], m["status"]] + [""] * (len(head) - 3)) + " |")
    return "\n".join(lines)


def plot(path: str, result: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot written", file=sys.stderr)
        return None
    wls = [w["name"] for w in result["workloads"]]
    fig, axes = plt.subplots(len(wls), 2, figsize=(13, 4.2 * len(wls)), squeeze=False)
    try:
        for (ax_s, ax_p), wl in zip(axes, wls):
            rows = [r for r in result["rows"] if r["workload"] == wl]
            names = [r["name"].replace("ncclavg ", "") for r in rows]
            colors = ["tab:gray" if r["kind"] == "ddp" else "tab:blue" for r in rows]
            bars = ax_s.bar(names, [r["samples_per_s"] for r in rows], color=colors)
            for b, r in zip(bars, rows):
                if "speedup_vs_torch" in r:
                    ax_s.annotate(f"{r['speedup_vs_torch']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                  ha="center", va="bottom", fontsize=8)
            ax_s.set_ylabel("samples/s (global batch / median step)")
            ax_s.set_title(f"{wl}: throughput (label: x best DDP)")
            bottom = [0.0] * len(rows)
            for p in PHASE_KEYS + ("other",):
                vals = [max(0.0, r["phases_s"].get(p) or 0.0) * 1e3 for r in rows]
                if any(vals):
                    ax_p.bar(names, vals, bottom=bottom, label=p)
                    bottom = [b + v for b, v in zip(bottom, vals)]
            ax_p.set_ylabel("ms (median per phase, rank 0)")
            ax_p.set_title(f"{wl}: step phases (DDP: reduce inside compute)")
            ax_p.legend(fontsize=8)
            for ax in (ax_s, ax_p):
                ax.tick_params(axis="x", labelrotation=25, labelsize=8)
                ax.grid(axis="y", alpha=0.3)
        h = result["header"]
        fig.suptitle(f"TowerTrainer PxT CPU towers vs DDP/gloo: {h['machine']['cpu']}, "
                     f"{h['machine']['cores']} cores, {h['date'][:10]}", fontsize=10)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    print(f"wrote {path}")
    return path


def markdown(result: dict, md_table: str) -> str:
    h = result["header"]
    m = h["machine"]
    return "\n".join([
        f"# Scaling: TowerTrainer processes x towers vs DDP over gloo, {h['date'][:10]}", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; torch {m['torch']}, ncclavg "
        f"{m['ncclavg']}, python {m['python']}. Load average at start {h['loadavg_start'][0]:.2f}, at end "
        f"{h['loadavg_end'][0]:.2f}. memcpy {h['memcpy_gbps_start']:.1f} GB/s at start, "
        f"{h['memcpy_gbps_end']:.1f} GB/s at end.", "",
        f"Command: `{h['command']}` ({h['wall_s']:.0f} s).", "",
        "Workloads (global batch split over 4 towers in every shape; AdamW lr 1e-3): " + "; ".join(
            f"{w['name']}: {w['what']}, {w['params'] / 1e6:.3g} M parameters, batch {w['batch']}"
            for w in result["workloads"]) + ".", "",

        f"Threads: {h['threads_rule']}.", f"Timing: {h['timing']}.", f"Phases: {h['phases']}.",
        f"Ratios (x ddp F: against DDP with AdamW F): {h['ratios']}.",
        f"opt %copy: {h['optimizer_vs_copy']}", f"shard_master: {h['shard_master']}.",
        "Transport between processes (the row's `transport`): " + "; ".join(
            f"{r['name']}: {r['transport']}" for r in result["rows"] if r["workload"] == result["rows"][0]["workload"])
        + ".", "",
        md_table, "",
        "On 2 cores every shape oversubscribes the machine (4 towers or 4 processes on 2 cores): these numbers "
        "compare the ways of running the same 4-tower step on this machine, not scaling to more cores.", ""])


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (for the tests)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    ap.add_argument("--md", default=None, help="write a markdown summary here")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per contender (excluded)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per contender per round")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound on every wait for a group, seconds")
    ap.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rank:
        run_rank(json.loads(Path(args._rank).read_text()))
        return 0   # not reached: run_rank ends the process

    t_start = time.monotonic()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shard = shard_available()
    wls = workloads(args.quick)
    base = {"workloads": wls, "cores": cores, "timeout": 60.0,
            "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 3),
            "steps": args.steps or (3 if args.quick else 4), "rounds": args.rounds or (1 if args.quick else 10)}
    groups = plan_groups(shard)
    import numpy as np

    src = np.ones((64 << 20) // 4, dtype=np.float32)
    dst = np.empty_like(src)

    def memcpy_gbps() -> float:   # libc memcpy, as bench/trainer.py and cpu_suite.py measure it
        return 2 * src.nbytes / _common.median_seconds(lambda: np.copyto(dst, src), reps=7) / 1e9

    from ncclavg.bench.report import cpu_model

    load0 = os.getloadavg()
    copy0 = memcpy_gbps()
    print(f"scale bench: {cores} cores ({cpu_model(_common.UNKNOWN_CPU)}); ncclavg 1x4, 2x2, 4x1"
          + (" (+shard_master on 2x2, 4x1)" if shard else " (shard_master: not available in this build)")
          + f", DDP/gloo 4x1; {base['warmup']} warm-up + {base['rounds']} rounds x {base['steps']} timed steps; "
          f"threads per process = max(1, {cores} // (processes*towers)); memcpy {copy0:.1f} GB/s", flush=True)
    t0 = time.monotonic()
    try:
        raw = run_groups(groups, base, args.timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"scale bench: {e}", file=sys.stderr)
        return 1
    print(f"  all groups done in {time.monotonic() - t0:.1f} s (threads per process: "
          + ", ".join(f"P={P}: {r['threads']}" for P, r in raw.items()) + ")", flush=True)
    copy1 = memcpy_gbps()
    copy_gbps = statistics.median([copy0, copy1])
    rows, missing = [], not_available(wls, shard)
    for wl in wls:
        for g in groups:
            got = raw[g["processes"]]
            for c in g["contenders"]:
                row = summarise(c, got["workloads"][wl["name"]][c["id"]], wl["batch"], got["threads"], copy_gbps,
                                base["steps"])
                rows.append({"workload": wl["name"], **row})
    add_ratios(rows)
    machine = _common.machine()
    machine["threads_used"] = None   # per process: see the rows and threads_rule
    result = {
        "header": {
            "benchmark": "scale", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
            "command": " ".join(["python bench/scale.py", *(sys.argv[1:] if argv is None else argv)]),
            "arguments": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "warmup": base["warmup"], "steps_per_round": base["steps"], "rounds": base["rounds"],
            "threads_rule": f"each process: max(1, cores // (processes * towers per process)) torch and OpenMP "
                            f"threads (cores = {cores})",
            "timing": "rank 0's wall time per step; every process group alive at once, taking turns: one block "
                      "of steps_per_round steps of one contender at a time, every contender in each round (order "
                      "rotated), a barrier before each block (Note [Interleaving process groups]); medians over the "
                      f"{base['rounds'] * base['steps']} timed steps; mean_step_s = wall time of the timed blocks / "
                      "steps; best_round_step_s = the lowest block median (the least disturbed round)",
            "phases": "metrics.PHASES medians on rank 0; other = what no phase covers (TowerTrainer: zero_grad and "
                      "the per-step loss/accuracy exchange between processes); DDP: compute = forward + backward "
                      "with its overlapped bucket all-reduces, then optimizer",
            "ratios": "ratio_vs_ddp = DDP median step / ncclavg median step = ncclavg samples/s / DDP samples/s "
                      "(> 1: ncclavg faster); speedup_vs_torch against the faster DDP row; paired_ratio_vs_ddp = "
                      "median over rounds of the same ratio of the two block medians of one round",
            "optimizer_vs_copy": f"time of a memcpy-speed pass over the AdamW state ({ADAMW_BYTES_PER_PARAM} B per "
                                 "parameter stepped: 1/P of them with shard_master) / the optimizer phase; the 1x4 "
                                 "phase also averages its 4 towers (fused)",
            "shard_master": ("available: TowerTrainer(shard_master=True) rows" if shard else
                             "not available in this build"),
            "memcpy_gbps_start": copy0, "memcpy_gbps_end": copy1, "memcpy_bytes": int(src.nbytes),
            "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
            "wall_s": round(time.monotonic() - t_start, 1)},
        "workloads": [{**wl, "params": next(r["params"] for r in rows if r["workload"] == wl["name"])} for wl in wls],
        "rows": rows, "not_available": missing}
    md_table = table(rows, missing)
    print(md_table)
    _common.write_json(args.json, result)
    if args.plot:
        plot(args.plot, result)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(markdown(result, md_table))
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
