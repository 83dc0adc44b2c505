"""ncclavg for stock DistributedDataParallel: a comm hook that averages DDP's gradient buckets through
ncclavg's transports (the shared-memory channel between processes of one host, gloo between hosts, NCCL
on GPUs), whatever backend the DDP model was built over, with an optional bfloat16 / float16 wire that
still adds in float32.

    ddp = DistributedDataParallel(model)          # over "ncclavg" or "gloo" (or NCCL on GPUs)
    ncclavg.ddp.register(ddp, wire="bfloat16")    # on every rank, before the first backward

`register(model, *, wire=None, predivide=None, timeout=None)` returns the hook's `HookState`;
`allreduce_hook(state, bucket)` is the hook itself, for `model.register_comm_hook(HookState(...), hook)`.
`check_replicas(model, group=None, *, buffers=False, on_mismatch="raise")`, called on every rank now and
then, checks that the replicas still hold the same bytes; `straggler_report(group=None)` tells which rank
held the others back in the recent collectives of an ncclavg group (ncclavg/process_group/health.py).
The implementation lives in ncclavg/process_group/ddp_hook.py (Note [The DDP hook's engine], Note [Low-precision
wire with fp32 accumulation]); this module only forwards to it, so that importing it stays light.
"""
from __future__ import annotations

from typing import Any, Optional


def register(model: Any, *, wire: Any = None, predivide: Optional[bool] = None, timeout: Optional[float] = None) -> Any:
    """See ncclavg/process_group/ddp_hook.py: register()."""
    from .process_group.ddp_hook import register as _register

    return _register(model, wire=wire, predivide=predivide, timeout=timeout)


def allreduce_hook(state, bucket):  # no annotations: DDP checks a hook's (and this module's are strings)
    """The DDP comm hook (state: a HookState)."""
    from .process_group.ddp_hook import allreduce_hook as _hook

    return _hook(state, bucket)


def check_replicas(model: Any, group: Any = None, *, buffers: bool = False, on_mismatch: str = "raise",
                   step: Optional[int] = None) -> Optional[str]:
    """See ncclavg/process_group/health.py: check_replicas()."""
    from .process_group.health import check_replicas as _check

    return _check(model, group, buffers=buffers, on_mismatch=on_mismatch, step=step)


def straggler_report(group: Any = None, *, calls: Optional[int] = None, seconds: Optional[float] = None,
                     threshold_s: float = 5e-3) -> Any:   # stragglers.DEFAULT_THRESHOLD_S
    """See ncclavg/process_group/health.py: straggler_report()."""
    from .process_group.health import straggler_report as _report

    return _report(group, calls=calls, seconds=seconds, threshold_s=threshold_s)


def __getattr__(name: str) -> Any:
    if name == "HookState":
        from .process_group.ddp_hook import HookState

        return HookState
    raise AttributeError(f"module 'ncclavg.ddp' has no attribute {name!r}")


__all__ = ["register", "allreduce_hook", "check_replicas", "straggler_report"]   # and HookState, loaded on first access (__getattr__)
