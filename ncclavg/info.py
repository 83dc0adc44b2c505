"""`ncclavg.build_info()` and the text of `ncclavg info`: what a bug report pastes."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
from pathlib import Path

from ._ext import _C, nccl_info
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
                 "PyPI (NCCLAVG_CUDA=pypi pip install --force-reinstall --no-deps ncclavg) or with a system "
                 "toolkit (NCCLAVG_CUDA=1 CUDA_HOME=/path/to/cuda pip install ...); see docs/building.md")


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
        "device_count": core.get("device_count", 0),
        "devices": [f"{n} (sm_{c.replace('.', '')})" for n, c in
                    zip(core.get("device_names", []), core.get("device_capabilities", []))],
        "build": build_record(),
        "cuda_hint": cuda_hint(bool(core["cuda"])),
        "nccl": nccl_info(),
        "simd_level": core["simd_level"],
        "simd_best_supported": core["simd_best_supported"],
        "simd_levels_supported": list(_C.simd_levels_supported()),
        "openmp_threads": core["openmp_threads"],
        "compiler": core["compiler"],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _module_version("torch"),
        "cupy": _module_version("cupy"),
        "numpy": _module_version("numpy"),
    }
    return info


def format_info(info: dict) -> str:
    """The human-readable `ncclavg info` text."""
    nccl = info["nccl"]
    if not info["cuda"]:
        reason = info.get("build", {}).get("reason", "")
        cuda_line = f"no (CPU-only build{': ' + reason if reason else ''})"
        if info.get("cuda_hint"):
            cuda_line += "\n" + " " * 16 + info["cuda_hint"]
    else:
        cuda_line = f"yes, archs {';'.join(info['cuda_archs'])}, runtime {info['cuda_runtime']}"
    if not info["cuda"]:
        driver_line = "n/a (CPU-only build)"
    elif info["driver"]:
        driver_line = info["driver"] + (f" ({info['driver_error']})" if info["driver_error"] else "")
    else:
        driver_line = f"not usable: {info['driver_error'] or 'no driver'}"
    if nccl["loaded"]:
        nccl_line = f"{nccl['version']} from {nccl['path']} ({nccl['source']})"
    else:
        # First line: what to install; then one indented line per place that was tried.
        nccl_line = "not found: " + "\n                ".join(
            line.strip() for line in nccl["error"].splitlines() if line.strip())
    simd = info["simd_level"]
    if simd != info["simd_best_supported"]:
        simd += f" (forced; best supported {info['simd_best_supported']})"
    rows = [
        ("ncclavg", info["version"]),
        ("CUDA built", cuda_line),
        ("CUDA driver", driver_line),
        ("devices", f"{info['device_count']}" + (": " + ", ".join(info["devices"]) if info["devices"] else "")),
        ("NCCL", nccl_line),
        ("SIMD", f"{simd} (supported: {', '.join(info['simd_levels_supported'])})"),
        ("OpenMP threads", str(info["openmp_threads"])),
        ("compiler", info["compiler"]),
        ("python", f"{info['python']} on {info['platform']}"),
        ("torch", info["torch"] or "not importable"),
        ("cupy", info["cupy"] or "not importable"),
        ("numpy", info["numpy"] or "not importable"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def env_overrides() -> dict:
    """The NCCLAVG_* variables that change behaviour at run time, as set now."""
    return {k: v for k, v in os.environ.items() if k.startswith("NCCLAVG_")}
