"""The torch.distributed plumbing every multi-process backend uses (gloo.py, nccl.py), each exchange a job
on the communicator's runner (transport/runner.py: bounded, its failure the communicator's, see Note [A
failed communicator stays failed] in base.py): an allgather_object that cannot outwait the
communicator's timeout, the debug-mode record exchange; and end_process for leaving without torch's
teardown.

Note [Gloo teardown]
With torch 2.13 a gloo rank whose run has finished sometimes dies on its way out: it prints its
results, then "terminate called without an active exception" (SIGABRT, exit -6), and torchrun or a
test harness reports the whole run as failed. Measured on a loaded 2-core AMD EPYC with plain torch DDP
over gloo: 2 runs in 30 with destroy_process_group() at the end, 1 in 30 with a barrier before it, 0 in
30 without it; here (Intel Xeon, 2 cores) ncclavg's gloo test job, ending with a barrier and no
destroy, still aborted once in about 15 runs while other test processes loaded the machine.
The cause, from a core dump of plain torch DDP over gloo (run 37 of 37 under load, Python 3.11.7): a
process group's worker thread (ProcessGroupGloo::runLoop) drops its reference to a finished work
(AsyncAllreduceWork) after the waiter has been told it completed. When that is the last reference, the
work's tensors die on the worker thread, and a tensor that Python has seen decrements its Python object
there, which needs the GIL (pybind11 gil_scoped_acquire). If the main thread has meanwhile returned and
is in Py_FinalizeEx, CPython 3.11 ends any thread that asks for the GIL with pthread_exit. The forced
unwind crosses the work's noexcept destructor, and std::terminate aborts the process. So the race is
between the interpreter's exit and the gloo threads letting go of completed works; a barrier or
destroy_process_group() only moves the window, because the group has several worker threads. ncclavg
therefore keeps out of teardown altogether:
- it never destroys a gloo group: `Communicator.close()` leaves the process group alone, whether
  from_torch_distributed() created it (from torchrun's environment) or the user did;
- its own multi-process programs (`ncclavg bench` ranks, examples/torchrun_gloo.py, the test workers)
  end with `end_process(code)` once every rank is past its last collective: it flushes stdout, stderr
  and logging and leaves with os._exit, so no destructor runs; the kernel closes the sockets.
Groups with an NCCL backend are still destroyed: NCCL communicators must be torn down.
"""
from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import torch

from .jobs import GlooAllGather


def end_process(code: int = 0) -> None:
    """Ends this process now with exit status `code`, after flushing stdout, stderr and logging, without
    running Python's or C++'s teardown. For a rank whose collectives are all complete (after a
    barrier): see Note [Gloo teardown]. Never returns."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed or replaced streams
            pass
    logging.shutdown()
    os._exit(int(code))


def _gather(comm: Any, dist: Any, group: Any, outs: list, inp: torch.Tensor, what: Any, timeout: float) -> None:
    """A torch.distributed all_gather of `inp` into `outs` as a job of `comm`'s runner on this thread
    (after the ones queued before it), waited for: bounded by `timeout`, a failure fails the communicator
    and raises its error."""
    job = GlooAllGather(dist, group, outs, inp, what, timeout, own_timeout=timeout != comm.timeout)
    comm._runner.call(job, timeout)


def allgather_object(comm: Any, dist: Any, group: Any, obj: Any, timeout: float, device: Any = "cpu") -> list:
    """torch.distributed.all_gather_object, but every wait bounded by `timeout` (the torch version waits
    as long as the process group's own timeout, 30 min by default): sizes first, then the padded bytes."""
    what = f"{comm.backend} allgather_object (rank {comm.rank} of {comm.world_size})"
    payload = pickle.dumps(obj)
    world = comm.world_size
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _gather(comm, dist, group, sizes, size, what + " (sizes)", timeout)
    counts = [int(x.item()) for x in sizes]
    longest = max(counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    _gather(comm, dist, group, outs, mine, what + " (payload)", timeout)
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, counts)]


def debug_allgather(comm: Any, dist: Any, group: Any, record: torch.Tensor, timeout: float,
                    device: Any = "cpu") -> torch.Tensor:
    """Every process's debug record (Note [Collective sequence check] in debug.py), bounded."""
    what = f"{comm.backend} debug sequence check (rank {comm.rank} of {comm.world_size})"
    rows = [torch.empty_like(record, device=device) for _ in range(comm.world_size)]
    _gather(comm, dist, group, rows, record.to(device), what, timeout)
    return torch.stack([r.cpu() for r in rows])
