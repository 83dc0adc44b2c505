"""The all-reduce between hosts (ncclavg/transport/hosts.py, Note [Several hosts]) and the calls' check
folded into its first exchange (Note [The check folded into the data] in calls.py), on hosts pretended on
one machine (each rank says which host it is on): the lanes' layout on its own, then whole jobs through
both faces. The namespace runs, on shaped links, are bench/hosts.py's and the slow tests'."""
import json

import _hosts_workers as W
import pytest
import torch
from _dist_util import run_ranks

from ncclavg.transport import host_pipes
from ncclavg.transport.host_layout import HostsLayout
from ncclavg.transport.host_pipes import ShardLayout


@pytest.mark.parametrize("lanes_of, chunk", [
    ([[0], [1]], 8), ([[0], [1]], 7), ([[0], [1], [2]], 1),         # as many lanes as processes
    ([[0, 2], [1]], 10), ([[0, 2], [1]], 3),                          # 3 lanes on a host of 2
    ([[0, 1, 2]], 11), ([[0, 1, 2, 3]], 0),                           # a host of one carries them all
])
def test_a_chunk_laid_out_by_lanes_comes_back_whole(lanes_of, chunk):
    k = sum(len(x) for x in lanes_of)
    shard = -(-chunk // k)
    layout = ShardLayout(lanes_of, shard, chunk)
    assert layout.direct == (all(len(x) == 1 for x in lanes_of) and shard * k == chunk)
    src = torch.arange(1, chunk + 1, dtype=torch.float32)
    stage = torch.full((len(lanes_of) * layout.region,), -1.0)
    layout.scatter_in(src, stage)
    # each rank's region holds its lanes' shards in order, zeros after (never garbage: it is summed)
    for l, lanes in enumerate(lanes_of):
        region = stage[l * layout.region:(l + 1) * layout.region]
        want = torch.cat([torch.nn.functional.pad(src[i * shard:(i + 1) * shard], (0, 0)) for i in lanes] or [src[:0]])
        assert torch.equal(region[:want.numel()], want) and not region[want.numel():].any()
    back = torch.zeros(chunk)
    layout.gather_out(stage, back)
    assert torch.equal(back, src)


def owners(hosts, lane):
    return HostsLayout(hosts, 0).owners(lane)


def slices(hosts, lane):
    return HostsLayout(hosts, 0).slices(lane)


def test_every_lane_has_one_carrier_per_host():
    assert [owners([[0, 1, 2], [3]], k) for k in range(3)] == [[0, 3], [1, 3], [2, 3]]
    assert [owners([[0, 2], [1, 3]], k) for k in range(2)] == [[0, 1], [2, 3]]


def test_each_lane_carries_the_slices_of_one_local_rank_per_host():
    # lane k: local rank k's slice of each host that has one, in the lane's group order (ranks ascending)
    assert [slices([[0, 1, 2], [3]], k) for k in range(3)] == [[0, 3], [1, None], [2, None]]
    # the carrier of lane 1 on the second host (rank 2) has a lower rank than the first host's (rank 3)
    assert [slices([[0, 3], [1, 2]], k) for k in range(2)] == [[0, 1], [2, 3]]
    assert slices([[0, 3], [1, 2]], 1) == [2, 3] and sorted(owners([[0, 3], [1, 2]], 1)) == [2, 3]


@pytest.mark.parametrize("hosts, rank, lanes_of, slots", [
    ([[0, 1], [2, 3]], 1, [[0], [1]], [[0, 2], [1, 3]]),
    ([[0, 1, 2], [3]], 3, [[0, 1, 2]], [[0, 3, 1, 2]]),          # one process carries every lane
    ([[0, 2], [1]], 2, [[0], [1]], [[0, 1], [2]]),               # lane 1 has no slice on the second host
])
def test_the_layout_both_engines_read_says_what_each_process_carries(hosts, rank, lanes_of, slots):
    layout = HostsLayout(hosts, rank)
    mine = next(h for h in hosts if rank in h)
    assert (layout.mine, layout.local, layout.lanes) == (mine, mine.index(rank), max(map(len, hosts)))
    assert layout.lanes_of == lanes_of and layout.slots == slots
    assert layout.world_size == sum(map(len, hosts))


@pytest.mark.parametrize("hosts, rank, arg", [([[0, 1]], 0, "hosts"), ([[0], [1]], 5, "rank"),
                                              ([[0, 1], [1]], 1, "hosts"), ([[0], []], 0, "hosts")])
def test_a_bad_layout_names_its_argument(hosts, rank, arg):
    with pytest.raises(ValueError, match=arg):
        HostsLayout(hosts, rank)


@pytest.mark.parametrize("name, value", [("NCCLAVG_HOSTS_CHUNK_KB", "0"), ("NCCLAVG_HOSTS_CHUNK_KB", "x"),
                                         ("NCCLAVG_HOSTS_DEPTH", "0")])
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        host_pipes.chunk_bytes() if "CHUNK" in name else host_pipes.depth()


# 2 hosts of 2 (lanes as processes); 3 hosts of 2, 1 and 1 (a host of one carries both lanes, one with no
# channel at all); chunks of 64 KiB, so that a call just past the most a record carries whole crosses several
# 3 processes alone on their hosts (no channel: the group's gloo, a sum too large for one record reduce-scattered
# in it)
# Each on UCX's lanes (the default where libucx loads) and on gloo's (NCCLAVG_UCX=0: the fallback).
def engine(name, monkeypatch):
    monkeypatch.setenv("NCCLAVG_UCX", "0" if name == "gloo" else "auto")


SLOW = pytest.mark.slow


@pytest.mark.parametrize("layout, lanes", [((0, 1, 0, 1), "ucx"), ((0, 1, 2), "ucx"),
                                           pytest.param((0, 0, 1, 2), "ucx", marks=SLOW), ((0, 1, 0, 1), "gloo"),
                                           pytest.param((0, 1, 2), "gloo", marks=SLOW),
                                           pytest.param((0, 0, 1, 2), "gloo", marks=SLOW)])
def test_every_float_type_sums_exactly_across_hosts(layout, lanes, monkeypatch):
    engine(lanes, monkeypatch)
    run_ranks(W.across_hosts_job, len(layout), args=(layout, 64), timeout_s=300)


# 3 processes on one host and 1 on the other (lanes 1 and 2 carry no slice of the second host's; its one
# process carries all three); hosts whose ranks interleave so that a lane's group lists the second host first;
# two processes alone on their hosts (no channel: the group's gloo, the slices in the record or gloo's own)
@pytest.mark.parametrize("layout, lanes", [((0, 0, 0, 1), "ucx"), ((0, 1, 1, 0), "ucx"), ((0, 1), "ucx"),
                                           ((0, 0, 0, 1), "gloo"), pytest.param((0, 1, 1, 0), "gloo", marks=SLOW)])
def test_reduce_scatter_and_all_gather_between_hosts_are_exact(layout, lanes, monkeypatch):
    engine(lanes, monkeypatch)
    run_ranks(W.slices_job, len(layout), args=(layout, 64), timeout_s=300)


# 2 + 1 processes (the host of one carries both lanes; AVG divides by 3, an inexact quotient) and 2 x 2
@pytest.mark.parametrize("layout, lanes", [((0, 0, 1), "ucx"), ((0, 1, 0, 1), "ucx"), ((0, 0, 1), "gloo")])
def test_small_all_reduces_on_the_fast_path_meet_the_general_path_bit_for_bit(layout, lanes, monkeypatch):
    engine(lanes, monkeypatch)
    run_ranks(W.fast_path_job, len(layout), args=(layout, lanes), timeout_s=300)


# gloo's lanes (UCX's: test_ucx_lanes.py)
@pytest.mark.parametrize("layout", [(0, 0, 1, 1), (0, 1)])
def test_the_calls_check_rides_in_the_first_exchange(tmp_path, layout, monkeypatch):
    monkeypatch.setenv("NCCLAVG_UCX", "0")
    run_ranks(W.exchanges_job, len(layout), args=(layout, str(tmp_path)), timeout_s=180)
    for rank in range(len(layout)):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        seen = {int(n) if n.isdigit() else n: ops for n, ops in rep["seen"].items()}
        leads = layout.index(layout[rank]) == rank
        one, edge, past = W.EXCHANGE_SIZES
        record = ["recv", "send"]   # a record: one message each way between two ranks
        if rep["transport"] == "gloo":   # no channel: the group's own gloo, one record per call
            assert seen[one] == seen[edge] == [record], seen   # done in the record itself
            assert seen[past] == [record + ["allreduce"]], seen   # its first 4 KiB in the record
            # a broadcast the same way: the root's data in the record, gloo's broadcast the rest of a larger one
            assert seen[f"broadcast {one}"] == seen[f"broadcast {edge}"] == [record], seen
            assert seen[f"broadcast {past}"] == [record + ["broadcast"]], seen
            continue
        first = [record] if leads else [[]]
        assert seen[one] == seen[edge] == first, seen          # only the leaders cross, once
        # past the record: the rest in chunks of 16 KiB, each lane's own all-reduce per chunk, no other exchange
        chunks = -(-(past - 1024) * 4 // (16 << 10))
        lanes = [ops[2:] if leads and i == 0 else ops for i, ops in enumerate(seen[past])]
        # (two hosts: an all-gather of the shards, one message each way)
        assert all(ops == ["_allgather_base"] * chunks for ops in lanes), seen
        # a broadcast: the record (with the first 4 KiB), then each lane's shard of each chunk sent once
        assert seen[f"broadcast {one}"] == seen[f"broadcast {edge}"] == first, seen
        lanes = [ops[2:] if leads and i == 0 else ops for i, ops in enumerate(seen[f"broadcast {past}"])]
        assert all(ops == ["broadcast"] * chunks for ops in lanes), seen
        # reduce-scatter and all-gather: a small one is the record alone; a larger one the record (with the
        # first 4 KiB of a host's slices: 512 elements of each of its two), then on each lane one exchange
        # per chunk of the rest (every slice's chunk at once: 1024 elements)
        one, edge, past = W.SLICE_SIZES
        for what, op in (("all_gather", "_allgather_base"), ("reduce_scatter", "alltoall_base")):
            assert seen[f"{what} {one}"] == seen[f"{what} {edge}"] == first, (what, seen)
            lanes = [ops[2:] if leads and i == 0 else ops for i, ops in enumerate(seen[f"{what} {past}"])]
            assert all(ops == [op] * -(-(past - 512) // 1024) for ops in lanes), (what, seen)


# 3 processes on one host and 1 on the other (the lone one carries all 3 lanes); the root everywhere
@pytest.mark.parametrize("layout, lanes", [((0, 0, 0, 1), "ucx"), ((0, 0, 0, 1), "gloo")])
def test_a_broadcast_from_any_rank_reaches_every_host_bit_for_bit(layout, lanes, monkeypatch):
    engine(lanes, monkeypatch)
    run_ranks(W.broadcast_job, len(layout), args=(layout, 64), timeout_s=300)


@pytest.mark.parametrize("layout, counts, collective, lanes", [
    ((0, 0, 1, 1), (3, 4), "all_reduce", "ucx"), ((0, 0, 1, 1), (5000, 5001), "all_reduce", "ucx"),
    ((0, 1), (5000, 5001), "all_reduce", "ucx"), ((0, 0, 1, 1), (5000, 5001), "broadcast", "ucx"),
    # slices: within the record on both sides, past it on both (the lanes' pipe), one on each side of it
    ((0, 0, 1, 1), (3, 4), "all_gather", "ucx"), ((0, 0, 1, 1), (5000, 5001), "all_gather", "ucx"),
    ((0, 0, 1, 1), (255, 5000), "reduce_scatter", "ucx"), ((0, 0, 0, 1), (5000, 5001), "reduce_scatter", "ucx"),
    ((0, 0, 1, 1), (5000, 5001), "all_reduce", "gloo"), ((0, 0, 0, 1), (255, 5000), "reduce_scatter", "gloo"),
    pytest.param((0, 0, 1, 1), (5000, 5001), "broadcast", "gloo", marks=SLOW)])
def test_a_different_count_on_another_host_fails_every_rank_naming_both(tmp_path, layout, counts, collective, lanes,
                                                                         monkeypatch):
    engine(lanes, monkeypatch)
    run_ranks(W.host_mismatch_job, len(layout), args=(layout, str(tmp_path), counts, collective), timeout_s=120)
    for rank in range(len(layout)):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["type"] == "BackendMismatchError", res
        text = res["error"]
        named = [f"of {c} float32" in text for c in counts]
        # a leader names both calls; a rank its leader told may name its own and the host that differs
        assert all(named) or (any(named) and "failed on the host of rank" in text), text
        assert res["elapsed"] < 15, res   # one exchange, not the 30 s timeout
