"""The backend's CPU collectives ask their primitive steps of the group's implementations in order
(Note [Implementations in order] in ncclavg/process_group/cpu_collectives.py): the channel's first when
the group has a channel, then gloo's; a step an implementation lacks, or answers NotImplemented for, goes
to the next. Checked here with stand-in implementations that record who ran what; the real steps' results
are checked against references by the matrix tests (tests/comm/test_backend_matrix.py)."""
import pytest
import torch

from ncclavg.process_group.cpu_collectives import CpuCollectives
from ncclavg.process_group.cpu_paths import ChannelPaths, GlooPaths


class Recorder:
    def __init__(self, name, log, refuse=()):
        self.name, self.log, self.refuse = name, log, set(refuse)

    def __getattr__(self, step):
        if step.startswith("_") or step in ("name", "log", "refuse"):
            raise AttributeError(step)

        def run(*args):
            if step in self.refuse:
                return NotImplemented
            self.log.append((self.name, step))
            return torch.zeros(2, 1) if step == "rows" else None
        return run


class ChannelLike(Recorder):
    """Has no all-to-all, as the real channel has none."""

    def __getattr__(self, step):
        if step.startswith("alltoall"):
            raise AttributeError(step)
        return super().__getattr__(step)


class FakeShm:
    kind = "shm"


def _cpu(log, refuse=()):
    cpu = CpuCollectives(None, object(), 0, 2)
    cpu.paths = [ChannelLike("channel", log, refuse), Recorder("gloo", log)]
    return cpu


def test_the_order_follows_the_transport():
    with_channel = CpuCollectives(FakeShm(), object(), 0, 2)
    assert [type(p) for p in with_channel.paths] == [ChannelPaths, GlooPaths]
    assert [type(p) for p in CpuCollectives(None, object(), 0, 2).paths] == [GlooPaths]


@pytest.mark.parametrize("call, step", [
    (lambda c, j: c.allreduce(j, torch.ones(4), torch.distributed.ReduceOp.SUM), "sum"),
    (lambda c, j: c.allreduce(j, torch.ones(4, dtype=torch.int32), torch.distributed.ReduceOp.MAX), "reduce"),
    (lambda c, j: c.allreduce(j, torch.ones(4, dtype=torch.float8_e4m3fn), torch.distributed.ReduceOp.SUM), "reduce"),
    (lambda c, j: c.broadcast(j, torch.ones(3), 1), "broadcast_bytes"),
    (lambda c, j: c.all_gather_single(j, torch.empty(6), torch.ones(3)), "all_gather_bytes"),
    (lambda c, j: c.reduce_scatter_single(j, torch.empty(2), torch.ones(4), torch.distributed.ReduceOp.SUM),
     "sum_scatter"),
    (lambda c, j: c.scatter(j, torch.empty(2), [torch.ones(2)] * 2, 0), "scatter"),
    (lambda c, j: c.barrier(j), "check"),
])
def test_the_channel_runs_what_it_takes_and_gloo_the_rest(call, step):
    log = []
    call(_cpu(log), None)
    assert log == [("channel", step)]
    log.clear()
    call(_cpu(log, refuse={step}), None)   # e.g. a broadcast from rank 1 between hosts
    assert log == [("gloo", step)]


def test_a_step_the_channel_lacks_goes_to_gloo():
    log = []
    _cpu(log).alltoall(None, [torch.empty(1)] * 2, [torch.ones(1)] * 2)
    assert log == [("gloo", "alltoall")]


def test_with_no_implementation_left_it_says_so():
    cpu = CpuCollectives(None, object(), 0, 2)
    cpu.paths = [ChannelLike("channel", [])]
    with pytest.raises(AssertionError, match="no implementation of 'alltoall'"):
        cpu.alltoall(None, [], [])
