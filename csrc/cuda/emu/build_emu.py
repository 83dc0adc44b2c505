"""Builds the CUDA-kernel emulator harness from the csrc/ of a checkout (stdlib only; no package import).

    python csrc/cuda/emu/build_emu.py [--cache DIR] [--jobs N] [-- HARNESS ARGS]

builds (or reuses) the harness and runs it: the kernels of csrc/cuda/*.cu compiled by g++ as C++ with
ASan + UBSan, the launches driven through the real host entry points, compared bit for bit with the
scalar CPU kernels. See docs/cuda_emulation.md.

Note [Launch rewrite]
`kernel<<<grid, block, smem, stream>>>(args)` is CUDA syntax no host compiler accepts. Each kernel
file is copied into the build cache with its launches rewritten to
`::ncclavg_emu::launch_kernel(kernel, grid, block, smem, stream)(args)` (a regex; the kernel name may
carry template arguments) and a `#line 1` directive, so diagnostics and sanitizer reports name the
original file and line. Nothing else changes: the includes resolve against csrc/cuda through -iquote,
and cuda_emu.h is force-included. A launch the regex does not understand leaves `<<<` in the copy,
which fails to compile: it cannot be skipped silently.
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The kernel files the harness drives. A new .cu file in csrc/cuda must be added here and given
# checks in the harness (tests/test_cuda_emu.py fails until it is).
KERNELS = ("pack_kernel.cu", "average_kernel.cu", "scale_kernel.cu")
# The rest of the program: the runtime part the kernel files call, the project's CPU reference, the
# argument checks the entry points use, and the harness itself.
PROJECT_SOURCES = ("cuda/device_guard.cpp", "common/buffer.cpp", "common/pack_plan.cpp",
                   "cpu/kernels_scalar.cpp", "cpu/pack_scalar.cpp")
EMU_SOURCES = ("emu_runtime.cpp", "emu_streams.cpp", "emu_devices.cpp", "harness_util.cpp", "check_pack.cpp",
               "check_average.cpp", "check_divide.cpp", "harness_main.cpp")
EMULATED_SOURCES = ("check_launch.cpp",)  # built like a kernel file (cuda_emu.h force-included)

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
CXXFLAGS = ["-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", *SANITIZE,
            # the same rounding as the real build: no FMA contraction (nvcc runs with --fmad=false)
            "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unknown-pragmas"]

LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<([^;]*?)>>>\s*\(")
RUN_ENV = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def find_cuda_include():
    """(include dir, None) when cuda_fp16.h is found like setup.py's find_cuda looks, else (None, why)."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    homes = [explicit] if explicit else []
    nvcc = shutil.which("nvcc")
    if nvcc and not explicit:
        homes.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    homes.append("/usr/local/cuda")
    for home in homes:
        inc = Path(home) / "include"
        if (inc / "cuda_fp16.h").exists() and (inc / "cuda_runtime.h").exists():
            return inc, None
    return None, "no cuda_fp16.h under " + ", ".join(f"{h}/include" for h in homes)


def find_cxx():
    return shutil.which("g++")


def rewrite_launches(text):
    """See Note [Launch rewrite]."""
    return LAUNCH.sub(lambda m: f"::ncclavg_emu::launch_kernel({m.group(1)}, {m.group(2)})(", text)


def _digest(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(root, cache, mutations=None, jobs=2, log=None, sanitize=True):
    """Compiles what changed, links, returns the harness executable's path.

    root: the checkout (the directory holding csrc/). cache: a directory kept between builds; objects
    are keyed on their command, their source and every header under csrc/. mutations: {kernel file
    name: [(old, new), ...]} text substitutions applied to that kernel's copy (each `old` must occur),
    for showing that a planted defect is caught."""
    root, cache = Path(root).resolve(), Path(cache).resolve()
    csrc = root / "csrc"
    emu = csrc / "cuda" / "emu"
    inc, why = find_cuda_include()
    cxx = find_cxx()
    if inc is None or cxx is None:
        raise RuntimeError(why or "no g++ on PATH")
    mutations = dict(mutations or {})
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    headers = b"".join(p.read_bytes() for p in sorted(csrc.rglob("*.h")))
    flags = CXXFLAGS if sanitize else [f for f in CXXFLAGS if f not in SANITIZE]
    base = [cxx, *flags, f"-I{csrc}", "-isystem", str(inc)]
    emulated = ["-x", "c++", "-iquote", str(csrc / "cuda"), "-include", str(emu / "cuda_emu.h")]
    (cache / "obj").mkdir(parents=True, exist_ok=True)

    jobs_list = []  # (name, source text or None, source path, extra flags)
    for name in KERNELS:
        text = (csrc / "cuda" / name).read_text()
        for old, new in mutations.pop(name, []):
            if old not in text:
                raise ValueError(f"mutation of {name}: {old!r} does not occur")
            text = text.replace(old, new)
        copy = f'#line 1 "csrc/cuda/{name}"\n' + rewrite_launches(text)
        jobs_list.append((name, copy, None, emulated))
    if mutations:
        raise ValueError(f"mutations of files that are not kernels: {sorted(mutations)}")
    for rel in PROJECT_SOURCES:
        jobs_list.append((rel, None, csrc / rel, []))
    for rel in EMU_SOURCES:
        jobs_list.append((rel, None, emu / rel, []))
    for rel in EMULATED_SOURCES:
        jobs_list.append((rel, None, emu / rel, ["-include", str(emu / "cuda_emu.h")]))

    def compile_one(job):
        name, text, path, extra = job
        src_bytes = text.encode() if text is not None else path.read_bytes()
        key = _digest(version, base, extra, src_bytes, headers, name)
        obj = cache / "obj" / f"{Path(name).stem}-{key}.o"
        if obj.exists():
            return obj
        tmpdir = Path(tempfile.mkdtemp(dir=cache / "obj"))
        try:
            if text is not None:
                path = tmpdir / (Path(name).stem + ".emu.cpp")
                path.write_text(text)
            cmd = [*base, *extra, "-c", str(path), "-o", str(tmpdir / "out.o")]
            if log:
                log(f"compiling {name}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {name} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
            if r.stderr.strip() and log:
                log(r.stderr)
            os.replace(tmpdir / "out.o", obj)  # atomic: a concurrent build never sees half an object
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        return obj

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        objects = list(pool.map(compile_one, jobs_list))
    exe_dir = cache / ("bin-" + _digest(*[o.name for o in objects]))
    exe = exe_dir / "emu_harness"
    if not exe.exists():
        exe_dir.mkdir(parents=True, exist_ok=True)
        tmp = exe_dir / f"emu_harness.{os.getpid()}.tmp"
        cmd = [cxx, *(SANITIZE if sanitize else []), *map(str, objects), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking the harness failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
        os.replace(tmp, exe)
    return exe


def run(exe, args=(), timeout=300):
    """Runs the harness; returns the CompletedProcess (stdout and stderr as text)."""
    env = dict(os.environ, **RUN_ENV)
    env.pop("LD_PRELOAD", None)  # the executable links its own sanitizer runtimes
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ncclavg-cuda-emu"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("harness_args", nargs="*", help="passed to the harness, e.g. --quick pack")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[3]
    exe = build(root, a.cache, jobs=a.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
    r = run(exe, a.harness_args)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
