"""Learning-rate schedules as pure functions of the optimizer step.

A schedule holds only its hyper-parameters; the trainer owns the step counter. So the state that goes
into a checkpoint is `state_dict()` (kind + hyper-parameters) and resuming cannot drift: lr(step) after
a reload is the same float the uninterrupted run computed.

A schedule named by the user ("cosine", "exponential") is planned from the run's length by the trainer
(`make_schedule`), and planned again when a resumed run is given another length (`replan`); see Note
[Schedules over a resumed run] in trainer.py.
"""
from __future__ import annotations

import math
from typing import Any, Union


def _positive(value: Any, name: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


class LRSchedule:
    """Base class: `schedule(step) -> lr` for step = number of optimizer steps already taken."""
    kind = "base"

    def __call__(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def hparams(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"kind": self.kind, **self.hparams()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LRSchedule) and self.state_dict() == other.state_dict()


class Constant(LRSchedule):
    kind = "constant"

    def __init__(self, lr: float):
        self.lr = _positive(lr, "lr", allow_zero=True)

    def __call__(self, step: int) -> float:
        return self.lr

    def hparams(self) -> dict:
        return {"lr": self.lr}


class ExponentialDecay(LRSchedule):
    """lr * decay_rate ** (step / decay_steps); staircase=True floors the exponent, i.e. the rate is
    multiplied by decay_rate once every decay_steps steps (the classic multi-tower recipe)."""
    kind = "exponential"

    def __init__(self, lr: float, decay_steps: int, decay_rate: float, staircase: bool = True):
        self.lr = _positive(lr, "lr", allow_zero=True)
        self.decay_steps = _count(decay_steps, "decay_steps", 1)
        self.decay_rate = _positive(decay_rate, "decay_rate")
        self.staircase = bool(staircase)

    def __call__(self, step: int) -> float:
        e = step // self.decay_steps if self.staircase else step / self.decay_steps
        return self.lr * self.decay_rate ** e

    def hparams(self) -> dict:
        return {"lr": self.lr, "decay_steps": self.decay_steps, "decay_rate": self.decay_rate,
                "staircase": self.staircase}


class CosineWarmup(LRSchedule):
    """Linear warm-up from lr/warmup_steps to lr over `warmup_steps` steps, then a half cosine down to
    `min_lr` at `total_steps`; min_lr after that."""
    kind = "cosine"

    def __init__(self, lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0):
        self.lr = _positive(lr, "lr", allow_zero=True)
        self.total_steps = _count(total_steps, "total_steps", 1)
        self.warmup_steps = _count(warmup_steps, "warmup_steps", 0)
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps: {warmup_steps} exceeds total_steps={total_steps}")
        self.min_lr = _positive(min_lr, "min_lr", allow_zero=True)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {min_lr} exceeds lr={lr}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = self.total_steps - self.warmup_steps
        if span <= 0 or step >= self.total_steps:
            return self.min_lr if step >= self.total_steps else self.lr
        progress = (step - self.warmup_steps) / span
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def hparams(self) -> dict:
        return {"lr": self.lr, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "min_lr": self.min_lr}


_KINDS = {c.kind: c for c in (Constant, ExponentialDecay, CosineWarmup)}
_ALIASES = {"const": "constant", "none": "constant", "exp": "exponential", "staircase": "exponential",
            "cos": "cosine", "cosine_warmup": "cosine"}

ScheduleSpec = Union[None, str, dict, LRSchedule]


def from_state_dict(state: dict) -> LRSchedule:
    """Rebuild a schedule saved with `state_dict()`."""
    if not isinstance(state, dict) or "kind" not in state:
        raise ValueError(f"lr_schedule: expected a dict with a 'kind' key, got {state!r}")
    kind = _ALIASES.get(state["kind"], state["kind"])
    if kind not in _KINDS:
        raise ValueError(f"lr_schedule: unknown kind {state['kind']!r}; use one of {', '.join(_KINDS)}")
    kwargs = {k: v for k, v in state.items() if k != "kind"}
    try:
        return _KINDS[kind](**kwargs)
    except TypeError as e:
        raise ValueError(f"lr_schedule: bad parameters for {kind!r}: {e}") from None


def schedule_name(spec: str) -> str:
    """The canonical kind of a schedule name ("cos" -> "cosine"); ValueError naming lr_schedule if unknown."""
    kind = _ALIASES.get(spec.lower(), spec.lower())
    if kind not in _KINDS:
        raise ValueError(f"lr_schedule: unknown schedule {spec!r}; use constant, exponential or cosine")
    return kind


def replan(schedule: LRSchedule, lr: float, total_steps: int | None, steps_per_epoch: int | None) -> LRSchedule:
    """`schedule` planned again for a run of `total_steps` steps (`steps_per_epoch` per epoch) at peak
    rate `lr`, keeping what is not a matter of length: a cosine keeps its warm-up length (steps already
    taken are not warmed up again) and its floor, an exponential its rate; an exponential decays once per
    epoch when the epoch length is known. Where a length is unknown (None) that part stays as it was."""
    if isinstance(schedule, Constant):
        return Constant(lr)
    if isinstance(schedule, ExponentialDecay):
        return ExponentialDecay(lr, decay_steps=int(steps_per_epoch) if steps_per_epoch else schedule.decay_steps,
                                decay_rate=schedule.decay_rate, staircase=schedule.staircase)
    if isinstance(schedule, CosineWarmup):
        if not total_steps:
            return schedule
        total = int(total_steps)
        return CosineWarmup(lr, total_steps=total, warmup_steps=min(schedule.warmup_steps, total),
                            min_lr=min(schedule.min_lr, lr))
    raise TypeError(f"lr_schedule: cannot re-plan a {type(schedule).__name__}")


def make_schedule(spec: ScheduleSpec, lr: float, total_steps: int | None = None,
                  steps_per_epoch: int | None = None) -> LRSchedule:
    """Turn the user's `lr_schedule` argument into a schedule.

    - None / "constant": lr throughout.
    - "exponential" (alias "exp"): staircase decay by 0.9 every epoch (when steps_per_epoch is known),
      else by 0.5 every 1000 steps.
    - "cosine": 5% linear warm-up then cosine to 0 over total_steps (required).
    - dict: {"kind": ..., hyper-parameters}; missing "lr" defaults to the `lr` argument.
    - an LRSchedule instance: used as is.
    """
    if isinstance(spec, LRSchedule):
        return spec
    if spec is None:
        return Constant(lr)
    if isinstance(spec, dict):
        return from_state_dict({"lr": lr, **spec})
    if callable(spec):
        raise TypeError("lr_schedule: pass an ncclavg.train.schedules.LRSchedule subclass instance (so it can "
                        "be checkpointed), a dict or a name, not a plain function")
    if not isinstance(spec, str):
        raise TypeError(f"lr_schedule: expected a name, dict or LRSchedule, got {type(spec).__name__}")
    kind = schedule_name(spec)
    if kind == "constant":
        return Constant(lr)
    if kind == "exponential":
        if steps_per_epoch:
            return ExponentialDecay(lr, decay_steps=int(steps_per_epoch), decay_rate=0.9)
        return ExponentialDecay(lr, decay_steps=1000, decay_rate=0.5)
    if kind == "cosine":
        if not total_steps:
            raise ValueError("lr_schedule: 'cosine' needs the total number of steps (fit() computes it "
                             "from the loader and epochs; pass a dict with total_steps otherwise)")
    return CosineWarmup(lr, total_steps=int(total_steps), warmup_steps=max(0, int(total_steps) // 20))
