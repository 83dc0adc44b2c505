"""UCX's own measure of the link for bench/hosts.py, the anchor of the lanes on UCX: `ucx_perftest` (from
the libucx wheel) between host 0 and host 1 over TCP on NIC 0, the transports the lanes use (UCX_TLS=tcp:
no shared memory, which would skip the link), tag-matched bandwidth with 4 MiB messages and tag latency
with 4 KiB ones, each in a server/client pair of its own. None when the wheel is not installed."""
from __future__ import annotations

import os
import re
import subprocess
import time

PORT = 13337


def perftest_binary() -> tuple[str, str] | None:
    """(ucx_perftest, its library folder) of the libucx wheel, or None."""
    try:
        import libucx
    except ImportError:
        return None
    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    return (exe, os.path.join(root, "lib")) if os.access(exe, os.X_OK) else None


def _final(out: str) -> list[float]:
    """The numbers of ucx_perftest's "Final:" line: iterations, latency (us: 50th percentile, average,
    overall), bandwidth (MiB/s: average, overall), message rate (average, overall)."""
    for line in out.splitlines():
        if line.strip().startswith("Final:"):
            return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?", line)]
    raise RuntimeError(f"ucx_perftest printed no result: {out[-1500:]}")


def _pair(net, test: str, size: int, iters: int, port: int, timeout: float = 120) -> list[float]:
    found = perftest_binary()
    assert found is not None
    exe, lib = found
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=net.ifnames[0],
               LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    server = subprocess.Popen([*net.netns_exec(1), exe, "-p", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)   # the server listens within milliseconds; the client retries nothing
        client = subprocess.run([*net.netns_exec(0), exe, net.hosts[1].addrs[0], "-p", str(port), "-t", test,
                                 "-s", str(size), "-n", str(iters)], env=env, capture_output=True, text=True,
                                timeout=timeout)
        if client.returncode != 0:
            raise RuntimeError(f"ucx_perftest {test} exited {client.returncode}: {client.stderr[-1500:]}")
        return _final(client.stdout)
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def perftest(net) -> dict | None:
    """{"tag_bw_mbit", "tag_lat_ms"}: UCX's tag bandwidth (4 MiB messages) and one-way latency (4 KiB)
    between hosts 0 and 1; None without the wheel."""
    if perftest_binary() is None:
        return None
    bw = _pair(net, "tag_bw", 4 << 20, 64, PORT)
    lat = _pair(net, "tag_lat", 4 << 10, 1000, PORT + 1)
    return {"tag_bw_mbit": bw[5] * (1 << 20) * 8 / 1e6, "tag_lat_ms": lat[1] / 1e3}
