"""Communicator: the one object that averages a bucket across all towers.

This module holds what every backend shares: the public constructors, the argument checks that name
the argument, the runner whose failure state every backend keeps (transport/runner.py, under this face's
words: `FACE`) and the debug-mode sequence check. The Works it hands back are the transport's
(transport/work.py: `Work`, a job's `JobWork`, the completed `DoneWork`, also known as CompletedWork). The backends are subclasses in
local.py (CPU towers of one process), gloo.py (CPU towers of several processes through
torch.distributed; dist.py holds the bounded torch.distributed plumbing) and nccl.py (the core's NCCL
communicator); see Note [Backend table].

Every wait is bounded: `timeout` seconds (default NCCLAVG_TIMEOUT, else 600); a wait that runs out raises
`ncclavg.CommTimeoutError` naming the operation, its tag (e.g. "bucket 3"), the bytes and the rank (Note
[One deadline per call] in transport/runner.py). See Note [A failed communicator stays failed]. NCCLAVG_DEBUG=1 checks that every rank runs the same
collectives in the same order (debug.py, Note [Collective sequence check]).

Note [A failed communicator stays failed]
After a collective timed out or failed on one rank, the ranks no longer agree on which collective
comes next: the peers may still be inside the one this rank gave up on, or may never reach it. Any
later collective could pair up with the wrong one on the other side and hang or average unrelated
data. So the first failure is recorded (`comm.failure`, the communicator's runner's) and every later
call raises CommError naming it; the NCCL core does the same after ncclCommAbort. Recovery is a new communicator (in practice, a
restart of every rank from the last checkpoint).

Note [Validated buffer cache]
Checking one tensor per tower in Python (type, device, dtype, size, contiguity, no shared memory) and
wrapping each in a core Buffer costs about 3 us per tower: more than averaging 4 KiB, so small messages
were slower than torch's add_ loop. But a Buffer (pointer, element count, dtype, device) and the
verdict of every one of those checks are functions of a few facts per tensor: its data pointer, element
count, dtype, contiguity, device and negation bit. So the first call for a list of tensors runs the full
checks and stores the Buffers under a key of those facts; a later call with the same key (the same
buckets, step after step) reads the facts again (about 0.4 us per tower), finds the key and reuses the
Buffers. A tensor whose storage moved, was resized or changed dtype gives another key, so it is checked
again; memory freed and handed to a new tensor of the same size and type gives the same Buffers, which
are then right for it. The key holds no reference to a tensor, and the cache keeps the newest 256 keys.
Whether the communicator is open is still checked on every call.

Note [Backend table]
`Communicator.local(n)` / `.nccl(devices)` / `.from_torch_distributed()` build instances of subclasses
that live in other modules, and those modules import this one for the base class. Importing them from
here, even inside the constructors, would make the modules import each other. Instead the constructors
look the class up in `_BACKENDS`, which `ncclavg/comm/__init__.py` fills right after importing every
backend module. Python runs a package's `__init__` before any of its modules, so the table is complete
before any code can reach a constructor.
"""
from __future__ import annotations

import datetime
import functools
import math
import os
from typing import Any, Callable, Optional, Sequence

import torch

from .. import _ext
from ..buffers import as_buffers
from ..errors import CollectiveMismatchError, CommError, CommTimeoutError
from ..transport import failure as F
from ..transport import stragglers
from ..transport.failure import Face, LazyText
from ..transport.runner import Runner
from ..transport.work import DoneWork, Work, check_seconds
from . import debug as comm_debug
from .devices import device_list, device_of, one_kind

DEFAULT_TIMEOUT_S = 600.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")   # what torchrun sets for env://


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


def check_count(n: Any, argname: str) -> int:
    """A count of towers (>= 1), named `argname` in errors."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{argname}: expected an int, got {type(n).__name__}")
    n = int(n)
    if n < 1:
        raise ValueError(f"{argname}: must be >= 1, got {n}")
    return n


def check_timeout(timeout: Any, argname: str = "timeout") -> float:
    """A timeout argument in seconds (None: the default), else a TypeError / ValueError naming it."""
    return default_timeout() if timeout is None else check_seconds(timeout, argname)


# The public API's words (transport/failure.py): a wait that runs out gives up for good (Note [One Work for
# both faces] in transport/work.py); the ranks' calls that differ are a CollectiveMismatchError.
FACE = Face(noun="communicator", error=CommError, timeout_error=CommTimeoutError,
            mismatch_error=CollectiveMismatchError, wait_fails=True)
CompletedWork = DoneWork   # the public name of a Work complete when handed out (nothing to average)


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
        # the runner of this communicator's jobs, and its failure state (Note [A failed communicator stays
        # failed]); the gloo backend gives it its host channel, the local one its asynchronous averages
        self._runner = Runner(f"ncclavg-{getattr(self, 'backend', 'comm')}", FACE)
        # See Note [Collective sequence check] in debug.py; settable after construction.
        self.debug: bool = comm_debug.debug_enabled()
        self._debug_seq = 0
        self._buffer_cache: dict = {}   # See Note [Validated buffer cache]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def local(cls, n: int, timeout: Optional[float] = None, *, device: Any = "cpu") -> "Communicator":
        """`n` towers in this process on one `device`: CPU towers (default), or towers sharing one GPU
        ("cuda:N", N or a torch.device: ONE CUDA average-kernel launch per bucket on that device's current
        stream, no NCCL; see Note [Towers sharing one GPU] in local.py)."""
        return _backend("local")(n, timeout, device=device)

    @classmethod
    def nccl(cls, devices: Sequence[Any], timeout: Optional[float] = None, predivide: bool = False) -> "Communicator":
        """One process over several CUDA devices (ncclCommInitAll): one NCCL rank per entry of `devices`; a
        device listed twice needs NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (towers sharing one GPU
        otherwise: Communicator.local(n, device=...))."""
        return _backend("nccl").init_all(devices, check_timeout(timeout), predivide)

    @classmethod
    def from_torch_distributed(cls, group: Any = None, device: Any = None, timeout: Optional[float] = None,
                               predivide: bool = False, devices: Optional[Sequence[Any]] = None) -> "Communicator":
        """This process's towers under torchrun (or after init_process_group), averaged with the towers of
        every process of `group`: `device` for one tower per process, or `devices` for several (CPU
        towers: ["cpu"] * n). CPU towers use gloo (Note [Hierarchical CPU average] in gloo.py); a CUDA
        tower uses the core's NCCL (rank 0's unique id through the default store). `device` defaults to
        cuda:LOCAL_RANK when CUDA is usable and ncclavg has CUDA support, else cpu. Processes may feed
        different numbers of towers: the mean is over towers. Building it is a collective (every process
        of the group calls it). When torch.distributed is not initialized yet but the torchrun variables
        are set, it is initialized here (backend gloo: it carries the store and small control messages)."""
        import torch.distributed as dist

        t = check_timeout(timeout)
        if device is not None and devices is not None:
            raise ValueError("devices: give either device (one tower per process) or devices (this process's "
                             "towers), not both")
        devs = _parse_process_devices(devices)
        if not dist.is_available():
            raise RuntimeError("from_torch_distributed: this torch build has no torch.distributed")
        if not dist.is_initialized():
            if all(k in os.environ for k in TORCHRUN_VARS):
                _init_torchrun_group(dist, t)
            else:
                raise RuntimeError("from_torch_distributed: torch.distributed is not initialized; call "
                                   "torch.distributed.init_process_group(...) first or run under torchrun")
        if devs is None:
            devs = [_default_process_device() if device is None else torch.device(device)]
        if devs[0].type == "cpu":
            # any backend that runs CPU tensors: gloo, mpi, or ncclavg's own (whose groups then each get a
            # channel of their own: Note [One channel per group] in connect.py)
            backend = str(dist.get_backend(group)).lower()
            if not any(name in backend for name in ("gloo", "mpi", "ncclavg")):
                raise ValueError(f"device: cpu towers need a process group that runs CPU tensors, but this group's "
                                 f"backend is {backend!r}; pass group=torch.distributed.new_group(backend='gloo')")
            return _backend("gloo")(group, t, predivide, towers=len(devs))
        if devs[0].type == "cuda":
            if len(devs) > 1:
                return _backend("nccl").init_ranks(group, devs, t, predivide)
            return _backend("nccl").init_rank(group, devs[0], t, predivide)
        raise ValueError(f"device: {devs[0]} is not supported; use a cpu or cuda device")

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

    def sum_over_processes(self, values: Sequence[float], *, timeout: Optional[float] = None) -> list:
        """The elementwise sum of a few numbers over every process, as float64 (e.g. a step's loss sum and
        sample count); bounded by `timeout`. One process: the values themselves."""
        self._check_open()
        limit = self._timeout_arg(timeout)
        mine = [float(v) for v in values]
        if self.world_size == 1:
            return mine
        rows = self.allgather_object(mine, timeout=limit)
        if any(len(r) != len(mine) for r in rows):
            raise ValueError(f"values: processes passed different numbers of values ({[len(r) for r in rows]})")
        return [math.fsum(col) for col in zip(*rows)]

    def sum_over_processes_async(self, values: Sequence[float], *,
                                 timeout: Optional[float] = None) -> Callable[[], list]:
        """sum_over_processes started now, finished by calling the returned function (bounded): the
        exchange overlaps what runs in between. Backends without async ops finish it here."""
        result = self.sum_over_processes(values, timeout=timeout)
        return lambda: result

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], *, timeout: Optional[float] = None) -> None:
        """In place: every process's `tensors` (same shapes and dtypes everywhere) become rank 0's, e.g. the
        initial weights, so that every process starts from the same model. Bounded by `timeout`."""
        self._check_open()
        limit = self._timeout_arg(timeout)
        if self.world_size == 1:
            return
        mine = [t.detach().cpu() for t in tensors]
        rows = self.allgather_object(mine if self.rank == 0 else None, timeout=limit)
        with torch.no_grad():
            for t, src in zip(tensors, rows[0]):
                t.copy_(src)

    def straggler_report(self, calls: Optional[int] = None, seconds: Optional[float] = None,
                         threshold_s: float = stragglers.DEFAULT_THRESHOLD_S,
                         since: Optional[int] = None) -> Optional[stragglers.StragglerReport]:
        """Which rank held the others back in this process's recent collectives, and by how much (Note [The
        straggler report] in ncclavg/transport/stragglers.py): over the last `calls` calls it logged
        (default: all it keeps, up to 4096), or those of the last `seconds`, or those after the first
        `since` it logged (an earlier report's `logged`). Local: no collective. It covers the processes of
        this host, or, between hosts on UCX, every rank of every host. None when nothing logs this
        communicator's arrivals (one process alone on its host with gloo between the hosts, the local and
        NCCL backends)."""
        log = stragglers.arrival_source(self._runner.transport)
        return None if log is None else stragglers.report(log, calls, seconds, threshold_s, since)

    # ------------------------------------------------------------------ failure state
    @property
    def failure(self) -> Optional[str]:
        """Why this communicator became unusable (None while it is healthy). See Note [A failed
        communicator stays failed]."""
        return self._runner.failure

    def abort(self, reason: str = "abort() was called") -> None:
        """Marks the communicator unusable (NCCL: ncclCommAbort), e.g. from a watchdog of the caller's."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        self._runner.fail(reason)

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
        failure = self._runner.failure
        if failure is not None:
            raise CommError(F.unusable_because(f"{self.backend} communicator (rank {self.rank} of {self.world_size})",
                                               failure))
        if self._closed:
            raise RuntimeError(f"{self.backend} communicator is closed")

    def _timeout_arg(self, timeout: Any) -> float:
        return self.timeout if timeout is None else check_timeout(timeout)

    def _what(self, op: str, tensors: Sequence[torch.Tensor], tag: Optional[str]) -> "LazyText":
        """'gloo all_reduce_avg[bucket 3] of 4096 bytes (1024 x float32) on rank 1 of 3' for errors, written
        out only when an error message needs it (every collective carries one)."""
        t = tensors[0]   # its facts, not the tensor: a message must not keep a bucket alive
        return LazyText(self._describe, op, t.numel(), t.element_size(), t.dtype, tag)

    def _describe(self, op: str, numel: int, itemsize: int, dtype: torch.dtype, tag: Optional[str]) -> str:
        where = (f"rank {self.rank} of {self.world_size}" if self.world_size > 1 else
                 f"{self.local_size} local tower(s)")
        return (f"{self.backend} {op}{f'[{tag}]' if tag else ''} of {numel * itemsize} bytes ({numel} x "
                f"{str(dtype).replace('torch.', '')} per tower) on {where}")

    def _debug_check(self, op: str, tensor: torch.Tensor, debug_key: Any, timeout: float) -> None:
        """See Note [Collective sequence check] in debug.py."""
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

    _BUFFER_CACHE_SIZE = 256

    def _checked_buffers(self, tensors: Any, argname: str) -> tuple:
        """(tensors, their core Buffers): `_check_group` + `as_buffers`, served from the cache of validated
        Buffers when tensors with the same facts were checked before. See Note [Validated buffer cache]."""
        self._check_open()
        key = None
        if type(tensors) is list or type(tensors) is tuple:
            try:
                key = tuple([(t.data_ptr(), t.numel(), t.dtype, t.is_contiguous(), t.get_device(), t.is_neg())
                             for t in tensors])
            except (AttributeError, TypeError):  # not tensors: the full checks say what is wrong
                key = None
            else:
                bufs = self._buffer_cache.get(key)
                if bufs is not None:
                    return tensors, bufs
        tensors = self._check_group(tensors, argname)
        bufs = as_buffers(tensors, argname)
        if key is not None:
            if len(self._buffer_cache) >= self._BUFFER_CACHE_SIZE:
                self._buffer_cache.pop(next(iter(self._buffer_cache)))   # the oldest key
            self._buffer_cache[key] = bufs
        return tensors, bufs

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


def _init_torchrun_group(dist: Any, timeout: float) -> None:
    """init_process_group("gloo") from torchrun's environment, every key of this attempt under its own
    prefix.

    Note [Process groups of a restarted run]
    torchrun keeps one store (its agent's, at the same MASTER_PORT) for every attempt of a run. After a
    restart (--max-restarts), the new rank 0 can read the listening address a rank of the FAILED attempt
    left in the store under the same key and fail with "Gloo connectFullMesh ... Connection refused"
    (measured: 1 restart in 2 here, depending on which new process starts first). So the group is built
    on a PrefixStore named after TORCHELASTIC_RESTART_COUNT: each attempt sees only its own keys (the
    rendezvous itself is torchrun's, as before)."""
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ncclavg/attempt-{attempt}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))


def _parse_process_devices(devices: Any) -> Optional[list]:
    """`devices` of from_torch_distributed as torch.devices: all CPU, or all CUDA (None: not given)."""
    if devices is None:
        return None
    devices = device_list(devices, "devices", "this process's tower devices")
    out = []
    for i, d in enumerate(devices):
        try:
            out.append(torch.device(d))
        except (RuntimeError, TypeError):
            raise ValueError(f"devices[{i}]: expected a device such as 'cpu' or 'cuda:0', got {d!r}") from None
    one_kind([d.type for d in out], devices, "devices", "all towers of a process must be CPU or all CUDA")
    return [device_of(d, f"devices[{i}]") if d.type == "cpu" else d for i, d in enumerate(out)]


def _default_process_device() -> torch.device:
    if torch.cuda.is_available() and _ext.cuda_built():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


# backend name -> Communicator subclass. See Note [Backend table].
_BACKENDS: dict = {}


def register_backend(cls: type) -> type:
    """Makes `cls` (a Communicator subclass with a `backend` name) reachable from the constructors."""
    if not (isinstance(cls, type) and issubclass(cls, Communicator) and isinstance(getattr(cls, "backend", None), str)):
        raise TypeError(f"cls: expected a Communicator subclass with a backend name, got {cls!r}")
    _BACKENDS[cls.backend] = cls
    return cls


def _backend(name: str) -> Any:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise RuntimeError(f"the {name} backend of Communicator is not registered; import ncclavg.comm "
                           "(see Note [Backend table] in ncclavg/comm/base.py)") from None
