"""The ABI check of csrc/cuda/nccl_api.h (scripts/check_nccl_abi.py, scripts/nccl_abi_check.cpp): the
hand-written NCCL declarations match every nccl.h found here, and a planted wrong declaration of each
kind (an enum value, an entry point's type, a config field's offset, a struct's size, an entry point
left unchecked, default_config()'s magic) fails it with words that name it.

The headers: NCCLAVG_TEST_NCCL_HEADERS (folders, pip --target folders or .whl files, separated by
os.pathsep; .ci/run gives the nvidia-nccl-cu13 and -cu12 wheels, latest and pinned), else the NCCL of
NCCLAVG_TEST_NCCL and any nvidia-nccl wheel on sys.path. Skipped, with the reason, when there is none, or
no C++ compiler or CUDA toolkit headers (nccl.h includes cuda_runtime.h)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _paths import ROOT, load_script

SCRIPT = ROOT / "scripts" / "check_nccl_abi.py"
API_H = ROOT / "csrc" / "cuda" / "nccl_api.h"


def _sources() -> list[str]:
    env = os.environ.get("NCCLAVG_TEST_NCCL_HEADERS", "")
    if env:
        return [s for s in env.split(os.pathsep) if s]
    found = []
    lib = os.environ.get("NCCLAVG_TEST_NCCL")
    if lib:
        inc = Path(lib).resolve().parent.parent / "include"
        if (inc / "nccl.h").is_file():
            found.append(str(inc))
    for entry in sys.path:
        inc = Path(entry or ".") / "nvidia" / "nccl" / "include"
        if (inc / "nccl.h").is_file() and str(inc) not in found:
            found.append(str(inc))
    return found


def _why_not() -> str | None:
    if not _sources():
        return ("no nccl.h: set NCCLAVG_TEST_NCCL_HEADERS, or install nvidia-nccl-cu13 / -cu12 (.ci/run puts "
                "them in --target folders of their own)")
    if not shutil.which(os.environ.get("CXX", "g++")):
        return "no C++ compiler (g++ or $CXX)"
    try:
        load_script(SCRIPT, "check_nccl_abi").cuda_include()
    except Exception as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _check(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_the_declarations_match_every_header():
    sources = _sources()
    r = _check(*sources)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(sources) + 1 and lines[-1].endswith("all match"), r.stdout
    for line in lines[:-1]:   # each header named by its version, with every entry point checked
        assert ": ok: nccl.h 2." in line and "(22 entry points)" in line and ", 0 failed" in line, line
    print(r.stdout)


PLANTS = {
    "enum value": ("ncclFloat16 = 6", "ncclFloat16 = 7", "ncclFloat16 has another value"),
    "entry point type": ("ncclResult_t (*AllReduce)(const void*, void*, size_t,",
                         "ncclResult_t (*AllReduce)(const void*, void*, int,",
                         "Api::AllReduce has another type than ncclAllReduce"),
    "config field order": ("  int minCTAs;\n  int maxCTAs;\n", "  int maxCTAs;\n  int minCTAs;\n",
                           "ncclConfig_t::minCTAs is at another offset"),
    "unique id size": ("char internal[128];", "char internal[64];", "sizeof(ncclUniqueId) differs"),
    "unchecked entry point": ("  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t);",
                              "  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t);\n"
                              "  ncclResult_t (*CommFinalize)(ncclComm_t);",
                              "Api has a member that nccl_abi_check.cpp does not check"),
    "config magic": ("c.magic = 0xcafebeef;", "c.magic = 0xcafebeee;", "default_config().magic"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_wrong_declaration_fails_the_check(plant, tmp_path):
    old, new, words = PLANTS[plant]
    text = API_H.read_text()
    assert text.count(old) == 1, f"the plant {plant!r} no longer matches nccl_api.h: update it"
    (tmp_path / "nccl_api.h").write_text(text.replace(old, new))
    r = _check(_sources()[0], "--api-dir", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert words in r.stdout + r.stderr and "MISMATCH" in r.stdout, r.stdout + r.stderr


def test_a_source_without_nccl_h_cannot_run_the_check(tmp_path):
    r = _check(str(tmp_path))
    assert r.returncode == 2 and "no nccl.h there" in r.stderr, r.stdout + r.stderr
