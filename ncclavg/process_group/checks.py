"""The checks of the `ncclavg` torch backend's calls (group.py), on the caller's thread before anything is
queued: a bad call raises ValueError / TypeError naming the argument and leaves the group as it was (as
gloo's does); the call's description for errors; the device type its tensors decide (Note [Device types]
in devices.py); the per-call timeout."""
from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch
from torch._C._distributed_c10d import AllreduceOptions

from ..transport import calls
from ..transport.calls import Call
from ..transport.failure import LazyText
from ..transport.reductions import R, red_kind
from .devices import flat, has_cuda

UNSET_TIMEOUT = AllreduceOptions().timeout   # what torch's options hold when the caller gave none
_INTEGER_OK = (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT, R.BAND, R.BOR, R.BXOR)
_FLOAT_OK = (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT, R.PREMUL_SUM)


def call_limit(opts: Any, default: float) -> float:
    """The timeout of one call: torch's per-call option (opts.timeout, a timedelta; unset is torch's
    default value, or not positive), else the group's `default`. The one place it is read in Python (the
    native all_reduce reads it the same way: GroupAllreduce::call)."""
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, datetime.timedelta) and timeout != UNSET_TIMEOUT and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return default


def one_tensor(tensors: Any, argname: str) -> torch.Tensor:
    """The one tensor of a call that takes a list of exactly one (else a ValueError naming `argname`)."""
    if isinstance(tensors, torch.Tensor) or len(tensors) != 1:
        raise ValueError(f"{argname}: expected a list of one tensor")
    return tensors[0]


def list_call(collective: str, tensors: List[torch.Tensor], op: Any = None) -> Call:
    """The call of a collective over a list of tensors: their dtype and total count (or their bytes,
    when the dtypes differ)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return calls.make(collective, dtypes.pop(), op, count=sum(t.numel() for t in tensors))
    return calls.make(collective, torch.uint8, op, count=sum(t.numel() * t.element_size() for t in tensors))


def describe(count: int, dtype: Optional[torch.dtype]) -> str:
    return "no tensors" if dtype is None else f"{count} x {str(dtype).replace('torch.', '')}"


class CallChecks:
    """The group's argument checks and descriptions (a base of ProcessGroupNcclavg: it reads the group's
    `_rank`, `_size`, `_name`, `transport`, `_nccl` and `_devices`)."""

    # Every argument is checked here, on the caller's thread, before anything is queued: a bad call
    # raises ValueError / TypeError naming the argument and leaves the group as it was (as gloo's does).
    def _what(self, op: str, tensors: List[torch.Tensor]) -> LazyText:
        """'ncclavg allreduce of 3 x float32 (group 0, rank 1 of 2, shm)', written out only when an error
        needs it (the facts are taken now: a message must not keep a tensor alive)."""
        if not tensors:
            return LazyText(self._what_text, op, 0, None)
        count = tensors[0].numel() if len(tensors) == 1 else sum(x.numel() for x in tensors)
        return LazyText(self._what_text, op, count, tensors[0].dtype)

    def _what_text(self, op: str, count: int, dtype: Optional[torch.dtype]) -> str:
        return (f"ncclavg {op} of {describe(count, dtype)} (group {self._name or '?'}, rank {self._rank} of "
                f"{self._size}, {self.transport})")

    def _kind(self, tensors: List[torch.Tensor], argname: str) -> str:
        """'cpu' or 'cuda' for the tensors of one call; raises naming the argument otherwise (Note [Device
        types] in devices.py)."""
        kinds = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{argname}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            kinds.add(t.device.type)
        if len(kinds) > 1:
            raise ValueError(f"{argname}: tensors on several device types {sorted(kinds)} in one call")
        kind = kinds.pop() if kinds else "cpu"
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"{argname}: the ncclavg backend takes CPU and CUDA tensors, got {kind}")
        if kind == "cuda" and self._nccl is None:
            raise ValueError(f"{argname}: CUDA tensors need CUDA and NCCL, which this process does not have")
        return kind

    def _check_cpu(self, tensors: List[torch.Tensor], argname: str) -> None:
        """The tensors of a call on the CPU path are dense contiguous CPU tensors; raises naming the argument."""
        if self._kind(tensors, argname) != "cpu":   # CUDA tensors beside the ones _device looked at
            raise ValueError(f"{argname}: expected CPU tensors like the call's other tensors, got CUDA tensors")
        for i, t in enumerate(tensors):
            if t.layout != torch.strided:
                raise TypeError(f"{argname}[{i}]: the ncclavg backend takes dense tensors here, got {t.layout}")
            if not t.is_contiguous():
                raise ValueError(f"{argname}[{i}]: expected a contiguous tensor")

    def _root(self, root: int, argname: str = "root") -> int:
        if not isinstance(root, int) or not 0 <= root < self._size:
            raise ValueError(f"{argname}: must be a rank of the group, in [0, {self._size}), got {root}")
        return root

    def _op(self, op: Any, t: torch.Tensor) -> Any:
        kind = red_kind(op)
        ok = _FLOAT_OK if (t.is_floating_point() or t.is_complex()) else _INTEGER_OK
        if kind not in ok:
            raise ValueError(f"op: {getattr(kind, 'name', kind)} is not supported on {t.dtype} tensors by the "
                             "ncclavg backend")
        if t.is_complex() and kind not in (R.SUM, R.AVG, R.PREMUL_SUM):
            raise ValueError(f"op: {kind.name} is not defined for complex tensors")
        return op

    def _same_size(self, tensors: List[torch.Tensor], like: torch.Tensor, argname: str) -> None:
        for i, t in enumerate(tensors):
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise ValueError(f"{argname}[{i}]: expected {like.numel()} elements of {like.dtype}, got "
                                 f"{t.numel()} of {t.dtype}")

    def _device(self, argname: str, *tensors: Any) -> Any:
        """Note [Device types]: the collectives registered for the device type of a call's deciding
        `tensors` (each a tensor or a list of them) when they are CUDA tensors, all of them (else a
        ValueError naming `argname`); None for CPU tensors: the method's own path follows."""
        if self._nccl is None or not has_cuda(tensors):
            return None
        self._kind(flat(tensors), argname)   # all CUDA, or an error naming the argument
        return self._devices["cuda"]

    def _check_scatter_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if input.dtype != output.dtype:
            raise TypeError(f"input_tensor: expected {output.dtype} like output_tensor, got {input.dtype}")
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"input_tensor: expected {output.numel() * self._size} elements (world size "
                             f"{self._size} x output_tensor's {output.numel()}), got {input.numel()}")

    def _check_gather_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if input.dtype != output.dtype:
            raise TypeError(f"output_tensor: expected {input.dtype} like input_tensor, got {output.dtype}")
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"output_tensor: expected {input.numel() * self._size} elements (world size "
                             f"{self._size} x input_tensor's {input.numel()}), got {output.numel()}")
