"""Communicator: the one object that averages a bucket across all towers, on three backends.

- `Communicator.local(n)`: n CPU towers in this process; the average is the core's one-pass host
  reduction (`_C.average_`: each buffer read once, fp32 accumulation, the mean written to all).
- gloo (`Communicator.from_torch_distributed()` on CPU): one tower per process through torch.distributed;
  SUM, then the 1/N applied by one fused pass (or by the caller's unpack, see `defer_scale`).
- `Communicator.nccl(devices)` / `from_torch_distributed()` on CUDA: the core's NCCL communicator
  (comm_nccl.py).

Every wait is bounded: `timeout` seconds (default NCCLAVG_TIMEOUT, else 600); a wait that runs out raises
`ncclavg.CommTimeoutError`.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import torch

from . import ops
from ._ext import _C
from .buffers import as_buffers
from .errors import CommTimeoutError

DEFAULT_TIMEOUT_S = 600.0


def default_timeout() -> float:
    """NCCLAVG_TIMEOUT in seconds when set (validated), else 600."""
    raw = os.environ.get("NCCLAVG_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"NCCLAVG_TIMEOUT: expected a number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"NCCLAVG_TIMEOUT: must be a positive finite number of seconds, got {raw!r}")
    return value


def _check_timeout(timeout: Any, argname: str = "timeout") -> float:
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{argname}: expected seconds as a number, got {type(timeout).__name__}")
    if not timeout > 0 or timeout == float("inf"):
        raise ValueError(f"{argname}: must be a positive finite number of seconds, got {timeout}")
    return float(timeout)


class Work:
    """Handle of an asynchronous collective. `wait(timeout=None)` blocks until it is complete (raising
    CommTimeoutError after `timeout` seconds, default the communicator's); `done()` polls.
    `divisor` is the division still to apply when the op was issued with defer_scale=True (1 otherwise);
    `elapsed` the seconds from issue to completion once known."""

    divisor: float = 1.0
    elapsed: Optional[float] = None

    def wait(self, timeout: Optional[float] = None) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError


class _CompletedWork(Work):
    def __init__(self, divisor: float = 1.0):
        self.divisor = divisor
        self.elapsed = 0.0

    def wait(self, timeout: Optional[float] = None) -> None:
        return None

    def done(self) -> bool:
        return True


class _FutureWork(Work):
    """A job running on the communicator's worker thread."""

    def __init__(self, future: Future, default_timeout_s: float, what: str, divisor: float = 1.0):
        self._future = future
        self._timeout = default_timeout_s
        self._what = what
        self.divisor = divisor

    def wait(self, timeout: Optional[float] = None) -> None:
        t = _check_timeout(timeout) if timeout is not None else self._timeout
        try:
            self.elapsed = self._future.result(timeout=t)
        except FutureTimeout:
            raise CommTimeoutError(f"{self._what} did not complete within {t:g} s") from None

    def done(self) -> bool:
        return self._future.done()


class _DistWork(Work):
    """A torch.distributed async op, plus the in-place scale to run once it has completed."""

    def __init__(self, work: Any, default_timeout_s: float, what: str, finalize: Optional[Callable] = None,
                 divisor: float = 1.0):
        self._work = work
        self._timeout = default_timeout_s
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
            t = _check_timeout(timeout) if timeout is not None else self._timeout
            _wait_dist(self._work, t, self._what)
            if self._finalize is not None:
                self._finalize()
            self.elapsed = time.perf_counter() - self._t0
            self._finished = True

    def done(self) -> bool:
        return self._finished or bool(self._work.is_completed())


def _wait_dist(work: Any, timeout: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise CommTimeoutError(f"{what} did not complete within {timeout:g} s: {e}") from None
        raise


class Communicator:
    """Averages one tensor per local tower across every tower (all processes).

    Attributes: backend ("local" | "gloo" | "nccl"), size (towers in the average, all processes),
    local_size (towers this process feeds), rank / world_size (process rank and count), devices (local
    towers' devices), timeout (seconds). Build with `Communicator.local(n)`, `Communicator.nccl(devices)`
    or `Communicator.from_torch_distributed()`."""

    backend: str
    size: int
    local_size: int
    rank: int
    world_size: int
    devices: list
    timeout: float

    def __init__(self, *args: Any, **kwargs: Any):
        if type(self) is Communicator:
            raise TypeError("Communicator: use Communicator.local(n), Communicator.nccl(devices) or "
                            "Communicator.from_torch_distributed()")
        self._closed = False

    # ------------------------------------------------------------------ constructors
    @classmethod
    def local(cls, n: int, timeout: Optional[float] = None) -> "Communicator":
        """`n` CPU towers in this process."""
        return LocalCommunicator(n, timeout)

    @classmethod
    def nccl(cls, devices: Sequence[Any], timeout: Optional[float] = None, predivide: bool = False) -> "Communicator":
        """One process over several CUDA devices (ncclCommInitAll)."""
        from .comm_nccl import NcclCommunicator

        return NcclCommunicator.init_all(devices, _check_timeout(timeout), predivide)

    @classmethod
    def from_torch_distributed(cls, group: Any = None, device: Any = None, timeout: Optional[float] = None,
                               predivide: bool = False) -> "Communicator":
        """One tower per process under torchrun (or after init_process_group): gloo for a CPU `device`,
        NCCL (the core's, rank 0's unique id through the default store) for a CUDA one. `device` defaults
        to cuda:LOCAL_RANK when CUDA is usable and ncclavg has CUDA support, else cpu. When
        torch.distributed is not initialized yet but the torchrun variables are set, it is initialized
        here (backend gloo: it carries the store and small control messages)."""
        import torch.distributed as dist

        t = _check_timeout(timeout)
        if not dist.is_available():
            raise RuntimeError("from_torch_distributed: this torch build has no torch.distributed")
        if not dist.is_initialized():
            if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=t))
            else:
                raise RuntimeError("from_torch_distributed: torch.distributed is not initialized; call "
                                   "torch.distributed.init_process_group(...) first or run under torchrun")
        dev = _default_process_device() if device is None else torch.device(device)
        if dev.type == "cpu":
            backend = str(dist.get_backend(group)).lower()
            if "gloo" not in backend and "mpi" not in backend:
                raise ValueError(f"device: cpu towers need a process group that runs CPU tensors, but this group's "
                                 f"backend is {backend!r}; pass group=torch.distributed.new_group(backend='gloo')")
            return GlooCommunicator(group, t, predivide)
        if dev.type == "cuda":
            from .comm_nccl import NcclCommunicator

            return NcclCommunicator.init_rank(group, dev, t, predivide)
        raise ValueError(f"device: {dev} is not supported; use a cpu or cuda device")

    # ------------------------------------------------------------------ collectives
    def all_reduce_avg(self, tensors: Sequence[torch.Tensor]) -> None:
        """In place: every tensor (one per local tower) becomes the mean over all towers."""
        self.all_reduce_avg_async(tensors).wait()

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False) -> Work:
        """Starts the average; the returned Work's wait() completes it. defer_scale=True leaves the SUM
        divided by all but `work.divisor` (the caller fuses that division into its unpack)."""
        raise NotImplementedError

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """inputs[t]: a full buffer per local tower (numel divisible by size); outputs[t]: the mean over all
        towers of shard (global tower index) of it, numel/size elements."""
        raise NotImplementedError

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Inverse of reduce_scatter_avg: outputs[t] (size * n elements) = every tower's input, in
        global tower order."""
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> list:
        """One picklable object per process, in rank order."""
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Communicator(backend={self.backend!r}, size={self.size}, local_size={self.local_size}, "
                f"rank={self.rank}, world_size={self.world_size}, devices={self.devices}, timeout={self.timeout:g})")

    # ------------------------------------------------------------------ argument checks
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")

    def _check_group(self, tensors: Any, argname: str, numel: Optional[int] = None) -> list:
        """One tensor per local tower, same numel/dtype, each on its tower's device, no shared memory."""
        self._check_open()
        if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__len__"):
            raise TypeError(f"{argname}: expected a list with one tensor per local tower, got {type(tensors).__name__}")
        tensors = list(tensors)
        if len(tensors) != self.local_size:
            raise ValueError(f"{argname}: got {len(tensors)} tensors but this {self.backend} communicator has "
                             f"local_size {self.local_size} (one tensor per local tower)")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{argname}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.device != torch.device(self.devices[i]):
                raise ValueError(f"{argname}[{i}]: is on {t.device} but local tower {i} of this communicator is "
                                 f"on {self.devices[i]}")
            if t.dtype != tensors[0].dtype:
                raise TypeError(f"{argname}[{i}]: dtype {t.dtype} differs from {argname}[0] dtype {tensors[0].dtype}")
            want = tensors[0].numel() if numel is None else numel
            if t.numel() != want:
                raise ValueError(f"{argname}[{i}]: has {t.numel()} elements, expected {want}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i, str(t.device))
                       for i, t in enumerate(tensors) if t.numel() > 0)
        for a, b in zip(spans, spans[1:]):
            if a[3] == b[3] and a[1] > b[0]:
                raise ValueError(f"{argname}: entries {a[2]} and {b[2]} share memory (the same tensor passed "
                                 "twice, or overlapping views)")
        return tensors

    def _check_scatter_args(self, inputs: Any, outputs: Any) -> tuple:
        inputs = self._check_group(inputs, "inputs")
        n = inputs[0].numel()
        if n % self.size:
            raise ValueError(f"inputs: {n} elements is not divisible by the communicator size {self.size}")
        outputs = self._check_group(outputs, "outputs", numel=n // self.size)
        if outputs[0].dtype != inputs[0].dtype:
            raise TypeError(f"outputs: dtype {outputs[0].dtype} differs from inputs dtype {inputs[0].dtype}")
        return inputs, outputs

    def _check_gather_args(self, inputs: Any, outputs: Any) -> tuple:
        inputs = self._check_group(inputs, "inputs")
        outputs = self._check_group(outputs, "outputs", numel=inputs[0].numel() * self.size)
        if outputs[0].dtype != inputs[0].dtype:
            raise TypeError(f"outputs: dtype {outputs[0].dtype} differs from inputs dtype {inputs[0].dtype}")
        return inputs, outputs


def _default_process_device() -> torch.device:
    from ._ext import cuda_built

    if torch.cuda.is_available() and cuda_built():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


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
        self.timeout = _check_timeout(timeout)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._executor_lock = threading.Lock()

    def _submit(self, fn: Callable) -> Future:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclavg-local")
            return self._executor.submit(fn)

    def all_reduce_avg(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = self._check_group(tensors, "tensors")
        if self.size > 1:
            _C.average_(as_buffers(tensors, "tensors"), 0)

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False) -> Work:
        tensors = self._check_group(tensors, "tensors")
        if self.size == 1:
            return _CompletedWork()
        bufs = as_buffers(tensors, "tensors")

        def job() -> float:
            t0 = time.perf_counter()
            _C.average_(bufs, 0)
            del keep_alive[:]  # the Buffers hold raw pointers only: the tensors live until the job ran
            return time.perf_counter() - t0

        keep_alive = list(tensors)
        fut = self._submit(job)
        return _FutureWork(fut, self.timeout, f"local all_reduce_avg of {len(tensors)} x {tensors[0].numel()}")

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        inputs, outputs = self._check_scatter_args(inputs, outputs)
        shard = outputs[0].numel()
        for t, out in enumerate(outputs):
            # fp32 accumulation in tower order, one division, one rounding: the arithmetic of _C.average_.
            acc = inputs[0].reshape(-1)[t * shard:(t + 1) * shard].to(torch.float32, copy=True)
            for k in range(1, self.size):
                acc += inputs[k].reshape(-1)[t * shard:(t + 1) * shard]
            out.view(-1).copy_(acc.div_(self.size))

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        inputs, outputs = self._check_gather_args(inputs, outputs)
        flat = [x.reshape(-1) for x in inputs]
        for out in outputs:
            torch.cat(flat, out=out.view(-1))

    def allgather_object(self, obj: Any) -> list:
        self._check_open()
        return [obj]

    def close(self) -> None:
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        super().close()


class GlooCommunicator(Communicator):
    """One CPU tower per process through torch.distributed (any backend that runs CPU tensors; gloo)."""

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

    def _scale(self, t: torch.Tensor) -> None:
        if self.size > 1:
            flat = t.view(-1)
            ops.unpack_(flat, [flat], [0], divisor=self.size)   # in place, one fused pass

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False) -> Work:
        (t,) = self._check_group(tensors, "tensors")
        as_buffers([t], "tensors")  # dtype / contiguity in the user's terms
        if self.predivide:  # divide before the SUM: no fp16 overflow of the sum
            self._scale(t)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group, async_op=True)
        what = f"gloo all_reduce_avg of {t.numel()} x {t.dtype} (rank {self.rank} of {self.size})"
        if self.predivide or self.size == 1:
            return _DistWork(work, self.timeout, what)
        if defer_scale:
            return _DistWork(work, self.timeout, what, divisor=float(self.size))
        return _DistWork(work, self.timeout, what, finalize=lambda: self._scale(t))

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        (inp,), (out,) = self._check_scatter_args(inputs, outputs)
        work = self._reduce_scatter(out.view(-1), inp.reshape(-1), op=self._dist.ReduceOp.SUM, group=self.group,
                                    async_op=True)
        _wait_dist(work, self.timeout, f"gloo reduce_scatter_avg (rank {self.rank})")
        self._scale(out)

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        (inp,), (out,) = self._check_gather_args(inputs, outputs)
        work = self._all_gather(out.view(-1), inp.reshape(-1), group=self.group, async_op=True)
        _wait_dist(work, self.timeout, f"gloo all_gather (rank {self.rank})")

    def allgather_object(self, obj: Any) -> list:
        self._check_open()
        out: list = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out
