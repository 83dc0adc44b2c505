"""The SIMD level files of csrc/cpu each architecture compiles (Note [Run-time ISA dispatch] in
csrc/cpu/simd.h): a build compiles its own architecture's and none of the others' (their pragmas and
intrinsics do not exist there). Used by setup.py and by the emulated-CUDA build of the whole core
(csrc/cuda/emu/build_pycore.py)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

# architecture -> its level files' suffixes (kernels_<level>.cpp, pack_<level>.cpp, optim_<level>.cpp)
ISA_LEVELS = {"x86_64": ("avx2", "avx512"), "aarch64": ("neon", "sve")}


def _canonical(machine: str) -> str:
    """x86_64 / aarch64 whatever the platform calls them (amd64, arm64)."""
    machine = machine.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def host_machine() -> str:
    """The architecture of the machine this runs on (whatever a cross build targets)."""
    return _canonical(platform.machine())


def target_machine() -> str:
    """The architecture being built for: this machine's, unless _PYTHON_HOST_PLATFORM names another
    (the cross-build variable CPython's own build and setuptools' wheel platform tag honour, e.g.
    linux-aarch64; scripts/build_wheels.sh --arch aarch64 sets it), so that the level files and the
    wheel's tag cannot disagree."""
    host = os.environ.get("_PYTHON_HOST_PLATFORM", "").strip()
    return _canonical(host.rsplit("-", 1)[-1]) if host else host_machine()


def foreign(path: str | Path, machine: str) -> bool:
    """Is `path` a level file of an architecture other than `machine`?"""
    others = {lvl for arch, lvls in ISA_LEVELS.items() if arch != machine for lvl in lvls}
    return Path(path).stem.rsplit("_", 1)[-1] in others
