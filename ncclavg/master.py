"""fp32 master weights on the host, laid out bucket by bucket like the gradient buckets, updated by the
fused CPU optimizer core.

`MasterWeights(params, plan)` keeps one flat float32 tensor per bucket of `plan` (a
`ncclavg.bucketing.BucketPlan`: same element offsets, same padding), so that the flat gradient of bucket
k on every tower (`GradientAverager.bucket_storage(t, k)`) lines up element for element with the master
storage of bucket k. `step(tower_grads)` averages the towers' gradients on the fly (in double, one
rounding) inside the same pass that updates params and optimizer state, optionally unscaling by a loss
scale, skipping steps with inf/NaN gradients and clipping the global norm, and can write the new params
straight into a bfloat16/float16/float32 staging buffer (`out=`) for the host-to-device copy.

The storage is pinned when CUDA is available (pin=None), so copies to and from devices are asynchronous.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from ._ext import _C
from .buffers import as_buffer
from .optim import (check_betas, check_eps, check_grad, check_grad_scale, check_lr, check_max_grad_norm,
                    check_nonneg, clip_coef_f32, _number)

__all__ = ["MasterWeights"]

_ALIGN_ELEMS = 64  # 256 bytes of fp32: the slot alignment of the default one-bucket layout

_DEFAULTS = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
              "maximize": False},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
            "maximize": False},
}


@dataclass(frozen=True)
class _Slot:
    index: int
    shape: tuple
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class _Bucket:
    index: int
    numel: int


class LayoutPlan:
    """A plan given as plain data (what a checkpoint can hold): `slots` as (index, shape, bucket, offset,
    numel) tuples and each bucket's numel. Any object with these attributes serves as a plan."""

    def __init__(self, slots: Sequence[tuple], numel: Sequence[int]):
        self.slots = [_Slot(int(i), tuple(shape), int(b), int(off), int(n)) for i, shape, b, off, n in slots]
        self.buckets = [_Bucket(b, int(n)) for b, n in enumerate(numel)]


class _OneBucketPlan:
    """The layout used without a BucketPlan: every parameter in one bucket, slots 256-byte aligned."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.slots, offset = [], 0
        for i, p in enumerate(params):
            self.slots.append(_Slot(i, tuple(p.shape), 0, offset, p.numel()))
            offset += -(-p.numel() // _ALIGN_ELEMS) * _ALIGN_ELEMS
        self.buckets = [_Bucket(0, offset)]


def _check_hp(kind: str, hp: dict) -> dict:
    """Validated copy of the hyperparameters (ValueError naming the bad one)."""
    out = dict(hp)
    check_lr(out["lr"], "lr")
    check_nonneg(out["weight_decay"], "weight_decay")
    if kind == "sgd":
        momentum = check_nonneg(out["momentum"], "momentum")
        dampening = _number(out["dampening"], "dampening")
        if out["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: Nesterov momentum needs momentum > 0 and dampening == 0")
    else:
        out["betas"] = check_betas(out["betas"], "betas")
        check_eps(out["eps"], "eps")
    return out


class MasterWeights:
    """Flat fp32 master copy of `params`, bucket-aligned with `plan`, plus the optimizer state.

    params: the model's parameters (any float dtype, any device; their values seed the master copy).
    plan: a BucketPlan (or any object with `.buckets[k].numel` and `.slots[i].bucket/.offset/.numel/
      .shape`); None: one bucket holding everything with 256-byte aligned slots.
    optimizer: "adamw" | "adam" | "sgd"; hyperparameters as keyword arguments with torch's names and
      defaults (lr, betas, eps, weight_decay, amsgrad, maximize | lr, momentum, dampening,
      weight_decay, nesterov, maximize).
    pin: page-lock the master storage; None: when CUDA is available.
    skip_nonfinite: a step whose gradients hold an inf/NaN changes nothing and reports skipped=True.
    """

    def __init__(self, params: Sequence[torch.Tensor], plan: Any = None, optimizer: str = "adamw",
                 pin: Optional[bool] = None, *, skip_nonfinite: bool = True, **hp):
        if optimizer not in _DEFAULTS:
            raise ValueError(f"optimizer: must be one of {sorted(_DEFAULTS)}, got {optimizer!r}")
        unknown = set(hp) - set(_DEFAULTS[optimizer])
        if unknown:
            raise TypeError(f"unexpected hyperparameter(s) {sorted(unknown)} for optimizer {optimizer!r}; "
                            f"accepted: {sorted(_DEFAULTS[optimizer])}")
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"params[{i}]: expected a torch.Tensor, got {type(p).__name__}")
            if not p.is_floating_point():
                raise ValueError(f"params[{i}]: must be a floating-point tensor, got {p.dtype}")
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise ValueError("pin: pinned host memory needs CUDA, and torch.cuda.is_available() is False")
        self.kind = optimizer
        self.pin = bool(pin)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.plan = plan if plan is not None else _OneBucketPlan(params)
        self._check_plan(params)
        self.param_groups = [_check_hp(optimizer, {**_DEFAULTS[optimizer], **hp})]
        nb = len(self.plan.buckets)
        self.flat = [self._zeros(b.numel) for b in self.plan.buckets]
        for slot, p in zip(self.plan.slots, params):
            self._view(self.flat, slot).copy_(p.detach().reshape(slot.shape))
        self.steps = [0] * nb
        if optimizer == "sgd":
            self.momentum_buffer = [torch.zeros(b.numel) for b in self.plan.buckets]
            self._momentum_started = [False] * nb
        else:
            self.exp_avg = [torch.zeros(b.numel) for b in self.plan.buckets]
            self.exp_avg_sq = [torch.zeros(b.numel) for b in self.plan.buckets]
            self.max_exp_avg_sq: list = [None] * nb
        self._staging: dict = {}

    # ---- layout

    @property
    def hp(self) -> dict:
        """The hyperparameters (the single param group); edit in place to schedule the lr."""
        return self.param_groups[0]

    @property
    def num_buckets(self) -> int:
        return len(self.plan.buckets)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, pin_memory=self.pin)

    @staticmethod
    def _view(flats: Sequence[torch.Tensor], slot) -> torch.Tensor:
        return flats[slot.bucket][slot.offset:slot.offset + slot.numel].view(tuple(slot.shape))

    def _check_plan(self, params: Sequence[torch.Tensor]) -> None:
        plan = self.plan
        if len(plan.slots) != len(params):
            raise ValueError(f"plan: has {len(plan.slots)} slots but params has {len(params)} tensors")
        spans: list[tuple[int, int, int, int]] = []
        for i, (slot, p) in enumerate(zip(plan.slots, params)):
            if tuple(slot.shape) != tuple(p.shape) or slot.numel != p.numel():
                raise ValueError(f"params[{i}]: shape {tuple(p.shape)} does not match plan.slots[{i}] "
                                 f"(shape {tuple(slot.shape)}, numel {slot.numel})")
            if not 0 <= slot.bucket < len(plan.buckets):
                raise ValueError(f"plan: slots[{i}].bucket={slot.bucket} is not a bucket index")
            if slot.offset < 0 or slot.offset + slot.numel > plan.buckets[slot.bucket].numel:
                raise ValueError(f"plan: slots[{i}] (offset {slot.offset}, numel {slot.numel}) does not fit "
                                 f"bucket {slot.bucket} ({plan.buckets[slot.bucket].numel} elements)")
            spans.append((slot.bucket, slot.offset, slot.offset + slot.numel, i))
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if a[0] == b[0] and b[1] < a[2]:
                raise ValueError(f"plan: slots[{a[3]}] and slots[{b[3]}] overlap in bucket {a[0]}")

    def param_views(self) -> list[torch.Tensor]:
        """One view per parameter (its shape) into the master storage, in parameter order."""
        return [self._view(self.flat, slot) for slot in self.plan.slots]

    # ---- step

    def _buckets_arg(self, bucket: Optional[int]) -> list[int]:
        if bucket is None:
            return list(range(self.num_buckets))
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket: must be None or a bucket index in [0, {self.num_buckets}), got {bucket!r}")
        return [bucket]

    def _tower_grads(self, tower_grads: Any, bks: list[int], single: bool) -> list[list[torch.Tensor]]:
        """tower_grads in any accepted form -> grads[t][j] for the buckets bks[j], validated."""
        nb = self.num_buckets
        if isinstance(tower_grads, torch.Tensor):
            if len(bks) != 1:
                raise ValueError(f"tower_grads: one tensor given but {len(bks)} buckets are stepped; pass "
                                 "tower_grads[tower][bucket]")
            nested = [[tower_grads]]
        else:
            seq = list(tower_grads)
            if not seq:
                raise ValueError("tower_grads: empty; pass tower_grads[tower][bucket]")
            if all(isinstance(x, torch.Tensor) for x in seq):
                if single:          # step(bucket=k): one flat gradient of bucket k per tower
                    nested = [[x] for x in seq]
                elif nb == 1:       # one bucket: a list of towers
                    nested = [[x] for x in seq]
                elif len(seq) == nb:  # one tower: a list of buckets
                    nested = [seq]
                else:
                    raise ValueError(f"tower_grads: {len(seq)} tensors for {nb} buckets; pass one tensor per "
                                     "bucket (one tower) or tower_grads[tower][bucket]")
            else:
                nested = []
                for t, tw in enumerate(seq):
                    if isinstance(tw, torch.Tensor):
                        raise ValueError(f"tower_grads[{t}]: mixes tensors and lists; pass tower_grads[tower][bucket]")
                    tw = list(tw)
                    if len(tw) == nb:
                        nested.append([tw[b] for b in bks])
                    elif single and len(tw) == 1:
                        nested.append(tw)
                    else:
                        raise ValueError(f"tower_grads[{t}]: has {len(tw)} tensors, expected one per bucket ({nb})")
        out = []
        for t, tw in enumerate(nested):
            row = []
            for j, g in enumerate(tw):
                b = bks[j]
                name = f"tower_grads[{t}][{b}]"
                if isinstance(g, torch.Tensor) and g.device.type == "cuda":
                    g = self._to_host(g, t, b)
                row.append(check_grad(g, self.plan.buckets[b].numel, name))
            out.append(row)
        return out

    def _to_host(self, g: torch.Tensor, t: int, b: int) -> torch.Tensor:
        """Device gradients are first copied into a reused (pinned) host buffer, synchronously."""
        key = (t, b, g.dtype)
        buf = self._staging.get(key)
        if buf is None or buf.numel() != g.numel():
            buf = torch.empty(g.numel(), dtype=g.dtype, pin_memory=self.pin)
            self._staging[key] = buf
        buf.copy_(g.reshape(-1))
        return buf

    def _outs(self, out: Any, bks: list[int]) -> list[torch.Tensor]:
        if out is None:
            return []
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        if len(outs) != len(bks):
            raise ValueError(f"out: {len(outs)} tensors for {len(bks)} stepped buckets")
        for j, (o, b) in enumerate(zip(outs, bks)):
            name = f"out[{j}]"
            if not isinstance(o, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(o).__name__}")
            if o.device.type != "cpu":
                raise ValueError(f"{name}: must be a host tensor (the staging buffer), got device {o.device}")
            if o.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{name}: dtype {o.dtype} is not supported; use float32, bfloat16 or float16")
            if o.numel() != self.plan.buckets[b].numel or not o.is_contiguous():
                raise ValueError(f"{name}: must be contiguous with {self.plan.buckets[b].numel} elements "
                                 f"(bucket {b}), got {o.numel()}")
        return outs

    def grad_norm(self, tower_grads: Any, bucket: Optional[int] = None, grad_scale=None) -> float:
        """Global L2 norm of the averaged, unscaled gradients (inf/nan when some are not finite). Sum
        the squares of per-bucket norms to clip over buckets stepped one by one (step(grad_norm=...))."""
        bks = self._buckets_arg(bucket)
        grads = self._tower_grads(tower_grads, bks, bucket is not None)
        st = _C.grad_stats([[as_buffer(g) for g in row] for row in grads], check_grad_scale(grad_scale), None)
        return float(st["grad_norm"]) if st["finite"] else math.nan

    @torch.no_grad()
    def step(self, tower_grads: Any, bucket: Optional[int] = None, grad_scale=None, max_grad_norm=None, *,
             out: Any = None, grad_norm: Optional[float] = None, grads_finite: Optional[bool] = None) -> dict:
        """Averages the towers' gradients and updates params and state of every bucket (or of `bucket`),
        in one pass per bucket element.

        tower_grads[t][b]: flat gradient of bucket b on tower t (float32/bfloat16/float16, the bucket's
          numel; a plain list of tensors is one tower's buckets, or the towers of `bucket`).
        grad_scale: loss scale to divide out. max_grad_norm: clip the global norm of the stepped
          buckets' gradients; when stepping one bucket at a time pass the global `grad_norm` too.
        out: staging buffer(s) (one per stepped bucket) receiving the new params in their dtype.
        grads_finite: whether tower_grads hold only finite values, as the pass that wrote them noted it
          (GradientAverager.grads_finite, Work.finite). True spares skip_nonfinite its read-only scan of
          the gradients (Note [Finiteness of the averaged gradients] in averager.py); None (the default)
          or False: the scan decides. Pass it only for gradients exactly as that pass left them.
        Returns {"skipped", "grad_norm" (None when no first pass ran), "clip_coef", "steps"}.
        """
        bks = self._buckets_arg(bucket)
        gs, mgn, grad_norm = self._check_step_args(bucket, grad_scale, max_grad_norm, grad_norm, grads_finite)
        hp = _check_hp(self.kind, self.hp)
        grads = self._tower_grads(tower_grads, bks, bucket is not None)
        outs = self._outs(out, bks)
        gbufs = [[as_buffer(g) for g in row] for row in grads]
        obufs = [as_buffer(o, f"out[{j}]") for j, o in enumerate(outs)]
        params = [as_buffer(self.flat[b]) for b in bks]

        info = {"skipped": False, "grad_norm": None, "clip_coef": 1.0}
        clip, pass_mgn = 1.0, mgn
        if grad_norm is not None:  # a global norm computed by the caller
            info["grad_norm"] = grad_norm
            if not math.isfinite(grad_norm):
                if outs:
                    _C.cast_copy(params, obufs)
                info.update(skipped=True, steps=[self.steps[b] for b in bks])
                return info
            clip = clip_coef_f32(grad_norm, mgn) if mgn is not None else 1.0
            pass_mgn = None
        common = dict(grad_scale=gs, check_finite=self.skip_nonfinite, max_grad_norm=pass_mgn, clip_coef=clip,
                      grads_finite=grads_finite)
        step = self._sgd_step if self.kind == "sgd" else self._adam_step
        r = step(hp, bks, params, gbufs, obufs, common)
        if r["stats_computed"]:
            info["grad_norm"] = r["grad_norm"]
        info["clip_coef"] = r["clip_coef"]
        info["skipped"] = r["skipped"]
        if not r["skipped"]:
            self._count_step(hp, bks)
        info["steps"] = [self.steps[b] for b in bks]
        return info

    def _check_step_args(self, bucket: Optional[int], grad_scale: Any, max_grad_norm: Any,
                         grad_norm: Optional[float], grads_finite: Optional[bool]) -> tuple:
        """step's scalar arguments checked: (grad_scale, max_grad_norm, grad_norm) as floats or None."""
        gs = check_grad_scale(grad_scale)
        mgn = check_max_grad_norm(max_grad_norm)
        if grad_norm is not None:
            grad_norm = float(grad_norm)
        elif mgn is not None and bucket is not None and self.num_buckets > 1:
            raise ValueError("max_grad_norm: clipping one bucket needs the global norm of all buckets; pass "
                             "grad_norm=... (see grad_norm()) or step all buckets at once")
        if grads_finite is not None and not isinstance(grads_finite, bool):
            raise TypeError(f"grads_finite: expected a bool or None, got {type(grads_finite).__name__}")
        return gs, mgn, grad_norm

    def _sgd_step(self, hp: dict, bks: List[int], params: list, gbufs: list, obufs: list, common: dict) -> dict:
        """The native SGD pass over buckets `bks` (momentum buffers started on their first step)."""
        momentum = float(hp["momentum"])
        started = [self._momentum_started[b] for b in bks]
        return _C.sgd_step(params, gbufs, [as_buffer(self.momentum_buffer[b]) for b in bks] if momentum else [],
                           [not s for s in started] if momentum else [], obufs, lr=float(hp["lr"]),
                           momentum=momentum, dampening=float(hp["dampening"]),
                           weight_decay=float(hp["weight_decay"]), nesterov=bool(hp["nesterov"]),
                           maximize=bool(hp["maximize"]), **common)

    def _adam_step(self, hp: dict, bks: List[int], params: list, gbufs: list, obufs: list, common: dict) -> dict:
        """The native Adam / AdamW pass over buckets `bks` (AMSGrad's maxima made on first use)."""
        amsgrad = bool(hp["amsgrad"])
        if amsgrad:
            for b in bks:
                if self.max_exp_avg_sq[b] is None:
                    self.max_exp_avg_sq[b] = torch.zeros(self.plan.buckets[b].numel)
        beta1, beta2 = hp["betas"]
        return _C.adam_step(params, gbufs, [as_buffer(self.exp_avg[b]) for b in bks],
                            [as_buffer(self.exp_avg_sq[b]) for b in bks],
                            [as_buffer(self.max_exp_avg_sq[b]) for b in bks] if amsgrad else [],
                            [float(self.steps[b] + 1) for b in bks], obufs, lr=float(hp["lr"]), beta1=beta1,
                            beta2=beta2, eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]),
                            decoupled=self.kind == "adamw", amsgrad=amsgrad, maximize=bool(hp["maximize"]),
                            **common)

    def _count_step(self, hp: dict, bks: List[int]) -> None:
        """A step taken: the buckets' step counts advance, SGD's momentum buffers count as started."""
        for b in bks:
            self.steps[b] += 1
            if self.kind == "sgd" and hp["momentum"]:
                self._momentum_started[b] = True

    # ---- copy-out

    def copy_out(self, dtype: torch.dtype = torch.float32, bucket: Optional[int] = None,
                 out: Any = None) -> list[torch.Tensor]:
        """The master params of every bucket (or of `bucket`) cast to `dtype` (round to nearest even),
        into `out` (one tensor per bucket) or new (pinned when `pin`) tensors; returns them."""
        bks = self._buckets_arg(bucket)
        if out is None:
            if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
            outs = [torch.empty(self.plan.buckets[b].numel, dtype=dtype, pin_memory=self.pin) for b in bks]
        else:
            outs = self._outs(out, bks)
        _C.cast_copy([as_buffer(self.flat[b]) for b in bks], [as_buffer(o, f"out[{j}]") for j, o in enumerate(outs)])
        return outs

    # ---- checkpoints

    def state_dict(self) -> dict:
        """Layout-independent checkpoint: the per-parameter fp32 weights and, under "optimizer", a state
        dict in torch.optim's format (loadable by torch.optim.AdamW/Adam/SGD over the same parameters,
        and by a MasterWeights with any bucket plan)."""
        state: dict = {}
        for i, slot in enumerate(self.plan.slots):
            b = slot.bucket
            if self.kind == "sgd":
                if self._momentum_started[b]:
                    state[i] = {"momentum_buffer": self._view(self.momentum_buffer, slot).clone()}
                continue
            if self.steps[b] == 0:
                continue
            s = {"step": torch.tensor(float(self.steps[b]), dtype=torch.float32),
                 "exp_avg": self._view(self.exp_avg, slot).clone(),
                 "exp_avg_sq": self._view(self.exp_avg_sq, slot).clone()}
            if self.max_exp_avg_sq[b] is not None:
                s["max_exp_avg_sq"] = self._view(self.max_exp_avg_sq, slot).clone()
            state[i] = s
        group = dict(self.hp)
        if self.kind != "sgd":
            group["betas"] = tuple(group["betas"])
            group["decoupled_weight_decay"] = self.kind == "adamw"
        group["params"] = list(range(len(self.plan.slots)))
        return {"kind": self.kind, "steps": list(self.steps),
                "params": [v.clone() for v in self.param_views()],
                "optimizer": {"state": state, "param_groups": [group]}}

    def load_state_dict(self, sd: dict) -> None:
        """Loads a state_dict() of a MasterWeights over the same parameters (any bucket plan). Validates
        everything first; on error nothing changes."""
        if not isinstance(sd, dict) or "params" not in sd or "optimizer" not in sd:
            raise ValueError("state_dict: expected a dict with 'params' and 'optimizer' (from state_dict())")
        if sd.get("kind", self.kind) != self.kind:
            raise ValueError(f"state_dict: saved for optimizer {sd.get('kind')!r}, this one runs {self.kind!r}")
        slots = self.plan.slots
        params = list(sd["params"])
        if len(params) != len(slots):
            raise ValueError(f"state_dict: has {len(params)} params, this MasterWeights has {len(slots)}")
        for i, (t, slot) in enumerate(zip(params, slots)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(slot.shape):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state_dict['params'][{i}]: shape {got}, expected {tuple(slot.shape)}")
        opt = sd["optimizer"]
        groups = opt.get("param_groups", [])
        if len(groups) != 1:
            raise ValueError(f"state_dict['optimizer']: expected one param group, got {len(groups)}")
        hp = {k: groups[0][k] for k in _DEFAULTS[self.kind] if k in groups[0]}
        hp = _check_hp(self.kind, {**self.hp, **hp})
        state = {int(k): v for k, v in opt.get("state", {}).items()}
        keys = ("momentum_buffer",) if self.kind == "sgd" else ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        bucket_steps: dict = {}
        for i, s in state.items():
            if not 0 <= i < len(slots):
                raise ValueError(f"state_dict['optimizer']['state']: parameter index {i} out of range")
            for k in keys:
                if k in s and (not isinstance(s[k], torch.Tensor) or tuple(s[k].shape) != tuple(slots[i].shape)):
                    raise ValueError(f"state_dict['optimizer']['state'][{i}]['{k}']: expected shape "
                                     f"{tuple(slots[i].shape)}")
            if self.kind != "sgd":
                step = int(float(s.get("step", 0)))
                prev = bucket_steps.setdefault(slots[i].bucket, step)
                if prev != step:
                    raise ValueError(f"state_dict: parameters of bucket {slots[i].bucket} were saved at different "
                                     f"steps ({prev} and {step}); a bucket has one step count")
        # Everything checked: apply.
        for t, slot in zip(params, slots):
            self._view(self.flat, slot).copy_(t)
        self.param_groups[0].clear()
        self.param_groups[0].update(hp)
        nb = self.num_buckets
        if self.kind == "sgd":
            for buf in self.momentum_buffer:
                buf.zero_()
            started = [False] * nb
            for i, s in state.items():
                if s.get("momentum_buffer") is not None:
                    self._view(self.momentum_buffer, slots[i]).copy_(s["momentum_buffer"])
                    started[slots[i].bucket] = True
            self._momentum_started = started
            self.steps = [int(x) for x in sd.get("steps", [0] * nb)] if len(sd.get("steps", [])) == nb else [0] * nb
            return
        for t in self.exp_avg + self.exp_avg_sq:
            t.zero_()
        self.max_exp_avg_sq = [None] * nb
        for i, s in state.items():
            slot = slots[i]
            self._view(self.exp_avg, slot).copy_(s["exp_avg"])
            self._view(self.exp_avg_sq, slot).copy_(s["exp_avg_sq"])
            if "max_exp_avg_sq" in s:
                if self.max_exp_avg_sq[slot.bucket] is None:
                    self.max_exp_avg_sq[slot.bucket] = torch.zeros(self.plan.buckets[slot.bucket].numel)
                self._view(self.max_exp_avg_sq, slot).copy_(s["max_exp_avg_sq"])
        self.steps = [bucket_steps.get(b, 0) for b in range(nb)]
