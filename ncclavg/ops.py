"""Element-wise ops of the core on user tensors."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ._ext import _C, cuda_built
from .buffers import as_buffer, as_buffers


def _stream_for(x: Any) -> int:
    """The CUDA stream to enqueue on for a device tensor: torch's / cupy's current stream OF THE TENSOR'S
    DEVICE (each device has its own current stream; the current device's may belong to another GPU)."""
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    if mod.startswith("cupy"):
        import cupy

        with x.device:   # cupy's current stream is per device: ask with the array's device current
            return int(cupy.cuda.get_current_stream().ptr)
    return 0


def average_(buffers: Sequence[Any], *, check_finite: bool = False) -> Optional[bool]:
    """In place: every buffer becomes the element-wise mean of all of them.

    One pass over memory (each buffer read once and written once), fp32 accumulation, one rounding to
    the storage type. All buffers must have the same size, dtype and device, be contiguous, writable and
    distinct. CPU buffers use the OpenMP+SIMD host kernel; CUDA buffers of one device one kernel launch
    on the current stream (asynchronous, like any CUDA op).

    check_finite=True (CPU buffers): returns whether every mean written is finite, noted by the same pass
    (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h); None when nothing was
    written (a single buffer) or not checked (CUDA, or check_finite=False).
    """
    bufs = as_buffers(buffers, "buffers")
    device = bufs[0].device
    if device >= 0 and not cuda_built():
        raise ValueError(f"buffers[0]: is on cuda:{device} but this build of ncclavg has no CUDA "
                         "support (rebuild with NCCLAVG_CUDA=1)")
    stream = _stream_for(buffers[0]) if device >= 0 else 0
    return _C.average_(bufs, stream, bool(check_finite))


def _check_factor(value: Any, argname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argname}: expected a number, got {type(value).__name__}")
    f = float(value)
    if f != f or f in (float("inf"), float("-inf")):
        raise ValueError(f"{argname}: must be finite, got {value}")
    if argname == "divisor" and f == 0.0:
        raise ValueError("divisor: must be non-zero")
    return f


def _check_offsets(offsets: Sequence[int], n: int, seq_name: str) -> list:
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__"):
        raise TypeError(f"offsets: expected a list of element offsets, got {type(offsets).__name__}")
    if len(offsets) != n:
        raise ValueError(f"offsets: has {len(offsets)} entries but {seq_name} has {n}")
    out = []
    for i, o in enumerate(offsets):
        if isinstance(o, bool) or not hasattr(o, "__index__"):
            raise TypeError(f"offsets[{i}]: expected an int, got {type(o).__name__}")
        out.append(int(o))
    return out


def pack_(tensors: Sequence[Any], bucket: Any, offsets: Sequence[int], scale: float = 1.0,
          divisor: float = 1.0, *, check_finite: bool = False) -> Optional[bool]:
    """ONE fused call: `bucket[offsets[i] : offsets[i] + tensors[i].numel] = tensors[i] * scale / divisor`,
    cast to the bucket's dtype (e.g. float32 grads into a bfloat16 bucket).

    Offsets count elements of the bucket. CPU: OpenMP + SIMD; CUDA: one kernel launch on the bucket's
    current stream. Tensors may be empty; writes may not overlap (see Note [Pack aliasing rule]).
    check_finite=True (CPU): returns whether every value written is finite (an overflow of the cast
    included), noted by the same pass; None when not checked (CUDA)."""
    bufs = as_buffers(tensors, "srcs") if len(tensors) else []
    dst = as_buffer(bucket, "dst")
    offs = _check_offsets(offsets, len(bufs), "srcs")
    mul, div = _check_factor(scale, "scale"), _check_factor(divisor, "divisor")
    stream = _stream_for(bucket) if dst.device >= 0 else 0
    return _C.pack_(bufs, dst, offs, mul, div, stream, bool(check_finite))


def unpack_(bucket: Any, tensors: Sequence[Any], offsets: Sequence[int], scale: float = 1.0,
            divisor: float = 1.0, *, check_finite: bool = False) -> Optional[bool]:
    """ONE fused call: `tensors[i] = bucket[offsets[i] : offsets[i] + tensors[i].numel] * scale / divisor`,
    cast to each tensor's dtype (e.g. a bfloat16 bucket into float32 grads with divisor=N).

    A tensor that IS its bucket region (same dtype) is scaled in place. check_finite: as pack_'s."""
    src = as_buffer(bucket, "src")
    bufs = as_buffers(tensors, "dsts") if len(tensors) else []
    offs = _check_offsets(offsets, len(bufs), "dsts")
    mul, div = _check_factor(scale, "scale"), _check_factor(divisor, "divisor")
    stream = _stream_for(bucket) if src.device >= 0 else 0
    return _C.unpack_(src, bufs, offs, mul, div, stream, bool(check_finite))
