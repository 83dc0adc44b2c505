"""A peer of an `ncclavg` process group killed (SIGKILL) or frozen (SIGSTOP): every survivor's next
collective fails within the timeout with torch's DistBackendError (also ncclavg's CommError) naming the
lost rank, through the shared-memory channel and through gloo alone (NCCLAVG_SHM=0); through stock DDP the
same text arrives as the RuntimeError DDP's C++ reducer raises (Note [One Work for both faces] in ncclavg/transport/work.py)."""
import re
import signal

import _process_group_workers as W
import pytest
from _fault_util import read_reports, spawn_ranks

TIMEOUT = 4.0


SLOW = pytest.mark.slow


@pytest.mark.parametrize("world,victim,how,shm,mode", [
    (2, 1, "kill", "auto", "allreduce"),
    pytest.param(3, 0, "kill", "auto", "allreduce", marks=SLOW),   # rank 0 hosts the store: the channel names it
    pytest.param(2, 1, "stop", "auto", "allreduce", marks=SLOW),
    pytest.param(3, 2, "kill", "0", "allreduce", marks=SLOW),
    pytest.param(2, 1, "stop", "0", "allreduce", marks=SLOW),
    (2, 1, "kill", "auto", "ddp"),
])
def test_lost_peer_is_named_within_the_timeout(tmp_path, monkeypatch, world, victim, how, shm, mode):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    codes = spawn_ranks(W.peer_lost_job, world, (str(tmp_path), victim, how, TIMEOUT, mode), timeout_s=120)
    assert codes[victim] == (-signal.SIGKILL if how == "kill" else -signal.SIGSTOP), codes
    reports = read_reports(tmp_path, world)
    survivors = [r for r in range(world) if r != victim]
    assert sorted(reports) == survivors, (codes, reports)
    for r in survivors:
        rep = reports[r]
        # a hang would have been cut by spawn_ranks; within the timeout plus the diagnosis (2.5 s) and slack
        assert rep["elapsed"] < TIMEOUT + 10, rep
        assert f"rank {victim} stopped responding" in rep["msg"], rep
        if mode == "ddp":   # DDP's reducer waits in C++: a RuntimeError carrying the backend's text
            assert "RuntimeError" in rep["classes"] and "BackendError" in rep["msg"], rep
        else:
            assert {"DistBackendError", "CommError"} <= set(rep["classes"]), rep
            if how == "stop":
                assert rep["type"] == "BackendTimeoutError" and f"within {TIMEOUT:g} s" in rep["msg"], rep
        # the group stays failed: the next call says why at once
        assert "BackendError" in rep["later"] and "earlier collective failed" in rep["later"], rep


@SLOW
def test_each_group_keeps_its_own_timeout(tmp_path):
    from _dist_util import run_ranks

    run_ranks(W.own_timeout_job, 2, args=(str(tmp_path),), timeout_s=120)
    reports = read_reports(tmp_path, 2)
    early = reports[0]
    # the short group's 2 s, not the default group's 60 s: the watchdog (0.2 s) and the look at the
    # heartbeats (2.5 s at most) come on top
    assert early["type"] == "BackendTimeoutError" and "within 2 s" in early["msg"], early
    assert early["elapsed"] < 2 + 10, early
    # arrives to find the channel aborted by rank 0, with rank 0's reason, which names the 2 s: the runner's
    # words ("did not complete within 2 s") or, when rank 0's call took the fast path, the channel's own
    # ("timed out after 2 s")
    late = reports[1]
    assert late["type"] in ("BackendError", "BackendTimeoutError"), late
    assert re.search(r"(within|timed out after) 2 s", late["msg"]) and "rank 0" in late["msg"], late
