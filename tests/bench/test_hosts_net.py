"""The emulated hosts of bench/hosts.py for real (bench/hosts_net.py, bench/hosts_delay.c): network
namespaces joined by the TUN delay line, tbf on each NIC, or (the link `veth`) by veth pairs into
bridges. The delay line holds every packet at least the configured delay and passes it intact, the
switch ports never send faster than the line rate, tbf is set as asked, every byte between two hosts
shows in their NICs' counters, and nothing is left behind, by a run that ends or by one that is killed.
Skipped, with the reason, where namespaces cannot be made (not root, no `ip` or `tc`, no /dev/net/tun,
no gcc).

Every timing assertion here is a lower bound on a time that the configuration guarantees (a packet
leaves the delay line no earlier than it is due; a port sends no faster than its rate): a slow or busy
machine only makes the measured times longer, so none can fail spuriously.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "bench" / "hosts.py", "hosts_bench")


@pytest.fixture(scope="module")
def hn(bench):
    mod = bench.net_mod   # the module the bench itself uses
    try:
        mod.preflight()
    except mod.HostsUnavailable as e:
        pytest.skip(f"emulated hosts need network namespaces and TUN devices: {e}")
    return mod


@pytest.fixture(scope="module")
def tcp(bench):
    return bench.hosts_tcp


def up(hn, hosts=2, rate=2500, delay=0.1, net_class=None, link=None, **kw):
    """The network, up (on `link`, else rate:delay); the test is skipped (with the reason) where the
    kernel refuses a namespace or a TUN device to root."""
    net = (net_class or hn.Network)(hosts, link or hn.Link(rate, delay), **kw)
    try:
        net.up()
    except hn.HostsUnavailable as e:
        pytest.skip(f"emulated hosts need network namespaces and TUN devices: {e}")
    return net


def nothing_left(hn, tag: str) -> list[str]:
    """What of run `tag` is still on the machine (empty: nothing)."""
    left = [f"namespace {n}" for n in hn.namespaces() if hn.names_run(tag, n)]
    left += [f"process {p}" for p in hn.tagged_pids(tag)]
    for base in (hn.ETC_NETNS, Path("/dev/shm"), Path("/tmp")):
        if base.exists():
            left += [str(p) for p in base.iterdir() if hn.names_run(tag, p.name)]
    # a TUN whose namespace went away while its delay line lived would have moved to this namespace; and
    # no veth or bridge of the run may be here either
    links = subprocess.run([hn.tool("ip"), "-o", "link", "show"], capture_output=True, text=True).stdout
    left += [f"device {line.split(':')[1].strip()}" for line in links.splitlines()
             if line.split(":")[1].strip().startswith(hn.PREFIX)]
    return left


def in_host(net, h: int, code: str, *args: str, timeout: float = 60) -> str:
    r = subprocess.run([*net.netns_exec(h), sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_links_are_rate_and_delay_or_veth_and_anything_else_is_refused_naming_links(bench):
    hn = bench.net_mod   # no namespaces needed: runs everywhere
    assert hn.parse_links("2500:0.1, veth") == [hn.Link(2500, 0.1), hn.VETH]
    assert hn.VETH.veth and not hn.Link(2500, 0.1).veth
    assert [link.label for link in hn.parse_links("veth,1000:0.5")] == ["unshaped veth", "1000 Mbit/s + 0.5 ms"]
    for bad in ("vethx", "veth:0.1", "Veth", "2500:0.1,veths"):
        with pytest.raises(ValueError, match="--links"):
            hn.parse_links(bad)


def test_the_delay_line_holds_each_packet_at_least_the_delay_each_way(hn, tcp):
    delay_ms = 1.0
    net = up(hn, delay=delay_ms)
    try:
        rtts = tcp.rtt(net, 0, 1, count=20)   # each reply is checked equal to its ping (intact)
    finally:
        net.down()
    # a packet is written no earlier than read + delay, and read no earlier than sent: each way >= delay
    assert len(rtts) == 20 and min(rtts) >= 2 * delay_ms / 1e3, rtts


def test_data_crosses_intact_and_every_byte_shows_in_the_nics_counters(hn):
    net = up(hn)
    payload_mb = 8
    recv = ("import hashlib, socket, sys\n"
            "s = socket.socket(); s.bind((sys.argv[1], 5401)); s.listen(1); print('ok', flush=True)\n"
            "c, _ = s.accept(); h = hashlib.sha256(); n = 0\n"
            "while True:\n"
            "    b = c.recv(1 << 20)\n"
            "    if not b: break\n"
            "    h.update(b); n += len(b)\n"
            "print(n, h.hexdigest())\n")
    send = ("import random, socket, sys, time\n"
            "data = random.Random(7).randbytes(int(sys.argv[2]) << 20)\n"
            "for _ in range(300):\n"
            "    try: s = socket.create_connection((sys.argv[1], 5401)); break\n"
            "    except OSError: time.sleep(0.02)\n"
            "s.sendall(data); s.close()\n")
    try:
        before = [net.counters(h) for h in (0, 1)]
        r = subprocess.Popen([*net.netns_exec(1), sys.executable, "-c", recv, net.hosts[1].addrs[0]],
                             stdout=subprocess.PIPE, text=True)
        assert r.stdout.readline().strip() == "ok"
        in_host(net, 0, send, net.hosts[1].addrs[0], str(payload_mb))
        n, digest = r.communicate(timeout=60)[0].split()
        after = [net.counters(h) for h in (0, 1)]
    finally:
        net.down()
    import random

    want = random.Random(7).randbytes(payload_mb << 20)
    assert int(n) == len(want) and digest == hashlib.sha256(want).hexdigest()
    sent = after[0]["nvbhn0"]["tx_bytes"] - before[0]["nvbhn0"]["tx_bytes"]
    got = after[1]["nvbhn0"]["rx_bytes"] - before[1]["nvbhn0"]["rx_bytes"]
    assert sent >= len(want) and got >= len(want)          # payload plus headers, through the NICs
    assert sent < 1.05 * len(want)                        # and nothing else of note crossed
    assert after[0]["lo"]["tx_bytes"] == before[0]["lo"]["tx_bytes"]   # not a byte over loopback


def test_tbf_on_every_nic_is_what_was_asked(hn):
    net = up(hn, hosts=2, rate=1000, delay=0.5, nics=2, mtu=9000)
    try:
        for h in (0, 1):
            for k in (0, 1):
                q = net.qdisc(h, k)
                assert q["kind"] == "tbf"
                assert q["options"]["rate"] == 500e6 / 8     # bytes/s: each of 2 NICs gets R/2
                # tc stores the burst in its clock's ticks: the value it reports back is within 1%
                assert abs(q["options"]["burst"] - max(hn.TBF_BURST, 2 * 9000)) <= 0.01 * hn.TBF_BURST
        assert net.tbf_args()[:6] == ["tbf", "rate", "500000kbit", "burst", str(hn.TBF_BURST), "limit"]
    finally:
        net.down()


TIMED_SINK = ("import socket, sys, time\n"
              "s = socket.socket(); s.bind((sys.argv[1], 5601)); s.listen(1)\n"
              "t0 = time.monotonic(); print('ok', flush=True)\n"
              "c, _ = s.accept(); n = 0\n"
              "while True:\n"
              "    b = c.recv(1 << 20)\n"
              "    if not b: break\n"
              "    n += len(b)\n"
              "print(n, time.monotonic() - t0)\n")


def test_the_switch_port_never_sends_faster_than_the_line_rate(hn, tcp):
    # unshaped hosts (no tbf) behind a port of 200 Mbit/s: only the delay line's pacing holds the rate
    rate = 200

    class PortOnly(hn.Network):
        def tbf_args(self):
            return ["pfifo", "limit", "1000"]

    net = up(hn, rate=rate, net_class=PortOnly)
    try:
        sink = subprocess.Popen([*net.netns_exec(1), sys.executable, "-c", TIMED_SINK, net.hosts[1].addrs[0]],
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ok"
        subprocess.run([*net.netns_exec(0), sys.executable, tcp.__file__, "send", net.hosts[1].addrs[0], "5601",
                        "1.0"], check=True, capture_output=True, timeout=60)
        n, seconds = sink.communicate(timeout=60)[0].split()
    finally:
        net.down()
    n, seconds = int(n), float(seconds)
    # From listen() (before the sender connects) to the last byte, the port spaced every packet after
    # the first (64 KiB at most) by its time on the wire at the rate: a lower bound on the time that a
    # busy machine can only lengthen. (Not from accept(): a receiver that gets the core late would start
    # its clock after bytes had already arrived.)
    assert n > 1 << 20
    assert seconds >= (n - 65535) * 8 / (rate * 1e6), (n, seconds)


def test_three_hosts_meet_through_one_switch_and_counters_name_the_sender(hn, tcp):
    net = up(hn, hosts=3)
    try:
        c0 = [net.counters(h) for h in range(3)]
        tcp.tcp_ceiling(net, [(0, 2)], seconds=0.5)
        c1 = [net.counters(h) for h in range(3)]
    finally:
        net.down()
    moved = [c1[h]["nvbhn0"]["tx_bytes"] - c0[h]["nvbhn0"]["tx_bytes"] for h in range(3)]
    got = [c1[h]["nvbhn0"]["rx_bytes"] - c0[h]["nvbhn0"]["rx_bytes"] for h in range(3)]
    assert moved[0] > 1 << 20 and got[2] >= moved[0] * 0.99   # host 0 -> host 2 through the switch
    assert got[1] < 1 << 16 and moved[1] < 1 << 16            # host 1 saw none of it


@pytest.mark.slow   # ~3 s
def test_a_full_switch_port_drops_and_tcp_still_delivers(hn, tcp):
    # hosts 0 and 1 both send to host 2 at the line rate: its port gets twice what it can send and a
    # buffer of two 64 KiB packets, so it drops (the ring wraps and fills) as soon as both windows hold
    # more than a packet in flight; TCP retransmits and both streams go on
    net = up(hn, hosts=3, rate=100, delay=0.2, queue_bytes=150_000)
    try:
        rates = tcp.tcp_ceiling(net, [(0, 2), (1, 2)], seconds=1.5)
    finally:
        net.down()
    stats = net.forwarders_stats[0]
    assert all(r > 0 for r in rates), rates
    assert stats["ports"][2]["drop_queue"] > 0, stats


def stream_to_host1(net, tcp, addr, port, seconds):
    """Bytes one TCP stream carried from host 0 to host 1's address `addr` in `seconds` (bench/hosts_tcp.py)."""
    rx = subprocess.Popen([*net.netns_exec(1), sys.executable, tcp.__file__, "recv", addr, port],
                          stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "listening"
    subprocess.run([*net.netns_exec(0), sys.executable, tcp.__file__, "send", addr, port, str(seconds)],
                   check=True, capture_output=True, timeout=60)
    return json.loads(rx.communicate(timeout=60)[0].splitlines()[-1])["bytes"]


def test_two_nics_each_carry_the_traffic_to_their_own_addresses(hn, tcp):
    net = up(hn, hosts=2, nics=2)
    try:
        assert [h.addrs for h in net.hosts] == [("10.233.0.1", "10.233.1.1"), ("10.233.0.2", "10.233.1.2")]
        c0 = net.counters(0)
        n = stream_to_host1(net, tcp, "10.233.1.2", "5501", 0.5)
        c1 = net.counters(0)
    finally:
        net.down()
    assert n > 0
    assert c1["nvbhn1"]["tx_bytes"] - c0["nvbhn1"]["tx_bytes"] >= n
    assert c1["nvbhn0"]["tx_bytes"] - c0["nvbhn0"]["tx_bytes"] < 1 << 16


def test_a_veth_link_joins_the_hosts_through_bridges_and_every_byte_shows_in_the_counters(hn, tcp):
    net = up(hn, hosts=2, link=hn.VETH)
    tag = net.tag
    try:
        assert net.forwarders == [] and net.switch_netns in hn.namespaces()   # bridges, no delay line
        assert net.qdisc(0)["kind"] != "tbf"                                  # unshaped
        info = json.loads(subprocess.run([net.ip, "-j", "-n", net.hosts[0].netns, "addr", "show", "nvbhn0"],
                                         capture_output=True, text=True, check=True).stdout)[0]
        assert info["mtu"] == 65535 and [a["local"] for a in info["addr_info"]] == ["10.233.0.1"]
        assert len(tcp.rtt(net, 0, 1, count=5)) == 5                        # host 0 reaches host 1 and back
        before = [net.counters(h) for h in (0, 1)]
        n = stream_to_host1(net, tcp, "10.233.0.2", "5701", 0.3)
        after = [net.counters(h) for h in (0, 1)]
    finally:
        net.down()
    net.down()                                       # twice is harmless
    assert n > 1 << 20
    assert after[0]["nvbhn0"]["tx_bytes"] - before[0]["nvbhn0"]["tx_bytes"] >= n
    assert after[1]["nvbhn0"]["rx_bytes"] - before[1]["nvbhn0"]["rx_bytes"] >= n
    assert after[0]["lo"]["tx_bytes"] == before[0]["lo"]["tx_bytes"]   # not a byte over loopback
    assert nothing_left(hn, tag) == [] and net.forwarders_stats == []


def test_down_leaves_nothing(hn):
    net = up(hn, hosts=3, nics=2)
    tag = net.tag
    assert len([n for n in hn.namespaces() if hn.names_run(tag, n)]) == 3
    assert hn.tagged_pids(tag)                       # the delay lines run
    net.down()
    net.down()                                       # twice is harmless
    assert nothing_left(hn, tag) == []
    assert len(net.forwarders_stats) == 2 and all(s["drop_noroute"] == 0 for s in net.forwarders_stats)


CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
import hosts_net
net = hosts_net.Network(2, hosts_net.parse_links(sys.argv[2])[0]).up()
print(net.tag, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("link", ["2500:0.1", "veth"])
def test_a_killed_run_leaves_what_the_next_one_removes(hn, link):
    """SIGKILL cannot be caught: the run's delay lines die with it (their parent-death signal) and their
    TUNs with them; its namespaces (a veth link's bridges and pairs are in them) stay until
    clean_leftovers() (the next run, or hosts.py --clean) finds their tag, whose process is gone, and
    removes everything."""
    veth = link == "veth"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "bench"), link], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        tag = child.stdout.readline().strip()
        if not tag:
            err = child.communicate(timeout=60)[1]
            if "HostsUnavailable" in err:
                pytest.skip(f"emulated hosts need network namespaces and TUN devices: {err.splitlines()[-1]}")
        assert tag.startswith(hn.PREFIX), tag
        assert bool(hn.tagged_pids(tag)) != veth   # the delay lines run; a veth link has none
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 10
    while hn.tagged_pids(tag) and time.monotonic() < deadline:   # the delay line follows its parent
        time.sleep(0.05)
    assert hn.tagged_pids(tag) == []
    assert any(hn.names_run(tag, n) for n in hn.namespaces())   # left behind ...
    assert (f"{tag}-sw" in hn.namespaces()) == veth
    assert tag in hn.leftovers()
    assert tag in hn.clean_leftovers(log=open(os.devnull, "w"))
    assert nothing_left(hn, tag) == []                           # ... and removed


def test_a_live_run_is_not_a_leftover(hn):
    net = up(hn)
    try:
        assert net.tag not in hn.leftovers()   # this process (python) is alive
    finally:
        net.down()


def test_the_delay_line_refuses_bad_arguments_naming_them(hn, tmp_path):
    exe = hn.build_forwarder(tmp_path)
    for args, word in ((["--mtu", "70000", "--port", "a:b:1.2.3.4", "--port", "a:b:1.2.3.5"], "--mtu"),
                       (["--delay-ns", "x"], "--delay-ns"),
                       (["--port", "/nonexistent:nvbhn0:1.2.3.4", "--port", "x:y:1.2.3.5"], "/nonexistent"),
                       (["--port", "a:b:999.1.1.1", "--port", "a:b:1.2.3.4"], "--port"),
                       (["--port", "a:b:1.2.3.4"], "--port")):
        r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=10)
        assert r.returncode == 2 and word in r.stderr, (args, r.stderr)


NIC_PROBE = """
import os, sys
import torch, torch.distributed as dist
from pathlib import Path

def sent(nic):
    return int(Path(f"/sys/class/net/{nic}/statistics/tx_bytes").read_text())

os.environ["GLOO_SOCKET_IFNAME"] = "nvbhn0"
dist.init_process_group("gloo")
os.environ["GLOO_SOCKET_IFNAME"] = "nvbhn1"   # torch reads it when a gloo group is made
group = dist.new_group(backend="gloo")
x = torch.zeros(1 << 20)
for g in (group, None):
    # a barrier of the same group on each side: a rank's all_reduce returns with its last bytes still
    # in its NIC's queue (tbf); once the peer has passed the barrier after it, they have crossed
    dist.barrier(group=g)
    before = [sent("nvbhn0"), sent("nvbhn1")]
    dist.all_reduce(x, group=g)
    dist.barrier(group=g)
    print("sent", *(a - b for a, b in zip([sent("nvbhn0"), sent("nvbhn1")], before)), flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow   # ~10 s: a torchrun node in each of two hosts
def test_each_gloo_group_can_take_its_own_nic(bench, hn, tmp_path):
    """What docs/bench.md tells code that wants to put its groups on different NICs: set
    GLOO_SOCKET_IFNAME before making each gloo group."""
    script = tmp_path / "nic_probe.py"
    script.write_text(NIC_PROBE)
    net = up(hn, nics=2)
    try:
        cmds = [bench.launch.torchrun_command(net, h, 1, 29690, []) for h in (0, 1)]
        cmds = [c[:c.index(str(bench.launch.WORKER))] + [str(script)] for c in cmds]
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1")) for c in cmds]
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        net.down()
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        (g0, g1), (d0, d1) = [tuple(map(int, line.split()[1:])) for line in out.splitlines() if line.startswith("sent")]
        # 4 MiB each, 2 ranks: each sends at least half of it, and the other NIC carries no data
        assert g1 >= 2 << 20 and g0 < 1 << 12, out     # the new group on NIC 1
        assert d0 >= 2 << 20 and d1 < 1 << 12, out     # the default group on NIC 0
