"""The collectives of the `ncclavg` torch backend on CUDA tensors: `NcclCollectives`, registered by the
group for the device type "cuda".

Note [Device types]
A group of this backend is one ProcessGroup for both devices (Note [A ProcessGroup, not a Backend] in
group.py). Each collective of the group is the CPU path, preceded by one question: `group._device(argname,
*tensors)` looks at the tensors that decide the call's device (the same as the NCCL call would take: a
call's inputs, and its outputs where NCCL looks at them too) and answers the implementation registered
for their device type, or None for CPU tensors (then the method goes on). The CUDA implementation is
this module's `NcclCollectives`: for each collective the inner ProcessGroupNCCL's method for the same
call with the same arguments (made on first use), or a loop of such calls where NCCL has no one method.
A call whose tensors are CUDA tensors must have only CUDA tensors there, in a process that has NCCL
(else a ValueError naming the argument); NCCL checks the rest (layout, sizes) as it does for torch's own
`nccl` backend. A process without CUDA or NCCL has nothing registered: every call takes the CPU path,
whose checks refuse a CUDA tensor naming the argument.
"""
from __future__ import annotations

import weakref
from typing import Any, List

import torch


def _listed(x: Any) -> List[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def first_list(x: Any) -> List[Any]:
    """The tensors of the first list in a list of lists (a rank's inputs or outputs); [] when there is none
    (a malformed argument: the CPU path's checks name it)."""
    return list(x[0]) if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple)) else []


def flat(parts: tuple) -> List[Any]:
    """The tensors of a call's deciding arguments: each a tensor or a list of them."""
    out: List[Any] = []
    for part in parts:
        out.extend(_listed(part))
    return out


def has_cuda(parts: tuple) -> bool:
    """Does any of the call's deciding arguments hold a CUDA tensor? Anything that is not a tensor answers
    no: the CPU path then says what is wrong with it."""
    for part in parts:
        for t in _listed(part):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return True
    return False


def _given(opts: Any) -> tuple:
    """The options argument as the caller gave it: none when None (NCCL's methods then use their defaults)."""
    return () if opts is None else (opts,)


class NcclCollectives:
    """The group's collectives on CUDA tensors: its inner ProcessGroupNCCL's (Note [Device types]). Each
    method takes the group method's own arguments and returns NCCL's Work."""

    def __init__(self, group: Any):
        self._group = weakref.ref(group)   # the group holds this object: a strong reference would be a cycle

    def _nccl(self) -> Any:
        return self._group()._nccl_group()

    def _pairs(self, method: str, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> Any:
        """NCCL's `method` on each (output, input) pair of a coalesced call, in order; the last pair's Work
        stands for the call (the earlier ones are waited for first, so it completes last)."""
        nccl = self._nccl()
        works = [getattr(nccl, method)(o, i, *_given(opts)) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    # ------------------------------------------------------------------ the all-reduce family
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().allreduce(tensors, *_given(opts))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().allreduce_coalesced(tensors, *_given(opts))

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().reduce(tensors, *_given(opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._nccl()._reduce_scatter_base(output, input, *_given(opts))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._pairs("_reduce_scatter_base", outputs, inputs, opts)

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        return self._nccl().reduce_scatter(outputs, input_lists, *_given(opts))

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().broadcast(tensors, *_given(opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._nccl()._allgather_base(output, input, *_given(opts))

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> Any:
        return self._pairs("_allgather_base", outputs, inputs, opts)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().allgather(output_lists, inputs, *_given(opts))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> Any:
        return self._nccl().allgather_coalesced(output_lists, inputs, *_given(opts))

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().gather(output_lists, inputs, *_given(opts))

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        return self._nccl().scatter(outputs, input_lists, *_given(opts))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                          input_splits: List[int], opts: Any = None) -> Any:
        return self._nccl().alltoall_base(output, input, output_splits, input_splits, *_given(opts))

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        return self._nccl().alltoall(outputs, inputs, *_given(opts))

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._nccl().send(tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._nccl().recv(tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        raise ValueError("tensor: receiving from any source is not supported for CUDA tensors")
