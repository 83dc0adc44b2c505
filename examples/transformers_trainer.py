"""Hugging Face transformers' `Trainer` on CPUs with the `ncclavg` backend, and ncclavg's DDP comm hook on
the model Trainer wraps. A tiny GPT-2 built from a config (no download) learns synthetic sequences.

Trainer refuses the backend by name both ways a user would ask for it (transformers 5.x, Accelerate 1.x):
`--ddp_backend ncclavg` is not among the CLI's choices (nccl, gloo, mpi, xccl, hccl, cncl, mccl), and
`TrainingArguments(ddp_backend="ncclavg", use_cpu=True)` fails in Accelerate, which on CPUs allows only gloo
or mpi ("Your assigned backend ncclavg is not available, please use gloo"). Both checks belong upstream.
What works: create the default group first; Trainer (through Accelerate) then uses it as it is:

    dist.init_process_group("ncclavg")
    args = TrainingArguments(..., use_cpu=True)        # and no ddp_backend

`use_cpu=True` is needed even on a CPU-only torch: without it Trainer reports ParallelMode.NOT_PARALLEL,
does not wrap the model in DDP, the replicas drift apart and the logged loss is the sum over the ranks
(gloo behaves the same). This script checks the parallel mode and refuses to go on without DDP.

    torchrun --nproc_per_node 2 examples/transformers_trainer.py [--hook] [--steps 30]
Needs `pip install "torch==<yours>" transformers accelerate` (the pin keeps your torch).
"""
from __future__ import annotations

import argparse
import datetime
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.training_args import ParallelMode

import ncclavg  # registers the "ncclavg" backend (an installed ncclavg also does it at `import torch`)

VOCAB, SEQ = 64, 32


class CountingSequences(torch.utils.data.Dataset):
    """Sequences that count up modulo VOCAB from a random start: a pattern a tiny model learns fast."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)   # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class NcclavgDDPHook(TrainerCallback):
    """Registers ncclavg.ddp's hook on the DDP model Trainer made. Trainer wraps the model inside train(),
    after its constructor, and calls on_train_begin after wrapping and before the first backward."""

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref
        self.registered_on = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer_ref().model_wrapped
        ncclavg.ddp.register(wrapped)
        self.registered_on = type(wrapped).__name__


def replicas_identical(model: torch.nn.Module) -> bool:
    """Every rank's parameters, gathered and compared bit for bit."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hook", action="store_true", help="register ncclavg.ddp's comm hook too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("ncclavg", timeout=datetime.timedelta(seconds=300))   # torchrun's env://
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, use_cpu=True, max_steps=args.steps, per_device_train_batch_size=8,
                                  learning_rate=3e-3, logging_steps=5, save_strategy="no", report_to="none",
                                  disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                  ddp_find_unused_parameters=False)
        if targs.parallel_mode != ParallelMode.DISTRIBUTED:
            raise SystemExit(f"Trainer sees {targs.parallel_mode}, not DISTRIBUTED: it would not wrap the model "
                             "in DDP and the replicas would drift (is use_cpu=True set?)")
        model = tiny_gpt2()
        trainer = Trainer(model=model, args=targs, train_dataset=CountingSequences(2048))
        hook = NcclavgDDPHook(lambda: trainer) if args.hook else None
        if hook:
            trainer.add_callback(hook)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = type(trainer.model_wrapped).__name__
    same = replicas_identical(model)
    if dist.get_rank() == 0:
        print(f"transformers_trainer: backend={dist.get_backend()} world_size={dist.get_world_size()} "
              f"wrapped={wrapped} hook={hook.registered_on if hook else 'off'} first_loss={losses[0]:.3f} "
              f"last_loss={losses[-1]:.3f} replicas_identical={same}", flush=True)
    dist.barrier()
    ncclavg.comm.end_process(0 if same else 1)   # Note [Gloo teardown] in ncclavg/comm/dist.py


if __name__ == "__main__":
    main()
