"""The transport between the processes of one host: the core's shared-memory channel (Note [Shared-memory
channel] in csrc/transport/shm_channel.cpp). `ShmTransport` holds one host's channel and offers its
primitives (all_reduce_sum, reduce_scatter_sum, all_gather, broadcast, check), called inside a job of
the runner that owns the channel (runner.py) and handed that job, whose deadline gives each its limit;
host_setup.py's `connect` makes it (or, for processes on several hosts, ucx.py's UcxHostsTransport or
hosts.py's HostsTransport, which have the same primitives).

Note [When the shared-memory channel is used]
GlooCommunicator groups its processes by host identity: the kernel's boot id and the process's network,
IPC, PID and mount namespaces. Processes in separate network namespaces are separate hosts on purpose,
even when they could share /dev/shm: that is how containers, and the two-host test, say "another
machine". All on one host: one channel over every process (transport "shm"). Several hosts, some with
several processes: a channel per host and torch.distributed between the hosts' leaders (transport
"shm+gloo", Note [Several hosts] in hosts.py). Every process alone on its host: no channel ("gloo"). The setup
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
Every primitive carries its own time limit (the job's: Note [One deadline per call] in runner.py) and
the user's call, compared across the ranks in the same round (Note [Call signatures] in
csrc/transport/shm_calls.cpp).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..buffers import channel_type_code, is_channel_type
from . import failure as F
from .calls import Call

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


def supports(t: torch.Tensor) -> bool:
    """A tensor the channel's sums take: contiguous, on the CPU, of a channel type."""
    return is_channel_type(t.dtype) and t.device.type == "cpu" and t.is_contiguous()


def stalled_text(channel: Any) -> str:
    """" (rank 1 stopped responding: ...)" for the rank `channel` waits for now (the same words as the
    channel's own timeout and the heartbeats' diagnosis), or ""."""
    r = channel.waiting_on
    return F.lost([r], "it has not reached this collective on the channel") if r >= 0 else ""


def tag(call: Optional[Call]) -> tuple:
    """The channel's (tag, tag_count) arguments of a user call (Note [Call signatures])."""
    return (0, 0) if call is None else (call.tag, call.count)


class ShmTransport:
    """One host's channel over every process of a group: its primitives, called inside a runner's job,
    each given the job (`job.channel_limit()` its limit, `job.call` the call the ranks compare: Note [One
    deadline per call] in runner.py). Each takes flat contiguous CPU tensors of a channel type."""

    kind = "shm"
    between_hosts = False
    names_peers = True   # its errors name the rank that stopped (Note [Failures are told by type] in failure.py)

    def __init__(self, channel: Any, rank: int, world_size: int):
        self.channel = channel   # the core's _C.ShmChannel, which the fast paths call directly too
        self.host_channel = channel   # the one of this host (stragglers.py reads its arrival times)
        self.fast_target = channel   # what the native fast all-reduce runs on (comm/fast_average.py)
        self.rank, self.world_size = rank, world_size

    def all_reduce_sum(self, t: torch.Tensor, job: Any, divisor: float = 1.0,
                       check_finite: bool = False) -> Optional[bool]:
        """t = the sum over the ranks (divided by `divisor` in the same pass). `check_finite`: returns
        whether every value written is finite, the same on every rank (Note [Finiteness from the pass that
        writes] in csrc/common/finite_math.h); else None."""
        noted = self.channel.all_reduce_sum(t.data_ptr(), t.numel(), channel_type_code(t.dtype), job.channel_limit(),
                                            1.0, float(divisor), *tag(job.call), bool(check_finite))
        return noted if check_finite else None

    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, job: Any, divisor: float = 1.0) -> None:
        """out = this rank's slice of the sum over the ranks of inp (divided by `divisor` in the same pass)."""
        self.channel.reduce_scatter_sum(inp.data_ptr(), out.data_ptr(), out.numel(), channel_type_code(out.dtype),
                                        job.channel_limit(), 1.0, float(divisor), *tag(job.call))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, job: Any) -> None:
        self.channel.all_gather(inp.data_ptr(), out.data_ptr(), inp.numel(), channel_type_code(inp.dtype),
                                job.channel_limit(), *tag(job.call))

    def broadcast(self, t: torch.Tensor, root: int, job: Any) -> None:
        self.channel.broadcast(t.data_ptr(), t.numel(), channel_type_code(t.dtype), int(root), job.channel_limit(),
                               *tag(job.call))

    def check(self, job: Any) -> None:
        """A round that moves nothing and compares the job's call across every rank: before a step that
        moves the call's data another way (gloo)."""
        self.channel.barrier(job.channel_limit(), *tag(job.call))

    def peers_ready(self, wait_s: float) -> bool:
        """Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp."""
        return bool(self.channel.peers_ready(wait_s))

    def stalled_on(self) -> str:
        """Words naming the rank a collective of this process waits for on the channel now, or ""."""
        return stalled_text(self.channel)

    def abort(self, why: str, mismatch: bool = False) -> None:
        """Ends every rank's wait on the channel with `why` (`mismatch`: the ranks' calls differ)."""
        self.channel.abort(why, mismatch)

    def close(self) -> None:
        pass   # the segment goes with the channel object
