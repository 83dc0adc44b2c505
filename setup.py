"""Build of ncclavg's compiled core `ncclavg._C`.

Note [Build decision]
CPU sources are always compiled (OpenMP; SIMD chosen at run time, never -march=native). The CUDA part
is compiled when a toolkit is found (nvcc and cuda_runtime.h under CUDA_HOME, or next to the nvcc on
PATH): NCCLAVG_CUDA=auto (default) builds it when found, 1 requires it, 0 skips it. The decision depends
on the toolchain only, never on whether a GPU is visible, and is printed as one line. NCCL is never
needed at build time: it is loaded at run time (csrc/cuda/nccl_api.cpp).

Environment: NCCLAVG_CUDA, NCCLAVG_CUDA_ARCHS ("80;90" by default; PTX for the newest is added),
CUDA_HOME, NCCLAVG_CXXFLAGS / NCCLAVG_LDFLAGS (extra flags, e.g. sanitizers), NCCLAVG_BUILD_JOBS.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "ncclavg" / "_version.py").read_text()).group(1)


class BuildError(SystemExit):
    pass


def find_cuda():
    """Returns (cuda_home, nvcc) when a usable toolkit exists, else (None, reason).

    Candidates in order: CUDA_HOME / CUDA_PATH, the toolkit of the nvcc on PATH (followed through
    symlinks; `nvcc -v` reveals the real location when nvcc is a wrapper script), /usr/local/cuda."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [explicit] if explicit else []
    if not explicit:
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
            try:  # a wrapper script: ask nvcc where its toolkit is
                out = subprocess.run([nvcc, "-v", "--version"], capture_output=True, text=True, timeout=30)
                m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.M)
                if m:
                    candidates.append(str(Path(m.group(1).strip()).resolve()))
            except (OSError, subprocess.SubprocessError):
                pass
        candidates.append("/usr/local/cuda")
    reasons = []
    for home in candidates:
        nvcc = Path(home) / "bin" / "nvcc"
        if not nvcc.exists():
            reasons.append(f"{nvcc} does not exist")
        elif not (Path(home) / "include" / "cuda_runtime.h").exists():
            reasons.append(f"{home}/include/cuda_runtime.h does not exist")
        else:
            return home, str(nvcc)
    if not candidates:
        return None, "no nvcc on PATH, CUDA_HOME unset"
    return None, "; ".join(reasons)


def cuda_lib_dir(home):
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (Path(home) / sub / "libcudart_static.a").exists():
            return str(Path(home) / sub)
    raise BuildError(f"ncclavg build: libcudart_static.a not found under {home}")


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def parse_archs(text):
    archs = [a.strip().replace(".", "").replace("sm_", "") for a in re.split(r"[;, ]+", text) if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d{2,3}[af]?", a):
            raise BuildError(f"ncclavg build: NCCLAVG_CUDA_ARCHS entry '{a}' is not like 80 or 90")
    if not archs:
        raise BuildError("ncclavg build: NCCLAVG_CUDA_ARCHS is empty")
    return archs


def decide_cuda():
    mode = os.environ.get("NCCLAVG_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise BuildError(f"ncclavg build: NCCLAVG_CUDA must be auto, 0 or 1, got '{mode}'")
    if mode == "0":
        return None, "NCCLAVG_CUDA=0"
    home, nvcc_or_reason = find_cuda()
    if home is None:
        if mode == "1":
            raise BuildError(f"ncclavg build: NCCLAVG_CUDA=1 but no CUDA toolkit: {nvcc_or_reason}")
        return None, f"no CUDA toolkit ({nvcc_or_reason})"
    return {"home": home, "nvcc": nvcc_or_reason,
            "archs": parse_archs(os.environ.get("NCCLAVG_CUDA_ARCHS", "80;90"))}, None


def sources(sub, *patterns):
    out = []
    for pat in patterns:
        out += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / sub).glob(pat))
    return out


class BuildExt(build_ext):
    """Compiles each source with its own compiler and flags (g++ for C++, nvcc for .cu), in parallel."""

    def build_extension(self, ext):
        cuda, why_not = decide_cuda()
        if cuda:
            print(f"ncclavg build: CUDA=yes (nvcc {nvcc_version(cuda['nvcc'])} at {cuda['home']}, "
                  f"archs {';'.join(cuda['archs'])} + PTX {cuda['archs'][-1]}, cudart static)", flush=True)
        else:
            print(f"ncclavg build: CUDA=no ({why_not}); CPU core only", flush=True)

        include = [str(ROOT / "csrc"), *ext.include_dirs, sysconfig.get_paths()["include"]]
        defines = [f'-DNCCLAVG_VERSION="{VERSION}"']
        cxx_flags = ["-std=c++17", "-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden",
                     # Same rounding at every SIMD level and on the GPU: no silent FMA contraction.
                     "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"]
        cxx_flags += shlex.split(os.environ.get("NCCLAVG_CXXFLAGS", ""))
        link_flags = ["-fopenmp", "-lrt"] + shlex.split(os.environ.get("NCCLAVG_LDFLAGS", ""))
        libs = []
        cpp_sources = list(ext.sources)
        cu_sources = []
        if cuda:
            archs = ";".join(cuda["archs"])
            defines += ["-DNCCLAVG_WITH_CUDA", f'-DNCCLAVG_CUDA_ARCHS="{archs}"']
            include.append(str(Path(cuda["home"]) / "include"))
            cpp_sources += sources("cuda", "*.cpp")
            cu_sources = sources("cuda", "*.cu")
            libs = [f"-L{cuda_lib_dir(cuda['home'])}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
        else:
            cpp_sources += ["csrc/cuda/nccl_api.cpp"]  # plain C++: lets a CPU build report NCCL

        build_temp = Path(self.build_temp) / ("cuda" if cuda else "cpu")
        jobs = []
        for src in cpp_sources:
            obj = build_temp / (src.replace("/", "_") + ".o")
            cmd = ["g++" if shutil.which("g++") else "c++", *cxx_flags, *defines,
                   *[f"-I{i}" for i in include], "-c", str(ROOT / src), "-o", str(obj)]
            jobs.append((src, obj, cmd))
        for src in cu_sources:
            obj = build_temp / (src.replace("/", "_") + ".o")
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda["archs"]]
            newest = cuda["archs"][-1]
            gencode.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
            cmd = [cuda["nvcc"], "-std=c++17", "-O3", "--fmad=false", *gencode, *defines,
                   "-Xcompiler", "-fPIC,-fvisibility=hidden", *[f"-I{i}" for i in include],
                   "-c", str(ROOT / src), "-o", str(obj)]
            jobs.append((src, obj, cmd))

        build_temp.mkdir(parents=True, exist_ok=True)
        n_jobs = int(os.environ.get("NCCLAVG_BUILD_JOBS", os.cpu_count() or 1))

        def compile_one(job):
            src, obj, cmd = job
            if obj.exists() and all(obj.stat().st_mtime >= p.stat().st_mtime for p in deps(src)):
                return obj
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError(f"ncclavg build: compiling {src} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
            if r.stderr.strip():
                print(r.stderr, file=sys.stderr)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
            objects = [str(o) for o in pool.map(compile_one, jobs)]

        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["g++" if shutil.which("g++") else "c++", "-shared", *objects, "-o", str(out),
               *link_flags, *libs]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"ncclavg build: linking failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")


def deps(src):
    """The source and every header under csrc/: a header change rebuilds everything (few files)."""
    return [ROOT / src, *(ROOT / "csrc").rglob("*.h")]


ext = Pybind11Extension("ncclavg._C", sources("", "bindings.cpp") + sources("common", "*.cpp") + sources("cpu", "*.cpp")
                        + sources("python", "*.cpp"))
setup(version=VERSION, ext_modules=[ext], cmdclass={"build_ext": BuildExt})
