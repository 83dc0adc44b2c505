"""How bench/hosts.py starts the ranks of one launch inside the emulated hosts (bench/hosts_net.py): a
torchrun node in each host (the torch contenders), or Open MPI's mpirun in host 0 reaching the other
hosts through an "ssh agent" that is `ip netns exec` (the MPI contender); and the busy processes of
--load. Every process started here is killed when its launch ends or fails (its namespace's processes,
by the network's `pids`), and the load processes carry the run's tag (hosts_net.tagged_pids).

Note [Open MPI across namespaces]
Open MPI 5 (PRRTE) starts one daemon per host through its ssh agent (`--prtemca plm_ssh_agent`), which
it calls as `agent HOSTNAME 'command line'`, and tells hosts apart by hostname. So each host gets a
hostname of its own (a UTS namespace per launch: `unshare --uts`, hostname = the namespace's name),
/etc/hosts inside each namespace names every host at its NIC 0 address (hosts_net writes
/etc/netns/NS/hosts, which `ip netns exec` mounts over /etc/hosts), and the agent is a shell script
that maps the hostname to its namespace and runs the command line there. The daemons call back over
NIC 0 (oob_tcp_if_include), the ranks talk over every NIC of the job (btl tcp, btl_tcp_if_include;
Open MPI stripes a message over them) and through shared memory within a host (btl sm). On 2 cores
with more ranks than cores, ranks must yield while they poll (mpi_yield_when_idle 1) and may not be
pinned (--bind-to none: Note [Pinning the ranks] in mpi_peer_envs.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from hosts_net import kill_pids

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hosts_worker.py"
MASTER_PORT = 29611   # host 0's TCPStore (+ the launch's index: a new port per launch)
FAIL_GRACE_S = 15.0   # after one node fails, how long the others get to end on their own


@dataclass
class Outcome:
    ok: bool
    wall_s: float
    error: str | None
    tail: str


class Echo:
    """Reads a process's merged output as it comes (so its pipe never fills), keeping the last lines and
    echoing them to stderr with a prefix."""

    def __init__(self, proc: subprocess.Popen, prefix: str, echo: bool, keep: int = 40):
        self.lines: deque[str] = deque(maxlen=keep)
        self._thread = threading.Thread(target=self._pump, args=(proc, prefix, echo), daemon=True)
        self._thread.start()

    def _pump(self, proc, prefix, echo) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if echo:
                print(f"    {prefix}{line}", end="", file=sys.stderr, flush=True)

    def text(self) -> str:
        self._thread.join(5)
        return "\n".join(self.lines)


def worker_args(contender: str, args, net, result: Path) -> list[str]:
    return ["--contender", contender, "--collective", args.collective, "--sizes", ",".join(map(str, args.sizes)), "--calls", str(args.calls),
            "--warmup", str(args.warmup), "--ifnames", ",".join(net.ifnames), "--nic-use", args.nic_use,
            "--hostnames", ",".join(h.hostname for h in net.hosts), "--timeout", str(args.timeout),
            "--result", str(result)]


def base_env(workdir: Path) -> dict:
    """One thread per rank (the ranks share the cores); unbuffered output, so lines come as printed;
    TMPDIR in the run's folder, so that torchrun's and Open MPI's scratch folders (named by pid, not by
    the run) go with it, even after a kill (hosts_net.remove_run)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(workdir))


def torchrun_command(net, h: int, procs: int, port: int, script_args: list[str]) -> list[str]:
    """Node h of an H-node torchrun job inside host h: the static rendezvous at host 0's NIC 0 address
    (Note [Two hosts from network namespaces] in tests/_netns.py: why not c10d)."""
    return [*net.netns_exec(h), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(net.hosts_n),
            "--nproc-per-node", str(procs), "--node-rank", str(h), "--master-addr", net.hosts[0].addrs[0],
            "--master-port", str(port), "--max-restarts", "0", str(WORKER), *script_args]


def run_torch(contender: str, index: int, args, net, result: Path) -> Outcome:
    env = dict(base_env(net.workdir), GLOO_SOCKET_IFNAME=net.ifnames[0], NCCLAVG_TIMEOUT=str(args.timeout))
    cmds = [torchrun_command(net, h, args.procs, MASTER_PORT + index, worker_args(contender, args, net, result))
            for h in range(net.hosts_n)]
    return _run_all(cmds, env, args.timeout, net, echo=args.verbose)


def agent_script(net) -> Path:
    """The ssh agent of Note [Open MPI across namespaces]: `agent HOSTNAME COMMAND...`."""
    cases = "\n".join(f"  {h.hostname}) ns={h.netns} ;;" for h in net.hosts)
    path = Path(net.workdir) / "mpi-agent.sh"
    path.write_text(f"""#!/bin/sh
# Open MPI's "ssh" into an emulated host: run the command line in its namespace, under its hostname
host=$1; shift
case $host in
{cases}
  *) echo "mpi-agent: unknown host $host" >&2; exit 1 ;;
esac
exec {net.ip} netns exec "$ns" {net.unshare} --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
    path.chmod(0o755)
    return path


# Note [Two Open MPI contenders]
# "mpi" is Open MPI as the job asks for it here (btl self,sm,tcp) with its own choice of collective
# components: on 2 hosts x 2 processes it picks han (hierarchical: reduce in the host through sm, across
# the hosts, broadcast in the host), whose pipeline stalls with 4 polling ranks on 2 cores (4 MiB: 54-68
# ms, 32 MiB: 0.3-0.7 s, against 21-31 ms and 0.2-0.3 s below). "mpi-tcp" is every byte over TCP
# (btl self,tcp) with han off (coll ^han: the tuned component's flat algorithms), the fastest setting
# measured here at every size on 2 x 2 (with han off but sm on, 4 KiB took 6-13 ms). Both run every
# time, and the table's "best MPI" is the faster of the two at each size.
MPI_VARIANTS = {
    "mpi": ("--mca", "btl", "self,sm,tcp"),
    "mpi-tcp": ("--mca", "btl", "self,tcp", "--mca", "coll", "^han"),
}


def mpi_command(net, procs: int, venv: Path, script_args: list[str], variant: str = "mpi",
                extra_mca: tuple[tuple[str, str], ...] = ()) -> list[str]:
    ifs = ",".join(net.ifnames)
    mca = [a for name, value in extra_mca for a in ("--mca", name, value)]
    return [*net.netns_exec(0, hostname=True), str(venv / "bin" / "mpiexec"),
            "--host", ",".join(f"{h.hostname}:{procs}" for h in net.hosts), "-n", str(net.hosts_n * procs),
            "--map-by", f"ppr:{procs}:node", "--bind-to", "none",
            "--prtemca", "plm_ssh_agent", str(agent_script(net)), "--prtemca", "oob_tcp_if_include", net.ifnames[0],
            *MPI_VARIANTS[variant], "--mca", "btl_tcp_if_include", ifs, "--mca", "mpi_yield_when_idle", "1", *mca,
            str(venv / "bin" / "python"), str(WORKER), *script_args]


def mpi_env(venv: Path, workdir: Path) -> dict:
    env = base_env(workdir)
    for k in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH"):
        env.pop(k, None)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return env


def run_mpi(variant: str, index: int, args, net, venv: Path, result: Path) -> Outcome:
    cmd = mpi_command(net, args.procs, venv, worker_args(variant, args, net, result), variant, args.mpi_mca)
    return _run_all([cmd], mpi_env(venv, net.workdir), args.timeout, net, echo=args.verbose)


def _run_all(cmds: list[list[str]], env: dict, timeout: float, net, echo: bool) -> Outcome:
    """Starts the commands (the last first: host 0's node, which hosts the store, comes last, as a
    late host does) and waits for all of them, at most `timeout`, and at most FAIL_GRACE_S after one
    failed (the others may wait for it until their own timeout); then kills whatever is left in the
    hosts."""
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    outs: list[Echo] = []
    failed_at = None
    try:
        for i in reversed(range(len(cmds))):
            p = subprocess.Popen([*die_with_us(), *cmds[i]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            outs.append(Echo(p, f"[host {i}] " if len(cmds) > 1 else "", echo))
        while True:
            rcs = [p.poll() for p in procs]
            now = time.monotonic()
            if None not in rcs:
                break
            if failed_at is None and any(rc not in (None, 0) for rc in rcs):
                failed_at = now
            if now - t0 > timeout or (failed_at is not None and now - failed_at > FAIL_GRACE_S):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for h in range(net.hosts_n):
            kill_pids(net.pids(h))
    wall = time.monotonic() - t0
    tail = "\n".join(o.text() for o in outs)
    bad = [rc for rc in rcs if rc != 0]
    if not bad:
        return Outcome(True, wall, None, tail)
    if None in rcs and failed_at is None:
        return Outcome(False, wall, f"ran past --timeout {timeout:g} s", tail)
    return Outcome(False, wall, f"exit {next(rc for rc in bad if rc is not None)}", tail)


LOAD_CODE = "while True: pass"


def die_with_us() -> list[str]:
    """A prefix that makes the command die with this process, even when it is killed (SIGKILL cannot
    be caught): util-linux's setpriv sets the parent-death signal, which survives the exec of `ip`,
    `nice` and python. Without setpriv the leftovers are found by their tag (hosts_net.leftovers)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL"] if setpriv else []


def start_load(n: int, tag: str) -> list[subprocess.Popen]:
    """n busy processes at the lowest priority (`nice -n 19`), outside the hosts (they take the cores
    the ranks leave, as other jobs of a shared machine do); their command line names the run."""
    return [subprocess.Popen([*die_with_us(), "nice", "-n", "19", sys.executable, "-c", LOAD_CODE, f"{tag}-load"],
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()
