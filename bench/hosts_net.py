"""The network of bench/hosts.py: H hosts as network namespaces, each with N NICs (TUN devices), NIC k
of every host joined to the others through switch k, a delay line (bench/hosts_delay.c, Note [A delay
line between two TUN devices] there) that this module builds with gcc and starts itself; tbf on each NIC
shapes what the host sends. Or, for the link `veth`, unshaped: NIC k of every host a veth whose peer is a
port of Linux bridge k, the bridges in a namespace of the run's own. Everything it makes is named with
PREFIX and this process's id, and `down()` removes it; `clean_leftovers()` removes what a killed earlier
run left.

Note [Hosts joined by switches]
Each host has one NIC per switch (a "rail": NIC k of every host on switch k, as multi-NIC clusters
wire them), named the same in every host (nvbhn0, nvbhn1, ...: one GLOO_SOCKET_IFNAME serves every
host), with address 10.233.k.(h+1)/24; the subnet of switch k is reachable only through NIC k. So every
packet between two hosts leaves one host through its NIC's tbf (the host's line rate), waits the
one-way delay in the delay line, leaves the switch port at most at the line rate, and enters the other
host through its NIC: each NIC's byte counters see every byte the host sends or receives (loopback
carries only the host's own traffic). Two hosts make a wire; three or more a switch with the same
per-host rate, which is what T* = 2(H-1)/H x S / R assumes (each host's NIC is the bottleneck), where
direct pairs of links would let a host send at (H-1) x R. With N NICs each is shaped to R/N.
A host talks to another host's NIC k address through its own NIC k (a connected route), so a process
whose gloo binds NIC k (GLOO_SOCKET_IFNAME) and connects to peers bound to NIC j sends through NIC j:
every byte still crosses a shaped, delayed link.
The MTU is large by default (--mtu, 65535): a real NIC hands the kernel 64 KiB segments (TSO, GRO),
and a TUN does neither, so a 1500-byte MTU would charge the hosts (and this 2-core machine) for 40x
the packets a real host handles (measured: the delay line's CPU time doubles at a 9000-byte MTU, and a
1500-byte MTU caps the link at ~1 Gbit/s each way on 2 cores).
tbf's burst is 256 KiB (at least two MTUs): with a burst of one MTU, tbf's timer wakeups on this VM
held one TCP stream to 93% of 2500 Mbit/s (2330), with 256 KiB it reaches 99.8% (2495). The burst does
not reach the other host as a burst: the switch port spaces the packets at the line rate.
The link `veth` (--links veth) is the unshaped counterpart: NIC k of each host is one end of a veth pair
whose other end is a port of a Linux bridge, switch k, in a namespace of its own (the run's tag and
"-sw", so the root namespace holds nothing of the run and the namespaces' removal takes the bridges and
the pairs with it). No tbf, no delay line, no rate or delay to configure: the fastest link this machine
has between two namespaces, kernel-only (a veth hands the packet, a 64 KiB GSO segment, to its peer
without a copy, and the bridge forwards it the same way), where the TUN line copies every packet twice
through a process in user space. It shows what a contender does when the wire is not the bottleneck;
the hosts' CPU (and the kernel's work on their behalf) is. The same addresses, names and MTU as the TUN
link, and every byte between hosts still crosses a NIC (a veth counts what it sends and receives).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "nvbh"                   # every namespace, device, process tag and file of this benchmark
SUBNET = "10.233"                 # 10.233.<nic>.<host + 1>/24; it exists only inside the namespaces
HERE = Path(__file__).resolve().parent
DELAY_SOURCE = HERE / "hosts_delay.c"
NETNS_DIR = Path("/var/run/netns")   # where `ip netns add` mounts a namespace (the forwarder's setns)
ETC_NETNS = Path("/etc/netns")       # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
RT_PRIORITY = 10                  # the delay line's SCHED_FIFO priority (when the kernel grants it)
TBF_LIMIT = 4 << 20               # bytes tbf may queue: above what TCP's small queues let sockets park
TBF_BURST = 256 << 10             # Note [Hosts joined by switches]


_SEQ = itertools.count()


def new_tag() -> str:
    """PREFIX, this process's id and a counter: unique on the machine while this process lives."""
    return f"{PREFIX}{os.getpid()}x{next(_SEQ)}"


def names_run(tag: str, name: str) -> bool:
    """`name` (a file, namespace or argument) belongs to run `tag`: the tag followed by "-" or the end,
    not preceded by a letter or digit (nvbh12x1 is not part of nvbh12x10-h0 or anvbh12x1-)."""
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(tag)}(?:-|$)", name) is not None


class HostsUnavailable(Exception):
    """The emulated hosts cannot be made here; the message says why (the tests skip with it)."""


@dataclass(frozen=True)
class Link:
    """One NIC's worth of wire: rate in Mbit/s (whole host; N NICs share it), one-way delay in ms; or, with
    `veth`, an unshaped veth into a bridge (Note [Hosts joined by switches]), whose rate and delay mean
    nothing (0)."""
    rate_mbit: float
    delay_ms: float
    veth: bool = False

    @property
    def label(self) -> str:
        return "unshaped veth" if self.veth else f"{self.rate_mbit:g} Mbit/s + {self.delay_ms:g} ms"


VETH = Link(0.0, 0.0, veth=True)


def parse_links(text: str, arg: str = "--links") -> list[Link]:
    """"2500:0.1,1000:0.5,veth" -> [Link(2500, 0.1), Link(1000, 0.5), VETH]: RATE_MBIT:DELAY_MS or `veth`,
    comma-separated."""
    links = []
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        if part == "veth":
            links.append(VETH)
            continue
        m = re.fullmatch(r"(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)", part)
        if not m:
            raise ValueError(f"{arg}: {part!r} is not RATE_MBIT:DELAY_MS (e.g. 2500:0.1) or veth")
        rate, delay = float(m.group(1)), float(m.group(2))
        if not 1 <= rate <= 100000:
            raise ValueError(f"{arg}: rate {rate:g} Mbit/s is outside 1 to 100000")
        if delay > 1000:
            raise ValueError(f"{arg}: delay {delay:g} ms is above 1000")
        links.append(Link(rate, delay))
    if not links:
        raise ValueError(f"{arg}: no link given (e.g. 2500:0.1)")
    return links


def tool(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def preflight(tun: bool = True) -> None:
    """Raises HostsUnavailable naming what is missing: root, `ip`, `tc`, and for the TUN links (`tun`: not
    needed by veth links alone) /dev/net/tun and gcc (the delay line)."""
    if os.geteuid() != 0:
        raise HostsUnavailable(f"network namespaces and TUN devices need root (running as uid {os.geteuid()})")
    needed = (("ip", "iproute2"), ("tc", "iproute2")) + ((("gcc", "gcc"),) if tun else ())
    for name, package in needed:
        if tool(name) is None:
            raise HostsUnavailable(f"`{name}` ({package}) is not installed")
    if tun and not os.path.exists("/dev/net/tun"):
        raise HostsUnavailable("/dev/net/tun is missing (no TUN support in this kernel or container)")


def build_forwarder(into: Path) -> Path:
    """The delay line compiled from hosts_delay.c into `into` (named by the source's hash)."""
    src = DELAY_SOURCE.read_bytes()
    exe = Path(into) / f"{PREFIX}_delay_{hashlib.sha256(src).hexdigest()[:12]}"
    if not exe.exists():
        tmp = exe.with_suffix(".tmp")
        r = subprocess.run([tool("gcc") or "gcc", "-O2", "-Wall", "-o", str(tmp), str(DELAY_SOURCE)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"gcc could not build {DELAY_SOURCE.name}:\n{r.stderr}")
        tmp.rename(exe)
    return exe


def run(cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


@dataclass(frozen=True)
class Host:
    index: int
    netns: str                 # `ip netns exec <netns>`; also the host's hostname (MPI's node name)
    addrs: tuple[str, ...]     # one per NIC

    @property
    def hostname(self) -> str:
        return self.netns


@dataclass
class Forwarder:
    proc: subprocess.Popen
    nic: int
    sched: str = ""
    stats: dict | None = None   # its last words (JSON), once stopped


@dataclass
class Network:
    """H hosts x N NICs joined by switches (Note [Hosts joined by switches]): delay lines, or bridges for
    a veth link; `up()` makes it, `down()` removes all of it (also after a failed `up()`)."""
    hosts_n: int
    link: Link
    nics: int = 1
    mtu: int = 65535
    queue_bytes: int = 4 << 20        # each switch port's buffer
    rt: bool = True                   # the delay line asks for SCHED_FIFO
    shaped: bool = True               # False: no tbf and no port rate (the delay line's own ceiling)
    tag: str = field(default_factory=lambda: new_tag())
    hosts: list[Host] = field(default_factory=list)
    forwarders: list[Forwarder] = field(default_factory=list)
    workdir: Path | None = None
    forwarders_stats: list = field(default_factory=list)   # the delay lines' last words, after down()

    def __post_init__(self) -> None:
        if not 2 <= self.hosts_n <= 9:
            raise ValueError(f"hosts: {self.hosts_n} is outside 2 to 9")
        if not 1 <= self.nics <= 4:
            raise ValueError(f"nics: {self.nics} is outside 1 to 4")
        if not 1280 <= self.mtu <= 65535:
            raise ValueError(f"mtu: {self.mtu} is outside 1280 to 65535")
        self.hosts = [Host(h, f"{self.tag}-h{h}", tuple(f"{SUBNET}.{k}.{h + 1}" for k in range(self.nics)))
                      for h in range(self.hosts_n)]

    @property
    def ip(self) -> str:
        return tool("ip") or "ip"

    @property
    def unshare(self) -> str:
        return tool("unshare") or "unshare"

    @staticmethod
    def ifname(nic: int) -> str:
        return f"{PREFIX}n{nic}"

    @property
    def ifnames(self) -> list[str]:
        return [self.ifname(k) for k in range(self.nics)]

    @property
    def nic_rate_mbit(self) -> float:
        return self.link.rate_mbit / self.nics

    @property
    def switch_netns(self) -> str:
        """The namespace of a veth link's bridges (named by the run, so its removal finds it)."""
        return f"{self.tag}-sw"

    @staticmethod
    def bridge(nic: int) -> str:
        return f"{PREFIX}br{nic}"

    @staticmethod
    def bridge_port(nic: int, host: int) -> str:
        return f"{PREFIX}p{nic}h{host}"

    # ------------------------------------------------------------------ up
    def up(self) -> "Network":
        preflight(tun=not self.link.veth)
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            exe = None if self.link.veth else build_forwarder(self.workdir)
            for h in self.hosts:
                _add_netns(h.netns)
                run([tool("ip"), "-n", h.netns, "link", "set", "lo", "up"])
                self._write_etc_hosts(h)
            if self.link.veth:
                self._make_bridges()
            else:
                for k in range(self.nics):
                    self._start_forwarder(exe, k)
            for h in self.hosts:
                self._configure(h)
        except BaseException:
            self.down()
            raise
        return self

    def _make_bridges(self) -> None:
        """Switch k as bridge k in the run's switch namespace, NIC k of each host a veth whose peer is a
        port of it (Note [Hosts joined by switches]). Each pair is made with its ends in their namespaces
        at once, so nothing passes through the root namespace."""
        ip, sw, mtu = tool("ip"), self.switch_netns, str(self.mtu)
        _add_netns(sw)
        # no IPv6 on the bridges and ports: their router solicitations would reach the hosts' counters
        for conf in ("all", "default"):
            run([ip, "netns", "exec", sw, "sysctl", "-qw", f"net.ipv6.conf.{conf}.disable_ipv6=1"])
        for k in range(self.nics):
            br = self.bridge(k)
            run([ip, "-n", sw, "link", "add", br, "mtu", mtu, "type", "bridge"])
            for h in self.hosts:
                port = self.bridge_port(k, h.index)
                run([ip, "link", "add", self.ifname(k), "netns", h.netns, "mtu", mtu, "type", "veth",
                     "peer", "name", port, "netns", sw, "mtu", mtu])
                run([ip, "-n", sw, "link", "set", port, "master", br, "up"])
            run([ip, "-n", sw, "link", "set", br, "up"])

    def _write_etc_hosts(self, h: Host) -> None:
        """Every host's name at its NIC 0 address, as each host sees /etc/hosts (MPI resolves the names)."""
        d = ETC_NETNS / h.netns
        d.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{o.addrs[0]} {o.hostname}" for o in self.hosts]
        (d / "hosts").write_text("\n".join(lines) + "\n")

    def _start_forwarder(self, exe: Path, k: int) -> None:
        rate_bps = int(self.nic_rate_mbit * 1e6) if self.shaped else 0
        cmd = [str(exe), "--tag", self.tag, "--delay-ns", str(int(round(self.link.delay_ms * 1e6))),
               "--rate-bps", str(rate_bps), "--queue-bytes", str(self.queue_bytes), "--mtu", str(self.mtu),
               "--parent", str(os.getpid()), "--rt", str(RT_PRIORITY if self.rt else 0)]
        for h in self.hosts:
            cmd += ["--port", f"{NETNS_DIR / h.netns}:{self.ifname(k)}:{h.addrs[k]}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True)
        fwd = Forwarder(proc, k)
        self.forwarders.append(fwd)
        line = proc.stdout.readline()   # "ready sched=..." once every TUN exists
        if not line.startswith("ready"):
            proc.wait(5)
            why = proc.stderr.read().strip()
            if any(w in why for w in ("/dev/net/tun", "TUNSETIFF", "setns")):   # the kernel said no
                raise HostsUnavailable(f"the delay line cannot make its TUN devices: {why}")
            raise RuntimeError(f"the delay line of NIC {k} did not start: {why}")
        fwd.sched = line.split("sched=", 1)[1].strip()

    def _configure(self, h: Host) -> None:
        ip, tc = tool("ip"), tool("tc")
        # no IPv6: its router solicitations would cross the wire and show in the counters
        run([ip, "netns", "exec", h.netns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
        for k in range(self.nics):
            dev = self.ifname(k)
            run([ip, "-n", h.netns, "link", "set", dev, "mtu", str(self.mtu)])
            run([ip, "-n", h.netns, "addr", "add", f"{h.addrs[k]}/24", "dev", dev])
            run([ip, "-n", h.netns, "link", "set", dev, "up"])
            if self.shaped and not self.link.veth:
                run([tc, "-n", h.netns, "qdisc", "replace", "dev", dev, "root", *self.tbf_args()])

    def tbf_args(self) -> list[str]:
        """tbf for one NIC: its share of the rate, a burst of 256 KiB or two MTUs (Note [Hosts joined by
        switches]), a queue above what TCP parks in it."""
        return ["tbf", "rate", f"{int(self.nic_rate_mbit * 1000)}kbit", "burst", str(max(TBF_BURST, 2 * self.mtu)),
                "limit", str(TBF_LIMIT)]

    # ------------------------------------------------------------------ use
    def netns_exec(self, h: int, hostname: bool = False) -> list[str]:
        """The command prefix that runs inside host h; with `hostname`, in a UTS namespace of its own
        whose hostname is the host's name (MPI tells hosts apart by it)."""
        cmd = [self.ip, "netns", "exec", self.hosts[h].netns]
        if hostname:
            cmd += [self.unshare, "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                    self.hosts[h].hostname]
        return cmd

    def qdisc(self, h: int, nic: int = 0) -> dict:
        """What tc reports for host h's NIC: the qdisc's kind, options and drops."""
        out = run([tool("tc"), "-j", "-s", "-n", self.hosts[h].netns, "qdisc", "show", "dev", self.ifname(nic)]).stdout
        return json.loads(out)[0]

    def counters(self, h: int) -> dict[str, dict[str, int]]:
        """{ifname: {"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}} of host h's NICs and loopback."""
        out = run([tool("ip"), "-j", "-s", "-n", self.hosts[h].netns, "link", "show"]).stdout
        got = {}
        for link in json.loads(out):
            s = link["stats64"]
            got[link["ifname"]] = {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
                                   "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]}
        return got

    def pids(self, h: int) -> list[int]:
        r = run([tool("ip"), "netns", "pids", self.hosts[h].netns], check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    # ------------------------------------------------------------------ down
    def down(self) -> None:
        """Kills what runs in the hosts, stops the delay lines (their TUNs go with them; their stats are
        kept), deletes the namespaces (a veth link's bridges and pairs go with its switch namespace) and
        their /etc/netns files and the work folder. Idempotent."""
        for h in range(len(self.hosts)):
            kill_pids(self.pids(h))
        for f in self.forwarders:
            if f.proc.poll() is None:
                f.proc.send_signal(signal.SIGTERM)
            try:
                out, _ = f.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                f.proc.kill()
                out, _ = f.proc.communicate()
            last = [x for x in (out or "").splitlines() if x.startswith("{")]
            if last and f.stats is None:
                f.stats = json.loads(last[-1])
        if self.forwarders:   # a second down() keeps the first one's stats
            self.forwarders_stats = [f.stats for f in self.forwarders]
        self.forwarders = []
        remove_run(self.tag)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _add_netns(name: str) -> None:
    r = run([tool("ip"), "netns", "add", name], check=False)
    if r.returncode != 0:
        raise HostsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")


def kill_pids(pids: list[int], wait_s: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdlines() -> dict[int, list[str]]:
    """Every other process's arguments."""
    got = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            got[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return got


def tagged_pids(tag: str) -> list[int]:
    """Processes whose command line names the run `tag`: its delay lines (--tag), load processes, and
    ranks (their --result file is in the run's folder)."""
    return [pid for pid, argv in _cmdlines().items() if any(names_run(tag, a) for a in argv)]


def namespaces() -> list[str]:
    ip = tool("ip")
    if ip is None:
        return []
    out = run([ip, "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_run(tag: str) -> None:
    """Everything of run `tag`: the processes inside its namespaces and those that name it (delay
    lines: their TUNs go with them; load; ranks), the namespaces, their /etc/netns folders, its files in
    /dev/shm and /tmp (Open MPI's shared-memory segments carry the host's name, which is the namespace's;
    the run's folder holds the launches' TMPDIR)."""
    ip = tool("ip")
    mine = [ns for ns in namespaces() if names_run(tag, ns)]
    for ns in mine:
        r = run([ip, "netns", "pids", ns], check=False)
        if r.returncode == 0:
            kill_pids([int(p) for p in r.stdout.split()])
    kill_pids(tagged_pids(tag))
    for ns in mine:
        run([ip, "netns", "del", ns], check=False)
    for base in (ETC_NETNS, Path("/dev/shm"), Path(tempfile.gettempdir())):
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for p in entries:
            if names_run(tag, p.name):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    try:
        ETC_NETNS.rmdir()   # only when empty: someone else's /etc/netns/* stays
    except OSError:
        pass


TAG = re.compile(rf"(?<![0-9A-Za-z])({PREFIX}(\d+)x\d+)(?=-|$)")


def leftovers() -> list[str]:
    """Tags of runs whose process is gone but which left something: a namespace, an /etc/netns folder,
    a file in /dev/shm or /tmp, a process that names the run."""
    names = namespaces()
    for base in (ETC_NETNS, Path("/dev/shm"), Path(tempfile.gettempdir())):
        try:
            names += [p.name for p in base.iterdir()]
        except OSError:
            pass
    names += [a for argv in _cmdlines().values() for a in argv]
    found = {m.group(1): int(m.group(2)) for n in names for m in TAG.finditer(n)}
    return sorted(tag for tag, pid in found.items() if pid != os.getpid() and not _is_a_hosts_run(pid))


def _is_a_hosts_run(pid: int) -> bool:
    """pid is alive and is a Python process (a run of this benchmark or a test that makes hosts)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _alive(pid) and b"python" in argv


def clean_leftovers(log=sys.stderr) -> list[str]:
    """Removes what killed earlier runs left (leftovers()); returns their tags."""
    found = leftovers()
    for tag in found:
        print(f"removing what an earlier run left: {tag}", file=log, flush=True)
        remove_run(tag)
    return found
