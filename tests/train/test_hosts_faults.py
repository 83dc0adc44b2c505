"""Elastic restart across two hosts (Note [Elastic restart] in ncclavg/train/cli.py; the hosts are network
namespaces, tests/_netns.py): `ncclavg train` under `torchrun --max-restarts 1` on both hosts meets a
fault between them (a rank of host 1 killed mid-run; the link cut mid-run, then mended), torchrun
restarts the group on both hosts, every process resumes from the newest checkpoint in the directory the
hosts share, and the run ends with the master weights of an uninterrupted run of the same shape, bit for
bit (CPU towers). The faults themselves, and the errors the survivors raise, are the subject of
tests/process_group/test_hosts_faults.py."""
import os
import re
import time

import pytest
import torch
from _hosts_faults import HostsJob
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


def env_for(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                NCCLAVG_TIMEOUT=str(TIMEOUT_S), PYTHONUNBUFFERED="1", **extra)


def start(hosts, cwd, args, nproc, env, restarts):
    """A two-node run of tests/_elastic_train.py (`ncclavg train`, a rank that may kill itself) with both
    nodes in `cwd`: one file system shared by the hosts, as Note [Elastic restart] asks."""
    cmd = [str(TESTS / "_elastic_train.py"), *COMMON, *args]
    return HostsJob(hosts, cwd, cmd, env, nproc, cwds=[cwd, cwd], max_restarts=restarts)


def finish(job):
    """Waits for both nodes (the job's hard deadline), then returns the final checkpoint."""
    try:
        rcs = job.wait_nodes(job.deadline)
    finally:
        job.stop()
    assert rcs == [0, 0], f"exit statuses {rcs}\n" + job.outputs()
    assert job.leftovers() == []
    return ckpt.load(ckpt.resolve(str(job.outdir / "ck")))


def assert_bit_identical(got, want, steps):
    assert got["step"] == want["step"] == steps, (got["step"], want["step"])
    pairs = list(zip(got["master"]["params"], want["master"]["params"]))
    assert pairs and all(torch.equal(g, w) for g, w in pairs), "the resumed run's master weights differ"


# 2 hosts x 2 processes x 1 tower (a channel per host) and 2 hosts x 1 process x 2 towers (no channel):
# 4 towers either way. The reference is an uninterrupted run of the same shape: another shape sums the
# towers in another order (test_two_hosts.py), and only the same order can be compared bit for bit.
def wait_for(what, until):
    while time.monotonic() < until:
        if what():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("nproc,towers", [(2, "1")])
def test_rank_killed_on_the_other_host_restarts_both_hosts_bit_identical(hosts, tmp_path, nproc, towers):
    args = ["--epochs", "3", "--towers", towers]
    # the leader of host 1 dies at step 45, in epoch 2, after the checkpoint of epoch 1 (step 30)
    (tmp_path / "run").mkdir()
    job = start(hosts, tmp_path / "run", args, nproc, env_for(ELASTIC_VICTIM_RANK=str(nproc), ELASTIC_KILL_STEP="45"),
                restarts=1)
    got = finish(job)
    out = job.output(0)
    assert "after torchrun restart 1" in out and "(step 30, epoch 1)" in out, job.outputs()
    assert out.count("summary: ") == 1, job.outputs()
    (tmp_path / "ref").mkdir()
    ref = start(hosts, tmp_path / "ref", args, nproc, env_for(ELASTIC_VICTIM_RANK="none", ELASTIC_KILL_STEP="0"),
                restarts=0)
    assert_bit_identical(got, finish(ref), 90)


@pytest.mark.parametrize("nproc,towers", [(1, "2")])
def test_link_cut_then_mended_restarts_both_hosts_bit_identical(hosts, tmp_path, nproc, towers):
    # long enough (12 epochs, 2-3 s after the first) that the cut comes well before the end
    args = ["--epochs", "12", "--towers", towers]
    (tmp_path / "run").mkdir()
    job = start(hosts, tmp_path / "run", args, nproc, env_for(ELASTIC_VICTIM_RANK="none", ELASTIC_KILL_STEP="0"),
                restarts=1)
    try:
        first = tmp_path / "run" / "ck" / "ckpt-000000030.ckpt"
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
    got = finish(job)
    out = job.output(0)
    assert "after torchrun restart 1" in out and out.count("summary: ") == 1, job.outputs()
    assert re.search(r"CommTimeoutError: .*did not complete within 5 s", out), job.outputs()
    (tmp_path / "ref").mkdir()
    ref = start(hosts, tmp_path / "ref", args, nproc, env_for(ELASTIC_VICTIM_RANK="none", ELASTIC_KILL_STEP="0"),
                restarts=0)
    assert_bit_identical(got, finish(ref), 360)
