"""Both faces' collectives ask their steps of a group's implementations in order (Note [Implementations in
order] in ncclavg/transport/paths.py): the channel's first when the group has a channel, then gloo's; a
step whose arguments the channel does not take (`takes_sum`, `takes_root`), or that it has no way to do
(all_to_all), goes to gloo. Checked here with stand-in implementations that record who ran what; the real
steps' results are checked against references by the matrix tests (tests/process_group/)."""
import pytest
import torch

from ncclavg.process_group.cpu_collectives import CpuCollectives
from ncclavg.transport.paths import ChannelPaths, GlooPaths, HostsPaths, Paths


class Recorder:
    """Runs every step by recording it; takes what `takes` says."""

    def __init__(self, name, log, takes=True):
        self.name, self.log, self._takes = name, log, takes

    def takes_sum(self, t):
        return self._takes

    def takes_root(self, root):
        return self._takes

    def __getattr__(self, step):
        if step.startswith("_"):
            raise AttributeError(step)

        def run(*args):
            self.log.append((self.name, step))
            if step == "rows":
                return torch.zeros(2, 1)
            return args[-1] if step in ("sum", "sum_scatter") else None
        return run


class FakeShm:
    kind = "shm"
    between_hosts = False


class FakeHosts:
    kind = "shm+ucx"
    between_hosts = True


def _cpu(log, channel_takes=True):
    cpu = CpuCollectives(None, object(), 0, 2)
    channel, gloo = Recorder("channel", log, channel_takes), Recorder("gloo", log)
    cpu.paths.channel, cpu.paths.gloo, cpu.paths.impls = channel, gloo, [channel, gloo]
    return cpu


def test_the_order_follows_the_transport():
    with_channel = Paths(FakeShm(), object(), 0, 2)
    assert [type(p) for p in with_channel.impls] == [ChannelPaths, GlooPaths]
    assert [type(p) for p in Paths(None, object(), 0, 2).impls] == [GlooPaths]
    between = Paths(FakeHosts(), object(), 0, 4)
    assert [type(p) for p in between.impls] == [HostsPaths, GlooPaths]
    # between hosts a broadcast leaves from any rank, and a sum is divided after the hosts' sums
    assert all(between.channel.takes_root(r) for r in range(4)) and not between.channel.takes_root(4)
    assert between.channel.divides is False and with_channel.channel.divides is True
    assert between.channel.takes_sum(torch.ones(2)) and not between.channel.takes_sum(torch.ones(2, dtype=torch.int8))


@pytest.mark.parametrize("call, step, fallback", [
    (lambda c, j: c.allreduce(j, torch.ones(4), torch.distributed.ReduceOp.SUM), "sum", True),
    (lambda c, j: c.allreduce(j, torch.ones(4, dtype=torch.int32), torch.distributed.ReduceOp.MAX), "reduce", False),
    (lambda c, j: c.allreduce(j, torch.ones(4, dtype=torch.float8_e4m3fn), torch.distributed.ReduceOp.SUM), "reduce",
     False),
    (lambda c, j: c.broadcast(j, torch.ones(3), 1), "broadcast_bytes", True),
    (lambda c, j: c.all_gather_single(j, torch.empty(6), torch.ones(3)), "all_gather_bytes", False),
    (lambda c, j: c.reduce_scatter_single(j, torch.empty(2), torch.ones(4), torch.distributed.ReduceOp.SUM),
     "sum_scatter", True),
    (lambda c, j: c.scatter(j, torch.empty(2), [torch.ones(2)] * 2, 0), "scatter", True),
    (lambda c, j: c.barrier(j), "check", False),
])
def test_the_channel_runs_what_it_takes_and_gloo_the_rest(call, step, fallback):
    log = []
    call(_cpu(log), None)
    assert log == [("channel", step)]
    log.clear()
    call(_cpu(log, channel_takes=False), None)   # e.g. a broadcast from rank 1 between hosts, an int sum
    # steps with a predicate go to gloo; the others the channel always takes (bytes, gathered rows)
    assert log == [("gloo" if fallback else "channel", step)]


def test_a_step_the_channel_lacks_goes_to_gloo():
    log = []
    _cpu(log).alltoall(None, [torch.empty(1)] * 2, [torch.ones(1)] * 2)
    assert log == [("gloo", "alltoall")]
    log.clear()
    _cpu(log).alltoall_single(None, torch.empty(2), torch.ones(2), [], [])
    assert log == [("gloo", "alltoall_single")]
