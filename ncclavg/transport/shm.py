"""The gloo backend's transport between processes that share a host: the core's shared-memory channel
(Note [Shared-memory channel] in csrc/transport/shm_channel.cpp), with torch.distributed's Work interface so
that gloo.py issues and waits for it exactly as for a gloo collective (dist.py's bounded waits).

Note [When the shared-memory channel is used]
GlooCommunicator groups its processes by host identity: the kernel's boot id and the process's network,
IPC, PID and mount namespaces. Processes in separate network namespaces are separate hosts on purpose,
even when they could share /dev/shm: that is how containers, and the two-host test, say "another
machine". All on one host: one channel over every process (transport "shm"). Several hosts, some with
several processes: a channel per host and torch.distributed between the hosts' leaders (transport
"shm+gloo", Note [Several hosts] below). Every process alone on its host: no channel ("gloo"). The setup
is collective and bounded by the communicator's timeout: each host's leader creates its segment (a
memory file without a name, Note [Segment without a name] in csrc/transport/shm_segment.cpp) and opens a
door for it under a random name, one exchange tells the names, the others receive the segment through
the doors, a second exchange tells everyone whether all of that worked, and the channels are used only
if it worked everywhere. Then each leader closes its door. Nothing is left behind, even after a crash.
A failed setup (e.g. memory too short for 2 x processes x slot) warns once and leaves every process on
gloo.
NCCLAVG_SHM=0 turns the channels off, =1 makes a failed setup (or no two processes on one host) an
error, auto (the default) as above.
NCCLAVG_SHM_SLOT_KB sets the slot (by default 1 MiB, less above 16 processes on a host: slot_bytes; the
segment is about 2 x processes x slot; at most MAX_SLOT_KB).
Tensors of other dtypes than float32, float16, bfloat16 and float64 still go through gloo; every rank
makes the same choice, since the dtype is the same on every rank.
Asynchronous collectives (the averager's buckets during backward, the trainer's per-step sums) run in
order on one worker thread; a synchronous one runs on the caller's thread when nothing is queued (and
gloo.py's all_reduce_avg of one small tensor runs its own fast path: shm_fast.py). Every collective
carries its own time limit:
the caller's timeout when it gave one, else the communicator's.
"""
from __future__ import annotations

import datetime
import os
import secrets
import threading
import time
import warnings
from typing import Any, Callable, Optional

import torch

from .._ext import _C
from ..errors import CommError, is_timeout
from .executor import SLACK_S, Executor
from .calls import Call, CallMismatchError, check_over_gloo

TYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_SETTINGS = {"0": "off", "off": "off", "1": "on", "on": "on", "auto": "auto", "": "auto"}


def setting() -> str:
    """NCCLAVG_SHM as "off", "on" or "auto"."""
    raw = os.environ.get("NCCLAVG_SHM", "auto").strip().lower()
    if raw not in _SETTINGS:
        raise ValueError(f"NCCLAVG_SHM must be 0, 1 or auto, got '{raw}'")
    return _SETTINGS[raw]


SEGMENT_TARGET = 32 << 20   # bytes of /dev/shm a host's segment aims at by default (Docker gives 64 MiB)


MAX_SLOT_KB = 256 << 10   # the core's cap on a slot (256 MiB): beyond a few MiB a slot buys nothing


def slot_bytes(processes: int) -> int:
    """A channel's slot: NCCLAVG_SHM_SLOT_KB when set; else 1 MiB, smaller with many processes so that
    the segment (2 x processes x slot) stays near SEGMENT_TARGET, never below 64 KiB."""
    raw = os.environ.get("NCCLAVG_SHM_SLOT_KB", "").strip()
    if not raw:
        fit = SEGMENT_TARGET // (2 * max(1, processes)) // 4096 * 4096
        return max(64 << 10, min(1 << 20, fit))
    try:
        kb = int(raw)
    except ValueError:
        kb = -1
    if not 4 <= kb <= MAX_SLOT_KB:
        raise ValueError(f"NCCLAVG_SHM_SLOT_KB must be an integer in [4, {MAX_SLOT_KB}], got '{raw}'")
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


GRACE_S = SLACK_S   # Note [One deadline per call] in executor.py
# An asynchronous call of at most ASYNC_INLINE_BYTES runs on the caller's thread when its peers are in it
# within ASYNC_READY_S (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp).
ASYNC_INLINE_BYTES = _C.SHM_ASYNC_INLINE_BYTES
ASYNC_READY_S = 50e-6


def supports(t: torch.Tensor) -> bool:
    return t.dtype in TYPE_CODES and t.device.type == "cpu" and t.is_contiguous()


class _ShmWork:
    """One channel collective, with the part of torch.distributed's Work that dist.py uses: wait(timeout)
    raising RuntimeError (its text says "timed out" for a timeout) and is_completed()."""

    source = "shared-memory channel"

    def __init__(self, transport: "ShmTransport", keep: tuple):
        self.started = time.monotonic()   # dist._wait_dist measures from here: the work may run inline
        self.names_peers = transport.names_peers
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
        # The collective has a deadline of its own (the communicator's timeout, from when its wait began),
        # and its error names the rank that stopped: let it come first, by GRACE_S at most.
        if not self._event.wait(seconds) and not self._event.wait(GRACE_S):
            why = f"shared-memory collective timed out after {seconds:g} s (waited on rank {self._transport.rank})"
            self._transport.abort(why)
            self.names_peers = False   # this wait gave up before the channel's own deadline named anyone
            raise _failure(why, timed_out=True)
        if self._error is not None:
            # this rank's own deadline passed, or a peer exited / aborted the channel (a CommError here,
            # even when the peer's reason was its own timeout)
            raise _failed_call(self._error)
        return True


def _leaders_group(dist: Any, group: Any, leaders: list, timeout: float) -> Any:
    """The process group of the hosts' leaders (group ranks `leaders`); only they build it."""
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in leaders]
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                          use_local_synchronization=True)


def _noting(fn: Callable, finite: list) -> Callable:
    """fn (a checked channel sum), its answer appended to `finite`."""
    def call(*args: Any) -> None:
        finite.append(fn(*args))
    return call


def _tag(call: Optional[Call]) -> tuple:
    """The channel's (tag, tag_count) arguments of a user call (Note [Call signatures])."""
    return (0, 0) if call is None else (call.tag, call.count)


class _Raise:
    """A work that fails with `error` when waited: an error of the leaders' check, told like step (2)'s,
    or of a collective that ran where it was called (Note [An order held by the caller])."""

    def __init__(self, error: BaseException):
        self._error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self._error

    def is_completed(self) -> bool:
        return True


class _Done:
    """The work of a collective that ran where it was called (Note [An order held by the caller])."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class _Ran:
    """The work of a synchronous call that ran at once on the caller's thread (Note [A synchronous call on
    an idle channel]): what _ShmWork offers the waiter, with the outcome already known.

    Note [A synchronous call on an idle channel]
    A call whose caller waits at once, on a channel with nothing queued or running, runs on the caller's
    thread holding the channel's lock (as the executor would run it inline), without the executor's
    bookkeeping and the Event of a _ShmWork: ~1 us instead of ~7 for a small call. It takes the lock only
    when it is free and nothing is outstanding, so it never overtakes a queued call; otherwise the call goes
    to the executor as before."""

    source = "shared-memory channel"

    def __init__(self, started: float, names_peers: bool, error: Optional[BaseException] = None):
        self.started, self.names_peers, self._error = started, names_peers, error

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        if self._error is not None:
            raise _failed_call(self._error)
        return True


def _failed_call(error: BaseException) -> RuntimeError:
    """What a wait raises for a call the channel failed with `error` (its own timeout, a lost or aborting peer)."""
    return _failure(str(error), timed_out=isinstance(error, TimeoutError), like=error)


def _failure(text: str, timed_out: bool, like: Optional[BaseException] = None) -> RuntimeError:
    """The error a wait raises: a RuntimeError, or the mismatch error it was (the ranks' calls differ)."""
    e = type(like)(text) if isinstance(like, _C.ShmMismatchError) else RuntimeError(text)
    e.is_timeout = timed_out   # read by dist._is_timeout
    return e


class ShmTransport:
    """The collectives between the processes of one GlooCommunicator, through shared memory. Collectives
    take flat contiguous CPU tensors of the dtypes in `supports`; each returns a _ShmWork. `sync=True`:
    the caller will wait at once (run inline when nothing is queued).
    One host: one channel over every process. Several hosts (Note [Several hosts]): one channel per host
    over its processes, and the hosts' leaders (the lowest rank of each) meet through torch.distributed."""

    def __init__(self, channel: Any, rank: int, world_size: int, timeout: float, hosts: Optional[list] = None,
                 leaders: Any = None, dist: Any = None, group: Any = None):
        self._channel = channel              # None: this process is alone on its host (several hosts only)
        self.rank, self.world_size = rank, world_size
        self._timeout = float(timeout)
        self._hosts = hosts                  # several hosts: every host's group ranks, ascending
        self._leaders = leaders              # this process leads its host: the leaders' process group
        self._dist, self._group = dist, group
        if hosts is not None:
            self._mine = next(h for h in hosts if rank in h)
        self.kind = "shm" if hosts is None else "shm+gloo"
        self.names_peers = hosts is None     # between hosts, torch.distributed's errors name nobody
        # held while a collective runs (one at a time, in order), and the count of those submitted and
        # not done: native, so that the small-message fast path reads both (shm_fast.py); the executor of
        # the calls made here (Note [One executor] in executor.py)
        self._exec = _C.ShmExec()
        self._executor = Executor("ncclavg-shm", order=self._exec, run=_run_item)
        self._holder: Optional[int] = None   # the thread that holds `exec_lock` for its own order (held())

    # ------------------------------------------------------------------ setup
    @classmethod
    def connect(cls, rank: int, world: int, exchange: Callable[[Any], list], identities: list, timeout: float,
                dist: Any = None, group: Any = None) -> Optional["ShmTransport"]:
        """Collective: a transport when processes of the group share hosts, else None. See Note [When the
        shared-memory channel is used]. `exchange(obj)`: every rank's `obj`, in rank order (one object per
        rank, all ranks calling; the caller bounds it), the setup's only exchange on one host; `dist` and
        `group`: the torch.distributed functions and group the hosts' leaders meet through (several hosts)."""
        mode = setting()
        if mode == "off" or world < 2:
            return None
        hosts: list = []                     # group ranks per host, hosts in the order of their lowest rank
        for r, ident in enumerate(identities):
            found = next((h for h in hosts if identities[h[0]] == ident), None)
            if found is None:
                hosts.append([r])
            else:
                found.append(r)
        if len(hosts) == world:
            if mode == "on":
                raise CommError("NCCLAVG_SHM=1 but no two processes of this group are on one host (or in one "
                                "network namespace): the shared-memory channel needs that")
            return None
        mine = next(h for h in hosts if rank in h)
        local, leader = mine.index(rank), mine[0]
        size = slot_bytes(len(mine))
        # every host's leader creates its host's segment (a host of one process has none), then the others
        # open it; one exchange for the names, one for the outcome: every process decides the same
        channel, error, offer = None, "", None
        if local == 0 and len(mine) > 1:
            offer = (f"ncclavg-{secrets.token_hex(8)}", secrets.randbits(63))
            try:
                channel = _C.ShmChannel(offer[0], 0, len(mine), size, offer[1], mine)   # errors name group ranks
            except (RuntimeError, ValueError) as e:
                error = f"rank {rank}: {e}"
        offers = exchange((offer, error))
        if local > 0 and not offers[leader][1]:
            name, nonce = offers[leader][0]
            try:
                channel = _C.ShmChannel(name, local, len(mine), size, nonce, mine)
            except (RuntimeError, ValueError) as e:
                error = f"rank {rank}: {e}"
        errors = [e for e in exchange(error) if e]
        if local == 0 and channel is not None:
            channel.close_door()   # everyone has joined (or given up)
        leaders = None
        if not errors and len(hosts) > 1 and local == 0:
            try:
                leaders = _leaders_group(dist, group, [h[0] for h in hosts], timeout)
            except Exception as e:   # noqa: BLE001 (the others fail at their next collective, bounded)
                raise CommError(f"rank {rank}: the group of the hosts' leaders could not be made: {e}") from e
        if errors:
            if mode == "on":
                raise CommError(f"NCCLAVG_SHM=1 but the shared-memory channel could not be set up: {errors[0]}")
            warnings.warn(f"ncclavg: the gloo backend stays on torch.distributed; the shared-memory channel "
                          f"could not be set up: {errors[0]}", RuntimeWarning, stacklevel=3)
            return None
        if len(hosts) == 1:
            return cls(channel, rank, world, timeout)
        return cls(channel, rank, world, timeout, hosts=hosts, leaders=leaders, dist=dist, group=group)

    # ------------------------------------------------------------------ collectives
    # Each takes flat contiguous CPU tensors of a `supports` dtype and returns a _ShmWork; `timeout`
    # (seconds) bounds this call (default: the communicator's).
    @property
    def channel(self) -> Any:
        """The core channel when it alone connects every process (one host), for the fast path; else None."""
        return self._channel if self._hosts is None else None

    # `call` (calls.Call): the user's call this collective serves, compared across the ranks in the same
    # round (Note [Call signatures] in csrc/transport/shm_calls.cpp); None: the channel's own signature only.
    def all_reduce_sum(self, t: torch.Tensor, sync: bool = False, timeout: Optional[float] = None,
                       divisor: float = 1.0, call: Optional[Call] = None,
                       finite: Optional[list] = None) -> _ShmWork:
        """divisor != 1: one host only (`channel` is not None); the channel divides in the same pass.
        finite (one host): a list that receives, once the call ran, whether every value the channel wrote
        into `t` is finite (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h)."""
        if self._hosts is not None:
            if divisor != 1.0:
                raise ValueError("divisor: between hosts the channel does not divide")
            return self._submit(self._across_all_reduce, (t,), (t,), sync, timeout, (call,))
        fn, after = self._channel.all_reduce_sum, (1.0, float(divisor)) + _tag(call)
        if finite is not None:
            fn, after = _noting(fn, finite), after + (True,)   # check_finite=True
        return self._submit(fn, (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype]), (t,), sync, timeout, after)

    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, sync: bool = True,
                           timeout: Optional[float] = None, call: Optional[Call] = None,
                           divisor: float = 1.0) -> _ShmWork:
        """divisor != 1: one host only (`channel` is not None); the channel divides in the same pass."""
        if self._hosts is not None:
            assert divisor == 1.0, "only one host's channel divides"
            return self._submit(self._across_reduce_scatter, (out, inp), (out, inp), sync, timeout, (call,))
        return self._submit(self._channel.reduce_scatter_sum,
                            (inp.data_ptr(), out.data_ptr(), out.numel(), TYPE_CODES[out.dtype]), (out, inp), sync,
                            timeout, (1.0, float(divisor)) + _tag(call))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, sync: bool = True,
                   timeout: Optional[float] = None, call: Optional[Call] = None) -> _ShmWork:
        if self._hosts is not None:
            return self._submit(self._across_all_gather, (out, inp), (out, inp), sync, timeout, (call,))
        return self._submit(self._channel.all_gather,
                            (inp.data_ptr(), out.data_ptr(), inp.numel(), TYPE_CODES[inp.dtype]), (out, inp), sync,
                            timeout, _tag(call))

    def broadcast(self, t: torch.Tensor, root: int, sync: bool = True, timeout: Optional[float] = None,
                  call: Optional[Call] = None) -> _ShmWork:
        if self._hosts is not None:
            if root != 0:
                raise ValueError(f"root: between hosts only rank 0 broadcasts, got {root}")
            return self._submit(self._across_broadcast, (t,), (t,), sync, timeout, (call,))
        return self._submit(self._channel.broadcast, (t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], int(root)),
                            (t,), sync, timeout, _tag(call))

    def check(self, call: Call, sync: bool = True, timeout: Optional[float] = None) -> _ShmWork:
        """A round that moves nothing and compares `call` across every rank: before a step that moves the
        call's data another way (gloo)."""
        if self._hosts is not None:
            return self._submit(self._across_check, (), (), sync, timeout, (call,))
        return self._submit(self._channel.barrier, (), (), sync, timeout, _tag(call))

    def abort(self, why: str, mismatch: bool = False) -> None:
        """Ends every rank's wait on the channel with `why` (`mismatch`: the ranks' calls differ)."""
        if self._channel is not None:
            self._channel.abort(why, mismatch)

    def close(self) -> None:
        self._executor.close(self._timeout)

    # ------------------------------------------------------------------ several hosts
    # Note [Several hosts]
    # When the processes span several hosts, a collective runs in three steps, on the worker thread or
    # inline like any other: (1) within each host, through its channel; (2) between the hosts' leaders
    # (the lowest rank of each host), through torch.distributed on a group of the leaders alone; (3)
    # within each host again, from its leader. So each host sends one message per collective over the
    # network instead of one per process.
    # - all_reduce_sum: (1) sums the host's processes in rank order, (2) sums the hosts' sums (gloo's
    #   order), (3) broadcasts the result from the leader: every process of every host gets the
    #   leader's bits, so they all agree.
    # - reduce_scatter_sum: (1) sums the host's inputs, (2) each leader sends every other leader only
    #   the slices of that host's ranks (one all_to_all with per-host sizes) and sums what it receives
    #   in host order (fp32 accumulation, one rounding), (3) hands each process of its host its slice.
    #   The network carries each slice once, not the whole vector twice as an all-reduce would.
    # - all_gather: (1) gathers each host's inputs, (2) the leaders exchange the hosts' blocks with one
    #   all_to_all whose sizes are the hosts' own (no padding to the largest host) and put them in rank
    #   order, (3) broadcasts the whole result.
    # - broadcast is from rank 0, the leader of the first host.
    # A leader whose step (2) fails aborts its host's channel with the reason, so that its host's other
    # processes fail at once instead of waiting out the timeout.
    # The user's call (Note [Call signatures] in csrc/transport/shm_calls.cpp) is compared within each host by
    # step (1)'s round, and between the hosts by the leaders (one all-gather of two words, before the
    # first step (2) of the call); a leader that finds a difference aborts its host's channel with it, so
    # every process of every host fails naming both calls.
    def _local(self, op: str, *args: Any) -> None:
        if self._channel is not None:
            getattr(self._channel, op)(*args)

    def _host_step(self, call: Optional[Call], timeout: float, step: Callable[[], None]) -> None:
        """Step (1), then (on a leader) the leaders' check of the call, which runs even when step (1)
        failed: the other hosts' leaders then fail at once instead of at their timeout."""
        try:
            step()
        except Exception as e:   # noqa: BLE001 (re-raised below)
            self._leaders_check(call, timeout, ok=False)
            raise e
        self._leaders_check(call, timeout)

    def _leaders_check(self, call: Optional[Call], timeout: float, ok: bool = True) -> None:
        if call is None or call.checked or self._leaders is None:
            return
        backend = getattr(self._leaders, "backend", self._leaders)   # a _Group of the backend's setup, or a group
        leaders = [h[0] for h in self._hosts]
        try:
            check_over_gloo(backend, call, leaders.index(self.rank), len(leaders), timeout, labels=leaders,
                            where="between the hosts' leaders", ok=ok)
        except CallMismatchError as e:
            self.abort(str(e), mismatch=True)
            raise
        except Exception as e:   # noqa: BLE001 (re-raised as a step (2) failure, after the host is told)
            if ok:
                self._between_hosts("the calls' check", lambda err=e: _Raise(err), timeout)

    def _between_hosts(self, what: str, start: Callable[[], Any], timeout: float) -> None:
        try:
            start().wait(timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:   # noqa: BLE001 (re-raised, after the host's channel is told)
            why = f"rank {self.rank} (the leader of its host): {what} between the hosts failed: {e}"
            self.abort(why)
            if is_timeout(e):
                raise TimeoutError(why) from e
            raise RuntimeError(why) from e

    def _across_all_reduce(self, t: torch.Tensor, timeout: float, call: Optional[Call]) -> None:
        ptr, n, code = t.data_ptr(), t.numel(), TYPE_CODES[t.dtype]
        self._host_step(call, timeout, lambda: self._local("all_reduce_sum", ptr, n, code, timeout, 1.0, 1.0,
                                                           *_tag(call)))
        if self._leaders is not None:
            self._between_hosts("all_reduce", lambda: self._dist.all_reduce(
                t, op=self._dist.ReduceOp.SUM, group=self._leaders, async_op=True), timeout)
        self._local("broadcast", ptr, n, code, 0, timeout, *_tag(call))

    def _host_order(self, per_rank: torch.Tensor) -> torch.Tensor:
        """per_rank: world_size blocks in rank order -> the same blocks grouped by host, hosts in order."""
        blocks = per_rank.view(self.world_size, -1)
        return torch.cat([blocks[h] for h in self._hosts]).reshape(-1)

    def _across_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, timeout: float,
                               call: Optional[Call]) -> None:
        n, code = out.numel(), TYPE_CODES[out.dtype]
        host_sum = inp.reshape(-1).clone()
        self._host_step(call, timeout, lambda: self._local(                                    # (1)
            "all_reduce_sum", host_sum.data_ptr(), host_sum.numel(), code, timeout, 1.0, 1.0, *_tag(call)))
        mine = torch.empty(len(self._mine) * n, dtype=out.dtype)   # this host's ranks' slices, summed
        if self._leaders is not None:                                                          # (2)
            send = self._host_order(host_sum)
            got = torch.empty(len(self._hosts) * mine.numel(), dtype=out.dtype)
            self._between_hosts("all_to_all", lambda: self._dist.all_to_all_single(
                got, send, [mine.numel()] * len(self._hosts), [len(h) * n for h in self._hosts],
                group=self._leaders, async_op=True), timeout)
            parts = got.view(len(self._hosts), -1)
            acc = parts[0].to(torch.float64 if out.dtype == torch.float64 else torch.float32, copy=True)
            for part in parts[1:]:
                acc += part
            mine.copy_(acc)
        self._local("broadcast", mine.data_ptr(), mine.numel(), code, 0, timeout, *_tag(call))   # (3)
        at = self._mine.index(self.rank) * n
        out.view(-1).copy_(mine[at:at + n])

    def _across_all_gather(self, out: torch.Tensor, inp: torch.Tensor, timeout: float,
                           call: Optional[Call]) -> None:
        n, code = inp.numel(), TYPE_CODES[inp.dtype]
        mine = torch.empty(len(self._mine) * n, dtype=inp.dtype)

        def gather_host() -> None:                                                             # (1)
            if self._channel is not None:
                self._channel.all_gather(inp.data_ptr(), mine.data_ptr(), n, code, timeout, *_tag(call))
            else:
                mine.copy_(inp.reshape(-1))

        self._host_step(call, timeout, gather_host)
        flat = out.view(-1)
        if self._leaders is not None:                                                          # (2)
            got = torch.empty(self.world_size * n, dtype=inp.dtype)
            sizes = [len(h) * n for h in self._hosts]
            self._between_hosts("all_to_all", lambda: self._dist.all_to_all_single(
                got, mine.repeat(len(self._hosts)), sizes, [mine.numel()] * len(self._hosts),
                group=self._leaders, async_op=True), timeout)
            at = 0
            for members in self._hosts:
                for r in members:
                    flat[r * n:(r + 1) * n] = got[at:at + n]
                    at += n
        self._local("broadcast", flat.data_ptr(), flat.numel(), code, 0, timeout, *_tag(call))   # (3)

    def _across_broadcast(self, t: torch.Tensor, timeout: float, call: Optional[Call]) -> None:
        if call is not None:   # (1): the host's ranks agree on the call before the hosts move data
            self._host_step(call, timeout, lambda: self._local("barrier", timeout, *_tag(call)))
        if self._leaders is not None:
            src = self._dist.get_global_rank(self._group, 0) if self._group is not None else 0
            self._between_hosts("broadcast", lambda: self._dist.broadcast(
                t, src=src, group=self._leaders, async_op=True), timeout)
        self._local("broadcast", t.data_ptr(), t.numel(), TYPE_CODES[t.dtype], 0, timeout, *_tag(call))

    def _across_check(self, timeout: float, call: Call) -> None:
        """(1) the host's ranks agree, (2) the leaders agree, (3) a round in which the host's other ranks
        learn the leader's verdict (it aborts the channel on a mismatch)."""
        self._host_step(call, timeout, lambda: self._local("barrier", timeout, *_tag(call)))
        self._local("barrier", timeout, *_tag(call))

    # ------------------------------------------------------------------ execution
    # Note [An order held by the caller]
    # The torch backend orders its group's collectives itself (process_group.lane.Lane: one per group, and one
    # channel per group): a second queue here would only add a thread hop and a Work per step. So its
    # lane takes `exec_lock` (the lock the small-message fast path takes too), calls held(True) on the
    # thread that runs the job, and every collective called on that thread then runs at once, here, and
    # returns a work that is already done (or raises the channel's own error when waited). The lane
    # also counts its queued jobs in `exec_lock.outstanding`, so a fast path never overtakes them.
    @property
    def exec_lock(self) -> Any:
        """The native lock held while a collective runs (_C.ShmExec), and the count of those outstanding."""
        return self._exec

    def held(self, yes: bool) -> None:
        """The calling thread holds exec_lock (yes) or no longer does: see Note [An order held by the caller]."""
        self._holder = threading.get_ident() if yes else None

    def _submit(self, fn: Callable, args: tuple, keep: tuple, sync: bool, timeout: Optional[float],
                after: tuple = ()) -> Any:
        """Runs fn(*args, timeout, *after), inline or on the worker (shm_fast.py runs the fast path)."""
        if self._holder is not None and self._holder == threading.get_ident():
            try:
                fn(*args, self._timeout if timeout is None else float(timeout), *after)
            except BaseException as e:   # noqa: BLE001 (raised by the wait, as a queued call's would be)
                return _Raise(e)
            return _DONE
        limit = self._timeout if timeout is None else float(timeout)
        # Note [A synchronous call on an idle channel]; an asynchronous one too when it is small and its
        # peers are in it already (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp)
        here = sync or (self._hosts is None and sum(t.nbytes for t in keep) <= ASYNC_INLINE_BYTES)
        if here and self._exec.acquire(False):
            if self._exec.outstanding == 0 and not self._executor.closed and \
                    (sync or self._channel.peers_ready(ASYNC_READY_S)):
                started = time.monotonic()
                try:
                    fn(*args, limit, *after)
                except BaseException as e:   # noqa: BLE001 (raised by the wait, as a queued call's would be)
                    return _Ran(started, self.names_peers, e)
                finally:
                    self._exec.release()
                return _Ran(started, self.names_peers)
            self._exec.release()
        work = _ShmWork(self, keep)
        call = (fn, args + (limit,) + after)
        if self._executor.submit((work, call), inline=sync) is not None:
            raise RuntimeError("the shared-memory channel is closed")
        return work


def _run_item(item: tuple) -> None:
    """A queued channel call on the executor: the work records its own error (_ShmWork._run)."""
    work, call = item
    work._run(*call)
