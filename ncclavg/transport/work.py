"""The Works both faces hand back: `JobWork` for a job a runner queued or ran (runner.py), `DoneWork` for a
call that completed where it was issued (a fast path's, or a call with nothing to do). Each is a
torch.distributed `Work` (the torch face hands it to DDP, FSDP2 and the functional collectives) and a
`Work` of ncclavg's own API (`wait(timeout)` in seconds, `done()`, `divisor`, `elapsed`,
`wait_stream()`). The other Works of the package are the CUDA backends' (an event, NCCL's streams).

Note [One Work for both faces]
A Work waits for its job and raises the job's error; what differs between the faces is only what a
waiter's own timeout means (failure.Face.wait_fails): torch's `wait(timedelta)` is the caller's patience
(the call goes on to its own deadline), the public API's `wait(seconds)` gives up for good (the runner
fails with a timeout that names the call). A torch future is made only for a job that asked for one
(runner.Job(future=True)): a Python future completed with set_exception holds the exception as its
*value*, which C++ takes for a result (DDP would crash reading it as tensors), so the future handed out
is `inner.then(_value)`, whose callback's raise marks the outer future failed the way C++ understands.
"""
from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch

try:
    import torch.distributed as _dist
    _TorchWork: Any = _dist.Work if _dist.is_available() else object
except ImportError:   # a torch build without torch.distributed: the public API's Works alone
    _TorchWork = object


def check_seconds(value: Any, argname: str = "timeout") -> float:
    """A positive finite number of seconds, else a TypeError / ValueError naming `argname`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argname}: expected seconds as a number, got {type(value).__name__}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{argname}: must be a positive finite number of seconds, got {value}")
    return float(value)


def _seconds(timeout: Any) -> Optional[float]:
    """A wait's timeout in seconds: a timedelta (torch's; 0 means none) or a number; None when none."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
        return s if s > 0 else None
    return check_seconds(timeout, "timeout")


class Work(_TorchWork):
    """Handle of an asynchronous collective. `wait(timeout=None)` blocks until it is complete (raising
    CommTimeoutError after `timeout` seconds, default the call's own timeout); `done()` polls.
    `divisor` is the division still to apply when the op was issued with defer_scale=True (1 otherwise);
    `elapsed` the seconds from start to completion once known; `finite`, once wait() returned, whether
    every value the op left in the tensors is finite, when the pass that wrote them last noted it (Note
    [Finiteness from the pass that writes] in csrc/common/finite_math.h), else None."""

    divisor: float = 1.0
    elapsed: Optional[float] = None
    finite: Optional[bool] = None

    def wait(self, timeout: Any = None) -> Any:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def is_completed(self) -> bool:
        return self.done()

    def wait_stream(self) -> None:
        """Orders the caller's current streams (each local tower's device) after THIS collective without
        blocking the host (CUDA backends); backends without streams (local on the CPU, gloo) complete it
        on the host: the same as wait(). See Note [Stream-ordered average] in ncclavg/averager.py."""
        self.wait()

    def synchronize(self) -> None:
        pass


def _value(fut: Any) -> Any:
    return fut.value()   # raises the job's exception: the outer future fails (Note [One Work for both faces])


class JobWork(Work):
    """The Work of a runner's job (runner.Job)."""

    def __init__(self, job: Any, inner: Any = None):
        super().__init__()
        self._job = job
        self._inner = inner   # the torch work a profiled point-to-point call waits for (process_group/face.py)
        self._outer: Optional[Any] = None

    def wait(self, timeout: Any = None) -> bool:
        """Waits until the job is complete and raises its error. See Note [One Work for both faces]."""
        job = self._job
        runner = job.runner
        seconds = _seconds(timeout)
        if runner is not None and runner.face.wait_fails:   # the public API
            limit, slack = job.waiter_limits(seconds)
            if not job.wait_done(limit) and not job.wait_done(slack):
                raise runner.fail_waiter(job, limit)
        elif seconds is not None:   # torch's: the caller's patience, the job goes on
            if not job.wait_done(seconds):
                raise runner.face.timeout_error(f"{job.what}: wait() gave up after {seconds:g} s (the collective "
                                                f"goes on until its own timeout of {job.timeout:g} s)")
        else:   # each queued job is bounded by its own deadline
            while not job.wait_done(1.0):
                if runner is not None and not runner.alive():
                    raise runner.face.error(f"{job.what}: the {runner.face.noun}'s worker thread is gone")
        if job.error is not None:
            raise job.error
        return True

    @property
    def finite(self) -> Optional[bool]:   # type: ignore[override]
        """What the job's writing step noted (Work.finite), once it completed."""
        return self._job.finite if self._job.done else None

    @property
    def elapsed(self) -> Optional[float]:   # type: ignore[override]
        """Seconds from the job's start to its completion, once complete."""
        job = self._job
        return None if job.started is None or job.ended is None else job.ended - job.started

    def done(self) -> bool:
        return self._job.done

    def is_success(self) -> bool:
        return self._job.done and self._job.error is None

    def exception(self) -> Optional[BaseException]:
        return self._job.error

    def result(self) -> List[torch.Tensor]:
        res = self._job.result
        return list(res) if isinstance(res, (list, tuple)) else [res]

    def get_future(self) -> Any:
        if self._outer is None:
            if self._job.future is None:
                raise RuntimeError(f"{self._job.what}: this Work has no future")
            self._outer = self._job.future.then(_value)
        return self._outer

    def _source_rank(self) -> int:   # a recv_anysource's, through the gloo work it wraps
        return self._inner._source_rank()


class DoneWork(Work):
    """A collective that completed before its Work was handed out: done (`error` None) or failed (wait()
    raises `error`). It has no __init__ of its own: a Python __init__ that calls torch's Work's costs
    ~0.4 us more per call than the inherited one, a tenth of a fast 8-byte all_reduce through torch (see
    `done_work`)."""

    _result: Any = ()
    error: Optional[BaseException] = None
    elapsed: Optional[float] = 0.0

    def wait(self, timeout: Any = None) -> bool:
        if self.error is not None:
            raise self.error
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            _seconds(timeout)   # a bad value is refused here too, as by every other Work
        return True

    def done(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self.error is None

    def exception(self) -> Optional[BaseException]:
        return self.error

    def result(self) -> List[torch.Tensor]:
        return list(self._result)

    def get_future(self) -> Any:
        fut = torch.futures.Future()
        if self.error is None:
            fut.set_result(list(self._result))
        else:
            fut.set_exception(self.error)
            return fut.then(_value)
        return fut


def done_work(result: Any = (), error: Optional[BaseException] = None, divisor: float = 1.0) -> DoneWork:
    """A DoneWork holding `result` (the torch face's output tensors), or failed with `error`."""
    work = DoneWork()
    work._result = result
    if error is not None:
        work.error = error
    if divisor != 1.0:
        work.divisor = divisor
    return work
