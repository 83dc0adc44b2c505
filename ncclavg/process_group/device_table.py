"""The device table of the `ncclavg` torch backend: for each collective, which of its arguments decide
the device it runs on, and what the inner NCCL group is asked when they are CUDA tensors.

Note [The device table]
A group of this backend is one ProcessGroup for both devices (Note [A ProcessGroup, not a Backend] in
group.py): CPU tensors take its own path, CUDA tensors its inner ProcessGroupNCCL. Rather than each
collective asking "CUDA?" in its body, `routed` puts this table in front of the group's methods, which
are then the CPU path alone (they check that their tensors are CPU tensors, naming the argument). A call
goes to NCCL when the tensors its entry picks include a CUDA tensor: they must then all be CUDA tensors of
a process that has NCCL (else a ValueError naming the argument), and NCCL checks the rest (layout,
sizes) as it does for torch's own `nccl` backend. The NCCL side of an entry is its method for the same
call with the same arguments, or a function of (the NCCL group, the arguments) where it has no one method.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

# (the tensors that decide, the argument that names them in errors): from the call's own arguments
Picker = Callable[..., Tuple[List[Any], str]]


def _pairs(method: str) -> Callable[..., Any]:
    """NCCL's `method` on each (output, input) pair of a coalesced call, in order; the last pair's Work
    stands for the call (the earlier ones are waited for first, so it completes last)."""
    def run(nccl: Any, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        works = [getattr(nccl, method)(o, i, opts) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]
    return run


def _no_any_source(nccl: Any, tensors: List[torch.Tensor], tag: int = 0) -> Any:
    raise ValueError("tensor: receiving from any source is not supported for CUDA tensors")


def _list(x: Any) -> List[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _first_lists(x: Any) -> List[Any]:
    """The tensors of the first list in a list of lists (a rank's inputs or outputs); [] when there is none."""
    return list(x[0]) if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple)) else []


# collective -> (picker, the NCCL group's method name or a function of (nccl, *args))
TABLE: Dict[str, Tuple[Picker, Any]] = {
    "allreduce": (lambda tensors, opts=None: (_list(tensors), "tensors"), "allreduce"),
    "allreduce_coalesced": (lambda tensors, opts=None: (_list(tensors), "tensors"), "allreduce_coalesced"),
    "reduce": (lambda tensors, opts=None: (_list(tensors), "tensors"), "reduce"),
    "reduce_scatter_single": (lambda output, input, opts=None: ([output, input], "output_tensor, input_tensor"),
                              "_reduce_scatter_base"),
    "reduce_scatter_single_coalesced": (lambda outputs, inputs, opts=None: (_list(outputs) + _list(inputs),
                                                                            "outputs, inputs"),
                                        _pairs("_reduce_scatter_base")),
    "reduce_scatter": (lambda outputs, input_lists, opts=None: (_list(outputs) + _first_lists(input_lists),
                                                                "input_list"), "reduce_scatter"),
    "broadcast": (lambda tensors, opts=None: (_list(tensors), "tensors"), "broadcast"),
    "all_gather_single": (lambda output, input, opts=None: ([output, input], "output_tensor, input_tensor"),
                          "_allgather_base"),
    "all_gather_single_coalesced": (lambda outputs, inputs, opts=None: (_list(outputs) + _list(inputs),
                                                                        "outputs, inputs"),
                                    _pairs("_allgather_base")),
    "allgather": (lambda output_lists, inputs, opts=None: (_list(inputs) + _first_lists(output_lists),
                                                           "tensor_list"), "allgather"),
    "allgather_coalesced": (lambda output_lists, inputs, opts=None: (_list(inputs), "input_tensor_list"),
                            "allgather_coalesced"),
    "gather": (lambda output_lists, inputs, opts=None: (_list(inputs) + _first_lists(output_lists), "gather_list"),
               "gather"),
    "scatter": (lambda outputs, input_lists, opts=None: (_list(outputs) + _first_lists(input_lists), "scatter_list"),
                "scatter"),
    "all_to_all_single": (lambda output, input, output_splits=None, input_splits=None, opts=None:
                          ([output, input], "output, input"), "alltoall_base"),
    "alltoall": (lambda outputs, inputs, opts=None: (_list(outputs) + _list(inputs),
                                                     "output_tensor_list, input_tensor_list"), "alltoall"),
    "send": (lambda tensors, dst, tag=0: (_list(tensors), "tensor"), "send"),
    "recv": (lambda tensors, src, tag=0: (_list(tensors), "tensor"), "recv"),
    "recv_anysource": (lambda tensors, tag=0: (_list(tensors), "tensor"), _no_any_source),
}


def _has_cuda(pick: Picker, args: tuple, kwargs: dict) -> bool:
    """Does the call hand over a CUDA tensor where its entry looks? Malformed arguments answer no: the CPU
    path then says what is wrong with them."""
    try:
        tensors, _ = pick(*args, **kwargs)
    except Exception:   # noqa: BLE001 (the CPU path's checks name the argument)
        return False
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def _routed(name: str, cpu: Callable[..., Any], pick: Picker, nccl: Any) -> Callable[..., Any]:
    call = nccl if callable(nccl) else (lambda group, *a, **k: getattr(group, nccl)(*a, **k))

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._nccl is not None and _has_cuda(pick, args, kwargs):
            tensors, argname = pick(*args, **kwargs)
            self._kind(tensors, argname)   # all CUDA, or an error naming the argument
            return call(self._nccl_group(), *args, **kwargs)
        return cpu(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = cpu.__doc__
    method.__wrapped__ = cpu   # type: ignore[attr-defined]
    return method


def routed(cls: type) -> type:
    """Puts TABLE in front of the methods of the group class `cls` (a class decorator); every collective
    the table names must be a method of `cls`."""
    for name, (pick, nccl) in TABLE.items():
        cpu = cls.__dict__[name]
        method = _routed(name, cpu, pick, nccl)
        for alias, value in list(cls.__dict__.items()):   # the names torch also calls it by
            if value is cpu:
                setattr(cls, alias, method)
    return cls
