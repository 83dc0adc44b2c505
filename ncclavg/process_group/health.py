"""Two questions of a stock PyTorch job (ncclavg.ddp forwards here): are the replicas still identical
(check_replicas: Note [The replica check] in ncclavg/transport/replicas.py; every rank of a
torch.distributed group digests its model's parameters, and if asked its buffers, and the ranks compare
over the group's own backend, whatever it is: ncclavg, gloo, NCCL; the parts are the parameters, so a
difference names the first parameter, by its name in the module, where it is), and which rank holds the
others back (straggler_report, for a group of the ncclavg backend: Note [The straggler report] in
ncclavg/transport/stragglers.py)."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..transport import stragglers
from ..transport.replicas import Replica, check_replicas as _check


def check_replicas(model: Any, group: Any = None, *, buffers: bool = False, on_mismatch: str = "raise",
                   step: Optional[int] = None) -> Optional[str]:
    """Checks that every rank of `group` (default: the world) holds the same bytes in `model`'s parameters
    (a torch.nn.Module, DistributedDataParallel or FSDP-wrapped modules included, or a list of tensors);
    `buffers=True` checks the module's buffers too (DDP broadcasts them unless broadcast_buffers=False).
    Every rank must call it together. Returns None when they agree; otherwise raises
    ncclavg.errors.ReplicaMismatchError naming the ranks that differ and the first parameter where they
    do, on every rank (on_mismatch="warn": returns that text instead). `step`, if given, is named in it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("check_replicas: torch.distributed is not initialized (call init_process_group first)")
    names, parts = _parts(model, buffers)
    replica = Replica("model", "model", parts, names)
    what = "the replica check" + (f" at step {step}" if step is not None else "")

    def allgather(obj: Any) -> list:
        out: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return _check([replica], allgather, dist.get_rank(group), on_mismatch, what)


def _parts(model: Any, buffers: bool) -> tuple:
    """(names, tensors) of what is compared, in the module's registration order."""
    if isinstance(model, torch.nn.Module):
        named = list(model.named_parameters())
        if buffers:
            named += list(model.named_buffers())
        if not named:
            raise ValueError(f"model: {type(model).__name__} has no parameters" + (" or buffers" if buffers else ""))
        return [n for n, _ in named], [t for _, t in named]
    if isinstance(model, torch.Tensor) or not hasattr(model, "__iter__"):
        raise TypeError(f"model: expected a torch.nn.Module or a list of tensors, got {type(model).__name__}")
    tensors = list(model)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    if buffers:
        raise ValueError("buffers: needs a torch.nn.Module (a list of tensors has no buffers)")
    return [f"tensor {i}" for i in range(len(tensors))], tensors


def straggler_report(group: Any = None, *, calls: Optional[int] = None, seconds: Optional[float] = None,
                     threshold_s: float = stragglers.DEFAULT_THRESHOLD_S) -> Optional[stragglers.StragglerReport]:
    """The straggler report of `group` (default: the world), a group of the ncclavg backend: over the last
    `calls` collectives it logged (default: every one it keeps, up to 4096), or those of the last
    `seconds`. Local (no collective): it covers the ranks of this process's host, or, between hosts on
    UCX, every rank of every host. None when nothing logs the group's arrivals here (this process alone on
    its host with gloo between the hosts). A group of another backend is refused."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("straggler_report: torch.distributed is not initialized (call init_process_group first)")
    from .group import ProcessGroupNcclavg

    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupNcclavg):
        try:   # a group torch wraps: the backend object behind it
            pg = pg._get_backend(torch.device("cpu"))
        except Exception:   # noqa: BLE001 (no CPU backend in this group)
            pass
    report = getattr(pg, "straggler_report", None) if isinstance(pg, ProcessGroupNcclavg) else None
    if report is None:
        raise ValueError(f"group: not a process group of the ncclavg backend ({type(pg).__name__}); the arrival "
                         "times are the ncclavg channel's")
    return report(calls=calls, seconds=seconds, threshold_s=threshold_s)
