"""The transport between hosts on UCX (transport "shm+ucx"): each host's shared-memory channel inside it,
the core's native lanes between the hosts (Note [Lanes between hosts] in csrc/transport/host_lanes.cpp,
Note [The lanes' pipeline] in csrc/transport/host_lanes_collectives.cpp). `UcxHostsTransport` offers the
primitives of `ShmTransport` under the same names, so that the runners' jobs (paths.py) call either;
host_setup.py makes it, and falls back to the gloo lanes (hosts.py) when UCX is absent or does not start.

Note [Choosing UCX between hosts]
NCCLAVG_UCX=auto (the default) uses UCX between hosts when libucp loads and every rank's lanes connect,
else gloo's lanes, saying why once; =1 makes that an error; =0 keeps gloo. libucp comes from
NCCLAVG_UCX_LIBRARY (a system UCX: RDMA), the libucx wheel (`pip install ncclavg[hosts]`), or the system
loader path. The lanes use UCX's network transports only (NCCLAVG_UCX_TLS, default "tcp"): processes that
stand for hosts on one machine share its memory, and a shared-memory transport would skip the link being
measured. NCCLAVG_HOSTS_IFNAME (else GLOO_SOCKET_IFNAME) lists the interfaces, comma-separated: lane k goes
over interface k % count, so every listed NIC carries traffic when a host runs as many processes as NICs
(a process that carries several lanes gets all of theirs).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional

import torch

from .._ext import _C
from ..buffers import channel_type_code
from ..errors import CommError
from .._ext import devices_for, hosts_interfaces, ucx_load, ucx_setting, ucx_transports
from .host_layout import HostsLayout
from .host_pipes import env_int, chunk_bytes, depth
from .shm import tag

_warned: set = set()

# Note [The lanes' chunk on UCX]
# CHUNK_BYTES: the bytes of one chunk of a collective between hosts on UCX's lanes (each lane carries its
# shard of it); DEPTH: the chunks in flight. Swept with bench/hosts.py, 2 hosts x 2 processes, 2500 Mbit/s
# + 0.1 ms, a 2-core Xeon, one launch of 8 calls each (fraction of the line rate at 4 MiB / 32 MiB):
# 256 KiB x 4: 0.89 / 0.95; 512 KiB x 4: 0.89 / 0.98; 512 KiB x 8: 0.89 / 0.97; 1 MiB x 2: 0.86 / 0.97;
# 1 MiB x 4: 0.86 / 0.97; 2 MiB x 2 (gloo's lanes' setting): 0.79 / 0.96. The native loop costs a chunk a
# few microseconds, so chunks can be small: the pipeline's fill and drain (about one chunk's time on the
# wire) shrink with them, down to where a chunk's channel rounds and messages start to show (256 KiB).
# Four in flight keep every lane's connection busy while a chunk's host steps run; more bought nothing.
# NCCL's proxy (512 KiB steps) and Open MPI's HAN (512 KiB segments) landed on the same size.
# Swept again after the waits began to yield and TCP's receive segment grew (ms at 4 MiB / 32 MiB, 2 x 2,
# one launch pair each): 2500 Mbit/s + 0.1 ms 512 KiB x 4 14.99 / 109.9, 256 KiB x 4 14.78 / 110.9, 256 KiB
# x 8 15.01 / 110.0 (all within the runs' spread, 0.88-0.91 of the line rate at 4 MiB); on the unshaped veth
# link, where a chunk's CPU shows, 4.56 / 34.8 against 5.20 / 40.3 and 4.90 / 38.8: 512 KiB x 4 stays.
# NCCLAVG_HOSTS_CHUNK_KB and NCCLAVG_HOSTS_DEPTH override them (for both kinds of lanes).
CHUNK_BYTES = 512 << 10
DEPTH = 4


def spin_us() -> int:
    """NCCLAVG_HOSTS_SPIN_US, else the engine's own: how long a wait between hosts polls, yielding the core
    between polls, before it sleeps on UCX's event fd (Note [Lanes between hosts] in host_lanes.cpp)."""
    return env_int("NCCLAVG_HOSTS_SPIN_US", _C.HostLanes.SPIN_US, 0, _C.HostLanes.MAX_SPIN_US)


def say_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=4)


def start(hosts: List[List[int]], rank: int, channel: Any, exchange: Callable[[Any], list],
          timeout: float) -> Optional["UcxHostsTransport"]:
    """Collective over the group: the lanes on UCX when every rank started them, else None (the caller
    falls back to gloo's lanes, and this says why, once). Two exchanges: every rank's address or error,
    then every rank's outcome of connecting (its hello with each peer)."""
    mode = ucx_setting()   # (a setting that is wrong raises here, on every rank alike)
    tls, nics, chunk, ahead = ucx_transports(), hosts_interfaces(), chunk_bytes(CHUNK_BYTES), depth(DEPTH)
    spin = spin_us()
    if mode == "off":   # (the setting is the job's: every rank returns here)
        return None
    lanes, error = None, ""
    try:
        found = ucx_load()
        if not found["loaded"]:
            raise RuntimeError(found["error"])
        layout = HostsLayout(hosts, rank)
        mine = layout.lanes_of[layout.local]
        lanes = _C.HostLanes(hosts, rank, channel, tls, devices_for(mine, nics), chunk, ahead, spin)
    except (RuntimeError, ValueError) as e:
        error = f"rank {rank}: {e}"
    offers = exchange((lanes.address if lanes is not None else b"", error))
    errors = [e for _, e in offers if e]
    if not errors:
        try:
            lanes.connect([a for a, _ in offers], min(timeout, 60.0))   # type: ignore[union-attr]
        except (RuntimeError, ValueError, TimeoutError) as e:
            error = f"rank {rank}: the lanes between the hosts did not connect: {e}"
        errors = [e for e in exchange(error) if e]
    if errors:
        why = f"UCX between the hosts did not start ({errors[0]})"
        if mode == "on":
            raise CommError(f"NCCLAVG_UCX=1 but {why}")
        say_once(f"ncclavg: gloo carries the traffic between hosts: {why}")
        return None
    return UcxHostsTransport(channel, rank, sum(len(h) for h in hosts), hosts, lanes)


class UcxHostsTransport:
    """The processes of a group on several hosts, with the core's lanes on UCX between them: `channel` this
    host's (None when this process is alone on its host), `lanes` the core's HostLanes. Its primitives are
    ShmTransport's, each one call into the core (one native loop, the GIL released)."""

    channel = None   # no one channel over every process: the channel's fast paths are off
    between_hosts = True
    # the lanes' errors name the rank they lost or the peer that said why (Note [Failures are told by type])
    names_peers = True

    def __init__(self, channel: Any, rank: int, world_size: int, hosts: List[List[int]], lanes: Any):
        self._channel, self.lanes = channel, lanes
        self.host_channel = channel   # this host's, None when alone
        # the arrival times of every rank of every host, on this process's clock (stragglers.py reads them)
        self.arrival_source = lanes
        self.fast_target = lanes   # the native fast all-reduce (comm/fast_average.py): one call into the lanes
        # "ucx": every process alone on its host (no channel anywhere)
        self.kind = "shm+ucx" if max(len(h) for h in hosts) > 1 else "ucx"
        self.rank, self.world_size, self.hosts = rank, world_size, hosts

    def all_reduce_sum(self, t: torch.Tensor, job: Any, divisor: float = 1.0, check_finite: bool = False) -> None:
        """t = the sum over every rank of every host, the same bits on every rank; `check_finite` is not
        answered between hosts (None: the step's reader scans)."""
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the sum is not divided in the pass")
        self.lanes.all_reduce_sum(t.data_ptr(), t.numel(), channel_type_code(t.dtype), job.channel_limit(),
                                  *tag(job.call))

    def reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor, job: Any, divisor: float = 1.0) -> None:
        if divisor != 1.0:
            raise ValueError("divisor: between hosts the sum is not divided in the pass")
        self.lanes.reduce_scatter_sum(inp.data_ptr(), out.data_ptr(), out.numel(), channel_type_code(out.dtype),
                                      job.channel_limit(), *tag(job.call))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, job: Any) -> None:
        self.lanes.all_gather(inp.data_ptr(), out.data_ptr(), inp.numel(), channel_type_code(inp.dtype),
                              job.channel_limit(), *tag(job.call))

    def broadcast(self, t: torch.Tensor, root: int, job: Any) -> None:
        self.lanes.broadcast(t.data_ptr(), t.numel(), channel_type_code(t.dtype), int(root), job.channel_limit(),
                             *tag(job.call))

    def check(self, job: Any) -> None:
        self.lanes.check(job.channel_limit(), *tag(job.call))

    def stalled_on(self) -> str:
        """"": the rank this process waits for may itself wait on another; the heartbeats name the lost one."""
        return ""

    def abort(self, why: str, mismatch: bool = False) -> None:
        """Ends this process's waits with `why`, and tells its peers and its host's channel."""
        if self._channel is not None:
            self._channel.abort(why, mismatch)
        self.lanes.abort(why)

    def close(self) -> None:
        pass
