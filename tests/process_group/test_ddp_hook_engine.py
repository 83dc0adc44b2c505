"""The DDP hook sends a CUDA bucket through its `ncclavg` engine (whose CUDA half is NCCL), never through
DDP's own group: with DDP over gloo, the bucket went to gloo, where ReduceOp.AVG raises (torch before
gloo learnt AVG) and CUDA tensors take gloo's slow path. Note [The DDP hook's engine] in
ncclavg/process_group/ddp_hook.py.

No GPU here, so this is a stand-in: it drives the hook's CUDA route (`_cuda_average`) with CPU tensors
over two gloo ranks, and records the group that every torch.distributed collective of the route is
handed. The route has nothing device-specific but that group; the engine's CPU half (the channel) stands
in for its NCCL half. It cannot show NCCL's own arithmetic or stream order; on a GPU,
tests/process_group/test_torch_backend_gpu.py runs the hook over CUDA tensors.
"""
from __future__ import annotations

import pytest
from _dist_util import init_rank, run_ranks


def cuda_route_job(rank, world, port, predivide, wire):
    import torch
    import torch.distributed as dist

    import ncclavg  # noqa: F401  (registers the ncclavg backend)
    from ncclavg.process_group import ddp_hook

    init_rank(rank, world, port)   # DDP's own group: gloo
    state = ddp_hook.HookState(dist.group.WORLD, wire=wire, predivide=predivide, timeout=60)
    assert state.engine is not state.group and state.engine.getBackendName() == "ncclavg"
    handed = []   # (collective, the group it was handed)
    for name in ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single"):
        real = getattr(dist, name, None)
        if real is not None:
            def spy(*args, _real=real, _name=name, group=None, **kw):
                handed.append((_name, group))
                return _real(*args, group=group, **kw)
            setattr(dist, name, spy)
    # exact inputs: rank r holds r + 1 + k/4 at k, so the mean over ranks is exact in every wire dtype
    buf = (torch.arange(64, dtype=torch.float32) / 4 + rank + 1).contiguous()
    want = torch.arange(64, dtype=torch.float32) / 4 + (world + 1) / 2
    got = ddp_hook._cuda_average(state, buf).wait()
    assert got is buf and torch.equal(buf, want), (buf - want).abs().max()
    assert handed and all(g is state.engine for _, g in handed), \
        [(n, "engine" if g is state.engine else "DDP's group" if g is state.group else g) for n, g in handed]
    dist.barrier()


@pytest.mark.parametrize("predivide, wire", [(False, None), (True, "bfloat16")])
def test_the_cuda_route_averages_through_the_engine_not_ddps_gloo_group(predivide, wire):
    # before the fix, (False, None) raised "Cannot use ReduceOp.AVG with Gloo" on every rank
    run_ranks(cuda_route_job, 2, args=(predivide, wire), timeout_s=120)
