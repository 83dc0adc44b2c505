"""The local backend: CPU towers of one process (`Communicator.local(n)`). The average is the core's
one-pass host reduction (`_C.average_`: each buffer read once, fp32 accumulation, the mean written to
all); async ops run on one worker thread, which the core's released GIL lets overlap the rest of
backward, except small ones (Note [Small averages run inline]).

Note [Small averages run inline]
Handing a job to the worker thread and waiting for it costs 15-30 us (a queue, two thread wake-ups, a
future), while the core averages 2 x 64 KiB in a few microseconds. So an async average of at most
INLINE_BYTES per tower runs at once on the caller's thread and returns a completed Work: nothing to
overlap is lost, and a model with many small buckets no longer pays a hand-off per bucket. Only when no
job is still queued or running: jobs then keep the order they were issued in, so two calls on
overlapping memory can never run at the same time.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import torch

from .._ext import _C
from ..errors import CommError, CommTimeoutError
from .base import Communicator, CompletedWork, Work, check_timeout

INLINE_BYTES = 64 * 1024   # per tower; See Note [Small averages run inline]


class _FutureWork(Work):
    """A job running on the communicator's worker thread."""

    def __init__(self, comm: "Communicator", future: Future, what: str, divisor: float = 1.0):
        self._comm = comm
        self._future = future
        self._what = what
        self.divisor = divisor

    def wait(self, timeout: Optional[float] = None) -> None:
        t = check_timeout(timeout) if timeout is not None else self._comm.timeout
        try:
            self.elapsed = self._future.result(timeout=t)
        except FutureTimeout:
            msg = f"{self._what} did not complete within {t:g} s"
            self._comm._fail(msg)
            raise CommTimeoutError(msg + "; the communicator is unusable now") from None
        except Exception as e:
            msg = f"{self._what} failed: {type(e).__name__}: {e}"
            self._comm._fail(msg)
            raise CommError(msg) from e

    def done(self) -> bool:
        return self._future.done()


def _check_count(n: Any, argname: str) -> int:
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{argname}: expected an int, got {type(n).__name__}")
    n = int(n)
    if n < 1:
        raise ValueError(f"{argname}: must be >= 1, got {n}")
    return n


class LocalCommunicator(Communicator):
    """CPU towers of one process. Async ops run on one worker thread (the core releases the GIL, so
    they overlap Python work such as the rest of backward)."""

    backend = "local"

    def __init__(self, n: int, timeout: Optional[float] = None):
        super().__init__()
        n = _check_count(n, "n")
        self.size = self.local_size = n
        self.rank, self.world_size = 0, 1
        self.devices = ["cpu"] * n
        self.timeout = check_timeout(timeout)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._executor_lock = threading.Lock()
        self._inflight: list = []   # (future, description) of jobs not known to be finished

    def _idle(self) -> bool:
        """No job queued or running on the worker thread."""
        with self._executor_lock:
            self._inflight = [(f, w) for f, w in self._inflight if not f.done()]
            return not self._inflight

    def _submit(self, fn: Callable, what: str = "a queued job") -> Future:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclavg-local")
            fut = self._executor.submit(fn)
            self._inflight = [(f, w) for f, w in self._inflight if not f.done()] + [(fut, what)]
            return fut

    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        if timeout is not None:
            check_timeout(timeout)  # validated; a host pass over memory has nothing to wait for
        if self.size > 1:
            _C.average_(bufs, 0)

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        if self.size == 1:
            return CompletedWork()
        if tensors[0].numel() * tensors[0].element_size() <= INLINE_BYTES and self._idle():
            t0 = time.perf_counter()   # See Note [Small averages run inline]
            _C.average_(bufs, 0)
            work = CompletedWork()
            work.elapsed = time.perf_counter() - t0
            return work

        def job() -> float:
            t0 = time.perf_counter()
            _C.average_(bufs, 0)
            del keep_alive[:]  # the Buffers hold raw pointers only: the tensors live until the job ran
            return time.perf_counter() - t0

        keep_alive = list(tensors)
        what = self._what("all_reduce_avg", tensors, tag)
        return _FutureWork(self, self._submit(job, what), what)

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                           tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                           timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_scatter_args(inputs, outputs)
        self._timeout_arg(timeout)
        shard = outputs[0].numel()
        for t, out in enumerate(outputs):
            # fp32 accumulation in tower order, one division, one rounding: the arithmetic of _C.average_.
            acc = inputs[0].reshape(-1)[t * shard:(t + 1) * shard].to(torch.float32, copy=True)
            for k in range(1, self.size):
                acc += inputs[k].reshape(-1)[t * shard:(t + 1) * shard]
            out.view(-1).copy_(acc.div_(self.size))

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                   tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_gather_args(inputs, outputs)
        self._timeout_arg(timeout)
        flat = [x.reshape(-1) for x in inputs]
        for out in outputs:
            torch.cat(flat, out=out.view(-1))

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        self._check_open()
        self._timeout_arg(timeout)
        return [obj]

    def close(self, timeout: Optional[float] = None) -> None:
        """Waits (at most `timeout`, default the communicator's) for the jobs still queued, then stops
        the worker thread. Jobs still running then raise CommTimeoutError naming the oldest one; the
        worker finishes them on its own (they are host passes over memory: they do end)."""
        limit = self._timeout_arg(timeout)
        with self._executor_lock:
            executor, self._executor = self._executor, None
            inflight, self._inflight = self._inflight, []
        super().close()
        if executor is None:
            return
        executor.shutdown(wait=False)
        deadline = time.monotonic() + limit
        for fut, what in inflight:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                msg = f"close(): {what} was still running after {limit:g} s"
                self._fail(msg)
                raise CommTimeoutError(msg) from None
            except Exception:
                pass  # already reported to (or ignored by) whoever held the Work
