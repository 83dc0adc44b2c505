"""torch.profiler on the `ncclavg` backend (ncclavg/transport/profiling.py): every collective as gloo's
is seen, the dispatcher's range `c10d::<op>` around the issue and the backend's own `ncclavg:<title>`
from issue to completion, ended on another thread (async), each with its shapes; point-to-point calls
the same; the transport steps on the runner's worker when every thread is recorded."""
import json
import os

import pytest

import _transport_flight_workers as FW
from _dist_util import run_ranks


def _events(tmp_path, rank):
    with open(os.path.join(tmp_path, f"events{rank}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("all_threads", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["caller-thread", "all-threads"])
def test_ddp_steps_show_one_allreduce_per_bucket(tmp_path, all_threads):
    steps = 5
    run_ranks(FW.ddp_profile_job, 2, args=(str(tmp_path), steps, 0.1, all_threads), timeout_s=180)
    for rank in range(2):
        got = _events(tmp_path, rank)
        events, buckets = got["events"], got["buckets"]
        assert len(buckets) == 2, got   # bucket_cap_mb=0.1 splits the model in two
        by_name = {}
        for e in events:
            by_name.setdefault(e["name"], []).append(e)
        # one per bucket per step, each with the bucket's flat tensor as its input, in DDP's bucket order:
        # the dispatcher's range where the reducer issued it, the backend's from issue to completion.
        # A profiler of every thread records no inputs of a Python range (torch 2.13's global callbacks
        # do not ask for them), so there only the counts are compared.
        shapes = (lambda e: e["shapes"]) if not all_threads else (lambda e: "?")
        want = [[[n]] for n in buckets] * steps if not all_threads else ["?"] * (2 * steps)
        assert [shapes(e) for e in by_name["c10d::allreduce_"]] == want, events
        assert [shapes(e) for e in by_name["ncclavg:all_reduce"]] == want, events
        assert all(e["async"] for e in by_name["ncclavg:all_reduce"]), by_name["ncclavg:all_reduce"]
        assert not any(e["async"] for e in by_name["c10d::allreduce_"]), by_name["c10d::allreduce_"]
        one = [[5, 3]] if not all_threads else "?"
        assert [(shapes(e), e["async"]) for e in by_name["c10d::broadcast_"]] == [(one, False)], events
        assert [(shapes(e), e["async"]) for e in by_name["ncclavg:broadcast"]] == [(one, True)], events
        p2p, dispatched = ("ncclavg:send", "c10d::send") if rank == 0 else ("ncclavg:recv", "c10d::recv_")
        one = [[7]] if not all_threads else "?"
        assert [(shapes(e), e["async"]) for e in by_name[p2p]] == [(one, True)], events
        assert [shapes(e) for e in by_name[dispatched]] == [one], events
        # the channel's steps run on the runner's worker: recorded only when every thread is
        steps_seen = [e for e in events if e["name"].startswith("ncclavg:shm:")]
        if all_threads:
            names = [e["name"] for e in steps_seen]
            assert names.count("ncclavg:shm:broadcast") == 1, events
            assert names.count("ncclavg:shm:all_reduce_sum") == 2 * steps, events
            assert not any(e["main"] for e in steps_seen), steps_seen   # on the worker, not the caller
        else:
            assert steps_seen == [], steps_seen
        # each channel collective's last rank (Note [Profiler ranges of a Python backend]), recorded where
        # the call completes: the runner's worker
        last = [e for e in events if e["name"].startswith("ncclavg:last_rank:")]
        if all_threads:
            assert len(last) == 1 + 2 * steps, last   # the broadcast and every bucket's all-reduce
            assert not any(e["main"] for e in last), last
        else:
            assert last == [], last
        # nothing else of the backend
        known = {"c10d::allreduce_", "ncclavg:all_reduce", "c10d::broadcast_", "ncclavg:broadcast", p2p,
                 dispatched}
        assert {e["name"] for e in events if not e["name"].startswith(("ncclavg:shm:", "ncclavg:last_rank:"))} \
            == known, events


@pytest.mark.slow   # ~15 s: a recv waits out its group's timeout
def test_profiled_point_to_point_keeps_its_source_and_its_timeout(tmp_path):
    # the wrapper around gloo's work while profiling (P2PWork) must pass the sender of a receive from any
    # source through, and a receive nobody answers must fail from wait() (its group's 4 s timeout), not hang
    run_ranks(FW.profiled_p2p_job, 2, args=(str(tmp_path),), timeout_s=120)
    with open(os.path.join(tmp_path, "p2p.json")) as f:
        got = json.load(f)
    assert got["source"] == 0 and got["value"] == [5.0, 5.0, 5.0], got
    assert got["error"] is not None and "timed out" in got["error"].lower(), got
    assert 3 < got["seconds"] < 30, got   # the group's 4 s (gloo's clock may round down); a hang: the run's 120 s
