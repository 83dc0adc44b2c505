"""The arguments of TowerTrainer (trainer.py), checked before anything is touched: a bad one raises a
ValueError / TypeError naming it and leaves the model as it was."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from .amp import normalise_amp
from .engines import OptimConfig
from .schedules import LRSchedule, ScheduleSpec, make_schedule, schedule_name
from .towers import default_devices, parse_devices, tower_threads, trainable_parameters

OPTIMIZERS = ("adamw", "adam", "sgd")
MASTERS = ("cpu", "device")
NONFINITE_POLICIES = ("skip", "raise", "ignore")


def _number(value: Any, name: str, *, minimum: float = 0.0, strict: bool = False, none_ok: bool = False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name}: must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


@dataclass
class TrainerArgs:
    """TowerTrainer's arguments once checked (their meaning: TowerTrainer's docstring)."""
    names: list
    devices: list
    optimizer: str
    lr: float
    lr_schedule: ScheduleSpec
    schedule: Optional[LRSchedule]   # an explicit schedule, made; a named one is planned by fit()
    weight_decay: float
    momentum: float
    nesterov: bool
    grad_clip: Optional[float]
    amp: Optional[str]
    master: str
    bucket_cap_mb: float
    first_bucket_mb: float
    seed: int
    betas: tuple
    eps: float
    loss_fn: Optional[Callable]
    concurrent: bool
    overlap: bool
    init_loss_scale: float
    on_nonfinite: str
    replan_schedule: bool
    shard_master: bool
    threads: Optional[int]
    replica_check_every: int
    on_replica_mismatch: str

    def optim(self) -> OptimConfig:
        return OptimConfig(self.optimizer, self.lr, self.weight_decay, self.momentum, self.nesterov, self.betas,
                           self.eps)

    def config(self) -> dict:
        """The training's choices as a checkpoint keeps them (not the run's own: shard_master, replan)."""
        return {"devices": [str(d) for d in self.devices], "optimizer": self.optimizer, "lr": self.lr,
                "weight_decay": self.weight_decay, "momentum": self.momentum, "nesterov": self.nesterov,
                "grad_clip": self.grad_clip, "amp": self.amp, "master": self.master,
                "bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb, "seed": self.seed,
                "betas": self.betas, "eps": self.eps, "concurrent": self.concurrent, "overlap": self.overlap,
                "init_loss_scale": self.init_loss_scale, "on_nonfinite": self.on_nonfinite}


def check_trainer_args(model: nn.Module, devices: Any, optimizer: str, lr: float, lr_schedule: ScheduleSpec,
                       weight_decay: float, momentum: float, nesterov: bool, grad_clip: Optional[float],
                       amp: Optional[str], master: Optional[str], bucket_cap_mb: float, seed: int,
                       betas: Sequence[float], eps: float, first_bucket_mb: float, loss_fn: Optional[Callable],
                       concurrent: bool, overlap: bool, init_loss_scale: float, on_nonfinite: str,
                       replan_schedule: bool, shard_master: bool, threads: Optional[int],
                       replica_check_every: int = 100, on_replica_mismatch: str = "raise") -> TrainerArgs:
    """TowerTrainer's arguments checked, in the order of its signature's meaning; raises naming the first
    bad one."""
    names = _check_model(model)
    devs = default_devices() if devices is None else parse_devices(devices)
    tower_threads(devs, threads)   # checked here, applied once everything is: Note [Threads of CPU towers]
    optimizer, lr, weight_decay, momentum, betas, eps = _check_optimizer(optimizer, lr, weight_decay, momentum,
                                                                         nesterov, betas, eps)
    grad_clip = _number(grad_clip, "grad_clip", strict=True, none_ok=True)
    amp = normalise_amp(amp)
    master = "cpu" if master is None else master
    if master not in MASTERS:
        raise ValueError(f"master: must be 'cpu' or 'device', got {master!r}")
    bucket_cap_mb = _number(bucket_cap_mb, "bucket_cap_mb", strict=True)
    first_bucket_mb = _number(first_bucket_mb, "first_bucket_mb", strict=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: must be an integer, got {seed!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (output, target) -> scalar, got {type(loss_fn).__name__}")
    # A named schedule is planned by fit() from the run's length: see Note [Schedules over a resumed run].
    schedule = None if isinstance(lr_schedule, str) else make_schedule(lr_schedule, lr)
    if isinstance(lr_schedule, str):
        schedule_name(lr_schedule)   # an unknown name fails here, before the model is touched
    _check_bool(replan_schedule, "replan_schedule")
    _check_placement(devs, master, shard_master)
    init_loss_scale = _number(init_loss_scale, "init_loss_scale", strict=True)
    if not isinstance(on_nonfinite, str) or on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite: must be one of {', '.join(map(repr, NONFINITE_POLICIES))}, got "
                         f"{on_nonfinite!r}")
    if isinstance(replica_check_every, bool) or not isinstance(replica_check_every, int) or replica_check_every < 0:
        raise ValueError(f"replica_check_every: must be an integer >= 0 (0: never), got {replica_check_every!r}")
    if on_replica_mismatch not in ("raise", "warn"):
        raise ValueError(f"on_replica_mismatch: must be 'raise' or 'warn', got {on_replica_mismatch!r}")
    return TrainerArgs(names, devs, optimizer, lr, lr_schedule, schedule, weight_decay, momentum, bool(nesterov),
                       grad_clip, amp, master, bucket_cap_mb, first_bucket_mb, seed, betas, eps, loss_fn,
                       bool(concurrent), bool(overlap), float(init_loss_scale), on_nonfinite, replan_schedule,
                       shard_master, threads, replica_check_every, on_replica_mismatch)


def _check_model(model: Any) -> List[str]:
    """The names of the model's trainable parameters; a model with none is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    names, params = trainable_parameters(model)
    if not params:
        raise ValueError(f"model: {type(model).__name__} has no trainable parameters (none with "
                         "requires_grad=True); there is nothing to train")
    return names


def _check_optimizer(optimizer: Any, lr: Any, weight_decay: Any, momentum: Any, nesterov: Any, betas: Any,
                     eps: Any) -> tuple:
    """The optimizer's name and hyperparameters checked: (optimizer, lr, weight_decay, momentum, betas, eps)."""
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZERS:
        raise ValueError(f"optimizer: must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    optimizer = optimizer.lower()
    lr = _number(lr, "lr", strict=True)
    weight_decay = _number(weight_decay, "weight_decay")
    momentum = _number(momentum, "momentum")
    if momentum >= 1.0:
        raise ValueError(f"momentum: must be < 1, got {momentum}")
    if nesterov and (optimizer != "sgd" or momentum == 0.0):
        raise ValueError("nesterov: needs optimizer='sgd' with momentum > 0")
    try:
        betas = tuple(float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas: need two numbers in [0, 1), got {betas!r}") from None
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas: need two numbers in [0, 1), got {betas!r}")
    eps = _number(eps, "eps", strict=True)
    return optimizer, lr, weight_decay, momentum, betas, eps


def _check_bool(value: Any, argname: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{argname}: expected a bool, got {type(value).__name__}")


def _check_placement(devs: List[torch.device], master: str, shard_master: Any) -> None:
    """Where the master weights live fits the towers' devices, and a CUDA tower has a CUDA build."""
    _check_bool(shard_master, "shard_master")
    if shard_master and (master != "cpu" or devs[0].type != "cpu"):
        raise ValueError("shard_master: shards the CPU master weights of CPU towers over the processes; it "
                         f"needs master='cpu' and CPU towers (got master={master!r}, devices {devs[0].type})")
    if devs[0].type == "cuda":
        from .._ext import cuda_built

        if not cuda_built():
            raise ValueError(f"devices: {devs[0]} needs ncclavg's CUDA build, and this ncclavg has none "
                             "(built CPU-only; rebuild with NCCLAVG_CUDA=1, see docs/building.md)")
