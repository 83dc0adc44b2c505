"""ncclavg's PEP 517 build backend: setuptools.build_meta, plus the PyPI CUDA toolkit as a build
requirement when NCCLAVG_CUDA=pypi.

Note [The PyPI CUDA toolkit]
NVIDIA publishes the CUDA 13 compiler as wheels: nvidia-cuda-nvcc (nvcc, ptxas, fatbinary, nvlink),
nvidia-nvvm (cicc, libdevice), nvidia-cuda-crt (the crt/ headers nvcc needs), nvidia-cuda-runtime
(cuda_runtime.h, libcudart_static.a) and nvidia-cuda-cccl (nv/target, cuda/std). All of them unpack
into one tree, site-packages/nvidia/cu13/{bin,include,lib,nvvm}, which is a toolkit layout setup.py
can use as CUDA_HOME. With NCCLAVG_CUDA=pypi this backend asks pip to put them in the isolated build
environment (nothing lands in the user's environment) and setup.py builds with that tree only.
The pin is the oldest minor of the major (13.0.*): the PTX the build embeds is JIT-compiled by any
driver of the major only when the compiler is not newer than the driver, and cudart is linked
statically, so the oldest minor works everywhere the major does. NCCLAVG_CUDA_PYPI_VERSION overrides it
(e.g. "13.2.*").
CUDA 12 is not offered: nvidia-cuda-nvcc-cu12 (12.6, 12.8 and 12.9 looked at) ships ptxas and libnvvm
but neither the nvcc driver nor cicc, so no CUDA 12 source can be compiled from PyPI alone; a CUDA 12
build needs a toolkit tree (NCCLAVG_CUDA=1 CUDA_HOME=...): a system toolkit, or the one
scripts/cuda12_toolkit.sh makes from Debian's packages of CUDA 12.4.
"""
from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook this module does not override)

__all__ = list(_setuptools.__all__)

# The distributions of the toolkit, per CUDA major; the version spec is appended.
PYPI_TOOLKIT = {
    "13": ["nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-runtime", "nvidia-cuda-cccl"],
}
PYPI_TOOLKIT_VERSION = {"13": "13.0.*"}
NO_PYPI_TOOLKIT = {
    "12": "the PyPI wheels of CUDA 12 (nvidia-cuda-nvcc-cu12) hold ptxas but not nvcc nor cicc, so CUDA 12 "
          "cannot be compiled from PyPI; install a CUDA 12 toolkit and build with NCCLAVG_CUDA=1 "
          "(CUDA_HOME=...), or use CUDA 13 (NCCLAVG_CUDA_MAJOR=13)",
}


class ToolkitError(SystemExit):
    pass


def cuda_mode() -> str:
    return os.environ.get("NCCLAVG_CUDA", "auto").strip().lower()


def pypi_major() -> str:
    major = os.environ.get("NCCLAVG_CUDA_MAJOR", "13").strip()
    if major in NO_PYPI_TOOLKIT:
        raise ToolkitError(f"ncclavg build: NCCLAVG_CUDA=pypi with NCCLAVG_CUDA_MAJOR={major}: "
                           f"{NO_PYPI_TOOLKIT[major]}")
    if major not in PYPI_TOOLKIT:
        raise ToolkitError(f"ncclavg build: NCCLAVG_CUDA_MAJOR must be 13 (or 12 with a system toolkit), "
                           f"got '{major}'")
    return major


def pypi_toolkit_requirements(major: str | None = None) -> list[str]:
    """The requirement strings of the PyPI CUDA toolkit of `major` (default: NCCLAVG_CUDA_MAJOR or 13)."""
    major = major or pypi_major()
    version = os.environ.get("NCCLAVG_CUDA_PYPI_VERSION", "").strip() or PYPI_TOOLKIT_VERSION[major]
    if version[0] not in "=<>!~":
        version = "==" + version
    return [name + version for name in PYPI_TOOLKIT[major]]


def _with_toolkit(requires: list[str]) -> list[str]:
    if cuda_mode() == "pypi":
        return [*requires, *pypi_toolkit_requirements()]
    return requires


def get_requires_for_build_wheel(config_settings=None):
    return _with_toolkit(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _with_toolkit(_setuptools.get_requires_for_build_editable(config_settings))
