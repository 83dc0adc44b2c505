"""Builds the host-logic harness and the stand-in NCCL from the csrc/ of a checkout (stdlib only).

    python csrc/cuda/emu/build_host.py [--sanitize address|thread] [--api CODE] [--list | SCENARIO...]

The NcclComm sources (csrc/cuda/comm*.cpp, nccl_api.cpp, device_guard.cpp) and the divide kernel,
unchanged, compiled by g++ against the emulated CUDA runtime (streams, events, capture, memory:
emu_host.h) with ASan + UBSan or with ThreadSanitizer; NCCL is the stand-in library
(nccl_standin*.cpp), loaded at run time through the project's own loader (NCCLAVG_NCCL_LIBRARY). See
docs/cuda_emulation.md, "The host logic on the CPU".

Note [Stand-in feature sets]
The loader resolves NCCL's optional entry points with dlsym and the code gates on them, so a stand-in
that always exported everything would never take the paths of an older NCCL. The stand-in is built
once per feature set (NCCLEMU_API, a version code): 2.9.9 (no ncclAvg, no bfloat16, no PreMulSum, no
ncclGetLastError, no config), 2.13.4 (PreMulSum, last error; no non-blocking init), 2.17.1 (non-blocking
init, no ncclCommSplit), 2.28.9 (what torch pins; everything), 2.30.7 (several ranks on one GPU).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_emu  # noqa: E402  (the kernel harness's builder: compiler, CUDA headers, the launch rewrite)

API_LEVELS = (20909, 21304, 21701, 22809, 23007)
DEFAULT_API = 22809
# The code under test, compiled unchanged (scale_kernel.cu through the launch rewrite).
PROJECT_SOURCES = ("cuda/comm.cpp", "cuda/comm_init.cpp", "cuda/comm_collectives.cpp", "cuda/nccl_api.cpp",
                   "cuda/device_guard.cpp", "common/buffer.cpp")
KERNELS = ("scale_kernel.cu",)
EMU_SOURCES = ("emu_runtime.cpp", "emu_streams.cpp", "emu_devices.cpp", "host_util.cpp", "host_init.cpp",
               "host_collectives.cpp", "host_lifecycle.cpp", "host_faults.cpp")
STANDIN_SOURCES = ("nccl_standin.cpp", "nccl_standin_world.cpp")

SANITIZERS = {
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "thread": ["-fsanitize=thread"],
    "none": [],   # the stand-in loaded by the emulated core in a Python process (build_pycore.py)
}
RUN_ENV = {
    "address": dict(build_emu.RUN_ENV),
    # second_deadlock_stack: both stacks of a lock-order report; exitcode 66 tells a race from a FAIL;
    # no thread-leak reports: a peer frozen by a fault is left running on purpose, and the process ends
    # with _exit (host_util.h)
    # (tsan.supp: a report inside glibc's loader, the file says which)
    "thread": {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1:exitcode=66:report_thread_leaks=0:"
                               f"suppressions={os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tsan.supp')}"},
    "none": {},
}


def _flags(sanitize):
    base = [f for f in build_emu.CXXFLAGS if f not in build_emu.SANITIZE]
    return [*base, *SANITIZERS[sanitize], "-pthread"]


def build(root, cache, sanitize="address", api=DEFAULT_API, mutations=None, jobs=2, log=None):
    """Compiles what changed; returns (harness executable, stand-in library).

    mutations: {path relative to csrc/ or a stand-in file name: [(old, new), ...]} applied to copies, for
    showing that a planted defect fails the scenarios."""
    tc = Toolchain(root, cache, _flags(sanitize), mutations, jobs, log)
    jobs_list = []  # (name, text, extra flags, suffix)
    for name in KERNELS:
        jobs_list.append(tc.kernel_job(f"cuda/{name}"))
    for rel in PROJECT_SOURCES:
        jobs_list.append(tc.job(rel))
    for rel in EMU_SOURCES:
        jobs_list.append(tc.job(f"cuda/emu/{rel}"))
    standin = _standin_jobs(tc, api)
    tc.check_mutations_used()
    objects = tc.compile(jobs_list)
    exe = _link(tc.cxx, tc.cache, "emu_host", objects, [*SANITIZERS[sanitize], "-pthread", "-rdynamic", "-ldl"])
    return exe, _link_standin(tc, standin, sanitize)


def build_standin(root, cache, sanitize="address", api=DEFAULT_API, jobs=2, log=None):
    """The stand-in library alone (for the emulated core of build_pycore.py: sanitize="none")."""
    tc = Toolchain(root, cache, _flags(sanitize), jobs=jobs, log=log)
    return _link_standin(tc, _standin_jobs(tc, api), sanitize)


def _standin_jobs(tc, api):
    return [tc.job(f"cuda/emu/{rel}", ["-fPIC", f"-DNCCLEMU_API={api}"]) for rel in STANDIN_SOURCES]


def _link_standin(tc, jobs_list, sanitize):
    return _link(tc.cxx, tc.cache, "libnccl-standin.so", tc.compile(jobs_list),
                 [*SANITIZERS[sanitize], "-pthread", "-shared"])


class Toolchain:
    """g++ and the CUDA headers for one build into `cache`: sources read (with their mutations applied)
    into compile jobs, objects keyed on the compiler, the command, the text and every csrc/ header."""

    def __init__(self, root, cache, flags, mutations=None, jobs=2, log=None, include=()):
        self.root, self.cache = Path(root).resolve(), Path(cache).resolve()
        self.csrc = self.root / "csrc"
        self.emu = self.csrc / "cuda" / "emu"
        inc, why = build_emu.find_cuda_include()
        self.cxx = build_emu.find_cxx()
        if inc is None or self.cxx is None:
            raise RuntimeError(why or "no g++ on PATH")
        self.mutations = dict(mutations or {})
        self.jobs, self.log = jobs, log
        self.version = subprocess.run([self.cxx, "--version"], capture_output=True, text=True).stdout
        self.headers = b"".join(p.read_bytes() for p in sorted(self.csrc.rglob("*.h")))
        self.base = [self.cxx, *flags, f"-I{self.csrc}", *[f"-I{i}" for i in include], "-isystem", str(inc)]
        (self.cache / "obj").mkdir(parents=True, exist_ok=True)

    def _text(self, rel):
        text = (self.csrc / rel).read_text()
        for old, new in self.mutations.pop(rel, []) + self.mutations.pop(Path(rel).name, []):
            if old not in text:
                raise ValueError(f"mutation of {rel}: {old!r} does not occur")
            text = text.replace(old, new)
        return text

    def job(self, rel, extra=()):
        """A C++ source of csrc/ (`rel` relative to it), compiled as it is."""
        return (rel, f'#line 1 "csrc/{rel}"\n' + self._text(rel), list(extra), ".cpp")

    def kernel_job(self, rel, extra=()):
        """A .cu file of csrc/, its launches rewritten (Note [Launch rewrite] in build_emu.py) and the
        emulator's shim (cuda_emu.h) force-included."""
        text = f'#line 1 "csrc/{rel}"\n' + build_emu.rewrite_launches(self._text(rel))
        return (rel, text, ["-x", "c++", "-iquote", str(self.csrc / "cuda"), "-include",
                            str(self.emu / "cuda_emu.h"), *extra], ".emu.cpp")

    def check_mutations_used(self):
        if self.mutations:
            raise ValueError(f"mutations of files that are not built here: {sorted(self.mutations)}")

    def compile(self, jobs_list):
        with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
            return list(pool.map(self._compile_one, jobs_list))

    def _compile_one(self, job):
        name, text, extra, suffix = job
        key = build_emu._digest(self.version, self.base, extra, text, self.headers, name)
        obj = self.cache / "obj" / f"{Path(name).stem}-{key}.o"
        if obj.exists():
            return obj
        tmpdir = Path(tempfile.mkdtemp(dir=self.cache / "obj"))
        try:
            # the copy sits next to its original's directory in the include search: -iquote below
            path = tmpdir / (Path(name).stem + suffix)
            path.write_text(text)
            cmd = [*self.base, *extra, "-iquote", str((self.csrc / name).parent), "-c", str(path),
                   "-o", str(tmpdir / "out.o")]
            if self.log:
                self.log(f"compiling {name}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {name} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
            os.replace(tmpdir / "out.o", obj)  # atomic: a concurrent build never sees half an object
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        return obj


def _link(cxx, cache, name, objects, flags):
    out_dir = cache / ("bin-" + build_emu._digest(name, *[o.name for o in objects], *flags))
    out = out_dir / name
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"{name}.{os.getpid()}.tmp"
        # the executable exports the emulated runtime (-rdynamic): the stand-in's CUDA calls bind to it
        cmd = [cxx, *map(str, objects), *flags, "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking {name} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
        os.replace(tmp, out)
    return out


def scenarios(exe):
    """{name: budget_s} of the harness."""
    r = subprocess.run([str(exe), "--list"], capture_output=True, text=True, timeout=60)
    return {line.split()[0]: float(line.split()[1]) for line in r.stdout.splitlines() if line.strip()}


def run(exe, lib, scenario, env=None, sanitize="address", rendezvous=None, timeout=None):
    """Runs one scenario in its own process; returns the CompletedProcess. `env`: extra variables (the
    faults, NCCLEMU_VERSION, NCCLAVG_*). `rendezvous`: the stand-in's directory (default: a fresh one)."""
    with tempfile.TemporaryDirectory(prefix="ncclemu-") as tmp:
        full = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLEMU_", "NCCLAVG_", "NCCL_"))}
        full.update(RUN_ENV[sanitize])
        full.pop("LD_PRELOAD", None)
        full.update({"NCCLAVG_NCCL_LIBRARY": str(lib), "NCCLEMU_DIR": str(rendezvous or tmp)})
        full.update(env or {})
        return subprocess.run([str(exe), scenario], capture_output=True, text=True, env=full,
                              timeout=timeout or 120)



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ncclavg-host-emu"))
    ap.add_argument("--sanitize", choices=sorted(SANITIZERS), default="address")
    ap.add_argument("--api", type=int, default=DEFAULT_API, choices=API_LEVELS)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("scenario", nargs="*")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[3]
    exe, lib = build(root, a.cache, a.sanitize, a.api, log=lambda m: print(m, file=sys.stderr, flush=True))
    names = scenarios(exe)
    if a.list:
        print("\n".join(names))
        return 0
    failed = 0
    for name in a.scenario or sorted(names):
        r = run(exe, lib, name, sanitize=a.sanitize)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            sys.stdout.write(r.stderr[-4000:])
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
