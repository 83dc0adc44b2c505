"""The NCCL backend of Communicator: a thin layer over the core's `_C.NcclComm` (csrc/cuda/comm.*).

The core owns one NCCL communicator and one comm stream per local device; each collective waits (with an
event) for the caller's current stream, runs as ONE grouped NCCL call, and the caller's streams are then
made to wait for it, so nothing synchronises the host. Host-side waits (Work.wait) are bounded: on
timeout the core aborts the communicator and raises CommTimeoutError.

Note [GPU towers of several processes]
Under torch.distributed, every CUDA tower of every process is one rank of ONE NCCL communicator (as
the CPU towers are: Note [Towers of several processes] in ncclavg/train/distributed.py), whether a
process feeds one tower (init_rank) or several (init_ranks): the average of a bucket is one NCCL
collective over all towers, with no second, per-process stage. Ranks are numbered process-major:
process p's T_p towers are ranks offset_p .. offset_p + T_p - 1, offset_p = T_0 + ... + T_(p-1), the
global tower numbering of the gloo backend (Note [Hierarchical CPU average] in gloo.py), so
reduce_scatter_avg's shard of local tower t is shard offset_p + t on both backends. The tower counts
travel through the default store together with rank 0's NCCL unique id (one key per process, every
wait bounded by the timeout), before any NCCL call. init_rank is init_ranks with one device, so
processes with one tower and processes with several build the same communicator.
"""
from __future__ import annotations

import datetime
import itertools
import os
import time
from typing import Any, Mapping, Optional, Sequence

import torch

from .._ext import _C, cuda_built, nccl_info
from ..buffers import as_buffers
from ..errors import CommTimeoutError
from .base import Communicator, Work, check_timeout
from .devices import cuda_index, device_list, kinds_of, one_kind
from ..transport import profiling
from .dist import allgather_object

_UID_SEQ = itertools.count()  # one store key per communicator built under torch.distributed
MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"  # NCCL >= 2.30: several ranks may share one GPU


def require_nccl_comm() -> None:
    """Raises NcclError (no loadable NCCL) or RuntimeError (CPU-only build, no GPU) saying what to install
    when this machine cannot run the NCCL backend."""
    info = nccl_info()
    if not info["loaded"]:  # first: NcclError naming `pip install nvidia-nccl-cu13`
        also = "" if cuda_built() and hasattr(_C, "NcclComm") else (
            "the nccl backend also needs ncclavg built with CUDA support (this build is CPU-only: reinstall "
            "with the CUDA toolkit present, `NCCLAVG_CUDA=1 pip install .`). ")
        raise _C.NcclError(also + info["error"])
    if not cuda_built() or not hasattr(_C, "NcclComm"):
        raise RuntimeError(
            "the nccl backend needs ncclavg built with CUDA support: this build is CPU-only. Reinstall from "
            "source on a machine with the CUDA toolkit (nvcc): `NCCLAVG_CUDA=1 pip install .`, and install an "
            "NCCL (`pip install nvidia-nccl-cu12` or `nvidia-nccl-cu13`, or the extras ncclavg[cu12] / "
            "ncclavg[cu13]). For CPU towers use Communicator.local(n) or gloo "
            "(Communicator.from_torch_distributed(device='cpu')).")
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device, but torch.cuda.is_available() is False "
                           "(is this torch build CPU-only, or is no GPU visible?)")


# Note [A Work keeps its tensors alive]
# A collective only enqueues work: NCCL reads and writes the tensors on the comm streams later. torch's
# caching allocator hands a freed block to the next allocation on the stream it was allocated on at
# once, ordered only by that stream. all_reduce_avg orders the callers' streams after the collective
# right away (stream_wait), so freeing then is safe; the async form does that only in Work.wait(). A
# caller that dropped its tensors before wait() would let the allocator give memory NCCL is still
# writing to new work. So the Work holds the tensors until wait() returned or done() said True, and a
# Work dropped without either orders the callers' streams after the collective as it goes.
# (record_stream on the comm streams would also work, but then freeing a tensor after the
# communicator was closed would record an event on a destroyed stream inside torch's allocator.)


def multi_rank_gpu_problem(nccl_version: int, env: Mapping[str, str]) -> Optional[str]:
    """Why NCCL `nccl_version` (a version code, e.g. 23000 for 2.30.0) with the environment `env` cannot
    run several ranks of one communicator on one GPU, or None when it can. The rule is the core's (See
    Note [Several ranks on one GPU] in csrc/cuda/nccl_api.cpp): NCCL >= 2.30 and
    NCCL_MULTI_RANK_GPU_ENABLE=1."""
    why = _C.nccl_multi_rank_gpu_refusal(int(nccl_version), env.get(MULTI_RANK_GPU_ENV))
    return why or None


def _check_repeated_devices(ids: list, env: Mapping[str, str]) -> None:
    """A device listed twice is a second NCCL rank on that GPU: allowed only where NCCL allows it."""
    for i, d in enumerate(ids):
        if d in ids[:i]:
            why = multi_rank_gpu_problem(nccl_info().get("version_code", 0), env)
            if why:
                raise ValueError(f"devices[{i}]: cuda:{d} is listed twice (also devices[{ids.index(d)}]), i.e. "
                                 f"two NCCL ranks on one GPU: {why}")
            return


def process_major_ranks(tower_counts: Sequence[int], rank: int) -> tuple:
    """(size, first): the NCCL ranks of a communicator over every tower of every process, when process p
    feeds tower_counts[p] towers. size = all towers; process `rank`'s towers are the ranks first ..
    first + tower_counts[rank] - 1, first = the towers of the processes before it. See Note [GPU towers
    of several processes]."""
    counts = []
    for p, c in enumerate(tower_counts):
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(f"tower_counts[{p}]: expected an int, got {type(c).__name__}")
        if c < 1:
            raise ValueError(f"tower_counts[{p}]: every process feeds at least one tower, got {c}")
        counts.append(c)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(counts):
        raise ValueError(f"rank: expected a process rank in [0, {len(counts)}), got {rank!r}")
    return sum(counts), sum(counts[:rank])


_device_index = cuda_index   # a tower's CUDA ordinal (devices.py); the tests stand in for GPUs through this name


def _check_cuda_devices(devices: Any) -> list:
    """`devices` of init_ranks: a non-empty list of CUDA devices (ordinals, 'cuda:N', torch.device). Checked
    before anything needs NCCL or a GPU, so a wrong list is a ValueError / TypeError on any machine."""
    devices = device_list(devices, "devices", "this process's CUDA devices")
    kind = one_kind(kinds_of(devices, "devices"), devices, "devices",
                    "the towers of an nccl communicator are all CUDA devices")
    if kind != "cuda":
        raise ValueError(f"devices[0]: {devices[0]} is not a CUDA device; the nccl backend runs CUDA towers (CPU "
                         "towers: the gloo backend, from_torch_distributed(devices=['cpu'] * n))")
    return devices


def _exchange_through_store(store: Any, key: str, rank: int, world: int, towers: int, timeout: float,
                            make_uid: Any) -> tuple:
    """(uid, tower_counts): rank 0 publishes a fresh NCCL unique id (`make_uid()`) under `key`, every process
    its tower count under `key`/towers/<rank>; each reads them all, every wait ending by `timeout` seconds
    from now (the store's own timeout is the process group's, 30 min by default). See Note [GPU towers of
    several processes].
    Only store.wait is ever left to run out: after a timeout no other store call is made, because the
    store's server may be the process that stopped (a frozen rank 0 hosts torchrun's TCPStore), and any
    call to it would then wait for the store's own timeout."""
    deadline = time.monotonic() + timeout
    where = f"nccl init (rank {rank} of {world})"
    count_keys = [f"{key}/towers/{p}" for p in range(world)]
    if rank == 0:
        store.set(key, bytes(make_uid()))
    store.set(count_keys[rank], str(int(towers)).encode())
    try:
        store.wait([key], _left(deadline))
    except RuntimeError as e:
        raise CommTimeoutError(f"{where}: rank 0's NCCL unique id did not appear in the store under {key!r} within "
                               f"{timeout:g} s (is rank 0 alive and building the same communicator?): {e}") from None
    try:
        store.wait(count_keys, _left(deadline))
    except RuntimeError as e:
        raise CommTimeoutError(f"{where}: rank 0's NCCL unique id appeared, but not the tower count of every process "
                               f"(keys {key + '/towers/<rank>'!r}) within {timeout:g} s (is every process of the "
                               f"group alive and building the same communicator?): {e}") from None
    multi_get = getattr(store, "multi_get", None)
    values = multi_get(count_keys) if multi_get is not None else [store.get(k) for k in count_keys]
    return bytes(store.get(key)), [int(bytes(v)) for v in values]


def _left(deadline: float) -> datetime.timedelta:
    """What is left until `deadline` (time.monotonic()), at least a millisecond: to some stores (HashStore)
    a zero timeout means "wait forever"."""
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def _process_group(group: Any) -> tuple:
    """(rank, world size, default store, members) of `group` for the store keys of a communicator."""
    import torch.distributed as dist

    members = "world" if group is None else ",".join(map(str, dist.get_process_group_ranks(group)))
    return (dist.get_rank(group), dist.get_world_size(group), dist.distributed_c10d._get_default_store(),
            members)


class _NcclWork(Work):
    """A collective enqueued on the core's comm streams. wait() blocks the host until it completed
    (bounded; the core aborts the communicator on timeout) and orders the callers' streams after it.
    Nothing waits at issue time, so compute (e.g. the rest of backward) overlaps the collective.
    See Note [A Work keeps its tensors alive] and Note [Which streams a Work orders].

    Note [Which streams a Work orders]
    The core numbers the collectives it enqueues from 1; an empty one enqueues nothing and returns 0,
    which the core's wait/stream_wait read as "everything so far" / "the last enqueued". So a Work
    of seq 0 is complete at once and orders nothing (it must not wait for other threads' buckets).
    wait() and wait_stream() order the streams that are current when they are called (like
    torch.distributed's Work.wait: the consumer may be another thread or stream than the one that
    issued, e.g. the averager unpacks on the caller's stream what a hook thread issued), and also the
    streams current at issue when those differ: the tensors were allocated there, and the caching
    allocator may hand their memory to new work on those streams once the Work lets them go."""

    def __init__(self, comm: "NcclCommunicator", seq: Any, streams: list, default_timeout: float,
                 tensors: Sequence[Any] = ()):
        super().__init__()
        self._comm = comm
        self._seq = int(seq) if isinstance(seq, int) else 0   # 0: nothing was enqueued
        self._streams = streams
        self._timeout = default_timeout
        self._tensors: Optional[tuple] = tuple(tensors) if self._seq else None   # kept until safe to forget

    def _order_streams(self) -> None:
        current = self._comm._streams()
        self._comm._call(self._comm._handle.stream_wait, current, self._seq)
        if list(current) != list(self._streams):
            self._comm._call(self._comm._handle.stream_wait, self._streams, self._seq)

    def wait(self, timeout: Optional[float] = None) -> None:
        t = check_timeout(timeout) if timeout is not None else self._timeout
        if not self._seq:
            return
        self._comm._call(self._comm._handle.wait, t, self._seq)
        self._order_streams()
        self._tensors = None   # the callers' streams now run after the collective

    def wait_stream(self) -> None:
        """Orders the callers' streams after THIS collective (events on the device), without blocking
        the host: See Note [Stream-ordered average] in ncclavg/averager.py. Failures of the collective
        surface at the next host wait (wait(), done(), or a later collective's)."""
        if self._seq:
            self._order_streams()
        self._tensors = None   # later work on those streams, new allocations included, runs after it

    def done(self) -> bool:
        if not self._seq:
            return True
        finished = bool(self._comm._call(self._comm._handle.done, self._seq))
        if finished:
            self._tensors = None   # NCCL no longer touches them
        return finished

    def __del__(self) -> None:
        # Dropped without wait(): order the callers' streams after the collective before the tensors go,
        # so their memory is not handed to new work on those streams while NCCL still writes it.
        if getattr(self, "_tensors", None):
            try:
                self._comm._handle.stream_wait(self._streams, self._seq)
            except Exception:   # an aborted or destroyed communicator runs nothing any more
                pass


class NcclCommunicator(Communicator):
    backend = "nccl"

    def __init__(self, handle: Any, device_ids: list, rank: int, world_size: int, size: int, timeout: float,
                 predivide: bool, group: Any = None, tower_counts: Optional[Sequence[int]] = None):
        super().__init__()
        self._handle = handle
        self._device_ids = device_ids
        self.devices = [f"cuda:{d}" for d in device_ids]
        self.local_size = len(device_ids)
        self.rank, self.world_size, self.size = rank, world_size, size
        # The towers of every process and this process's first global tower (= its first NCCL rank), as on
        # the gloo backend. See Note [GPU towers of several processes].
        self.tower_counts: list = ([int(c) for c in tower_counts] if tower_counts is not None else
                                   [self.local_size] * world_size)
        self.tower_offset = sum(self.tower_counts[:rank])
        self.timeout = timeout
        self.predivide = bool(predivide)
        self.group = group
        self.nccl_version = getattr(handle, "nccl_version", None)
        # "blocking" / "nonblocking" and why: See Note [Blocking collectives after a bounded init] in
        # csrc/cuda/comm_init.cpp (NCCLAVG_NCCL_COLLECTIVES chooses; benchmarks report it).
        self.collective_mode = getattr(handle, "collective_mode", None)
        self.collective_mode_reason = getattr(handle, "collective_mode_reason", None)

    @classmethod
    def init_all(cls, devices: Sequence[Any], timeout: float, predivide: bool) -> "NcclCommunicator":
        if isinstance(devices, (str, int)) or not hasattr(devices, "__len__") or len(devices) == 0:
            raise ValueError(f"devices: expected a non-empty list of CUDA devices, got {devices!r}")
        require_nccl_comm()
        ids = [_device_index(d, f"devices[{i}]") for i, d in enumerate(devices)]
        _check_repeated_devices(ids, os.environ)   # one NCCL rank per entry: a repeat shares its GPU
        handle = _C.NcclComm.init_all(ids, timeout)
        return cls(handle, ids, rank=0, world_size=1, size=len(ids), timeout=timeout, predivide=predivide)

    @classmethod
    def init_rank(cls, group: Any, device: Any, timeout: float, predivide: bool) -> "NcclCommunicator":
        """One CUDA tower in this process, one rank of the communicator over every tower of every process
        of `group` (init_ranks with one device). Building it is a collective."""
        return cls._init_process_towers(group, [device], timeout, predivide, single=True)

    @classmethod
    def init_ranks(cls, group: Any, devices: Sequence[Any], timeout: float, predivide: bool) -> "NcclCommunicator":
        """This process's CUDA towers (`devices`, one NCCL rank each) in ONE NCCL communicator over every tower
        of every process of `group`, ranks numbered process-major. See Note [GPU towers of several
        processes]. Building it is a collective."""
        return cls._init_process_towers(group, _check_cuda_devices(devices), timeout, predivide, single=False)

    @classmethod
    def _init_process_towers(cls, group: Any, devices: list, timeout: float, predivide: bool,
                             single: bool) -> "NcclCommunicator":
        require_nccl_comm()
        ids = [_device_index(d, "device" if single else f"devices[{i}]") for i, d in enumerate(devices)]
        _check_repeated_devices(ids, os.environ)   # one NCCL rank per entry: a repeat shares its GPU
        rank, world, store, members = _process_group(group)
        key = f"ncclavg/nccl_uid/{members}/{next(_UID_SEQ)}"
        # looked up when rank 0 calls it: only rank 0 draws an id (a CPU-only build has no nccl_unique_id)
        uid, counts = _exchange_through_store(store, key, rank, world, len(ids), timeout,
                                              lambda: _C.nccl_unique_id())
        size, first = process_major_ranks(counts, rank)
        handle = _C.NcclComm.init_ranks(uid, size, first, ids, timeout)
        return cls(handle, ids, rank=rank, world_size=world, size=size, timeout=timeout, predivide=predivide,
                   group=group, tower_counts=counts)

    # ------------------------------------------------------------------ failure state
    def _check_open(self) -> None:
        if self.failure is None and not self._closed and self._handle.aborted:
            self._fail(self._handle.abort_reason)   # aborted by the core's watchdog
        super()._check_open()

    def _call(self, fn: Any, *args: Any) -> Any:
        """Runs a core call; a timeout or NCCL error there (the core has aborted the communicator) is
        recorded so that every later call says why the communicator is unusable. So is a CUDA error after
        which the core aborted (a sticky error found while waiting: Note [Watchdog] in
        csrc/cuda/comm.cpp); one it did not abort for (a bad stream handle) leaves the communicator usable."""
        try:
            return fn(*args)
        except (CommTimeoutError, _C.NcclError) as e:
            self._fail(str(e))
            raise
        except _C.CudaError as e:
            if self._handle.aborted:
                self._fail(str(e))
            raise

    def abort(self, reason: str = "abort() was called") -> None:
        self._fail(reason)
        self._handle.abort()

    # ------------------------------------------------------------------ collectives
    def _streams(self) -> list:
        return [int(torch.cuda.current_stream(d).cuda_stream) for d in self._device_ids]

    def _order_after(self, streams: list, seq: Any) -> None:
        """Orders `streams` after collective `seq` only (never "the last enqueued", which may be another
        thread's later bucket); seq 0: nothing was enqueued. See Note [Which streams a Work orders]."""
        if isinstance(seq, int) and seq:
            self._call(self._handle.stream_wait, streams, seq)

    def _enqueue_all_reduce(self, tensors: Any, tag: Optional[str], debug_key: Any) -> tuple:
        tensors, bufs = self._checked_buffers(tensors, "tensors")
        self._debug_check("all_reduce_avg", tensors[0], debug_key, self.timeout)
        streams = self._streams()
        # NCCL averages: nothing deferred. The tag names the collective in the core's timeout messages.
        seq = self._call(self._handle.all_reduce_avg, bufs, streams, self.predivide, None, tag or "")
        return seq, streams, tensors

    @profiling.ranged("all_reduce_avg_async")
    def all_reduce_avg_async(self, tensors: Sequence[torch.Tensor], defer_scale: bool = False, *,
                             tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None) -> Work:
        seq, streams, tensors = self._enqueue_all_reduce(tensors, tag, debug_key)
        return _NcclWork(self, seq, streams, self.timeout, tensors)

    @profiling.ranged("all_reduce_avg")
    def all_reduce_avg(self, tensors: Sequence[torch.Tensor], *, tag: Optional[str] = None,
                       debug_key: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        # Stream-ordered like torch's collectives: the callers' streams wait for the result on the device.
        # The host does not wait here; a later Work.wait / close() bounds the time to completion.
        self._timeout_arg(timeout)
        seq, streams, _ = self._enqueue_all_reduce(tensors, tag, debug_key)
        self._order_after(streams, seq)   # See Note [A Work keeps its tensors alive]

    @profiling.ranged("reduce_scatter_avg")
    def reduce_scatter_avg(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                           tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                           timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_scatter_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        self._debug_check("reduce_scatter_avg", inputs[0], debug_key, limit)
        streams = self._streams()
        seq = self._call(self._handle.reduce_scatter_avg, as_buffers(inputs, "inputs"), as_buffers(outputs, "outputs"),
                         streams, self.predivide, limit, tag or "")
        self._order_after(streams, seq)

    @profiling.ranged("all_gather")
    def all_gather(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                   tag: Optional[str] = None, debug_key: Optional[Sequence[int]] = None,
                   timeout: Optional[float] = None) -> None:
        inputs, outputs = self._check_gather_args(inputs, outputs)
        limit = self._timeout_arg(timeout)
        self._debug_check("all_gather", inputs[0], debug_key, limit)
        streams = self._streams()
        seq = self._call(self._handle.all_gather, as_buffers(inputs, "inputs"), as_buffers(outputs, "outputs"),
                         streams, limit, tag or "")
        self._order_after(streams, seq)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Host waits (bounded) for every collective enqueued so far."""
        self._check_open()
        self._call(self._handle.wait, self._timeout_arg(timeout), 0)

    def _torch_group_device(self) -> Any:
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group)).lower()
        return "cpu" if ("gloo" in backend or "mpi" in backend) else torch.device("cuda", self._device_ids[0])

    def allgather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        self._check_open()
        limit = self._timeout_arg(timeout)
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        return allgather_object(self, dist, self.group, obj, limit, self._torch_group_device())

    def _debug_allgather(self, record: torch.Tensor, timeout: float) -> torch.Tensor:
        # Through the NCCL core itself: the check then also proves that this communicator's ranks line up.
        # The core gathers one record per tower (every local device sends this process's); the check wants
        # one per process: each process's first tower, at its tower offset.
        devs = [torch.device("cuda", d) for d in self._device_ids]
        mine = [record.to(dev) for dev in devs]
        rows = [torch.empty(record.numel() * self.size, dtype=torch.float32, device=dev) for dev in devs]
        streams = self._streams()
        seq = self._call(self._handle.all_gather, as_buffers(mine, "record"), as_buffers(rows, "rows"), streams,
                         timeout, "NCCLAVG_DEBUG sequence check")
        self._call(self._handle.wait, timeout, seq)
        self._order_after(streams, seq)
        firsts = [sum(self.tower_counts[:p]) for p in range(self.world_size)]
        return rows[0].cpu().view(self.size, record.numel())[firsts]

    def close(self) -> None:
        if not self._closed:
            self._handle.destroy()  # bounded: waits at most `timeout` for work in flight, then aborts
        super().close()
