"""`ncclavg.build_info()` and the text of `ncclavg info`: what a bug report pastes."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
from pathlib import Path

from ._ext import _C, nccl_info
from ._ext import ucx_info
from ._version import __version__


def _module_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # not installed, or broken: either way "not importable"
        return None


def _cuda_version_string(code: int) -> str:
    return f"{code // 1000}.{(code % 1000) // 10}" if code else ""


def build_record() -> dict:
    """How the core was built ({mode, cuda, decision, reason, cuda_home, pypi_toolkit}), as setup.py
    recorded it next to the extension; {} for a core built before it kept the record."""
    try:
        return json.loads((Path(__file__).resolve().parent / "_build.json").read_text())
    except (OSError, ValueError):
        return {}


def nvidia_driver_evidence() -> str:
    """Why this machine looks like it has an NVIDIA driver ("" when it does not): the kernel module's
    /proc entry, or libcuda.so.1 loadable. Loading libcuda does not touch a GPU."""
    if os.path.exists("/proc/driver/nvidia"):
        return "/proc/driver/nvidia exists"
    try:
        ctypes.CDLL("libcuda.so.1")
        return "libcuda.so.1 loads"
    except OSError:
        return ""


CPU_ONLY_HINT = ("this machine has an NVIDIA driver ({evidence}) but this ncclavg has no CUDA part: install a "
                 "wheel with it (pip install ncclavg-cu13), or rebuild from source with the CUDA toolkit from "
                 "PyPI (NCCLAVG_CUDA=pypi pip install --no-cache-dir --force-reinstall --no-deps ncclavg) or with a system "
                 "toolkit (NCCLAVG_CUDA=1 CUDA_HOME=/path/to/cuda pip install ...); see docs/building.md")


NO_DRIVER = "no NVIDIA driver on this machine (no /proc/driver/nvidia, libcuda.so.1 does not load), so no GPU"


def no_gpu_reason(core: dict | None = None) -> str:
    """Why ncclavg finds no GPU here, in the words of what is true on this machine ("" when its CUDA
    runtime sees one). See Note [Saying why there is no GPU]."""
    core = dict(_C.core_info()) if core is None else core
    if core.get("device_count", 0):
        return ""
    evidence = nvidia_driver_evidence()
    if not evidence:
        return NO_DRIVER
    if not core.get("cuda"):
        return f"an NVIDIA driver is here ({evidence}), but ncclavg's CUDA build is none (CPU-only)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (f"an NVIDIA driver is here ({evidence}{hidden}) but no GPU is usable: "
            f"{core.get('driver_error') or 'the CUDA runtime reports no device'}")


def torch_cuda_build() -> str:
    """"torch's CUDA build: 13.0", "... none (torch 2.13.0+cpu)", or that torch is not importable.

    Note [Saying why there is no GPU]
    Two CUDA builds meet in a process and either can be missing: torch's (torch.version.cuda; a +cpu
    wheel has none) and ncclavg's (its compiled CUDA part; `ncclavg info`'s "ncclavg's CUDA build").
    Messages name them apart, as "torch's CUDA build" and "ncclavg's CUDA build", never "CUDA build"
    alone. Where there is no GPU they say the machine's state: the CUDA runtime's own error for a missing
    libcuda is cudaErrorInsufficientDriver ("CUDA driver version is insufficient"), which on a machine
    with no NVIDIA driver at all is not what is true; so when neither the kernel module's /proc entry nor
    libcuda.so.1 is there, the words are "no NVIDIA driver ..., so no GPU", and the runtime's error is
    kept for a driver that is there but does not work (too old, no device, hidden devices)."""
    try:
        import torch
    except Exception:   # not installed, or broken
        return "torch is not importable"
    build = getattr(torch.version, "cuda", None)
    return f"torch's CUDA build: {build}" if build else f"torch's CUDA build: none (torch {torch.__version__})"


def torch_no_gpu_reason() -> str:
    """Why torch.cuda sees no GPU here: no driver, torch's CUDA build being none, or the driver's own
    error, whichever are true (joined by '; '). See Note [Saying why there is no GPU]."""
    parts = []
    evidence = nvidia_driver_evidence()
    if not evidence:
        parts.append(NO_DRIVER)
    if not _torch_cuda_version():
        parts.append(torch_cuda_build())
    if not parts:
        core = dict(_C.core_info())
        err = core.get("driver_error") if core.get("cuda") else ""
        parts.append(f"an NVIDIA driver is here ({evidence}) but torch.cuda.is_available() is False"
                     + (f" ({err})" if err else ""))
    return "; ".join(parts)


def _torch_cuda_version() -> str | None:
    try:
        import torch
    except Exception:
        return None
    return getattr(torch.version, "cuda", None)


def cuda_hint(cuda_built: bool) -> str:
    """What to do to get the CUDA half, when it is missing and a driver is there; "" otherwise."""
    if cuda_built:
        return ""
    evidence = nvidia_driver_evidence()
    return CPU_ONLY_HINT.format(evidence=evidence) if evidence else ""


def build_info() -> dict:
    """Versions, build options and what this machine offers. Never raises and never needs a GPU."""
    core = dict(_C.core_info())
    info = {
        "version": __version__,
        "core_version": core["version"],
        "cuda": core["cuda"],
        "cuda_archs": core["cuda_archs"].split(";") if core["cuda_archs"] else [],
        "cuda_runtime": _cuda_version_string(core.get("cuda_runtime_version", 0)),
        "driver": _cuda_version_string(core.get("driver_version", 0)),
        "driver_error": core.get("driver_error", ""),
        "no_gpu_reason": no_gpu_reason(core),
        "device_count": core.get("device_count", 0),
        "devices": [f"{n} (sm_{c.replace('.', '')})" for n, c in
                    zip(core.get("device_names", []), core.get("device_capabilities", []))],
        "build": build_record(),
        "cuda_hint": cuda_hint(bool(core["cuda"])),
        "nccl": nccl_info(),
        "between_hosts": ucx_info(),
        "simd_level": core["simd_level"],
        "simd_best_supported": core["simd_best_supported"],
        "simd_levels_supported": list(_C.simd_levels_supported()),
        "openmp_threads": core["openmp_threads"],
        "compiler": core["compiler"],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _module_version("torch"),
        "torch_cuda": _torch_cuda_version(),
        "cupy": _module_version("cupy"),
        "numpy": _module_version("numpy"),
    }
    return info


LABEL_WIDTH = len("ncclavg's CUDA build")   # the longest label of format_info's rows
CONTINUED = "\n" + " " * (LABEL_WIDTH + 2)   # a value's next line, under its first


def format_info(info: dict) -> str:
    """The human-readable `ncclavg info` text."""
    nccl = info["nccl"]
    if not info["cuda"]:
        reason = info.get("build", {}).get("reason", "")
        cuda_line = f"none (built CPU-only{': ' + reason if reason else ''})"
        if info.get("cuda_hint"):
            cuda_line += CONTINUED + info["cuda_hint"]
    else:
        cuda_line = f"yes, archs {';'.join(info['cuda_archs'])}, runtime {info['cuda_runtime']}"
    if info.get("no_gpu_reason") == NO_DRIVER:   # See Note [Saying why there is no GPU]
        driver_line = "none: " + NO_DRIVER
    elif not info["cuda"]:
        driver_line = "n/a (ncclavg's CUDA build is none)"
    elif info["driver"]:
        driver_line = info["driver"] + (f" ({info['driver_error']})" if info["driver_error"] else "")
    else:
        driver_line = f"not usable: {info['driver_error'] or 'no driver'}"
    if nccl["loaded"]:
        nccl_line = f"{nccl['version']} from {nccl['path']} ({nccl['source']})"
    else:
        # First line: what to install; then one indented line per place that was tried.
        nccl_line = "not found: " + CONTINUED.join(
            line.strip() for line in nccl["error"].splitlines() if line.strip())
    simd = info["simd_level"]
    if simd != info["simd_best_supported"]:
        simd += f" (forced; best supported {info['simd_best_supported']})"
    rows = [
        ("ncclavg", info["version"]),
        ("ncclavg's CUDA build", cuda_line),
        ("CUDA driver", driver_line),
        ("devices", f"{info['device_count']}" + (": " + ", ".join(info["devices"]) if info["devices"] else "")),
        ("NCCL", nccl_line),
        ("between hosts", _hosts_line(info["between_hosts"])),
        ("SIMD", f"{simd} (supported: {', '.join(info['simd_levels_supported'])})"),
        ("OpenMP threads", str(info["openmp_threads"])),
        ("compiler", info["compiler"]),
        ("python", f"{info['python']} on {info['platform']}"),
        ("torch", f"{info['torch']} (torch's CUDA build: {info.get('torch_cuda') or 'none'})" if info["torch"]
         else "not importable"),
        ("cupy", info["cupy"] or "not importable"),
        ("numpy", info["numpy"] or "not importable"),
    ]
    return "\n".join(f"{k:<{LABEL_WIDTH}}  {v}" for k, v in rows)


def _hosts_line(h: dict) -> str:
    """The engine between hosts: UCX's version, path, transports and interfaces, or why gloo."""
    if h["engine"] == "ucx":
        return (f"UCX {h['version']} from {h['path']} (transports {h['tls']}, interfaces "
                f"{h['interfaces'] if isinstance(h['interfaces'], str) else ','.join(h['interfaces'])})")
    why = h.get("error") or "NCCLAVG_UCX=0"
    return "gloo: " + CONTINUED.join(line.strip() for line in why.splitlines() if line.strip())


def env_overrides() -> dict:
    """The NCCLAVG_* variables that change behaviour at run time, as set now."""
    return {k: v for k, v in os.environ.items() if k.startswith("NCCLAVG_")}
