"""The local backend: towers of one process that share one device (`Communicator.local(n)`: CPU towers;
`Communicator.local(n, device="cuda:0")`: towers sharing one GPU). On the CPU the average is the core's
one-pass host reduction (`_C.average_`: each buffer read once, fp32 accumulation, the mean written to
all); async ops run on one worker thread, which the core's released GIL lets overlap the rest of
backward, except small ones (Note [Small averages run inline]); the worker is the communicator's runner
(transport/runner.py). On a GPU it is the core's CUDA average kernel, stream-ordered (Note [Towers
sharing one GPU]).

Note [Small averages run inline]
Handing a job to the worker thread and waiting for it costs 15-30 us (a queue, two thread wake-ups, a
future), while the core averages 2 x 64 KiB in a few microseconds. So an async average of at most
INLINE_BYTES per tower runs at once on the caller's thread (the runner's one rule: only when no job is
still queued or running, so jobs keep the order they were issued in and two calls on overlapping memory
never run at the same time): nothing to overlap is lost, and a model with many small buckets no longer
pays a hand-off per bucket.

Note [Towers sharing one GPU]
Towers on one GPU need no NCCL: `_C.average_` with a CUDA stream averages every tower's buffer of a
bucket in ONE kernel launch (each buffer read once, fp32 accumulation, the mean written to all; the
element math of the CPU path). It is enqueued at issue time on the device's CURRENT stream (of the
issuing thread: autograd's hooks see the stream the gradients were produced on), so it is ordered after
the towers' work like an NCCL collective, and nothing waits on the host. The Work holds a CUDA event
recorded right after the kernel: `wait_stream()` makes the caller's current stream wait for it (a
device-side wait, for a caller on another stream than the one that issued), `wait()` also waits on the
host, polling the event until the timeout. There are no peers, so nothing can hang but the stream
itself; a timeout or CUDA error still marks the communicator failed, as on the CPU. reduce_scatter_avg
and all_gather are torch ops on the same current stream. The kernel takes at most MAX_CUDA_TOWERS
buffers (csrc/cuda/average_kernel.cu, kMaxBuffers).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

from .._ext import _C, cuda_built
from ..errors import CommError, CommTimeoutError
from ..transport import failure as F
from ..transport import profiling
from ..transport.runner import Job
from ..transport.work import JobWork, Work
from .base import Communicator, CompletedWork, check_count, check_timeout
from .jobs import LocalAverage
from .devices import device_of, present_cuda_device

INLINE_BYTES = 64 * 1024   # per tower; See Note [Small averages run inline]
MAX_CUDA_TOWERS = 256      # kMaxBuffers of the CUDA average kernel; See Note [Towers sharing one GPU]


class _CudaEventWork(Work):
    """An average kernel enqueued on a CUDA stream; `event` was recorded right after it. See
    Note [Towers sharing one GPU]."""

    def __init__(self, comm: "LocalCommunicator", event: Any, what: Any, keep_alive: list):
        super().__init__()
        self._comm = comm
        self._event = event
        self._what = what
        self._keep_alive = keep_alive   # the buffers stay allocated until the kernel is known to be done
        self._t0 = time.perf_counter()

    def wait_stream(self) -> None:
        """Orders the current stream of the towers' device after the average, without blocking the host."""
        torch.cuda.current_stream(self._comm._device).wait_event(self._event)

    def wait(self, timeout: Optional[float] = None) -> None:
        t = check_timeout(timeout) if timeout is not None else self._comm.timeout
        deadline = time.monotonic() + t
        pause = 1e-5
        while not self._query():
            if time.monotonic() >= deadline:
                msg = F.timed_out(self._what, t, "the wait's") + " (its CUDA stream did not reach it)"
                self._comm._fail(msg)
                raise CommTimeoutError(F.unusable(msg, "communicator"))
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if self.elapsed is None:
            self.elapsed = time.perf_counter() - self._t0   # seen done on the host: an upper bound
        self._keep_alive = []
        self.wait_stream()

    def done(self) -> bool:
        return self._query()

    def _query(self) -> bool:
        try:
            return bool(self._event.query())
        except RuntimeError as e:   # a CUDA error on the stream (sticky): say which collective saw it
            msg = F.failed(self._what, f"{type(e).__name__}: {e}")
            self._comm._fail(msg)
            raise CommError(msg) from e


def _tower_device(device: Any) -> torch.device:
    """The validated device shared by the towers, with errors naming the `device` argument."""
    dev = device_of(device, "device")
    if dev.type == "cpu":
        return dev
    if not cuda_built():
        raise ValueError(f"device: {dev} needs ncclavg built with CUDA support, but this build is CPU-only "
                         "(reinstall with the CUDA toolkit present: `NCCLAVG_CUDA=1 pip install .`)")
    return present_cuda_device(dev, "device")


class LocalCommunicator(Communicator):
    """`n` towers of one process on one `device`: "cpu" (default; async ops run on one worker thread,
    the core releases the GIL, so they overlap Python work such as the rest of backward) or one GPU
    ("cuda:N", N or a torch.device; see Note [Towers sharing one GPU])."""

    backend = "local"

    def __init__(self, n: int, timeout: Optional[float] = None, *, device: Any = "cpu"):
        super().__init__()
        n = check_count(n, "n")
        dev = _tower_device(device)
        if dev.type == "cuda" and n > MAX_CUDA_TOWERS:
            raise ValueError(f"n: at most {MAX_CUDA_TOWERS} towers can share one GPU (the average kernel's "
                             f"pointer table), got {n}")
        self.timeout = check_timeout(timeout)
        self.size = self.local_size = n
        self.rank, self.world_size = 0, 1
        self._device = dev
        self._cuda = dev.type == "cuda"
        self.devices = [str(dev)] * n
        self._runner.alone = True   # no peers: a queued average still runs after a failure

    def _submit(self, fn: Callable[[], Any], what: Any = "a queued job", inline: bool = False) -> JobWork:
        """`fn()` as a job of this communicator's runner (its asynchronous host averages run there in
        order: Note [One runner] in transport/runner.py), bounded by the communicator's timeout."""
        return self._runner.submit(Job(lambda job: fn(), what, self.timeout), inline=inline)

    @profiling.ranged("all_reduce_avg")
    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        if timeout is not None:
            check_timeout(timeout)  # validated; a host pass (or a stream-ordered kernel) has nothing to wait for
        if self.size > 1:
            _C.average_(bufs, self._stream())

    def _stream(self) -> int:
        """0 on the CPU; the device's current stream (of this thread) on a GPU."""
        return int(torch.cuda.current_stream(self._device).cuda_stream) if self._cuda else 0

    @profiling.ranged("all_reduce_avg_async")
    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        if self.size == 1:
            return CompletedWork()
        if self._cuda:   # See Note [Towers sharing one GPU]
            stream = torch.cuda.current_stream(self._device)
            _C.average_(bufs, int(stream.cuda_stream))
            event = torch.cuda.Event()
            event.record(stream)
            return _CudaEventWork(self, event, self._what("all_reduce_avg", tensors, tag), list(tensors))
        # the Buffers hold raw pointers only: the job holds the tensors until it ran
        job = LocalAverage(bufs, list(tensors), self._what("all_reduce_avg", tensors, tag), self.timeout)
        small = tensors[0].numel() * tensors[0].element_size() <= INLINE_BYTES   # Note [Small averages run inline]
        return self._runner.submit(job, inline=small)

    @profiling.ranged("reduce_scatter_avg")
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
            # A 0-dim tensor on acc's device: with a Python number, CUDA's true-divide kernel multiplies
            # by the reciprocal (up to 1 ulp from _C.average_ for n = 3, 5, 6, 7); a tensor divides.
            out.view(-1).copy_(acc.div_(torch.full((), float(self.size), dtype=torch.float32, device=acc.device)))

    @profiling.ranged("all_gather")
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
        the worker thread. A job still running then raises CommTimeoutError naming it; the worker finishes
        it on its own (they are host passes over memory: they do end)."""
        limit = self._timeout_arg(timeout)
        super().close()
        if self._runner.drain(limit):
            self._runner.close(limit)
            return
        running = self._runner.running()
        msg = f"close(): {running.what if running is not None else 'a job'} was still running after {limit:g} s"
        self._fail(msg)
        raise CommTimeoutError(msg)
