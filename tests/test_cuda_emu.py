"""The CUDA kernels of csrc/cuda, run on the CPU by the grid emulator (csrc/cuda/emu, docs/cuda_emulation.md).

The harness is built from the csrc/ of THIS checkout (a kernel change is tested without reinstalling),
with ASan + UBSan, into a cache keyed on the sources; it drives every kernel through its real host entry
point and compares bit for bit with the project's scalar CPU kernels, each case in three thread orders.
No GPU and no ncclavg._C needed: only g++ and the CUDA headers.
"""
import re
import shutil
import subprocess

import pytest

from _paths import ROOT, load_script

EMU = ROOT / "csrc" / "cuda" / "emu"


def _load_builder():
    return load_script(EMU / "build_emu.py", "ncclavg_build_emu")


build_emu = _load_builder()


def _skip_reason():
    if build_emu.find_cxx() is None:
        return "no g++ on PATH: the grid emulator compiles the kernels with g++"
    inc, why = build_emu.find_cuda_include()
    if inc is None:
        return f"no CUDA headers ({why}); set CUDA_HOME to a CUDA toolkit"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")

# Planted defects: (kernel file, text, replacement, harness arguments, what must appear in the output).
PLANTED = {
    # an off-by-one in the segment lookup of the chunk table: blocks work on their neighbour's segment
    "segment_lookup": ("pack_kernel.cu", "t.seg[mid].first_block <= block", "t.seg[mid].first_block < block",
                       ["--quick", "pack"], "MISMATCH"),
    # a vector count rounded up: the last vector runs past the end of the tensor
    "vector_count": ("pack_kernel.cu", "const int nvec = (n - head) / V;",
                     "const int nvec = (n - head + V - 1) / V;", ["--quick", "pack"], "AddressSanitizer"),
    # the large table (32 KiB of parameters) chosen on a driver older than CUDA 12.1: the launch is refused
    "large_table_driver": ("pack_kernel.cu", "return driver >= 12010 && major >= 7;", "return major >= 7;",
                           ["--quick", "pack"], "operation not supported"),
    # buffers vectorised together although their addresses differ modulo 16: a misaligned 16-byte access
    "alignment_check": ("average_kernel.cu",
                        "if (reinterpret_cast<uintptr_t>(t.p[k]) % 16 != p0 % 16) head = numel;",
                        "if (false) head = numel;", ["--quick", "average"], "misaligned address"),
}
# The lanes past the vector count of average_vectors once added their uninitialised loads (discarded,
# but undefined behaviour); valgrind sees the read, ASan cannot (it is in bounds, just never written).
UNINIT_FIX = "        if (!live[u]) continue;  // a lane past nvec loaded nothing: its in[g][u] is uninitialised\n"


@pytest.fixture(scope="module")
def cache(request, tmp_path_factory):
    c = getattr(request.config, "cache", None)
    return c.mkdir("cuda_emu") if c is not None else tmp_path_factory.mktemp("cuda_emu")


@pytest.fixture(scope="module")
def harness(cache):
    return build_emu.build(ROOT, cache, jobs=2)


def _result(proc):
    m = re.search(r"^RESULT: (\w+) cases=(\d+) runs=(\d+) elements=(\d+) failures=(\d+)", proc.stdout, re.M)
    return m and {"status": m.group(1), "cases": int(m.group(2)), "runs": int(m.group(3)),
                  "failures": int(m.group(5))}


def test_every_kernel_file_is_driven_by_the_harness():
    on_disk = sorted(p.name for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    assert on_disk == sorted(build_emu.KERNELS), (
        "a kernel file was added or removed: list it in build_emu.KERNELS and give it checks in the harness")


def test_launch_rewrite():
    rw = build_emu.rewrite_launches
    assert rw("pack_kernel<ew::kPackCopy><<<blocks, kThreads, 0, st>>>(table, mul, div);") == (
        "::ncclavg_emu::launch_kernel(pack_kernel<ew::kPackCopy>, blocks, kThreads, 0, st)(table, mul, div);")
    assert rw("k<<<dim3(2, 3), 64>>>(p)") == "::ncclavg_emu::launch_kernel(k, dim3(2, 3), 64)(p)"
    assert rw("divide_kernel<E><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(x)") == (
        "::ncclavg_emu::launch_kernel(divide_kernel<E>, static_cast<unsigned>(blocks), kThreads, 0, s)(x)")
    for name in build_emu.KERNELS:  # nothing left for the compiler to choke on
        assert "<<<" not in build_emu.rewrite_launches((ROOT / "csrc" / "cuda" / name).read_text())


# The quick suite runs the harness's --quick selection (every kernel, dtype pair and table size, fewer
# misalignment pairs and bucket sizes: ~1,000 cases); the slow one runs all of it (~2,200 cases).
@pytest.mark.parametrize("mode", ["quick", pytest.param("full", marks=pytest.mark.slow)])
def test_emulated_kernels_match_the_cpu_kernels(harness, mode):
    proc = build_emu.run(harness, ["--quick"] if mode == "quick" else [], timeout=600)
    print(proc.stdout)
    r = _result(proc)
    assert proc.returncode == 0 and r and r["status"] == "ok", proc.stdout[-4000:] + proc.stderr[-4000:]
    want_cases, want_runs = (900, 2700) if mode == "quick" else (2000, 6000)
    assert r["failures"] == 0 and r["cases"] > want_cases and r["runs"] > want_runs
    for suite in ("launch", "pack", "average", "divide"):
        assert re.search(rf"^{suite} +cases=[1-9]", proc.stdout, re.M), suite


# With the slow tests: each builds a mutated harness (~6 s on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("defect", sorted(PLANTED))
def test_a_planted_defect_fails_the_harness(cache, defect):
    kernel, old, new, args, evidence = PLANTED[defect]
    exe = build_emu.build(ROOT, cache, {kernel: [(old, new)]}, jobs=2)
    proc = build_emu.run(exe, args, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert evidence in out, out[-3000:]


def test_kernels_that_need_threads_together_do_not_compile(tmp_path):
    """See Note [Sequential threads are a legal schedule]: such a kernel must not pass wrongly."""
    inc, _ = build_emu.find_cuda_include()
    for body in ("__shared__ float s[32]; s[0] = 1.0f;", "__syncthreads();", "atomicAdd(p, 1.0f);",
                 "p[0] = __shfl_sync(0xffffffffu, p[0], 1);"):
        src = tmp_path / "k.cpp"
        src.write_text(f"__global__ void k(float* p) {{ {body} }}\n")
        r = subprocess.run([build_emu.find_cxx(), "-std=c++17", "-fsyntax-only", "-isystem", str(inc),
                            "-include", str(EMU / "cuda_emu.h"), str(src)], capture_output=True, text=True)
        assert r.returncode != 0 and "extend it first" in r.stderr, (body, r.stderr[-2000:])


# Slow (a second build without sanitizers, ~15 s on 2 cores): it runs in the `-m slow` step of .ci/run.
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_no_uninitialised_reads_under_valgrind(cache):
    """ASan cannot see a read of a local that was never written; valgrind can, in a build without ASan."""
    def under_valgrind(mutations):
        exe = build_emu.build(ROOT, cache, mutations, jobs=2, sanitize=False)
        return subprocess.run(["valgrind", "-q", "--error-exitcode=3", str(exe), "--quick", "average", "divide"],
                              capture_output=True, text=True, timeout=300)

    clean = under_valgrind(None)
    assert clean.returncode == 0 and "RESULT: ok" in clean.stdout, clean.stdout[-2000:] + clean.stderr[-3000:]
    planted = under_valgrind({"average_kernel.cu": [(UNINIT_FIX, "")]})
    assert planted.returncode == 3 and "uninitialised" in planted.stderr, planted.stderr[-3000:]
