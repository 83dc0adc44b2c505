"""The update half of a training step: from the towers' local gradients to new weights on every tower.

Two engines run anywhere (CPU towers here, GPU towers too):
- DeviceMasterEngine (master="device"): GradientAverager averages the gradients into every tower, then
  a torch optimizer on each tower applies the same update to its own copy of the weights.
- CpuMasterEngine (master="cpu" with CPU towers): the towers' gradient buckets go straight into the fused
  C++ "average N towers + optimizer step" over fp32 master weights (MasterWeights), then the new weights
  are copied back into every tower's flat parameter buckets.
The GPU master="cpu" pipeline lives in offload.py.

Every engine exposes the same small surface to the trainer (zero_grad, step, master_state,
load_master_state, ...) and saves its state in one engine-independent form (see Note [Portable master
state]) so a checkpoint of one engine resumes on the other.

Note [Portable master state]
A checkpoint stores {"params": one fp32 CPU tensor per trainable parameter (registration order),
"optimizer": a torch.optim-format state dict (state keyed by parameter index, param_groups)}. That is
exactly what torch.optim.AdamW/SGD produce and what the CPU optimizers accept, so the format does not
depend on the bucket plan, the number of towers or the engine.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch

from ..averager import all_finite
from ..bucketing import BucketPlan, plan_everywhere
from .metrics import StepTimes


class OptimConfig:
    """The optimizer hyper-parameters shared by all engines (lr is set per step by the schedule)."""

    def __init__(self, name: str, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 betas: tuple[float, float], eps: float):
        self.name, self.lr, self.weight_decay = name, lr, weight_decay
        self.momentum, self.nesterov, self.betas, self.eps = momentum, nesterov, tuple(betas), eps

    def torch_optimizer(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer of one tower for master="device": ncclavg's fused CPU optimizers (torch.optim
        subclasses with torch's state format) for fp32 CPU parameters, torch.optim otherwise."""
        params = list(params)
        if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            from ..optim import CPUAdamW, CPUSGD

            # skip_nonfinite=False: the engine decides skips itself (fp16), as with torch.optim.
            if self.name in ("adamw", "adam"):
                return CPUAdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                weight_decay=self.weight_decay, adamw=self.name == "adamw", skip_nonfinite=False)
            return CPUSGD(params, lr=self.lr, momentum=self.momentum, dampening=0.0,
                          weight_decay=self.weight_decay, nesterov=self.nesterov, skip_nonfinite=False)
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                     weight_decay=self.weight_decay)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                    weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, dampening=0.0,
                               weight_decay=self.weight_decay, nesterov=self.nesterov)

    def master_kwargs(self) -> dict:
        """Keyword arguments for MasterWeights / the CPU optimizers."""
        if self.name in ("adamw", "adam"):
            return {"optimizer": "adamw" if self.name == "adamw" else "adam", "lr": self.lr,
                    "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}
        return {"optimizer": "sgd", "lr": self.lr, "momentum": self.momentum, "dampening": 0.0,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}


def check_master_state(state: Any, plan: BucketPlan, what: str = "state") -> None:
    """The parameter list of a saved master state must match the plan (same count, shapes)."""
    params = state.get("params") if isinstance(state, dict) else None
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"{what}: has no 'params' list")
    if len(params) != len(plan.slots):
        raise ValueError(f"{what}: holds {len(params)} trainable parameters, the model has {len(plan.slots)}")
    for s, p in zip(plan.slots, params):
        if tuple(p.shape) != s.shape:
            raise ValueError(f"{what}: parameter {s.index} ({s.name!r}) has shape {tuple(p.shape)} in the "
                             f"checkpoint but {s.shape} in the model")


def _finite(flat: torch.Tensor) -> bool:
    """All elements finite: one max-|x| reduction (inf and NaN propagate through it, no temporary)."""
    return bool(torch.isfinite(torch.linalg.vector_norm(flat, float("inf"))))


def _bucket_sumsq(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all buckets of one tower, accumulated in fp32 on the buckets' device."""
    parts = [torch.linalg.vector_norm(f, dtype=torch.float32).square() for f in flats if f.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=flats[0].device if flats else "cpu")
    return torch.stack(parts).sum()


def tower_communicator(devices: Sequence[Any]) -> Any:
    """The communicator of this process's towers, one per entry of `devices`:
    - every tower on the CPU: the local backend (the core's one-pass host average);
    - every tower on one and the same GPU (a single GPU tower too): the local backend on that device
      (ONE average-kernel launch per bucket for all towers, stream-ordered; no NCCL needed);
    - every tower on a GPU of its own: NCCL over those devices (one grouped call per bucket).
    Anything else raises ValueError naming `devices`: cpu and cuda towers mixed, or several GPUs of which
    one holds several towers (e.g. cuda:0,cuda:0,cuda:1), which neither backend averages."""
    from ..comm import Communicator

    devs = [torch.device(d) for d in devices]
    if not devs:
        raise ValueError("devices: the list is empty; give one device per tower")
    listed = ",".join(str(d) for d in devs)
    kinds = {d.type for d in devs}
    if kinds == {"cpu"}:
        return Communicator.local(len(devs))
    if kinds != {"cuda"}:
        raise ValueError(f"devices: {listed} mixes {' and '.join(sorted(kinds))} towers; put every tower on "
                         "the CPU or every tower on a GPU")
    index = [torch.cuda.current_device() if d.index is None else d.index for d in devs]
    if len(set(index)) == 1:
        return Communicator.local(len(devs), device=torch.device("cuda", index[0]))
    if len(set(index)) == len(index):
        return Communicator.nccl(index)
    counts = ", ".join(f"cuda:{i} x{index.count(i)}" for i in sorted(set(index)))
    raise ValueError(f"devices: {listed} puts several towers on some GPUs ({counts}); either give every tower "
                     "a GPU of its own (averaged with NCCL) or put all towers on one GPU (averaged by one "
                     "kernel), e.g. cuda:0,cuda:0")


class DeviceMasterEngine:
    """master="device": GradientAverager + one optimizer per tower (identical updates)."""
    kind = "device"
    collectives_in_backward = True   # the averager's hooks launch buckets during backward

    def __init__(self, tower_params: Sequence[Sequence[torch.Tensor]], names: Sequence[str],
                 devices: Sequence[torch.device], opt: OptimConfig, bucket_cap_mb: float,
                 first_bucket_mb: float, overlap: bool = True, check_finite: bool = True, comm: Any = None):
        from ..averager import GradientAverager

        self.devices = list(devices)
        self.tower_params = [list(ps) for ps in tower_params]
        # comm: the towers of several processes (Note [Towers of several processes] in distributed.py)
        self.comm = comm if comm is not None else tower_communicator(self.devices)
        self.averager = GradientAverager(self.comm, self.tower_params, bucket_cap_mb=bucket_cap_mb,
                                         first_bucket_mb=first_bucket_mb, overlap=overlap, names=list(names),
                                         check_finite=check_finite)
        self.plan: BucketPlan = self.averager.plan
        self.optimizers = [opt.torch_optimizer(ps) for ps in self.tower_params]
        self.zero_grad()

    def _tower_buckets(self, t: int) -> list[torch.Tensor]:
        return [self.averager.bucket_storage(t, b) for b in range(len(self.plan.buckets))]

    def zero_grad(self) -> None:
        self.averager.zero_grad()

    def after_compute(self, tower_streams: Sequence[Any] | None) -> None:
        """Order the averaging after the towers' backward on their streams (GPU only)."""
        if tower_streams:
            for dev, s in zip(self.devices, tower_streams):
                torch.cuda.current_stream(dev).wait_stream(s)

    def step(self, lr: float, loss_scale: float | None, max_grad_norm: float | None,
             times: StepTimes) -> dict:
        with times.phase("reduce"):
            self.averager.average()
        with times.phase("optimizer"):
            info = {"skipped": False, "grad_norm": None}
            if self.averager.check_finite:  # See Note [Non-finite gradients] in trainer.py
                bad = self.averager.nonfinite()
                if not bad and self.averager.grads_finite is False:
                    # finite towers whose float32 sum overflowed: an inf mean, from no one tower
                    bad = [(None, b) for b, f in enumerate(self.averager.bucket_finite) if f is False]
                if bad:
                    info.update(skipped=True, nonfinite=bad)
                    return info
            coef = 1.0
            if loss_scale is not None or max_grad_norm is not None:
                # The towers hold identical averaged gradients: measure tower 0 once.
                norm = math.sqrt(float(_bucket_sumsq(self._tower_buckets(0))))
                inv = 1.0 / loss_scale if loss_scale is not None else 1.0
                norm *= inv
                info["grad_norm"] = norm
                if not math.isfinite(norm):
                    info["skipped"] = True
                    info["nonfinite"] = [(None, b) for b, f in enumerate(self._tower_buckets(0))
                                         if f.numel() and not _finite(f)]
                    return info
                coef = inv
                if max_grad_norm is not None:
                    coef *= min(1.0, max_grad_norm / (norm + 1e-6))
            if coef != 1.0:
                for t in range(len(self.devices)):
                    for flat in self._tower_buckets(t):
                        flat.mul_(coef)
            for o in self.optimizers:
                for g in o.param_groups:
                    g["lr"] = lr
                o.step()
        return info

    def before_compute(self, tower_streams: Sequence[Any] | None) -> None:
        if tower_streams:
            for dev, s in zip(self.devices, tower_streams):
                s.wait_stream(torch.cuda.current_stream(dev))

    # ---- state (see Note [Portable master state])
    def master_params(self) -> list[torch.Tensor]:
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.tower_params[0]]

    def master_state(self) -> dict:
        sd = self.optimizers[0].state_dict()
        state = {k: {n: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                     for n, v in s.items()} for k, s in sd["state"].items()}
        return {"params": self.master_params(), "optimizer": {"state": state, "param_groups": sd["param_groups"]}}

    def load_master_state(self, state: dict) -> None:
        check_master_state(state, self.plan)
        with torch.no_grad():
            for ps in self.tower_params:
                for p, src in zip(ps, state["params"]):
                    p.copy_(src)
        for o in self.optimizers:
            # A deep copy per tower: load_state_dict keeps tensors that already have the right dtype and
            # device as they are, so towers would otherwise share (and triple-update) one moment buffer.
            o.load_state_dict(copy.deepcopy(state["optimizer"]))

    def close(self) -> None:
        close = getattr(self.averager, "close", None)
        if close is not None:
            close()
        self.comm.close()


def tower_plan(tower_params: Sequence[Sequence[torch.Tensor]], names: Sequence[str], bucket_cap_mb: float,
               first_bucket_mb: float) -> BucketPlan:
    """The bucket plan of tower 0's parameters; every other tower must lay out the same way."""
    plan = BucketPlan.build(tower_params[0], names, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    for t, ps in enumerate(tower_params[1:], 1):
        plan.check_same_layout(ps, names, tower=t)
    return plan


class CpuMasterEngine:
    """master="cpu" on CPU towers: fused average-of-N + optimizer step from the towers' gradient buckets,
    then copy-out into every tower's flat parameter buckets.

    Note [Flat tower storage]
    Every tower's trainable parameters and gradients are re-pointed into flat per-bucket storage laid out
    exactly like the plan (p.data and p.grad become views). Autograd then accumulates each gradient
    straight into its bucket slot (AccumulateGrad adds in place into an existing .grad), the fused step
    reads the N towers' buckets as they are, and the copy-out writes one contiguous buffer per bucket and
    tower: no per-tensor Python work in the step.
    """
    kind = "cpu"

    def __init__(self, tower_params: Sequence[Sequence[torch.Tensor]], names: Sequence[str],
                 devices: Sequence[torch.device], opt: OptimConfig, bucket_cap_mb: float,
                 first_bucket_mb: float, skip_nonfinite: bool = True, comm: Any = None, overlap: bool = True):
        from ..master import MasterWeights

        self.devices = list(devices)
        self.tower_params = [list(ps) for ps in tower_params]
        # comm: None, or the towers of several processes (Note [Towers of several processes]); every
        # process learns whether every other one could build the same plan before any collective
        self.comm = comm if comm is not None and comm.world_size > 1 else None
        self.plan = plan_everywhere(self.comm, lambda: tower_plan(self.tower_params, names, bucket_cap_mb,
                                                                  first_bucket_mb))
        self.param_flats: list[list[torch.Tensor]] = []
        self.grad_flats: list[list[torch.Tensor]] = []
        for ps in self.tower_params:
            # several processes with overlap: the averager below owns the gradient storage
            with_averager = self.comm is not None and overlap
            pf, gf = self.plan.allocate("cpu"), None if with_averager else self.plan.allocate("cpu")
            with torch.no_grad():
                for s in self.plan.slots:
                    p = ps[s.index]
                    view = self.plan.slot_view(pf[s.bucket], s.index)
                    view.copy_(p.detach())
                    p.data = view
                    if gf is not None:
                        p.grad = self.plan.slot_view(gf[s.bucket], s.index)
            self.param_flats.append(pf)
            self.grad_flats.append(gf)
        # Several processes, overlap=True: a GradientAverager owns the gradient storage and reduces each
        # bucket across the processes as soon as backward has produced it on every local tower (its
        # hooks), so the reductions overlap the rest of backward as in DDP. Its plan is this plan (same
        # parameters, cap and first bucket), so its storage of tower t, bucket b lines up with the
        # master's bucket b. overlap=False reduces every bucket after backward instead (measured faster
        # for small models on an oversubscribed 2-core host, where nothing is idle to overlap with).
        self.averager = None
        self._reduced = False   # reduce_now() ran for the coming step()
        if self.comm is not None and overlap:
            from ..averager import GradientAverager

            self.averager = GradientAverager(self.comm, self.tower_params, bucket_cap_mb=bucket_cap_mb,
                                             first_bucket_mb=first_bucket_mb, overlap=True, names=list(names))
            if self.averager.plan.fingerprint != self.plan.fingerprint:
                raise RuntimeError("the averager's bucket plan differs from the engine's")
            self.grad_flats = [[self.averager.bucket_storage(t, b) for b in range(len(self.plan.buckets))]
                               for t in range(len(self.tower_params))]
        # skip_nonfinite: a step with an inf/NaN gradient on any tower changes nothing (Note [Non-finite
        # gradients] in trainer.py, Note [Dynamic loss scale]); the price is a read-only first pass, except
        # where the averaging passes noted the gradients' finiteness (several processes: Note [Finiteness
        # of the averaged gradients] in averager.py).
        self.master = MasterWeights(self.tower_params[0], plan=self.plan, pin=False,
                                    skip_nonfinite=skip_nonfinite, **opt.master_kwargs())

    def reduce_now(self, times: StepTimes) -> bool:
        """Finishes this step's gradient reduction now, before step() (several processes: the averager's
        remaining buckets and waits), so the trainer can start its own small exchange between the two;
        False when step() reduces by itself (one process: the fused step averages the towers)."""
        if self.averager is None:
            return False
        with times.phase("reduce"):
            self.averager.average()
        self._reduced = True
        return True

    @property
    def collectives_in_backward(self) -> bool:
        """True when backward itself starts collectives (the averager's hooks): the trainer then issues
        no collective of its own between backward and step()."""
        return self.averager is not None

    def zero_grad(self) -> None:
        if self.averager is not None:   # its storage, its views
            self.averager.zero_grad()
            return
        for gf in self.grad_flats:
            for flat in gf:
                flat.zero_()
        # model.zero_grad() (set_to_none=True) between steps would detach the .grad views and the next
        # backward would allocate fresh tensors the fused step never reads. Checking the first slot of each
        # tower is O(towers) and catches that; then every view is re-pointed.
        first = self.plan.slots[0]
        for t, ps in enumerate(self.tower_params):
            g = ps[first.index].grad
            flat = self.grad_flats[t][first.bucket]
            if g is None or g.data_ptr() != flat.data_ptr() + first.offset * flat.element_size():
                for s in self.plan.slots:
                    ps[s.index].grad = self.plan.slot_view(self.grad_flats[t][s.bucket], s.index)

    def before_compute(self, tower_streams: Any) -> None:
        pass

    def after_compute(self, tower_streams: Any) -> None:
        pass

    def step(self, lr: float, loss_scale: float | None, max_grad_norm: float | None,
             times: StepTimes) -> dict:
        self.master.hp["lr"] = lr
        if self.comm is not None:
            info = self._step_across_processes(loss_scale, max_grad_norm, times)
        else:
            with times.phase("optimizer"):
                # One pass: average the N towers' buckets, update master + state, write tower 0's weights.
                info = self.master.step(self.grad_flats, grad_scale=loss_scale, max_grad_norm=max_grad_norm,
                                        out=self.param_flats[0])
        if info["skipped"] and self.comm is not None:
            # averaged over the processes already: the towers that held the inf/NaN are not known here
            bad = [(None, b) for b, g in enumerate(self.grad_flats[0]) if g.numel() and not _finite(g)]
            return {"skipped": True, "grad_norm": info.get("grad_norm"), "nonfinite": bad}
        if info["skipped"]:
            # The towers' gradients are still separate here: name every (tower, bucket) with an inf/NaN.
            bad = [(t, b) for t, gf in enumerate(self.grad_flats) for b, g in enumerate(gf)
                   if g.numel() and not _finite(g)]
            return {"skipped": True, "grad_norm": info.get("grad_norm"), "nonfinite": bad}
        with times.phase("broadcast"):
            self._copy_out(first=1)
        return {"skipped": False, "grad_norm": info.get("grad_norm")}

    def _step_across_processes(self, loss_scale: float | None, max_grad_norm: float | None,
                               times: StepTimes) -> dict:
        """Towers in several processes: the averager has reduced most buckets during backward (local
        one-pass average, one all-reduce per bucket and process; Note [Hierarchical CPU average]);
        average() reduces the rest and waits. Every local tower then holds the mean over every tower,
        and ONE fused step over tower 0's buffers updates the master. Every process takes the same step
        on the same averaged gradients: the master copies stay identical."""
        if self.averager is None:
            return self._reduce_then_step(loss_scale, max_grad_norm, times)
        if not self._reduced:
            with times.phase("reduce"):
                self.averager.average()
        self._reduced = False
        with times.phase("optimizer"):
            # the averaging passes noted the gradients' finiteness: Note [Finiteness of the averaged gradients]
            return self.master.step([self.grad_flats[0]], grad_scale=loss_scale, max_grad_norm=max_grad_norm,
                                    out=self.param_flats[0], grads_finite=self.averager.grads_finite)

    def _reduce_then_step(self, loss_scale: float | None, max_grad_norm: float | None, times: StepTimes) -> dict:
        """overlap=False: every bucket's reduction starts after backward, all in flight at once, then the
        fused step with the division still owed folded into the gradient scale."""
        nb = len(self.plan.buckets)
        with times.phase("reduce"):
            works = [self.comm.all_reduce_avg_async([gf[b] for gf in self.grad_flats], defer_scale=True,
                                                    tag=f"bucket {b}") for b in range(nb)]
            for w in works:
                w.wait()
        divisors = {float(w.divisor) for w in works}
        if len(divisors) != 1:
            raise RuntimeError(f"the communicator left different divisors per bucket ({sorted(divisors)})")
        scale = (1.0 if loss_scale is None else loss_scale) * divisors.pop()
        with times.phase("optimizer"):
            return self.master.step([self.grad_flats[0]], grad_scale=None if scale == 1.0 else scale,
                                    max_grad_norm=max_grad_norm, out=self.param_flats[0],
                                    grads_finite=all_finite([w.finite for w in works]))

    def _copy_out(self, first: int = 0) -> None:
        for pf in self.param_flats[first:]:
            self.master.copy_out(out=pf)

    def master_params(self) -> list[torch.Tensor]:
        return [v.detach().clone() for v in self.master.param_views()]

    def master_state(self) -> dict:
        return self.master.state_dict()  # already in the portable form, see Note [Portable master state]

    def load_master_state(self, state: dict) -> None:
        check_master_state(state, self.plan)
        self.master.load_state_dict(state)
        self._copy_out()

    def close(self) -> None:
        if self.averager is not None:
            self.averager.close()
