"""Elastic restart across two hosts (Note [Elastic restart] in ncclavg/train/cli.py; the hosts are network
namespaces, tests/_netns.py): `ncclavg train` under `torchrun --max-restarts 1` on both hosts meets a
fault between them (a rank of host 1 killed mid-run; the link cut mid-run, then mended), torchrun
restarts the group on both hosts, every process resumes from the newest checkpoint in the directory the
hosts share, and the run ends with the master weights of an uninterrupted run of the same shape, bit for
bit (CPU towers). The faults themselves, and the errors the survivors raise, are the subject of
tests/process_group/test_two_hosts_faults.py."""
import os
import re
import time

import pytest
import torch
from _hosts_faults import HostsJob, wait_jobs
from _netns import two_hosts_fixture
from _paths import ROOT, TESTS

from ncclavg.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

TIMEOUT_S = 5   # NCCLAVG_TIMEOUT: a cut link is found when it expires
# digits MLP, global batch 48: 30 steps an epoch, a checkpoint after each
COMMON = ["--model", "mlp", "--batch-size", "48", "--lr-schedule", "constant", "--no-progress",
          "--checkpoint-dir", "ck"]


@pytest.fixture
def hosts():
    yield from two_hosts_fixture()


@pytest.fixture
def ref_hosts():
    """Two more hosts, for the uninterrupted run beside the one that meets the fault."""
    yield from two_hosts_fixture()


def env_for(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                NCCLAVG_TIMEOUT=str(TIMEOUT_S), PYTHONUNBUFFERED="1", **extra)


def start(hosts, cwd, args, nproc, restarts, victim="none", step="0"):
    """A two-node run of tests/_elastic_train.py (`ncclavg train`; rank `victim` kills itself at `step`)
    with both nodes in `cwd`: one file system shared by the hosts, as Note [Elastic restart] asks."""
    cwd.mkdir()
    cmd = [str(TESTS / "_elastic_train.py"), *COMMON, *args]
    env = env_for(ELASTIC_VICTIM_RANK=str(victim), ELASTIC_KILL_STEP=str(step))
    return HostsJob(hosts, cwd, cmd, env, nproc, cwds=[cwd, cwd], max_restarts=restarts)


def wait_for(what, until):
    while time.monotonic() < until:
        if what():
            return True
        time.sleep(0.05)
    return False


def finish(*jobs):
    """Waits for every node of `jobs` (their hard deadlines), checks that nothing of them is left (no
    process, no channel segment: the leftover check saw the channels of a host of several processes),
    then returns each job's final checkpoint."""
    try:
        wait_jobs(jobs, max(job.deadline for job in jobs))
    finally:
        left = [job.stop() for job in jobs]
    out = []
    for job, still in zip(jobs, left):
        rcs = [p.returncode for p in job.procs]
        assert rcs == [0, 0], f"exit statuses {rcs}\n" + job.outputs()
        assert still == {0: [], 1: []} and job.leftovers() == [], (still, job.leftovers())
        assert bool(job.segments) == (job.nproc > 1), job.segments
        out.append(ckpt.load(ckpt.resolve(str(job.outdir / "ck"))))
    return out


def assert_bit_identical(got, want, steps):
    assert got["step"] == want["step"] == steps, (got["step"], want["step"])
    pairs = list(zip(got["master"]["params"], want["master"]["params"]))
    assert pairs and all(torch.equal(g, w) for g, w in pairs), "the resumed run's master weights differ"


# 2 hosts x 2 processes x 1 tower (a channel per host) and 2 hosts x 1 process x 2 towers (no channel):
# 4 towers either way, one shape per fault. The reference is an uninterrupted run of the same shape
# (another shape sums the towers in another order: only the same order can be compared bit for bit),
# run at the same time on two hosts of its own.
def test_rank_killed_on_the_other_host_restarts_both_hosts_bit_identical(hosts, ref_hosts, tmp_path):
    nproc, args = 2, ["--epochs", "3", "--towers", "1"]
    ref = start(ref_hosts, tmp_path / "ref", args, nproc, restarts=0)
    # the leader of host 1 dies at step 45, in epoch 2, after the checkpoint of epoch 1 (step 30)
    job = start(hosts, tmp_path / "run", args, nproc, restarts=1, victim=nproc, step=45)
    got, want = finish(job, ref)
    out = job.output(0)
    assert "after torchrun restart 1" in out and "(step 30, epoch 1)" in out, job.outputs()
    assert out.count("summary: ") == 1, job.outputs()
    assert_bit_identical(got, want, 90)


def test_link_cut_then_mended_restarts_both_hosts_bit_identical(hosts, ref_hosts, tmp_path):
    # long enough (12 epochs, 2-3 s after the first) that the cut comes well before the end
    nproc, args = 1, ["--epochs", "12", "--towers", "2"]
    ref = start(ref_hosts, tmp_path / "ref", args, nproc, restarts=0)
    job = start(hosts, tmp_path / "run", args, nproc, restarts=1)
    try:
        first = job.outdir / "ck" / "ckpt-000000030.ckpt"
        assert wait_for(first.exists, job.deadline), "no checkpoint after epoch 1\n" + job.outputs()
        workers = job.workers()
        job.inject("link")
        # every rank of both hosts fails (each side's timeout), and both agents restart their group: only
        # then is the link mended, so that no rank of the first attempt sees it come back
        assert wait_for(lambda: not set(workers) & set(job.workers()), job.deadline), job.outputs()
        job.mend_link()
    except BaseException:
        job.stop()
        raise
    got, want = finish(job, ref)
    out = job.output(0)
    assert "after torchrun restart 1" in out and out.count("summary: ") == 1, job.outputs()
    assert re.search(rf"CommTimeoutError: .*did not complete within {TIMEOUT_S} s", out), job.outputs()
    assert_bit_identical(got, want, 360)
