"""The NCCL backend's Python layer over the emulated core, in THIS process (a child the test started).

`install(core)` loads the emulated `ncclavg._C` (csrc/cuda/emu/build_pycore.py: every source of the real
core, the CUDA runtime emulated, NCCL the stand-in named by NCCLAVG_NCCL_LIBRARY) before ncclavg is
imported, and makes torch.cuda answer for the emulated machine. What is patched, and why that is
honest (see docs/cuda_emulation.md, "The Python layer on the emulated core"):
- torch.cuda.is_available / device_count / current_device / set_device: the emulated runtime's device
  count and the calling thread's chosen device, read from the emulated runtime itself;
- torch.cuda.current_stream(d): the legacy default stream of device d (handle 0), which is what torch's
  current stream is until a program picks another; synchronize() is cudaStreamSynchronize on it.
Tensors are `cuda_tensor(...)`: CPU tensors over memory from the emulated cudaMalloc (so the core's
cudaPointerGetAttributes check sees device d), whose .device says cuda:d. torch ops on them give plain
CPU tensors; `host(t)` reads one as a CPU tensor after synchronizing its device's current stream, as
`.cpu()` does on a GPU. Nothing here runs torch's own CUDA code: the CPU wheel has none.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

import torch

_lib = None


def install(core_path: str, devices: int = 4) -> ctypes.CDLL:
    """Loads the emulated core as ncclavg._C (RTLD_GLOBAL: the stand-in NCCL binds its CUDA calls to
    the same emulated runtime) and patches torch.cuda. Call before `import ncclavg`."""
    global _lib
    if "ncclavg" in sys.modules:
        raise RuntimeError("install() must run before ncclavg is imported")
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        spec = importlib.util.spec_from_file_location("ncclavg._C", core_path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.setdlopenflags(flags)
    sys.modules["ncclavg._C"] = mod
    _lib = ctypes.CDLL(core_path)   # the same loaded object: its exported emulated runtime and controls
    assert _lib.ncclavg_emu_is_emulated() == 1
    _lib.ncclavg_emu_set_device_count(devices)
    _lib.ncclavg_emu_drain_all_streams.argtypes = [ctypes.c_double]
    _lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    _lib.cudaFree.argtypes = [ctypes.c_void_p]
    _lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    _patch_torch_cuda()
    return _lib


def lib() -> ctypes.CDLL:
    return _lib


def _check(e: int, what: str) -> None:
    if e != 0:
        _lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {_lib.cudaGetErrorString(e).decode()}")


def set_device(d: int) -> None:
    _check(_lib.cudaSetDevice(int(d)), f"cudaSetDevice({d})")


def current_device() -> int:
    out = ctypes.c_int(-1)
    _check(_lib.cudaGetDevice(ctypes.byref(out)), "cudaGetDevice")
    return out.value


def device_count() -> int:
    out = ctypes.c_int(0)
    return out.value if _lib.cudaGetDeviceCount(ctypes.byref(out)) == 0 else 0


class _Stream:
    """torch.cuda.Stream's face for the legacy default stream of one device."""

    def __init__(self, device: int):
        self.device = torch.device("cuda", device)
        self.cuda_stream = 0

    def synchronize(self) -> None:
        prev = current_device()
        set_device(self.device.index)
        try:
            _check(_lib.cudaStreamSynchronize(None), f"cudaStreamSynchronize on cuda:{self.device.index}")
        finally:
            set_device(prev)


def _stream_of(device=None) -> _Stream:
    if device is None:
        return _Stream(current_device())
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return _Stream(d.index if d.index is not None else current_device())


def _patch_torch_cuda() -> None:
    torch.cuda.is_available = lambda: device_count() > 0
    torch.cuda.device_count = device_count
    torch.cuda.current_device = current_device
    torch.cuda.set_device = lambda d: set_device(d if isinstance(d, int) else torch.device(d).index)
    torch.cuda.current_stream = _stream_of
    torch.cuda.synchronize = lambda device=None: _stream_of(device).synchronize()


class EmulatedCudaTensor(torch.Tensor):
    """A CPU tensor over emulated device memory that reports cuda:<device>. Its memory is freed (the
    emulated cudaFree) when the last tensor over it goes."""

    __torch_function__ = torch._C._disabled_torch_function_impl   # ops give plain CPU tensors

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: int, owner: "_Allocation"):
        t = torch.Tensor._make_subclass(cls, data)
        t._emu_device = torch.device("cuda", device)
        t._emu_owner = owner
        return t

    @property
    def device(self) -> torch.device:
        return self._emu_device

    @property
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:
        return self._emu_device.index


class _Allocation:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        if _lib is not None and self.ptr:
            _lib.cudaFree(ctypes.c_void_p(self.ptr))


def cuda_tensor(values, device: int, dtype=torch.float32) -> EmulatedCudaTensor:
    """A new tensor on emulated cuda:`device` holding `values` (a CPU tensor or anything torch.tensor
    takes), copied in after the device's current stream drained (as a pageable H2D copy is)."""
    src = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    src = src.to(dtype).contiguous()
    nbytes = src.numel() * src.element_size()
    prev = current_device()
    set_device(device)
    try:
        ptr = ctypes.c_void_p()
        _check(_lib.cudaMalloc(ctypes.byref(ptr), max(nbytes, 1)), f"cudaMalloc on cuda:{device}")
        _Stream(device).synchronize()
    finally:
        set_device(prev)
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr.value)
    flat = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype).view(src.shape)
    flat.copy_(src)
    return EmulatedCudaTensor(flat, device, _Allocation(ptr.value))


def host(t: EmulatedCudaTensor) -> torch.Tensor:
    """`t.cpu()`: a CPU copy, after everything enqueued on its device's current stream ran."""
    _Stream(t.get_device()).synchronize()
    return t.as_subclass(torch.Tensor).clone()


def drain(timeout_s: float = 30.0) -> bool:
    return bool(_lib.ncclavg_emu_drain_all_streams(timeout_s))
