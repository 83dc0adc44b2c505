"""Reference arithmetic for the fused optimizer tests.

`ref_adam` / `ref_sgd` replay the core's float32 operation sequence with numpy (IEEE float32, no FMA),
so the scalar kernels must match them bit for bit (see Note [Optimizer arithmetic follows torch] in
csrc/common/optim_math.h). `tower_mean` is the float64 mean rounded once to float32 (Note [Exact tower
mean]). Helpers for SIMD levels and tolerances live here too.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from ncclavg import _C

f32 = np.float32


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().reshape(-1).numpy().copy()


def tower_mean(towers) -> np.ndarray:
    """float64 sum of the towers in order, divided by n, rounded to float32 once."""
    acc = to_np(towers[0]).astype(np.float64)
    for t in towers[1:]:
        acc = acc + to_np(t).astype(np.float64)
    return (acc / len(towers)).astype(f32) if len(towers) > 1 else to_np(towers[0])


def effective_grad(towers, grad_scale=1.0, clip=1.0, maximize=False) -> np.ndarray:
    inv = f32(1.0 / grad_scale)
    if maximize:
        inv = -inv
    with np.errstate(over="ignore", invalid="ignore"):
        return (tower_mean(towers) * inv) * f32(clip)


def ref_adam(p, m, v, vmax, g, *, step, lr, beta1, beta2, eps, wd, decoupled=True, amsgrad=False):
    """In place on float32 numpy arrays, the core's exact operation order."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    step_size = lr / bc1
    w1 = f32(1.0 - beta1)
    if decoupled and wd != 0:
        p *= f32(1.0 - lr * wd)
    if not decoupled and wd != 0:
        g = g + f32(wd) * p
    if abs(w1) < f32(0.5):
        m += w1 * (g - m)
    else:
        m[:] = g - (g - m) * (f32(1.0) - w1)
    v *= f32(beta2)
    v += (f32(1.0 - beta2) * g) * g
    src = v
    if amsgrad:
        np.maximum(vmax, v, out=vmax)
        src = vmax
    denom = np.sqrt(src) / f32(bc2 ** 0.5) + f32(eps)
    p += (f32(-step_size) * m) / denom


def ref_sgd(p, buf, g, *, lr, momentum, dampening, wd, nesterov, first):
    if wd != 0:
        g = g + f32(wd) * p
    if momentum != 0:
        if first:
            buf[:] = g
        else:
            buf *= f32(momentum)
            buf += f32(1.0 - dampening) * g
        g = g + f32(momentum) * buf if nesterov else buf
    p += f32(-lr) * g


def simd_levels() -> list[str]:
    return list(_C.simd_levels_supported())


@contextlib.contextmanager
def simd_level(name: str):
    before = _C.simd_level()
    _C.set_simd_level(name)
    try:
        yield
    finally:
        _C.set_simd_level(before)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the float32 relative error of a parameter tensor."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def bits_equal(a, b) -> bool:
    a = torch.as_tensor(a).reshape(-1)
    b = torch.as_tensor(b).reshape(-1)
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


def norm64(towers_per_seg, grad_scale=1.0) -> float:
    total = 0.0
    for towers in towers_per_seg:
        g = effective_grad(towers, grad_scale).astype(np.float64)
        total += float(np.dot(g, g))
    return math.sqrt(total)
