"""The build's decision line and its refusals (fast paths that fail before compiling anything)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(tmp_path, **env):
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t"),
         "--build-lib", str(tmp_path / "l")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


@pytest.mark.parametrize("env,needle", [
    ({"NCCLAVG_CUDA": "maybe"}, "NCCLAVG_CUDA must be auto, 0, 1 or pypi"),
    ({"NCCLAVG_CUDA": "1", "CUDA_HOME": "/nonexistent-cuda"}, "NCCLAVG_CUDA=1 but no CUDA toolkit"),
])
def test_refusals_are_one_clear_line(tmp_path, env, needle):
    r = _build(tmp_path, **env)
    assert r.returncode != 0
    assert needle in r.stdout + r.stderr


def test_bad_arch_list(tmp_path):
    from shutil import which
    if not (which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no CUDA toolkit on this machine: arch parsing is only reached with one")
    r = _build(tmp_path, NCCLAVG_CUDA="1", NCCLAVG_CUDA_ARCHS="ampere")
    assert r.returncode != 0 and "NCCLAVG_CUDA_ARCHS entry 'ampere'" in r.stdout + r.stderr


def test_cpu_only_auto_build_says_why_and_the_ways_out(tmp_path):
    # No toolkit (an explicit CUDA_HOME that does not exist), and a compiler flag that fails at once:
    # the note comes before any compiling, so the build stops right after it.
    r = _build(tmp_path, NCCLAVG_CUDA="auto", CUDA_HOME="/nonexistent-cuda", NCCLAVG_CXXFLAGS="-fno-such-flag")
    out = r.stdout + r.stderr
    assert "CUDA=no (no CUDA toolkit" in out
    assert "this build is CPU-only" in out
    assert "pip install ncclavg-cu13" in out and "NCCLAVG_CUDA=pypi" in out


def test_cpu_only_note_reaches_the_terminal_when_output_is_captured(tmp_path):
    # pip pipes the build's output into its log; the note also goes to the controlling terminal.
    # `script` gives the build a terminal while its stdout and stderr go to a file, as under pip.
    from shutil import which
    if not which("script"):
        pytest.skip("util-linux `script` not installed")
    log = tmp_path / "captured.log"
    inner = (f"cd {ROOT} && {sys.executable} setup.py -q build_ext --build-temp {tmp_path / 't'} "
             f"--build-lib {tmp_path / 'l'} > {log} 2>&1")
    env = {**os.environ, "NCCLAVG_CUDA": "auto", "CUDA_HOME": "/nonexistent-cuda", "NCCLAVG_CXXFLAGS": "-fno-such-flag"}
    r = subprocess.run(["script", "-qec", inner, "/dev/null"], capture_output=True, text=True, timeout=600,
                       env=env, stdin=subprocess.DEVNULL)
    assert "this build is CPU-only" in r.stdout, r.stdout + r.stderr      # what the terminal showed
    assert "this build is CPU-only" in log.read_text()                   # and the captured log has it too


def _messages(monkeypatch, forwards: bool, local: bool):
    monkeypatch.syspath_prepend(str(ROOT / "build_backend"))
    import build_messages
    monkeypatch.setattr(build_messages, "frontend_forwards_warnings", lambda: forwards)
    monkeypatch.setattr(build_messages, "building_a_local_directory", lambda: local)
    return build_messages


DECISION = "ncclavg build: CUDA=yes (nvcc 13.0 at /usr/local/cuda, archs 80;90 + PTX 90, cudart static)"


def test_the_decision_is_one_warning_line_as_pip_writes_it(monkeypatch, tmp_path, capsys):
    """Under pip's PEP 517 runner the decision goes out as a warning that pip writes with
    warnings.formatwarning: one line, with no source line after it, in any working directory (Note
    [Telling pip users about the build])."""
    import warnings

    msgs = _messages(monkeypatch, forwards=True, local=True)
    (tmp_path / "setup.py").write_text("print('a line of some other setup.py')\n")
    monkeypatch.chdir(tmp_path)   # where pip runs: a setup.py there must not be quoted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        msgs.tell_user(DECISION, msgs.BuildDecision)
    assert capsys.readouterr().out == DECISION + "\n"   # the -v log
    assert len(caught) == 1 and caught[0].category is msgs.BuildDecision
    w = caught[0]

    class BuildBackendWarning(UserWarning):   # the category pip gives every forwarded warning
        pass

    shown = warnings.formatwarning(str(w.message), BuildBackendWarning, w.filename, w.lineno, None)
    assert shown == f"setup.py:0: BuildBackendWarning: {DECISION}\n"


def test_the_cuda_decision_reaches_the_terminal_when_output_is_captured(tmp_path):
    """With a toolkit here: the CUDA=yes line also reaches a terminal when the build's output is piped."""
    from shutil import which
    if not which("script") or not (which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("needs util-linux `script` and a CUDA toolkit")
    log = tmp_path / "captured.log"
    inner = (f"cd {ROOT} && {sys.executable} setup.py -q build_ext --build-temp {tmp_path / 't'} "
             f"--build-lib {tmp_path / 'l'} > {log} 2>&1")
    env = {**os.environ, "NCCLAVG_CUDA": "1", "NCCLAVG_CXXFLAGS": "-fno-such-flag"}
    r = subprocess.run(["script", "-qec", inner, "/dev/null"], capture_output=True, text=True, timeout=600,
                       env=env, stdin=subprocess.DEVNULL)
    shown = [ln for ln in r.stdout.splitlines() if "ncclavg build: CUDA=" in ln]
    assert len(shown) == 1 and "CUDA=yes (nvcc " in shown[0], r.stdout + r.stderr
    assert "ncclavg build: CUDA=yes (nvcc " in log.read_text()


def test_explicit_cpu_build_is_not_announced(tmp_path):
    r = _build(tmp_path, NCCLAVG_CUDA="0", NCCLAVG_CXXFLAGS="-fno-such-flag")
    assert "CUDA=no (NCCLAVG_CUDA=0)" in r.stdout + r.stderr
    assert "this build is CPU-only" not in r.stdout + r.stderr


def _backend(monkeypatch, **env):
    for k in ("NCCLAVG_CUDA", "NCCLAVG_CUDA_MAJOR", "NCCLAVG_CUDA_PYPI_VERSION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(ROOT / "build_backend"))
    monkeypatch.chdir(ROOT)
    import ncclavg_build
    return ncclavg_build


def test_backend_adds_the_pypi_toolkit_only_when_asked(monkeypatch):
    b = _backend(monkeypatch)
    assert not any(r.startswith("nvidia-") for r in b.get_requires_for_build_wheel())
    b = _backend(monkeypatch, NCCLAVG_CUDA="pypi")
    for hook in (b.get_requires_for_build_wheel, b.get_requires_for_build_editable):
        reqs = hook()
        for name in ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-runtime", "nvidia-cuda-cccl"):
            assert f"{name}==13.0.*" in reqs, reqs
    b = _backend(monkeypatch, NCCLAVG_CUDA="pypi", NCCLAVG_CUDA_PYPI_VERSION="13.2.*")
    assert "nvidia-cuda-nvcc==13.2.*" in b.get_requires_for_build_wheel()


def test_backend_refuses_cuda12_from_pypi_saying_why(monkeypatch):
    b = _backend(monkeypatch, NCCLAVG_CUDA="pypi", NCCLAVG_CUDA_MAJOR="12")
    with pytest.raises(SystemExit, match="nvcc nor cicc"):
        b.get_requires_for_build_wheel()


def test_pypi_mode_without_the_toolkit_names_what_to_install(tmp_path):
    # A bad flag stops the build at its first compile if this environment has the toolkit after all.
    r = _build(tmp_path, NCCLAVG_CUDA="pypi", PYTHONNOUSERSITE="1", NCCLAVG_CXXFLAGS="-fno-such-flag")
    out = r.stdout + r.stderr
    if "CUDA=yes" in out:
        pytest.skip("the PyPI toolkit is installed in this environment")
    assert r.returncode != 0
    assert "NCCLAVG_CUDA=pypi but the PyPI CUDA 13 toolkit is not on sys.path" in out
    assert "nvidia-cuda-nvcc==13.0.*" in out


@pytest.mark.parametrize("archs, small_only", [("80;90", False), ("60;80", True), ("75", False), ("sm_61", True)])
def test_an_arch_below_sm70_builds_the_small_pack_table_only(tmp_path, archs, small_only):
    # Kernel parameters above 4 KiB need sm_70+ (Note [Pack chunk table] in csrc/cuda/pack_kernel.cu), so
    # the build defines NCCLAVG_PACK_SMALL_TABLE_ONLY for every source. A stand-in toolkit (an nvcc that
    # only answers --version) and a C++ flag that fails at once: the failing command line shows the defines.
    home = tmp_path / "cuda"
    for sub in ("bin", "include", "lib64"):
        (home / sub).mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "lib64" / "libcudart_static.a").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text('#!/bin/sh\necho "Cuda compilation tools, release 12.4, V12.4.131"\nexit 1\n')
    nvcc.chmod(0o755)
    r = _build(tmp_path, NCCLAVG_CUDA="1", CUDA_HOME=str(home), NCCLAVG_CUDA_ARCHS=archs,
               NCCLAVG_CXXFLAGS="-fno-such-flag")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "-fno-such-flag" in out and "-DNCCLAVG_WITH_CUDA" in out, out[-3000:]
    assert ("-DNCCLAVG_PACK_SMALL_TABLE_ONLY" in out) == small_only, out[-3000:]


def _setup_functions(*names):
    """Functions and constants of setup.py, without running it (it calls setup() at import)."""
    import ast
    import platform

    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in names) or
            (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets))]
    sys.path.insert(0, str(ROOT / "build_backend"))
    from isa_levels import foreign

    ns = {"Path": Path, "ROOT": ROOT, "platform": platform, "foreign": foreign}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    return ns


def test_each_architecture_compiles_only_its_own_isa_files():
    """Note [Run-time ISA dispatch]: x86 pragmas and intrinsics do not exist on aarch64, nor the reverse."""
    ns = _setup_functions("sources", "cpu_sources")
    x86, arm = ns["cpu_sources"]("x86_64"), ns["cpu_sources"]("aarch64")
    for fam in ("kernels", "pack", "optim"):
        assert f"csrc/cpu/{fam}_scalar.cpp" in x86 and f"csrc/cpu/{fam}_scalar.cpp" in arm
        for lvl in ("avx2", "avx512"):
            assert f"csrc/cpu/{fam}_{lvl}.cpp" in x86 and f"csrc/cpu/{fam}_{lvl}.cpp" not in arm
        for lvl in ("neon", "sve"):
            assert f"csrc/cpu/{fam}_{lvl}.cpp" in arm and f"csrc/cpu/{fam}_{lvl}.cpp" not in x86
    assert "csrc/cpu/simd.cpp" in arm and "csrc/cpu/optim.cpp" in arm
    # Any other architecture gets the scalar level alone.
    assert not [s for s in ns["cpu_sources"]("riscv64") if s.rsplit("_", 1)[-1][:-4] in ("avx2", "avx512", "neon", "sve")]


@pytest.mark.parametrize("host,want", [(None, None), ("linux-aarch64", "aarch64"), ("linux-x86_64", "x86_64"),
                                       ("macosx-11.0-arm64", "aarch64")])
def test_target_machine_follows_python_host_platform(monkeypatch, host, want):
    """A cross build (scripts/build_wheels.sh --arch aarch64) names its target in _PYTHON_HOST_PLATFORM,
    as setuptools' wheel tag reads it: the level files follow the same variable."""
    import platform

    sys.path.insert(0, str(ROOT / "build_backend"))
    from isa_levels import target_machine

    if host is None:
        monkeypatch.delenv("_PYTHON_HOST_PLATFORM", raising=False)
        want = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    else:
        monkeypatch.setenv("_PYTHON_HOST_PLATFORM", host)
    assert target_machine() == want


@pytest.mark.parametrize("args,needle", [
    (["--arch", "aarch64", "--variants", "cu13"], "cpu variant only; cu13 would need NVIDIA's CUDA toolkit for aarch64 (sbsa)"),
    (["--arch", "aarch64", "--pythons", "3.12"], "CPython 3.11 only"),
    (["--arch", "riscv64"], "--arch must be x86_64 or aarch64"),
])
def test_build_wheels_refusals(tmp_path, args, needle):
    """scripts/build_wheels.sh refuses what it cannot build before touching the network or the cache."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheels.sh"), *args, "--out", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "NCCLAVG_WHEELS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and needle in r.stderr, r.stdout + r.stderr


def test_core_errors_name_their_source_relative_to_the_tree():
    """A check's [file:line] (csrc/common/check.h) is relative to the source tree (setup.py's
    -ffile-prefix-map), so a wheel's errors do not carry the build machine's directories."""
    from ncclavg import _C

    with pytest.raises(ValueError) as e:
        _C.digest([(0, -1)])
    assert "[csrc/cpu/replica_hash.cpp:" in str(e.value), str(e.value)
    assert str(ROOT) not in str(e.value)
