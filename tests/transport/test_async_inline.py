"""Asynchronous collectives whose peers are already in them run on the caller's thread (Note [An
asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp), through the torch backend and
the public API: complete when handed back; never waiting for a peer that is late; ranks that run a call
inline and ranks that queue it meet, in order, with exact values; a failure comes back as a failed Work."""
import json

import _async_inline_workers as W
import pytest
from _dist_util import run_ranks


@pytest.fixture(autouse=True)
def _channel_on(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")


@pytest.mark.parametrize("face", ["torch", "api"])
def test_an_async_call_whose_peers_wait_completes_at_once(face):
    run_ranks(W.inline_when_peers_wait_job, 2, args=(face,), timeout_s=120)


def test_the_public_apis_async_average_run_at_once_notes_finiteness():
    run_ranks(W.api_inline_notes_finiteness_job, 2, timeout_s=120)


def test_async_broadcast_gather_and_reduce_scatter_whose_peers_wait_complete_at_once():
    run_ranks(W.torch_collectives_inline_job, 2, timeout_s=120)


@pytest.mark.parametrize("face,peer_async", [pytest.param("torch", False, marks=pytest.mark.slow), ("torch", True),
                                             pytest.param("api", True, marks=pytest.mark.slow)])
def test_an_async_call_never_waits_for_a_late_peer(face, peer_async):
    run_ranks(W.late_peer_is_not_waited_for_job, 2, args=(face, peer_async), timeout_s=120)


@pytest.mark.parametrize("face,world", [("torch", 2), ("api", 2), pytest.param("torch", 3, marks=pytest.mark.slow)])
def test_inline_and_queued_calls_meet_in_order(face, world):
    run_ranks(W.mixed_job, world, args=(face, 300), timeout_s=240)


def test_an_inline_mismatch_fails_the_work_naming_both_calls(tmp_path):
    run_ranks(W.mismatch_inline_job, 2, args=(str(tmp_path),), timeout_s=120)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reps[0]["returned"], reps
    for rep in reps:
        assert rep["first"].startswith("BackendMismatchError"), rep
        assert "of 4 float32" in rep["first"] and "of 5 float32" in rep["first"], rep
        assert "earlier collective failed" in rep["later"], rep
