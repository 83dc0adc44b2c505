"""The `ncclavg` backend's matrix: every collective x every dtype x every op the docs list, (a) called alike
on every rank -> the exact (integers) or correctly rounded (floats) result of a wide reference, (b) a
different call on one rank -> an error on every rank that names both calls, well within the timeout;
never a silent difference. Through the shared-memory channel here; through gloo alone, with 3 processes
and across pretend hosts in the slow run."""
import json

import _process_group_matrix_workers as W
import pytest
from _dist_util import run_ranks

SLOW = pytest.mark.slow


@pytest.mark.parametrize("world,shm,layout,sizes", [
    (2, "auto", None, (0, 5)),
    pytest.param(2, "0", None, (0, 5), marks=SLOW),
    pytest.param(3, "auto", None, (0, 1, 1001), marks=SLOW),
    pytest.param(3, "0", None, (1, 7), marks=SLOW),
    pytest.param(4, "auto", (0, 1, 0, 1), (0, 3), marks=SLOW),
])
def test_same_call_on_every_rank_gives_the_reference(world, shm, layout, sizes, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    run_ranks(W.same_calls_job, world, args=(sizes, layout), timeout_s=900)


@pytest.mark.parametrize("world,shm,layout", [
    (2, "auto", None),
    (2, "0", None),
    pytest.param(3, "auto", None, marks=SLOW),
    pytest.param(4, "auto", (0, 0, 1, 1), marks=SLOW),   # the last rank's host differs: the leaders compare
    pytest.param(4, "auto", (0, 1, 0, 1), marks=SLOW),   # the last rank is not its host's leader
])
def test_a_different_call_fails_on_every_rank_naming_both(world, shm, layout, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    timeout = 20
    run_ranks(W.mismatch_job, world, args=(W.PAIRS_QUICK, str(tmp_path), layout, timeout), timeout_s=600)
    for rank in range(world):
        for res in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            pair = res["pair"]
            assert res["error"] is not None, (rank, pair, "no error")
            assert "out of step" in res["error"] or "failed on the host of rank" in res["error"], (rank, pair, res)
            # every rank names both calls; a rank told by its host's leader (pretend hosts) may see only
            # that the other host failed, with this rank's own call named
            named = [n in res["error"] for n in res["names"]]
            assert all(named) or (layout and any(named)), (rank, pair, res["error"])
            assert res["type"] == "BackendMismatchError", (rank, pair, res["type"])
            # a mismatch is no lost rank: no heartbeat diagnosis (it would add ~1.3 s and say "unknown")
            assert "which rank was lost" not in res["error"] and "heartbeat" not in res["error"], res["error"]
            # at once, not at the timeout: the first round (or the gloo exchange) compares the calls
            assert res["elapsed"] < timeout / 2, (rank, pair, res["elapsed"])
