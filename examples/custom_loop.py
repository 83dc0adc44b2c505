"""A training loop of your own with ncclavg's building blocks: N CPU towers in one process, a
GradientAverager that averages their gradients bucket by bucket, and CPUAdamW (the fused SIMD AdamW) on
each tower. This is the classic multi-tower recipe written out by hand; TowerTrainer packages it.

    python examples/custom_loop.py --towers 2 --epochs 3
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

from ncclavg.averager import GradientAverager
from ncclavg.comm import Communicator
from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.models import build_model
from ncclavg.optim import CPUAdamW


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--towers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    T = args.towers

    data = load_digits()
    model = build_model("cnn", seed=0)
    towers = [model] + [copy.deepcopy(model) for _ in range(T - 1)]   # identical initial weights
    comm = Communicator.local(T)
    averager = GradientAverager(comm, towers)                          # grads now live in flat buckets
    optimizers = [CPUAdamW(t.parameters(), lr=args.lr, weight_decay=0.0) for t in towers]
    loader = TensorLoader(data.x_train, data.y_train, batch_size=args.batch_size, seed=0)
    print(f"{T} towers, {len(averager.plan.buckets)} bucket(s), {averager.plan.param_numel} parameters")

    for epoch in range(args.epochs):
        for x, y in loader:
            averager.zero_grad()
            # Split the batch; each tower weights its mean loss by n_t * T / B so that the equal-weight
            # average over towers is the gradient of the full-batch mean (uneven last batch included).
            for tower, xs, ys in zip(towers, torch.tensor_split(x, T), torch.tensor_split(y, T)):
                if len(ys):
                    loss = nn.functional.cross_entropy(tower(xs), ys)
                    (loss * (len(ys) * T / len(y))).backward()
            averager.average()           # every tower's .grad now holds the mean gradient
            for opt in optimizers:       # identical grads + identical weights -> identical updates
                opt.step()
        with torch.no_grad():
            acc = (towers[0](data.x_test).argmax(1) == data.y_test).float().mean().item()
        print(f"epoch {epoch + 1}: last loss {loss.item():.4f}, test accuracy {acc:.3f}")

    same = all(torch.equal(p, q) for t in towers[1:] for p, q in zip(towers[0].parameters(), t.parameters()))
    averager.close()
    comm.close()
    print(f"custom_loop: test_accuracy={acc:.3f} towers={T} replicas_identical={same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
