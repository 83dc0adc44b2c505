"""Bodies of tests/process_group/test_backend_device_table.py: the `ncclavg` backend's collectives by device type
(Note [Device types] in ncclavg/process_group/devices.py), on a machine without CUDA: tensors that say they
are CUDA tensors, and an inner NCCL group that records what it is asked."""
import torch
import torch.distributed as dist

from _process_group_workers import init_backend


class SaysCuda(torch.Tensor):
    """A CPU tensor that answers as a CUDA tensor where the group looks."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


class RecordingNccl:
    """The inner ProcessGroupNCCL's stand-in: each call is logged as (method, args) and answers a Work."""

    def __init__(self):
        self.log = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            self.log.append((name, args))
            return _Done()
        return call


class _Done:
    def wait(self, timeout=None):
        return True


def cuda(n=4):
    return torch.zeros(n).as_subclass(SaysCuda)


def calls(world):
    """(method of the group, its arguments, the NCCL method expected, how many NCCL calls) per collective."""
    from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                            AllToAllOptions, BroadcastOptions, GatherOptions, ReduceOptions,
                                            ReduceScatterOptions, ScatterOptions)
    a, b, out = cuda(), cuda(), cuda(4 * world)
    return [
        ("allreduce", ([a], AllreduceOptions()), "allreduce", 1),
        ("allreduce_coalesced", ([a, b], AllreduceCoalescedOptions()), "allreduce_coalesced", 1),
        ("reduce", ([a], ReduceOptions()), "reduce", 1),
        ("reduce_scatter_single", (a, out, ReduceScatterOptions()), "_reduce_scatter_base", 1),
        ("_reduce_scatter_base", (a, out, ReduceScatterOptions()), "_reduce_scatter_base", 1),
        ("reduce_scatter_tensor_coalesced", ([a, b], [out, cuda(4 * world)], ReduceScatterOptions()),
         "_reduce_scatter_base", 2),
        ("reduce_scatter", ([a], [[cuda() for _ in range(world)]], ReduceScatterOptions()), "reduce_scatter", 1),
        ("broadcast", ([a], BroadcastOptions()), "broadcast", 1),
        ("all_gather_single", (out, a, AllgatherOptions()), "_allgather_base", 1),
        ("_allgather_base", (out, a, AllgatherOptions()), "_allgather_base", 1),
        ("allgather_into_tensor_coalesced", ([out, cuda(4 * world)], [a, b], AllgatherOptions()),
         "_allgather_base", 2),
        ("allgather", ([[cuda() for _ in range(world)]], [a], AllgatherOptions()), "allgather", 1),
        ("allgather_coalesced", ([[cuda(), cuda()] for _ in range(world)], [a, b], AllgatherOptions()),
         "allgather_coalesced", 1),
        ("gather", ([[cuda() for _ in range(world)]], [a], GatherOptions()), "gather", 1),
        ("scatter", ([a], [[cuda() for _ in range(world)]], ScatterOptions()), "scatter", 1),
        ("all_to_all_single", (out, cuda(4 * world), [], [], AllToAllOptions()), "alltoall_base", 1),
        ("alltoall_base", (out, cuda(4 * world), [], [], AllToAllOptions()), "alltoall_base", 1),
        ("alltoall", ([cuda() for _ in range(world)], [cuda() for _ in range(world)], AllToAllOptions()),
         "alltoall", 1),
        ("send", ([a], 0, 3), "send", 1),
        ("recv", ([a], 0, 3), "recv", 1),
    ]


def routes_job(rank, world, port):
    """Every collective of NcclCollectives hands its CUDA tensors to the inner NCCL group's method, with
    the caller's own arguments; mixed devices and receiving from any source are refused naming the
    argument; CPU tensors never reach NCCL."""
    from ncclavg.process_group.devices import NcclCollectives

    table = {n for n in vars(NcclCollectives) if not n.startswith("_")}

    init_backend(rank, world, port)
    g = dist.group.WORLD
    nccl = RecordingNccl()
    g._nccl = nccl
    seen = set()
    for method, args, want, n in calls(world):
        nccl.log.clear()
        getattr(g, method)(*args)
        assert [name for name, _ in nccl.log] == [want] * n, (method, nccl.log)
        if n == 1:
            got = nccl.log[0][1]
            assert len(got) == len(args) and all(x is y for x, y in zip(got, args)), (method, got)
        seen.add(getattr(type(g), method).__name__)
    assert seen == table - {"recv_anysource"}, table - seen

    try:
        g.recv_anysource([cuda()], 0)
        raise AssertionError("recv_anysource took a CUDA tensor")
    except ValueError as e:
        assert str(e).startswith("tensor:"), e
    for method, args in [("allreduce_coalesced", ([cuda(), torch.zeros(4)],)),
                         ("all_gather_single", (torch.zeros(4 * world), cuda()))]:
        try:
            getattr(g, method)(*args)
            raise AssertionError(f"{method} took CPU and CUDA tensors in one call")
        except ValueError as e:
            assert "several device types" in str(e), e
    # outputs on CUDA beside CPU inputs, where the table looks at the inputs only
    try:
        g.allgather_coalesced([[cuda()] for _ in range(world)], [torch.zeros(4)])
        raise AssertionError("allgather_coalesced took CUDA outputs for CPU inputs")
    except ValueError as e:
        assert str(e).startswith("output_tensor_lists[0]: expected CPU tensors"), e
    nccl.log.clear()
    t = torch.ones(3)
    dist.all_reduce(t)
    assert nccl.log == [] and torch.equal(t, torch.full((3,), float(world))), nccl.log

    g._nccl = None   # a process without CUDA or NCCL
    try:
        g.broadcast([cuda()])
        raise AssertionError("a CUDA tensor went somewhere without NCCL")
    except ValueError as e:
        assert str(e) == "tensors: CUDA tensors need CUDA and NCCL, which this process does not have", e
    dist.barrier()
