"""Build of ncclavg's compiled core `ncclavg._C`.

Note [Build decision]
CPU sources are always compiled (OpenMP; SIMD chosen at run time, never -march=native). The CUDA part
is compiled when a toolkit is found (nvcc and cuda_runtime.h under CUDA_HOME, or next to the nvcc on
PATH, or /usr/local/cuda, or the PyPI toolkit's nvidia/cu13 tree on sys.path): NCCLAVG_CUDA=auto
(default) builds it when found, 1 requires it, 0 skips it, pypi builds with the PyPI toolkit only (the
in-tree backend build_backend/ncclavg_build.py puts it in the isolated build environment; see Note
[The PyPI CUDA toolkit] there). The decision depends on the toolchain only, never on whether a GPU is
visible; it is printed as one line and recorded next to the extension (ncclavg/_build.json) for
`ncclavg info`. NCCL is never needed at build time: it is loaded at run time (csrc/cuda/nccl_api.cpp).

The decision line reaches pip's users without -v: Note [Telling pip users about the build] in
build_backend/build_messages.py.

Environment: NCCLAVG_CUDA, NCCLAVG_CUDA_ARCHS ("80;90" by default; PTX for the newest is added),
CUDA_HOME, NCCLAVG_CUDA_MAJOR (pypi: 13), NCCLAVG_CXXFLAGS / NCCLAVG_LDFLAGS (extra flags, e.g.
sanitizers), NCCLAVG_BUILD_JOBS.
"""
import hashlib
import json
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
sys.path.insert(0, str(ROOT / "build_backend"))
from build_messages import BuildDecision, CpuOnlyBuild, tell_user  # noqa: E402
from isa_levels import foreign, target_machine  # noqa: E402
from ncclavg_build import PYPI_TOOLKIT, pypi_major, pypi_toolkit_requirements  # noqa: E402
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
        candidates += [str(p) for major in PYPI_TOOLKIT for p in pypi_toolkit_homes(major)]
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


def pypi_toolkit_homes(major):
    """The nvidia/cu<major> trees on sys.path that hold the PyPI toolkit's nvcc (the isolated build
    environment's site-packages is on sys.path while pip runs this file)."""
    out = []
    for entry in sys.path:
        home = Path(entry or ".") / "nvidia" / f"cu{major}"
        if (home / "bin" / "nvcc").exists() and home.resolve() not in [h.resolve() for h in out]:
            out.append(home)
    return out


def find_pypi_cuda():
    """NCCLAVG_CUDA=pypi: the PyPI toolkit only (never CUDA_HOME, PATH or /usr/local/cuda)."""
    major = pypi_major()
    for home in pypi_toolkit_homes(major):
        if (home / "include" / "cuda_runtime.h").exists():
            return str(home), str(home / "bin" / "nvcc")
    raise BuildError(
        f"ncclavg build: NCCLAVG_CUDA=pypi but the PyPI CUDA {major} toolkit is not on sys.path. "
        "`pip install .` with build isolation (the default) installs it in the build environment; "
        "without isolation install it first: pip install " + " ".join(f"'{r}'" for r in pypi_toolkit_requirements(major)))


def pypi_nvcc_version():
    try:
        from importlib.metadata import version
        return version("nvidia-cuda-nvcc")
    except Exception:  # not installed as a distribution (a bare tree on sys.path)
        return "?"


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
    if mode not in ("auto", "0", "1", "pypi"):
        raise BuildError(f"ncclavg build: NCCLAVG_CUDA must be auto, 0, 1 or pypi, got '{mode}'")
    if mode == "0":
        return None, "NCCLAVG_CUDA=0"
    home, nvcc_or_reason = find_pypi_cuda() if mode == "pypi" else find_cuda()
    if home is None:
        if mode == "1":
            raise BuildError(f"ncclavg build: NCCLAVG_CUDA=1 but no CUDA toolkit: {nvcc_or_reason}")
        return None, f"no CUDA toolkit ({nvcc_or_reason})"
    return {"home": home, "nvcc": nvcc_or_reason,
            "archs": parse_archs(os.environ.get("NCCLAVG_CUDA_ARCHS", "80;90"))}, None


CPU_ONLY_HELP = """\
ncclavg build: NOTE: this build is CPU-only, because {why}.
  The nccl backend and GPU tensors will not be available (`ncclavg info` says "ncclavg's CUDA build  none").
  For the CUDA part, either
    - install a binary wheel that has it: pip install ncclavg-cu13
    - or build from source with NVIDIA's CUDA toolkit from PyPI (no system toolkit needed):
        NCCLAVG_CUDA=pypi pip install --no-cache-dir --force-reinstall ncclavg   (or `pip install .` in a checkout)
      or with a system toolkit: NCCLAVG_CUDA=1 CUDA_HOME=/path/to/cuda pip install ...
      (--no-cache-dir: pip would otherwise reuse the CPU-only wheel it built and cached from the sdist)
  NCCLAVG_CUDA=0 builds CPU-only without this note."""


def sources(sub, *patterns):
    out = []
    for pat in patterns:
        out += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / sub).glob(pat))
    return out


class BuildExt(build_ext):
    """Compiles each source with its own compiler and flags (g++ for C++, nvcc for .cu), in parallel."""

    # The build record (ncclavg/_build.json) travels with the extension: into the wheel from build_lib,
    # and next to the in-place extension for `pip install -e` / `build_ext --inplace`.
    def _record_files(self):
        build_py = self.get_finalized_command("build_py")
        return (str(Path(self.build_lib) / "ncclavg" / "_build.json"),
                os.path.join(build_py.get_package_dir("ncclavg"), "_build.json"))

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        built, inplace = self._record_files()
        if os.path.exists(built):
            self.copy_file(built, inplace, level=self.verbose)

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            built, inplace = self._record_files()
            mapping[built] = inplace
        return mapping

    def build_extension(self, ext):
        cuda, why_not = decide_cuda()
        mode = os.environ.get("NCCLAVG_CUDA", "auto").strip().lower()
        if cuda:
            where = f"at {cuda['home']}"
            if mode == "pypi":  # a temporary build environment: name the wheel, not the path
                where = f"from PyPI (nvidia-cuda-nvcc {pypi_nvcc_version()} in the build environment)"
            decision = (f"ncclavg build: CUDA=yes (nvcc {nvcc_version(cuda['nvcc'])} {where}, "
                        f"archs {';'.join(cuda['archs'])} + PTX {cuda['archs'][-1]}, cudart static)")
            tell_user(decision, BuildDecision)
        else:
            decision = f"ncclavg build: CUDA=no ({why_not}); CPU core only"
            print(decision, flush=True)
            if mode == "auto":
                tell_user(CPU_ONLY_HELP.format(why=why_not), CpuOnlyBuild)

        include = [str(ROOT / "csrc"), *ext.include_dirs, sysconfig.get_paths()["include"]]
        defines = [f'-DNCCLAVG_VERSION="{VERSION}"']
        cxx_flags = ["-std=c++17", "-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden",
                     # Same rounding at every SIMD level and on the GPU: no silent FMA contraction
                     # (x86 GCC contracts only where the target has FMA, aarch64 GCC everywhere,
                     # scalar code included: a*b+c in one rounding would change the bits).
                     "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"]
        # The errors' [file:line] (csrc/common/check.h) relative to the source tree, not the build
        # machine's path to it (a wheel's errors would name the builder's directories).
        prefix_map = f"-ffile-prefix-map={ROOT}/="
        cxx_flags.append(prefix_map)
        cxx_flags += shlex.split(os.environ.get("NCCLAVG_CXXFLAGS", ""))
        link_flags = ["-fopenmp", "-lrt"] + shlex.split(os.environ.get("NCCLAVG_LDFLAGS", ""))
        libs = []
        cpp_sources = list(ext.sources)
        cu_sources = []
        if cuda:
            archs = ";".join(cuda["archs"])
            defines += ["-DNCCLAVG_WITH_CUDA", f'-DNCCLAVG_CUDA_ARCHS="{archs}"']
            if min(int(re.match(r"\d+", a).group()) for a in cuda["archs"]) < 70:
                # kernel parameters above 4 KiB need sm_70+ (Note [Pack chunk table] in pack_kernel.cu)
                defines.append("-DNCCLAVG_PACK_SMALL_TABLE_ONLY")
            include.append(str(Path(cuda["home"]) / "include"))
            if (Path(cuda["home"]) / "include" / "cccl").is_dir():  # the PyPI layout (nvcc.profile misses it)
                include.append(str(Path(cuda["home"]) / "include" / "cccl"))
            cpp_sources += sources("cuda", "*.cpp")
            cu_sources = sources("cuda", "*.cu")
            libs = [f"-L{cuda_lib_dir(cuda['home'])}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
        else:
            cpp_sources += ["csrc/cuda/nccl_api.cpp"]  # plain C++: lets a CPU build report NCCL

        # Objects are reused when newer than their sources: keep them apart per toolkit, archs and flags.
        config = json.dumps([cuda and cuda["home"], cuda and cuda["archs"], cxx_flags, defines])
        build_temp = Path(self.build_temp) / (("cuda-" if cuda else "cpu-") + hashlib.sha1(config.encode()).hexdigest()[:10])
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
                   "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Xcompiler", prefix_map, *[f"-I{i}" for i in include],
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
        # What `ncclavg info` reports about how this core was built (why CPU-only, which toolkit).
        pypi = bool(cuda) and "nvidia" in Path(cuda["home"]).parts
        record = {"mode": mode, "cuda": bool(cuda), "decision": decision, "reason": why_not or "",
                  "cuda_home": cuda["home"] if cuda and not pypi else "", "pypi_toolkit": pypi}
        (out.parent / "_build.json").write_text(json.dumps(record, indent=1) + "\n")


def deps(src):
    """The source and every header under csrc/: a header change rebuilds everything (few files)."""
    return [ROOT / src, *(ROOT / "csrc").rglob("*.h")]


def cpu_sources(machine):
    """csrc/cpu's sources for `machine`: its own SIMD level files, none of another architecture's."""
    return [src for src in sources("cpu", "*.cpp") if not foreign(src, machine)]


ext = Pybind11Extension("ncclavg._C", sources("", "bindings.cpp") + sources("common", "*.cpp") + cpu_sources(target_machine()) + sources("transport", "*.cpp")
                        + sources("python", "*.cpp"))
setup(version=VERSION, ext_modules=[ext], cmdclass={"build_ext": BuildExt})
