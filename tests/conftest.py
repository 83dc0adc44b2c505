"""Shared fixtures. Nothing here touches a GPU at import or collection time.

The tests are grouped like the package: tests/transport, tests/comm, tests/process_group, tests/train and
tests/bench; the core's tests and the helpers they all share (_gpu.py, _dist_util.py, ...) stay here, and
the rank workers live beside the tests that run them. This folder and the folders whose workers other
tests import are put on sys.path, so that every test (and every rank a test spawns, which inherits
sys.path) can import those helpers by name.
"""
from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in ("process_group", "transport", ""):   # tests/ first on the path
    sys.path.insert(0, os.path.join(_HERE, _folder) if _folder else _HERE)

from ncclavg import _C


def _has_cuda_device() -> bool:
    try:
        return bool(_C.core_info().get("device_count", 0))
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda_device():
        return
    from ncclavg.info import no_gpu_reason   # words that are true here: Note [Saying why there is no GPU]

    reason = (no_gpu_reason() if _C.core_info()["cuda"] else
              "ncclavg's CUDA build is none (CPU-only)" + (f"; and {no_gpu_reason()}" if no_gpu_reason() else ""))
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=list(_C.simd_levels_supported()))
def simd_level(request):
    """Runs a test once per SIMD level this CPU supports, restoring the default afterwards."""
    _C.set_simd_level(request.param)
    yield request.param
    _C.set_simd_level(os.environ.get("NCCLAVG_SIMD", "auto"))
