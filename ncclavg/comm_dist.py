"""torch.distributed plumbing of Communicator with every wait bounded: issue and wait for async works
(failures recorded on the communicator, see Note [A failed communicator stays failed] in comm.py), an
allgather_object that cannot outwait the communicator's timeout, and the debug-mode record exchange."""
from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Callable

import torch

from .errors import CommError, CommTimeoutError


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _wait_dist(comm: Any, work: Any, timeout: float, what: str) -> None:
    """Bounded wait for a torch.distributed work; every failure marks `comm` unusable. See Note [A failed
    communicator stays failed]."""
    t0 = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if _is_timeout(e):
            elapsed = time.monotonic() - t0
            # the process group's own (shorter) timeout may fire first: say which one did
            msg = (f"{what} did not complete within {timeout:g} s" if elapsed >= 0.9 * timeout else
                   f"{what} timed out after {elapsed:.1f} s in torch.distributed (the process group's own "
                   f"timeout, shorter than this communicator's {timeout:g} s)")
            comm._fail(msg)
            raise CommTimeoutError(f"{msg}; the communicator is unusable now (torch.distributed: {e})") from None
        msg = f"{what} failed: {e}"
        comm._fail(msg)
        raise CommError(msg + "; the communicator is unusable now (did a peer process die?)") from e


def _issue_dist(comm: Any, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Starts a torch.distributed async op; a failure to even start it (a peer's connection already
    closed) marks `comm` unusable like a failed wait."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        msg = f"{what} could not start: {e}"
        comm._fail(msg)
        raise (CommTimeoutError if _is_timeout(e) else CommError)(msg + "; the communicator is unusable now") from e


def _allgather_object_bounded(comm: Any, dist: Any, group: Any, obj: Any, timeout: float,
                              device: Any = "cpu") -> list:
    """torch.distributed.all_gather_object, but every wait bounded by `timeout` (the torch version waits
    as long as the process group's own timeout, 30 min by default): sizes first, then the padded bytes."""
    what = f"{comm.backend} allgather_object (rank {comm.rank} of {comm.world_size})"
    payload = pickle.dumps(obj)
    world = comm.world_size
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, sizes, size, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (sizes)")
    counts = [int(x.item()) for x in sizes]
    longest = max(counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    work = _issue_dist(comm, what, dist.all_gather, outs, mine, group=group, async_op=True)
    _wait_dist(comm, work, timeout, what + " (payload)")
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, counts)]


def _debug_allgather_dist(comm: Any, dist: Any, group: Any, record: torch.Tensor, timeout: float,
                          device: Any = "cpu") -> torch.Tensor:
    what = f"{comm.backend} debug sequence check (rank {comm.rank} of {comm.world_size})"
    rows = [torch.empty_like(record, device=device) for _ in range(comm.world_size)]
    work = _issue_dist(comm, what, dist.all_gather, rows, record.to(device), group=group, async_op=True)
    _wait_dist(comm, work, timeout, what)
    return torch.stack([r.cpu() for r in rows])
