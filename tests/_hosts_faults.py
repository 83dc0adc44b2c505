"""Faults between hosts for the slow tests (tests/process_group/test_two_hosts_faults.py and
tests/train/test_two_hosts_restart.py): a two-node torchrun job in two network namespaces (_netns.py), a
fault injected while it runs, and the checks that follow every fault: the job ends by its own hard
deadline or is killed, and nothing of its channels is left on the machine.

Note [Faults between hosts]
Each fault is one a real cluster meets, made with what the namespaces offer:
- "kill": the leader of host 1 (its lowest rank) is SIGKILLed: a process on the other host dies, and
  its connections are reset by the kernel, so the survivors may learn of it before their timeout.
- "link": host 1's end of the veth pair is set down inside its namespace: the cable is cut. Nothing is
  reset; every rank on both hosts is alive, and each side sees the other go silent.
- "stop": every process of host 1 (its torchrun agent too) is SIGSTOPped: a frozen host, alive to the
  kernel, silent on the wire.
The bound on when a survivor raises (`raise_bound_s`) is derived from the runner's own bounds, not
measured: see its comment.
Leftovers: the channels' segments are memory files without a name (memfd) mapped by the ranks of a
host; the test records the ones the ranks map while healthy (device and inode in /proc/<pid>/maps) and,
once the job is over, asserts that no process on the machine still maps or holds one of them, and that
no new `ncclavg*` name appeared in /dev/shm.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from ncclavg.transport.liveness import DIAGNOSE_S
from ncclavg.transport.runner import BACKSTOP_S

FAULTS = ("kill", "link", "stop")
MEMFD = "/memfd:ncclavg"   # how /proc writes a memory file that ncclavg made (memfd_create's name)
LOAD_SLACK_S = 6.0   # a 2-core machine busy with both hosts' ranks and agents (and other jobs beside them)
JOB_DEADLINE_S = 120   # a hard bound on any job: a hang ends there, killed, and the test fails saying so


def raise_bound_s(timeout: float) -> float:
    """How long after the fault every survivor must have raised. A survivor's call that runs when the
    fault comes (or the one after it) has its deadline at most `timeout` later; a wait that misses the
    watchdog's abort at the deadline is ended by its own limit BACKSTOP_S later (the watchdog's period,
    the heartbeats' diagnosis DIAGNOSE_S and the runner's scheduling margin); the failure it raises is
    then named by the heartbeats once more (at most DIAGNOSE_S). LOAD_SLACK_S covers a loaded machine."""
    return timeout + BACKSTOP_S + DIAGNOSE_S + LOAD_SLACK_S


class LostMisnamed(AssertionError):
    """A survivor's error names a rank that is alive as lost, or names nothing that was lost (the tests
    mark a known case xfail with raises=LostMisnamed, so that any other failure still fails them)."""


def survivors(fault: str, nproc: int) -> list:
    """The ranks that outlive the fault (host 0 holds ranks 0..nproc-1, host 1 the next nproc)."""
    world = 2 * nproc
    if fault == "kill":
        return [r for r in range(world) if r != nproc]   # the leader of host 1 dies
    if fault == "stop":
        return list(range(nproc))                        # host 1 is frozen: it raises nothing
    return list(range(world))                            # a cut link leaves every rank alive


def lost_by(fault: str, nproc: int, rank: int) -> set:
    """The ranks that `rank` lost: the killed one, the frozen host's, or the other side of the cut link."""
    host1 = set(range(nproc, 2 * nproc))
    if fault == "kill":
        return {nproc}
    if fault == "link" and rank in host1:
        return set(range(nproc))
    return host1


_STOPPED = re.compile(r"\branks? (\d+(?:, \d+)*) stopped responding")


def named_lost(msg: str) -> set:
    """The ranks a message says stopped responding (the words of the channel's and the heartbeats'
    errors alike)."""
    return {int(r) for m in _STOPPED.finditer(msg) for r in m.group(1).split(", ")}


def check_named_loss(reports: dict, lost: dict, hosts, nproc: int) -> None:
    """Each survivor's error names what it lost, and nothing else: the ranks it says stopped responding
    are among `lost[rank]` (at least one), or, naming no rank, it names the address of a host it lost
    (rank q is on host q // nproc). Raises LostMisnamed listing every survivor that does not."""
    wrong = []
    for r, rep in sorted(reports.items()):
        named = named_lost(rep["msg"])
        if named and named <= lost[r]:
            continue
        if not named and any(hosts.hosts[q // nproc].addr in rep["msg"] for q in lost[r]):
            continue
        wrong.append(f"rank {r} lost {sorted(lost[r])} but names {sorted(named) or 'no rank'}: {rep['msg']}")
    if wrong:
        raise LostMisnamed("\n".join(wrong))


class HostsJob:
    """A two-node torchrun job, node k in host k of `hosts` (_netns.TwoHosts), its output in
    `outdir`/host<k>.log; `cmd` is what torchrun runs on each node (in `cwds[k]`), restarting the group
    up to `max_restarts` times."""

    def __init__(self, hosts, outdir: Path, cmd: list, env: dict, nproc: int, cwds=None, max_restarts: int = 0):
        self.hosts, self.outdir, self.nproc = hosts, Path(outdir), nproc
        self.world = 2 * nproc
        self.deadline = time.monotonic() + JOB_DEADLINE_S
        self.shm_before = shm_names()
        self.procs: list = [None, None]
        self.logs = [self.outdir / f"host{k}.log" for k in (0, 1)]
        for k in (1, 0):
            with open(self.logs[k], "w") as log:
                self.procs[k] = subprocess.Popen(hosts.torchrun(k, *cmd, nproc=nproc, max_restarts=max_restarts),
                                                 env=hosts.env(k, env),
                                                 stdout=log, stderr=subprocess.STDOUT,
                                                 cwd=None if cwds is None else cwds[k])
        self.segments: set = set()

    # ------------------------------------------------------------------ while it runs
    def output(self, k: int) -> str:
        return self.logs[k].read_text(errors="replace")

    def outputs(self) -> str:
        return "".join(f"--- host {k}:\n{self.output(k)[-4000:]}\n" for k in (0, 1))

    def wait_files(self, names: list, until: float) -> bool:
        """True once every file of `names` is in outdir; False at `until` or when both nodes exited."""
        while time.monotonic() < until:
            if all((self.outdir / n).exists() for n in names):
                return True
            if all(p.poll() is not None for p in self.procs):
                return all((self.outdir / n).exists() for n in names)
            time.sleep(0.05)
        return False

    def ready(self) -> dict:
        """Waits for every rank's ready<rank>.json (the ranks run collectives from then on); returns
        them by rank, and records the channel segments the ranks map."""
        names = [f"ready{r}.json" for r in range(self.world)]
        assert self.wait_files(names, self.deadline), "the ranks never got ready:\n" + self.outputs()
        self.look_at_segments()
        return {r: json.loads((self.outdir / n).read_text()) for r, n in enumerate(names)}

    def inject(self, fault: str, victim_pid: int = 0) -> float:
        """Makes `fault` (Note [Faults between hosts]); returns when it was made (time.monotonic())."""
        if fault == "kill":
            t = time.monotonic()
            os.kill(victim_pid, signal.SIGKILL)
        elif fault == "link":
            t = time.monotonic()
            self.hosts.set_link(1, up=False)
        elif fault == "stop":
            t = time.monotonic()
            self.hosts.kill_all(1, signal.SIGSTOP)
        else:
            raise ValueError(f"fault: one of {FAULTS}, got {fault!r}")
        return t

    def look_at_segments(self) -> None:
        """Adds the channel segments the job's processes map now to those the leftover check looks for."""
        for k in (0, 1):
            for pid in self.hosts.pids(k):
                self.segments |= mapped_segments(pid)

    def mend_link(self) -> None:
        """Sets host 1's end of the veth pair up again (after a "link" fault)."""
        self.hosts.set_link(1, up=True)

    def workers(self) -> list:
        """The pids of the job's processes other than the two torchrun agents."""
        agents = {p.pid for p in self.procs}   # `ip netns exec` execs torchrun: the same pid
        return [pid for k in (0, 1) for pid in self.hosts.pids(k) if pid not in agents]

    # ------------------------------------------------------------------ ending
    def reports(self) -> dict:
        """The ranks' rank<r>.json reports (_hosts_fault_workers.py), by rank."""
        return {r: json.loads((self.outdir / f"rank{r}.json").read_text()) for r in range(self.world)
                if (self.outdir / f"rank{r}.json").exists()}

    def wait_nodes(self, until: float, nodes=(0, 1)) -> list:
        """The exit status of each node of `nodes`, or None for one still running at `until`."""
        wait_jobs([self], until, nodes)
        return [self.procs[k].poll() for k in nodes]

    def stop(self) -> dict:
        """Kills what is left of the job (a frozen host's processes among them: they hold their host's
        channel); returns the pids each host still had."""
        left = {k: self.hosts.pids(k) for k in (0, 1)}
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for k in (0, 1):
            self.hosts.kill_all(k)
        for p in self.procs:
            p.wait()
        until = time.monotonic() + 10
        while any(self.hosts.pids(k) for k in (0, 1)) and time.monotonic() < until:
            time.sleep(0.05)
        return left

    def leftovers(self) -> list:
        """What the job left on the machine once its processes are gone: segments still mapped or held
        by some process, new `ncclavg*` names in /dev/shm."""
        out = [f"/dev/shm/{n}" for n in sorted(shm_names() - self.shm_before)]
        if self.segments:
            out += [f"segment {seg} still used by pid {pid}" for pid, seg in segment_users(self.segments)]
        return out


def wait_jobs(jobs: list, until: float, nodes=(0, 1)) -> None:
    """Waits until the nodes `nodes` of every job of `jobs` have exited, or `until`; meanwhile records the
    segments their processes map (a restarted group makes new ones)."""
    while time.monotonic() < until and any(job.procs[k].poll() is None for job in jobs for k in nodes):
        for job in jobs:
            job.look_at_segments()
        time.sleep(0.2)


def shm_names() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ncclavg")}
    except OSError:
        return set()


def mapped_segments(pid: int) -> set:
    """(device, inode) of every ncclavg memory file that process `pid` maps."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(MEMFD):
                    out.add((fields[3], int(fields[4])))
    except OSError:
        pass
    return out


def _held(pid: str) -> set:
    """(device, inode) of every memory file process `pid` holds open, as /proc/<pid>/maps writes them."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(MEMFD):
                continue
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out.add((f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino))
    return out


def segment_users(segments: set) -> list:
    """(pid, segment) for every process on the machine that still maps or holds one of `segments`."""
    users = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for seg in (mapped_segments(int(pid)) | _held(pid)) & segments:
                users.append((int(pid), seg))
    return users
