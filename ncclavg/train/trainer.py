"""TowerTrainer: one model replica ("tower") per device in one process, every batch split across them,
gradients averaged through ncclavg, fp32 master weights updated on the CPU (or on each device).

Note [Uneven batches]
Towers average their gradients with equal weight, but a batch of B samples split over T towers gives
tower t n_t samples, and the last batch of an epoch rarely divides evenly. Tower t therefore scales its
loss (the mean over its n_t samples) by w_t = n_t * T / B before backward. Its gradient becomes
(T / B) * sum of its per-sample gradients, and the equal-weight mean over towers is (1 / B) * sum over all
B samples: exactly the gradient of the full-batch mean loss. A tower with no sample (a final batch
smaller than T) contributes a zero gradient and still takes part in the average. This holds for losses
that are means over samples (loss_fn's `reduction="mean"`); models whose output for one sample depends
on the other samples of the batch (batch norm in training mode) see per-tower statistics instead.

Note [Schedules over a resumed run]
A schedule given by name ("cosine", "exponential") is planned by fit() from the run's length: cosine
warms up over 5% of epochs x batches-per-epoch steps and decays to 0 at the end, exponential multiplies
the rate by 0.9 once per epoch. The plan is saved with every checkpoint. When a later fit() asks for
another length (a run resumed with more epochs, or fit() called again with a larger `epochs`), the
schedule is planned again over the new total, from the step reached: the cosine now ends at the new
last step, the step counter is unchanged and the warm-up keeps its length, so the steps already taken
are not warmed up again (schedules.replan). An exponential decays per epoch whatever the number of
epochs, so only a new epoch length changes it. Without this a cosine planned over 5 epochs
runs epochs 6 and 7 at lr = 0 and nothing moves. A new peak `lr` given on resume is planned in the same
way. `replan_schedule=False` (`ncclavg train --keep-schedule`) keeps the saved plan; fit() then says
where it runs past the schedule's end. A schedule given explicitly (a dict or an LRSchedule) is never
planned again: its length is the user's. Resuming with the run's own length changes nothing, so an
interrupted run that is resumed stays bit-identical to an uninterrupted one. Each decision is logged
and kept in `trainer.schedule_note` (the CLI prints it in the run header).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from . import checkpoint as ckpt
from .amp import DynamicLossScale, autocast_context, normalise_amp
from .callbacks import Callback
from .distributed import processes_communicator, write_once
from .engines import CpuMasterEngine, DeviceMasterEngine, OptimConfig
from .metrics import PHASES, StepTimes
from .schedules import LRSchedule, ScheduleSpec, from_state_dict, make_schedule, replan, schedule_name
from .towers import (TowerRunner, build_towers, default_devices, model_signature, parse_devices,
                     split_sizes, trainable_parameters, unpack_batch)
from .state import (CHECKPOINT_FORMAT, CHECKPOINT_KIND, check_signature, extra_tensors,
                            load_extra_tensors, rng_state, seed_everything, set_rng_state)

OPTIMIZERS = ("adamw", "adam", "sgd")
MASTERS = ("cpu", "device")
NONFINITE_POLICIES = ("skip", "raise", "ignore")

log = logging.getLogger(__name__)


def _number(value: Any, name: str, *, minimum: float = 0.0, strict: bool = False, none_ok: bool = False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name}: must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


def _accuracy_counts(out: Any, y: Any) -> torch.Tensor | None:
    """Correct predictions for class-index targets and [N, C] logits; None for other tasks."""
    if not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None
    if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point() and out.shape[0] == y.shape[0]:
        return (out.argmax(dim=1) == y).sum()
    return None


class TowerTrainer:
    """Data-parallel training over towers: this process's `devices`, and under torchrun (or given `comm`)
    the towers of every process; see Note [Towers of several processes] in distributed.py. `timeout`
    (seconds, default NCCLAVG_TIMEOUT or 600) bounds every wait on another process. See the module
    docstring and docs/architecture.md."""

    def __init__(self, model: nn.Module, devices: Sequence[Any] | str | None = None, optimizer: str = "adamw",
                 lr: float = 1e-3, lr_schedule: ScheduleSpec = None, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = False, grad_clip: float | None = None,
                 amp: str | None = None, master: str | None = None, bucket_cap_mb: float = 25.0,
                 seed: int = 0, *, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 first_bucket_mb: float = 1.0, loss_fn: Callable | None = None, concurrent: bool = True,
                 overlap: bool = True, init_loss_scale: float = 2.0 ** 16, on_nonfinite: str = "skip",
                 replan_schedule: bool = True, comm: Any = None, timeout: float | None = None,
                 shard_master: bool = False):
        # Validate everything before touching the model: a bad argument leaves it as it was.
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        names, params = trainable_parameters(model)
        if not params:
            raise ValueError(f"model: {type(model).__name__} has no trainable parameters (none with "
                             "requires_grad=True); there is nothing to train")
        devs = default_devices() if devices is None else parse_devices(devices)
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
        if not isinstance(replan_schedule, bool):
            raise TypeError(f"replan_schedule: expected a bool, got {type(replan_schedule).__name__}")
        if not isinstance(shard_master, bool):
            raise TypeError(f"shard_master: expected a bool, got {type(shard_master).__name__}")
        if shard_master and (master != "cpu" or devs[0].type != "cpu"):
            raise ValueError("shard_master: shards the CPU master weights of CPU towers over the processes; it "
                             f"needs master='cpu' and CPU towers (got master={master!r}, devices {devs[0].type})")
        if devs[0].type == "cuda":
            from .._ext import cuda_built

            if not cuda_built():
                raise ValueError(f"devices: {devs[0]} needs ncclavg built with CUDA (NCCLAVG_CUDA=1); this "
                                 "build is CPU only")

        # See Note [Towers of several processes]; building it is a collective when there are several.
        process_comm = processes_communicator(comm, devs, timeout)
        init_loss_scale = _number(init_loss_scale, "init_loss_scale", strict=True)
        if not isinstance(on_nonfinite, str) or on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite: must be one of {', '.join(map(repr, NONFINITE_POLICIES))}, got "
                             f"{on_nonfinite!r}")
        scaler = DynamicLossScale(init_scale=init_loss_scale) if amp == "fp16" else None

        self.devices = devs
        self.comm = process_comm   # None: this process's towers are all the towers
        self.processes = process_comm.world_size if process_comm is not None else 1
        self.rank = process_comm.rank if process_comm is not None else 0
        self.total_towers = process_comm.size if process_comm is not None else len(devs)
        self.tower_offset = getattr(process_comm, "tower_offset", 0) if process_comm is not None else 0
        self.loss_fn = loss_fn if loss_fn is not None else nn.functional.cross_entropy
        self.amp = amp
        self.master = master
        self.grad_clip = grad_clip
        self.schedule: LRSchedule | None = schedule
        self._schedule_spec = lr_schedule
        # {"total_steps", "steps_per_epoch"} the named schedule was planned for; None for an explicit one
        self._schedule_plan: dict | None = None
        self._planned_for: tuple | None = None   # the (steps_per_epoch, epochs, max_steps) last planned for
        self.schedule_note: str | None = None
        self.config = {"devices": [str(d) for d in devs], "optimizer": optimizer, "lr": lr,
                       "weight_decay": weight_decay, "momentum": momentum, "nesterov": bool(nesterov),
                       "grad_clip": grad_clip, "amp": amp, "master": master, "bucket_cap_mb": bucket_cap_mb,
                       "first_bucket_mb": first_bucket_mb, "seed": seed, "betas": betas, "eps": eps,
                       "concurrent": bool(concurrent), "overlap": bool(overlap),
                       "init_loss_scale": float(init_loss_scale), "on_nonfinite": on_nonfinite}
        # Choices of this run's, not of the training: not saved with the checkpoint (a sharded run resumes
        # unsharded and the other way round: Note [Sharded CPU master]).
        self.replan_schedule = replan_schedule
        self.shard_master = shard_master and self.processes > 1
        if shard_master and self.processes == 1:
            log.info("shard_master: one process, nothing to shard; the master weights stay whole")
        self.on_nonfinite = on_nonfinite
        self.nonfinite_steps = 0   # steps skipped for an inf/NaN gradient (fp16 overflows included)
        opt = OptimConfig(optimizer, lr, weight_decay, momentum, bool(nesterov), betas, eps)

        seed_everything(seed, devs)
        if self.processes > 1:   # every process starts from rank 0's weights and buffers
            self.comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self.towers = build_towers(model, devs)
        self.names = names
        self.tower_params = [trainable_parameters(t)[1] for t in self.towers]
        self.engine = self._make_engine(opt, bucket_cap_mb, first_bucket_mb, overlap)
        self.plan = self.engine.plan
        self.runner = TowerRunner(len(devs), concurrent=concurrent)
        # Note [Tower streams]: each GPU tower works on its device's CURRENT stream, from its own thread.
        # Towers on different GPUs thus run concurrently, and every collective (launched by the averager's
        # backward hooks from whichever tower thread completes a bucket, or by the engines from the main
        # thread) is ordered after the towers' work: the NCCL communicator waits for each device's current
        # stream, which is thread-independent unless a caller switches streams. Private per-tower streams
        # would break that (a hook running in tower 1's thread sees the default stream of tower 0's device).
        self.streams = None
        self.scaler = scaler
        self.signature = model_signature(self.towers[0])

        self.step = 0            # optimizer steps taken (one per batch, skipped fp16 steps included)
        self.epoch = 0           # epochs completed
        self.history: list[dict] = []
        self.stop_training = False
        self.target_epochs: int | None = None
        self.last_fit: dict = {}
        self._loader: Any = None
        self._data_state: dict | None = None
        self._epoch_acc = self._new_epoch_acc()

    # ------------------------------------------------------------------ construction helpers
    def _make_engine(self, opt: OptimConfig, bucket_cap_mb: float, first_bucket_mb: float, overlap: bool):
        check = self.on_nonfinite != "ignore"   # See Note [Non-finite gradients]
        if self.master == "device":
            return DeviceMasterEngine(self.tower_params, self.names, self.devices, opt, bucket_cap_mb,
                                      first_bucket_mb, overlap=overlap, check_finite=check, comm=self.comm)
        if self.shard_master:
            from .sharded import ShardedCpuMasterEngine  # See Note [Sharded CPU master]

            return ShardedCpuMasterEngine(self.tower_params, self.names, self.devices, opt, bucket_cap_mb,
                                          first_bucket_mb, comm=self.comm, skip_nonfinite=check or self.amp == "fp16")
        if self.devices[0].type == "cpu":
            return CpuMasterEngine(self.tower_params, self.names, self.devices, opt, bucket_cap_mb,
                                   first_bucket_mb, skip_nonfinite=check or self.amp == "fp16", comm=self.comm,
                                   overlap=overlap)
        from .offload import GpuOffloadEngine  # see Note [Pipelined CPU master] there

        return GpuOffloadEngine(self.tower_params, self.names, self.devices, opt, bucket_cap_mb,
                                first_bucket_mb, check_finite=check, comm=self.comm)

    @property
    def model(self) -> nn.Module:
        """Tower 0: the model you passed in, holding the current weights."""
        return self.towers[0]

    @property
    def num_towers(self) -> int:
        """This process's towers (`total_towers` counts those of every process)."""
        return len(self.devices)

    @property
    def is_main(self) -> bool:
        """True in the process that prints and writes files (rank 0; the only process when alone)."""
        return self.rank == 0

    def describe(self) -> dict:
        return {"towers": self.total_towers, "local_towers": self.num_towers, "processes": self.processes,
                "shard_master": self.shard_master,
                "devices": [str(d) for d in self.devices], "master": self.master,
                "optimizer": self.config["optimizer"], "amp": self.amp, "params": self.plan.param_numel,
                "buckets": len(self.plan.buckets), "bucket_bytes": self.plan.total_bytes,
                "concurrent": self.runner.concurrent,
                # between the processes: "shm", "shm+gloo", "gloo" or "nccl"; None with one process
                "transport": getattr(self.comm, "transport", self.comm.backend) if self.comm is not None else None}

    def _ensure_schedule(self, total_steps: int | None, steps_per_epoch: int | None) -> LRSchedule:
        if self.schedule is None:
            self.schedule = make_schedule(self._schedule_spec, self.config["lr"], total_steps, steps_per_epoch)
            if isinstance(self._schedule_spec, str):
                self._schedule_plan = {"total_steps": total_steps, "steps_per_epoch": steps_per_epoch}
        return self.schedule

    def plan_schedule(self, steps_per_epoch: int | None, epochs: int | None, max_steps: int | None = None,
                      *, log_note: bool = True) -> str | None:
        """Fixes the learning-rate schedule for a run of `epochs` epochs in total of `steps_per_epoch`
        steps (or of `max_steps` steps when the epoch length is unknown); fit() calls it. Returns, and
        keeps in `schedule_note`, a line saying what changed for this run (None when nothing did), also
        logged unless log_note=False (a caller that prints it itself). Asking again for the same run
        decides nothing new. See Note [Schedules over a resumed run]."""
        total = steps_per_epoch * epochs if steps_per_epoch and epochs else max_steps
        if (steps_per_epoch, epochs, max_steps) == self._planned_for:
            return None
        self._planned_for = (steps_per_epoch, epochs, max_steps)
        if self.schedule is None:
            self._ensure_schedule(total, steps_per_epoch)
            return None
        old, plan, lr = self.schedule, self._schedule_plan, self.config["lr"]
        wanted = {"total_steps": total, "steps_per_epoch": steps_per_epoch}
        if plan is not None and (plan != wanted or getattr(old, "lr", lr) != lr) and self.replan_schedule:
            new = replan(old, lr, total, steps_per_epoch)
            self._schedule_plan = wanted
            if new != old:
                self.schedule = new
                note = (f"lr schedule re-planned for {_run_length(wanted)} (was {_run_length(plan)}): {new!r}; "
                        f"lr at step {self.step}: {old(self.step):.4g} -> {new(self.step):.4g}")
                return self._note(note, logging.INFO if log_note else None)
            return None
        end = getattr(old, "total_steps", None)
        if total and end is not None and total > end:
            why = ("kept as saved: replan_schedule=False, --keep-schedule" if plan is not None else
                   "given explicitly: never re-planned")
            return self._note(f"lr schedule {old!r} ends at step {end}, this run goes on to step {total}: the "
                              f"steps after {end} run at lr {old(end):.4g} ({why})",
                              logging.WARNING if log_note else None)
        return None

    def _note(self, note: str, level: int | None) -> str:
        self.schedule_note = note
        if level is not None:
            log.log(level, note)
        return note

    def current_lr(self) -> float:
        return self._ensure_schedule(None, None)(self.step)

    # ------------------------------------------------------------------ one step
    def _device_ctx(self, t: int) -> Any:
        if self.devices[t].type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.devices[t])  # See Note [Tower streams]

    def _tower_bounds(self, total: int) -> list[int]:
        """[lo_0, ..., lo_T]: this process's towers' sample ranges in a batch of `total`, split over the
        towers of every process by global tower index (process-major). See Note [Towers of several
        processes]."""
        sizes = split_sizes(total, self.total_towers)
        first = sum(sizes[:self.tower_offset])
        bounds = [first]
        for g in range(self.tower_offset, self.tower_offset + self.num_towers):
            bounds.append(bounds[-1] + sizes[g])
        return bounds

    def _sum_results(self, live: list) -> Callable[[], tuple[float, int | None]]:
        """A function returning (loss sum, correct predictions or None) over the towers of every process.
        With several processes the exchange starts here and is finished by the call: started before the
        engine's step where that step issues its collectives in a fixed order after compute (the CPU
        master engines), it overlaps the step instead of adding a round trip after it."""
        loss_sum = sum(float(r[0]) for r in live)
        correct = None if any(r[1] is None for r in live) else sum(int(r[1]) for r in live)
        if self.processes == 1:
            return lambda: (loss_sum, correct)
        # a process without accuracy counts (a task without class targets) turns accuracy off everywhere
        pending = self.comm.sum_over_processes_async([loss_sum, correct or 0, 1.0 if correct is None else 0.0])

        def finish() -> tuple[float, int | None]:
            total, correct_sum, no_acc = pending()
            return total, None if no_acc else int(round(correct_sum))

        return finish

    def _slice_to(self, t: int, tensors: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
        dev = self.devices[t]
        return [x[lo:hi].to(dev, non_blocking=True) for x in tensors]

    def _tower_train(self, t: int, inputs: tuple, target: torch.Tensor, lo: int, hi: int, total: int,
                     loss_scale: float | None):
        n = hi - lo
        if n == 0:
            return None
        with self._device_ctx(t):
            xs = self._slice_to(t, inputs, lo, hi)
            (y,) = self._slice_to(t, (target,), lo, hi)
            with autocast_context(self.amp, self.devices[t]):
                out = self.towers[t](*xs)
                loss = self.loss_fn(out, y)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn: must return a scalar tensor (the mean loss over the samples)")
            weight = n * self.total_towers / total  # See Note [Uneven batches]
            if loss_scale is not None:
                weight *= loss_scale
            (loss.float() * weight).backward()
            with torch.no_grad():
                correct = _accuracy_counts(out, y)
            return loss.detach().float() * n, correct, n

    def train_step(self, batch: Any, *, _allow_idle_towers: bool = False) -> dict:
        """One optimizer step on `batch` = (inputs..., target), split across the towers. Returns the
        step's record (loss, accuracy, lr, samples/s, time per phase)."""
        inputs, target = unpack_batch(batch)
        total = int(target.shape[0])
        if total == 0:
            raise ValueError("batch: is empty")
        if total < self.total_towers and not _allow_idle_towers:
            raise ValueError(f"batch: has {total} samples, fewer than the {self.total_towers} towers; use a "
                             f"batch size of at least {self.total_towers}")
        bounds = self._tower_bounds(total)
        lr = self.current_lr()
        loss_scale = self.scaler.scale if self.scaler is not None else None
        for tower in self.towers:
            tower.train()
        times = StepTimes()
        t0 = time.perf_counter()
        self.engine.zero_grad()
        self.engine.before_compute(self.streams)
        with times.phase("compute"):
            results = self.runner.map(lambda t: self._tower_train(t, inputs, target, bounds[t], bounds[t + 1],
                                                                 total, loss_scale))
        self.engine.after_compute(self.streams)
        live = [r for r in results if r is not None]
        # A GradientAverager may still launch buckets in step(): no exchange of ours before they are all
        # out. An engine that can finish its reduction first (reduce_now) lets the exchange overlap its
        # update instead.
        reduce_now = getattr(self.engine, "reduce_now", None)
        reduced = bool(reduce_now is not None and reduce_now(times))
        in_backward = getattr(self.engine, "collectives_in_backward", False)
        stats = self._sum_results(live) if reduced or not in_backward else None
        info = self.engine.step(lr, loss_scale, self.grad_clip, times)
        if self.processes > 1 and self.comm.debug:
            self._check_replicas_agree()
        if info["skipped"]:
            self._nonfinite_step(info, results, loss_scale)
        if self.scaler is not None:
            self.scaler.update(bool(info["skipped"]))
        self.step += 1
        loss_sum, correct = (stats or self._sum_results(live))()
        loss = loss_sum / total
        step_s = time.perf_counter() - t0
        record = {"step": self.step, "epoch": self.epoch + 1, "loss": loss,
                  "accuracy": None if correct is None else correct / total, "lr": lr, "samples": total,
                  "step_s": step_s, "samples_per_s": total / step_s if step_s > 0 else None,
                  "skipped": bool(info["skipped"]), "grad_norm": info.get("grad_norm"),
                  **({"nonfinite": [list(x) for x in info.get("nonfinite", [])]} if info["skipped"] else {}),
                  **({"loss_scale": loss_scale} if loss_scale is not None else {}), **times.as_dict()}
        acc = self._epoch_acc
        acc["loss_sum"] += loss * total
        acc["samples"] += total
        acc["correct"] = None if correct is None or acc["correct"] is None else acc["correct"] + correct
        acc["train_s"] += step_s
        for k in PHASES:
            acc["t_" + k] += times.times[k]
        return record

    def _check_replicas_agree(self) -> None:
        """NCCLAVG_DEBUG=1 with several processes: after every step, tower 0 of every process must hold
        bit for bit the same weights (Note [Towers of several processes]); a fingerprint of them is
        compared across the processes, and a difference raises CollectiveMismatchError naming the ranks."""
        import hashlib

        from ..errors import CollectiveMismatchError

        h = hashlib.blake2b(digest_size=16)
        for p in self.tower_params[0]:
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        prints = self.comm.allgather_object(h.hexdigest())
        if len(set(prints)) > 1:
            groups: dict = {}
            for r, fp in enumerate(prints):
                groups.setdefault(fp, []).append(r)
            raise CollectiveMismatchError(
                f"step {self.step + 1}: the processes' weights differ after the update (NCCLAVG_DEBUG=1): ranks "
                + "; ".join(", ".join(map(str, rs)) for rs in groups.values()) + " agree among themselves only")

    def _nonfinite_step(self, info: dict, results: list, loss_scale: float | None) -> None:
        """A step the engine skipped for an inf/NaN gradient: count it, log where it came from, or raise.

        Note [Non-finite gradients]
        Every engine checks the gradients before it writes anything: the CPU master's fused step on the
        towers' own buckets (a read-only first pass), master="device" on each tower's buckets before they
        are averaged (GradientAverager(check_finite=True): after the in-place average every tower holds
        the same non-finite mean), the GPU offload pipeline on the reduced shards before the update
        starts. A skipped step changes no weight, moment or step count; the trainer's step counter and
        the schedule still advance (as with torch's GradScaler). With amp="fp16" an overflow is part of
        dynamic loss scaling (the scale halves); on_nonfinite="raise" raises only once the scale is at
        its minimum, where an inf/NaN can no longer be an overflow of the scaled loss.
        on_nonfinite="ignore" turns the check off (an inf/NaN then reaches the weights, as with
        torch.optim): it saves one read pass over the gradients per step (about +20% on the fused CPU
        optimizer step alone); fp16 keeps its overflow check.
        """
        self.nonfinite_steps += 1
        where = info.get("nonfinite") or []
        parts = [f"tower {t} bucket {b}" if t is not None else f"bucket {b} (tower unknown after the reduction)"
                 for t, b in where]
        bad_loss = [t for t, r in enumerate(results) if r is not None and not math.isfinite(float(r[0]))]
        msg = (f"step {self.step + 1}: non-finite gradient (inf/NaN) in " + (", ".join(parts) or "the gradients") +
               (f"; towers with a non-finite loss: {bad_loss}" if bad_loss else ""))
        overflow = self.scaler is not None and loss_scale is not None and loss_scale > self.scaler.min_scale
        if overflow:
            log.debug("%s at loss scale %g: step skipped, the scale backs off", msg, loss_scale)
            return
        if self.on_nonfinite == "raise":
            self.nonfinite_steps -= 1
            raise FloatingPointError(msg + "; nothing was updated (on_nonfinite='raise')")
        log.warning("%s; step skipped, master weights and optimizer state unchanged (%d skipped so far)",
                    msg, self.nonfinite_steps)

    # ------------------------------------------------------------------ evaluation
    def _tower_eval(self, t: int, inputs: tuple, target: torch.Tensor, lo: int, hi: int):
        if hi == lo:
            return None
        with self._device_ctx(t), torch.no_grad():
            xs = self._slice_to(t, inputs, lo, hi)
            (y,) = self._slice_to(t, (target,), lo, hi)
            with autocast_context(self.amp, self.devices[t]):
                out = self.towers[t](*xs)
                loss = self.loss_fn(out, y)
            return float(loss.float()) * (hi - lo), _accuracy_counts(out, y), hi - lo

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Make every tower's buffers equal: floating-point ones (batch-norm running statistics) become
        the mean over the towers, the others (counters) tower 0's.

        Note [Lazy buffer sync]
        Each tower updates its running statistics from its own slice of the batch. They are only read in
        eval mode, so they are synchronised when they are read (evaluate, state_dict), not every step.
        Running statistics are exponential moving averages, linear in the per-batch statistics, so the
        mean of the towers' averages equals the average of the per-step means: syncing lazily gives the
        result of syncing every step without the per-step cost.
        """
        if self.total_towers == 1:
            return
        named = [dict(t.named_buffers()) for t in self.towers]
        sums = {}
        for name, b0 in named[0].items():
            if b0.is_floating_point():
                total = b0.to(torch.float64)
                for other in named[1:]:
                    total = total + other[name].to(b0.device, torch.float64)
                sums[name] = total
        if self.processes > 1 and sums:   # one exchange: every floating buffer's sum, flat
            flat = torch.cat([v.reshape(-1).cpu() for v in sums.values()])
            flat = torch.tensor(self.comm.sum_over_processes(flat.tolist()), dtype=torch.float64)
            pos = 0
            for name, v in sums.items():
                sums[name] = flat[pos:pos + v.numel()].view_as(v)
                pos += v.numel()
        for name, b0 in named[0].items():
            if name in sums:
                b0.copy_(sums[name] / self.total_towers)
            for other in named[1:]:
                other[name].copy_(b0)

    def evaluate(self, loader: Iterable) -> dict:
        """Mean loss and accuracy over `loader` (batches split across the towers, no gradients).
        A TensorLoader's training position is left untouched."""
        self.sync_buffers()  # See Note [Lazy buffer sync]
        batches = loader.batches() if hasattr(loader, "batches") else loader
        was_training = [t.training for t in self.towers]
        for tower in self.towers:
            tower.eval()
        loss_sum, correct, samples = 0.0, 0, 0
        try:
            for batch in batches:
                inputs, target = unpack_batch(batch)
                b = self._tower_bounds(int(target.shape[0]))
                results = self.runner.map(lambda t: self._tower_eval(t, inputs, target, b[t], b[t + 1]))
                for r in results:
                    if r is None:
                        continue
                    loss_sum += r[0]
                    samples += r[2]
                    correct = None if r[1] is None or correct is None else correct + int(r[1])
        finally:
            for tower, mode in zip(self.towers, was_training):
                tower.train(mode)
        if self.processes > 1:   # one exchange for the whole evaluation
            loss_sum, correct_sum, samples, no_acc = self.comm.sum_over_processes(
                [loss_sum, correct or 0, samples, 1.0 if correct is None else 0.0])
            samples, correct = int(round(samples)), None if no_acc else int(round(correct_sum))
        if samples == 0:
            raise ValueError("loader: yielded no samples to evaluate")
        return {"loss": loss_sum / samples, "accuracy": None if correct is None else correct / samples,
                "samples": samples}

    # ------------------------------------------------------------------ fit
    @staticmethod
    def _new_epoch_acc() -> dict:
        return {"loss_sum": 0.0, "samples": 0, "correct": 0, "train_s": 0.0, **{"t_" + k: 0.0 for k in PHASES}}

    def epoch_progress(self) -> tuple[int | None, int]:
        """(batches per epoch, batches done in the current epoch) of the loader being fitted."""
        total = len(self._loader) if hasattr(self._loader, "__len__") else None
        return total, int(getattr(self._loader, "batch", 0) or 0)

    def fit(self, loader: Iterable, epochs: int = 1, eval_loader: Iterable | None = None,
            callbacks: Sequence[Callback] = (), max_steps: int | None = None) -> list[dict]:
        """Train until `epochs` epochs are complete in total (a resumed trainer continues where its
        checkpoint stopped) or `max_steps` optimizer steps were taken in total. Returns the history of
        epoch records. A loader with state_dict/load_state_dict/epoch (TensorLoader) is resumable mid-epoch;
        any other iterable of (inputs..., target) batches is iterated once per epoch."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: must be a positive integer, got {epochs!r}")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps: must be a positive integer or None, got {max_steps!r}")
        nominal = getattr(loader, "batch_size", None)
        if isinstance(nominal, int) and nominal < self.total_towers:
            raise ValueError(f"batch_size: the loader's batch size {nominal} is smaller than the number of "
                             f"towers ({self.total_towers}); every tower needs at least one sample")
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks[{i}]: expected an ncclavg.train.callbacks.Callback, got {type(cb).__name__}")
        resumable = all(hasattr(loader, a) for a in ("state_dict", "load_state_dict", "epoch"))
        if resumable and self._data_state is not None:
            loader.load_state_dict(self._data_state)
        self._data_state = None
        steps_per_epoch = len(loader) if hasattr(loader, "__len__") else None
        self.plan_schedule(steps_per_epoch, epochs, max_steps)
        self._loader, self.target_epochs, self.stop_training = loader, epochs, False
        fit_samples, fit_train_s, t_fit = 0, 0.0, time.perf_counter()
        for cb in callbacks:
            cb.on_fit_start(self)
        try:
            while not self.stop_training:
                epoch = loader.epoch if resumable else self.epoch
                if epoch >= epochs or (max_steps is not None and self.step >= max_steps):
                    break
                for cb in callbacks:
                    cb.on_epoch_start(self, epoch)
                completed = True
                for batch, allow_idle in self._epoch_batches(loader, nominal):
                    record = self.train_step(batch, _allow_idle_towers=allow_idle)
                    fit_samples += record["samples"]
                    fit_train_s += record["step_s"]
                    for cb in callbacks:
                        cb.on_step_end(self, record)
                    if self.stop_training or (max_steps is not None and self.step >= max_steps):
                        completed = False
                        break
                if not completed:
                    break
                self.epoch = epoch + 1
                record = self._epoch_record(eval_loader)
                self.history.append(record)
                for cb in callbacks:
                    cb.on_epoch_end(self, record)
        except BaseException as error:   # See Note [Callbacks when fit fails] in callbacks.py
            self._note_fit(fit_samples, fit_train_s, t_fit)
            for cb in callbacks:
                try:
                    cb.on_fit_error(self, error)
                except Exception as cb_error:   # the training error is the one to see; this one rides along
                    error.add_note(f"while handling it, {type(cb).__name__}.on_fit_error raised "
                                   f"{type(cb_error).__name__}: {cb_error}")
            raise
        self._note_fit(fit_samples, fit_train_s, t_fit)
        for cb in callbacks:
            cb.on_fit_end(self, self.history)
        return self.history

    def _note_fit(self, samples: int, train_s: float, t_fit: float) -> None:
        self.last_fit = {"samples": samples, "train_s": train_s,
                         "samples_per_s": samples / train_s if train_s > 0 else 0.0,
                         "wall_s": time.perf_counter() - t_fit}

    def _epoch_batches(self, loader: Iterable, nominal: Any) -> Iterable[tuple[Any, bool]]:
        """(batch, may it leave towers idle). Only the trailing remainder of an epoch may be smaller than
        the number of towers: with a loader that states its batch size (checked >= towers in fit) that
        is any short batch; for other iterables, a last batch that follows a full one (one-batch
        lookahead), so that a loader yielding too small batches fails before its first step."""
        if isinstance(nominal, int):
            for batch in loader:
                yield batch, True
            return
        it = iter(loader)
        sentinel = object()
        current, seen = next(it, sentinel), 0
        while current is not sentinel:
            upcoming = next(it, sentinel)
            yield current, upcoming is sentinel and seen > 0
            current, seen = upcoming, seen + 1

    def _epoch_record(self, eval_loader: Iterable | None) -> dict:
        acc, self._epoch_acc = self._epoch_acc, self._new_epoch_acc()
        n = acc["samples"]
        record = {"epoch": self.epoch, "step": self.step, "loss": acc["loss_sum"] / n if n else None,
                  "accuracy": acc["correct"] / n if n and acc["correct"] is not None else None,
                  "samples": n, "train_s": acc["train_s"],
                  "samples_per_s": n / acc["train_s"] if acc["train_s"] > 0 else None,
                  "lr": self.current_lr(), **{"t_" + k: acc["t_" + k] for k in PHASES}}
        if eval_loader is not None:
            ev = self.evaluate(eval_loader)
            record.update(val_loss=ev["loss"], val_accuracy=ev["accuracy"])
        return record

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return self._state(self.engine.master_state())

    def _state(self, master: dict) -> dict:
        self.sync_buffers()  # See Note [Lazy buffer sync]
        loader = self._loader
        data = loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else self._data_state
        return {"kind": CHECKPOINT_KIND, "format": CHECKPOINT_FORMAT, "signature": self.signature,
                "config": dict(self.config), "master": master,
                "extra": extra_tensors(self.towers[0]), "step": self.step, "epoch": self.epoch,
                "data": data, "schedule": self._ensure_schedule(None, None).state_dict(),
                "schedule_plan": self._schedule_plan,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "rng": rng_state(self.devices), "history": list(self.history),
                "processes": self.processes, "total_towers": self.total_towers,
                "epoch_acc": dict(self._epoch_acc), "nonfinite_steps": self.nonfinite_steps}

    def save(self, path: str, *, _manager: Any = None) -> str:
        """Write a checkpoint atomically (temp file, fsync, rename) with a checksum; returns its path."""
        if self.shard_master:   # a set of parts, one per process: Note [Sharded checkpoints]
            return self._save_set(path, _manager)
        state = self.state_dict()   # every process: it syncs buffers across them
        if _manager is not None:    # See Note [Towers of several processes]: rank 0 writes
            return write_once(self.comm, lambda: _manager.save(state, self.step))
        return write_once(self.comm, lambda: ckpt.save(path, state))

    def _save_set(self, path: str, manager: Any) -> str:
        """Every process writes its part of the master, then rank 0 the checkpoint file (the commit)."""
        from .sharded import shard_manifest, shard_part

        state = self._state(shard_manifest(self.engine))   # every process: it syncs buffers across them
        main = manager.path_for(self.step) if manager is not None else os.fspath(path)
        error = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(main)), exist_ok=True)
            ckpt.save(ckpt.part_path(main, self.rank, self.processes), shard_part(self.engine))
        except Exception as e:   # reported to every process below, then raised here
            error = e
        failed = [(r, msg) for r, msg in enumerate(self.comm.allgather_object(
            None if error is None else f"{type(error).__name__}: {error}")) if msg is not None]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} could not write its part of {main}: {failed[0][1]}")
        if manager is not None:
            return write_once(self.comm, lambda: manager.save(state, self.step))
        return write_once(self.comm, lambda: ckpt.save(main, state))

    def load_state_dict(self, state: dict, path: str = "<state>") -> None:
        check_signature(path, state, self.signature)
        master = state["master"]
        if isinstance(master, dict) and "sharded" in master:   # Note [Sharded checkpoints]
            if path == "<state>":
                raise ValueError("state: its master weights were saved as a set of parts next to the checkpoint "
                                 "file; load it with restore(path) or TowerTrainer.load(path, ...)")
            from .sharded import assemble_master

            master = assemble_master(master["sharded"], path)
        self.engine.load_master_state(master)
        load_extra_tensors(self.towers, state["extra"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self._data_state = state["data"]
        self.schedule = from_state_dict(state["schedule"])
        self._schedule_plan = state.get("schedule_plan")
        self._planned_for = None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], self.devices)
        self.history = list(state["history"])
        self._epoch_acc = dict(state["epoch_acc"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))

    def restore(self, path: str) -> str:
        """Load a checkpoint file (or the newest complete one in a directory) into this trainer."""
        path = ckpt.resolve(path)
        self.load_state_dict(ckpt.load(path), path)
        return path

    @classmethod
    def load(cls, path: str, model: nn.Module, devices: Sequence[Any] | str | None = None,
             **overrides: Any) -> "TowerTrainer":
        """A trainer rebuilt from a checkpoint (a file, or a directory: its newest complete checkpoint)
        with the saved configuration, `overrides` applied on top. The model must have the parameters and
        buffers the checkpoint was saved from; checked before the model is touched."""
        path = ckpt.resolve(path)
        state = ckpt.load(path)
        check_signature(path, state, model_signature(model))
        config = dict(state["config"])
        saved_devices = config.pop("devices")
        if devices is None:
            devices = _resume_devices(path, state, saved_devices, overrides.get("comm"))
        config.update(overrides)
        if "lr_schedule" not in overrides:
            config["lr_schedule"] = from_state_dict(state["schedule"])
        trainer = cls(model, devices=devices, **config)
        trainer.load_state_dict(state, path)
        if "lr_schedule" in overrides:  # the user's new schedule, not the saved one (planned by fit if named)
            trainer._schedule_spec = overrides["lr_schedule"]
            trainer.schedule = None if isinstance(trainer._schedule_spec, str) else make_schedule(
                trainer._schedule_spec, trainer.config["lr"])
            trainer._schedule_plan = None
            trainer._planned_for = None
        return trainer

    def master_params(self) -> list[torch.Tensor]:
        """fp32 CPU copies of the master weights, one per trainable parameter (registration order)."""
        return self.engine.master_params()

    def close(self) -> None:
        self.runner.close()
        self.engine.close()

    def __enter__(self) -> "TowerTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _run_length(plan: dict) -> str:
    spe, total = plan.get("steps_per_epoch"), plan.get("total_steps")
    if spe and total:
        return f"{total // spe} epochs ({total} steps)"
    return f"{total} steps" if total else "an unknown number of steps"


def _resume_devices(path: str, state: dict, saved: list, comm: Any) -> list | None:
    """This process's towers for a checkpoint resumed without `devices`: the saved ones when the number
    of processes is the same; the saved total of CPU towers spread evenly over a new number of processes
    (4 towers saved by 1 process resume as 2 x 2 or 4 x 1); None (the defaults) for GPU towers resumed
    without GPUs. See Note [Towers of several processes]."""
    from .distributed import launched_with_processes

    if comm is not None:
        return list(comm.devices)
    processes = 1
    if launched_with_processes():
        processes = int(os.environ.get("WORLD_SIZE", "0")) or _dist_world_size()
    saved_processes, total = int(state.get("processes", 1)), int(state.get("total_towers", len(saved)))
    try:
        devices = parse_devices(saved)
    except ValueError:  # saved on GPUs, resumed here without them
        return None
    if processes == saved_processes:
        return devices
    if devices[0].type == "cpu" and total % processes == 0:
        return [torch.device("cpu")] * (total // processes)
    raise ValueError(f"devices: {path} was saved by {saved_processes} process(es) with {total} towers in all; "
                     f"with {processes} processes pass this process's devices explicitly")


def _dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
