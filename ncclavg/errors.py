"""Exception types. NcclError, CudaError and CommTimeoutError are raised by the compiled core (their
classes are created there so C++ can raise them); the others are raised by the Python layer.

    CommTimeoutError (TimeoutError)   a wait ran out: names the operation, bucket, bytes and rank
    CommError (RuntimeError)          a collective failed (a peer died, a connection closed), or the
                                      communicator is unusable after an earlier failure or timeout
    CollectiveMismatchError (CommError)  NCCLAVG_DEBUG=1: ranks issued different collectives (one skipped
                                      or reordered a bucket); raised on every rank
    LayoutMismatchError (ValueError)  towers/ranks hold parameter lists that do not line up
    UsageError (ValueError)           a bad command-line argument of `ncclavg bench` / `ncclavg train`
"""
from __future__ import annotations

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
