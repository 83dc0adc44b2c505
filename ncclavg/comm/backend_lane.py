"""The torch backend's errors at their old address: they live in ncclavg/errors.py (`ncclavg.errors.
BackendError`, `BackendTimeoutError`, `BackendMismatchError`). Kept for programs that catch
`ncclavg.comm.backend_lane.BackendError`."""
from typing import Any

from .. import errors as _errors

_MOVED = ("BackendError", "BackendTimeoutError", "BackendMismatchError")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(_errors, name)   # made on first use there (they derive from torch's DistBackendError)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
