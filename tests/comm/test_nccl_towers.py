"""Several CUDA towers per process across processes (NcclCommunicator.init_ranks, Note [GPU towers of
several processes] in ncclavg/comm/nccl.py), on a CPU: the process-major rank numbering, the argument
checks that come before NCCL or a GPU, the exchange of the unique id and the tower counts through a real
torch.distributed store (threads stand for processes), and the whole Python path with a fake core. The
GPU run is tests/comm/test_gpu_nccl_ranks.py::test_towers_of_several_processes."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from ncclavg import CommTimeoutError
from ncclavg.comm import nccl as nccl_backend
from ncclavg.comm.nccl import NcclCommunicator, _exchange_through_store, process_major_ranks


# ---------------------------------------------------------------- rank numbering

@pytest.mark.parametrize("counts,rank,want", [
    ([1], 0, (1, 0)),
    ([1, 1], 1, (2, 1)),          # one tower per process: the first rank is the process rank
    ([2, 2], 0, (4, 0)),
    ([2, 2], 1, (4, 2)),
    ([2, 1, 3], 1, (6, 2)),
    ([2, 1, 3], 2, (6, 3)),
    ([1, 4, 1, 4], 3, (10, 6)),
])
def test_process_major_ranks(counts, rank, want):
    assert process_major_ranks(counts, rank) == want


def test_process_major_ranks_cover_every_tower_once():
    counts = [3, 1, 2, 4]
    owned = []
    for p in range(len(counts)):
        size, first = process_major_ranks(counts, p)
        assert size == 10
        owned += list(range(first, first + counts[p]))
    assert owned == list(range(10)), "ranks must be numbered process-major, each tower once"


@pytest.mark.parametrize("counts,rank,exc,match", [
    ([], 0, ValueError, r"rank: expected a process rank in \[0, 0\)"),
    ([1, 1], 2, ValueError, r"rank: expected a process rank in \[0, 2\), got 2"),
    ([1, 1], -1, ValueError, "rank"),
    ([1, 1], True, ValueError, "rank"),
    ([1, 0], 0, ValueError, r"tower_counts\[1\]: every process feeds at least one tower, got 0"),
    ([1, 1.5], 0, TypeError, r"tower_counts\[1\]: expected an int, got float"),
    ([True, 1], 0, TypeError, r"tower_counts\[0\]"),
])
def test_process_major_ranks_refuse_bad_input(counts, rank, exc, match):
    with pytest.raises(exc, match=match):
        process_major_ranks(counts, rank)


# ---------------------------------------------------------------- argument checks

@pytest.mark.parametrize("devices,exc,match", [
    ([], ValueError, r"devices: expected a non-empty list of this process's CUDA devices, got \[\]"),
    ("cuda:0", ValueError, "devices: expected a non-empty list"),
    (torch.device("cuda", 0), ValueError, "devices: expected a non-empty list"),
    (None, ValueError, "devices: expected a non-empty list"),
    (["cuda:0", "cpu"], ValueError, r"devices: mixes cpu and cuda towers \(\['cuda:0', 'cpu'\]\)"),
    ([torch.device("cpu"), 1], ValueError, "devices: mixes cpu and cuda towers"),
    (["cpu", "cpu"], ValueError, r"devices\[0\]: cpu is not a CUDA device; .*gloo"),
    (["meta"], ValueError, r"devices\[0\]: meta is not a CUDA device"),
    (["cuda:0", True], TypeError, r"devices\[1\]: expected a CUDA device ordinal or 'cuda:N', got True"),
    (["cuda:0", "gpu7"], TypeError, r"devices\[1\]: expected a CUDA device ordinal"),
])
def test_init_ranks_checks_its_devices_before_nccl(monkeypatch, devices, exc, match):
    def no_nccl_yet():
        raise AssertionError("the argument checks must come before anything needs NCCL or a GPU")

    monkeypatch.setattr(nccl_backend, "require_nccl_comm", no_nccl_yet)
    with pytest.raises(exc, match=match):
        NcclCommunicator.init_ranks(None, devices, 10.0, False)


# ---------------------------------------------------------------- exchange through the store

def run_processes(fn, world):
    """fn(rank) in one thread per "process"; returns the results in rank order, re-raising the first error."""
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:   # noqa: BLE001 - handed to the test thread
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank of the store exchange did not finish within 60 s"
    for e in errors:
        if e is not None:
            raise e
    return results


def test_exchange_gives_every_process_rank_0s_id_and_every_count():
    store = dist.HashStore()
    counts = [2, 1, 3]
    made = []

    def make_uid():
        made.append(1)
        return b"u" * 128

    got = run_processes(lambda r: _exchange_through_store(store, "k/0", r, 3, counts[r], 30.0, make_uid), 3)
    assert made == [1], "only rank 0 draws the unique id"
    for uid, seen in got:
        assert uid == b"u" * 128 and seen == counts


def test_exchange_keys_of_two_communicators_do_not_mix():
    store = dist.HashStore()
    first = run_processes(lambda r: _exchange_through_store(store, "k/0", r, 2, 1 + r, 30.0, lambda: b"a"), 2)
    second = run_processes(lambda r: _exchange_through_store(store, "k/1", r, 2, 2, 30.0, lambda: b"b"), 2)
    assert [c for _, c in first] == [[1, 2]] * 2 and [u for u, _ in first] == [b"a"] * 2
    assert [c for _, c in second] == [[2, 2]] * 2 and [u for u, _ in second] == [b"b"] * 2


def test_exchange_without_rank_0_times_out_naming_the_id():
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"nccl init \(rank 1 of 2\): rank 0's NCCL unique id did not appear "
                                               r"in the store under 'k/7' within 0.5 s"):
        _exchange_through_store(dist.HashStore(), "k/7", 1, 2, 2, 0.5, lambda: b"x")
    assert time.monotonic() - t0 < 0.5 + 5.0


def test_exchange_without_a_peer_times_out_naming_the_counts():
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"nccl init \(rank 0 of 2\): rank 0's NCCL unique id appeared, but "
                                               r"not the tower count of every process .*'k/8/towers/<rank>'.* 0.5 s"):
        _exchange_through_store(dist.HashStore(), "k/8", 0, 2, 1, 0.5, lambda: b"x")
    # one limit for both waits: the id was there at once, so the whole call took about 0.5 s, not 1 s
    assert time.monotonic() - t0 < 0.5 + 5.0


# ---------------------------------------------------------------- the Python path, with a fake core

class PerThreadCount:
    """`_UID_SEQ` for threads standing for processes: each "process" numbers its communicators from 0."""

    def __init__(self):
        self.local = threading.local()

    def __next__(self):
        n = getattr(self.local, "n", 0)
        self.local.n = n + 1
        return n


class FakeCore:
    """Stands in for _C: records NcclComm.init_ranks calls; the handle carries what NcclCommunicator reads."""

    class NcclError(RuntimeError):
        pass

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()
        self.NcclComm = types.SimpleNamespace(init_ranks=self.init_ranks)

    def nccl_unique_id(self):
        return bytes(range(128))

    def init_ranks(self, uid, nranks, first_rank, devices, timeout_s):
        with self.lock:
            self.calls.append((uid, nranks, first_rank, list(devices), timeout_s))
        return types.SimpleNamespace(nccl_version=23000, collective_mode="blocking", collective_mode_reason="test",
                                     aborted=False)


def test_init_rank_and_init_ranks_build_one_communicator_over_every_tower(monkeypatch):
    # Process 0 feeds two towers (init_ranks), process 1 one (init_rank): the same exchange, one communicator
    # of 3 ranks numbered process-major.
    core, store = FakeCore(), dist.HashStore()
    monkeypatch.setattr(nccl_backend, "_C", core)
    monkeypatch.setattr(nccl_backend, "require_nccl_comm", lambda: None)
    monkeypatch.setattr(nccl_backend, "_device_index", lambda d, argname: torch.device(d).index)
    monkeypatch.setattr(nccl_backend, "_UID_SEQ", PerThreadCount())
    monkeypatch.setattr(nccl_backend, "_process_group",
                        lambda group: (group, 2, store, "world"))   # the fake "group" is the rank

    def build(rank):
        if rank == 0:
            return NcclCommunicator.init_ranks(0, ["cuda:0", "cuda:1"], 30.0, False)
        return NcclCommunicator.init_rank(1, "cuda:2", 30.0, True)

    c0, c1 = run_processes(build, 2)
    calls = sorted(core.calls, key=lambda c: c[2])
    assert calls == [(bytes(range(128)), 3, 0, [0, 1], 30.0), (bytes(range(128)), 3, 2, [2], 30.0)]
    for c, rank, local, offset, devices in ((c0, 0, 2, 0, ["cuda:0", "cuda:1"]), (c1, 1, 1, 2, ["cuda:2"])):
        assert (c.backend, c.size, c.local_size, c.rank, c.world_size) == ("nccl", 3, local, rank, 2)
        assert c.tower_counts == [2, 1] and c.tower_offset == offset and c.devices == devices
        assert c.group == rank and c.collective_mode == "blocking"
    assert c1.predivide and not c0.predivide


def test_tower_offset_of_directly_built_communicators():
    handle = types.SimpleNamespace(aborted=False)
    # one tower per process: the offset is the process rank (the layout init_rank builds everywhere)
    c = NcclCommunicator(handle, [0], rank=3, world_size=4, size=4, timeout=9.0, predivide=False)
    assert c.tower_counts == [1, 1, 1, 1] and c.tower_offset == 3
    c = NcclCommunicator(handle, [0, 1], rank=0, world_size=1, size=2, timeout=9.0, predivide=False)   # init_all
    assert c.tower_counts == [2] and c.tower_offset == 0


# ---------------------------------------------------------------- the core's init_ranks: argument checks

@pytest.mark.parametrize("args,argname", [
    ((b"x" * 7, 2, 0, [0], 5.0), "unique_id"),
    ((b"x" * 128, 2, 0, [], 5.0), "devices"),
    ((b"x" * 128, 0, 0, [0], 5.0), "nranks"),
    ((b"x" * 128, 3, 2, [0, 1], 5.0), "first_rank"),   # ranks 2..3 of 3
    ((b"x" * 128, 3, -1, [0], 5.0), "first_rank"),
    ((b"x" * 128, 2, 0, [0], 0.0), "timeout_s"),
    ((b"x" * 128, 2, 0, [0], float("nan")), "timeout_s"),
])
def test_core_init_ranks_checks_arguments_before_nccl_or_cuda(args, argname):
    # Every case fails before the core loads NCCL or asks CUDA for a device, so it runs on any machine.
    from ncclavg import _C

    if not hasattr(_C, "NcclComm"):
        pytest.skip("this build of ncclavg has no CUDA part")
    with pytest.raises(ValueError, match=f"argument '{argname}'"):
        _C.NcclComm.init_ranks(*args)


def test_core_init_ranks_refuses_a_bad_collective_mode_first(monkeypatch):
    # See Note [Blocking collectives after a bounded init] in csrc/cuda/comm_init.cpp.
    from ncclavg import _C

    if not hasattr(_C, "NcclComm"):
        pytest.skip("this build of ncclavg has no CUDA part")
    monkeypatch.setenv("NCCLAVG_NCCL_COLLECTIVES", "sometimes")
    with pytest.raises(ValueError, match="NCCLAVG_NCCL_COLLECTIVES.*'sometimes'"):
        _C.NcclComm.init_ranks(b"x" * 128, 2, 0, [0], 5.0)
