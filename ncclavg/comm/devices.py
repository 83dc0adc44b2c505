"""Tower devices from what users write: 'cpu', 'cuda', 'cuda:N', N (a GPU ordinal) or a torch.device.
'cpu:0' is torch's other spelling of 'cpu'; 'cpu:N' past it is refused (there is one CPU device: CPU
towers are replicas that share it).

The one parser of the package's device arguments: the local communicator's `device`, the trainer's
`devices[i]`, from_torch_distributed's `devices`, the nccl backend's `devices` and `device`, so that all
accept the same spellings and their errors name the argument in the same words. It is split in steps
because the callers check different things in between: the local communicator asks whether this build
has CUDA before it asks torch for GPUs (the first answer is the more useful one on a CPU-only wheel).
"""
from __future__ import annotations

from typing import Any

import torch

_SPELLINGS = "'cpu', 'cuda:N', a GPU ordinal or a torch.device"
_CUDA_SPELLINGS = "a CUDA device ordinal or 'cuda:N'"


def device_of(value: Any, name: str, cuda_only: bool = False) -> torch.device:
    """The device `value` names (CPU devices all read as plain 'cpu'; 'cuda' keeps no index), checked
    for spelling only: nothing here asks whether a GPU exists (see `present_cuda_device`). `cuda_only`:
    an argument that takes CUDA devices alone (the nccl backend's), whose errors say so."""
    spellings = _CUDA_SPELLINGS if cuda_only else _SPELLINGS
    if isinstance(value, bool):   # bool is an int: True would read as cuda:1
        raise TypeError(f"{name}: expected {spellings}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: a GPU ordinal must be >= 0, got {value}")
        dev = torch.device("cuda", value)
    elif isinstance(value, torch.device):
        dev = value
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            dev = torch.device("cuda", int(text)) if text.isdigit() else torch.device(text)
        except (RuntimeError, ValueError):
            if cuda_only:
                raise TypeError(f"{name}: expected {spellings}, got {value!r}") from None
            raise ValueError(f"{name}: unknown device {value!r}; use 'cpu', 'cuda:N' or a GPU ordinal") from None
    else:
        raise TypeError(f"{name}: expected {spellings}, got {type(value).__name__}")
    if cuda_only and dev.type != "cuda":
        raise ValueError(f"{name}: {dev} is not a CUDA device")
    if dev.type == "cpu":
        if dev.index not in (None, 0):   # torch names one CPU device; an index past it means nothing here
            raise ValueError(f"{name}: {dev} is not a device: CPU towers all run on the one 'cpu' (also spelled "
                             "'cpu:0'); give 'cpu' once per tower, e.g. ['cpu', 'cpu'] or --devices cpu,cpu")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{name}: {dev} is not supported; towers run on 'cpu' or 'cuda:N'")
    return dev


def device_list(devices: Any, name: str, what: str) -> list:
    """`devices` as a non-empty list (not one device given alone); else a ValueError naming `name`."""
    if isinstance(devices, (str, torch.device, int)) or not hasattr(devices, "__len__") or len(devices) == 0:
        raise ValueError(f"{name}: expected a non-empty list of {what}, got {devices!r}")
    return list(devices)


def kinds_of(devices: list, name: str) -> list:
    """The device type ('cpu', 'cuda', ...) of each entry, only read (a bad spelling is the caller's to
    name with `device_of`, after the lists' own checks): a TypeError naming the entry for what is no
    device at all."""
    out = []
    for i, d in enumerate(devices):
        if isinstance(d, bool):
            raise TypeError(f"{name}[{i}]: expected {_CUDA_SPELLINGS}, got {d!r}")
        if isinstance(d, int):
            out.append("cuda")
            continue
        try:
            out.append(torch.device(d).type)
        except (RuntimeError, TypeError, ValueError):
            raise TypeError(f"{name}[{i}]: expected {_CUDA_SPELLINGS}, got {d!r}") from None
    return out


def one_kind(kinds: list, devices: list, name: str, advice: str) -> str:
    """The one device type of a list of towers' devices, else a ValueError naming `name`."""
    if len(set(kinds)) > 1:
        raise ValueError(f"{name}: mixes {' and '.join(sorted(set(kinds)))} towers ({[str(d) for d in devices]}); "
                         f"{advice}")
    return kinds[0]


def cuda_count() -> int:
    """GPUs torch can use; a broken driver reads as none (the caller's error then names the device)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def present_cuda_device(dev: torch.device, name: str) -> torch.device:
    """`dev` (a CUDA device from `device_of`) with its index resolved ('cuda' is the current device),
    or a ValueError naming `name` when torch sees no GPU or not that one."""
    count = cuda_count()
    if count == 0:
        from ..info import torch_no_gpu_reason   # Note [Saying why there is no GPU] in ncclavg/info.py

        raise ValueError(f"{name}: {dev} needs a GPU, and torch sees none: {torch_no_gpu_reason()}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"{name}: cuda:{index} does not exist ({count} visible CUDA device(s))")
    return torch.device("cuda", index)


def cuda_index(value: Any, name: str) -> int:
    """The ordinal of the CUDA device `value` names, which must exist (the nccl backend's devices)."""
    return present_cuda_device(device_of(value, name, cuda_only=True), name).index
