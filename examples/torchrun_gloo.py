"""One tower per process under torchrun, averaged over gloo (CPU) -- or NCCL when each process owns a
GPU. Every rank builds the same model from the same seed, takes its slice of every global batch, and
GradientAverager averages the gradients across ranks.

    torchrun --nproc_per_node 2 examples/torchrun_gloo.py --epochs 2
    (or: python -m torch.distributed.run --nproc_per_node 2 examples/torchrun_gloo.py)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from ncclavg.averager import GradientAverager
from ncclavg.comm import Communicator, end_process
from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.models import build_model
from ncclavg.optim import CPUAdamW
from ncclavg.train.towers import split_sizes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)                       # several processes share the machine's cores
    comm = Communicator.from_torch_distributed(device="cpu")   # initialises gloo from torchrun's env
    rank, world = comm.rank, comm.world_size
    data = load_digits()                           # the same split on every rank
    model = build_model("cnn", seed=0)             # the same initial weights on every rank
    averager = GradientAverager(comm, [model])     # checks that all ranks have the same layout
    opt = CPUAdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = TensorLoader(data.x_train, data.y_train, batch_size=args.batch_size, seed=0)  # same order

    for epoch in range(args.epochs):
        for x, y in loader:
            sizes = split_sizes(len(y), world)
            lo = sum(sizes[:rank])
            xs, ys = x[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]
            averager.zero_grad()
            if len(ys):                            # weight n_r * world / B: the mean is the full-batch grad
                loss = nn.functional.cross_entropy(model(xs), ys)
                (loss * (len(ys) * world / len(y))).backward()
            averager.average()
            opt.step()
        with torch.no_grad():
            acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {acc:.3f}", flush=True)

    # All ranks must hold bit-identical weights: compare a checksum of the parameters.
    digest = float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))
    digests = comm.allgather_object(digest)
    same = all(d == digests[0] for d in digests)
    if rank == 0:
        print(f"torchrun_gloo: test_accuracy={acc:.3f} world_size={world} replicas_identical={same}", flush=True)
    averager.close()
    comm.close()
    # No dist.destroy_process_group(), and no ordinary exit either: torch's gloo teardown now and then
    # aborts a process whose work is done. A barrier (every rank is past its last collective), then
    # end_process() flushes the output and leaves without teardown. See the README's "Ending a gloo run".
    dist.barrier()
    end_process(0 if same else 1)


if __name__ == "__main__":
    main()
