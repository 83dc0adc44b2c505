"""torch.optim-compatible CPU optimizers running ncclavg's fused SIMD core.

`CPUAdamW` (AdamW, or Adam with L2 decay when ``adamw=False``), `CPUAdam` and `CPUSGD` (momentum,
dampening, Nesterov) are `torch.optim.Optimizer` subclasses: param groups, LR schedulers, closures,
`zero_grad` and `state_dict`/`load_state_dict` behave as in torch, and the state uses torch's keys
('step' as a float32 scalar tensor, 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'momentum_buffer'), so a
state dict moves between these and `torch.optim.AdamW`/`Adam`/`SGD` in both directions.

Each step updates all parameters of a group in one call into the C++ core (OpenMP + AVX-512/AVX2/scalar),
reading every tensor once. `step()` also takes `grad_scale` (a loss scale to divide out) and
`max_grad_norm` (global L2 clipping, as `torch.nn.utils.clip_grad_norm_` over all params with grads);
with `skip_nonfinite=True` a step whose gradients hold an inf or NaN changes nothing (params, state,
step counts) and reports ``{"skipped": True}``. It is off by default, as in torch.optim: the check is
an extra read-only pass over the gradients (about 15-20% of a step), unless the pass that wrote the
gradients already noted their finiteness: `step(grads_finite=avg.grads_finite)` after a
GradientAverager's average() makes the check free. MasterWeights, the trainer's CPU master, turns it on
by default.

Parameters must be contiguous float32 CPU tensors (the fp32 master weights); gradients may be float32,
bfloat16 or float16.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from ._ext import _C
from .buffers import torch_code

__all__ = ["CPUAdamW", "CPUAdam", "CPUSGD"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- argument checks shared with master.py (messages name the argument)

def _number(x: Any, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: a tensor value must have one element, got shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name}: must be finite, got {x}")
    return x


def check_lr(lr: Any, name: str = "lr") -> float:
    lr = _number(lr, name)
    if lr < 0:
        raise ValueError(f"{name}: must be >= 0, got {lr}")
    return lr


def check_betas(betas: Any, name: str = "betas") -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}: expected a pair (beta1, beta2), got {betas!r}")
    out = []
    for i, b in enumerate(betas):
        b = _number(b, f"{name}[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name}[{i}]: must be in [0, 1), got {b}")
        out.append(b)
    return out[0], out[1]


def check_eps(eps: Any, name: str = "eps") -> float:
    eps = _number(eps, name)
    if eps <= 0:
        raise ValueError(f"{name}: must be > 0, got {eps}")
    return eps


def check_nonneg(x: Any, name: str) -> float:
    x = _number(x, name)
    if x < 0:
        raise ValueError(f"{name}: must be >= 0, got {x}")
    return x


def check_grad_scale(grad_scale: Any) -> float:
    if grad_scale is None:
        return 1.0
    s = _number(grad_scale, "grad_scale")
    if s <= 0 or not math.isfinite(1.0 / s):
        raise ValueError(f"grad_scale: must be a loss scale > 0, got {s}")
    return s


def check_max_grad_norm(max_grad_norm: Any) -> Optional[float]:
    if max_grad_norm is None:
        return None
    m = _number(max_grad_norm, "max_grad_norm")
    if m <= 0:
        raise ValueError(f"max_grad_norm: must be > 0, got {m}")
    return m


def check_master_param(p: Any, name: str) -> None:
    """A parameter the fused core updates in place: a contiguous float32 CPU tensor."""
    if not isinstance(p, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(p).__name__}")
    if p.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor (the fp32 master weights), got device {p.device}")
    if p.dtype != torch.float32:
        raise ValueError(f"{name}: must be float32 (the fp32 master weights), got {p.dtype}")
    if p.is_sparse or not p.is_contiguous():
        raise ValueError(f"{name}: must be a dense contiguous tensor (shape {tuple(p.shape)}, "
                         f"stride {p.stride()})")


def check_grad(g: Any, numel: int, name: str) -> torch.Tensor:
    """A gradient the core reads: a CPU float32/bfloat16/float16 tensor of `numel` elements. A strided
    gradient is made contiguous (a copy); anything else raises ValueError naming it."""
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(g).__name__}")
    if g.is_sparse:
        raise ValueError(f"{name}: sparse gradients are not supported")
    if g.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor, got device {g.device}")
    if g.dtype not in _GRAD_DTYPES:
        raise ValueError(f"{name}: dtype {g.dtype} is not supported; use float32, bfloat16 or float16")
    if g.numel() != numel:
        raise ValueError(f"{name}: has {g.numel()} elements, expected {numel}")
    return g if g.is_contiguous() else g.contiguous()


def clip_coef_f32(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor in float32: min(1, max_norm / (norm + 1e-6))."""
    import numpy as np

    f = np.float32
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        coef = f(max_norm) / (f(norm) + f(1e-6))
    return float(min(coef, f(1.0)))


# ---- per-step fast path: Buffers without the general checks when a tensor is what the core expects

_F32 = torch.float32


def _where(gi: int, pi: int) -> str:
    return f"param_groups[{gi}]['params'][{pi}]"


def _param_buffer(p: torch.Tensor, gi: int, pi: int):
    if p.dtype is not _F32 or not p.is_cpu or p.layout is not torch.strided or not p.is_contiguous():
        check_master_param(p, _where(gi, pi))  # raises with the precise reason
    return _C.Buffer(p.data_ptr(), p.numel(), 0, -1, False)


def _grad_buffer(g: torch.Tensor, numel: int, gi: int, pi: int, keep: list):
    code = torch_code(g.dtype)   # (the core's code: float32, float16, bfloat16; else None)
    if code is None or not g.is_cpu or g.layout is not torch.strided or g.numel() != numel:
        check_grad(g, numel, _where(gi, pi) + ".grad")  # raises with the precise reason
    if not g.is_contiguous():
        g = g.contiguous()
        keep.append(g)  # alive until the core has read it
    return _C.Buffer(g.data_ptr(), numel, code, -1, True)


def _state_ok(t: Any, numel: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype is _F32 and t.is_cpu and t.layout is torch.strided
            and t.is_contiguous() and t.numel() == numel)


# ---- the optimizers

class _FusedOptimizer(torch.optim.Optimizer):
    """Shared step logic: validate everything, decide skip/clip in a read-only first pass over all
    gradients (see Note [Two passes, no partial updates] in csrc/cpu/optim.h), then one fused call per
    param group. State is created only once the step is known to go ahead."""

    _torch_group_keys: dict = {}

    def __init__(self, params, defaults: dict, skip_nonfinite: bool):
        self.skip_nonfinite = bool(skip_nonfinite)
        self.last_step_info: dict = {}
        super().__init__(params, defaults)

    # torch calls this for every group, at construction and later; checks the group in user terms.
    def add_param_group(self, param_group: dict) -> None:
        index = len(getattr(self, "param_groups", []))
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        param_group = {**param_group, "params": params}  # a generator would be consumed by the checks
        where = "params" if index == 0 else f"param_groups[{index}]['params']"
        for i, p in enumerate(params):
            check_master_param(p, f"{where}[{i}]")
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._check_group(merged, "" if index == 0 else f"param_groups[{index}]")
        super().add_param_group(param_group)

    def _after_setstate(self) -> None:
        pass

    @staticmethod
    def _name(prefix: str, key: str) -> str:
        return f"{prefix}['{key}']" if prefix else key

    def _check_group(self, group: dict, prefix: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale=None, max_grad_norm=None,
             grads_finite: Optional[bool] = None):
        """One optimizer step. Returns the closure's loss when a closure is given, else an info dict
        {"skipped": bool, "grad_norm": float | None, "clip_coef": float} (also kept in
        `last_step_info`). grad_scale: loss scale to divide out of the gradients first;
        max_grad_norm: clip the global L2 norm of the (unscaled) gradients of all params.
        grads_finite: whether the gradients hold only finite values, as the pass that wrote them noted it
        (GradientAverager.grads_finite after average()); True spares skip_nonfinite its read-only scan
        when grad_scale >= 1 (Note [Finiteness of the averaged gradients] in averager.py). None (the
        default) or False: the scan decides. Pass it only for gradients exactly as that pass left them."""
        if grads_finite is not None and not isinstance(grads_finite, bool):
            raise TypeError(f"grads_finite: expected a bool or None, got {type(grads_finite).__name__}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            grads_finite = None   # the closure ran a backward: these are new gradients
        info = self._fused_step(check_grad_scale(grad_scale), check_max_grad_norm(max_grad_norm),
                                grads_finite)
        self.last_step_info = info
        return loss if closure is not None else info

    def _collect(self) -> list:
        """Per group: (group, params with a gradient, their Buffers, their gradients' Buffers). Every
        check happens here, before anything is written."""
        work, keep = [], []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, "" if gi == 0 else f"param_groups[{gi}]")
            ps, pbufs, gbufs = [], [], []
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                pbufs.append(_param_buffer(p, gi, pi))
                gbufs.append(_grad_buffer(g, p.numel(), gi, pi, keep))
                ps.append(p)
            work.append((group, ps, pbufs, gbufs))
        return work, keep

    def _fused_step(self, grad_scale: float, max_grad_norm: Optional[float], grads_finite: Optional[bool]) -> dict:
        work, keep = self._collect()
        info = {"skipped": False, "grad_norm": None, "clip_coef": 1.0}
        all_grads = [b for w in work for b in w[3]]
        if not all_grads:
            return info
        clip, sumsq = 1.0, None
        if max_grad_norm is not None:
            st = _C.grad_stats([all_grads], grad_scale, max_grad_norm)
            info["grad_norm"] = st["grad_norm"]
            if not st["finite"]:
                info["skipped"] = True
                return info
            clip = st["clip_coef"]
        elif self.skip_nonfinite:
            # A scan of the raw bits decides, and the groups' updates sum the norm's squares one after
            # another: the same norm as grad_stats (Note [The inf/NaN check as a scan] in csrc/cpu/optim.cpp).
            # The scan is spared when the pass that wrote the gradients said they are finite and the unscale
            # cannot overflow (|1/grad_scale| <= 1): the scan's own condition.
            known = grads_finite is True and grad_scale >= 1.0
            if not known and not _C.grads_finite([all_grads], grad_scale):
                info["grad_norm"] = _C.grad_stats([all_grads], grad_scale, None)["grad_norm"]
                info["skipped"] = True
                return info
            sumsq = 0.0
        info["clip_coef"] = clip
        for group, ps, pbufs, gbufs in work:
            if ps:
                r = self._group_step(group, ps, pbufs, gbufs, grad_scale, clip, sumsq)
                if sumsq is not None:
                    sumsq = r["sumsq"]
        if sumsq is not None:
            info["grad_norm"] = math.sqrt(sumsq)
        del keep
        return info

    def _group_step(self, group, params, pbufs, gbufs, grad_scale, clip, sumsq_start) -> dict:  # pragma: no cover
        """Steps one group; sumsq_start: see _C.adam_step. Returns the core's result dict."""
        raise NotImplementedError

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for key, value in self._torch_group_keys.items():
            for group in self.param_groups:
                group.setdefault(key, value)
        self._core_buffers = {}
        self._after_setstate()

    def _state_buffers(self, p: torch.Tensor, state: dict, keys: tuple, where: str) -> tuple:
        """Buffers of the state tensors `keys` of p, cached (by id, checked by identity and storage
        pointer) while the tensors stay the same. A state tensor of another dtype/device/layout (e.g.
        loaded from elsewhere) is converted once; one of the wrong size raises ValueError naming it."""
        cache = self.__dict__.setdefault("_core_buffers", {})
        hit = cache.get(id(p))
        if hit is not None and hit[0] is p and hit[1] == keys:
            tensors, ptrs = hit[2], hit[3]
            ok = True
            for k in range(len(keys)):
                t = state.get(keys[k])
                if t is not tensors[k] or t.data_ptr() != ptrs[k]:
                    ok = False
                    break
            if ok:
                return hit[4]
        tensors = []
        for key in keys:
            t = state[key]
            if key == "step":
                if not torch.is_tensor(t) or not _state_ok(t, 1):
                    t = state[key] = torch.tensor(float(t), dtype=_F32)
            elif not _state_ok(t, p.numel()):
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{where}: state['{key}'] has shape {got}, expected {tuple(p.shape)}")
                t = state[key] = t.to(device="cpu", dtype=_F32).contiguous()
            tensors.append(t)
        ptrs = [t.data_ptr() for t in tensors]
        bufs = tuple(_C.Buffer(ptr, t.numel(), 0, -1, False) for t, ptr in zip(tensors, ptrs))
        cache[id(p)] = (p, keys, tensors, ptrs, bufs)
        return bufs


class CPUAdamW(_FusedOptimizer):
    """AdamW (``adamw=True``: decoupled weight decay, as torch.optim.AdamW) or Adam with an L2 term
    (``adamw=False``: as torch.optim.Adam) on CPU fp32 params, one fused pass per step.

    Same arguments and defaults as torch.optim.AdamW (lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False, maximize=False). eps must be > 0."""

    _torch_group_keys = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                         "differentiable": False, "fused": None}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, adamw: bool = True, maximize: bool = False, skip_nonfinite: bool = False,
                 foreach=None, capturable=False, differentiable=False, fused=None):
        # foreach/capturable/differentiable/fused exist for torch state-dict compatibility only.
        check_lr(lr)
        check_betas(betas)
        check_eps(eps)
        check_nonneg(weight_decay, "weight_decay")
        self._decoupled = bool(adamw)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=bool(maximize), foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=self._decoupled)
        super().__init__(params, defaults, skip_nonfinite)

    def _after_setstate(self) -> None:
        # As torch.optim.AdamW: the class (here the constructor's `adamw`) decides the algorithm, whatever
        # the loaded groups say.
        for group in self.param_groups:
            group["decoupled_weight_decay"] = self._decoupled

    def _check_group(self, group: dict, prefix: str) -> None:
        check_lr(group["lr"], self._name(prefix, "lr"))
        check_betas(group["betas"], self._name(prefix, "betas"))
        check_eps(group["eps"], self._name(prefix, "eps"))
        check_nonneg(group["weight_decay"], self._name(prefix, "weight_decay"))

    def _group_step(self, group, params, pbufs, gbufs, grad_scale, clip, sumsq_start) -> dict:
        amsgrad = bool(group.get("amsgrad", False))
        beta1, beta2 = check_betas(group["betas"])
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step") if amsgrad else ("exp_avg", "exp_avg_sq", "step")
        new_states = {}
        exp_avg, exp_avg_sq, max_sq, steps = [], [], [], []
        for i, p in enumerate(params):
            state = self.state.get(p)
            if not state:
                state = {"step": torch.tensor(0.0, dtype=_F32),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format)}
                new_states[p] = state
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            bufs = self._state_buffers(p, state, keys, f"params[{i}]")
            exp_avg.append(bufs[0])
            exp_avg_sq.append(bufs[1])
            if amsgrad:
                max_sq.append(bufs[2])
            steps.append(bufs[-1])
        # The core increments the float32 step counters itself (see Note [Step counters as tensors]).
        r = _C.adam_step(pbufs, [gbufs], exp_avg, exp_avg_sq, max_sq, [], [], lr=check_lr(group["lr"]),
                         beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), decoupled=self._decoupled, amsgrad=amsgrad,
                         maximize=bool(group.get("maximize", False)), grad_scale=grad_scale, check_finite=False,
                         max_grad_norm=None, clip_coef=clip, step_tensors=steps, sumsq_start=sumsq_start)
        for p, st in new_states.items():
            self.state[p] = st
        return r


class CPUAdam(CPUAdamW):
    """Adam with an L2 term (as torch.optim.Adam; weight_decay defaults to 0)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 **kwargs):
        kwargs.setdefault("adamw", False)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class CPUSGD(_FusedOptimizer):
    """SGD with momentum, dampening and Nesterov, as torch.optim.SGD (same arguments and defaults),
    on CPU fp32 params, one fused pass per step."""

    _torch_group_keys = {"nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
                         "fused": None}

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 *, maximize: bool = False, skip_nonfinite: bool = False, foreach=None, differentiable=False,
                 fused=None):
        check_lr(lr)
        check_nonneg(momentum, "momentum")
        _number(dampening, "dampening")
        check_nonneg(weight_decay, "weight_decay")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: Nesterov momentum needs momentum > 0 and dampening == 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize), foreach=foreach,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, skip_nonfinite)

    def _check_group(self, group: dict, prefix: str) -> None:
        check_lr(group["lr"], self._name(prefix, "lr"))
        momentum = check_nonneg(group["momentum"], self._name(prefix, "momentum"))
        dampening = _number(group["dampening"], self._name(prefix, "dampening"))
        check_nonneg(group["weight_decay"], self._name(prefix, "weight_decay"))
        if group.get("nesterov", False) and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{self._name(prefix, 'nesterov')}: Nesterov momentum needs momentum > 0 and "
                             "dampening == 0")

    def _group_step(self, group, params, pbufs, gbufs, grad_scale, clip, sumsq_start) -> dict:
        momentum = float(group["momentum"])
        bufs, first, new_bufs = [], [], {}
        if momentum != 0:
            for i, p in enumerate(params):
                state = self.state.get(p)
                if state is None or state.get("momentum_buffer") is None:
                    buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                    new_bufs[p] = buf
                    first.append(True)
                    bufs.append(_C.Buffer(buf.data_ptr(), buf.numel(), 0, -1, False))
                else:
                    first.append(False)
                    bufs.append(self._state_buffers(p, state, ("momentum_buffer",), f"params[{i}]")[0])
        r = _C.sgd_step(pbufs, [gbufs], bufs, first, [], lr=check_lr(group["lr"]), momentum=momentum,
                        dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                        nesterov=bool(group.get("nesterov", False)), maximize=bool(group.get("maximize", False)),
                        grad_scale=grad_scale, check_finite=False, max_grad_norm=None, clip_coef=clip,
                        sumsq_start=sumsq_start)
        for p, buf in new_bufs.items():
            self.state[p]["momentum_buffer"] = buf
        return r
