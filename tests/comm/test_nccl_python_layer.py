"""The NCCL backend's Python layer on a CPU, with a fake core handle: a Work keeps its tensors alive
until the collective is safe to forget (Note [A Work keeps its tensors alive]), reduce_scatter_avg
passes `predivide` on, and the rule for several NCCL ranks on one GPU (Note [Several ranks on one GPU]
in csrc/cuda/nccl_api.cpp) names the NCCL found, the one needed and the variable."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ncclavg.comm import nccl as nccl_backend
from ncclavg.comm.nccl import NcclCommunicator, _NcclWork, multi_rank_gpu_problem

VAR = "NCCL_MULTI_RANK_GPU_ENABLE"


class FakeHandle:
    """Records the core calls; `finished` is what done() answers."""

    def __init__(self):
        self.calls = []
        self.finished = False

    def wait(self, timeout, seq):
        self.calls.append(("wait", timeout, seq))

    def done(self, seq):
        self.calls.append(("done", seq))
        return self.finished

    def stream_wait(self, streams, seq=0):
        self.calls.append(("stream_wait", list(streams), seq))

    def reduce_scatter_avg(self, inputs, outputs, streams, predivide, timeout, tag):
        self.calls.append(("reduce_scatter_avg", predivide, timeout, tag))
        return self.seq

    def all_gather(self, inputs, outputs, streams, timeout, tag):
        self.calls.append(("all_gather", timeout, tag))
        return self.seq

    def all_reduce_avg(self, bufs, streams, predivide, timeout, tag):
        self.calls.append(("all_reduce_avg", predivide, timeout, tag))
        return self.seq

    seq = 7   # what the enqueueing calls return (0: an empty collective, nothing enqueued)


class FakeComm:
    """`current` is what torch.cuda.current_stream would say now, per device."""

    def __init__(self, current=(123,)):
        self._handle = FakeHandle()
        self.current = list(current)

    def _call(self, fn, *args):
        return fn(*args)

    def _streams(self):
        return list(self.current)


def work_with_a_dropped_tensor(comm):
    """A Work over a tensor whose only other reference is gone; returns (work, weakref to the tensor)."""
    t = torch.ones(16)
    ref = weakref.ref(t)
    work = _NcclWork(comm, 7, [123], 30.0, [t])
    del t
    gc.collect()
    return work, ref


def test_work_keeps_its_tensors_until_wait():
    comm = FakeComm()
    work, ref = work_with_a_dropped_tensor(comm)
    assert ref() is not None, "the Work let go of a tensor NCCL may still write"
    work.wait()
    gc.collect()
    assert ref() is None, "wait() returned, so the tensor may go"
    assert comm._handle.calls == [("wait", 30.0, 7), ("stream_wait", [123], 7)]


def test_work_keeps_its_tensors_until_done_says_true():
    comm = FakeComm()
    work, ref = work_with_a_dropped_tensor(comm)
    assert work.done() is False
    gc.collect()
    assert ref() is not None, "done() said False: NCCL may still write the tensor"
    comm._handle.finished = True
    assert work.done() is True
    gc.collect()
    assert ref() is None


def test_work_dropped_without_wait_orders_the_streams_first():
    comm = FakeComm()
    work, ref = work_with_a_dropped_tensor(comm)
    del work
    gc.collect()
    assert ref() is None
    assert comm._handle.calls == [("stream_wait", [123], 7)], "dropping the Work must order the callers' streams"


def test_wait_stream_orders_after_this_collective_without_a_host_wait():
    """Note [Stream-ordered average]: the averager orders each bucket's own collective, no host wait."""
    comm = FakeComm()
    work, ref = work_with_a_dropped_tensor(comm)
    work.wait_stream()
    assert comm._handle.calls == [("stream_wait", [123], 7)]   # collective 7, not the last enqueued
    gc.collect()
    assert ref() is None, "the streams are ordered after the collective: the tensor may go"
    del work
    gc.collect()
    assert len(comm._handle.calls) == 1, "an ordered Work does not order again when dropped"


def test_waited_work_does_not_order_again_when_dropped():
    comm = FakeComm()
    work, _ = work_with_a_dropped_tensor(comm)
    work.wait()
    del work
    gc.collect()
    assert [c[0] for c in comm._handle.calls] == ["wait", "stream_wait"]


def test_reduce_scatter_passes_predivide(monkeypatch):
    # The tensor checks need CUDA tensors; this test is about what reaches the core, so they are bypassed.
    monkeypatch.setattr(NcclCommunicator, "_check_scatter_args", lambda self, i, o: (list(i), list(o)))
    monkeypatch.setattr(NcclCommunicator, "_streams", lambda self: [0])
    monkeypatch.setattr(nccl_backend, "as_buffers", lambda tensors, name: list(tensors))
    for predivide in (False, True):
        handle = FakeHandle()
        comm = NcclCommunicator(handle, [0], rank=0, world_size=1, size=2, timeout=9.0, predivide=predivide)
        comm.debug = False
        comm.reduce_scatter_avg([torch.zeros(4)], [torch.zeros(2)], tag="bucket 1")
        assert handle.calls[0] == ("reduce_scatter_avg", predivide, 9.0, "bucket 1")


@pytest.mark.parametrize("version,env,allowed", [
    (23000, {VAR: "1"}, True),
    (23203, {VAR: "1"}, True),
    (23000, {VAR: "0x1"}, True),      # NCCL parses with strtoll(..., 0)
    (23000, {VAR: "7"}, True),
    (22907, {VAR: "1"}, False),       # too old, however it is configured
    (21805, {}, False),
    (0, {VAR: "1"}, False),           # no NCCL loaded
    (23000, {}, False),               # new enough, but not enabled
    (23000, {VAR: "0"}, False),
    (23000, {VAR: ""}, False),
    (23000, {VAR: "yes"}, False),
    (23000, {VAR: "1abc"}, False),    # refused here even though NCCL would read 1: the safe direction
])
def test_multi_rank_gpu_rule(version, env, allowed):
    why = multi_rank_gpu_problem(version, env)
    assert (why is None) == allowed, why
    if allowed:
        return
    assert VAR in why and "2.30.0" in why, why   # the variable and the version needed
    if version >= 23000:
        assert f"'{env[VAR]}'" in why if VAR in env else "unset" in why
    elif version:
        found = f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
        assert f"loaded NCCL is {found}" in why, why
    else:
        assert "no NCCL is loaded" in why, why


def test_repeated_device_error_names_the_entry_and_the_rule(monkeypatch):
    monkeypatch.setattr(nccl_backend, "nccl_info", lambda: {"version_code": 22904})
    with pytest.raises(ValueError, match=r"devices\[2\]: cuda:1 is listed twice \(also devices\[1\]\)") as e:
        nccl_backend._check_repeated_devices([0, 1, 1], {VAR: "1"})
    assert "2.29.4" in str(e.value) and "2.30.0" in str(e.value) and VAR in str(e.value)
    nccl_backend._check_repeated_devices([0, 1, 2], {})           # nothing repeated: no rule to apply
    monkeypatch.setattr(nccl_backend, "nccl_info", lambda: {"version_code": 23000})
    nccl_backend._check_repeated_devices([0, 0], {VAR: "1"})      # allowed: one rank per tower
    with pytest.raises(ValueError, match=VAR):
        nccl_backend._check_repeated_devices([0, 0], {})


def test_wait_orders_the_streams_current_at_wait_and_at_issue():
    """Note [Which streams a Work orders]: issued from one stream (a hook thread's), waited on another."""
    comm = FakeComm(current=[555])
    work, ref = work_with_a_dropped_tensor(comm)   # issued with streams [123]
    work.wait()
    assert comm._handle.calls == [("wait", 30.0, 7), ("stream_wait", [555], 7), ("stream_wait", [123], 7)]
    comm2 = FakeComm(current=[555])
    work2, _ = work_with_a_dropped_tensor(comm2)
    work2.wait_stream()
    assert comm2._handle.calls == [("stream_wait", [555], 7), ("stream_wait", [123], 7)]


def test_an_empty_collectives_work_is_complete_and_waits_for_nothing():
    """seq 0 (nothing enqueued) must not mean "every collective so far" to the core's wait."""
    comm = FakeComm()
    work = _NcclWork(comm, 0, [123], 30.0, [torch.ones(0)])
    assert work.done() is True
    work.wait()
    work.wait_stream()
    del work
    gc.collect()
    assert comm._handle.calls == []


@pytest.mark.parametrize("seq", [0, 9])
def test_synchronous_collectives_order_after_their_own_collective(monkeypatch, seq):
    """Not after "the last enqueued" (seq 0 to the core), which may be another thread's later bucket."""
    monkeypatch.setattr(NcclCommunicator, "_check_scatter_args", lambda self, i, o: (list(i), list(o)))
    monkeypatch.setattr(NcclCommunicator, "_check_gather_args", lambda self, i, o: (list(i), list(o)))
    monkeypatch.setattr(NcclCommunicator, "_checked_buffers", lambda self, t, name: (list(t), list(t)))
    monkeypatch.setattr(NcclCommunicator, "_streams", lambda self: [42])
    monkeypatch.setattr(nccl_backend, "as_buffers", lambda tensors, name: list(tensors))
    handle = FakeHandle()
    handle.seq = seq
    comm = NcclCommunicator(handle, [0], rank=0, world_size=1, size=2, timeout=9.0, predivide=False)
    comm.debug = False
    comm.reduce_scatter_avg([torch.zeros(4)], [torch.zeros(2)])
    comm.all_gather([torch.zeros(2)], [torch.zeros(4)])
    comm.all_reduce_avg([torch.zeros(4)])
    waits = [c for c in handle.calls if c[0] == "stream_wait"]
    assert waits == ([("stream_wait", [42], seq)] * 3 if seq else []), handle.calls


class _FailingHandle(FakeHandle):
    """wait() raises the core's CudaError; `aborted` says whether the core aborted before raising."""

    def __init__(self, aborted):
        super().__init__()
        self.aborted = aborted
        self.abort_reason = "CUDA error while all_reduce_avg ran on cuda:0" if aborted else ""

    def wait(self, timeout, seq):
        raise nccl_backend._C.CudaError("CUDA error while all_reduce_avg ran on cuda:0: an illegal memory access "
                                        "was encountered; the communicator was aborted (ncclCommAbort)")


@pytest.mark.parametrize("aborted", [True, False])
def test_a_cuda_error_the_core_aborted_for_fails_the_communicator(aborted):
    # A sticky CUDA error found while waiting aborts the core communicator (csrc/cuda/comm.cpp, Note
    # [Watchdog]); the Python layer must then refuse every later call with the reason, and must not
    # when the core stayed usable.
    comm = NcclCommunicator(_FailingHandle(aborted), [0], rank=0, world_size=1, size=1, timeout=5.0, predivide=False)
    with pytest.raises(nccl_backend._C.CudaError, match="illegal memory access"):
        comm._call(comm._handle.wait, 1.0, 0)
    assert (comm.failure is not None) == aborted
    if aborted:
        assert "illegal memory access" in comm.failure
