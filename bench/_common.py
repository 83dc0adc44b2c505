"""What the standalone CPU benchmarks in bench/ share and `ncclavg bench` does not: which copy of the
package they import, their timing loop and copy reference, the machine block of their JSON, byte counts
as their tables write them, and their thread pinning. The CPU model and the JSON file itself come from
ncclavg.bench.report, imported where used: a script sets its environment before ncclavg loads."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

# The CPU model the results have always written when neither /proc/cpuinfo nor platform names one.
UNKNOWN_CPU = "unknown"

# Run from a source checkout built in place (`python setup.py build_ext --inplace`), use that copy;
# otherwise the installed package. A checkout without a built core must not shadow an installed one.
_ROOT = Path(__file__).resolve().parent.parent
if list((_ROOT / "ncclavg").glob("_C*.so")):
    import sys as _sys

    _sys.path.insert(0, str(_ROOT))


def median_seconds(fn: Callable[[], object], reps: int = 9, warmup: int = 2) -> float:
    """Median wall time of fn() over `reps` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict:
    import torch

    import ncclavg
    from ncclavg.bench.report import cpu_model

    info = ncclavg.build_info()
    return {
        "cpu": cpu_model(UNKNOWN_CPU),
        "cores": os.cpu_count(),
        "threads_used": torch.get_num_threads(),
        "simd_level": info["simd_level"],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ncclavg": ncclavg.__version__,
        "date": _dt.date.today().isoformat(),
    }


def copy_bandwidth_gbps(nbytes: int, reps: int | None = None) -> float:
    """torch copy_ of an nbytes buffer (float32, at least one element) into another: (read + write)
    bytes per second, in GB/s. reps: by default enough for ~20 MB of copies, 3 to 200."""
    import torch

    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    if reps is None:
        reps = max(3, min(200, int(2e7 // max(nbytes, 1))))
    t = median_seconds(lambda: dst.copy_(src), reps=reps)
    return 2 * src.numel() * 4 / t / 1e9


def human(n: int) -> str:
    """A byte count as the tables write it: 8 B, 4 KiB, 16 MiB."""
    for unit, step in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= step:
            return f"{n // step} {unit}"
    return f"{n} B"


def write_json(path: str | None, payload: dict) -> None:
    """payload at path (nothing when no path was asked for), and a line saying so."""
    if not path:
        return
    from ncclavg.bench.report import dump_json

    dump_json(path, payload, indent=2)
    print(f"wrote {path}")


def same_threads_everywhere() -> int:
    """Pins torch's intra-op pool and OpenMP (used by the core) to the same thread count."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n
