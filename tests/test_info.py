"""build_info() / `ncclavg info`: what a bug report pastes. Never needs a GPU or NCCL."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ncclavg

REQUIRED = {"version", "cuda", "cuda_archs", "cuda_runtime", "driver", "driver_error", "device_count",
            "devices", "nccl", "simd_level", "simd_levels_supported", "openmp_threads", "torch", "cupy"}


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ncclavg", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_build_info_keys_and_types():
    info = ncclavg.build_info()
    assert REQUIRED <= set(info)
    assert info["version"] == ncclavg.__version__ == info["core_version"]
    assert isinstance(info["cuda"], bool)
    assert info["simd_level"] in info["simd_levels_supported"]
    assert "scalar" in info["simd_levels_supported"]
    assert info["openmp_threads"] >= 1
    assert set(info["nccl"]) >= {"loaded", "path", "version", "error"}
    if info["cuda"]:
        assert info["cuda_archs"] and info["cuda_runtime"]
        if info["device_count"] == 0:
            assert info["driver_error"], "no device must come with the runtime's reason"
    else:
        assert info["cuda_archs"] == [] and info["device_count"] == 0


def test_cli_info_text_and_json():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    for label in ("ncclavg", "ncclavg's CUDA build", "CUDA driver", "devices", "NCCL", "SIMD", "OpenMP threads",
                  "torch's CUDA build"):
        assert label in r.stdout
    r = _run("info", "--json")
    assert r.returncode == 0, r.stderr
    assert REQUIRED <= set(json.loads(r.stdout))


def test_forced_simd_level_is_reported():
    r = _run("info", "--json", env={"NCCLAVG_SIMD": "scalar"})
    assert json.loads(r.stdout)["simd_level"] == "scalar"


def test_bad_forced_simd_level_is_a_clear_error():
    r = subprocess.run([sys.executable, "-c", "import ncclavg, torch; ncclavg.ops.average_([torch.ones(2), torch.ones(2)])"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "NCCLAVG_SIMD": "mmx"})
    assert r.returncode != 0 and "NCCLAVG_SIMD" in r.stderr


def test_nccl_missing_is_reported_with_install_hint():
    r = _run("info", "--json", env={"NCCLAVG_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert r.returncode == 0, r.stderr
    nccl = json.loads(r.stdout)["nccl"]
    assert not nccl["loaded"] and "NCCLAVG_NCCL_LIBRARY" in nccl["error"]


def test_import_info_and_numpy_ops_work_without_torch():
    # torch is an optional dependency: block it and check what must still work, and what must say why not.
    code = """
import sys
sys.modules["torch"] = None   # any `import torch` now raises ModuleNotFoundError
import numpy as np
import pytest

import ncclavg
assert ncclavg.build_info()["torch"] is None
a = [np.full(7, 1.0, np.float32), np.full(7, 3.0, np.float32)]
ncclavg.ops.average_(a)
assert (a[1] == 2.0).all()
try:
    ncclavg.GradientAverager
except ModuleNotFoundError as e:
    assert "needs PyTorch" in str(e), e
else:
    raise AssertionError("GradientAverager without torch must raise")
for name in ("TowerTrainer", "Communicator", "comm"):
    try:
        getattr(ncclavg, name)
    except ModuleNotFoundError as e:
        assert "needs PyTorch" in str(e), (name, e)
    else:
        raise AssertionError(f"ncclavg.{name} without torch must raise")
from ncclavg.cli import build_parser, main   # builds the bench and train subcommands: no torch needed
build_parser().parse_args(["train", "--epochs", "1"])
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()) as out:
    assert main(["info"]) == 0
assert ["torch", "not importable"] in [ln.split(None, 1) for ln in out.getvalue().splitlines()], out.getvalue()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def _fake_core(monkeypatch, cuda, evidence, **core_fields):
    """build_info() of a core that reports `cuda` (and `core_fields`), on a machine whose driver check says
    `evidence`."""
    from types import SimpleNamespace
    from ncclavg import info as info_mod
    real = info_mod._C
    core = dict(real.core_info())
    core.update(cuda=cuda, cuda_archs="80;90" if cuda else "", cuda_runtime_version=13000 if cuda else 0)
    core.update(core_fields)
    monkeypatch.setattr(info_mod, "_C", SimpleNamespace(core_info=lambda: core,
                                                        simd_levels_supported=real.simd_levels_supported))
    monkeypatch.setattr(info_mod, "nvidia_driver_evidence", lambda: evidence)
    return info_mod


def test_cpu_only_build_on_a_machine_with_a_driver_says_how_to_get_cuda(monkeypatch):
    info_mod = _fake_core(monkeypatch, cuda=False, evidence="/proc/driver/nvidia exists")
    info = info_mod.build_info()
    assert "NCCLAVG_CUDA=pypi" in info["cuda_hint"] and "ncclavg-cu13" in info["cuda_hint"]
    text = info_mod.format_info(info)
    assert "/proc/driver/nvidia exists" in text and "NCCLAVG_CUDA=pypi" in text


def test_no_cuda_hint_without_a_driver_or_with_cuda_built(monkeypatch):
    info_mod = _fake_core(monkeypatch, cuda=False, evidence="")
    assert info_mod.build_info()["cuda_hint"] == ""
    info_mod = _fake_core(monkeypatch, cuda=True, evidence="libcuda.so.1 loads")
    assert info_mod.build_info()["cuda_hint"] == ""
    assert "NCCLAVG_CUDA=pypi" not in info_mod.format_info(info_mod.build_info())


def test_build_record_matches_the_core():
    info = ncclavg.build_info()
    rec = info["build"]
    if not rec:
        pytest.skip("core built before setup.py kept a build record")
    assert rec["cuda"] == info["cuda"] and rec["decision"].startswith("ncclavg build: CUDA=")


INSUFFICIENT = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


def test_no_driver_is_said_as_such_not_as_an_old_driver(monkeypatch):
    """nvcc at build time, no NVIDIA driver here: the CUDA runtime's error for a missing libcuda says the
    driver is too old; info says there is none (Note [Saying why there is no GPU])."""
    info_mod = _fake_core(monkeypatch, cuda=True, evidence="", device_count=0, driver_version=0,
                          driver_error=INSUFFICIENT)
    info = info_mod.build_info()
    assert info["no_gpu_reason"] == info_mod.NO_DRIVER
    text = info_mod.format_info(info)
    assert "CUDA driver           none: no NVIDIA driver on this machine" in text and "insufficient" not in text
    assert "ncclavg's CUDA build  yes, archs 80;90" in text


def test_a_driver_that_does_not_work_keeps_the_runtimes_words(monkeypatch):
    info_mod = _fake_core(monkeypatch, cuda=True, evidence="/proc/driver/nvidia exists", device_count=0,
                          driver_version=0, driver_error=INSUFFICIENT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = info_mod.build_info()["no_gpu_reason"]
    assert reason == ("an NVIDIA driver is here (/proc/driver/nvidia exists, CUDA_VISIBLE_DEVICES='') but no GPU is "
                      "usable: " + INSUFFICIENT)
    assert "not usable: " + INSUFFICIENT in info_mod.format_info(info_mod.build_info())
    info_mod = _fake_core(monkeypatch, cuda=True, evidence="libcuda.so.1 loads", device_count=1)
    assert info_mod.no_gpu_reason() == ""


def test_torchs_cuda_build_is_named_apart(monkeypatch):
    torch = pytest.importorskip("torch")
    from ncclavg import info as info_mod

    monkeypatch.setattr(info_mod, "nvidia_driver_evidence", lambda: "")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert info_mod.torch_no_gpu_reason() == (info_mod.NO_DRIVER + f"; torch's CUDA build: none (torch "
                                              f"{torch.__version__})")
    assert "(torch's CUDA build: none)" in info_mod.format_info(info_mod.build_info())
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert info_mod.torch_cuda_build() == "torch's CUDA build: 13.0"
    assert info_mod.torch_no_gpu_reason() == info_mod.NO_DRIVER
    monkeypatch.setattr(info_mod, "nvidia_driver_evidence", lambda: "libcuda.so.1 loads")
    assert info_mod.torch_no_gpu_reason().startswith("an NVIDIA driver is here (libcuda.so.1 loads) but "
                                                     "torch.cuda.is_available() is False")
