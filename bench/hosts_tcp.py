"""The link's own measures for bench/hosts.py, run inside the emulated hosts: a TCP stream's throughput
(the ceiling any collective can reach over the link) and a small UDP packet's round trip (the delay the
delay line adds, both ways). Standalone, standard library only, so it starts in a fraction of a second.

    python bench/hosts_tcp.py recv ADDR PORT              # one connection, prints {"bytes", "seconds"}
    python bench/hosts_tcp.py send ADDR PORT SECONDS      # sends for SECONDS
    python bench/hosts_tcp.py echo ADDR PORT              # UDP echo, until killed
    python bench/hosts_tcp.py ping ADDR PORT COUNT        # prints {"rtt_s": [...]}

A Python socket pair reaches several GB/s on loopback here (1 MiB sendall / recv_into), far above the
links it measures, so the interpreter is not what it measures. The receiver times from its first byte to
the last, so the connection's start (and the sender's slow start) count only as they would in a
collective; the sender's SO_SNDBUF / the receiver's SO_RCVBUF are the kernel's autotuned defaults, as
gloo's and MPI's sockets are.
"""
from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def recv(addr: str, port: int) -> dict:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1)
        print("listening", flush=True)
        conn, _ = s.accept()
        with conn:
            buf = bytearray(CHUNK)
            n, t0, t1 = 0, None, None
            while True:
                k = conn.recv_into(buf)
                if not k:
                    break
                t1 = time.perf_counter()
                if t0 is None:
                    t0, n = t1, -k   # from the first byte: the bytes of the first read took no time
                n += k
    return {"bytes": max(n, 0), "seconds": (t1 - t0) if t0 is not None else 0.0}


def send(addr: str, port: int, seconds: float) -> dict:
    data = b"\x5a" * CHUNK
    deadline = time.monotonic() + 30
    while True:   # the receiver may still be starting in the other host
        try:
            s = socket.create_connection((addr, port), timeout=30)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with s:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            s.sendall(data)
            n += CHUNK
    return {"bytes": n}


def echo(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, port))
        print("listening", flush=True)
        while True:
            data, peer = s.recvfrom(2048)
            s.sendto(data, peer)


def ping(addr: str, port: int, count: int) -> dict:
    rtts = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5.0)
        for i in range(count):
            msg = i.to_bytes(4, "little") * 16
            t0 = time.perf_counter()
            s.sendto(msg, (addr, port))
            while True:   # a reply to an earlier ping that timed out is skipped
                data, _ = s.recvfrom(2048)
                if data == msg:
                    break
            rtts.append(time.perf_counter() - t0)
            time.sleep(0.002)
    return {"rtt_s": rtts}


def main(argv: list[str]) -> None:
    mode, addr, port = argv[0], argv[1], int(argv[2])
    if mode == "recv":
        out = recv(addr, port)
    elif mode == "send":
        out = send(addr, port, float(argv[3]))
    elif mode == "echo":
        echo(addr, port)
        return
    elif mode == "ping":
        out = ping(addr, port, int(argv[3]))
    else:
        raise SystemExit(f"mode: {mode!r} is not recv, send, echo or ping")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


# ------------------------------------------------------------------------------------------ driver side
def _start(net, h: int, *args: str):
    import subprocess

    return subprocess.Popen([*net.netns_exec(h), sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _last_json(proc, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"hosts_tcp.py exited {proc.returncode}: {err.strip()[-2000:]}")
    return json.loads(lines[-1])


def tcp_ceiling(net, pairs: list[tuple[int, int]], seconds: float = 2.0, port: int = 5201,
                nic: int | None = None) -> list[float]:
    """Mbit/s of one TCP stream per (sender host, receiver host) pair, all streams at once, each to the
    receiver's NIC `nic` address (both directions of a link: [(0, 1), (1, 0)]); nic None: every pair
    once per NIC (the streams of pair i are at i * NICs + k)."""
    streams = [(src, dst, k) for src, dst in pairs for k in ([nic] if nic is not None else range(net.nics))]
    receivers = []
    for i, (_, dst, k) in enumerate(streams):
        p = _start(net, dst, "recv", net.hosts[dst].addrs[k], str(port + i))
        if p.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the TCP receiver in host {dst} did not start: {p.stderr.read()[-2000:]}")
        receivers.append(p)
    senders = [_start(net, src, "send", net.hosts[dst].addrs[k], str(port + i), str(seconds))
               for i, (src, dst, k) in enumerate(streams)]
    for s in senders:
        _last_json(s, seconds + 60)
    got = [_last_json(r, 60) for r in receivers]
    return [g["bytes"] * 8 / g["seconds"] / 1e6 if g["seconds"] > 0 else 0.0 for g in got]


def rtt(net, src: int, dst: int, count: int = 50, port: int = 5301) -> list[float]:
    """Round trips in seconds of `count` small UDP packets from host src to host dst and back."""
    echo_p = _start(net, dst, "echo", net.hosts[dst].addrs[0], str(port))
    try:
        if echo_p.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the UDP echo in host {dst} did not start: {echo_p.stderr.read()[-2000:]}")
        return _last_json(_start(net, src, "ping", net.hosts[dst].addrs[0], str(port), str(count)), 60)["rtt_s"]
    finally:
        echo_p.kill()
        echo_p.wait()
