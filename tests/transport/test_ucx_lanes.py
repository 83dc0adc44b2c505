"""The lanes between hosts on UCX (Note [Lanes between hosts] in csrc/transport/host_lanes.cpp), for what
only they do, on hosts pretended on one machine (UCX over TCP on loopback): a call that differs in any
part fails every rank naming both calls within one exchange; a late peer is waited for on UCX's event fd;
one call sends a hello and its data; UCX that does not start leaves gloo's lanes in charge, saying so
once (or is an error with NCCLAVG_UCX=1). Their exactness: test_hosts_algorithm.py, whose jobs run on
them; their faults between namespaces: tests/process_group/test_two_hosts_faults.py."""
import json

import _ucx_workers as W
import pytest
from _dist_util import run_ranks

from ncclavg import _ext as ucx_lib


# 3 + 1 (the lone process carries every lane), interleaved hosts, three hosts of one
@pytest.mark.parametrize("layout", [(0, 0, 0, 1), (0, 1, 1, 0), (0, 1, 2)])
def test_small_calls_go_whole_and_exact_around_their_edge(layout):
    run_ranks(W.whole_edge_job, len(layout), args=(layout,), timeout_s=240)


def test_waits_that_block_at_once_are_exact(tmp_path, monkeypatch):
    # NCCLAVG_HOSTS_SPIN_US=0: every wait between the hosts that finds nothing to progress sleeps on UCX's
    # event fd at once (the path a long wait takes), whole calls and chunked ones alike
    monkeypatch.setenv("NCCLAVG_HOSTS_SPIN_US", "0")
    run_ranks(W.whole_edge_job, 4, args=((0, 0, 1, 1),), timeout_s=240)
    run_ranks(W.messages_job, 2, args=((0, 1), str(tmp_path), 64), timeout_s=120)
    assert all(res["spin_us"] == 0 for res in _reports(tmp_path, 2))


def _reports(tmp_path, world):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("layout, what, names", [
    ((0, 0, 1, 1), "dtype", ("of 5000 float32", "of 5000 float64")),
    ((0, 1), "op", ("all_reduce(SUM)", "all_reduce(MAX)")),
    ((0, 0, 1, 1), "root", ("from root 3", "from root 0")),
    ((0, 0, 0, 1), "collective", ("all_reduce", "broadcast")),
])
def test_a_call_that_differs_between_hosts_fails_every_rank_naming_both(tmp_path, layout, what, names):
    run_ranks(W.mismatch_job, len(layout), args=(layout, str(tmp_path), what), timeout_s=120)
    for res in _reports(tmp_path, len(layout)):
        assert res["transport"] in ("shm+ucx", "ucx"), res
        assert res["type"] == "BackendMismatchError", res
        # a rank that compared the calls names both; one its host's channel or a peer told names them too
        assert all(n in res["error"] for n in names), res["error"]
        assert res["elapsed"] < 15, res   # one exchange, not the 30 s timeout
        assert res["after"] is not None and "refused" in res["after"], res["after"]


# a rank of the other host absent: its lane's carriers time out on the wire; a rank of one's own host absent
# too: the one left times out in the call's channel step
@pytest.mark.parametrize("absent, where", [((2,), "waited 1 s for rank 2 (host 1) without an answer"),
                                           ((1, 2), "timed out after 1 s in a step within host 0")])
def test_a_timeout_between_the_hosts_names_no_rank(tmp_path, absent, where):
    layout = (0, 0, 1)
    run_ranks(W.lanes_timeout_job, len(layout), args=(layout, str(tmp_path), absent), timeout_s=120)
    for rank, res in enumerate(_reports(tmp_path, len(layout))):
        if rank in absent:
            continue
        # a CommTimeoutError, not the channel's ShmTimeoutError (which names the rank that stopped): the rank
        # waited for may itself wait on another, so the runner asks the heartbeats (failure.NAMES_ITSELF)
        assert res["comm_timeout"] and not res["shm_timeout"], res
        assert where in res["error"] and "stopped responding" not in res["error"], res
        assert 1.0 <= res["elapsed"] < 5.0, res
        assert res["refused"] is not None and where in res["refused"], res   # the engine refuses, saying why


def test_a_late_peer_is_waited_for_without_spinning(tmp_path):
    layout, late = (0, 1, 1), 3.0
    run_ranks(W.late_peer_job, len(layout), args=(layout, str(tmp_path), late), timeout_s=120)
    for rank, res in enumerate(_reports(tmp_path, len(layout))):
        if rank == 0:
            continue
        assert res["wall_s"] > late / 2, res   # it did wait (most of the sleep)
        # blocked on the event fd: a few wake-ups (one per 100 ms poll), not a spinning core; 10% of the wait
        # is far above what polling costs and far below the whole core a spinning wait takes
        assert res["cpu_s"] < 0.10 * res["wall_s"], res


def test_one_call_is_a_hello_and_its_data_per_peer(tmp_path):
    layout = (0, 0, 1, 1)
    run_ranks(W.messages_job, len(layout), args=(layout, str(tmp_path), 64), timeout_s=120)
    for res in _reports(tmp_path, len(layout)):
        peers = len(res["peers"])
        assert peers == 1, res   # 2 x 2: each rank carries one lane, one peer on the other host
        # a small call: one hello and one data message to the peer, both sent at once (no record round trip)
        assert res["sent"]["2"] == res["sent"]["1024"] == 2 * peers, res
        # 192 KiB in chunks of 64 KiB: three chunks, one data message each (3 + the hello)
        assert res["sent"][str((64 << 10) // 4 * 3)] == 4 * peers, res
        # ... whose completions paced the waits: the time between two chunks, measured (a positive average)
        assert res["chunk_us"] > 0, res


# Note [TCP's receive segment] in csrc/transport/host_lanes.cpp: the lanes' own choice, unless the user set one
@pytest.mark.parametrize("user_segment", [None, "128K"])
def test_the_lanes_say_which_ucx_settings_they_chose(tmp_path, monkeypatch, user_segment):
    if user_segment is not None:
        monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", user_segment)
    layout = (0, 1)
    run_ranks(W.messages_job, len(layout), args=(layout, str(tmp_path), 64), timeout_s=120)
    for res in _reports(tmp_path, len(layout)):
        assert res["ucx"]["TLS"] == "tcp", res
        assert res["ucx"].get("TCP_RX_SEG_SIZE") == (None if user_segment else "256K"), res
        assert res["spin_us"] == ucx_lib._C.HostLanes.SPIN_US, res   # the engine's own when unset


@pytest.mark.parametrize("strict", [False, True])
def test_ucx_that_does_not_start_leaves_gloo_in_charge(tmp_path, monkeypatch, strict):
    # "rc": InfiniBand, which this machine lacks: UCX loads, and its context finds no transport
    monkeypatch.setenv("NCCLAVG_UCX_TLS", "rc")
    monkeypatch.setenv("NCCLAVG_UCX", "1" if strict else "auto")
    layout = (0, 0, 1, 1)
    run_ranks(W.fallback_job, len(layout), args=(layout, str(tmp_path)), timeout_s=120)
    for res in _reports(tmp_path, len(layout)):
        if strict:
            assert res["error"] is not None and "NCCLAVG_UCX=1" in res["error"], res
        else:
            assert res["error"] is None and res["transport"] == "shm+gloo", res
            assert len(res["warnings"]) == 1 and "did not start" in res["warnings"][0], res


@pytest.mark.parametrize("name, value", [("NCCLAVG_UCX", "maybe"), ("NCCLAVG_UCX_TLS", "tcp,posix"),
                                         ("NCCLAVG_UCX_TLS", "sm"), ("NCCLAVG_UCX_TLS", " "),
                                         ("NCCLAVG_HOSTS_SPIN_US", "-1"), ("NCCLAVG_HOSTS_SPIN_US", "x"),
                                         ("NCCLAVG_HOSTS_SPIN_US", "1000001")])
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    from ncclavg.transport import ucx

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        if name == "NCCLAVG_UCX":
            ucx_lib.ucx_setting()
        elif name == "NCCLAVG_UCX_TLS":
            ucx_lib.ucx_transports()
        else:
            ucx.spin_us()


# Note [Lanes between hosts] in csrc/transport/host_lanes.cpp: a slow link's chunks pace the waits. The
# threshold at 0 makes every chunk "slow" and at 10**9 none, whatever this machine's speed.
@pytest.mark.parametrize("slow_chunk_us, pipelined", [(0, "slow"), (10**9, "full")])
def test_a_slow_links_chunks_shorten_the_polling(tmp_path, slow_chunk_us, pipelined):
    from ncclavg import _C

    run_ranks(W.paced_waits_job, 2, args=(str(tmp_path), slow_chunk_us), timeout_s=120)
    for res in _reports(tmp_path, 2):
        assert res["sum_ok"] and res["whole_ok"], res
        assert res["before"] == 0 and res["chunk_us"] > 0, res   # measured by the pipelined call
        want = _C.HostLanes.SLOW_SPIN_US if pipelined == "slow" else _C.HostLanes.SPIN_US
        assert res["pipelined"] == want, res
        assert res["whole"] == _C.HostLanes.SPIN_US, res   # a whole call's wait is a round trip: polled


def test_the_engine_checks_its_spin_window():
    with pytest.raises(ValueError, match="spin_us"):
        ucx_lib._C.HostLanes([[0], [1]], 0, None, "tcp", "", 1 << 19, 4, -5)
    with pytest.raises(ValueError, match="slow_chunk_us"):
        ucx_lib._C.HostLanes([[0], [1]], 0, None, "tcp", "", 1 << 19, 4, 300, -1)


def test_each_lane_goes_over_its_interface():
    assert ucx_lib.devices_for([0], ["eth0", "eth1"]) == "eth0"
    assert ucx_lib.devices_for([1], ["eth0", "eth1"]) == "eth1"
    assert ucx_lib.devices_for([0, 1, 2], ["eth0", "eth1"]) == "eth0,eth1"   # one process carrying 3 lanes
    assert ucx_lib.devices_for([0, 1], []) == ""                               # UCX's own choice


def test_a_forked_child_cannot_use_its_parents_lanes(tmp_path):
    run_ranks(W.forked_child_job, 2, args=(str(tmp_path),), timeout_s=120)
    reps = _reports(tmp_path, 2)
    assert "forked child" in reps[0]["child"] and "is not the process that made" in reps[0]["child"], reps[0]
    assert reps[0]["sum_ok"] and reps[1]["sum_ok"], reps
