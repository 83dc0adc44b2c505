"""Element-wise ops of the core on user tensors."""
from __future__ import annotations

from typing import Any, Sequence

from ._ext import _C, cuda_built
from .buffers import as_buffers


def _stream_for(x: Any) -> int:
    """The CUDA stream to enqueue on for a device tensor: torch's / cupy's current stream."""
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    if mod.startswith("cupy"):
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def average_(buffers: Sequence[Any]) -> None:
    """In place: every buffer becomes the element-wise mean of all of them.

    One pass over memory (each buffer read once and written once), fp32 accumulation, one rounding to
    the storage type. All buffers must have the same size, dtype and device, be contiguous, writable and
    distinct. CPU buffers use the OpenMP+SIMD host kernel; CUDA buffers of one device one kernel launch
    on the current stream (asynchronous, like any CUDA op).
    """
    bufs = as_buffers(buffers, "buffers")
    device = bufs[0].device
    if device >= 0 and not cuda_built():
        raise ValueError(f"buffers[0]: is on cuda:{device} but this build of ncclavg has no CUDA "
                         "support (rebuild with NCCLAVG_CUDA=1)")
    stream = _stream_for(buffers[0]) if device >= 0 else 0
    _C.average_(bufs, stream)
