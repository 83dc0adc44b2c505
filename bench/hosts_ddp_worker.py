"""One rank of bench/hosts_ddp.py: stock DistributedDataParallel over the group of `--backend` (gloo or
ncclavg), an MLP of about `--params` parameters, torch.optim.AdamW(fused=True), synthetic data of this
rank; times `--steps` steps after `--warmup`, a barrier before them, and rank 0 writes the step times."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path


def mlp(params: int, inputs: int = 256, classes: int = 10):
    """Three hidden layers of one width w, about `params` parameters: inputs*w + 2*w*w + w*classes."""
    import math

    import torch.nn as nn

    a, b = 2.0, inputs + classes + 3
    w = max(8, int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)))
    return nn.Sequential(nn.Linear(inputs, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                         nn.Linear(w, classes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("gloo", "ncclavg"), required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    if args.backend == "ncclavg":
        import ncclavg  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(mlp(args.params))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    per = max(1, args.batch // world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(per, 256, generator=g), torch.randint(0, 10, (per,), generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    slowest = [0.0] * world
    every = [None] * world
    dist.all_gather_object(every, times)
    slowest = [max(ts) for ts in zip(*every)]   # a step ends when its slowest rank's does
    transport = getattr(dist.group.WORLD, "transport", "gloo")
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        Path(args.result).write_text(json.dumps({"backend": args.backend, "params": n, "world": world,
                                                 "batch": per * world, "step_s": slowest, "transport": transport}))
    dist.barrier()
    from ncclavg.comm import end_process   # Note [Gloo teardown] in ncclavg/comm/dist.py

    end_process(0)


if __name__ == "__main__":
    main()
