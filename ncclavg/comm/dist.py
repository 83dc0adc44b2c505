"""The gloo backend (one CPU tower per process through torch.distributed) and the torch.distributed
plumbing every multi-process backend uses, with every wait bounded: issue and wait for async works
(failures recorded on the communicator, see Note [A failed communicator stays failed] in base.py), an
allgather_object that cannot outwait the communicator's timeout, and the debug-mode record exchange.

Note [Gloo teardown]
With torch 2.13 a gloo rank whose run has finished sometimes dies on its way out: it prints its
results, then "terminate called without an active exception" (SIGABRT, exit -6), and torchrun or a
test harness reports the whole run as failed. Measured on a loaded 2-core AMD EPYC with plain torch DDP
over gloo: 2 runs in 30 with destroy_process_group() at the end, 1 in 30 with a barrier before it, 0 in
30 without it; here (Intel Xeon, 2 cores) ncclavg's gloo test job, ending with a barrier and no
destroy, still aborted once in about 15 runs while other test processes loaded the machine. It happens
in torch's teardown (the process group, its gloo threads, C++ destructors at exit), after every
collective has completed, so ncclavg keeps out of teardown altogether:
- it never destroys a gloo group: `Communicator.close()` leaves the process group alone, whether
  from_torch_distributed() created it (from torchrun's environment) or the user did;
- its own multi-process programs (`ncclavg bench` ranks, examples/torchrun_gloo.py, the test workers)
  end with `end_process(code)` once every rank is past its last collective: it flushes stdout, stderr
  and logging and leaves with os._exit, so no destructor runs; the kernel closes the sockets.
Groups with an NCCL backend are still destroyed: NCCL communicators must be torn down.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..buffers import as_buffer
from .._ext import _C
from ..errors import CommError, CommTimeoutError
from .base import Communicator, Work, check_timeout


def end_process(code: int = 0) -> None:
    """Ends this process now with exit status `code`, after flushing stdout, stderr and logging, without
    running Python's or C++'s teardown. For a rank whose collectives are all complete (after a
    barrier): see Note [Gloo teardown]. Never returns."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed or replaced streams
            pass
    logging.shutdown()
    os._exit(int(code))


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _wait_dist(comm: Any, work: Any, timeout: float, what: str) -> None:
    """Bounded wait for a torch.distributed work; every failure marks `comm` unusable. See Note [A failed
    communicator stays failed]."""
    t0 = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if _is_timeout(e):
            elapsed = time.monotonic() - t0
            # the process group's own (shorter) timeout may fire first: say which one did
            msg = (f"{what} did not complete within {timeout:g} s" if elapsed >= 0.9 * timeout else
                   f"{what} timed out after {elapsed:.1f} s in torch.distributed (the process group's own "
                   f"timeout, shorter than this communicator's {timeout:g} s)")
            comm._fail(msg)
            raise CommTimeoutError(f"{msg}; the communicator is unusable now (torch.distributed: {e})") from None
        msg = f"{what} failed: {e}"
        comm._fail(msg)
        raise CommError(msg + "; the communicator is unusable now (did a peer process die?)") from e


def _issue_dist(comm: Any, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Starts a torch.distributed async op; a failure to even start it (a peer's connection already
    closed) marks `comm` unusable like a failed wait."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        msg = f"{what} could not start: {e}"
        comm._fail(msg)
        raise (CommTimeoutError if _is_timeout(e) else CommError)(msg + "; the communicator is unusable now") from e


def _allgather_object_bounded(comm: Any, dist: Any, group: Any, obj: Any, timeout: float,
                              device: Any = "cpu") -> list:
    """torch.distributed.all_gather_object, but every wait bounded by `timeout` (the torch version waits
    as long as the process group's own timeout, 30 min by default): sizes first, then the padded bytes."""
    what = f"{comm.backend} allgather_object (rank {comm.rank} of {comm.world_size})"
    payload = pickle.dumps(obj)
    world = comm.world_size
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, sizes, size, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (sizes)")
    counts = [int(x.item()) for x in sizes]
    longest = max(counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, outs, mine, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (payload)")
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, counts)]


def _debug_allgather_dist(comm: Any, dist: Any, group: Any, record: torch.Tensor, timeout: float,
                          device: Any = "cpu") -> torch.Tensor:
    what = f"{comm.backend} debug sequence check (rank {comm.rank} of {comm.world_size})"
    rows = [torch.empty_like(record, device=device) for _ in range(comm.world_size)]
    work = _issue_dist(comm, what, dist.all_gather, rows, record.to(device), group=group, async_op=True)
    _wait_dist(comm, work, timeout, what)
    return torch.stack([r.cpu() for r in rows])


class _DistWork(Work):
    """A torch.distributed async op, plus the in-place scale to run once it has completed."""

    def __init__(self, comm: "Communicator", work: Any, what: str, finalize: Optional[Callable] = None,
                 divisor: float = 1.0):
        self._comm = comm
        self._work = work
        self._what = what
        self._finalize = finalize
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._finished = False
        self.divisor = divisor

    def wait(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._finished:
                return
            t = check_timeout(timeout) if timeout is not None else self._comm.timeout
            _wait_dist(self._comm, self._work, t, self._what)
            if self._finalize is not None:
                self._finalize()
            self.elapsed = time.perf_counter() - self._t0
            self._finished = True

    def done(self) -> bool:
        return self._finished or bool(self._work.is_completed())


class GlooCommunicator(Communicator):
    """One CPU tower per process through torch.distributed (any backend that runs CPU tensors; gloo).
    close() never destroys the process group: see Note [Gloo teardown]."""

    backend = "gloo"

    def __init__(self, group: Any, timeout: float, predivide: bool = False):
        import torch.distributed as dist

        super().__init__()
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = self.size = dist.get_world_size(group)
        self.local_size = 1
        self.devices = ["cpu"]
        self.timeout = timeout
        self.predivide = bool(predivide)
        # reduce_scatter_tensor / all_gather_into_tensor were renamed in recent torch versions.
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def _scale_buffer(self, buf: Any) -> None:
        """In place x /= size through a checked Buffer, one fused pass (all_reduce_avg passes the cached
        one: no checks per call)."""
        if self.size > 1:
            _C.unpack_(buf, [buf], [0], 1.0, float(self.size), 0)

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        (t,), (buf,) = self._checked_buffers(tensors, "tensors")  # dtype / contiguity in the user's terms
        what = self._what("all_reduce_avg", [t], tag)
        self._debug_check("all_reduce_avg", t, debug_key, self.timeout)
        if self.predivide:  # divide before the SUM: no fp16 overflow of the sum
            self._scale_buffer(buf)
        work = _issue_dist(self, what, self._dist.all_reduce, t, op=self._dist.ReduceOp.SUM, group=self.group,
                           async_op=True)
        if self.predivide or self.size == 1:
            return _DistWork(self, work, what)
        if defer_scale:
            return _DistWork(self, work, what, divisor=float(self.size))

        def finalize(owner: torch.Tensor = t) -> None:  # holds the tensor: the Buffer is only its pointer
            self._scale_buffer(buf)

        return _DistWork(self, work, what, finalize=finalize)

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                           tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                           timeout: Optional[float] = None) -> None:
        (inp,), (out,) = self._check_scatter_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        what = self._what("reduce_scatter_avg", [inp], tag)
        self._debug_check("reduce_scatter_avg", inp, debug_key, limit)
        work = _issue_dist(self, what, self._reduce_scatter, out.view(-1), inp.reshape(-1),
                           op=self._dist.ReduceOp.SUM, group=self.group, async_op=True)
        _wait_dist(self, work, limit, what)
        self._scale_buffer(as_buffer(out.view(-1), "outputs[0]"))

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                   tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None) -> None:
        (inp,), (out,) = self._check_gather_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        what = self._what("all_gather", [inp], tag)
        self._debug_check("all_gather", inp, debug_key, limit)
        work = _issue_dist(self, what, self._all_gather, out.view(-1), inp.reshape(-1), group=self.group,
                           async_op=True)
        _wait_dist(self, work, limit, what)

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        self._check_open()
        return _allgather_object_bounded(self, self._dist, self.group, obj, self._timeout_arg(timeout))

    def _debug_allgather(self, record: torch.Tensor, timeout: float) -> torch.Tensor:
        return _debug_allgather_dist(self, self._dist, self.group, record, timeout)
