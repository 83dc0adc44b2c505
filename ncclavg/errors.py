"""Exception types. NcclError, CudaError and CommTimeoutError are raised by the compiled core (their
classes are created there so C++ can raise them); LayoutMismatchError is raised by the Python layer."""
from __future__ import annotations

from ._ext import _C

NcclError = _C.NcclError
CudaError = _C.CudaError
CommTimeoutError = _C.CommTimeoutError


class LayoutMismatchError(ValueError):
    """Towers (or ranks) hold parameter lists that do not line up: the message names the first
    parameter that differs (index, name when known, shape, dtype)."""
