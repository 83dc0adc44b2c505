"""Ray Train on CPUs with the `ncclavg` backend: two workers, an MLP on synthetic data. Neither this
script nor its workers import ncclavg: Ray starts the workers itself and calls `init_process_group` there,
and an installed ncclavg registers the backend at every `import torch` (the `torch.backends` entry point).

    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2),
                 torch_config=TorchConfig(backend="ncclavg"))

With autoload off (NCCLAVG_AUTOLOAD=0) or an ncclavg older than the entry point, the workers fail with
"AssertionError: Unknown backend type ncclavg"; then name a module that imports ncclavg in
`ray.init(runtime_env={"worker_process_setup_hook": ...})`.

    python examples/ray_train.py [--workers 2] [--epochs 3]
Needs `pip install "torch==<yours>" "ray[train]"`.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

FEATURES, CLASSES = 16, 4


def synthetic_data(n: int, seed: int):
    """Gaussian blobs around fixed class centres: separable enough to train a small MLP in seconds."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234)) * 0.5
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[y] + torch.randn(n, FEATURES, generator=g), y


def train_loop(config: dict) -> dict:
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = synthetic_data(4096, seed=0)
    mine = torch.arange(rank, len(x), world)   # this worker's shard of the data
    losses = []
    for epoch in range(config["epochs"]):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        for batch in order.split(64):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    xt, yt = synthetic_data(1024, seed=1)
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    return {"backend": dist.get_backend(), "world_size": world, "wrapped": type(model).__name__,
                      "first_loss": losses[0], "last_loss": losses[-1], "test_accuracy": accuracy,
                      "replicas_identical": all(torch.equal(g, gathered[0]) for g in gathered)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args(argv)
    # Logical CPUs: one per worker and some for Ray's own actors, whatever this machine has.
    ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(train_loop, train_loop_config={"epochs": args.epochs},
                               scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
                               torch_config=TorchConfig(backend="ncclavg", timeout_s=300),
                               run_config=RunConfig(name="ncclavg-ray", storage_path=storage))
        m = trainer.fit().return_value   # what rank 0's train_loop returned (Ray Train 2.5x)
    ray.shutdown()
    print(f"ray_train: backend={m['backend']} world_size={m['world_size']} wrapped={m['wrapped']} "
          f"first_loss={m['first_loss']:.3f} last_loss={m['last_loss']:.3f} test_accuracy={m['test_accuracy']:.3f} "
          f"replicas_identical={m['replicas_identical']} autoload={os.environ.get('NCCLAVG_AUTOLOAD', '1')}",
          flush=True)
    return 0 if m["backend"] == "ncclavg" and m["replicas_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
