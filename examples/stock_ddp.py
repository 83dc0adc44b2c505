"""Stock torch DistributedDataParallel on the `ncclavg` backend: the only change to a DDP script is the
backend name (and `import ncclavg`, which registers it). On one host the gradient all-reduces go through
ncclavg's shared-memory channel instead of gloo's sockets; `--hook` also registers ncclavg's DDP comm hook
(`--wire bfloat16` sends bfloat16 and adds in float32). At the end every rank checks that the replicas
hold the same bytes (ncclavg.ddp.check_replicas) and, on the ncclavg backend, rank 0 prints which rank
held the others back (ncclavg.ddp.straggler_report); `--slow-rank 1 --slow-ms 30` makes one rank's
backward slower to show it.

    torchrun --nproc_per_node 2 examples/stock_ddp.py --epochs 2
    torchrun --nproc_per_node 2 examples/stock_ddp.py --hook --wire bfloat16
    torchrun --nproc_per_node 2 examples/stock_ddp.py --epochs 1 --slow-rank 1 --slow-ms 30
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ncclavg  # registers the "ncclavg" torch.distributed backend
from ncclavg.comm import end_process
from ncclavg.train.data import load_digits
from ncclavg.train.models import build_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64, help="per process")
    ap.add_argument("--backend", default="ncclavg", help="ncclavg (default) or gloo, for comparison")
    ap.add_argument("--hook", action="store_true", help="also register ncclavg.ddp's comm hook")
    ap.add_argument("--wire", default=None, choices=["bfloat16", "float16"], help="the hook's wire dtype")
    ap.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --slow-ms before each backward")
    ap.add_argument("--slow-ms", type=float, default=30.0)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)                      # several processes share the machine's cores
    dist.init_process_group(args.backend)         # torchrun's environment (env://)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_digits()
    model = DDP(build_model("mlp", seed=0))       # DDP broadcasts rank 0's weights
    if args.hook:
        ncclavg.ddp.register(model, wire=args.wire)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                                  num_replicas=world, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if rank == args.slow_rank:
                time.sleep(args.slow_ms / 1e3)     # a slower rank: the others wait for it in the all-reduce
            loss.backward()
            opt.step()
        with torch.no_grad():
            acc = (model.module(data.x_test).argmax(1) == data.y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {acc:.3f}", flush=True)

    # every rank holds the same bytes (an error naming the rank and parameter that differ, on every rank)
    same = ncclavg.ddp.check_replicas(model, on_mismatch="warn") is None
    report = ncclavg.ddp.straggler_report() if args.backend == "ncclavg" else None
    if rank == 0 and report is not None:
        print(report.summary(), flush=True)
    if rank == 0:
        print(f"stock_ddp: test_accuracy={acc:.3f} backend={args.backend} world_size={world} "
              f"hook={'on' if args.hook else 'off'} replicas_identical={same} "
              f"transport={getattr(dist.group.WORLD, 'transport', args.backend)}", flush=True)
    dist.barrier()
    end_process(0 if same else 1)   # no teardown race at exit: Note [Gloo teardown] in ncclavg/comm/dist.py


if __name__ == "__main__":
    main()
