"""FSDP2 (`fully_shard`) on the `ncclavg` backend on CPUs: parameters sharded over the processes, gathered
for forward and backward, gradients reduce-scattered (op AVG) through ncclavg's shared-memory channel.

    torchrun --nproc_per_node 2 examples/fsdp2.py --epochs 2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ncclavg  # noqa: F401  (registers the "ncclavg" torch.distributed backend)
from ncclavg.comm import end_process
from ncclavg.train.data import load_digits
from ncclavg.train.models import build_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64, help="per process")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("ncclavg")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = load_digits()
    model = build_model("mlp", seed=0)            # the same initial weights on every rank
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    n = len(data.y_train)
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=g)    # the same order everywhere; each rank takes its slice
        for i in range(0, n - world * args.batch_size + 1, world * args.batch_size):
            idx = order[i + rank * args.batch_size:i + (rank + 1) * args.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {acc:.3f}", flush=True)
    if rank == 0:
        print(f"fsdp2: test_accuracy={acc:.3f} world_size={world} transport={dist.group.WORLD.transport}", flush=True)
    dist.barrier()
    end_process(0)


if __name__ == "__main__":
    main()
