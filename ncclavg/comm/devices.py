"""Tower devices from what users write: 'cpu', 'cuda', 'cuda:N', N (a GPU ordinal) or a torch.device.
'cpu:0' is torch's other spelling of 'cpu'; 'cpu:N' past it is refused (there is one CPU device: CPU
towers are replicas that share it).

One parser for the local communicator's `device` and the trainer's `devices[i]`, so that both accept the
same spellings and their errors name the argument in the same words. It is split in two because the
callers check different things in between: the local communicator asks whether this build has CUDA
before it asks torch for GPUs (the first answer is the more useful one on a CPU-only wheel).
"""
from __future__ import annotations

from typing import Any

import torch

_SPELLINGS = "'cpu', 'cuda:N', a GPU ordinal or a torch.device"


def device_of(value: Any, name: str) -> torch.device:
    """The device `value` names (CPU devices all read as plain 'cpu'; 'cuda' keeps no index), checked
    for spelling only: nothing here asks whether a GPU exists (see `present_cuda_device`)."""
    if isinstance(value, bool):   # bool is an int: True would read as cuda:1
        raise TypeError(f"{name}: expected {_SPELLINGS}, got {value!r}")
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
            raise ValueError(f"{name}: unknown device {value!r}; use 'cpu', 'cuda:N' or a GPU ordinal") from None
    else:
        raise TypeError(f"{name}: expected {_SPELLINGS}, got {type(value).__name__}")
    if dev.type == "cpu":
        if dev.index not in (None, 0):   # torch names one CPU device; an index past it means nothing here
            raise ValueError(f"{name}: {dev} is not a device: CPU towers all run on the one 'cpu' (also spelled "
                             "'cpu:0'); give 'cpu' once per tower, e.g. ['cpu', 'cpu'] or --devices cpu,cpu")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{name}: {dev} is not supported; towers run on 'cpu' or 'cuda:N'")
    return dev


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
