"""The `ncclavg` backend with CUDA tensors: they go to the group's inner ProcessGroupNCCL (Note [A
ProcessGroup, not a Backend]). One process per GPU; skipped without one (a 2-process case needs 2 GPUs:
NCCL before 2.30 cannot put two ranks on one GPU)."""
import pytest
import torch
from _dist_util import run_ranks

pytestmark = pytest.mark.gpu


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_job(rank, world, port):
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ncclavg

    torch.cuda.set_device(rank)
    dist.init_process_group("ncclavg", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cuda", rank)
    t = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((1000,), float(sum(range(1, world + 1)))))
    t = torch.full((8,), float(rank + 1), device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t.cpu(), torch.full((8,), sum(range(1, world + 1)) / world))
    out = torch.empty(2 * world, device=dev)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev))
    assert torch.equal(out.cpu(), torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    x = torch.arange(4.0, device=dev) + rank
    dist.broadcast(x, src=0)
    assert torch.equal(x.cpu(), torch.arange(4.0))
    # CPU tensors of the same group still take the channel / gloo
    c = torch.ones(5)
    dist.all_reduce(c)
    assert torch.equal(c, torch.full((5,), float(world)))
    # stock DDP on CUDA over the backend, and with the hook on a bfloat16 wire
    for wire in (None, "bfloat16"):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(16, 4).to(dev), device_ids=[rank])
        if wire:
            ncclavg.ddp.register(model, wire=wire)
        model(torch.randn(8, 16, device=dev)).sum().backward()
        torch.cuda.synchronize()
        g = model.module.weight.grad.clone()
        dist.broadcast(g, src=0)
        assert torch.equal(g, model.module.weight.grad)   # every rank holds the same average
    dist.barrier()
    dist.destroy_process_group()   # NCCL groups are torn down (Note [Gloo teardown] is about gloo's)


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
def test_cuda_tensors_one_process():
    run_ranks(cuda_job, 1, timeout_s=300)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices (one rank per GPU)")
def test_cuda_tensors_two_processes():
    run_ranks(cuda_job, 2, timeout_s=300)
