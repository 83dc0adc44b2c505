"""TowerTrainer: one model replica ("tower") per device in one process, every batch split across them,
gradients averaged through ncclavg, fp32 master weights updated on the CPU (or on each device).

What lives here: the class and its construction (the arguments checked, the towers, the engine), one
training step (train_step), evaluation, the lazy buffer sync and the planning of the learning-rate
schedule. The epoch loop (fit) is in fit.py, the checkpoints (state_dict, save, restore, load) in
trainer_state.py: TowerTrainer inherits both.

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
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .amp import DynamicLossScale, autocast_context
from ..transport.stragglers import DEFAULT_THRESHOLD_S
from .distributed import check_tower_replicas, processes_communicator
from .engines import CpuMasterEngine, DeviceMasterEngine, OptimConfig
from .fit import FitLoop
from .metrics import PHASES, StepTimes
from .schedules import LRSchedule, ScheduleSpec, make_schedule, replan
from .state import seed_everything
from .towers import (TowerRunner, apply_tower_threads, build_towers, model_signature,
                     split_sizes, trainable_parameters, unpack_batch)
from .trainer_args import TrainerArgs, check_trainer_args
from .trainer_state import TrainerState

# Importable from here too, for callers that know them from this module; fit.py and trainer_state.py
# are where they are used.
from . import checkpoint as ckpt  # noqa: F401
from .callbacks import Callback  # noqa: F401
from .distributed import write_once  # noqa: F401
from .schedules import from_state_dict  # noqa: F401
from .state import (CHECKPOINT_FORMAT, CHECKPOINT_KIND, check_signature, extra_tensors,  # noqa: F401
                    load_extra_tensors, rng_state, set_rng_state)


log = logging.getLogger(__name__)


def _accuracy_counts(out: Any, y: Any) -> torch.Tensor | None:
    """Correct predictions for class-index targets and [N, C] logits; None for other tasks."""
    if not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None
    if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point() and out.shape[0] == y.shape[0]:
        return (out.argmax(dim=1) == y).sum()
    return None


class TowerTrainer(FitLoop, TrainerState):
    """Data-parallel training over towers: this process's `devices`, and under torchrun (or given `comm`)
    the towers of every process; see Note [Towers of several processes] in distributed.py. `timeout`
    (seconds, default NCCLAVG_TIMEOUT or 600) bounds every wait on another process. `threads`: torch's
    intra-op threads, set for the process when the trainer is built (default: the cores shared out over
    the CPU towers of this host; GPU towers leave torch's setting alone): Note [Threads of CPU towers]
    in towers.py. See the module
    docstring and docs/architecture.md. fit() comes from FitLoop (fit.py); state_dict, save, restore
    and load from TrainerState (trainer_state.py)."""

    def __init__(self, model: nn.Module, devices: Sequence[Any] | str | None = None, optimizer: str = "adamw",
                 lr: float = 1e-3, lr_schedule: ScheduleSpec = None, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = False, grad_clip: float | None = None,
                 amp: str | None = None, master: str | None = None, bucket_cap_mb: float = 25.0,
                 seed: int = 0, *, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 first_bucket_mb: float = 1.0, loss_fn: Callable | None = None, concurrent: bool = True,
                 overlap: bool = True, init_loss_scale: float = 2.0 ** 16, on_nonfinite: str = "skip",
                 replan_schedule: bool = True, comm: Any = None, timeout: float | None = None,
                 shard_master: bool = False, threads: int | None = None, replica_check_every: int = 100,
                 on_replica_mismatch: str = "raise"):
        # Every argument checked before anything is touched: a bad one leaves the model as it was.
        args = check_trainer_args(model, devices, optimizer, lr, lr_schedule, weight_decay, momentum, nesterov,
                                  grad_clip, amp, master, bucket_cap_mb, seed, betas, eps, first_bucket_mb, loss_fn,
                                  concurrent, overlap, init_loss_scale, on_nonfinite, replan_schedule, shard_master,
                                  threads, replica_check_every, on_replica_mismatch)
        # See Note [Towers of several processes]; building it is a collective when there are several.
        self._keep_choices(args, processes_communicator(comm, args.devices, timeout))
        self._build(model, args)

    def _keep_choices(self, a: TrainerArgs, process_comm: Any) -> None:
        """The run's shape (its processes and towers) and its checked choices, kept on the trainer."""
        self.devices = a.devices
        self.comm = process_comm   # None: this process's towers are all the towers
        self.processes = process_comm.world_size if process_comm is not None else 1
        self.rank = process_comm.rank if process_comm is not None else 0
        self.total_towers = process_comm.size if process_comm is not None else len(a.devices)
        self.tower_offset = getattr(process_comm, "tower_offset", 0) if process_comm is not None else 0
        self.loss_fn = a.loss_fn if a.loss_fn is not None else nn.functional.cross_entropy
        self.amp = a.amp
        self.master = a.master
        self.grad_clip = a.grad_clip
        self.schedule: LRSchedule | None = a.schedule
        self._schedule_spec = a.lr_schedule
        # {"total_steps", "steps_per_epoch"} the named schedule was planned for; None for an explicit one
        self._schedule_plan: dict | None = None
        self._planned_for: tuple | None = None   # the (steps_per_epoch, epochs, max_steps) last planned for
        self.schedule_note: str | None = None
        self.config = a.config()
        # Choices of this run's, not of the training: not saved with the checkpoint (a sharded run resumes
        # unsharded and the other way round: Note [Sharded CPU master]).
        self.replan_schedule = a.replan_schedule
        self.shard_master = a.shard_master and self.processes > 1
        if a.shard_master and self.processes == 1:
            log.info("shard_master: one process, nothing to shard; the master weights stay whole")
        self.on_nonfinite = a.on_nonfinite
        # Note [The replica check] (transport/replicas.py): every replica_check_every steps (0: never), every
        # step while the communicator of several processes is in debug mode (NCCLAVG_DEBUG=1)
        self.replica_check_every = a.replica_check_every
        self.on_replica_mismatch = a.on_replica_mismatch
        self.replica_checks = 0    # checks run
        self.replica_warnings: list = []   # the texts of the mismatches found with on_replica_mismatch="warn"
        self.nonfinite_steps = 0   # steps skipped for an inf/NaN gradient (fp16 overflows included)

    def _build(self, model: nn.Module, a: TrainerArgs) -> None:
        """The towers (copies of `model`, from rank 0's weights when there are several processes), the
        engine that averages and steps, the tower runner, and the counters of a run not yet started."""
        devs = a.devices
        # Before the tower threads first compute: See Note [Threads of CPU towers] in towers.py.
        self.threads = apply_tower_threads(devs, a.threads)
        seed_everything(a.seed, devs)
        if self.processes > 1:   # every process starts from rank 0's weights and buffers
            self.comm.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self.towers = build_towers(model, devs)
        self.names = a.names
        self.tower_params = [trainable_parameters(t)[1] for t in self.towers]
        self.engine = self._make_engine(a.optim(), a.bucket_cap_mb, a.first_bucket_mb, a.overlap)
        self.plan = self.engine.plan
        self.runner = TowerRunner(len(devs), concurrent=a.concurrent)
        # Note [Tower streams]: each GPU tower works on its device's CURRENT stream, from its own thread.
        # Towers on different GPUs thus run concurrently, and every collective (launched by the averager's
        # backward hooks from whichever tower thread completes a bucket, or by the engines from the main
        # thread) is ordered after the towers' work: the NCCL communicator waits for each device's current
        # stream, which is thread-independent unless a caller switches streams. Private per-tower streams
        # would break that (a hook running in tower 1's thread sees the default stream of tower 0's device).
        self.streams = None
        self.scaler = DynamicLossScale(init_scale=a.init_loss_scale) if a.amp == "fp16" else None
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
                "concurrent": self.runner.concurrent, "threads": self.threads,
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

    def straggler_report(self, calls: int | None = None, seconds: float | None = None,
                         threshold_s: float = DEFAULT_THRESHOLD_S, since: int | None = None) -> Any:
        """Which rank held the others back (Note [The straggler report] in ncclavg/transport/stragglers.py)
        in the recent collectives of this process's host, over the window the arguments choose (as
        Communicator.straggler_report); None with one process, or one process on this host."""
        return None if self.comm is None else self.comm.straggler_report(calls, seconds, threshold_s, since)

    def _check_replicas(self) -> None:
        """Note [The replica check]: a mismatch raises ReplicaMismatchError on every process, or is logged
        as a warning and kept in `replica_warnings` (on_replica_mismatch="warn")."""
        self.replica_checks += 1
        text = check_tower_replicas(self, self.on_replica_mismatch)
        if text is not None:
            log.warning("%s", text)
            self.replica_warnings.append(text)

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
        if info["skipped"]:
            self._nonfinite_step(info, results, loss_scale)
        if self.scaler is not None:
            self.scaler.update(bool(info["skipped"]))
        self.step += 1
        every = self.replica_check_every
        checked = bool(every) and (self.step % every == 0 or (self.processes > 1 and self.comm.debug))
        if checked:
            self._check_replicas()
        loss_sum, correct = (stats or self._sum_results(live))()
        loss = loss_sum / total
        step_s = time.perf_counter() - t0
        record = {"step": self.step, "epoch": self.epoch + 1, "loss": loss,
                  "accuracy": None if correct is None else correct / total, "lr": lr, "samples": total,
                  "step_s": step_s, "samples_per_s": total / step_s if step_s > 0 else None,
                  "skipped": bool(info["skipped"]), "grad_norm": info.get("grad_norm"),
                  **({"replicas_checked": True} if checked else {}),
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

    def _nonfinite_step(self, info: dict, results: list, loss_scale: float | None) -> None:
        """A step the engine skipped for an inf/NaN gradient: count it, log where it came from, or raise.

        Note [Non-finite gradients]
        Every engine checks the gradients before it writes anything. The CPU master's fused step takes
        the answer from the passes that wrote the averaged gradients where they noted it (the channel's
        sum, the local average of the towers: Note [Finiteness of the averaged gradients] in averager.py)
        and reads the gradients once more only where no pass noted it (one process: the fused step
        averages the towers itself, after a read-only first pass; a user's own gradients). master="device" checks each tower's buckets before
        they are averaged (GradientAverager(check_finite=True): after the in-place average every tower
        holds the same non-finite mean), the GPU offload pipeline the reduced shards before the update
        starts. A skipped step changes no weight, moment or step count; the trainer's step counter and
        the schedule still advance (as with torch's GradScaler). With amp="fp16" an overflow is part of
        dynamic loss scaling (the scale halves); on_nonfinite="raise" raises only once the scale is at
        its minimum, where an inf/NaN can no longer be an overflow of the scaled loss.
        on_nonfinite="ignore" turns the check off (an inf/NaN then reaches the weights, as with
        torch.optim): where the check still reads the gradients it saves that read pass (about +20% on the
        fused CPU optimizer step alone); fp16 keeps its overflow check.
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

    # ------------------------------------------------------------------ master weights, closing
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
