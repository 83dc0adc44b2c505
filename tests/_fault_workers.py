"""Bodies of the multi-process fault tests (a module of its own so spawned children can import it).
Every rank reports what happened to it with _fault_util.report; a rank that is killed reports nothing."""
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_util import between_hosts, init_rank
from _fault_util import report
from _comm_gloo_workers import MLP, pretend_hosts, rank_batch

BUCKETS = dict(bucket_cap_mb=0.001, first_bucket_mb=0.0003)   # 4 buckets for the tiny MLP: [5] [4 3] [2 1] [0]


def _step(model, avg, rank, step):
    x, y = rank_batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    avg.average()


def _error_fields(e, t0):
    return {"type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0,
            "trace": traceback.format_exc()[-2000:]}


def _later_calls(comm, avg):
    """What a communicator / averager says when used again after the failure."""
    out = {}
    try:
        comm.all_reduce_avg([torch.ones(4)])
        out["comm"] = "no error"
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        out["comm"] = f"{type(e).__name__}: {e}"
    try:
        avg.average()
        out["avg"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["avg"] = f"{type(e).__name__}: {e}"
    return out


def peer_dies_mid_step(rank, world, port, outdir, victim, timeout, how, layout=None):
    """`victim` SIGKILLs (how="kill") or SIGSTOPs (how="stop": alive but silent, the classic hang)
    itself in the middle of backward of step 2, after its first buckets were launched. The others must
    raise within timeout + 10 s, naming the operation, bucket, bytes and rank. layout: pretend hosts
    (_comm_gloo_workers.pretend_hosts), so that the loss crosses a shared-memory channel and the hosts' link."""
    init_rank(rank, world, port, timeout_s=120)   # gloo's own timeout far above ours: ours must fire
    pretend_hosts(rank, layout)
    from ncclavg import Communicator, GradientAverager

    comm = Communicator.from_torch_distributed(device="cpu", timeout=timeout)
    if layout is not None:
        assert comm.transport == between_hosts(), comm.transport
    if how == "stop" and layout is None:
        # a bounded allgather_object first: rank 0 alone on a side group, its peer never joins
        side = dist.new_group([0, 1])
        side_comm = Communicator.from_torch_distributed(group=side, device="cpu", timeout=1.0)
        t0 = time.monotonic()
        try:
            if rank == 0:
                side_comm.allgather_object({"rank": rank})
            else:   # the nccl backend's unique-id look-up in the store, rank 0 never publishing one
                _nccl_uid_lookup_alone(timeout=1.0)
            side_err = "no error"
        except Exception as e:  # noqa: BLE001
            side_err = f"{type(e).__name__}: {e} after {time.monotonic() - t0:.1f} s"
        report(outdir, f"side{rank}", side=side_err)   # now: rank 1 will not report later
        dist.barrier()
    torch.manual_seed(0)
    model = MLP()
    avg = GradientAverager(comm, [model], overlap=True, **BUCKETS)
    assert len(avg.plan.buckets) == 4
    params = list(model.parameters())
    armed = []
    if rank == victim:
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        # backward produces grads in reverse order: param 2 comes after the buckets of params 5..3
        def die(_param):
            if armed:
                os.kill(os.getpid(), sig)

        params[2].register_post_accumulate_grad_hook(die)
    for step in range(2):
        avg.zero_grad()
        _step(model, avg, rank, step)
    avg.zero_grad()
    armed.append(True)
    t0 = time.monotonic()
    try:
        _step(model, avg, rank, 2)
        fields = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        fields = _error_fields(e, t0)
    fields.update(later=_later_calls(comm, avg), failure=comm.failure)
    report(outdir, rank, **fields)
    if rank == 0:
        # rank 0 hosts the store here (init_method tcp://; under torchrun the agent does): it stays until
        # the other survivors have reported, so that they can still read the heartbeats that name the lost
        # rank (Note [Naming the lost rank])
        others = [r for r in range(1, world) if r != victim]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(os.path.exists(os.path.join(outdir, f"rank{r}.json"))
                                                     for r in others):
            time.sleep(0.05)
    os._exit(0)   # the process group is broken: skip its teardown


def _nccl_uid_lookup_alone(timeout):
    """NcclCommunicator.init_rank on a CPU machine up to its store look-up: the NCCL checks are stubbed
    out, the store wait is the real one (rank 0 never publishes an id, so it must time out)."""
    from ncclavg.comm import nccl as comm_nccl

    comm_nccl.require_nccl_comm = lambda: None
    comm_nccl._device_index = lambda d, argname: 0
    comm_nccl.NcclCommunicator.init_rank(None, torch.device("cpu"), timeout, False)


def layout_and_debug(rank, world, port, outdir):
    """Phase 1: bucket plans that differ across 3 ranks -> LayoutMismatchError on every rank naming the
    first differing parameter. Phase 2: NCCLAVG_DEBUG=1 gives the same averages as normal mode, and
    a rank that skips bucket 1 makes every rank raise CollectiveMismatchError."""
    init_rank(rank, world, port, timeout_s=120)
    from ncclavg import CollectiveMismatchError, Communicator, GradientAverager, LayoutMismatchError

    comm = Communicator.from_torch_distributed(device="cpu", timeout=20)
    out = {"bad_input": []}
    if rank == 1:   # bad arguments on one rank only: refused before anything starts, so no rank desyncs
        for call in (lambda: comm.all_reduce_avg([torch.ones(4)], timeout=-1),
                     lambda: comm.all_reduce_avg([torch.ones(4, dtype=torch.int32)]),
                     lambda: comm.all_reduce_avg([torch.ones(4), torch.ones(4)]),
                     lambda: comm.all_reduce_avg_async([torch.ones(4, 4).t()]),
                     lambda: comm.reduce_scatter_avg([torch.ones(7)], [torch.ones(2)]),
                     lambda: comm.all_gather([torch.ones(2)], [torch.ones(5)]),
                     lambda: comm.allgather_object(1, timeout=0)):
            try:
                call()
                out["bad_input"].append("no error")
            except (ValueError, TypeError) as e:
                out["bad_input"].append(f"{type(e).__name__}: {e}")
    x = torch.full((4,), float(rank))
    comm.all_reduce_avg([x])
    out["after_bad_input"] = x.tolist()

    class Deeper(MLP):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 4)

    cases = {
        "extra_param_on_rank1": lambda: Deeper() if rank == 1 else MLP(),
        "shape_on_rank2": lambda: MLP(hidden=25) if rank == 2 else MLP(),
        "dtype_on_rank0": lambda: MLP().to(torch.bfloat16) if rank == 0 else MLP(),
    }
    for name, make in cases.items():
        try:
            GradientAverager(comm, [make()], **BUCKETS)
            out[name] = "no error"
        except LayoutMismatchError as e:
            out[name] = f"LayoutMismatchError: {e}"
    try:  # same parameters, different bucket sizes on rank 1
        GradientAverager(comm, [MLP()], bucket_cap_mb=0.001 if rank != 1 else 0.004, first_bucket_mb=0.0003)
        out["bucket_cap_on_rank1"] = "no error"
    except LayoutMismatchError as e:
        out["bucket_cap_on_rank1"] = f"LayoutMismatchError: {e}"

    # Phase 2: the same step with and without debug mode gives bit-identical averages
    torch.manual_seed(0)
    base = MLP()
    grads = {}
    for debug in (False, True):
        c = Communicator.from_torch_distributed(device="cpu", timeout=20)
        c.debug = debug
        m = MLP()
        m.load_state_dict(base.state_dict())
        a = GradientAverager(c, [m], **BUCKETS)
        _step(m, a, rank, 0)
        grads[debug] = [p.grad.clone() for p in m.parameters()]
        a.close()
    out["debug_same_result"] = all(torch.equal(x, y) for x, y in zip(grads[False], grads[True]))

    comm = Communicator.from_torch_distributed(device="cpu", timeout=20)
    comm.debug = True
    m = MLP()
    avg = GradientAverager(comm, [m], **BUCKETS)
    _step(m, avg, rank, 0)
    avg.zero_grad()
    if rank == 1:   # this rank "forgets" bucket 1 of step 1
        real = comm.all_reduce_avg_async

        def skipping(tensors, defer_scale=False, **kw):
            if kw.get("debug_key") is not None and kw["debug_key"][:2] == (1, 1):
                from ncclavg.comm import CompletedWork
                return CompletedWork()
            return real(tensors, defer_scale, **kw)

        comm.all_reduce_avg_async = skipping
    t0 = time.monotonic()
    try:
        _step(m, avg, rank, 1)
        out["skip"] = {"type": "no error"}
    except CollectiveMismatchError as e:
        out["skip"] = _error_fields(e, t0)
    except Exception as e:  # noqa: BLE001
        out["skip"] = _error_fields(e, t0)
    out["skip"]["later"] = _later_calls(comm, avg)
    report(outdir, rank, **out)
    os._exit(0)
