"""The `ncclavg` backend's groups over time: several groups with the same members driven from several
threads at once (each keeps its own order and its results, as on gloo), reductions into tensors that
require grad, ncclavg's Communicator over an `ncclavg` group, communicators built and closed again and
again with nothing left mapped, and a diagnosis that never prints from its helper thread."""
import json

import _process_group_lifecycle_workers as W
import pytest
from _dist_util import run_ranks


def test_same_member_groups_from_several_threads(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.threads_job, 2, args=(3, 200), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["auto", "0"])
def test_same_member_groups_from_several_threads_three_processes(shm, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    run_ranks(W.threads_job, 3, args=(4, 150), timeout_s=600)


def test_reductions_into_tensors_that_require_grad(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.requires_grad_job, 2, timeout_s=120)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_communicator_over_an_ncclavg_group(mode, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.communicator_on_backend_job, 2, args=(mode,), timeout_s=240)


def test_communicators_built_and_closed_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    cycles = 100
    run_ranks(W.create_close_job, 2, args=(cycles, str(tmp_path)), timeout_s=600)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # each close frees its channel's segment at once (reference counts, no collection needed)
        assert max(rep["mapped"]) <= 1 and rep["mapped"][-1] == 0 and rep["after_gc"] == 0, rep["mapped"][-10:]
        # a leaked segment costs its slots' resident pages, ~3.6 MB per cycle for 2 processes (2 x 1 MiB
        # slots written per rank, and the peer's read): 80 cycles would add ~290 MB. Allow 1/10 of one
        # leak per cycle for the allocator's own variation.
        growth = rep["rss"][-1] - rep["rss"][19]
        assert growth < 80 * 0.36e6, (rank, growth)


def test_diagnosis_never_prints_from_its_thread(capsys):
    """The store's host gone: the diagnosis says "unknown" and its helper thread prints nothing."""
    import threading

    from ncclavg.transport.liveness import diagnose

    class GoneStore:
        def add(self, key, value):
            raise RuntimeError("Connection reset by peer")

    hooked = []
    old = threading.excepthook
    threading.excepthook = lambda args: hooked.append(args)
    try:
        text = diagnose(GoneStore(), 0, 2, lambda r: f"alive/{r}", lambda r: f"failed/{r}")
    finally:
        threading.excepthook = old
    assert "unknown" in text and not hooked
    assert capsys.readouterr().err == ""


@pytest.mark.slow   # ~6 s: waits out a timeout
def test_a_barrier_times_out_at_its_deadline_with_a_timeouts_words(tmp_path, monkeypatch):
    from _fault_util import read_reports

    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    timeout = 2.0
    run_ranks(W.barrier_timeout_job, 2, args=(str(tmp_path), timeout), timeout_s=120)
    rep = read_reports(str(tmp_path), 2)[0]
    assert rep["type"] == "BackendTimeoutError" and rep["matches"], rep
    assert rep["elapsed"] >= timeout - 0.1, rep   # not before the deadline (torch's own test allows 0.1 s)


def test_destroy_and_abort_reach_the_inner_nccl_group(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.inner_nccl_ended_job, 2, args=(str(tmp_path),), timeout_s=120)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep == {"destroyed": ["shutdown"], "aborted": ["abort", "shutdown"]}, rep
