"""A process of a multi-process TowerTrainer run killed or frozen (SIGSTOP) mid-run: every survivor
raises CommError / CommTimeoutError within its timeout, naming the rank it lost (Note [Naming the lost
rank] in ncclavg/transport/liveness.py), exits non-zero, and the checkpoint directory holds only complete
checkpoints."""
import os
import signal

import _trainer_proc_workers as workers
import pytest
from _fault_util import read_reports, spawn_ranks

from ncclavg.train import checkpoint as ckpt

TIMEOUT = 4.0   # the communicators' timeout (seconds)


# A stopped (frozen) peer is found only when the timeout expires: that case runs in the slow suite.
@pytest.mark.parametrize("world,victim,how", [pytest.param(3, 2, "kill", marks=pytest.mark.slow),
                                              pytest.param(2, 1, "stop", marks=pytest.mark.slow),
                                              (3, 0, "kill")])
def test_survivors_raise_naming_the_lost_rank(tmp_path, world, victim, how):
    codes = spawn_ranks(workers.trainer_peer_lost, world, (str(tmp_path), victim, how, TIMEOUT), timeout_s=120)
    assert codes[victim] == (-signal.SIGKILL if how == "kill" else -signal.SIGSTOP), codes
    survivors = [r for r in range(world) if r != victim]
    assert all(codes[r] == 1 for r in survivors), codes   # non-zero exit, no hang
    reports = read_reports(tmp_path, world)
    for r in survivors:
        rep = reports[r]
        assert rep["type"] in ("CommError", "CommTimeoutError"), rep
        # the timeout, plus the diagnosis of who was lost (<= 2 s), plus slack for a loaded 2-core machine
        assert rep["elapsed"] < TIMEOUT + 2 + 6, rep
        if victim != 0:   # rank 0 hosts the store under init_method tcp://: with it gone, nobody can tell
            assert f"rank {victim} stopped responding" in rep["msg"], rep["msg"]
    # every checkpoint file present is complete (atomic writes): the newest one verifies and loads
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files and all(f.endswith(".ckpt") for f in files), files
    for f in files:
        ckpt.load(str(tmp_path / "ck" / f))
