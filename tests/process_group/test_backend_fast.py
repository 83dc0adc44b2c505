"""The `ncclavg` backend's fast path for a synchronous all_reduce (Note [The backend's fast path]):
the same results as the general path, ranks that mix the two paths meet, it never overtakes queued
collectives, a mismatch through it fails every rank naming both calls, and groups that used it leave
nothing mapped."""
import json

import _process_group_fast_workers as W
import pytest
from _dist_util import run_ranks


@pytest.fixture(autouse=True)
def _channel_on(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")


def test_fast_and_general_paths_agree():
    run_ranks(W.agree_job, 2, timeout_s=240)


def test_fast_calls_wait_behind_queued_ones():
    run_ranks(W.order_job, 2, timeout_s=240)


def test_mismatch_through_the_fast_path_names_both_calls(tmp_path):
    run_ranks(W.mismatch_job, 2, args=(str(tmp_path),), timeout_s=120)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["first"].startswith("BackendMismatchError"), rep
        assert "all_reduce(SUM) of 4 float32" in rep["first"] and "all_reduce(SUM) of 5 float32" in rep["first"], rep
        assert "earlier collective failed" in rep["later"], rep
        assert rep["cached_after"] == 0, rep   # disabled with the group


def test_groups_that_used_the_fast_path_leave_nothing_mapped():
    run_ranks(W.groups_cycle_job, 2, args=(20,), timeout_s=240)


def test_native_allreduce_works_references_and_per_call_timeout():
    run_ranks(W.native_allreduce_job, 2, timeout_s=120)


def test_broadcast_all_gather_reduce_scatter_fast_and_general_paths_agree():
    run_ranks(W.calls_agree_job, 2, timeout_s=300)


def test_fast_broadcast_and_gathers_wait_behind_queued_ones():
    run_ranks(W.calls_order_job, 2, timeout_s=240)


def test_different_collectives_through_the_fast_paths_name_both_calls(tmp_path):
    run_ranks(W.calls_mismatch_job, 2, args=(str(tmp_path),), timeout_s=120)
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["first"].startswith("BackendMismatchError"), rep
        assert "broadcast" in rep["first"] and "all_gather_into_tensor" in rep["first"], rep
        assert "earlier collective failed" in rep["later"], rep
    assert rep["taken"]["broadcast"] >= 1, rep


def test_tensors_that_require_grad_take_the_fast_paths():
    run_ranks(W.calls_grad_job, 2, timeout_s=120)
