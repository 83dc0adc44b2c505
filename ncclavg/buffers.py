"""Turns framework arrays into the core's `Buffer(ptr, numel, dtype, device)` descriptors.

Accepted: torch tensors, cupy arrays, numpy arrays (and anything with __cuda_array_interface__ or
__array_interface__), of float32, float16 or bfloat16, contiguous, writable. The core validates again;
this layer exists to give errors in the user's terms (which argument, which tensor) before any work.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from ._ext import _C

Buffer = _C.Buffer

# The one table of element types: the core's codes (_C.dtype_codes), from which every other is made.
CORE_CODES = dict(_C.dtype_codes())   # name -> code: the channel's types; a Buffer takes the first three
FLOAT32, FLOAT16, BFLOAT16, FLOAT64 = (CORE_CODES[n] for n in ("float32", "float16", "bfloat16", "float64"))
DTYPE_NAMES = {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}   # a Buffer's types
DTYPE_CODES = {v: k for k, v in DTYPE_NAMES.items()}
CPU = -1
_TORCH_CHANNEL: dict = {}   # torch dtype -> code, every channel type (built on first use: no torch import here)


def _torch_channel_codes() -> dict:
    if not _TORCH_CHANNEL:
        import torch

        _TORCH_CHANNEL.update({getattr(torch, name): code for name, code in CORE_CODES.items()})
    return _TORCH_CHANNEL


def channel_types() -> tuple:
    """The torch dtypes the shared-memory channel adds: float32, float16, bfloat16, float64."""
    return tuple(_torch_channel_codes())


def is_channel_type(dtype: Any) -> bool:
    """Whether the channel adds `dtype` (channel_types(), without building the tuple: per call)."""
    return dtype in _torch_channel_codes()


def channel_type_code(dtype: Any) -> int:
    """The core's code of a torch dtype the channel takes (KeyError for another)."""
    return _torch_channel_codes()[dtype]


def torch_code(dtype: Any) -> Any:
    """The core's code of a torch dtype a Buffer takes, or None."""
    code = _torch_channel_codes().get(dtype)
    return code if code in DTYPE_NAMES else None


def dtype_code(name: str, argname: str = "dtype") -> int:
    """'float32' | 'float16' | 'bfloat16' (also 'fp32', 'fp16', 'bf16', 'half') -> core code."""
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
               "bf16": "bfloat16"}
    key = str(name).replace("torch.", "")
    key = aliases.get(key, key)
    if key not in DTYPE_CODES:
        raise TypeError(f"{argname}: unsupported dtype {name!r}; use float32, float16 or bfloat16")
    return DTYPE_CODES[key]


def _kind(x: Any) -> str:
    mod = type(x).__module__ or ""
    if mod.startswith("torch") or _is_torch_subclass(type(x)):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if hasattr(x, "__array_interface__"):
        return "numpy"
    return "unknown"


def _is_torch_subclass(cls: type) -> bool:
    """A torch.Tensor subclass defined outside torch (a user's, a library's): a torch tensor all the same.
    Asked only of types that are not torch's own; torch is not imported for it (no tensor without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(cls, torch.Tensor)


def _from_torch(t: Any, name: str) -> Buffer:
    # On the per-bucket hot path: one attribute read per check, the dtype table built once.
    code = _torch_channel_codes().get(t.dtype)
    if code is None or code == FLOAT64:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use float32, float16 or bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{name}: tensor is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         "call .contiguous() or pass the flat bucket")
    dev = t.device
    if dev.type == "cpu":
        device = CPU
    elif dev.type == "cuda":
        if dev.index is None:
            import torch

            device = torch.cuda.current_device()
        else:
            device = dev.index
    else:
        raise ValueError(f"{name}: device {dev} is not supported; use cpu or cuda tensors")
    if t.is_neg():
        raise ValueError(f"{name}: tensor has a lazy negation bit; call .resolve_neg()")
    return Buffer(t.data_ptr(), t.numel(), code, device, False)


def _numpy_code(dtype: Any, name: str) -> int:
    if dtype.name == "float32":
        return FLOAT32
    if dtype.name == "float16":
        return FLOAT16
    if dtype.name == "bfloat16" and dtype.itemsize == 2:  # ml_dtypes.bfloat16
        return BFLOAT16
    raise TypeError(f"{name}: dtype {dtype} is not supported; use float32, float16 or bfloat16")


def _from_cupy(a: Any, name: str) -> Buffer:
    code = _numpy_code(a.dtype, name)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: cupy array is not C-contiguous (strides {a.strides})")
    return Buffer(int(a.data.ptr), int(a.size), code, int(a.device.id), False)


def _from_numpy(a: Any, name: str) -> Buffer:
    import numpy as np

    arr = np.asarray(a)  # zero-copy view of anything with __array_interface__
    code = _numpy_code(arr.dtype, name)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: array is not C-contiguous (strides {arr.strides})")
    if not arr.flags.writeable:
        raise ValueError(f"{name}: array is read-only; the op writes its result in place")
    return Buffer(int(arr.ctypes.data), int(arr.size), code, CPU, False)


def _from_cuda_array_interface(a: Any, name: str) -> Buffer:
    import numpy as np

    iface = a.__cuda_array_interface__
    shape = tuple(iface["shape"])
    dtype = np.dtype(iface["typestr"])
    code = _numpy_code(dtype, name)
    numel = int(np.prod(shape)) if shape else 1
    strides = iface.get("strides")
    if strides is not None and numel > 1:
        expect, step = [], dtype.itemsize
        for dim in reversed(shape):
            expect.insert(0, step)
            step *= dim
        if any(s != e for s, e, d in zip(strides, expect, shape) if d != 1):
            raise ValueError(f"{name}: array is not C-contiguous (strides {strides})")
    ptr, readonly = iface["data"]
    if readonly:
        raise ValueError(f"{name}: array is read-only; the op writes its result in place")
    device = getattr(getattr(a, "device", None), "id", None)
    if device is None:
        raise ValueError(f"{name}: cannot tell which CUDA device holds this array; pass a torch tensor "
                         "or a cupy array")
    return Buffer(int(ptr or 0), numel, code, int(device), False)


def as_buffer(x: Any, name: str = "tensor") -> Buffer:
    """One Buffer for a torch tensor, cupy array or numpy array; `name` is used in error messages."""
    if isinstance(x, Buffer):
        return x
    kind = _kind(x)
    if kind == "torch":
        return _from_torch(x, name)
    if kind == "cupy":
        return _from_cupy(x, name)
    if kind == "cai":
        return _from_cuda_array_interface(x, name)
    if kind == "numpy":
        return _from_numpy(x, name)
    raise TypeError(f"{name}: expected a torch tensor, cupy array or numpy array, got {type(x).__name__}")


def as_buffers(xs: Sequence[Any], name: str = "buffers") -> list[Buffer]:
    """Buffers for a non-empty list, each named `name[i]` in errors."""
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__len__") or _kind(xs) != "unknown":
        raise TypeError(f"{name}: expected a list of tensors/arrays, got {type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{name}: expected at least one tensor, got an empty list")
    return [as_buffer(x, f"{name}[{i}]") for i, x in enumerate(xs)]
