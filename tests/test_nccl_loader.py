"""NCCL loading and the NCCL communicator's CPU-side behaviour: what a machine without a GPU (or without
NCCL) sees. Each case runs in a fresh interpreter because the loader keeps its first result per process.

A real NCCL is looked for in the nvidia-nccl-cu13 / -cu12 wheels on sys.path, or at the file named by
NCCLAVG_TEST_NCCL; the cases that need one skip without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ncclavg
from ncclavg import _ext

ROOT = Path(__file__).resolve().parent.parent


def run_py(code: str, env_extra: dict | None = None, drop: tuple = ()) -> dict:
    """Runs `code` in a fresh interpreter importing this checkout; the code prints one JSON line last."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, f"subprocess failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def real_nccl() -> str | None:
    path = os.environ.get("NCCLAVG_TEST_NCCL")
    if path:
        return path if os.path.exists(path) else None
    found = _ext.nccl_wheel_candidates()
    return found[0] if found else None


needs_real_nccl = pytest.mark.skipif(
    real_nccl() is None,
    reason="no NCCL library to load: pip install nvidia-nccl-cu13 (or set NCCLAVG_TEST_NCCL=/path/libnccl.so.2)")
needs_cuda_build = pytest.mark.skipif(not hasattr(_ext._C, "NcclComm"),
                                      reason="this build of ncclavg has no CUDA part (NCCLAVG_CUDA=0)")


def test_bogus_library_variable_is_reported_not_silently_replaced():
    bogus = "/nonexistent/dir/libnccl.so.2"
    out = run_py("""
        import json, ncclavg
        from ncclavg import _ext
        info = ncclavg.build_info()["nccl"]
        try:
            _ext.require_nccl()
            raised = ""
        except ncclavg.NcclError as e:
            raised = str(e)
        print(json.dumps({"info": info, "raised": raised}))
    """, {"NCCLAVG_NCCL_LIBRARY": bogus})
    info = out["info"]
    assert info["loaded"] is False
    assert "NCCLAVG_NCCL_LIBRARY" in info["error"] and bogus in info["error"]
    assert "NCCLAVG_NCCL_LIBRARY" in out["raised"] and bogus in out["raised"]


@needs_real_nccl
def test_real_library_reports_version_and_source():
    lib = real_nccl()
    out = run_py("""
        import json
        from ncclavg import _ext
        print(json.dumps(_ext.require_nccl()))
    """, {"NCCLAVG_NCCL_LIBRARY": lib})
    assert out["loaded"] is True
    assert out["source"] == "NCCLAVG_NCCL_LIBRARY"
    assert os.path.realpath(out["path"]) == os.path.realpath(lib)
    major, minor, _ = (int(x) for x in out["version"].split("."))
    assert (major, minor) >= (2, 10), out
    assert out["version_code"] == major * 10000 + minor * 100 + int(out["version"].split(".")[2])


@needs_real_nccl
def test_info_command_names_the_loaded_nccl():
    lib = real_nccl()
    env = dict(os.environ, NCCLAVG_NCCL_LIBRARY=lib, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "ncclavg", "info"], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    nccl_line = next(line for line in r.stdout.splitlines() if line.startswith("NCCL"))
    assert "NCCLAVG_NCCL_LIBRARY" in nccl_line and os.path.basename(lib) in nccl_line


def test_without_any_nccl_the_error_says_what_to_install():
    # No variable, no wheel candidates; a system-wide NCCL (or one already loaded) makes this moot.
    out = run_py("""
        import json, ncclavg
        from ncclavg import _ext
        _ext.nccl_wheel_candidates = lambda: []
        info = _ext.nccl_info()
        errors = {}
        try:
            _ext.nccl_comm_class()
        except Exception as e:
            errors["nccl_comm_class"] = [type(e).__name__, str(e)]
        if hasattr(ncclavg, "Communicator"):
            try:
                ncclavg.Communicator.nccl(devices=[0])
            except Exception as e:
                errors["Communicator.nccl"] = [type(e).__name__, str(e)]
        print(json.dumps({"info": info, "errors": errors}))
    """, drop=("NCCLAVG_NCCL_LIBRARY", "LD_LIBRARY_PATH", "LD_PRELOAD"))
    if out["info"]["loaded"]:
        pytest.skip(f"an NCCL is reachable without asking ({out['info']['source']}: {out['info']['path']})")
    assert "pip install nvidia-nccl-cu13" in out["info"]["error"]
    assert out["errors"], "creating an NCCL communicator without NCCL did not raise"
    for where, (kind, msg) in out["errors"].items():
        assert kind == "NcclError", (where, kind, msg)
        assert "pip install nvidia-nccl-cu13" in msg, (where, msg)


@pytest.mark.skipif(hasattr(_ext._C, "NcclComm"), reason="CUDA build: the communicator class exists")
@needs_real_nccl
def test_cpu_build_says_the_nccl_backend_needs_cuda():
    lib = real_nccl()
    out = run_py("""
        import json
        from ncclavg import _ext
        try:
            _ext.nccl_comm_class()
            print(json.dumps(["no error", ""]))
        except Exception as e:
            print(json.dumps([type(e).__name__, str(e)]))
    """, {"NCCLAVG_NCCL_LIBRARY": lib})
    assert out[0] == "CudaError" and "NCCLAVG_CUDA=1" in out[1]


@needs_cuda_build
def test_comm_arguments_are_checked_before_nccl_or_cuda():
    # No NCCL loaded in this subprocess: argument errors come first and name the argument.
    out = run_py("""
        import json
        from ncclavg._ext import _C
        cases = {
            "empty devices": lambda: _C.NcclComm.init_all([], 10),
            "zero timeout": lambda: _C.NcclComm.init_all([0], 0),
            "nan timeout": lambda: _C.NcclComm.init_all([0], float("nan")),
            "short id": lambda: _C.NcclComm.init_rank(b"x" * 7, 2, 0, 0, 5),
            "nranks": lambda: _C.NcclComm.init_rank(b"x" * 128, 0, 0, 0, 5),
            "rank": lambda: _C.NcclComm.init_rank(b"x" * 128, 2, 2, 0, 5),
            "not loaded": lambda: _C.NcclComm.init_all([0], 10),
        }
        out = {}
        for name, f in cases.items():
            try:
                f()
                out[name] = ["no error", ""]
            except Exception as e:
                out[name] = [type(e).__name__, str(e)]
        print(json.dumps(out))
    """, drop=("NCCLAVG_NCCL_LIBRARY",))
    expect = {"empty devices": "devices", "zero timeout": "timeout_s", "nan timeout": "timeout_s",
              "short id": "unique_id", "nranks": "nranks", "rank": "rank"}
    for case, arg in expect.items():
        kind, msg = out[case]
        assert kind == "ValueError" and f"argument '{arg}'" in msg, (case, kind, msg)
    kind, msg = out["not loaded"]
    assert kind == "NcclError" and "require_nccl" in msg, (kind, msg)


@needs_cuda_build
@needs_real_nccl
def test_comm_on_a_machine_without_gpu_raises_a_clear_error():
    if ncclavg.cuda_available():
        pytest.skip("a CUDA device is visible here: the GPU tests cover this machine")
    out = run_py("""
        import json
        from ncclavg import _ext
        NcclComm = _ext.nccl_comm_class()
        uid = _ext.nccl_unique_id()
        out = {"uid_len": len(uid), "uids_differ": uid != _ext.nccl_unique_id()}
        for name, f in {"init_all": lambda: NcclComm.init_all([0], 10),
                        "init_rank": lambda: NcclComm.init_rank(uid, 2, 0, 0, 10)}.items():
            try:
                f()
                out[name] = ["no error", ""]
            except Exception as e:
                out[name] = [type(e).__name__, str(e)]
        print(json.dumps(out))
    """, {"NCCLAVG_NCCL_LIBRARY": real_nccl()})
    assert out["uid_len"] == 128 and out["uids_differ"]
    for name in ("init_all", "init_rank"):
        kind, msg = out[name]
        assert kind in ("CudaError", "NcclError"), (name, kind, msg)
        assert "CUDA device" in msg, msg


@needs_cuda_build
def test_bad_collective_mode_variable_is_refused_before_nccl_or_cuda():
    # See Note [Blocking collectives after a bounded init] in csrc/cuda/comm_init.cpp.
    out = run_py("""
        import json
        from ncclavg._ext import _C
        out = {}
        for name, f in {"init_all": lambda: _C.NcclComm.init_all([0], 10),
                        "init_rank": lambda: _C.NcclComm.init_rank(b"x" * 128, 2, 0, 0, 5)}.items():
            try:
                f()
                out[name] = ["no error", ""]
            except Exception as e:
                out[name] = [type(e).__name__, str(e)]
        print(json.dumps(out))
    """, {"NCCLAVG_NCCL_COLLECTIVES": "sometimes"}, drop=("NCCLAVG_NCCL_LIBRARY",))
    for name, (kind, msg) in out.items():
        assert kind == "ValueError", (name, kind, msg)
        assert "NCCLAVG_NCCL_COLLECTIVES" in msg and "'sometimes'" in msg and "nonblocking" in msg, msg


def test_multi_rank_gpu_rule_of_the_core():
    # The pure rule behind Communicator.nccl([0, 0]) (Note [Several ranks on one GPU] in nccl_api.cpp),
    # present in every build: it names the NCCL found, the one needed and the variable.
    refuse = _ext._C.nccl_multi_rank_gpu_refusal
    assert refuse(23000, "1") == "" and refuse(23203, "1") == ""
    old = refuse(22903, "1")
    assert "2.29.3" in old and "2.30.0" in old and "NCCL_MULTI_RANK_GPU_ENABLE" in old
    unset = refuse(23000, None)
    assert "NCCL_MULTI_RANK_GPU_ENABLE" in unset and "unset" in unset
    assert "'0'" in refuse(23000, "0")
    assert "no NCCL is loaded" in refuse(0, "1")
