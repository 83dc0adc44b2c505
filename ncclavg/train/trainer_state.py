"""TowerTrainer's checkpoints: the state dict it saves (state_dict, load_state_dict), writing it
(save: one file, or a set of parts with sharded master weights) and reading it back (restore into this
trainer, load: a trainer rebuilt from a checkpoint, with this process's towers for a run resumed by
another number of processes).

`TrainerState` is a mixin of TowerTrainer (trainer.py) and works on its attributes. The file format
and the directory of checkpoints are checkpoint.py's; the RNG states, the non-trainable tensors and the
check that a checkpoint fits the model are state.py's; the parts of a sharded master are sharded.py's.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence, TypeVar

import torch
from torch import nn

from . import checkpoint as ckpt
from .distributed import write_once
from .schedules import from_state_dict, make_schedule
from .state import (CHECKPOINT_FORMAT, CHECKPOINT_KIND, check_signature, extra_tensors, load_extra_tensors,
                    rng_state, set_rng_state)
from .towers import model_signature, parse_devices


# the class `load` is called on (TowerTrainer, or a user's subclass of it); a name of this module, since
# trainer.py imports this one and cannot be imported back
_Trainer = TypeVar("_Trainer", bound="TrainerState")
log = logging.getLogger("ncclavg.train")


class TrainerState:
    """state_dict, load_state_dict, save, restore and load of TowerTrainer."""

    # load(): one line saying how this run's towers differ from the checkpoint's; None when they do not
    resume_note: str | None = None

    def state_dict(self) -> dict:
        return self._state(self.engine.master_state())

    def _state(self, master: dict) -> dict:
        self.sync_buffers()  # See Note [Lazy buffer sync] in trainer.py
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
        if self.shard_master:   # a set of parts, one per process: Note [Sharded checkpoints] in sharded.py
            return self._save_set(path, _manager)
        state = self.state_dict()   # every process: it syncs buffers across them
        if _manager is not None:    # See Note [Towers of several processes] in distributed.py: rank 0 writes
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
        if isinstance(master, dict) and "sharded" in master:   # Note [Sharded checkpoints] in sharded.py
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
    def load(cls: type[_Trainer], path: str, model: nn.Module, devices: Sequence[Any] | str | None = None,
             **overrides: Any) -> _Trainer:
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
        trainer.resume_note = _shape_change(state, saved_devices, trainer)
        if trainer.resume_note and trainer.is_main:
            log.info("%s", trainer.resume_note)
        if "lr_schedule" in overrides:  # the user's new schedule, not the saved one (planned by fit if named)
            trainer._schedule_spec = overrides["lr_schedule"]
            trainer.schedule = None if isinstance(trainer._schedule_spec, str) else make_schedule(
                trainer._schedule_spec, trainer.config["lr"])
            trainer._schedule_plan = None
            trainer._planned_for = None
        return trainer


def _towers_in_words(towers: int, processes: int, devices: Sequence[str]) -> str:
    if processes == 1:
        return f"{towers} tower{'s' if towers != 1 else ''} ({','.join(devices)})"
    return f"{towers} towers in {processes} processes ({','.join(devices)} on rank 0)"


def _shape_change(state: dict, saved_devices: list, trainer: Any) -> str | None:
    """One line when the towers of this run differ from those the checkpoint was written by (their
    number, the processes, or rank 0's devices); None when they are the same."""
    saved = (int(state.get("total_towers", len(saved_devices))), int(state.get("processes", 1)),
             [str(d) for d in saved_devices])
    now = (trainer.total_towers, trainer.processes, [str(d) for d in trainer.devices])
    if saved == now:
        return None
    return (f"towers changed: the checkpoint was written by {_towers_in_words(*saved)}, this run has "
            f"{_towers_in_words(*now)}")


def _resume_devices(path: str, state: dict, saved: list, comm: Any) -> list | None:
    """This process's towers for a checkpoint resumed without `devices`: the saved ones when the number
    of processes is the same; the saved total of CPU towers spread evenly over a new number of processes
    (4 towers saved by 1 process resume as 2 x 2 or 4 x 1); None (the defaults) for GPU towers resumed
    without GPUs. See Note [Towers of several processes] in distributed.py."""
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
