"""The element math of the CPU reductions that the channel cannot do itself (integer, bool, MIN, MAX,
PRODUCT, the bitwise ops, and sums of dtypes it has no path for), and the byte views that carry any dtype
through it. Used by paths.py on every rank's rows, gathered in rank order.

Note [Reductions of gathered rows]
Every rank's input arrives as a row, in rank order, and each rank reduces the rows itself, so every rank
computes the same bits:
- integers: SUM and PRODUCT wrap in the element type (as gloo's and NCCL's do); MIN, MAX and the bitwise
  ops are exact. AVG is exact, never a wrap: the mean of the ranks' values rounded toward zero (as
  C's integer division and `torch.div(..., rounding_mode="trunc")`), computed through int64 for types
  of up to 32 bits and by quotient and remainder for int64 and uint64 (no sum is formed that could
  overflow). The unsigned types of 16 to 64 bits, which torch has few kernels for, go through numpy.
- bool: SUM, MAX, BOR and AVG are an OR (the mean is nonzero exactly when one value is), PRODUCT, MIN
  and BAND an AND, BXOR an XOR.
- floating point: accumulated in float64 for float64, else float32, in rank order, and rounded once to
  the element type.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch
from torch._C._distributed_c10d import ReduceOp

R = ReduceOp.RedOpType


def red_kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp (or of a RedOpType)."""
    return getattr(op, "op", op)


def premul_factor(op: Any) -> float:
    f = op.factor
    return float(f.item() if isinstance(f, torch.Tensor) else f)


# ---------------------------------------------------------------------------------------------- bytes
def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, flat (an empty tensor may have stride 0, which no view can reinterpret: a new empty one)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def byte_wire(flat_bytes: torch.Tensor, unit: int) -> torch.Tensor:
    """A channel-typed view of `flat_bytes` whose length is a multiple of the wire element, for a payload
    of `unit` bytes: float32 when `unit` is a multiple of 4, float16 when it is even, bfloat16 for an odd
    payload padded by one byte. The three are told apart by the channel's signature, so two payloads of
    different byte counts never look alike (an odd n and n + 1 would both be (n + 1) / 2 halves)."""
    if unit % 4 == 0:
        return flat_bytes.view(torch.float32)
    return flat_bytes.view(torch.float16 if unit % 2 == 0 else torch.bfloat16)


def padded(n: int) -> int:
    """Bytes on the wire for a payload of n bytes (see byte_wire)."""
    return n + (n % 2)


# ---------------------------------------------------------------------------------------------- reductions
def reduce_rows(rows: torch.Tensor, kind: Any, size: int) -> torch.Tensor:
    """rows (size, n), one per rank in rank order, reduced by `kind`: Note [Reductions of gathered rows]."""
    dtype = rows.dtype
    if dtype == torch.bool:
        return _reduce_bool(rows, kind)
    if dtype.is_floating_point:
        return _reduce_float(rows, kind, size)
    if dtype.is_complex:
        raise TypeError(f"op: {kind.name} is not defined for complex tensors")
    return torch.from_numpy(np.ascontiguousarray(_reduce_int(rows.numpy(), kind, size)))


def _reduce_bool(rows: torch.Tensor, kind: Any) -> torch.Tensor:
    if kind in (R.SUM, R.MAX, R.BOR, R.AVG):
        return rows.any(0)
    if kind in (R.PRODUCT, R.MIN, R.BAND):
        return rows.all(0)
    if kind == R.BXOR:
        return functools.reduce(torch.logical_xor, list(rows))
    raise ValueError(f"op: {kind.name} is not supported on bool tensors by the ncclavg backend")


def _reduce_float(rows: torch.Tensor, kind: Any, size: int) -> torch.Tensor:
    wide = rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32)
    if kind in (R.SUM, R.AVG):
        acc = wide[0].clone()
        for r in wide[1:]:
            acc += r
        if kind == R.AVG:
            acc /= size
    elif kind == R.PRODUCT:
        acc = wide[0].clone()
        for r in wide[1:]:
            acc *= r
    elif kind == R.MIN:
        acc = wide.amin(0)
    elif kind == R.MAX:
        acc = wide.amax(0)
    else:
        raise TypeError(f"op: {kind.name} needs an integer or bool tensor, got {rows.dtype}")
    return acc.to(rows.dtype)


def _reduce_int(rows: np.ndarray, kind: Any, size: int) -> np.ndarray:
    with np.errstate(over="ignore"):   # SUM and PRODUCT wrap, as the Note says
        if kind == R.SUM:
            return rows.sum(0, dtype=rows.dtype)
        if kind == R.PRODUCT:
            return rows.prod(0, dtype=rows.dtype)
        if kind == R.AVG:
            return exact_mean(rows)
    if kind == R.MIN:
        return rows.min(0)
    if kind == R.MAX:
        return rows.max(0)
    ops = {R.BAND: np.bitwise_and, R.BOR: np.bitwise_or, R.BXOR: np.bitwise_xor}
    if kind in ops:
        return ops[kind].reduce(rows, axis=0)
    raise ValueError(f"op: {kind} is not supported by the ncclavg backend on CPU tensors")


_SIGN64 = np.uint64(1 << 63)


def exact_mean(rows: np.ndarray) -> np.ndarray:
    """The mean of integer rows (size, n) over axis 0, rounded toward zero, in their dtype; exact for
    every value of every integer type (Note [Reductions of gathered rows])."""
    p = rows.shape[0]
    if rows.dtype.itemsize <= 4:   # the sum of up to 2^31 of them fits in int64
        total = rows.astype(np.int64).sum(0)
        mean = np.where(total >= 0, total // p, -((-total) // p))
        return mean.astype(rows.dtype)
    if rows.dtype == np.uint64:
        floor_mean, _ = _floor_mean_u64(rows)
        return floor_mean
    # int64: shifted by 2^63 into uint64 (the order and the differences stay), floored there, shifted
    # back; then the floor of a negative mean with a remainder moves up by one (toward zero)
    shifted = rows.view(np.uint64) ^ _SIGN64
    floor_u, rest = _floor_mean_u64(shifted)
    floor_mean = (floor_u ^ _SIGN64).view(np.int64)
    return floor_mean + ((floor_mean < 0) & (rest != 0)).astype(np.int64)


def _floor_mean_u64(rows: np.ndarray) -> tuple:
    """(floor of the mean, remainder of the sum mod size) of uint64 rows, with no sum that overflows:
    x = q * p + r, so sum(x) / p = sum(q) + sum(r) / p, sum(q) <= 2^64 - 1 and sum(r) < p^2."""
    p = np.uint64(rows.shape[0])
    q, r = rows // p, rows % p
    with np.errstate(over="ignore"):
        sum_q = q.sum(0, dtype=np.uint64)
    sum_r = r.sum(0, dtype=np.uint64)
    return sum_q + sum_r // p, sum_r % p


def sum_in_order(parts: list, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """parts[0] + parts[1] + ... in order, accumulated in float64 for float64 and float32 otherwise, rounded
    once to the parts' dtype: the channel's arithmetic, for sums done outside it (a record's payloads, the
    pieces of an all_to_all). Written into `out` when given (which may be parts[0] or parts[1], never a
    later part); float32 and float64 parts are added with no widening copy."""
    wide = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    if parts[0].dtype == wide and len(parts) > 1:
        acc = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
        for p in parts[2:]:
            acc += p
        return acc
    acc = parts[0].to(wide, copy=True)
    for p in parts[1:]:
        acc += p
    if out is not None:
        return out.copy_(acc)
    return acc.to(parts[0].dtype)
