"""PyTorch Lightning on CPUs with the `ncclavg` backend: `DDPStrategy(process_group_backend="ncclavg")`,
and ncclavg's DDP comm hook registered by a callback (Lightning itself registers DDP comm hooks only when
the root device is CUDA, so `DDPStrategy(ddp_comm_hook=...)` does nothing on CPUs).

    torchrun --nproc_per_node 2 examples/lightning_ddp.py --epochs 2 [--hook]
    (or plainly: python examples/lightning_ddp.py --devices 2: Lightning starts the other processes)
Needs `pip install pytorch-lightning` (with your torch already installed).
"""
from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import ncclavg  # registers the "ncclavg" torch.distributed backend
from ncclavg.train.data import load_digits
from ncclavg.train.models import build_model

try:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
except ImportError:   # the unified `lightning` package
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy


class Digits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model("mlp", seed=0)

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class NcclavgDDPHook(pl.Callback):
    """Registers ncclavg.ddp's hook on the DDP model once Lightning has wrapped it (before any backward)."""

    def __init__(self, wire=None):
        self.wire = wire

    def on_fit_start(self, trainer, pl_module):
        ncclavg.ddp.register(trainer.strategy.model, wire=self.wire)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    ap.add_argument("--hook", action="store_true", help="register ncclavg.ddp's comm hook too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = load_digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train), batch_size=64,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                         strategy=DDPStrategy(process_group_backend="ncclavg"),
                         callbacks=[NcclavgDDPHook()] if args.hook else [], enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False)
    module = Digits()
    trainer.fit(module, loader)
    import torch.distributed as dist

    backend = dist.get_backend()
    with torch.no_grad():
        acc = (module.model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    digest = torch.tensor([sum(float(p.detach().double().sum()) * (i + 1) for i, p in enumerate(module.parameters()))],
                          dtype=torch.float64)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(digests, digest)
    same = all(torch.equal(d, digests[0]) for d in digests)
    if trainer.global_rank == 0:
        print(f"lightning_ddp: test_accuracy={acc:.3f} backend={backend} world_size={dist.get_world_size()} "
              f"hook={'on' if args.hook else 'off'} replicas_identical={same}", flush=True)
    dist.barrier()
    ncclavg.comm.end_process(0 if same else 1)   # Note [Gloo teardown] in ncclavg/comm/dist.py


if __name__ == "__main__":
    main()
