"""gloo backend with 2 and 4 processes on loopback (spawned, bounded): collectives, and GradientAverager
against torch DDP(gloo) on the same model and data; through the shared-memory channel (the default on one
host) and through torch.distributed (NCCLAVG_SHM=0)."""
import json

import _comm_gloo_workers
import pytest
from _dist_util import run_ranks


# the channel (auto) in the quick suite; torch.distributed alone (NCCLAVG_SHM=0) and 4 processes in the slow run
@pytest.mark.parametrize("shm", ["auto", pytest.param("0", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gloo_collectives_and_averager_match_ddp(world, shm, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)   # the spawned ranks inherit it
    run_ranks(_comm_gloo_workers.collectives_and_ddp, world, timeout_s=180)


# Several "hosts" on this machine (tests/_comm_gloo_workers.pretend_hosts): a channel per host, torch.distributed
# between the hosts' leaders (Note [Several hosts] in ncclavg/transport/shm.py). Interleaved ranks check that
# gathers come back in rank order; a host of one process has no channel; a 4 KiB slot makes every
# bucket take several rounds per host.
@pytest.mark.parametrize("layout,slot_kb", [pytest.param((0, 0, 1, 1), "1024", marks=pytest.mark.slow), pytest.param((0, 1, 0, 1), "4", marks=pytest.mark.slow),
                                            pytest.param((0, 1, 1, 1), "1024", marks=pytest.mark.slow)])
def test_gloo_collectives_across_pretend_hosts(layout, slot_kb, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    monkeypatch.setenv("NCCLAVG_SHM_SLOT_KB", slot_kb)
    run_ranks(_comm_gloo_workers.collectives_and_ddp, len(layout), args=(layout,), timeout_s=180)


@pytest.mark.parametrize("shm", ["auto", pytest.param("0", marks=pytest.mark.slow)])
def test_gloo_wait_times_out(shm, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    run_ranks(_comm_gloo_workers.timeout_job, 2, timeout_s=60)


# ~7 s each (a peer held back for seconds): with the slow tests (test_gloo_wait_times_out is the quick one)
@pytest.mark.slow
@pytest.mark.parametrize("shm", ["auto", "0"])
@pytest.mark.parametrize("op", ["all_reduce_avg", "reduce_scatter_avg", "all_gather", "broadcast_tensors"])
def test_a_calls_own_timeout_bounds_it(op, shm, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    run_ranks(_comm_gloo_workers.per_call_timeout_job, 2, args=(op,), timeout_s=60)


def test_small_message_fast_path_follows_its_tensors():
    run_ranks(_comm_gloo_workers.fast_path_job, 2, timeout_s=120)


def test_api_broadcast_gather_and_scatter_take_the_channel_at_once_when_idle(tmp_path):
    run_ranks(_comm_gloo_workers.api_fast_calls_job, 2, args=(str(tmp_path),), timeout_s=120)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rep in enumerate(reps):
        # idle: only the odd payload (7 bytes, padded by the general path) takes a job
        assert rep["idle"] == ["shm broadcast_tensors"], (r, rep["idle"])
        # rank 0 had an average queued before each broadcast: those went down the general path
        want_busy = ["shm broadcast_tensors"] * (5 if r == 0 else 1)
        assert rep["busy"] == want_busy, (r, rep["busy"])
        err = rep["error"]
        assert err is not None and err["type"] == "CollectiveMismatchError", (r, err)
        assert "4 float32" in err["msg"] and "5 float32" in err["msg"], (r, err)


@pytest.mark.parametrize("required", [False, True])
def test_shm_setup_failure_falls_back_or_raises(required):
    run_ranks(_comm_gloo_workers.shm_setup_fails_job, 2, args=(required,), timeout_s=60)
