"""FSDP2's all-gathers and reduce-scatters through ncclavg for FSDP2 models built over another backend
(gloo): `use_ncclavg(model)` sets FSDP2's custom comms (FSDPModule.set_custom_all_gather /
set_custom_reduce_scatter) on every FSDP module of `model`.

FSDP2 on a DeviceMesh of an `ncclavg` group needs none of this: its collectives already go through the
backend. Over gloo, the custom comms send FSDP2's `all_gather_single` and `reduce_scatter_single` (AVG or
SUM, as FSDP2 asks) to an `ncclavg` group with the same members as the FSDP2 group, made once per group
(a collective over its members, like the hook's: Note [The DDP hook's engine] in ddp_hook.py), so on one
host they take the shared-memory channel.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .group import NAME, ProcessGroupNcclavg

try:   # torch >= 2.6: the public FSDP2 interfaces
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:   # pragma: no cover (older torch: plain classes with the same methods)
    AllGather = ReduceScatter = object   # type: ignore[misc, assignment]


class _Engines:
    """The `ncclavg` group for each FSDP2 group (the group itself when it is one)."""

    def __init__(self) -> None:
        self._by_group: Dict[int, Any] = {}

    def __call__(self, group: Any) -> Any:
        if isinstance(group, ProcessGroupNcclavg):
            return group
        engine = self._by_group.get(id(group))
        if engine is None:
            engine = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=NAME,
                                    use_local_synchronization=True)
            self._by_group[id(group)] = engine
        return engine


class _Alloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class NcclavgAllGather(_Alloc, AllGather):
    """FSDP2's all-gather through the `ncclavg` group of the FSDP2 group."""

    def __init__(self, engines: Optional[_Engines] = None):
        self._engines = engines or _Engines()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=self._engines(group), async_op=async_op)


class NcclavgReduceScatter(_Alloc, ReduceScatter):
    """FSDP2's reduce-scatter (AVG, SUM or PREMUL_SUM) through the `ncclavg` group of the FSDP2 group."""

    def __init__(self, engines: Optional[_Engines] = None):
        self._engines = engines or _Engines()

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(output_tensor, input_tensor, op=op, group=self._engines(group), async_op=async_op)


def use_ncclavg(model: torch.nn.Module) -> int:
    """Sets the ncclavg all-gather and reduce-scatter on every FSDP2 module of `model` (after
    fully_shard, before the first forward, on every rank). Returns how many modules it set."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    engines = _Engines()
    gather, scatter = NcclavgAllGather(engines), NcclavgReduceScatter(engines)
    count = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
            count += 1
    if count == 0:
        raise ValueError("model: no FSDP2 module in it (call fully_shard first)")
    return count
