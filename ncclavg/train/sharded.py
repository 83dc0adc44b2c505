"""master="cpu" with shard_master=True: the fp32 master weights and optimizer state split over the
processes (ZeRO-1 across processes), for CPU towers.

Note [Sharded CPU master]
Every bucket's flat storage is padded to a multiple of P (the processes) and cut into P equal shards;
process p owns shard p of every bucket: its master weights, moments and the optimizer work on them. One
step, per bucket:
1. reduce-scatter: the local towers' one-pass average, then ONE gloo reduce-scatter over the processes
   (GlooCommunicator.reduce_scatter_processes): shard p of the mean gradient over every tower;
2. the global gradient norm: each process's sum of squares over its shards, summed over the processes
   in one small exchange. An inf/NaN anywhere makes every process skip the step (nothing changes
   anywhere), clipping uses the global norm: every shard takes the step one unsharded master would;
3. the fused CPU optimizer steps this process's shards only (1/P of the work and of the master and
   moment memory), writing the new weights into tower 0's own slice of its flat parameters;
4. all-gather: every process's new slice into every local tower's flat parameters.
state_dict() returns the portable form of Note [Portable master state] (engines.py): the moment shards
gathered into one full master. The padding (at most P - 1 elements per bucket) is zero in the gradients
and never read back.

Note [Sharded checkpoints]
A checkpoint of a sharded run is a set: every process writes its own part (its shards of the master
weights and moments) next to the checkpoint, `<checkpoint>.part<r>-of-<P>`, atomically; once every
process has written its part (one exchange says so), rank 0 writes the checkpoint file itself, atomically,
holding everything else and the layout. That file is the commit: it appears only when the whole set is
on disk, and `latest()` and `resolve()` only ever take checkpoint files. No process holds more than its
own shards while saving. Loading reads the parts and puts the buckets together into the portable form,
so a sharded checkpoint resumes unsharded, on another number of processes, and back. The parts must be
readable where the checkpoint is (one file system shared by the hosts); pruning old checkpoints removes
their parts too.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..bucketing import plan_everywhere
from .engines import CpuMasterEngine, OptimConfig, check_master_state, tower_plan
from .metrics import StepTimes


class ShardedCpuMasterEngine(CpuMasterEngine):
    """CpuMasterEngine whose master weights and optimizer state are split over the processes of `comm`
    (a GlooCommunicator with world_size > 1). See Note [Sharded CPU master]."""
    kind = "cpu-sharded"

    def __init__(self, tower_params: Sequence[Sequence[torch.Tensor]], names: Sequence[str],
                 devices: Sequence[torch.device], opt: OptimConfig, bucket_cap_mb: float,
                 first_bucket_mb: float, comm: Any, skip_nonfinite: bool = True):
        from ..master import LayoutPlan, MasterWeights

        if comm is None or comm.world_size < 2 or not hasattr(comm, "reduce_scatter_processes"):
            raise ValueError("shard_master: needs CPU towers in several processes (gloo under torchrun)")
        self.devices = list(devices)
        self.tower_params = [list(ps) for ps in tower_params]
        self.comm = comm
        self.averager = None   # the reduce-scatter runs in step(), after backward
        self._opt = opt
        self._skip_nonfinite = skip_nonfinite
        self.plan = plan = plan_everywhere(comm, lambda: tower_plan(self.tower_params, names, bucket_cap_mb,
                                                                    first_bucket_mb))
        P, r = comm.world_size, comm.rank
        self._numel = [b.numel for b in plan.buckets]
        self._padded = [-(-n // P) * P for n in self._numel]
        self._shard = [(n // P * r, n // P * (r + 1)) for n in self._padded]
        # Full padded storage per tower and bucket; the plan's flats are its first numel elements.
        self.param_store, self.grad_store = [], []
        self.param_flats, self.grad_flats = [], []
        for ps in self.tower_params:
            pst = [torch.zeros(n) for n in self._padded]
            gst = [torch.zeros(n) for n in self._padded]
            pf = [s[:n] for s, n in zip(pst, self._numel)]
            gf = [s[:n] for s, n in zip(gst, self._numel)]
            with torch.no_grad():
                for s in plan.slots:
                    p = ps[s.index]
                    view = plan.slot_view(pf[s.bucket], s.index)
                    view.copy_(p.detach())
                    p.data = view
                    p.grad = plan.slot_view(gf[s.bucket], s.index)
            self.param_store.append(pst)
            self.grad_store.append(gst)
            self.param_flats.append(pf)
            self.grad_flats.append(gf)
        self._grad_shards = [torch.zeros(hi - lo) for lo, hi in self._shard]
        # MasterWeights sees this process's shard of bucket b as bucket b holding one flat parameter
        sizes = [hi - lo for lo, hi in self._shard]
        self.master = MasterWeights([self.param_store[0][b][lo:hi] for b, (lo, hi) in enumerate(self._shard)],
                                    plan=LayoutPlan([(b, (n,), b, 0, n) for b, n in enumerate(sizes)], sizes),
                                    pin=False,
                                    skip_nonfinite=skip_nonfinite, **opt.master_kwargs())

    def step(self, lr: float, loss_scale: float | None, max_grad_norm: float | None,
             times: StepTimes) -> dict:
        self.master.hp["lr"] = lr
        nb = len(self._numel)
        with times.phase("reduce"):
            for b in range(nb):
                self.comm.reduce_scatter_processes([gs[b] for gs in self.grad_store], self._grad_shards[b],
                                                   tag=f"bucket {b}")
        with times.phase("optimizer"):
            norm = self._global_norm(loss_scale, needed=max_grad_norm is not None or self._skip_nonfinite)
            outs = [self.param_store[0][b][lo:hi] for b, (lo, hi) in enumerate(self._shard)]
            info = self.master.step([self._grad_shards], grad_scale=loss_scale, max_grad_norm=max_grad_norm,
                                    out=outs, grad_norm=norm)
        if info["skipped"]:
            bad = [(None, b) for b in range(nb)] if norm is not None and not math.isfinite(norm) else []
            return {"skipped": True, "grad_norm": info.get("grad_norm"), "nonfinite": bad}
        with times.phase("broadcast"):
            self._gather_params()
        return {"skipped": False, "grad_norm": info.get("grad_norm")}

    def _global_norm(self, loss_scale: float | None, needed: bool) -> float | None:
        """The L2 norm of the whole averaged, unscaled gradient (nan when any process holds an inf/NaN),
        from each process's shards: one exchange of two numbers."""
        if not needed:
            return None
        local = self.master.grad_norm([self._grad_shards], grad_scale=loss_scale)
        finite = math.isfinite(local)
        sumsq, bad = self.comm.sum_over_processes([local * local if finite else 0.0, 0.0 if finite else 1.0])
        return math.nan if bad else math.sqrt(sumsq)

    def _gather_params(self) -> None:
        for b, (lo, hi) in enumerate(self._shard):
            self.comm.all_gather_processes(self.param_store[0][b][lo:hi], [ps[b] for ps in self.param_store],
                                           tag=f"bucket {b}")

    def _copy_out(self, first: int = 0) -> None:   # the towers are written by _gather_params
        self._gather_params()

    # ---- checkpoints: the portable form of one unsharded master (Note [Portable master state])
    def _moment_names(self) -> list:
        return ["momentum_buffer"] if self.master.kind == "sgd" else ["exp_avg", "exp_avg_sq"]

    def _unsharded(self) -> Any:
        """A full MasterWeights holding the current weights (tower 0's, gathered every step) and every
        process's moments, gathered."""
        from ..master import MasterWeights

        full = MasterWeights(self.tower_params[0], plan=self.plan, pin=False, skip_nonfinite=self._skip_nonfinite,
                             **self._opt.master_kwargs())
        full.param_groups[0].update(self.master.hp)
        for name in self._moment_names():
            for b, n in enumerate(self._numel):
                whole = torch.empty(self._padded[b])
                self.comm.all_gather_processes(getattr(self.master, name)[b], [whole], tag=f"{name} {b}")
                getattr(full, name)[b].copy_(whole[:n])
        full.steps = list(self.master.steps)
        if self.master.kind == "sgd":
            full._momentum_started = list(self.master._momentum_started)
        return full

    def master_params(self) -> list[torch.Tensor]:
        return [p.detach().float().clone() for p in self.tower_params[0]]

    def master_state(self) -> dict:
        return self._unsharded().state_dict()

    def load_master_state(self, state: dict) -> None:
        from ..master import MasterWeights

        check_master_state(state, self.plan)
        full = MasterWeights(self.tower_params[0], plan=self.plan, pin=False, **self._opt.master_kwargs())
        full.load_state_dict(state)
        for b, (lo, hi) in enumerate(self._shard):
            n = self._numel[b]
            for name in ["flat"] + self._moment_names():
                padded = torch.zeros(self._padded[b])
                padded[:n] = getattr(full, name)[b]
                getattr(self.master, name)[b].copy_(padded[lo:hi])
        self.master.param_groups[0].update(full.hp)
        self.master.steps = list(full.steps)
        if self.master.kind == "sgd":
            self.master._momentum_started = list(full._momentum_started)
        with torch.no_grad():
            for pst in self.param_store:
                for b, n in enumerate(self._numel):
                    pst[b][:n].copy_(full.flat[b])


# ---- checkpoints written as a set: one part per process (Note [Sharded checkpoints])
def shard_manifest(engine: ShardedCpuMasterEngine) -> dict:
    """What the checkpoint file itself holds for a sharded master: the layout to put the parts together
    again (every process writes the same)."""
    plan = engine.plan
    return {"sharded": {"processes": engine.comm.world_size, "kind": engine.master.kind,
                        "numel": list(engine._numel), "padded": list(engine._padded),
                        "slots": [(s.index, tuple(s.shape), s.bucket, s.offset, s.numel) for s in plan.slots],
                        "hp": {k: v for k, v in engine.master.hp.items()},
                        "steps": list(engine.master.steps),
                        "momentum_started": list(getattr(engine.master, "_momentum_started", []))}}


def shard_part(engine: ShardedCpuMasterEngine) -> dict:
    """This process's part: its shard of every bucket's master weights and moments."""
    names = ["flat"] + engine._moment_names()
    return {"rank": engine.comm.rank, "processes": engine.comm.world_size,
            **{name: [t.clone() for t in getattr(engine.master, name)] for name in names}}


def assemble_master(manifest: dict, path: str) -> dict:
    """The portable master state (Note [Portable master state]) of a checkpoint written as a set: reads
    every process's part next to `path`, verifies each, and puts the buckets together again."""
    from ..master import LayoutPlan, MasterWeights
    from . import checkpoint as ckpt

    count, kind = int(manifest["processes"]), manifest["kind"]
    parts = []
    for r in range(count):
        part = ckpt.load(ckpt.part_path(path, r, count))
        if int(part.get("rank", -1)) != r or int(part.get("processes", -1)) != count:
            raise ckpt.CheckpointError(ckpt.part_path(path, r, count), "content",
                                       f"holds the part of rank {part.get('rank')} of {part.get('processes')}")
        parts.append(part)
    plan = LayoutPlan(manifest["slots"], manifest["numel"])
    hp = dict(manifest["hp"])
    opt = {"optimizer": kind, **{k: hp[k] for k in hp if k not in ("params",)}}
    full = MasterWeights([torch.zeros(s.shape) for s in plan.slots], plan=plan, pin=False, **opt)
    for name in ["flat"] + (["momentum_buffer"] if kind == "sgd" else ["exp_avg", "exp_avg_sq"]):
        for b, n in enumerate(manifest["numel"]):
            whole = torch.cat([p[name][b] for p in parts])
            if whole.numel() != int(manifest["padded"][b]):
                raise ckpt.CheckpointError(path, "content", f"the parts of bucket {b} hold {whole.numel()} "
                                           f"elements, the set was written with {manifest['padded'][b]}")
            getattr(full, name)[b].copy_(whole[:n])
    full.steps = [int(x) for x in manifest["steps"]]
    if kind == "sgd":
        full._momentum_started = [bool(x) for x in manifest["momentum_started"]]
    return full.state_dict()
