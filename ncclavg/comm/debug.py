"""Debug mode of Communicator (NCCLAVG_DEBUG=1): every collective is preceded by a tiny all-gather of
what each rank is about to run, so ranks that diverge get an error naming the difference instead of a
hang or a silently wrong average.

Note [Collective sequence check]
A rank that skips a bucket (a code path taken on one rank only, an early return, a bucket plan built
from other parameters) makes the n-th collective of one rank meet the (n+1)-th of another. With luck
their sizes differ and the backend fails or hangs; with bad luck they have the same size and the
ranks silently average unrelated gradients. In debug mode each collective first all-gathers a fixed
size record from every rank: the communicator's own sequence number, the operation, element count and
dtype, and -- when the caller knows them -- the training step, the bucket index and the bucket's layout
fingerprint. The record has the same size on every rank, so this exchange always completes (or times
out, when a peer is gone), and every rank compares the same gathered table, so all of them raise the
same CollectiveMismatchError. The cost is one extra small collective per bucket: debug mode only.
The record travels as float32 (16-bit chunks of each 64-bit field, exact in float32) because the NCCL
core only moves floating-point buffers; gloo uses the same encoding, so the CPU tests exercise it.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from ..buffers import DTYPE_NAMES, torch_code

OP_CODES = {"all_reduce_avg": 1, "reduce_scatter_avg": 2, "all_gather": 3}
_OP_NAMES = {v: k for k, v in OP_CODES.items()}
FIELDS = ("seq", "op", "numel", "dtype", "step", "bucket", "fingerprint")
_CHUNKS = 4  # 16-bit chunks per 64-bit field
RECORD_LEN = len(FIELDS) * _CHUNKS


def debug_enabled() -> bool:
    """NCCLAVG_DEBUG set to anything but '', '0', 'false', 'no', 'off'."""
    raw = os.environ.get("NCCLAVG_DEBUG", "").strip().lower()
    return raw not in ("", "0", "false", "no", "off")


def _dtype_code(dtype: torch.dtype) -> int:
    code = torch_code(dtype)
    return -1 if code is None else code


def make_record(seq: int, op: str, numel: int, dtype: torch.dtype, key: Optional[Sequence[int]]) -> list:
    step, bucket, fingerprint = (-1, -1, 0) if key is None else (int(key[0]), int(key[1]), int(key[2]))
    return [int(seq), OP_CODES[op], int(numel), _dtype_code(dtype), step, bucket, fingerprint]


def encode(record: Sequence[int]) -> torch.Tensor:
    """64-bit fields -> float32 tensor of 16-bit chunks (each exactly representable)."""
    out = []
    for v in record:
        u = int(v) & 0xFFFF_FFFF_FFFF_FFFF
        out.extend(float((u >> (16 * k)) & 0xFFFF) for k in range(_CHUNKS))
    return torch.tensor(out, dtype=torch.float32)


def decode(row: torch.Tensor) -> list:
    vals = [int(x) for x in row.to(torch.float64).tolist()]
    out = []
    for f in range(len(FIELDS)):
        u = sum(vals[f * _CHUNKS + k] << (16 * k) for k in range(_CHUNKS))
        out.append(u - (1 << 64) if u >= (1 << 63) else u)
    return out


def describe(record: Sequence[int]) -> str:
    seq, op, numel, dtype, step, bucket, fingerprint = record
    s = f"#{seq} {_OP_NAMES.get(op, f'op {op}')} of {numel} x {DTYPE_NAMES.get(dtype, f'dtype {dtype}')}"
    if step >= 0 or bucket >= 0:
        s += f" (step {step}, bucket {bucket}, bucket fingerprint {fingerprint & 0xFFFF_FFFF_FFFF_FFFF:016x})"
    return s


def compare(rows: Sequence[Sequence[int]], rank: int, backend: str) -> Optional[str]:
    """None when every rank's record is the same; else the error message (identical on every rank)."""
    if all(list(r) == list(rows[0]) for r in rows):
        return None
    lines = [f"rank {r}: {describe(rec)}" for r, rec in enumerate(rows)]
    return (f"NCCLAVG_DEBUG: the ranks of this {backend} communicator are about to run different collectives "
            f"(this is rank {rank}); a rank skipped, added or reordered a collective (bucket):\n  " +
            "\n  ".join(lines))
