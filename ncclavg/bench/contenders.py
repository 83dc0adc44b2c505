"""The contenders of `ncclavg bench`: ncclavg's all_reduce_avg and the peers doing the same work.

Every contender averages, in place, the buffers of the local towers held by a `Workload` (one size of
the sweep), except the copy reference, which moves the same bytes (each buffer read once, written once,
as the fused one-pass average does) and gives the memory-bandwidth figure of the same run.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .inputs import ExactPattern, count_wrong, fill_periodic


class Workload:
    """One size of the sweep: a flat buffer per local tower, filled with the exact pattern of the
    participant it stands for (`first` is the global participant index of local tower 0)."""

    def __init__(self, count: int, pattern: ExactPattern, devices: Sequence[torch.device], first: int):
        self.count, self.pattern, self.first = count, pattern, first
        self.tensors = [torch.empty(count, dtype=pattern.dtype, device=d) for d in devices]

    @property
    def size_bytes(self) -> int:
        return self.count * self.tensors[0].element_size()

    def fill(self) -> None:
        for j, t in enumerate(self.tensors):
            fill_periodic(t, self.pattern.inputs(self.first + j, t.device))

    def wrong_mean(self) -> int:
        """Elements of the local towers that differ from the exact mean (bit for bit)."""
        return sum(count_wrong(t, self.pattern.expected(t.device)) for t in self.tensors)


class Contender:
    """One way of doing the work. `op()` is what gets timed; `wrong()` is called once after a single
    `op()` on freshly filled inputs."""

    key = "contender"          # JSON id
    label = "contender"        # legend / table header
    reference = False          # True: a bandwidth reference, not an all-reduce

    def setup(self, w: Workload) -> None:
        self.w = w

    def op(self) -> None:
        raise NotImplementedError

    def wrong(self) -> int:
        return self.w.wrong_mean()

    def teardown(self) -> None:
        self.w = None

    def close(self) -> None:
        """End of the sweep: release communicators."""


class CommAverage(Contender):
    """ncclavg's Communicator.all_reduce_avg, whatever the backend (local / gloo / nccl)."""

    key, label = "ncclavg", "ncclavg all_reduce_avg"

    def __init__(self, comm):
        self.comm = comm

    def op(self) -> None:
        self.comm.all_reduce_avg(self.w.tensors)

    def close(self) -> None:
        self.comm.close()


class TorchStackMean(Contender):
    """The obvious torch way for towers in one process: stack, mean, copy the mean back."""

    key, label = "torch_stack_mean", "torch stack().mean() + copy_"

    def op(self) -> None:
        ts = self.w.tensors
        mean = torch.stack(ts).mean(0)
        for t in ts:
            t.copy_(mean)


class TorchAddLoop(Contender):
    """The leaner torch way: accumulate with add_ into one scratch buffer, divide, copy back. No
    n-fold stack copy, but n+2 passes over memory (and storage-dtype accumulation for 16-bit types)."""

    key, label = "torch_add_loop", "torch add_ loop + div_ + copy_"

    def setup(self, w: Workload) -> None:
        super().setup(w)
        self.acc = torch.empty_like(w.tensors[0])

    def op(self) -> None:
        ts, acc = self.w.tensors, self.acc
        if len(ts) == 1:
            acc.copy_(ts[0])
        else:
            torch.add(ts[0], ts[1], out=acc)
            for t in ts[2:]:
                acc.add_(t)
        acc.div_(len(ts))
        for t in ts:
            t.copy_(acc)

    def teardown(self) -> None:
        self.acc = None
        super().teardown()


class CopyReference(Contender):
    """Memory bandwidth of the same run: every tower buffer is copied once into a scratch buffer on its
    device, the bytes an ideal one-pass average reads and writes. Host copies go through numpy.copyto,
    i.e. libc memcpy (streaming stores on big buffers: about twice torch's copy_ on some machines, and
    a bandwidth reference must be the fastest plain copy); device copies through torch (a D2D memcpy).
    An in-place average can still beat it on CPUs where memcpy's stores must first read the
    destination's cache lines (write-allocate), so "% of copy" above 100 is possible, not an error."""

    key, label, reference = "copy", "memcpy, same bytes (bandwidth reference)", True

    def setup(self, w: Workload) -> None:
        super().setup(w)
        self.scratch: dict[torch.device, torch.Tensor] = {}
        self.last: dict[torch.device, int] = {}
        for j, t in enumerate(w.tensors):
            if t.device not in self.scratch:
                self.scratch[t.device] = torch.empty_like(t)
            self.last[t.device] = j
        self.pairs = [(self._host_view(self.scratch[t.device]), self._host_view(t)) if t.device.type == "cpu"
                      else (self.scratch[t.device], t) for t in w.tensors]

    @staticmethod
    def _host_view(t: torch.Tensor):
        """The same memory as a numpy array (16-bit types as int16: numpy has no bfloat16)."""
        return (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy()

    def op(self) -> None:
        import numpy as np

        for dst, src in self.pairs:
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src)
            else:
                dst.copy_(src)

    def wrong(self) -> int:
        """Each scratch must hold the last tower copied into it, bit for bit."""
        p = self.w.pattern
        return sum(count_wrong(self.scratch[d], p.inputs(self.w.first + j, d)) for d, j in self.last.items())

    def teardown(self) -> None:
        self.scratch, self.last, self.pairs = {}, {}, []
        super().teardown()


class TorchDistributed(Contender):
    """torch.distributed.all_reduce on the process group: ReduceOp.AVG where the backend has it (NCCL),
    else SUM followed by div_ (gloo)."""

    key = "torch_dist"

    def __init__(self, group, size: int, use_avg: bool):
        import torch.distributed as dist

        self.dist, self.group, self.size, self.use_avg = dist, group, size, use_avg
        self.label = "torch.distributed all_reduce(AVG)" if use_avg else "torch.distributed all_reduce + div_"

    def op(self) -> None:
        op = self.dist.ReduceOp.AVG if self.use_avg else self.dist.ReduceOp.SUM
        for t in self.w.tensors:
            self.dist.all_reduce(t, op=op, group=self.group)
            if not self.use_avg:
                t.div_(self.size)


class CupyNccl(Contender):
    """cupy.cuda.nccl: one grouped ncclAllReduce(ncclAvg) over the local towers, on torch's current
    streams (one communicator per local device)."""

    key, label = "cupy_nccl", "cupy.cuda.nccl allReduce(avg)"
    _NCCL_TYPES = {torch.float32: "NCCL_FLOAT32", torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16"}
    _NCCL_AVG = 4  # ncclAvg in NCCL's C ABI (ncclRedOp_t), NCCL >= 2.10

    def __init__(self, comms: list, dtype: torch.dtype):
        from cupy.cuda import nccl

        self.nccl, self.comms = nccl, comms
        name = self._NCCL_TYPES[dtype]
        if not hasattr(nccl, name):
            raise RuntimeError(f"cupy.cuda.nccl has no {name}")
        self.nccl_dtype = getattr(nccl, name)
        self.avg = getattr(nccl, "NCCL_AVG", self._NCCL_AVG)

    @classmethod
    def single_process(cls, devices: Sequence[int], dtype: torch.dtype) -> "CupyNccl":
        from cupy.cuda import nccl

        return cls(list(nccl.NcclCommunicator.initAll(list(devices))), dtype)

    @classmethod
    def one_rank(cls, device: int, world: int, rank: int, share_id: Callable[[object], object],
                 dtype: torch.dtype) -> "CupyNccl":
        """One communicator per process; `share_id` broadcasts rank 0's unique id to every rank."""
        import cupy
        from cupy.cuda import nccl

        uid = share_id(nccl.get_unique_id() if rank == 0 else None)
        with cupy.cuda.Device(device):
            return cls([nccl.NcclCommunicator(world, uid, rank)], dtype)

    def op(self) -> None:
        ts = self.w.tensors
        streams = [torch.cuda.current_stream(t.device).cuda_stream for t in ts]
        self.nccl.groupStart()
        try:
            for c, t, s in zip(self.comms, ts, streams):
                c.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self.nccl_dtype, self.avg, s)
        finally:
            self.nccl.groupEnd()

    def close(self) -> None:
        for c in self.comms:
            c.destroy()
        self.comms = []
