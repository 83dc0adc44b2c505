"""Builds the native SIMD harness (tests/native/*.cpp + the CPU core) for x86-64 or aarch64 (stdlib only).

    python tests/native/build_native.py [--arch x86_64|aarch64] [--define NAME] [--cache DIR] -- [HARNESS ARGS]

builds (or reuses) the harness (or, with --program shm_harness, the shared-memory channel's
collectives between two forked processes) and runs it, under qemu-aarch64 for aarch64 on another
machine. Objects are cached by their command, source and every header under csrc/ and tests/native/,
so a second build after no change compiles nothing. Compiler flags are setup.py's for the core (-O3,
-ffp-contract=off) plus -Werror; aarch64 links -static (qemu then needs no sysroot) with OpenMP.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_backend"))
sys.path.insert(0, str(ROOT / "csrc" / "cuda" / "emu"))
from build_emu import _digest  # noqa: E402  (a cache key from the command, sources and headers)
# (host_arch: this machine, where a foreign build runs under qemu)
from isa_levels import ISA_LEVELS as LEVELS, host_machine as host_arch  # noqa: E402

# The CPU core: the common code, the dispatchers and the scalar level; LEVELS adds each architecture's.
CORE = ("common/buffer.cpp", "common/pack_plan.cpp", "cpu/simd.cpp", "cpu/kernels_scalar.cpp",
        "cpu/pack_scalar.cpp", "cpu/pack.cpp", "cpu/optim_scalar.cpp", "cpu/optim.cpp", "cpu/reduce.cpp")
# The programs: the SIMD harness, and the channel's collectives between two forked processes.
PROGRAMS = {"simd_harness": ("harness_main.cpp", "check_kernels.cpp", "check_optim.cpp"),
            "shm_harness": ("shm_main.cpp",)}
SHM = ("transport/shm_calls.cpp", "transport/shm_channel.cpp", "transport/shm_collectives.cpp",
       "transport/shm_segment.cpp")
CXX = {"x86_64": "g++", "aarch64": "aarch64-linux-gnu-g++"}
CXXFLAGS = ["-std=c++17", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]
# The core as setup.py optimises it (what ships is what is tested); the harness's own code at -O1
# (it compiles in half the time, and runs long enough only under qemu's SVE).
OPT_CORE, OPT_HARNESS = "-O3", "-O1"
QEMU = "qemu-aarch64"


def sources(arch, program):
    csrc = ROOT / "csrc"
    out = [csrc / s for s in CORE]
    for level in LEVELS[arch]:
        out += [csrc / "cpu" / f"{fam}_{level}.cpp" for fam in ("kernels", "pack", "optim")]
    if program == "shm_harness":
        out += [csrc / s for s in SHM]
    return out + [HERE / h for h in PROGRAMS[program]]


def find_cxx(arch):
    return shutil.which(CXX[arch])


def needs_qemu(arch):
    return arch != host_arch()


def build(cache, arch="aarch64", defines=(), jobs=2, nice=True, program="simd_harness"):
    """Compiles what changed, links, returns the harness executable's path. defines: -D names for the
    ISA level files only (what a planted defect in a lane type needs; the rest stays cached)."""
    cxx = find_cxx(arch)
    if cxx is None:
        raise RuntimeError(f"no {CXX[arch]} on PATH")
    cache = Path(cache).resolve()
    (cache / "obj").mkdir(parents=True, exist_ok=True)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    headers = b"".join(p.read_bytes() for d in (ROOT / "csrc", HERE) for p in sorted(d.rglob("*.h")))
    base = [*(["nice"] if nice and shutil.which("nice") else []), cxx] + CXXFLAGS + [f"-I{ROOT / 'csrc'}"]
    level_files = {f"{fam}_{level}.cpp" for level in LEVELS[arch] for fam in ("kernels", "pack", "optim")}

    def compile_one(src):
        flags = [*base, OPT_HARNESS if src.parent == HERE else OPT_CORE,
                 *([f"-D{d}" for d in defines] if src.name in level_files else [])]
        key = _digest(version, flags, src.read_bytes(), headers, src.name)
        obj = cache / "obj" / f"{arch}-{src.stem}-{key}.o"
        if obj.exists():
            return obj
        tmp = Path(tempfile.mkdtemp(dir=cache / "obj"))
        try:
            cmd = [*flags, "-c", str(src), "-o", str(tmp / "out.o")]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
            os.replace(tmp / "out.o", obj)  # atomic: a concurrent build never sees half an object
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return obj

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        objects = list(pool.map(compile_one, sources(arch, program)))
    exe = cache / ("bin-" + _digest(arch, *[o.name for o in objects])) / program
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        link = [cxx, "-fopenmp", *[str(o) for o in objects], "-lrt", "-o", str(exe) + ".tmp"]
        if arch == "aarch64":
            link.insert(1, "-static")
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking failed:\n{' '.join(link)}\n{r.stdout}{r.stderr}")
        os.replace(str(exe) + ".tmp", exe)
    return exe


def command(exe, arch="aarch64", cpu=None, args=()):
    """The command line that runs the harness: under qemu-aarch64 -cpu CPU when the arch is not the host's."""
    if needs_qemu(arch):
        return [QEMU, *(["-cpu", cpu] if cpu else []), str(exe), *args]
    return [str(exe), *args]


def run(exe, arch="aarch64", cpu=None, level=None, args=(), timeout=600):
    env = dict(os.environ)
    env.pop("NCCLAVG_SIMD", None)
    if level:
        env["NCCLAVG_SIMD"] = level
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(command(exe, arch, cpu, args), capture_output=True, text=True, env=env, timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="aarch64", choices=sorted(LEVELS))
    ap.add_argument("--cpu", default=None, help="qemu -cpu model, e.g. max,sve256=on or cortex-a72")
    ap.add_argument("--level", default=None, help="NCCLAVG_SIMD for the run")
    ap.add_argument("--define", action="append", default=[])
    ap.add_argument("--program", default="simd_harness", choices=sorted(PROGRAMS))
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ncclavg-native-harness"))
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    exe = build(a.cache, a.arch, a.define, program=a.program)
    r = run(exe, a.arch, a.cpu, a.level, a.args)
    sys.stdout.write(r.stdout + r.stderr)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
