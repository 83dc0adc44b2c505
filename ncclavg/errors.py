"""Exception types. NcclError, CudaError and CommTimeoutError are raised by the compiled core (their
classes are created there so C++ can raise them); the others are raised by the Python layer.

    CommTimeoutError (TimeoutError)   a wait ran out: names the operation, bucket, bytes and rank
    CommError (RuntimeError)          a collective failed (a peer died, a connection closed), or the
                                      communicator is unusable after an earlier failure or timeout
    CollectiveMismatchError (CommError)  NCCLAVG_DEBUG=1: ranks issued different collectives (one skipped
                                      or reordered a bucket); raised on every rank
    LayoutMismatchError (ValueError)  towers/ranks hold parameter lists that do not line up
    UsageError (ValueError)           a bad command-line argument of `ncclavg bench` / `ncclavg train`
    BackendError (torch's DistBackendError and CommError)  a collective of the `ncclavg` torch.distributed
                                      backend failed, or its group refused one after an earlier failure
    BackendTimeoutError (BackendError)   one of them did not complete within its timeout
    BackendMismatchError (BackendError)  the ranks called different collectives: raised on every rank

The three Backend* classes derive from torch.distributed's DistBackendError, so that torch's launchers and
users' `except DistBackendError` see them; `import ncclavg` loads no torch, so they are made on first
use (module `__getattr__`), once, and are the same classes everywhere after that.
"""
from __future__ import annotations

import threading
from typing import Any

from ._ext import _C

NcclError = _C.NcclError
CudaError = _C.CudaError
CommTimeoutError = _C.CommTimeoutError


class CommError(RuntimeError):
    """A collective failed on this rank (for example a peer process died and its connection closed), or
    the communicator refused a call because an earlier collective failed or timed out: after that the
    ranks no longer agree on which collective comes next, so the communicator cannot be used again."""


class CollectiveMismatchError(CommError):
    """Debug mode (NCCLAVG_DEBUG=1): the ranks' n-th collectives differ (operation, size, dtype, step,
    bucket or bucket fingerprint); the message lists what each rank issued."""


class ReplicaMismatchError(RuntimeError):
    """The data-parallel replicas no longer hold the same bytes (Note [The replica check] in
    ncclavg/transport/replicas.py): the message names each rank and replica that differs from the others
    and the first bucket or parameter where it does. Raised on every rank of the check."""


class LayoutMismatchError(ValueError):
    """Towers (or ranks) hold parameter lists that do not line up: the message names the first
    parameter that differs (index, name when known, shape, dtype)."""


class UsageError(ValueError):
    """A bad command-line argument of an `ncclavg` subcommand, raised before anything starts: the
    `ncclavg` command prints it on one line (`ncclavg bench: error: --towers: must be >= 1, got 0`) and
    exits with code 2."""

    @classmethod
    def check_at_least(cls, flag: str, value: object, lo: int = 1) -> None:
        """Raises `flag: must be >= lo, got value` unless value is None (flag not given) or >= lo."""
        if value is not None and value < lo:  # type: ignore[operator]
            raise cls(f"{flag}: must be >= {lo}, got {value}")


def is_timeout(e: BaseException) -> bool:
    """Whether `e` is a wait that ran out (the one place that decides it).

    ncclavg's own errors say so by type: CommTimeoutError (a TimeoutError), the torch backend's
    BackendTimeoutError, and the channel's failures an `is_timeout` flag (shm.py). The errors of
    torch's gloo and store are one type for everything (DistBackendError / RuntimeError), so for them
    alone their text decides: "Timed out" / "timeout", as torch's launchers read it."""
    flag = getattr(e, "is_timeout", None)
    if flag is not None:
        return bool(flag)
    if isinstance(e, TimeoutError):
        return True
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


_BACKEND_ERRORS = ("BackendError", "BackendTimeoutError", "BackendMismatchError")
_backend_errors_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name not in _BACKEND_ERRORS:
        raise AttributeError(f"module 'ncclavg.errors' has no attribute {name!r}")
    with _backend_errors_lock:   # two threads asking at once must get one class, not two
        if name not in globals():
            globals().update(_make_backend_errors())
    return globals()[name]


def _make_backend_errors() -> dict:
    import torch.distributed as dist

    class BackendError(dist.DistBackendError, CommError):
        """A collective of the `ncclavg` backend failed (a peer process died, the channel was aborted, the
        ranks called different collectives), or the process group refused a collective because an earlier
        one failed. Both torch's DistBackendError and ncclavg's CommError."""

        is_timeout = False   # by type, never by its text (is_timeout): BackendTimeoutError says True

    class BackendTimeoutError(BackendError):
        """A collective of the `ncclavg` backend did not complete within its timeout; the message names the
        rank that stopped responding when that can be told."""

        is_timeout = True

    class BackendMismatchError(BackendError):
        """The ranks called different collectives (or the same one with different sizes, dtypes, ops or
        roots): raised on every rank, naming both calls."""

    made = {"BackendError": BackendError, "BackendTimeoutError": BackendTimeoutError,
            "BackendMismatchError": BackendMismatchError}
    for cls in made.values():   # pickled by reference (Ray, multiprocessing): ncclavg.errors.<name>
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return made
