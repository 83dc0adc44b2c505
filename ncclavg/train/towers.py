"""Towers: device parsing, replica construction, batch splitting, the thread-per-tower runner and the
number of torch threads each CPU tower gets (Note [Threads of CPU towers]).

Note [Threads of CPU towers]
Each tower runs its forward and backward in a thread of its own (TowerRunner), and torch gives every
thread that computes an intra-op pool of torch.get_num_threads() threads: by default one per core. T CPU
towers in each of P processes of a host then run T * P * cores busy threads on `cores` cores, and they
preempt each other: fits of the README's example (2 towers, 2 cores) took 2.8 to 10 s with torch's
default against 3.0 to 5.7 s with one thread per tower, alternated on a busy machine (load average 5 to
9), and the spread grows with the load. So a trainer with CPU towers sets torch's intra-op threads to

    max(1, cores of this process // (its CPU towers * processes on this host))

where the cores are those this process may run on (os.sched_getaffinity) and the processes on this host
are torchrun's LOCAL_WORLD_SIZE (1 without torchrun). GPU towers leave torch's setting alone: their
compute is on the GPU. `threads=` (TowerTrainer) or `--threads` (ncclavg train) overrides the rule.
The setting is torch's, for the whole process, and is made when the trainer is built: a thread reads
it the first time it computes (torch initialises each thread's pool once), so the tower threads,
which start after it, all see it. The decision is logged once per process (again only if it changes)
and shown by describe() and the `towers:` line of `ncclavg train`.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..comm.devices import cuda_count, device_of, present_cuda_device
from .data import check_sample_tensors

log = logging.getLogger(__name__)
_logged_threads: tuple | None = None   # the last decision logged: See Note [Threads of CPU towers]


def parse_device(value: Any, name: str) -> torch.device:
    """'cpu' | 'cuda:N' | 'cuda' (current device) | N (GPU index) | torch.device -> torch.device."""
    dev = device_of(value, name)
    return dev if dev.type == "cpu" else present_cuda_device(dev, name)


def parse_devices(devices: Any) -> list[torch.device]:
    """Validated list of tower devices (non-empty, one kind). A string may list several: 'cpu,cpu'."""
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else [devices]
    elif isinstance(devices, (int, torch.device)):
        devices = [devices]
    if not isinstance(devices, (list, tuple)):
        raise TypeError(f"devices: expected a list of devices, got {type(devices).__name__}")
    if len(devices) == 0:
        raise ValueError("devices: the list is empty; give at least one device, e.g. ['cpu', 'cpu'] or "
                         "['cuda:0', 'cuda:1']")
    parsed = [parse_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
    kinds = {d.type for d in parsed}
    if len(kinds) > 1:
        raise ValueError(f"devices: mixes cpu and cuda towers ({', '.join(str(d) for d in parsed)}); all "
                         "towers must be of one kind")
    return parsed


def default_devices(cpu_towers: int = 2) -> list[torch.device]:
    """Every visible GPU when torch and this build of ncclavg can use them; else `cpu_towers` CPU towers."""
    from .._ext import cuda_built

    n = cuda_count()
    if n > 0 and cuda_built():
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * cpu_towers


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def processes_on_this_host() -> int:
    """torchrun's LOCAL_WORLD_SIZE (the processes of this job on this host), 1 without torchrun."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def tower_threads(devices: Sequence[torch.device], threads: int | None = None) -> tuple[int | None, str]:
    """(torch intra-op threads for these towers, why), or (None, why) when torch's setting is left as it
    is (GPU towers without `threads`). See Note [Threads of CPU towers]."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: must be a positive integer or None, got {threads!r}")
        return threads, "as asked"
    cpu_towers = sum(1 for d in devices if d.type == "cpu")
    if cpu_towers == 0:
        return None, "GPU towers: torch's setting kept"
    cores, procs = usable_cores(), processes_on_this_host()
    n = max(1, cores // (cpu_towers * procs))
    where = f" x {procs} processes on this host" if procs > 1 else ""
    return n, f"{cores} cores / ({cpu_towers} CPU towers{where})"


def apply_tower_threads(devices: Sequence[torch.device], threads: int | None = None) -> int:
    """Sets torch's intra-op threads by the rule of Note [Threads of CPU towers] (or to `threads`),
    logs the decision once per process, and returns the number of threads torch now uses."""
    global _logged_threads
    n, why = tower_threads(devices, threads)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    current = torch.get_num_threads()
    if (current, why) != _logged_threads:
        _logged_threads = (current, why)
        log.info("torch intra-op threads: %d (%s; TowerTrainer(threads=N) or --threads N to choose)",
                 current, why)
    return current


def trainable_parameters(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """(names, params) of the parameters that require grad, in registration order, shared ones once."""
    names, params, seen = [], [], set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            params.append(p)
    return names, params


def model_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, shape, dtype, trainable) of every parameter and buffer: what a checkpoint must match."""
    sig = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))
           for n, p in model.named_parameters()]
    sig += [(n, tuple(b.shape), str(b.dtype).replace("torch.", ""), False)
            for n, b in model.named_buffers()]
    return sig


def build_towers(model: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Tower 0 is `model` moved to devices[0]; the others are deep copies of it, so every replica starts
    from identical weights, buffers and frozen parameters."""
    towers = [model.to(devices[0])]
    for dev in devices[1:]:
        towers.append(copy.deepcopy(towers[0]).to(dev))
    return towers


def split_sizes(n: int, towers: int) -> list[int]:
    """As even as possible; the first n % towers towers get one sample more."""
    base, rem = divmod(n, towers)
    return [base + (1 if t < rem else 0) for t in range(towers)]


def unpack_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(inputs, target) from a batch given as a sequence (x..., y) of tensors sharing dim 0."""
    if isinstance(batch, dict):
        raise TypeError("batch: expected a tuple/list (inputs..., target) of tensors, got a dict")
    if isinstance(batch, torch.Tensor) or not isinstance(batch, (list, tuple)) or len(batch) < 2:
        length = f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""
        raise TypeError("batch: expected a tuple/list (inputs..., target) of at least two tensors, got "
                        f"{type(batch).__name__}{length}")
    check_sample_tensors(batch, "batch")
    return tuple(batch[:-1]), batch[-1]


class TowerRunner:
    """Runs fn(tower_index) for every tower, concurrently on a thread per tower (a CUDA stream per tower is
    the caller's business), and returns the results in tower order. An exception in any tower is
    re-raised after all towers finished, naming the tower."""

    def __init__(self, n: int, concurrent: bool = True):
        self.n = n
        self._pool = (ThreadPoolExecutor(max_workers=n, thread_name_prefix="ncclavg-tower")
                      if concurrent and n > 1 else None)
        self._lock = threading.Lock()

    @property
    def concurrent(self) -> bool:
        return self._pool is not None

    def map(self, fn: Callable[[int], Any]) -> list:
        if self._pool is None:
            return [fn(t) for t in range(self.n)]
        futures = [self._pool.submit(fn, t) for t in range(self.n)]
        results, first_error = [], None
        for t, f in enumerate(futures):
            try:
                results.append(f.result())
            except BaseException as e:  # wait for the others before raising: no tower left running
                results.append(None)
                if first_error is None:
                    first_error = (t, e)
        if first_error is not None:
            t, e = first_error
            if self.n > 1 and hasattr(e, "add_note"):
                e.add_note(f"(raised in tower {t})")
            raise e
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
