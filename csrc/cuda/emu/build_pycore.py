"""Builds ncclavg's compiled core (`ncclavg._C`, every source setup.py compiles, bindings.cpp included)
over the emulated CUDA runtime, and the stand-in NCCL without sanitizers (stdlib only).

    python csrc/cuda/emu/build_pycore.py [--cache DIR]      # prints the core's path and the stand-in's

Note [The emulated core]
The Python layer of the NCCL backend (ncclavg/comm/nccl.py: Works, failure state, stream ordering, the
unique id through the store, towers of several processes) calls `_C.NcclComm`. To run it without a GPU
the whole core is compiled as setup.py compiles it with CUDA (NCCLAVG_WITH_CUDA, the same bindings and
sources), except that g++ compiles the .cu files through the launch rewrite (Note [Launch rewrite] in
build_emu.py) and the emulated runtime (emu_runtime.cpp, emu_streams.cpp, emu_devices.cpp) is linked
instead of cudart. Its runtime functions keep default visibility, so once the core is loaded with
RTLD_GLOBAL the stand-in NCCL (loaded later by the core's own loader, NCCLAVG_NCCL_LIBRARY) binds its
CUDA calls to the same emulated streams and memory. No sanitizer: a Python process would need the
sanitizer runtime preloaded; the same C++ runs under ASan, UBSan and ThreadSanitizer in the host-logic
harness (build_host.py). tests/_nccl_emu_core.py loads it in place of the real core, in a child process.
"""
import argparse
import os
import re
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "build_backend"))
import build_host  # noqa: E402  (the toolchain, the stand-in's sources, the link step)
from isa_levels import foreign, target_machine  # noqa: E402  (this architecture's SIMD level files only)

# setup.py's sources: these folders of csrc/, not recursing (emu/ stays out), plus bindings.cpp.
CORE_FOLDERS = ("common", "cpu", "transport", "python", "cuda")
EMU_RUNTIME = ("emu_runtime.cpp", "emu_streams.cpp", "emu_devices.cpp", "py_controls.cpp")
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-fopenmp", "-pthread", "-ffp-contract=off", "-w"]


def _version(root):
    m = re.search(r'__version__\s*=\s*"([^"]+)"', (root / "ncclavg" / "_version.py").read_text())
    return m.group(1) if m else "0.0.0"


def _pybind11_include():
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_include()


def skip_reason():
    """Why the emulated core cannot be built here, or None."""
    if build_host.build_emu.find_cxx() is None:
        return "no g++ on PATH: the emulated core is compiled with g++"
    inc, why = build_host.build_emu.find_cuda_include()
    if inc is None:
        return f"no CUDA headers ({why}); set CUDA_HOME to a CUDA toolkit"
    if _pybind11_include() is None:
        return "no pybind11 in this Python (pip install pybind11, or the [test] extra)"
    return None


def build(root, cache, jobs=2, log=None, api=build_host.DEFAULT_API):
    """Compiles what changed; returns (path of the emulated `_C` extension, stand-in library)."""
    root = Path(root).resolve()
    defines = ["-DNCCLAVG_WITH_CUDA", '-DNCCLAVG_CUDA_ARCHS="emulated"', f'-DNCCLAVG_VERSION="{_version(root)}"']
    include = [_pybind11_include(), sysconfig.get_paths()["include"]]
    tc = build_host.Toolchain(root, cache, [*FLAGS, *defines], jobs=jobs, log=log, include=include)
    jobs_list = [tc.job("bindings.cpp")]
    for folder in CORE_FOLDERS:
        for p in sorted((tc.csrc / folder).glob("*.cpp")):
            if folder == "cpu" and foreign(p, target_machine()):
                continue
            jobs_list.append(tc.job(f"{folder}/{p.name}"))
    for p in sorted((tc.csrc / "cuda").glob("*.cu")):
        jobs_list.append(tc.kernel_job(f"cuda/{p.name}"))
    jobs_list += [tc.job(f"cuda/emu/{rel}") for rel in EMU_RUNTIME]
    objects = tc.compile(jobs_list)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    core = build_host._link(tc.cxx, tc.cache, f"_C{suffix}", objects, ["-shared", "-fopenmp", "-pthread", "-lrt", "-ldl"])
    lib = build_host.build_standin(root, cache, sanitize="none", api=api, jobs=jobs, log=log)
    return core, lib


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ncclavg-emu-core"))
    a = ap.parse_args(argv)
    why = skip_reason()
    if why:
        print(why, file=sys.stderr)
        return 2
    core, lib = build(Path(__file__).resolve().parents[3], a.cache, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(core)
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
