"""Fault injection on the communication path, with real gloo processes on loopback: a rank SIGKILLed or
frozen (SIGSTOP) in the middle of a step, plans that differ across ranks, a rank that skips a bucket in
debug mode. Each spawned job has a hard deadline (spawn_ranks kills everything after it)."""
import json
import re
import signal

import _fault_workers
import pytest
from _fault_util import read_reports, spawn_ranks

TIMEOUT = 4.0   # the communicators' timeout in these jobs (seconds)


# layout: pretend hosts (rank r on host layout[r]): a leader killed, a non-leader frozen, so the loss is
# seen through a host's shared-memory channel, between the hosts' leaders, and as an abort of a channel
# A frozen peer is found only when the timeout expires (~8 s a case): those run in the slow suite, and so
# does the one-host kill, which the two-host kill's own host covers in the quick suite.
@pytest.mark.parametrize("world,victim,how,layout", [pytest.param(4, 2, "kill", None, marks=pytest.mark.slow),
                                                     pytest.param(2, 1, "stop", None, marks=pytest.mark.slow),
                                                     pytest.param(4, 2, "kill", (0, 0, 1, 1), marks=pytest.mark.slow),
                                                     pytest.param(4, 3, "stop", (0, 0, 1, 1), marks=pytest.mark.slow)])
def test_peer_dies_mid_step_others_raise_within_timeout(tmp_path, world, victim, how, layout):
    codes = spawn_ranks(_fault_workers.peer_dies_mid_step, world, (str(tmp_path), victim, TIMEOUT, how, layout),
                        timeout_s=90)
    want = -signal.SIGKILL if how == "kill" else -signal.SIGSTOP
    assert codes[victim] == want, codes
    reports = read_reports(tmp_path, world)
    survivors = [r for r in range(world) if r != victim]
    assert sorted(reports) == survivors, (codes, reports)
    for r in survivors:
        rep = reports[r]
        assert rep["type"] in ("CommError", "CommTimeoutError"), rep
        assert rep["elapsed"] < TIMEOUT + 10, rep
        msg = rep["msg"]
        # names the operation, the bucket, the bytes and the rank
        assert re.search(r"gloo all_reduce_avg\[bucket \d+\] of \d+ bytes \(\d+ x float32 per tower\) on rank "
                         rf"{r} of {world}", msg), msg
        # names the rank that was lost (Note [Naming the lost rank])
        assert f"rank {victim} stopped responding" in msg, msg
        if how == "stop" and layout is None:   # a silent peer: only the timeout can end the wait
            assert rep["type"] == "CommTimeoutError" and f"did not complete within {TIMEOUT:g} s" in msg, msg
        # unusable afterwards, and every later call says so
        assert rep["failure"], rep
        assert rep["later"]["comm"].startswith("CommError: gloo communicator (rank") and "unusable" in \
            rep["later"]["comm"], rep["later"]
        assert "earlier reduction failed" in rep["later"]["avg"], rep["later"]
    if how == "stop" and layout is None:   # the side phase: bounded allgather_object and NCCL unique-id look-up
        side = json.loads((tmp_path / "rankside0.json").read_text())["side"]
        assert side.startswith("CommTimeoutError: gloo allgather_object (rank 0 of 2) (sizes) did not complete "
                               "within 1 s"), side
        side = json.loads((tmp_path / "rankside1.json").read_text())["side"]
        assert side.startswith("CommTimeoutError: nccl init (rank 1 of 2): rank 0's NCCL unique id did not "
                               "appear in the store"), side


def test_layout_mismatch_and_skipped_bucket_fail_on_every_rank(tmp_path):
    world = 3
    codes = spawn_ranks(_fault_workers.layout_and_debug, world, (str(tmp_path),), timeout_s=90)
    assert codes == [0] * world, codes
    reports = read_reports(tmp_path, world)
    assert sorted(reports) == list(range(world))
    bad = reports[1]["bad_input"]
    names = ["timeout", r"tensors\[0\]", "tensors", r"tensors\[0\]", "inputs", r"outputs\[0\]", "timeout"]
    assert len(bad) == len(names), bad
    for msg, name in zip(bad, names):
        assert re.match(rf"(ValueError|TypeError): {name}:", msg), (name, msg)
    for r, rep in reports.items():
        assert rep["after_bad_input"] == [1.0] * 4, rep["after_bad_input"]   # still in step, still usable
        # the same verdict on every rank, naming the first differing parameter
        m = rep["extra_param_on_rank1"]
        assert m.startswith("LayoutMismatchError") and "rank 1" in m and "parameter 6 ('head.weight')" in m, m
        m = rep["shape_on_rank2"]
        assert "rank 2" in m and "parameter 0 ('net.0.weight') has shape (25, 10)" in m, m
        m = rep["dtype_on_rank0"]
        assert "rank 1" in m and "parameter 0 ('net.0.weight')" in m and "bfloat16" in m, m
        m = rep["bucket_cap_on_rank1"]
        assert "rank 1" in m and "fingerprint" in m and "bucket_cap_mb" in m, m
        assert rep["debug_same_result"] is True
        skip = rep["skip"]
        assert skip["type"] == "CollectiveMismatchError", skip
        # every rank sees the whole table: rank 1 ran bucket 2 where the others ran bucket 1
        assert "rank 1: #" in skip["msg"] and "step 1, bucket 2" in skip["msg"], skip["msg"]
        assert "rank 0: #" in skip["msg"] and "step 1, bucket 1" in skip["msg"], skip["msg"]
        assert f"this is rank {r}" in skip["msg"]
        assert skip["elapsed"] < 20
        assert "unusable" in skip["later"]["comm"] and "NCCLAVG_DEBUG" in skip["later"]["comm"], skip["later"]


def test_local_close_and_wait_are_bounded():
    import threading
    import time

    import torch

    from ncclavg import CommError, CommTimeoutError, Communicator

    comm = Communicator.local(2, timeout=30)
    gate = threading.Event()
    comm._submit(gate.wait, "a stuck job")   # occupies the worker thread
    xs = [torch.ones(6), torch.zeros(6)]
    work = comm.all_reduce_avg_async(xs, tag="bucket 5")
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"local all_reduce_avg\[bucket 5\] of 24 bytes \(6 x float32 per "
                                               r"tower\) on 2 local tower\(s\) did not complete within 0.2 s"):
        work.wait(timeout=0.2)
    with pytest.raises(CommTimeoutError, match=r"close\(\): a stuck job was still running after 0.2 s"):
        comm.close(timeout=0.2)
    assert time.monotonic() - t0 < 5
    with pytest.raises(CommError, match="unusable"):
        comm.all_reduce_avg(xs)
    gate.set()


class _FakeCoreComm:
    """Stands in for _C.NcclComm to test the Python layer of the nccl backend without a GPU: it fails
    like the core does (CommTimeoutError after aborting, then NcclError on every call)."""

    nccl_version = 23203

    def __init__(self):
        self.aborted, self.abort_reason, self.calls = False, "", []

    def wait(self, timeout_s, seq=0):
        from ncclavg import CommTimeoutError

        self.calls.append(("wait", timeout_s, seq))
        self.aborted = True
        self.abort_reason = f"all_reduce_avg[bucket 3] of 4096 bytes did not complete within {timeout_s:g} s"
        raise CommTimeoutError(self.abort_reason + "; the communicator was aborted (ncclCommAbort)")

    def stream_wait(self, streams):
        self.calls.append(("stream_wait", streams))

    def abort(self):
        self.aborted, self.abort_reason = True, "abort() was called"

    def destroy(self):
        self.calls.append(("destroy",))


def test_nccl_backend_python_layer_records_core_failures():
    from ncclavg import CommError, CommTimeoutError
    from ncclavg.comm.nccl import NcclCommunicator, _NcclWork

    fake = _FakeCoreComm()
    comm = NcclCommunicator(fake, [0], rank=1, world_size=2, size=2, timeout=7.0, predivide=False)
    with pytest.raises(CommTimeoutError, match=r"\[bucket 3\] of 4096 bytes did not complete within 2 s"):
        _NcclWork(comm, 5, [0], comm.timeout).wait(timeout=2)
    assert fake.calls[0] == ("wait", 2.0, 5)
    assert "bucket 3" in comm.failure
    with pytest.raises(CommError, match=r"nccl communicator \(rank 1 of 2\) is unusable: .*bucket 3"):
        comm.allgather_object(1)
    # an abort done by the core's watchdog (seen through the handle) also makes the layer refuse calls
    fake2 = _FakeCoreComm()
    comm2 = NcclCommunicator(fake2, [0], rank=0, world_size=2, size=2, timeout=7.0, predivide=False)
    fake2.abort()
    with pytest.raises(CommError, match="unusable: abort"):
        comm2.allgather_object(1)


def test_debug_mode_switch_and_record_encoding(monkeypatch):
    import torch

    from ncclavg import Communicator
    from ncclavg.comm import debug as comm_debug

    for value, on in (("1", True), ("yes", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("NCCLAVG_DEBUG", value)
        assert Communicator.local(2).debug is on, value
    for record in ([1, 1, 0, 0, -1, -1, 0], [2**40 + 3, 3, 123456789, 2, 7, 12, 2**63 - 1],
                   [5, 2, 1, 1, 0, 0, -(2**63)]):
        enc = comm_debug.encode(record)
        assert enc.dtype == torch.float32 and enc.numel() == comm_debug.RECORD_LEN
        assert comm_debug.decode(enc) == record
    rows = [[3, 1, 64, 0, 2, 1, 99], [3, 1, 64, 0, 2, 2, 98]]
    msg = comm_debug.compare(rows, 1, "gloo")
    assert "rank 0: #3 all_reduce_avg of 64 x float32 (step 2, bucket 1" in msg and "this is rank 1" in msg
    assert comm_debug.compare([rows[0], rows[0]], 0, "gloo") is None
