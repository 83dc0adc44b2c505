"""Step time of TowerTrainer against the torch way of doing the same work.

Contenders (the same model, batch and towers; one optimizer step each):
  ncclavg_master_cpu     TowerTrainer(master="cpu"): GPU towers -> reduce-scatter-avg, D2H of 1/N shards,
                         fused CPU AdamW, H2D + all-gather, pipelined per bucket; CPU towers -> the fused
                         average-of-N + AdamW straight from the towers' buckets, then copy-out.
  ncclavg_master_device  TowerTrainer(master="device"): GradientAverager + torch AdamW on every tower.
  torch_offload          the plain torch loop with the same roles: backward on each tower, gradients
                         .cpu() and averaged with torch on the host, torch AdamW on fp32 CPU master
                         weights, new weights copied back (.to(device) / copy_) into every tower.
Reported: median step time of each (interleaved rounds after warm-up, so outside load hits them alike),
the ratios torch_offload / ncclavg_master_cpu and master_device / master_cpu, the optimizer phase of the
CPU master as bytes moved per second against the host memcpy bandwidth measured in the same run, and on
GPUs the pinned H2D/D2H bandwidth. Writes bench/results/trainer_<cpu|gpu>.json.

    python bench/trainer.py            # GPUs when visible (~100 M parameters), else 2 CPU towers (~8 M)
    python bench/trainer.py --quick    # smaller, fewer repetitions
    python bench/trainer.py --budget-s 30   # fewer rounds when the machine is slower than planned
    python bench/trainer.py --check-towers 1,4,8   # + the inf/NaN check's cost per CPU tower count

--check-towers (CPU towers): for each count, TowerTrainer(master="cpu") with the check (on_nonfinite="skip",
the default) and without ("ignore"), timed in the same interleaved rounds as a host memcpy: the check's
share of the step and of its optimizer phase, and the checked optimizer phase's bandwidth over memcpy.
The towers of one process give their fused step gradients that autograd wrote, which no pass of ncclavg
noted: that step falls back to its read-only scan (Note [Finiteness of the averaged gradients] in
ncclavg/averager.py); the free check shows in bench/optim.py's fed rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ncclavg  # noqa: E402
from ncclavg.train.towers import default_devices, split_sizes  # noqa: E402
from ncclavg.train.trainer import TowerTrainer  # noqa: E402

MIN_REPS = 3   # timed rounds kept even past --budget-s: a median of fewer says little


def wide_mlp(width: int, layers: int, classes: int = 10) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def sync(devices) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


class TorchOffload:
    """The naive loop: per tower backward, grads to the host, torch mean, torch AdamW on fp32 CPU master
    weights, weights back to every tower."""

    def __init__(self, model: nn.Module, devices, lr: float):
        import copy

        self.devices = devices
        self.towers = [copy.deepcopy(model).to(d) for d in devices]
        self.master = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(False)
                       for p in model.parameters()]
        self.master_params = [nn.Parameter(m) for m in self.master]
        self.opt = torch.optim.AdamW(self.master_params, lr=lr, weight_decay=0.0)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        T, B = len(self.towers), len(y)
        sizes = split_sizes(B, T)
        lo = 0
        for t, (tower, dev) in enumerate(zip(self.towers, self.devices)):
            n = sizes[t]
            tower.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(tower(x[lo:lo + n].to(dev)), y[lo:lo + n].to(dev))
            (loss * (n * T / B)).backward()
            lo += n
        host = [[p.grad.to("cpu", torch.float32) for p in tower.parameters()] for tower in self.towers]
        avg = host[0] if T == 1 else [torch.stack(gs).mean(0) for gs in zip(*host)]
        for p, g in zip(self.master_params, avg):
            p.grad = g
        self.opt.step()
        with torch.no_grad():
            for tower, dev in zip(self.towers, self.devices):
                if dev.type == "cpu":
                    torch._foreach_copy_(list(tower.parameters()), self.master)
                else:
                    for p, m in zip(tower.parameters(), self.master):
                        p.copy_(m.to(dev, non_blocking=True))
        sync(self.devices)


class Memcpy:
    """One host copy of `nbytes` (the memory-bandwidth reference); timed in the same rounds as the
    contenders so that both see the same outside load."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4)
        self.dst = torch.empty_like(self.src)

    def __call__(self) -> None:
        # libc memcpy (numpy's copyto on the same memory): faster than torch's copy_ loop on most hosts.
        np.copyto(self.dst.numpy(), self.src.numpy())

    def gbps(self, seconds: float) -> float:
        return 2 * self.nbytes / seconds / 1e9  # read + write


def pcie_gbps(device: torch.device, nbytes: int, reps: int = 5) -> dict:
    host = torch.ones(nbytes // 4, pin_memory=True)
    dev = torch.empty(nbytes // 4, device=device)
    out = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def check_cost(tower_counts: list, width: int, layers: int, reps: int) -> list:
    """The inf/NaN check's cost in TowerTrainer(master="cpu") on CPU towers, per tower count: checked and
    unchecked trainers and a memcpy, interleaved round by round (medians after two warm-up rounds)."""
    rows = []
    for n in tower_counts:
        torch.manual_seed(0)
        devices = [torch.device("cpu")] * n
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        x, y = torch.randn(32 * n, width), torch.randint(0, 10, (32 * n,))
        trainers = {policy: TowerTrainer(wide_mlp(width, layers), devices=devices, master="cpu", lr=1e-4,
                                         on_nonfinite=policy) for policy in ("skip", "ignore")}
        nparams = sum(p.numel() for p in trainers["skip"].model.parameters())
        memcpy = Memcpy(min(256 << 20, nparams * 4 * 4))
        fns = {k: (lambda tr=tr: tr.train_step((x, y))) for k, tr in trainers.items()}
        fns["memcpy"] = memcpy
        times: dict = {k: [] for k in fns}
        opt: dict = {k: [] for k in trainers}
        for rep in range(reps + 2):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                out = fn()
                if rep >= 2:
                    times[k].append(time.perf_counter() - t0)
                    if k in opt:
                        opt[k].append(out["t_optimizer"])
        med = {k: statistics.median(v) for k, v in times.items()}
        o = {k: statistics.median(v) for k, v in opt.items()}
        # the fused step reads n towers' fp32 grads (4n), writes tower 0's params (4), param + moments r/w (24)
        gbps = nparams * (4 * n + 28) / o["skip"] / 1e9
        rows.append({"towers": n, "params": nparams, "step_checked_s": med["skip"], "step_unchecked_s": med["ignore"],
                     "opt_checked_s": o["skip"], "opt_unchecked_s": o["ignore"],
                     "check_share_of_step": 1 - med["ignore"] / med["skip"],
                     "check_share_of_optimizer": 1 - o["ignore"] / o["skip"],
                     "optimizer_checked_gbps": gbps, "memcpy_gbps": memcpy.gbps(med["memcpy"]),
                     "optimizer_checked_over_memcpy": gbps / memcpy.gbps(med["memcpy"])})
        for tr in trainers.values():
            tr.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="TowerTrainer step time vs the torch offload loop")
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop timing after the round that passes this many seconds since the start "
                         f"(at least {MIN_REPS} rounds are timed); the JSON records the rounds done")
    ap.add_argument("--width", type=int, default=None, help="hidden width of the MLP")
    ap.add_argument("--layers", type=int, default=None, help="hidden layers of the MLP")
    ap.add_argument("--towers", type=int, default=None, help="CPU towers when there is no GPU (default 2)")
    ap.add_argument("--json", "--out", dest="out", default=None, help="JSON file (default bench/results/trainer_<cpu|gpu>.json)")
    ap.add_argument("--check-towers", default=None,
                    help="comma-separated CPU tower counts: also the inf/NaN check's cost at each (see above)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error("--budget-s must be > 0 seconds")

    devices = default_devices(cpu_towers=args.towers or 2)
    on_gpu = devices[0].type == "cuda"
    width = args.width or (4096 if on_gpu else 1024) // (2 if args.quick else 1)
    layers = args.layers or (6 if on_gpu else 8)
    reps = args.reps or (5 if args.quick else 10)
    per_tower_batch = 32
    if not on_gpu:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // len(devices)))
    torch.manual_seed(0)
    model = wide_mlp(width, layers)
    nparams = sum(p.numel() for p in model.parameters())
    B = per_tower_batch * len(devices)
    x, y = torch.randn(B, width), torch.randint(0, 10, (B,))
    print(f"trainer bench: {len(devices)} towers on {','.join(map(str, devices))}, MLP {layers}x{width} "
          f"({nparams / 1e6:.1f} M params), batch {B}, {reps} reps")

    contenders = {
        "ncclavg_master_cpu": TowerTrainer(wide_mlp(width, layers), devices=devices, master="cpu", lr=1e-4),
        "ncclavg_master_device": TowerTrainer(wide_mlp(width, layers), devices=devices, master="device", lr=1e-4),
    }
    naive = TorchOffload(wide_mlp(width, layers), devices, lr=1e-4)
    fns = {name: (lambda tr=tr: (tr.train_step((x, y)), sync(devices))) for name, tr in contenders.items()}
    fns["torch_offload"] = lambda: naive.step(x, y)
    memcpy = Memcpy(min(256 << 20, nparams * 4 * 4))
    fns["host_memcpy"] = memcpy
    records: dict = {k: [] for k in fns}
    for _ in range(2):  # warm-up
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    cut_by_budget = False
    for rep in range(reps):
        if args.budget_s is not None and rep >= min(MIN_REPS, reps) and time.perf_counter() - started > args.budget_s:
            cut_by_budget = True
            break
        for k, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            times[k].append(time.perf_counter() - t0)
            if isinstance(out, tuple) and isinstance(out[0], dict):
                records[k].append(out[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    phases = {k: {p: statistics.median(r[p] for r in recs) for p in recs[0] if p.startswith("t_")}
              for k, recs in records.items() if recs}

    T = len(devices)
    opt_s = phases["ncclavg_master_cpu"]["t_optimizer"]
    # Bytes the fused CPU step moves per element: on CPU towers it reads T grads and writes tower 0's copy
    # (4T + 4), plus param and the two moments read + written (24); on GPUs one averaged grad read and
    # one staged copy written (8) + 24.
    bytes_per_elem = (4 * T + 4 + 24) if not on_gpu else 32
    opt_gbps = nparams * bytes_per_elem / opt_s / 1e9 if opt_s > 0 else float("nan")
    mem_gbps = memcpy.gbps(med.pop("host_memcpy"))
    result = {
        "bench": "trainer", "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "devices": [str(d) for d in devices],
                    "gpu_names": [torch.cuda.get_device_name(d) for d in devices] if on_gpu else []},
        "versions": {"ncclavg": ncclavg.__version__, "torch": torch.__version__,
                     "simd": ncclavg.build_info()["simd_level"], "nccl": ncclavg.build_info()["nccl"].get("version")},
        "sizes": {"params": nparams, "width": width, "layers": layers, "batch": B, "towers": T, "reps": reps,
                  "reps_done": len(times["ncclavg_master_cpu"]), "cut_by_budget": cut_by_budget},
        "step_s": med, "phases_s": phases,
        "ratios": {"torch_offload_over_master_cpu": med["torch_offload"] / med["ncclavg_master_cpu"],
                   "master_device_over_master_cpu": med["ncclavg_master_device"] / med["ncclavg_master_cpu"]},
        "bandwidth_gbps": {"host_memcpy": mem_gbps, "fused_cpu_optimizer": opt_gbps,
                           "fused_cpu_optimizer_over_memcpy": opt_gbps / mem_gbps},
    }
    # Rows in the bench suite's contract (bench/cpu_suite.py): ncclavg vs the best torch way of the same step.
    result["rows"] = [{
        "case": f"TowerTrainer(master='cpu') step, {T} towers, {nparams / 1e6:.1f} M params, vs naive torch offload",
        "time_us": med["ncclavg_master_cpu"] * 1e6, "torch_time_us": med["torch_offload"] * 1e6,
        "speedup_vs_torch": med["torch_offload"] / med["ncclavg_master_cpu"],
    }, {
        "case": "fused CPU optimizer phase of that step vs host memcpy of the same bytes",
        "gbps": opt_gbps, "fraction_of_copy_bw": opt_gbps / mem_gbps,
    }]
    if on_gpu:
        result["bandwidth_gbps"]["pcie"] = pcie_gbps(devices[0], min(256 << 20, nparams * 4))
    for k in ("ncclavg_master_cpu", "ncclavg_master_device", "torch_offload"):
        extra = ""
        if k in phases:
            extra = "  (" + ", ".join(f"{p[2:]} {v * 1e3:.1f}" for p, v in phases[k].items()) + " ms)"
        print(f"  {k:24s} {med[k] * 1e3:9.2f} ms/step{extra}")
    r = result["ratios"]
    print(f"  torch_offload / master_cpu = {r['torch_offload_over_master_cpu']:.2f}x   "
          f"master_device / master_cpu = {r['master_device_over_master_cpu']:.2f}x")
    bw = result["bandwidth_gbps"]
    print(f"  fused CPU optimizer {bw['fused_cpu_optimizer']:.1f} GB/s = {bw['fused_cpu_optimizer_over_memcpy']:.2f} "
          f"of host memcpy ({bw['host_memcpy']:.1f} GB/s, same run)"
          + (f"; PCIe h2d {bw['pcie']['h2d']:.1f} / d2h {bw['pcie']['d2h']:.1f} GB/s" if on_gpu else ""))
    if args.check_towers:
        counts = [int(c) for c in args.check_towers.split(",") if c.strip()]
        result["check_cost"] = check_cost(counts, width, layers, reps)
        result["machine"]["loadavg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        print("  inf/NaN check (master='cpu', CPU towers of one process: the fused step's read-only scan):")
        for r in result["check_cost"]:
            print(f"    {r['towers']} tower(s): step {r['step_checked_s'] * 1e3:.1f} ms checked, "
                  f"{r['step_unchecked_s'] * 1e3:.1f} ms unchecked: check {r['check_share_of_step']:+.1%} of the step, "
                  f"{r['check_share_of_optimizer']:+.1%} of the optimizer phase; checked optimizer "
                  f"{r['optimizer_checked_over_memcpy']:.0%} of memcpy ({r['memcpy_gbps']:.1f} GB/s)")
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"trainer_{'gpu' if on_gpu else 'cpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"  wrote {out}")
    for tr in contenders.values():
        tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
