"""Communicator: the one object that averages a bucket across all towers, on three backends.

- `Communicator.local(n)`: n CPU towers in this process; the average is the core's one-pass host
  reduction (`_C.average_`: each buffer read once, fp32 accumulation, the mean written to all).
- gloo (`Communicator.from_torch_distributed()` on CPU): one tower per process through torch.distributed;
  SUM, then the 1/N applied by one fused pass (or by the caller's unpack, see `defer_scale`).
- `Communicator.nccl(devices)` / `from_torch_distributed()` on CUDA: the core's NCCL communicator
  (comm_nccl.py).

Every wait is bounded: `timeout` seconds (default NCCLAVG_TIMEOUT, else 600); a wait that runs out raises
`ncclavg.CommTimeoutError` naming the operation, its tag (e.g. "bucket 3"), the bytes and the rank. See
Note [A failed communicator stays failed]. NCCLAVG_DEBUG=1 checks that every rank runs the same
collectives in the same order (comm_debug.py, Note [Collective sequence check]).

Note [A failed communicator stays failed]
After a collective timed out or failed on one rank, the ranks no longer agree on which collective
comes next: the peers may still be inside the one this rank gave up on, or may never reach it. Any
later collective could pair up with the wrong one on the other side and hang or average unrelated
data. So the first failure is recorded (`comm.failure`) and every later call raises CommError naming
it; the NCCL core does the same after ncclCommAbort. Recovery is a new communicator (in practice, a
restart of every rank from the last checkpoint).
"""
from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import torch

from . import comm_debug, ops
from ._ext import _C
from .buffers import as_buffers
from .comm_dist import _allgather_object_bounded, _debug_allgather_dist, _issue_dist, _wait_dist
from .errors import CollectiveMismatchError, CommError, CommTimeoutError

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

    def __init__(self, comm: "Communicator", future: Future, what: str, divisor: float = 1.0):
        self._comm = comm
        self._future = future
        self._what = what
        self.divisor = divisor

    def wait(self, timeout: Optional[float] = None) -> None:
        t = _check_timeout(timeout) if timeout is not None else self._comm.timeout
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
            t = _check_timeout(timeout) if timeout is not None else self._comm.timeout
            _wait_dist(self._comm, self._work, t, self._what)
            if self._finalize is not None:
                self._finalize()
            self.elapsed = time.perf_counter() - self._t0
            self._finished = True

    def done(self) -> bool:
        return self._finished or bool(self._work.is_completed())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
        self._failure: Optional[str] = None
        self._state_lock = threading.Lock()
        # See Note [Collective sequence check] in comm_debug.py; settable after construction.
        self.debug: bool = comm_debug.debug_enabled()
        self._debug_seq = 0

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
    # Common keyword arguments: `tag` names the collective in errors (the averager passes "bucket 3");
    # `debug_key` = (step, bucket, bucket fingerprint) is compared across ranks in debug mode;
    # `timeout` (seconds) overrides the communicator's for this call.
    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        """In place: every tensor (one per local tower) becomes the mean over all towers."""
        limit = self._timeout_arg(timeout)   # before anything starts: a bad timeout must not desync ranks
        self.all_reduce_avg_async(tensors, tag=tag, debug_key=debug_key).wait(limit)

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        """Starts the average; the returned Work's wait() completes it (bounded: CommTimeoutError).
        defer_scale=True leaves the SUM divided by all but `work.divisor` (the caller fuses that division
        into its unpack)."""
        raise NotImplementedError

    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                           tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                           timeout: Optional[float] = None) -> None:
        """inputs[t]: a full buffer per local tower (numel divisible by size); outputs[t]: the mean over all
        towers of shard (global tower index) of it, numel/size elements."""
        raise NotImplementedError

    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                   tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None) -> None:
        """Inverse of reduce_scatter_avg: outputs[t] (size * n elements) = every tower's input, in
        global tower order."""
        raise NotImplementedError

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        """One picklable object per process, in rank order (bounded by `timeout`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ failure state
    @property
    def failure(self) -> Optional[str]:
        """Why this communicator became unusable (None while it is healthy). See Note [A failed
        communicator stays failed]."""
        return self._failure

    def abort(self, reason: str = "abort() was called") -> None:
        """Marks the communicator unusable (NCCL: ncclCommAbort), e.g. from a watchdog of the caller's."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        with self._state_lock:
            if self._failure is None:
                self._failure = reason

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
        if self._failure is not None:
            raise CommError(f"{self.backend} communicator (rank {self.rank} of {self.world_size}) is unusable: "
                            f"{self._failure}. See Note [A failed communicator stays failed]: build a new "
                            "communicator (restart the ranks from the last checkpoint)")
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")

    def _timeout_arg(self, timeout: Any) -> float:
        return self.timeout if timeout is None else _check_timeout(timeout)

    def _what(self, op: str, tensors: Sequence[torch.Tensor], tag: Optional[str]) -> str:
        """'gloo all_reduce_avg[bucket 3] of 4096 bytes (1024 x float32) on rank 1 of 3' for errors."""
        t = tensors[0]
        where = (f"rank {self.rank} of {self.world_size}" if self.world_size > 1 else
                 f"{self.local_size} local tower(s)")
        return (f"{self.backend} {op}{f'[{tag}]' if tag else ''} of {_nbytes(t)} bytes ({t.numel()} x "
                f"{str(t.dtype).replace('torch.', '')} per tower) on {where}")

    def _debug_check(self, op: str, tensor: torch.Tensor, debug_key: Any, timeout: float) -> None:
        """See Note [Collective sequence check] in comm_debug.py."""
        if not self.debug or self.world_size == 1:
            return
        if debug_key is not None:
            if isinstance(debug_key, (str, bytes)) or len(debug_key) != 3:
                raise ValueError(f"debug_key: expected (step, bucket, fingerprint), got {debug_key!r}")
        self._debug_seq += 1
        record = comm_debug.make_record(self._debug_seq, op, tensor.numel(), tensor.dtype, debug_key)
        gathered = self._debug_allgather(comm_debug.encode(record), timeout)
        rows = [comm_debug.decode(gathered[r]) for r in range(self.world_size)]
        msg = comm_debug.compare(rows, self.rank, self.backend)
        if msg is not None:
            self._fail("NCCLAVG_DEBUG found diverging ranks (" + comm_debug.describe(rows[self.rank]) + " here)")
            raise CollectiveMismatchError(msg)

    def _debug_allgather(self, record: torch.Tensor, timeout: float) -> torch.Tensor:
        """[world_size, len(record)] float32 CPU tensor: every process's record (bounded)."""
        raise NotImplementedError

    @functools.cached_property
    def _torch_devices(self) -> list:
        """torch.device of each local tower (devices never change after construction)."""
        return [torch.device(d) for d in self.devices]

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
            if t.device != self._torch_devices[i]:
                raise ValueError(f"{argname}[{i}]: is on {t.device} but local tower {i} of this communicator is "
                                 f"on {self.devices[i]}")
            if t.dtype != tensors[0].dtype:
                raise TypeError(f"{argname}[{i}]: dtype {t.dtype} differs from {argname}[0] dtype {tensors[0].dtype}")
            want = tensors[0].numel() if numel is None else numel
            if t.numel() != want:
                raise ValueError(f"{argname}[{i}]: has {t.numel()} elements, expected {want}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i, t.device)
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
        self._inflight: list = []   # (future, description) of jobs not known to be finished

    def _submit(self, fn: Callable, what: str = "a queued job") -> Future:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ncclavg-local")
            fut = self._executor.submit(fn)
            self._inflight = [(f, w) for f, w in self._inflight if not f.done()] + [(fut, what)]
            return fut

    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        tensors = self._check_group(tensors, "tensors")
        self._timeout_arg(timeout)  # validated; a host pass over memory has nothing to wait for
        if self.size > 1:
            _C.average_(as_buffers(tensors, "tensors"), 0)

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
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

    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        (t,) = self._check_group(tensors, "tensors")
        as_buffers([t], "tensors")  # dtype / contiguity in the user's terms
        what = self._what("all_reduce_avg", [t], tag)
        self._debug_check("all_reduce_avg", t, debug_key, self.timeout)
        if self.predivide:  # divide before the SUM: no fp16 overflow of the sum
            self._scale(t)
        work = _issue_dist(self, what, self._dist.all_reduce, t, op=self._dist.ReduceOp.SUM, group=self.group,
                           async_op=True)
        if self.predivide or self.size == 1:
            return _DistWork(self, work, what)
        if defer_scale:
            return _DistWork(self, work, what, divisor=float(self.size))
        return _DistWork(self, work, what, finalize=lambda: self._scale(t))

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
        self._scale(out)

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
