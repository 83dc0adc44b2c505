"""DeepSpeed on CPUs with the `ncclavg` backend, ZeRO stage 0, 1, 2 or 3, the digits MLP.

    deepspeed.init_distributed(dist_backend="ncclavg")      # passed through to torch.distributed
    engine, *_ = deepspeed.initialize(model=model, optimizer=client_optimizer, config=config)

DeepSpeed's CPU accelerator needs nothing more. Install it with `DS_BUILD_OPS=0 pip install "torch==<yours>"
deepspeed` (nothing compiled at install time); at start it JIT-compiles one small op of its own (a
shared-memory op for inference, cached under ~/.cache/torch_extensions). A config that names
`"optimizer": {"type": "AdamW"}` makes it JIT-compile its CPU fused Adam too (minutes), so this script
passes a client optimizer instead: torch.optim.AdamW, or with `--optimizer ncclavg` ncclavg.optim.CPUAdamW
(the fp32 master weights stepped by ncclavg's SIMD AdamW; ZeRO-1 and 2 hand it their flat fp32 partition
as its one parameter, ZeRO-3 its flat partitions).

    torchrun --nproc_per_node 2 examples/deepspeed_zero.py --stage 2 [--optimizer ncclavg] [--epochs 2]
    (or: deepspeed --num_gpus 2 examples/deepspeed_zero.py --stage 2, where a launcher sees devices)
"""
from __future__ import annotations

import argparse
import datetime

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import ncclavg  # registers the "ncclavg" backend (an installed ncclavg also does it at `import torch`)
from ncclavg.train.data import load_digits
from ncclavg.train.models import build_model


def client_optimizer(name: str, params, lr: float):
    if name == "ncclavg":
        return ncclavg.optim.CPUAdamW(params, lr=lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def full_parameters(engine) -> torch.Tensor:
    """This rank's copy of every parameter, flat (ZeRO-3 holds a shard only: gather it first)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().reshape(-1).double() for p in params]).clone()


def replicas_identical(flat: torch.Tensor) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    ap.add_argument("--optimizer", choices=("torch", "ncclavg"), default="torch")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="ncclavg", timeout=datetime.timedelta(seconds=300))
    data = load_digits()
    model = build_model("mlp", seed=0)
    config = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if args.optimizer == "ncclavg":
        # ZeRO refuses any optimizer outside its list (deepspeed/runtime/zero/utils.py,
        # ZERO_SUPPORTED_OPTIMIZERS: torch's Adam/AdamW/Adagrad and DeepSpeed's own) unless told otherwise.
        config["zero_allow_untested_optimizer"] = True
    opt = client_optimizer(args.optimizer, model.parameters(), lr=3e-3)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                                  shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=32, sampler=sampler)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    flat = full_parameters(engine)
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                                             enabled=args.stage == 3):
        accuracy = (engine.module(data.x_test).argmax(1) == data.y_test).float().mean().item()
    same = replicas_identical(flat)
    if dist.get_rank() == 0:
        print(f"deepspeed_zero: stage={args.stage} optimizer={type(engine.optimizer).__name__}"
              f"/{type(opt.optimizer if hasattr(opt, 'optimizer') else opt).__name__} test_accuracy={accuracy:.3f} "
              f"first_loss={losses[0]:.3f} last_loss={losses[-1]:.3f} backend={dist.get_backend()} "
              f"world_size={dist.get_world_size()} replicas_identical={same}", flush=True)
    dist.barrier()
    ncclavg.comm.end_process(0 if same else 1)   # Note [Gloo teardown] in ncclavg/comm/dist.py


if __name__ == "__main__":
    main()
