"""ncclavg's public all-reduce against every MPI that pip installs (Open MPI 5, MPICH 4, MPICH 5, Intel
MPI, each through mpi4py) and torch.distributed gloo, in the same processes, one size at a time, with
one timing rule.

Contenders, per MPI peer, process count P and element type:
  ncclavg            comm.all_reduce_avg([x]): the public API of a gloo-backend Communicator, whose
                     processes share this host, so it goes through the shared-memory channel (an
                     average: the sum and the division by P in one pass).
  ncclavg channel    the core channel alone (_C.ShmChannel.all_reduce_sum, same average), for the
                     Python layer's cost.
  MPI                MPI_Allreduce(MPI_IN_PLACE, SUM) on the same buffer (no average: MPI has none),
                     with the peer's own defaults (its shared-memory path and collective tuning); the
                     ranks unpinned unless --bind own (Note [Pinning the ranks] in mpi_peer_envs.py).
  torch gloo         torch.distributed.all_reduce(x) (SUM) over gloo, loopback TCP.
  torch ncclavg      torch.distributed.all_reduce(x) (SUM) on a group of the `ncclavg` backend: what
                     DDP, FSDP and every torch.distributed user reaches (Note [The backend's fast path]).
Each MPI peer runs in a venv of its own (bench/mpi_peer_envs.py: one libmpi per environment), made on
first use under --mpi-cache and reused; the ranks import ncclavg from this checkout, so the ncclavg
contenders are measured again in every peer's run, and the table gives their median over the runs.
Timing rule (the same for all): for each size, rounds in which every contender runs once, in turn,
the order rotating from round to round (so none always follows the same neighbour and its caches);
before each contender's timed batch every rank passes MPI_Barrier and then the channel's barrier (see
sync() in the worker for why both); a batch is enough back-to-back calls
to last about 5 ms (one call for large sizes; with more ranks than cores the first calls after a
barrier may wait a millisecond or more for a core, which a batch spreads thin), its time divided by the calls; the slowest rank's value
is the sample; the median over rounds is reported. Bandwidth as nccl-tests: algbw = bytes / time,
busbw = algbw x 2(P-1)/P, beside the copy bandwidth (memcpy, read + write) measured in the same run.
A last test, per P: rank 1 waits 2 s for rank 0 inside each contender; the CPU time it burns meanwhile
(the MPIs poll, MPICH's ch3:nemesis for one; ncclavg's channel sleeps on a futex after 1 ms).

Launch (it makes the venvs and starts each peer's mpiexec itself, once per peer and process count):
    python bench/mpi_peer.py                                   # all four MPIs, P = 2 and 4, float32, 8 B to 64 MiB
    python bench/mpi_peer.py --mpi openmpi,mpich4 --procs 2 --dtypes bfloat16,float16 --json R.json --md R.md
    python bench/mpi_peer.py --procs 2 --sizes 8,65536 --rounds 3 --budget 0 --wait-s 0.2
                                                               # a smoke run: seconds per peer once the venvs exist
    python bench/mpi_peer.py --mpi-cache DIR ...               # the venvs elsewhere than ~/.cache/ncclavg/mpi-peers
    python bench/mpi_peer.py --procs 2 --load 2                # a loaded machine: two busy `nice -n 19` processes
A peer that cannot be installed or started here is reported with the reason, and the others go on
(Intel MPI's wheel names a libfabric that PyPI lacks: it is installed without, and on one host it runs
on its shared-memory path alone).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (puts an in-place built checkout first on sys.path)
import mpi_peer_envs as envs  # noqa: E402

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CONTENDERS = ("ncclavg", "ncclavg channel", "MPI", "torch gloo", "torch ncclavg")
NCCLAVG_SIDE = ("ncclavg", "ncclavg channel", "torch ncclavg", "torch gloo")   # measured in every peer's run
BATCH_S = 5e-3
ROUNDS = 15
RULE = ("median over rounds of the slowest rank's per-call time in a ~5 ms batch after MPI_Barrier + the "
        "channel's barrier; contenders interleaved, the order rotating per round; the ncclavg and torch "
        "contenders: the median of that over the MPI peers' runs")


# ------------------------------------------------------------------------------------------ worker side
def worker(args: argparse.Namespace) -> None:
    import datetime
    import resource

    import numpy as np
    from mpi4py import MPI

    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ncclavg.bench.launch import free_port

    port = world.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    import ncclavg
    from ncclavg.comm import end_process
    from ncclavg.buffers import channel_type_code

    comm = ncclavg.Communicator.from_torch_distributed(devices=["cpu"], timeout=120.0)
    assert comm.transport == "shm", comm.transport
    channel = comm._channel
    backend_group = dist.new_group(backend="ncclavg")
    assert backend_group.transport == "shm", backend_group.transport
    np_dtypes = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}

    def sync() -> None:
        """MPI_Barrier, then the channel's barrier: an MPI's ranks spin while they wait (MPICH's do), and
        with more ranks than cores one still spinning in MPI_Barrier would hold a core through the first
        timed calls of the next contender (8 B calls read 1 ms for every contender that way); the
        channel's barrier completes only when every rank has left MPI, with microseconds of skew."""
        world.Barrier()
        channel.barrier(120.0)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        item = torch.empty((), dtype=dtype).element_size()
        for nbytes in args.sizes:
            n = max(1, nbytes // item)
            x = torch.ones(n, dtype=dtype)
            # MPI has no bfloat16 type: it sums the same bytes as float16 there would be wrong, so no row
            mpi_buf = x.numpy() if dtype in np_dtypes else None
            calls = {
                "ncclavg": lambda: comm.all_reduce_avg([x]),
                "ncclavg channel": lambda: channel.all_reduce_sum(x.data_ptr(), n, channel_type_code(dtype), 120.0, 1.0, float(size)),
                "MPI": (lambda: world.Allreduce(MPI.IN_PLACE, mpi_buf, op=MPI.SUM)) if mpi_buf is not None else None,
                "torch gloo": lambda: dist.all_reduce(x),
                "torch ncclavg": lambda: dist.all_reduce(x, group=backend_group),
            }
            if calls["MPI"] is not None:
                try:
                    calls["MPI"]()
                except Exception:   # noqa: BLE001 (an element type this MPI cannot sum: no row)
                    calls["MPI"] = None
            names = [c for c in CONTENDERS if calls[c] is not None]
            for c in names:   # warm-up, and an estimate of one call's time for the batch size
                calls[c]()
            est = {}
            for c in names:   # the median of single calls: the first after a barrier may wait for a core
                one = []
                sync()
                for _ in range(9 if n * item <= (1 << 20) else 3):
                    t0 = time.perf_counter()
                    calls[c]()
                    one.append(time.perf_counter() - t0)
                est[c] = world.allreduce(statistics.median(one), op=MPI.MAX)
            batch = {c: max(1, min(2000, int(BATCH_S / max(est[c], 1e-7)))) for c in names}
            per_round = max(sum(est[c] * batch[c] for c in names), 1e-6)
            rounds = max(min(3, args.rounds), min(args.rounds, int(args.budget / per_round)))
            samples = {c: [] for c in names}
            for i in range(rounds):
                for c in names[i % len(names):] + names[:i % len(names)]:   # each takes every place in turn
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(batch[c]):
                        calls[c]()
                    samples[c].append(world.allreduce((time.perf_counter() - t0) / batch[c], op=MPI.MAX))
            copy_gbps = _common.copy_bandwidth_gbps(n * item)
            for c in names:
                t = statistics.median(samples[c])
                algbw = n * item / t / 1e9
                rows.append({"procs": size, "dtype": dtype_name, "size_bytes": n * item, "contender": c,
                             "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (size - 1) / size,
                             "copy_gbps": copy_gbps, "batch": batch[c], "rounds": rounds})
            if rank == 0:
                print(f"  P={size} {dtype_name} {_common.human(n * item)}: " +
                      ", ".join(f"{c} {statistics.median(samples[c]) * 1e6:.1f} us" for c in names),
                      file=sys.stderr, flush=True)
    waiting = {}
    x = torch.ones(2)
    for c, call in (("ncclavg", lambda: comm.all_reduce_avg([x])), ("MPI", lambda: world.Allreduce(MPI.IN_PLACE, x.numpy(), op=MPI.SUM)),
                    ("torch gloo", lambda: dist.all_reduce(x))):
        world.Barrier()
        if rank == 0:
            time.sleep(args.wait_s)
            call()
        else:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            call()
            r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
            cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            if rank == 1:
                waiting[c] = {"wait_s": wall, "cpu_s": cpu, "core_percent": 100 * cpu / wall}
    waiting = world.bcast(waiting, root=1)   # rank 1 measured; rank 0 reports
    world.Barrier()
    if rank == 0:   # a file, not stdout: the launcher echoes the ranks' output, which it would interleave
        # Open MPI's string carries its C terminator (a NUL after the date): what precedes it, first line
        version = MPI.Get_library_version().split("\x00")[0].splitlines()[0].strip()
        Path(args.result).write_text(json.dumps({"rows": rows, "waiting": waiting, "mpi": version}))
    world.Barrier()
    dist.barrier()
    MPI.Finalize()   # Open MPI's launcher calls a rank that exits without it a failure (the MPICHs do not)
    end_process(0)   # no teardown of the gloo group: Note [Gloo teardown] in ncclavg/comm/dist.py


# -------------------------------------------------------------------------------------------- launcher
def run_echoed(cmd: list[str], env: dict, timeout: float, keep: int = 25) -> tuple[int | None, str]:
    """cmd's exit status (None when it ran past timeout and was killed) and its last `keep` lines of
    output; the output is echoed to stderr as it comes, so a long run shows its progress."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)   # its own group: a kill reaches the ranks
    tail: deque[str] = deque(maxlen=keep)

    def pump() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print("    " + line, end="", file=sys.stderr, flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    reader.join(5)
    return rc, "\n".join(tail)


def worker_args(args: argparse.Namespace, result: Path) -> list[str]:
    return ["--worker", "--result", str(result), "--dtypes", args.dtypes, "--sizes", ",".join(map(str, args.sizes)),
            "--budget", str(args.budget), "--rounds", str(args.rounds), "--wait-s", str(args.wait_s)]


def launch(peer: envs.Peer, procs: int, args: argparse.Namespace) -> dict:
    """One run of the worker under the peer's own mpiexec: the worker's result, or {"error": why, "output":
    the ranks' last lines}."""
    with tempfile.TemporaryDirectory(prefix="ncclavg-mpi-peer-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = envs.launch_command(peer, args.mpi_cache, procs, str(Path(__file__).resolve()),
                                  worker_args(args, result), args.bind)
        shown = " ".join(["mpiexec", *envs.mpiexec_options(peer, args.bind), "-n", str(procs),
                          "python bench/mpi_peer.py --worker ..."])
        print(f"[{peer.key}] P={procs}: {shown}", file=sys.stderr, flush=True)
        rc, tail = run_echoed(cmd, envs.launch_env(peer, args.bind), args.timeout)
        if rc == 0 and result.exists():
            return json.loads(result.read_text())
    why = f"ran past --timeout {args.timeout:g} s" if rc is None else f"exit {rc}"
    return {"error": f"the {procs}-process run failed ({why})", "output": tail}


def run_peer(peer: envs.Peer, procs_list: list[int], args: argparse.Namespace) -> dict:
    """Every process count's run of one peer (its venv made first if need be), as the JSON keeps it. The
    first failure ends the peer's runs: a libmpi that cannot start 2 ranks will not start 4."""
    entry = {"peer": peer.key, "label": peer.label, "mpi": None, "bind": args.bind,
             "launch": envs.launch_summary(peer, args.bind), "runs": {}, "error": None}
    try:
        envs.ensure_venv(peer, args.mpi_cache)
    except (RuntimeError, OSError) as e:
        entry["error"] = f"its venv could not be made: {e}"
        print(f"[{peer.key}] skipped: {entry['error']}", file=sys.stderr, flush=True)
        return entry
    if peer.key == "openmpi":
        entry["coll"] = {"ompi_info": envs.ompi_coll_components(peer, args.mpi_cache),
                         "comm_world": envs.ompi_coll_selected(peer, args.mpi_cache, min(procs_list), args.bind)}
    if peer.key == "impi":
        entry["startup"] = envs.impi_startup(peer, args.mpi_cache, max(procs_list), args.bind)
    for p in procs_list:
        got = launch(peer, p, args)
        entry["runs"][str(p)] = got
        if "error" in got:
            entry["error"] = got["error"] + ": " + last_lines(got.get("output", ""))
            print(f"[{peer.key}] {entry['error']}; going on with the other peers", file=sys.stderr, flush=True)
            break
        entry["mpi"] = got["mpi"]
    return entry


def last_lines(text: str, n: int = 3) -> str:
    """A failed run's reason, on one line, for the report: the first n lines inside the last box of
    dashes when the output has one (Open MPI's launcher boxes its messages, the problem first and
    advice after), else the last n non-blank lines (a Python traceback's last line is its error)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    rules = [i for i, x in enumerate(lines) if set(x) <= set("-=*") and len(x) >= 20]
    if len(rules) >= 2 and rules[-1] - rules[-2] > 1:
        return " ".join(lines[rules[-2] + 1:rules[-1]][:n])
    return " / ".join(lines[-n:]) or "no output"


# ---------------------------------------------------------------------------------------------- report
def merge(peers: list[dict]) -> list[dict]:
    """One row per (P, dtype, size) over every peer's runs: each peer's MPI time ("mpi_us", by peer key),
    and for each contender of NCCLAVG_SIDE the median of the times its runs measured ("time_us"), their
    (min, max) ("range_us") and how many ("runs"). ncclavg's bandwidth is from that median; the copy
    bandwidth is the median of the runs' own. "same_run": per peer, ncclavg's time over that MPI's in
    the same run (the same minutes of the machine: on a loaded one the runs differ far more than the
    contenders of one run), and "worst_same_run" the peer where that ratio is highest."""
    slots: dict[tuple, dict] = {}
    for e in peers:
        for run in e["runs"].values():
            for r in run.get("rows", []):
                s = slots.setdefault((r["procs"], r["dtype"], r["size_bytes"]),
                                     {"mpi": {}, "side": {c: [] for c in NCCLAVG_SIDE}, "copy": [], "own": {}})
                if r["contender"] == "MPI":
                    s["mpi"][e["peer"]] = r["time_us"]
                elif r["contender"] in s["side"]:
                    s["side"][r["contender"]].append(r["time_us"])
                if r["contender"] == "ncclavg":
                    s["copy"].append(r["copy_gbps"])
                    s["own"][e["peer"]] = r["time_us"]
    rows = []
    for (p, d, b), s in sorted(slots.items()):
        t = {c: statistics.median(v) if v else None for c, v in s["side"].items()}
        best = min(s["mpi"], key=s["mpi"].get) if s["mpi"] else None
        nc, tnc = t["ncclavg"], t["torch ncclavg"]
        algbw = b / (nc * 1e-6) / 1e9 if nc else None
        same = {k: s["own"][k] / v for k, v in s["mpi"].items() if k in s["own"] and v > 0}
        rows.append({"procs": p, "dtype": d, "size_bytes": b, "mpi_us": s["mpi"], "time_us": t,
                     "range_us": {c: [min(v), max(v)] for c, v in s["side"].items() if v},
                     "runs": len(s["side"]["ncclavg"]), "best_mpi": best,
                     "ncclavg_over_best_mpi": nc / s["mpi"][best] if best and nc else None,
                     "same_run": same, "worst_same_run": max(same, key=same.get) if same else None,
                     "torch_ncclavg_over_public": tnc / nc if tnc and nc else None,
                     "ncclavg_busbw_gbps": algbw * 2 * (p - 1) / p if algbw else None,
                     "copy_gbps": statistics.median(s["copy"]) if s["copy"] else None})
    return rows


def merge_waiting(peers: list[dict]) -> dict[str, dict]:
    """Per P: the % of a core a rank waiting for a late peer burns; each peer's MPI its own ("mpi", by
    peer key), ncclavg and gloo the median over the runs."""
    got: dict[str, dict] = {}
    for e in peers:
        for p, run in e["runs"].items():
            for c, v in run.get("waiting", {}).items():
                s = got.setdefault(p, {"mpi": {}, "side": {}})
                if c == "MPI":
                    s["mpi"][e["peer"]] = v["core_percent"]
                else:
                    s["side"].setdefault(c, []).append(v["core_percent"])
    return {p: {"mpi": s["mpi"], **{c: statistics.median(v) for c, v in s["side"].items()}}
            for p, s in sorted(got.items(), key=lambda kv: int(kv[0]))}


def columns(peers: list[dict]) -> list[tuple[str, str]]:
    """(peer key, column title) of the peers that produced rows, in --mpi's order: the title names the MPI
    and version its library reported, so a wheel that ships another major than its name says shows."""
    return [(e["peer"], envs.short_name(e["mpi"], e["label"])) for e in peers
            if any(run.get("rows") for run in e["runs"].values())]


def table(merged: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    """One line per (P, dtype, size): the ncclavg and torch contenders (medians over the runs), each MPI
    peer's MPI_Allreduce, ncclavg / the fastest MPI (below 1: ncclavg is faster), the highest ratio of
    ncclavg to an MPI within one run, and the torch backend / the public API (the torch face's cost)."""
    fmt = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
    head = (["P", "dtype", "size", "ncclavg us", "channel us", "torch ncclavg us", "gloo us"] +
            [f"{title} us" for _, title in cols] +
            ["ncclavg / best MPI", "ncclavg / MPI, same run (worst)", "torch ncclavg / public API",
             "ncclavg busbw GB/s", "copy GB/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in merged:
        t = r["time_us"]
        best = "-" if r["ncclavg_over_best_mpi"] is None else f"{r['ncclavg_over_best_mpi']:.2f}x ({r['best_mpi']})"
        face = "-" if r["torch_ncclavg_over_public"] is None else f"{r['torch_ncclavg_over_public']:.2f}x"
        w = r.get("worst_same_run")
        same = "-" if w is None else f"{r['same_run'][w]:.2f}x ({w})"
        cells = ([str(r["procs"]), r["dtype"], _common.human(r["size_bytes"]), fmt(t["ncclavg"]),
                  fmt(t["ncclavg channel"]), fmt(t["torch ncclavg"]), fmt(t["torch gloo"])] +
                 [fmt(r["mpi_us"].get(k)) for k, _ in cols] +
                 [best, same, face, "-" if r["ncclavg_busbw_gbps"] is None else f"{r['ncclavg_busbw_gbps']:.2f}",
                  fmt(r["copy_gbps"])])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def spread_line(merged: list[dict]) -> str | None:
    """How far apart the ncclavg contenders' runs under the different MPIs are (max / min of one row's
    values): each run has its own launcher (with --bind own, its own pinning) and its own minutes of a
    possibly shared machine, and a wide spread says the medians hide that."""
    parts = []
    for c in NCCLAVG_SIDE:
        got = [(hi / lo, r) for r in merged if r["runs"] > 1 and c in r["range_us"]
               for lo, hi in [r["range_us"][c]] if lo > 0]
        if got:
            worst, r = max(got, key=lambda x: x[0])
            parts.append(f"{c} {statistics.median(x for x, _ in got):.2f}x (at worst {worst:.2f}x, "
                         f"P={r['procs']} {r['dtype']} {_common.human(r['size_bytes'])})")
    return ("Spread of the ncclavg and torch contenders over the peers' runs (max / min of a row, median "
            "over the rows): " + "; ".join(parts) + ".") if parts else None


def peer_lines(peers: list[dict]) -> list[str]:
    """One line per peer: its library version string, Open MPI's collective components, or why it did
    not run."""
    lines = []
    for e in peers:
        say = f"- `{e['peer']}`: " + (" ".join(e["mpi"].split()) if e["mpi"] else "(no version: it did not start)")
        if e.get("launch"):
            say += "; launched with " + " ".join(e["launch"])
        coll = e.get("coll") or {}
        if coll.get("ompi_info"):
            say += "; coll components (ompi_info): " + ", ".join(coll["ompi_info"])
        if coll.get("comm_world"):
            say += ("; enabled on MPI_COMM_WORLD, highest priority first (--mca coll_base_verbose 20): "
                    + ", ".join(coll["comm_world"]))
        startup = e.get("startup") or {}
        if startup.get("tuning_file"):
            say += f"; tuning file {startup['tuning_file']} (I_MPI_DEBUG=5)"
        if startup.get("pinned_cpus"):
            say += "; the ranks' CPUs " + ", ".join(startup["pinned_cpus"])
        if e["error"]:
            say += f"; {'stopped' if e['mpi'] else 'did not run'}: {e['error']}"
        lines.append(say)
    return lines


def report(peers: list[dict]) -> list[str]:
    merged = merge(peers)
    binds = {e.get("bind") for e in peers}
    pinning = ("every launcher leaves the ranks unpinned (--bind none)" if binds == {"none"} else
               "each MPI pins the ranks as it does by default (--bind own)" if binds == {"own"} else "mixed")
    lines = ["MPI peers (MPI_Get_library_version, first line):", "", *peer_lines(peers), "",
             f"Timing rule: {RULE}. Pinning: {pinning}; Note [Pinning the ranks] in bench/mpi_peer_envs.py.",
             "The two ratio columns are ratios of times: below 1.00x the first named is faster.", "",
             *table(merged, columns(peers))]
    spread = spread_line(merged)
    if spread:
        lines += ["", spread]
    lines += ["", "A rank waiting for a late peer: CPU it burns (% of one core; ncclavg and gloo the median "
              "over the runs):", ""]
    for p, w in merge_waiting(peers).items():
        lines.append(f"- P={p}: " + ", ".join([f"{c} {w[c]:.1f}%" for c in ("ncclavg", "torch gloo") if c in w] +
                                              [f"{k} {v:.1f}%" for k, v in w["mpi"].items()]))
    return lines


def start_load(n: int) -> list:
    """n busy processes at the lowest priority (`nice -n 19`): the other jobs of a shared machine, which
    take a core whenever the ranks leave it, and which a rank that spins keeps waiting."""
    return [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpi", default=",".join(envs.PEERS),
                    help=f"MPI peers, comma-separated (default all: {','.join(envs.PEERS)})")
    ap.add_argument("--mpi-cache", type=Path, default=envs.DEFAULT_CACHE,
                    help="where the peers' venvs are made and reused (default ~/.cache/ncclavg/mpi-peers)")
    ap.add_argument("--bind", choices=envs.BINDS, default="none",
                    help="none (default): every launcher leaves the ranks unpinned; own: each MPI pins as it "
                         "does by default (Note [Pinning the ranks] in bench/mpi_peer_envs.py)")
    ap.add_argument("--procs", default="2,4", help="process counts, comma-separated (default 2,4)")
    ap.add_argument("--dtypes", default="float32", help="element types, comma-separated (float32, bfloat16, float16)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank, comma-separated")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed rounds per size (default 1)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"most rounds per size (default {ROUNDS}; at least 3 unless fewer are asked)")
    ap.add_argument("--wait-s", type=float, default=2.0, help="how late rank 0 comes in the waiting test")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit for each peer's and process count's run")
    ap.add_argument("--load", type=int, default=0,
                    help="busy processes (`nice -n 19`, a Python loop each) running beside the ranks for the "
                         "whole run: the loaded-machine comparison (default 0: quiet)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the table (markdown) here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.worker:
        worker(args)
        return
    try:
        chosen = envs.parse_peers(args.mpi)
    except ValueError as e:
        ap.error(str(e))
    procs = [int(v) for v in args.procs.split(",")]
    if args.load < 0:
        ap.error("--load must be 0 or more")
    busy = start_load(args.load)
    try:
        peers = [run_peer(peer, procs, args) for peer in chosen]
    finally:
        load_avg = os.getloadavg()
        for b in busy:
            b.kill()
            b.wait()
    lines = report(peers)
    if args.load:
        lines = [f"Loaded machine: {args.load} busy `nice -n 19` processes ran beside the ranks throughout "
                 f"(load average {load_avg[0]:.1f} at the end).", ""] + lines
    print("\n".join(lines))
    payload = {"machine": _common.machine(), "rule": RULE, "peers": peers, "merged": merge(peers),
               "waiting": merge_waiting(peers), "load": {"busy_processes": args.load, "load_avg_end": load_avg}}
    _common.write_json(args.json, payload)
    if args.md:
        m = payload["machine"]
        mpis = ", ".join(title for _, title in columns(peers)) or "MPI"
        head = [f"# ncclavg vs {mpis} vs torch gloo: all-reduce on one host ({m['date']})", "",
                f"{m['cpu']}, {m['cores']} cores, SIMD {m['simd_level']}; torch {m['torch']}.",
                "Command: `python bench/mpi_peer.py " + " ".join(sys.argv[1:]) + "`", ""]
        Path(args.md).write_text("\n".join(head + lines) + "\n")
        print(f"wrote {args.md}")
    if not columns(peers):
        sys.exit("no MPI peer ran: see the reasons above")


if __name__ == "__main__":
    main()
