"""Faults between two hosts for real (Note [Faults between hosts] in tests/_hosts_faults.py): a rank of
the other host killed, the link cut, the other host frozen, while every rank runs collectives through
the `ncclavg` torch backend (dist.all_reduce, stock DDP) or the public API (a Communicator over
torch.distributed). Two shapes: 2 hosts x 2 processes (a channel per host, UCX's lanes between them, or
gloo's with NCCLAVG_UCX=0) and 2 hosts x 1 process (no channel). Every surviving rank, on both hosts where there are survivors, raises
an error of its face naming the collective, the timeout (where only the timeout can end the wait) and
what was lost, within a derived bound; the job ends (or is killed at its hard deadline, and the test
fails); nothing of the channels is left on the machine."""
import os
import re

import pytest
import torch
from _dist_util import between_hosts
from _hosts_faults import HostsJob, check_named_loss, lost_by, raise_bound_s, survivors
from _netns import two_hosts_fixture
from _paths import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

TIMEOUT_S = 5.0   # the group's (or communicator's) timeout: a silent peer is found when it expires
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_hosts_fault_workers.py")
# how each face names the collective that failed (1 MiB of float32 a call; DDP's one bucket about as big)
COLLECTIVE = {"backend": r"ncclavg allreduce of 262144 x float32",
              "ddp": r"ncclavg allreduce of \d+ x float32",
              "api": r"all_reduce_avg of 1048576 bytes \(262144 x float32 per tower\)"}

@pytest.fixture
def hosts():
    yield from two_hosts_fixture()


# Each fault through both faces and in both shapes, not every combination (each case is a two-host job
# of ~10 s): the channel's shape (2 x 2) through the backend (stock DDP where a rank dies, a plain
# dist.all_reduce otherwise), the shape without a channel (2 x 1) through the public API.
@pytest.mark.parametrize("face,fault,nproc", [
    ("ddp", "kill", 2),
    ("backend", "link", 2),
    ("backend", "stop", 2),
    ("api", "kill", 1),
    ("api", "link", 1),
    ("api", "stop", 1),
])
def test_fault_between_hosts_is_named_on_every_survivor_within_the_timeout(hosts, tmp_path, face, fault, nproc):
    alive = survivors(fault, nproc)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), HERE, os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [WORKER, face, str(tmp_path), str(TIMEOUT_S), ",".join(map(str, alive))]
    job = HostsJob(hosts, tmp_path, cmd, env, nproc)
    bound = raise_bound_s(TIMEOUT_S)
    try:
        ready = job.ready()
        want = between_hosts(alone=nproc == 1)
        assert all(r["transport"] == want for r in ready.values()), ready
        # a channel per host, or none at all; and the leftover check below sees the channels' memory files
        assert bool(job.segments) == (nproc > 1), job.segments
        t_fault = job.inject(fault, victim_pid=ready[nproc]["pid"])
        # every survivor reports, then its node ends; a frozen host never ends by itself (the test ends it)
        job.wait_files([f"rank{r}.json" for r in alive], min(job.deadline, t_fault + bound))
        # a node's agent ends within seconds of its ranks (its monitor's period, its teardown)
        ends = job.wait_nodes(min(job.deadline, t_fault + bound + 10), nodes=[0] if fault == "stop" else [0, 1])
    finally:
        left = job.stop()
    reports = job.reports()
    assert sorted(reports) == alive, f"survivors that reported: {sorted(reports)}, want {alive}\n" + job.outputs()
    assert all(rc is not None and rc != 0 for rc in ends), f"nodes still running or ended well: {ends}\n" + \
        job.outputs()
    # nothing of the job outlives its nodes (but the frozen host, which the test ended)
    assert left[0] == [] and (fault == "stop" or left[1] == []), left
    assert job.leftovers() == []

    timeout_only = fault != "kill"   # nothing resets a connection: only the timeout ends the wait
    for r, rep in reports.items():
        elapsed = rep["raised"] - t_fault
        assert elapsed <= bound, f"rank {r} raised {elapsed:.1f} s after the fault (bound {bound:.1f} s): {rep}"
        msg = rep["msg"]
        assert re.search(COLLECTIVE[face], msg), (r, msg)
        if face == "ddp":   # DDP's reducer raises a RuntimeError carrying the backend's text: a lost peer
            # (BackendError) or, for a survivor whose wait no reset connection ends (its partner across
            # hosts is alive until its own agent ends it), the timeout (BackendTimeoutError, a BackendError)
            assert rep["type"] == "RuntimeError" and re.search(r"\bBackend(Timeout)?Error\b", msg), (r, rep)
        elif face == "backend":
            assert {"DistBackendError", "CommError"} <= set(rep["classes"]), (r, rep)
        else:
            assert "CommError" in rep["classes"] or "CommTimeoutError" in rep["classes"], (r, rep)
        if timeout_only:
            assert f"within {TIMEOUT_S:g} s" in msg, (r, msg)
            assert {"BackendTimeoutError", "CommTimeoutError"} & set(rep["classes"]), (r, rep)
        # the group or communicator stays failed: the next call says so at once
        assert "unusable" in rep["later"], (r, rep["later"])
    # last: what each survivor names (a rank that was lost, or the address of the host behind a cut link)
    check_named_loss(reports, {r: lost_by(fault, nproc, r) for r in alive}, hosts, nproc)
