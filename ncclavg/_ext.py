"""Loads the compiled core and answers "what is available here" without touching a GPU at import."""
from __future__ import annotations

import glob
import os
import sys

try:
    from . import _C  # noqa: F401  (the compiled core)
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "ncclavg's compiled core (ncclavg._C) is missing or failed to load: "
        f"{e}. Install with `pip install .` from a source checkout."
    ) from e


def cuda_built() -> bool:
    """True when this build contains the CUDA part (decided at build time from the toolkit)."""
    return bool(_C.core_info()["cuda"])


def cuda_available() -> bool:
    """True when the CUDA part is built AND the runtime sees at least one device."""
    if not cuda_built():
        return False
    return _C.core_info().get("device_count", 0) > 0


def nccl_wheel_candidates() -> list[str]:
    """libnccl files shipped by the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels on sys.path."""
    found: list[str] = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        for sub in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            for path in sorted(glob.glob(os.path.join(entry, sub, "libnccl.so*"))):
                if path not in found:
                    found.append(path)
    return found


def nccl_info() -> dict:
    """Loads NCCL once (see Note [Finding NCCL] in csrc/cuda/nccl_api.cpp) and reports what was found:
    {loaded, path, source, version, version_code, error}. Never raises."""
    return dict(_C.nccl_load(nccl_wheel_candidates()))


def require_nccl() -> dict:
    """nccl_info(), raising NcclError with the install hint when NCCL is not usable."""
    info = nccl_info()
    if not info["loaded"]:
        raise _C.NcclError(info["error"])
    return info


def nccl_comm_class():
    """`_C.NcclComm`, after making sure NCCL is loaded (the loader must see the wheel locations first).

    Raises NcclError with the install hint when no NCCL is found, and CudaError when this build of
    ncclavg has no CUDA part. The nccl backend of `Communicator` creates its communicators through this."""
    require_nccl()
    if not hasattr(_C, "NcclComm"):
        raise _C.CudaError(
            "this build of ncclavg has no CUDA support, so the nccl backend is unavailable: install a "
            "wheel with it (pip install ncclavg-cu13) or rebuild from source with the CUDA toolkit from PyPI "
            "(NCCLAVG_CUDA=pypi pip install .) or a system one (NCCLAVG_CUDA=1 pip install .)")
    return _C.NcclComm


def nccl_unique_id() -> bytes:
    """A fresh 128-byte ncclUniqueId for `NcclComm.init_rank` (rank 0 makes it, every rank uses it)."""
    nccl_comm_class()
    return bytes(_C.nccl_unique_id())
