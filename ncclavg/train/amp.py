"""Mixed precision for the towers: autocast contexts and the dynamic loss scale used with fp16.

Note [Dynamic loss scale]
fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by `scale` before
backward, so the gradients are `scale` times too large; the update divides them back (the optimizers
take `grad_scale=1/scale` and fold it into the same pass). When any averaged gradient is inf/NaN the
step is skipped (weights and optimizer state untouched) and the scale halves; after `growth_interval`
clean steps in a row it doubles. Same policy as torch.cuda.amp.GradScaler, so runs are comparable. bf16
has fp32's exponent range and needs no scaling.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

AMP_MODES = (None, "bf16", "fp16")


def normalise_amp(amp: Any) -> str | None:
    if amp is None or amp is False:
        return None
    if isinstance(amp, torch.dtype):
        amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp, str(amp))
    key = str(amp).lower()
    key = {"none": None, "off": None, "fp32": None, "bfloat16": "bf16", "float16": "fp16",
           "half": "fp16"}.get(key, key)
    if key not in AMP_MODES:
        raise ValueError(f"amp: must be None, 'bf16' or 'fp16', got {amp!r}")
    return key


def autocast_context(amp: str | None, device: torch.device) -> Any:
    """The autocast context of one tower (a null context without amp)."""
    if amp is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class DynamicLossScale:
    """See Note [Dynamic loss scale]."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, max_scale: float = 2.0 ** 24):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale: must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor: must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor: must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval: must be a positive integer, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.max_scale, self.scale * self.growth_factor)
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                "max_scale": self.max_scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            if key in state:
                setattr(self, key, float(state[key]))
        if "growth_interval" in state:
            self.growth_interval = int(state["growth_interval"])
