"""Helpers of the GPU tests (tests/test_gpu_*.py). Nothing here touches a GPU at import: every check
runs inside a test, so collection works on any machine, and tests skip with the reason."""
from __future__ import annotations

import numpy as np
import pytest

import ncclavg
from ncclavg import _ext


def require_cuda(min_devices: int = 1):
    """torch with CUDA and >= min_devices devices, or skip. Returns the torch module."""
    from ncclavg.info import no_gpu_reason, torch_no_gpu_reason

    if not ncclavg.cuda_built():
        pytest.skip("ncclavg's CUDA build is none (NCCLAVG_CUDA=0 or no toolkit at build time)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU: " + torch_no_gpu_reason())
    if not ncclavg.cuda_available():
        pytest.skip("ncclavg sees no GPU: " + no_gpu_reason())
    n = torch.cuda.device_count()
    if n < min_devices:
        pytest.skip(f"needs {min_devices} CUDA devices, {n} visible")
    return torch


def require_nccl_comm():
    """_C.NcclComm with NCCL loaded, or skip naming what is missing."""
    require_cuda()
    info = _ext.nccl_info()
    if not info["loaded"]:
        pytest.skip("no NCCL: " + info["error"].splitlines()[0])
    return _ext.nccl_comm_class()


def nccl_version() -> tuple[int, int, int]:
    info = _ext.nccl_info()
    return tuple(int(x) for x in info["version"].split(".")) if info["loaded"] else (0, 0, 0)


TORCH_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


def tdtype(torch, name: str):
    return getattr(torch, name)


def exact_rank_inputs(n_ranks: int, numel: int, seed: int) -> np.ndarray:
    """float64 [n_ranks, numel] whose mean over ranks is exact in every supported dtype, in every
    summation order, and after a 1/n pre-multiply when n is a power of two: a mean m in {-2..2} in
    quarter steps plus zero-sum deviations d (pairs +d/-d, the middle rank 0), |values| <= 4 in quarter
    steps, so every partial sum is a multiple of 1/4 below 4n <= 64: exact in bfloat16's 8 bits."""
    rng = np.random.default_rng(seed)
    m = rng.integers(-8, 9, size=numel) / 4.0
    x = np.empty((n_ranks, numel))
    for r in range(n_ranks // 2):
        d = rng.integers(-8, 9, size=numel) / 4.0
        x[r] = m + d
        x[n_ranks - 1 - r] = m - d
    if n_ranks % 2:
        x[n_ranks // 2] = m
    return x


def to_f64(t) -> np.ndarray:
    return t.detach().float().cpu().double().numpy()


def bits(t) -> np.ndarray:
    """The raw bits of a tensor, for bit-for-bit comparisons (NaN-safe)."""
    torch = pytest.importorskip("torch")
    v = t.detach().contiguous().cpu()
    return v.view(torch.int32 if v.element_size() == 4 else torch.int16).numpy()


def eps(name: str) -> float:
    """One ulp relative to the value (twice the unit roundoff): a rounding moves a value by at most that."""
    return {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[name]


# Half the spacing of the subnormals: what a rounding can lose below the normal range, where the relative
# bound does not hold (the 1/n pre-multiply of fp16 moves inputs below n * 2^-14 there).
HALF_SUBNORMAL = {"float32": 2.0 ** -150, "float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}


def assert_close_to_mean(out: np.ndarray, ref: np.ndarray, inputs_absmax: np.ndarray, n: int, dtype: str,
                         what: str) -> None:
    """|out - ref| <= one rounding of the result + n roundings of partial sums (in the element type,
    since NCCL reduces in it) + the 1/n pre-multiply, each within eps(dtype) of its magnitude or half a
    subnormal spacing: a bound that fails on any real mistake."""
    e = eps(dtype)
    bound = e * np.abs(ref) + (n + 2) * (e * inputs_absmax + HALF_SUBNORMAL[dtype])
    err = np.abs(out - ref)
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, (f"{what}: {bad.size} elements off the float64 mean, first at {bad[0]}: "
                           f"got {out[bad[0]]!r}, want {ref[bad[0]]!r} (bound {bound[bad[0]]:.3g})")


def forced_divisor() -> int:
    """The divisor of the reduction NCCLAVG_TEST_REDUCTION forces on communicators made in this process
    (Note [Forcing the reduction in tests] in csrc/cuda/comm_collectives.cpp), or 0 when the average is
    the plain one. bench/gpu_check.sh reruns the ordering and Work-lifetime tests with sum_divide:2 and
    premulsum:2, so that on one rank the "average" x/2 differs from its input and a missing order shows."""
    import os

    value = os.environ.get("NCCLAVG_TEST_REDUCTION", "")
    if not value:
        return 0
    from ncclavg import _C

    kind, divisor = _C.nccl_parse_test_reduction(value)
    return int(divisor)   # 0 for a kind without one: the size, the plain average


def expected_average(values, size: int) -> float:
    """What an averaging collective over ranks holding `values` gives under the forced reduction: the
    sum divided by its divisor (exact for the small integers and powers of two the tests use), else the
    mean over `size` ranks."""
    d = forced_divisor()
    return sum(values) / (d or size)
