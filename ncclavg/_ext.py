"""Loads the compiled core and answers "what is available here" without touching a GPU at import."""
from __future__ import annotations

import glob
import os
import sys
import threading
from typing import List

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


# Note [Setting NCCL_RUNTIME_CONNECT once]
# Blocking collectives want NCCL's connections made inside the bounded init (Note [Connections inside the
# bounded init] in csrc/cuda/comm_init.cpp), i.e. NCCL_RUNTIME_CONNECT=0 before NCCL's first communicator.
# Changing the environment is a race with every thread that reads it (setenv vs getenv is undefined
# behaviour, and NCCL's and torch's threads read it), so it is done once per process, from Python, at
# the earliest point that says NCCL communicators are coming: the import of ncclavg.comm (which the
# Communicator, the `ncclavg` torch backend and the DDP hook all import), or the first
# nccl_comm_class() of code that uses the core's NcclComm without it. Never at `import ncclavg` (a
# program that uses only the core's ops and optimizers with torch's own NCCL is left alone), never from
# the C++ init (any thread, any time). What it does to torch: NCCL reads the variable once per process,
# so torch's own NCCL communicators made later in this process (DDP over nccl, the `ncclavg` backend's
# inner NCCL group) also connect at init, with every algorithm's buffers; docs/building.md says so.
# A user value of the variable (0 or 1) is never touched: set NCCL_RUNTIME_CONNECT=1 to keep NCCL's lazy
# connections everywhere (collective_mode_reason then names the risk). With
# NCCLAVG_NCCL_COLLECTIVES=nonblocking, or a value the init will refuse, nothing is set.
RUNTIME_CONNECT_ENV = "NCCL_RUNTIME_CONNECT"
_runtime_connect_lock = threading.Lock()
_runtime_connect_done = False


def default_nccl_runtime_connect() -> bool:
    """Sets NCCL_RUNTIME_CONNECT=0 when it is unset and collectives are blocking, the first time it is
    called in this process; later calls do nothing. See Note [Setting NCCL_RUNTIME_CONNECT once].
    Returns True when this call set the variable."""
    global _runtime_connect_done
    with _runtime_connect_lock:
        if _runtime_connect_done:
            return False
        _runtime_connect_done = True
        if os.environ.get("NCCLAVG_NCCL_COLLECTIVES", "") not in ("", "blocking"):
            return False
        if RUNTIME_CONNECT_ENV in os.environ:
            return False
        os.environ[RUNTIME_CONNECT_ENV] = "0"
        return True


def nccl_comm_class():
    """`_C.NcclComm`, after making sure NCCL is loaded (the loader must see the wheel locations first).

    Raises NcclError with the install hint when no NCCL is found, and CudaError when this build of
    ncclavg has no CUDA part. The nccl backend of `Communicator` creates its communicators through this."""
    default_nccl_runtime_connect()   # before any NCCL communicator: See Note [Setting NCCL_RUNTIME_CONNECT once]
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


# ---------------------------------------------------------------------- UCX between hosts
# Finding and loading libucp (Note [Finding UCX] in csrc/transport/ucx_api.cpp) and the settings of the
# lanes between hosts (Note [Choosing UCX between hosts] in transport/ucx.py): what `ncclavg info` shows
# and transport/ucx.py starts from.
_SETTINGS = {"0": "off", "off": "off", "1": "on", "on": "on", "auto": "auto", "": "auto"}
# UCX transports that move data through this machine's memory, never over a link (Note [Choosing UCX
# between hosts])
_LOCAL_TLS = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "all")


def ucx_setting() -> str:
    """NCCLAVG_UCX as "off", "on" or "auto"."""
    raw = os.environ.get("NCCLAVG_UCX", "auto").strip().lower()
    if raw not in _SETTINGS:
        raise ValueError(f"NCCLAVG_UCX must be 0, 1 or auto, got '{raw}'")
    return _SETTINGS[raw]


def ucx_transports() -> str:
    """NCCLAVG_UCX_TLS (default "tcp"), refused when it names a transport through local memory."""
    raw = os.environ.get("NCCLAVG_UCX_TLS", "tcp").strip()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if n.lstrip("^") in _LOCAL_TLS]
    if not names or bad:
        raise ValueError(f"NCCLAVG_UCX_TLS must list UCX network transports (tcp, rc, ud, dc, ...), got '{raw}'"
                         + (f": {', '.join(bad)} would move data through this machine's memory" if bad else ""))
    return ",".join(names)


def hosts_interfaces() -> List[str]:
    """NCCLAVG_HOSTS_IFNAME, else GLOO_SOCKET_IFNAME, split at commas ([] : UCX chooses)."""
    raw = os.environ.get("NCCLAVG_HOSTS_IFNAME", "").strip() or os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    return [n.strip() for n in raw.split(",") if n.strip()]


def devices_for(lanes: List[int], nics: List[str]) -> str:
    """UCX_NET_DEVICES for a process carrying `lanes`: interface k % len(nics) of each lane k."""
    if not nics:
        return ""
    chosen: List[str] = []
    for k in lanes:
        nic = nics[k % len(nics)]
        if nic not in chosen:
            chosen.append(nic)
    return ",".join(chosen)


def ucx_candidates() -> List[str]:
    """Where libucp is looked for, in order (Note [Finding UCX] in csrc/transport/ucx_api.cpp)."""
    out = []
    explicit = os.environ.get("NCCLAVG_UCX_LIBRARY", "").strip()
    if explicit:
        out.append(explicit)
    try:
        import libucx   # the libucx-cu12 / -cu13 wheel

        lib = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
        if os.path.isfile(lib):
            out.append(lib)
    except ImportError:
        pass
    out.append("libucp.so.0")
    return out


def ucx_load() -> dict:
    """Loads libucp once per process: {"loaded", "path", "version", "error"}."""
    return dict(_C.ucx_load(ucx_candidates()))


def ucx_info() -> dict:
    """What `ncclavg info` shows of the engine between hosts: whether it would be used, UCX's version and
    path (or why not), its transports and interfaces."""
    out: dict = {"setting": os.environ.get("NCCLAVG_UCX", "auto") or "auto"}
    try:
        out["engine"] = "gloo" if ucx_setting() == "off" else "ucx"
        out["tls"] = ucx_transports()
    except ValueError as e:
        out.update(engine="gloo", error=str(e))
        return out
    if out["engine"] == "ucx":
        found = ucx_load()
        out.update(loaded=found["loaded"], version=found["version"], path=found["path"])
        if not found["loaded"]:
            out.update(engine="gloo", error=found["error"])
    out["interfaces"] = hosts_interfaces() or "UCX's choice"
    return out
