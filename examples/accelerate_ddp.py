"""Hugging Face Accelerate on CPUs with the `ncclavg` backend, and ncclavg's DDP comm hook registered on the
model `prepare()` returns (Accelerate's `DistributedDataParallelKwargs(comm_hook=...)` takes only its
built-in hooks). On CPUs Accelerate (1.15) refuses `InitProcessGroupKwargs(backend="ncclavg")`: it allows
only gloo or mpi there. It uses a process group that already exists, though, so the script initialises
the default group itself before making the Accelerator (on GPUs `InitProcessGroupKwargs(backend="ncclavg")`
is passed through).

    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --epochs 2 [--hook]
    (or: accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py)
Needs `pip install accelerate` (with your torch already installed).
"""
from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

import ncclavg  # registers the "ncclavg" torch.distributed backend
from ncclavg.train.data import load_digits
from ncclavg.train.models import build_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--hook", action="store_true", help="register ncclavg.ddp's comm hook too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("ncclavg", timeout=datetime.timedelta(seconds=300))   # torchrun's env://
    acc = Accelerator(cpu=True)   # uses the group above
    data = load_digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train), batch_size=64,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    model = build_model("mlp", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    if args.hook:
        ncclavg.ddp.register(model)   # model is the DistributedDataParallel prepare() made
    for _epoch in range(args.epochs):
        for x, y in loader:
            opt.zero_grad()
            acc.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
    net = acc.unwrap_model(model)
    with torch.no_grad():
        accuracy = (net(data.x_test).argmax(1) == data.y_test).float().mean().item()
    digest = torch.tensor([sum(float(p.detach().double().sum()) * (i + 1) for i, p in enumerate(net.parameters()))],
                          dtype=torch.float64)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(digests, digest)
    same = all(torch.equal(d, digests[0]) for d in digests)
    if acc.is_main_process:
        print(f"accelerate_ddp: test_accuracy={accuracy:.3f} backend={dist.get_backend()} "
              f"world_size={dist.get_world_size()} hook={'on' if args.hook else 'off'} replicas_identical={same}",
              flush=True)
    dist.barrier()
    ncclavg.comm.end_process(0 if same else 1)   # Note [Gloo teardown] in ncclavg/comm/dist.py


if __name__ == "__main__":
    main()
