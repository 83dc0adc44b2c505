"""The CPU kernels at every SIMD level, natively and on aarch64 under qemu, without Python bindings.

tests/native/ holds a C++ harness (see its harness_main.cpp) that runs every kernel family (average,
the channel's sum, pack/unpack, the optimizer step with its norm, copy-out and inf/NaN scan) at the
level NCCLAVG_SIMD names against the scalar level bit for bit and against a float64 reference.
tests/native/build_native.py builds it from the csrc/ of THIS checkout into a cache keyed on the
sources: natively (x86-64: scalar, avx2, avx512) and with aarch64-linux-gnu-g++ (-static), run under
qemu-aarch64 at scalar, neon and sve with 128-, 256- and 512-bit vectors, and on a CPU without SVE
(cortex-a72), where sve must be reported unsupported and forcing it must fail with a clear error.
A NEON lane type with a planted wrong lane must fail the harness. The shared-memory channel's
collectives (csrc/transport/shm_*) run between two forked processes, natively and under qemu, with
exact results (tests/native/shm_main.cpp).
"""
import re
import shutil

import pytest

from _paths import ROOT, load_script

native = load_script(ROOT / "tests" / "native" / "build_native.py", "ncclavg_build_native")
HOST = native.host_arch()


def _arm_skip_reason():
    if native.find_cxx("aarch64") is None:
        return "no aarch64-linux-gnu-g++ on PATH (Debian: apt-get install g++-aarch64-linux-gnu)"
    if HOST != "aarch64" and shutil.which(native.QEMU) is None:
        return "no qemu-aarch64 on PATH (Debian: apt-get install qemu-user)"
    return None


ARM_SKIP = _arm_skip_reason()
needs_arm = pytest.mark.skipif(ARM_SKIP is not None, reason=ARM_SKIP or "")
needs_x86 = pytest.mark.skipif(HOST != "x86_64" or native.find_cxx("x86_64") is None,
                               reason="the native x86-64 levels need an x86-64 host with g++")

# qemu CPU models: `max` has SVE unless told otherwise; cortex-a72 is ARMv8-A with NEON only.
NO_SVE = "max,sve=off"
# The aarch64 build (the core's CPU sources at -O3, cross-compiled: about a minute on 2 cores) and its runs
# under qemu are with the slow tests, which .ci/run runs too; the quick suite keeps the file checks. qemu
# runs the SVE kernels slowly above 128 bits (a 256- or 512-bit run takes ~10 s, a NEON or 128-bit one ~1.5 s).
ARM_RUNS = [("scalar", NO_SVE), ("neon", NO_SVE), ("neon", "cortex-a72"), ("sve", "max,sve128=on"),
            pytest.param("sve", "max,sve256=on", marks=pytest.mark.slow),
            pytest.param("sve", "max,sve512=on", marks=pytest.mark.slow)]
ARM_IDS = ["scalar-nosve", "neon-nosve", "neon-cortex-a72", "sve128", "sve256", "sve512"]


@pytest.fixture(scope="module")
def cache(request, tmp_path_factory):
    c = getattr(request.config, "cache", None)
    return c.mkdir("native_simd") if c is not None else tmp_path_factory.mktemp("native_simd")


@pytest.fixture(scope="module")
def arm_harness(cache):
    return native.build(cache, "aarch64")


@pytest.fixture(scope="module")
def x86_harness(cache):
    return native.build(cache, "x86_64")


def _result(proc):
    m = re.search(r"^RESULT: (\w+) level=(\w+) cases=(\d+) checks=(\d+) failures=(\d+)", proc.stdout, re.M)
    return m and {"status": m.group(1), "level": m.group(2), "cases": int(m.group(3)), "failures": int(m.group(5))}


def _assert_passes(proc, level):
    print(proc.stdout)
    r = _result(proc)
    assert proc.returncode == 0 and r and r["status"] == "ok", proc.stdout[-4000:] + proc.stderr[-4000:]
    assert r["level"] == level and r["failures"] == 0 and r["cases"] > 30000
    for family in ("average+sum", "pack", "optim"):  # every family ran cases
        assert re.search(rf"^{re.escape(family)} +cases=[1-9]", proc.stdout, re.M), family


def test_harness_builds_every_level_file_of_each_architecture():
    for arch, levels in native.LEVELS.items():
        for level in levels:
            for fam in ("kernels", "pack", "optim"):
                assert (ROOT / "csrc" / "cpu" / f"{fam}_{level}.cpp").exists(), (arch, fam, level)


@needs_arm
@pytest.mark.slow
@pytest.mark.parametrize("level,cpu", ARM_RUNS, ids=ARM_IDS)
def test_aarch64_level_matches_scalar_and_float64(arm_harness, level, cpu):
    proc = native.run(arm_harness, "aarch64", cpu, level, ["--quick"], timeout=300)
    _assert_passes(proc, level)
    if level == "sve":  # the vector length qemu was asked for is the one the kernels ran at
        want = re.search(r"sve(\d+)=on", cpu).group(1)
        assert re.search(rf"^sve vector bits: {want}$", proc.stdout, re.M), proc.stdout[:500]


@needs_arm
@pytest.mark.slow
@pytest.mark.parametrize("cpu,supported,best", [(NO_SVE, "scalar neon", "neon"), ("cortex-a72", "scalar neon", "neon"),
                                                ("max,sve256=on", "scalar neon sve", "sve")])
def test_aarch64_levels_follow_the_hardware(arm_harness, cpu, supported, best):
    proc = native.run(arm_harness, "aarch64", cpu, None, ["--info"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert re.search(rf"^supported: {supported}$", proc.stdout, re.M), proc.stdout[:500]
    # NCCLAVG_SIMD unset: the best level the CPU has
    assert re.search(rf"^best: {best}$", proc.stdout, re.M) and re.search(rf"^level: {best}$", proc.stdout, re.M)


@needs_arm
@pytest.mark.slow
@pytest.mark.parametrize("level,cpu,why", [("sve", "cortex-a72", "this CPU does not support 'sve'"),
                                           ("sve", NO_SVE, "this CPU does not support 'sve'"),
                                           ("avx2", NO_SVE, "unknown SIMD level 'avx2'; use auto, scalar, neon or sve")])
def test_aarch64_forcing_an_unsupported_level_is_a_clear_error(arm_harness, level, cpu, why):
    proc = native.run(arm_harness, "aarch64", cpu, level, ["--quick"], timeout=120)
    assert proc.returncode == 3, proc.stdout[-2000:]
    err = re.search(r"^ERROR: (.*)$", proc.stdout, re.M).group(1)
    assert "NCCLAVG_SIMD" in err and why in err, err


@needs_arm
@pytest.mark.slow   # a build of its own
def test_a_wrong_neon_lane_fails_the_harness(cache):
    """NCCLAVG_PLANT_NEON_DEFECT puts one ulp into lane 2 of every NEON float32 store."""
    exe = native.build(cache, "aarch64", defines=["NCCLAVG_PLANT_NEON_DEFECT"])
    proc = native.run(exe, "aarch64", NO_SVE, "neon", ["--quick"], timeout=300)
    r = _result(proc)
    assert proc.returncode == 1 and r and r["status"] == "FAIL" and r["failures"] > 0, proc.stdout[-3000:]
    assert "differs from the scalar level" in proc.stdout
    # The scalar level of the same binary does not use the lane: it still passes.
    _assert_passes(native.run(exe, "aarch64", NO_SVE, "scalar", ["--quick"], timeout=300), "scalar")


# On x86-64 the Python suite drives the channel already (tests/transport): the native run is slow-only.
@pytest.mark.parametrize("arch", [pytest.param("aarch64", marks=[needs_arm, pytest.mark.slow]),
                                  pytest.param("x86_64", marks=[needs_x86, pytest.mark.slow])])
def test_shm_channel_collectives_between_two_processes(cache, arch):
    exe = native.build(cache, arch, program="shm_harness")
    proc = native.run(exe, arch, "max,sve256=on" if native.needs_qemu(arch) else None, None, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0 and "RESULT: ok ranks=2" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}: checks=[1-9]\d* failures=0$", proc.stdout, re.M), proc.stdout[-2000:]


@needs_x86
@pytest.mark.slow   # the Python suite runs the x86 levels already; this is the harness's own check, a build of its own
@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
def test_x86_level_matches_scalar_and_float64(x86_harness, level):
    proc = native.run(x86_harness, "x86_64", None, level, ["--quick"], timeout=300)
    if proc.returncode == 3 and "does not support" in proc.stdout:
        pytest.skip(f"this CPU has no {level}")
    _assert_passes(proc, level)


# The longer size list (up to 4099 elements: long vector loops with every tail again), at the levels
# where the code differs most.
@pytest.mark.slow
@needs_arm
@pytest.mark.parametrize("level,cpu", [("neon", NO_SVE), ("sve", "max,sve256=on")])
def test_aarch64_full_sizes(arm_harness, level, cpu):
    _assert_passes(native.run(arm_harness, "aarch64", cpu, level, [], timeout=600), level)
