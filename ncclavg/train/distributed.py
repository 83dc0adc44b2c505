"""TowerTrainer across processes: which communicator spans the towers of every process, and how a
checkpoint is written once for all of them.

Note [Towers of several processes]
Under torchrun (or once torch.distributed is initialised, or given a Communicator explicitly) each
process drives its own towers (`devices`) and the average spans the towers of every process: N towers
in all, numbered process-major (process p's first tower has global index tower_offset = the towers of
processes 0..p-1). Every process iterates the same global batches (same data, same seed) and tower g
trains on slice g of each batch, split over all N towers with the weights of Note [Uneven batches]. So
P processes x T towers take the same steps as one process with P*T towers, whatever the shape, and a
run resumes on another shape. Processes may feed different numbers of towers: the average is over
towers. What each step reports (loss, accuracy, samples) is summed over the processes (one small
exchange per step), evaluation once per evaluate().
- CPU towers: the gloo backend, hierarchical (Note [Hierarchical CPU average] in comm/gloo.py).
  master="cpu" averages every bucket across processes, then takes one fused step over the averaged
  gradients with the division still owed folded into the gradient scale; every process then takes the
  same step on its own master copy, so the copies stay identical (NCCLAVG_DEBUG=1 compares them).
- Every process starts from rank 0's weights and buffers (broadcast at construction), as DDP does.
- Rank 0 (`trainer.is_main`) writes checkpoints, then every process learns whether it succeeded; the
  CLI prints, plots and writes metrics from rank 0 only. Callbacks run in every process and must make
  the same decisions everywhere (stop_training, max_steps): a process that stops early leaves the others
  waiting in a collective until their timeout (CommTimeoutError, never a hang).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from ..comm.base import TORCHRUN_VARS


def launched_with_processes() -> bool:
    """True under torchrun with more than one process, or when torch.distributed is initialised with
    more than one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return all(k in os.environ for k in TORCHRUN_VARS) and int(os.environ.get("WORLD_SIZE", "1")) > 1


def processes_communicator(comm: Any, devices: Sequence[torch.device], timeout: float | None = None) -> Any:
    """The communicator over the towers of every process, or None when this process is alone (its engine
    then builds the local / single-process one). `comm` given: checked against `devices` and used."""
    from ..comm import Communicator

    if comm is not None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm: expected an ncclavg Communicator, got {type(comm).__name__}")
        mine = [str(torch.device(d)) for d in comm.devices]
        wanted = [str(d) for d in devices]
        if mine != wanted:
            raise ValueError(f"comm: its local towers are on {','.join(mine)} but devices is {','.join(wanted)}; "
                             "pass devices=comm.devices (or leave devices out)")
        return comm
    if not launched_with_processes():
        return None
    return Communicator.from_torch_distributed(devices=list(devices), timeout=timeout)


def write_once(comm: Any, write: Callable[[], str]) -> str:
    """Runs `write()` (returning the path written) on rank 0 only; every process returns the path, and
    every process raises when rank 0's write failed, so that no process goes on alone."""
    if comm is None or comm.world_size == 1:
        return write()
    path, error = None, None
    if comm.rank == 0:
        try:
            path = write()
        except Exception as e:   # re-raised below, after the others have heard of it
            error = e
    outcome = comm.allgather_object(path if error is None else {"error": f"{type(error).__name__}: {error}"})[0]
    if error is not None:
        raise error
    if isinstance(outcome, dict):
        raise RuntimeError(f"rank 0 could not write the checkpoint: {outcome['error']}")
    return outcome


def check_same_start(comm: Any, step: int, source: str | None) -> None:
    """Every process must start from the same point: the same checkpoint's step, or all from scratch.
    A process that found another checkpoint than rank 0 (or none: e.g. hosts without a shared file system
    after an elastic restart, Note [Elastic restart] in cli.py) would train on with its own optimizer
    state and data position, and the replicas would drift apart without an error. So the processes
    compare (one exchange) and all raise ValueError, naming what each found, when they differ."""
    if comm is None or comm.world_size == 1:
        return
    seen = comm.allgather_object({"step": int(step), "from": source})
    if len({s["step"] for s in seen}) == 1:
        return
    found = "; ".join(f"rank {r}: " + (f"step {s['step']} from {s['from']}" if s["from"] else "no checkpoint")
                      for r, s in enumerate(seen))
    raise ValueError(f"the processes would start from different points ({found}): every process must see the "
                     "same checkpoints (one file system shared by the hosts for --checkpoint-dir and --resume)")


def check_tower_replicas(trainer: Any, on_mismatch: str = "raise") -> str | None:
    """Note [The replica check] in ncclavg/transport/replicas.py over a TowerTrainer's replicas: every
    tower's parameters (all the run's towers, in every process, compared with each other) and, where each
    process keeps whole fp32 master weights of its own (master="cpu", not sharded), those too (compared
    across the processes). A difference names the rank, the tower and the first parameter (or master
    bucket) where it is; raises ReplicaMismatchError, or returns the text with on_mismatch="warn"."""
    from ..transport.replicas import Replica, check_replicas

    names = [n or f"parameter {i}" for i, n in enumerate(trainer.names)]
    replicas = [Replica(f"tower {trainer.tower_offset + t}", "tower", params, names)
                for t, params in enumerate(trainer.tower_params)]
    master = getattr(trainer.engine, "master", None)
    if master is not None and not trainer.shard_master:
        replicas.append(Replica("master weights", "master", list(master.flat),
                                [f"master bucket {b}" for b in range(len(master.flat))]))
    comm = trainer.comm
    allgather = comm.allgather_object if comm is not None else (lambda obj: [obj])
    return check_replicas(replicas, allgather, trainer.rank, on_mismatch, f"the replica check after step {trainer.step}")
