"""Two hosts on one machine for the multi-host tests (Note [Two hosts from network namespaces]): two
network namespaces joined by a veth pair, and torchrun started in each as one node of a two-node job.

Note [Two hosts from network namespaces]
A network namespace has its own interfaces, addresses, routes and ports: processes in two of them can
talk only over the veth pair between them, as two hosts talk over a wire, so every byte that gloo and
the rendezvous store move between the nodes crosses that link (its counters prove it). Each pair gets
namespace and interface names of its own (pid and a counter), created directly inside the namespaces,
so concurrent tests never collide; the subnet exists only inside the pair, so it cannot clash with the
machine's networks either. Namespaces need root and `ip` (iproute2); where either is missing, or the
kernel refuses a namespace or a veth pair, `NetnsUnavailable` says why and the tests skip.
What the launch needs, because both namespaces share one hostname (which resolves to 127.0.0.1):
- GLOO_SOCKET_IFNAME=<the node's veth>: gloo otherwise binds the address its hostname resolves to,
  loopback, unreachable from the other node.
- The static rendezvous (--master-addr host 0's address, --master-port, --node-rank): host 0's agent
  hosts the store there and hands that address to every worker. The c10d rendezvous works too but needs
  `--rdzv-conf is_host=1|0` (it guesses the store's host by matching the endpoint against the hostname's
  addresses, which fails in both namespaces) and `--local-addr` (else host 0's workers are told to reach
  the store at "localhost"), and its rendezvous costs seconds more.
`down()` kills every process still inside either namespace (`ip netns pids`) before deleting them: the
veth pair goes with its namespaces, and nothing a failed test started keeps running.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

SUBNET = "10.231.87"   # a private /24 (RFC 1918); it exists only inside each pair of namespaces
MASTER_PORT = 29517    # host 0's store; nothing else listens inside its namespace
_SEQ = itertools.count()
_IP_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here; the message says why (the tests skip with it)."""


@dataclass(frozen=True)
class Host:
    netns: str    # the namespace's name (`ip netns exec <netns> ...`)
    ifname: str   # its end of the veth pair
    addr: str     # that end's address


class TwoHosts:
    """Two namespaces and the veth pair joining them; `up()` makes them, `down()` removes them."""

    def __init__(self) -> None:
        self.ip = shutil.which("ip", path=_IP_SEARCH_PATH)
        tag = f"{os.getpid()}x{next(_SEQ)}"
        # interface names: at most 15 characters
        self.hosts = tuple(Host(f"ncclavg-h{k}-{tag}", f"nv{k}{tag}"[:15], f"{SUBNET}.{k + 1}") for k in (0, 1))
        self._made: list[str] = []

    def _ip(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run([self.ip, *args], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def up(self) -> "TwoHosts":
        if self.ip is None:
            raise NetnsUnavailable("`ip` (iproute2) is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (running as uid %d)" % os.geteuid())
        for h in self.hosts:
            r = self._ip("netns", "add", h.netns, check=False)
            if r.returncode != 0:
                raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
            self._made.append(h.netns)
        a, b = self.hosts
        r = self._ip("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname,
                     "netns", b.netns, check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot make a veth pair: {r.stderr.strip()}")
        for h in self.hosts:
            self._ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            self._ip("-n", h.netns, "link", "set", "lo", "up")   # the workers' own local traffic
            self._ip("-n", h.netns, "link", "set", h.ifname, "up")
        return self

    def pids(self, k: int) -> list[int]:
        """Every process inside host k's namespace."""
        r = self._ip("netns", "pids", self.hosts[k].netns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def rx_bytes(self, k: int) -> int:
        """Bytes host k received over its end of the veth pair."""
        h = self.hosts[k]
        link = json.loads(self._ip("-j", "-s", "-n", h.netns, "link", "show", h.ifname).stdout)[0]
        return int(link["stats64"]["rx"]["bytes"])

    def kill_all(self, k: int, sig: int = signal.SIGKILL) -> list[int]:
        """Sends `sig` to every process inside host k's namespace (SIGKILL: the host is gone; SIGSTOP: it
        is frozen); returns their pids."""
        pids = self.pids(k)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, k: int, up: bool) -> None:
        """Sets host k's end of the veth pair up or down, inside its namespace (down: the cable is cut)."""
        h = self.hosts[k]
        self._ip("-n", h.netns, "link", "set", h.ifname, "up" if up else "down")

    def down(self) -> None:
        for k in range(len(self._made)):
            self.kill_all(k)
        deadline = time.monotonic() + 10
        while any(self.pids(k) for k in range(len(self._made))) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in self._made:
            self._ip("netns", "del", name, check=False)   # takes its end of the veth pair with it
        self._made.clear()

    def torchrun(self, k: int, *args: str, nproc: int = 1, max_restarts: int = 0) -> list[str]:
        """The command starting node k of a two-node torchrun job (`nproc` processes per node) inside host k;
        `max_restarts`: how often torchrun restarts the group after a worker failed."""
        return [self.ip, "netns", "exec", self.hosts[k].netns,
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                "--node-rank", str(k), "--master-addr", self.hosts[0].addr, "--master-port", str(MASTER_PORT),
                "--max-restarts", str(max_restarts), *args]

    def env(self, k: int, base: dict) -> dict:
        """`base` plus what node k's processes need: gloo on the node's veth (Note above)."""
        return dict(base, GLOO_SOCKET_IFNAME=self.hosts[k].ifname)


def two_hosts_fixture():
    """The body of a pytest fixture: TwoHosts up for the test, down afterwards; the test is skipped
    (with the reason) where network namespaces cannot be made."""
    import pytest

    pair = TwoHosts()
    try:
        pair.up()
    except NetnsUnavailable as e:
        pair.down()
        pytest.skip(f"two hosts need network namespaces: {e}")
    except BaseException:
        pair.down()
        raise
    try:
        yield pair
    finally:
        pair.down()
