"""The gloo backend's transport between processes of one host: the core's shared-memory channel
(Note [Shared-memory channel] in csrc/cpu/shm_channel.cpp), with torch.distributed's Work interface so
that gloo.py issues and waits for it exactly as for a gloo collective (dist.py's bounded waits).

Note [When the shared-memory channel is used]
GlooCommunicator opens a channel when every process of its group reports the same host identity: the
kernel's boot id and this process's network, IPC, PID and mount namespaces. Processes in separate network
namespaces are separate hosts on purpose, even when they could share /dev/shm: that is how containers,
and the two-host test, say "another machine". The setup is collective and bounded by the communicator's
timeout: rank 0 creates the segment under a random name and tells the others (through torch.distributed),
they open it, everyone reports, and the channel is used only if every process succeeded; then rank 0
removes the name, so no segment outlives the processes, even after a crash. A failed setup (e.g. a
/dev/shm too small for 2 x ranks x slot) warns once and leaves every process on gloo.
NCCLAVG_SHM=0 turns the channel off, =1 makes a failed setup an error, auto (the default) as above.
NCCLAVG_SHM_SLOT_KB sets the slot (1024 KiB by default; the segment is about 2 x ranks x slot).
Tensors of other dtypes than float32, float16, bfloat16 and float64 still go through gloo; every rank
makes the same choice, since the dtype is the same on every rank.
Asynchronous collectives (the averager's buckets during backward, the trainer's per-step sums) run in
order on one worker thread; a synchronous one runs on the caller's thread when nothing is queued.
"""
from __future__ import annotations

import datetime
import os
import queue
import secrets
import threading
import time
import warnings
from typing import Any, Callable, Optional

import torch

from .._ext import _C
from ..errors import CommError

_TYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_SETTINGS = {"0": "off", "off": "off", "1": "on", "on": "on", "auto": "auto", "": "auto"}


def setting() -> str:
    """NCCLAVG_SHM as "off", "on" or "auto"."""
    raw = os.environ.get("NCCLAVG_SHM", "auto").strip().lower()
    if raw not in _SETTINGS:
        raise ValueError(f"NCCLAVG_SHM must be 0, 1 or auto, got '{raw}'")
    return _SETTINGS[raw]


def slot_bytes() -> int:
    raw = os.environ.get("NCCLAVG_SHM_SLOT_KB", "1024").strip()
    try:
        kb = int(raw)
    except ValueError:
        kb = -1
    if kb < 4:
        raise ValueError(f"NCCLAVG_SHM_SLOT_KB must be an integer >= 4, got '{raw}'")
    return kb * 1024


def host_identity() -> str:
    """Equal for two processes exactly when they may use one channel: Note [When the shared-memory
    channel is used]."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        return f"unknown:{os.getpid()}"   # no way to tell: never share
    for ns in ("net", "ipc", "pid", "mnt"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            return f"unknown:{os.getpid()}"
    return "|".join(parts)


_PREFIX = "ncclavg-"
STALE_S = 60.0


def remove_stale_segments(directory: str = "/dev/shm") -> list:
    """Removes segment names left by a rank 0 that died during a channel's setup (the only window in which
    a name exists): ncclavg-<pid>-<hex> whose creator is gone and that is older than STALE_S. Returns
    what it removed."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        parts = e.name[len(_PREFIX):].split("-") if e.name.startswith(_PREFIX) else []
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            if now - e.stat().st_mtime < STALE_S or _alive(int(parts[0])):
                continue
            os.unlink(e.path)
            removed.append(e.name)
        except OSError:   # gone already, or not ours to remove
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, another user's
        return True
    return True


def supports(t: torch.Tensor) -> bool:
    return t.dtype in _TYPE_CODES and t.device.type == "cpu" and t.is_contiguous()


class _ShmWork:
    """One channel collective, with the part of torch.distributed's Work that dist.py uses: wait(timeout)
    raising RuntimeError (its text says "timed out" for a timeout) and is_completed()."""

    source = "shared-memory channel"
    names_peers = True   # its errors name the rank that stopped (see dist._wait_dist)

    def __init__(self, transport: "ShmTransport", keep: tuple):
        self.started = time.monotonic()   # dist._wait_dist measures from here: the work may run inline
        self._transport = transport
        self._keep = keep            # the tensors the channel reads and writes, alive until done
        self._event = threading.Event()
        self._error: Optional[BaseException] = None

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as e:   # reported by wait(); a failed channel stays failed (C++ side)
            self._error = e
        finally:
            self._keep = ()
            self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._event.wait(seconds):
            why = f"shared-memory collective timed out after {seconds:g} s (waited on rank {self._transport.rank})"
            self._transport.abort(why)
            self.names_peers = False   # this wait gave up before the channel's own deadline named anyone
            raise _failure(why, timed_out=True)
        if self._error is not None:
            # this rank's own deadline passed, or a peer exited / aborted the channel (a CommError here,
            # even when the peer's reason was its own timeout)
            raise _failure(str(self._error), timed_out=isinstance(self._error, TimeoutError))
        return True


def _failure(text: str, timed_out: bool) -> RuntimeError:
    e = RuntimeError(text)
    e.is_timeout = timed_out   # read by dist._is_timeout
    return e


class ShmTransport:
    """The channel of one GlooCommunicator. Collectives take flat contiguous CPU tensors of the dtypes in
    `supports`; each returns a _ShmWork. `sync=True`: the caller will wait at once (run inline when
    nothing is queued)."""

    def __init__(self, channel: Any, rank: int, world_size: int, timeout: float):
        self._channel = channel
        self.rank, self.world_size = rank, world_size
        self._timeout = float(timeout)
        self._lock = threading.Lock()        # guards _outstanding and the worker's start
        self._exec = threading.Lock()        # held while a collective runs: one at a time, in order
        self._outstanding = 0
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ setup
    @classmethod
    def connect(cls, comm: Any, dist: Any, group: Any, identities: list, timeout: float) -> Optional["ShmTransport"]:
        """Collective: a transport when every process of the group can share one, else None. See Note
        [When the shared-memory channel is used]."""
        from .dist import _allgather_object_bounded

        mode = setting()
        world, rank = comm.world_size, comm.rank
        if mode == "off" or world < 2:
            return None
        if len(set(identities)) != 1:
            if mode == "on":
                raise CommError("NCCLAVG_SHM=1 but the processes of this group are not on one host "
                                "(or not in one network namespace): the shared-memory channel needs that")
            return None
        size = slot_bytes()
        name = f"/{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        nonce = secrets.randbits(63)
        channel, error = None, ""
        if rank == 0:
            remove_stale_segments()
            try:
                channel = _C.ShmChannel(name, 0, world, size, nonce)
            except (RuntimeError, ValueError) as e:
                error = str(e)
        offer = _allgather_object_bounded(comm, dist, group, (name, nonce, error) if rank == 0 else None, timeout)[0]
        name, nonce, error = offer
        if rank != 0 and not error:
            try:
                channel = _C.ShmChannel(name, rank, world, size, nonce)
            except (RuntimeError, ValueError) as e:
                error = f"rank {rank}: {e}"
        errors = [e for e in _allgather_object_bounded(comm, dist, group, error if rank else "", timeout) if e]
        if rank == 0 and channel is not None:
            channel.unlink_name()   # everyone has opened it (or given up): the name is no longer needed
        if error or errors:
            why = error or errors[0]
            if mode == "on":
                raise CommError(f"NCCLAVG_SHM=1 but the shared-memory channel could not be set up: {why}")
            warnings.warn(f"ncclavg: the gloo backend stays on torch.distributed; the shared-memory channel "
                          f"could not be set up: {why}", RuntimeWarning, stacklevel=3)
            return None
        return cls(channel, rank, world, timeout)

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, t: torch.Tensor, sync: bool = False) -> _ShmWork:
        return self._submit(self._channel.all_reduce_sum, (t.data_ptr(), t.numel(), _TYPE_CODES[t.dtype]), (t,), sync)

    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, sync: bool = True) -> _ShmWork:
        return self._submit(self._channel.reduce_scatter_sum,
                            (inp.data_ptr(), out.data_ptr(), out.numel(), _TYPE_CODES[out.dtype]), (out, inp), sync)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, sync: bool = True) -> _ShmWork:
        return self._submit(self._channel.all_gather,
                            (inp.data_ptr(), out.data_ptr(), inp.numel(), _TYPE_CODES[inp.dtype]), (out, inp), sync)

    def broadcast(self, t: torch.Tensor, root: int, sync: bool = True) -> _ShmWork:
        return self._submit(self._channel.broadcast, (t.data_ptr(), t.numel(), _TYPE_CODES[t.dtype], int(root)),
                            (t,), sync)

    def abort(self, why: str) -> None:
        self._channel.abort(why)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=self._timeout)

    # ------------------------------------------------------------------ execution
    def _submit(self, fn: Callable, args: tuple, keep: tuple, sync: bool) -> _ShmWork:
        work = _ShmWork(self, keep)
        call = (fn, args + (self._timeout,))
        with self._lock:
            if self._closed:
                raise RuntimeError("the shared-memory channel is closed")
            inline = sync and self._outstanding == 0
            self._outstanding += 1
            if inline:
                self._exec.acquire()
            else:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, name="ncclavg-shm", daemon=True)
                    self._worker.start()
                self._queue.put((work, call))
        if inline:
            try:
                work._run(*call)
            finally:
                self._exec.release()
                self._done()
        return work

    def _done(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, call = item
            with self._exec:
                work._run(*call)
            self._done()
