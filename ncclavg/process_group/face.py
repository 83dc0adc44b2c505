"""What the `ncclavg` torch.distributed backend (group.py) adds to the transport's runner
(transport/runner.py), which runs its CPU collectives: its face (`FACE`: torch's DistBackendError family,
"process group" in its messages, Work.wait(timeout) as the caller's patience) and the Work of a
point-to-point call issued while torch's profiler runs.

Note [A runner per process group]
torch.distributed lets a caller issue a collective and wait for it later (DDP issues one all-reduce per
bucket while backward goes on). So each process group has a runner: a collective issued with
async_op=True (and every collective DDP, FSDP2 or a functional collective issues from C++) is queued and
returns at once (except a small one whose peers are already in it: Note [An asynchronous call whose
peers wait] in csrc/transport/shm_channel.cpp); the worker runs the queued collectives in order, each to
completion, through the shared-memory channel (which releases the GIL while it works, so backward keeps
computing) or through the group's inner gloo. A collective whose caller waits at once (async_op=False)
runs on the caller's thread when nothing is queued (except while torch's profiler runs: Note [Profiler
ranges of a Python backend] in profiling.py). Every CPU collective of a group goes through its runner,
the gloo fallbacks too, so they complete in the order they were issued, as the ranks issued them
(point-to-point calls do not: a recv that waits for a later send would block the runner, see group.py).

Note [What a job records]
A job issued with a flight recorder on carries its record (`rec`, flight.py) and, when issued while
torch's profiler runs, its open profiler range (`prof`, profiling.py): the runner marks the record
running when it starts the job; completing the job marks it done or failed and ends the range, on
whichever thread completes it. The runner's first failure hands the recorder the failure and the job it
happened in (Note [What the recorder says] in flight.py).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from .. import errors
from ..errors import BackendError, BackendMismatchError, BackendTimeoutError  # noqa: F401  (re-exported)
from ..transport import profiling
from ..transport.failure import Face
from ..transport.runner import Job
from ..transport.work import JobWork

# torch's Work.wait(timeout) is the caller's patience; the group's errors are torch's and ncclavg's at once
FACE = Face(noun="process group", error=errors.BackendError, timeout_error=errors.BackendTimeoutError,
            mismatch_error=errors.BackendMismatchError, wait_fails=False)


def profiled_p2p(work: Any, job: Job) -> JobWork:
    """The Work of a point-to-point call gloo runs (`work`), issued while torch's profiler runs: `job`'s
    range ends when gloo's work completes, seen by a thread of its own that waits for it (gloo's send and
    recv works offer no future to hang a callback on), and the Work's wait() returns once it has ended
    (Note [Profiler ranges of a Python backend] in profiling.py). Costs a thread per call, only while
    profiling."""
    def await_gloo() -> None:
        error: Optional[BaseException] = None
        try:
            work.wait()   # bounded by the group's timeout (gloo's own)
        except BaseException as e:   # noqa: BLE001 (handed to the waiter)
            error = e
        if job.prof is not None:   # on a long-lived thread: this one ends now (profiling._Closer)
            profiling.end_elsewhere(job.prof)
            job.prof = None
        job.complete(error)

    threading.Thread(target=await_gloo, name="ncclavg-p2p-profile", daemon=True).start()
    return JobWork(job, inner=work)
