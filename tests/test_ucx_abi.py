"""The ABI check of csrc/transport/ucx_api.h (scripts/check_ucx_abi.py, scripts/ucx_abi_check.cpp): the
hand-written UCX declarations match the ucp.h of the libucx wheel installed here, and a planted wrong
declaration of each kind (an enumerator's value, ucs_status_t's size, a struct's field order, an entry
point's type; with -m slow also a field's type, a callback's type, a parameter struct past UCX's end, an
entry point left unchecked, ptr_is_err(), and the header read out of a .whl) fails it with words that
name it.

Skipped, with the reason, when libucx (libucx-cu13 / -cu12) is not installed or there is no C++ compiler.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from _paths import ROOT, load_script

SCRIPT = ROOT / "scripts" / "check_ucx_abi.py"
API_H = ROOT / "csrc" / "transport" / "ucx_api.h"


def _why_not() -> str | None:
    if not shutil.which(os.environ.get("CXX", "g++")):
        return "no C++ compiler (g++ or $CXX)"
    try:
        load_script(SCRIPT, "check_ucx_abi").installed_include()
    except Exception as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _check(*args, python=(sys.executable,)):
    return subprocess.run([*python, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_the_declarations_match_the_installed_header():
    r = _check()   # no SOURCE: the installed libucx
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[-1].endswith("all match"), r.stdout
    # named by its package and the header's version, with every entry point checked
    assert lines[0].startswith("libucx") and ": ok: ucp.h 1." in lines[0], lines[0]
    assert "(23 entry points)" in lines[0] and ", 0 failed" in lines[0], lines[0]
    print(r.stdout)


# (old, new, words): one wrong declaration each; the words name it in the checker's output
PLANTS = {
    "enum value": ("enum { UCP_DATATYPE_IOV = 2 };", "enum { UCP_DATATYPE_IOV = 3 };",
                   "UCP_DATATYPE_IOV has another value"),
    # UCX packs ucs_status_t into one signed byte: a plain enum is four
    "status size": ("} __attribute__((packed)) ucs_status_t;", "} ucs_status_t;",
                    "ucs_status_t has another size or sign"),
    "struct field order": ("  void* buffer;\n  size_t length;\n} ucp_dt_iov_t;",
                           "  size_t length;\n  void* buffer;\n} ucp_dt_iov_t;",
                           "ucp_dt_iov_t::buffer is at another offset"),
    "entry point type": ("ucs_status_t (*worker_get_efd)(ucp_worker_h worker, int* fd);",
                         "ucs_status_t (*worker_get_efd)(ucp_worker_h worker, unsigned* fd);",
                         "Api::worker_get_efd has another type than ucp_worker_get_efd"),
}
SLOW_PLANTS = {
    "struct field type": ("  unsigned events;\n  void* user_data;", "  uint64_t events;\n  void* user_data;",
                          "ucp_worker_params_t::events has another type"),
    "callback type": ("ucs_status_t status, const ucp_tag_recv_info_t* info,",
                      "ucs_status_t status, ucp_tag_recv_info_t* info,",
                      "ucp_request_param_t::cb.recv has another type"),
    "struct past UCX's end": ("  const char* name;\n} ucp_params_t;",
                              "  const char* name;\n  uint64_t spare[64];\n} ucp_params_t;",
                              "sizeof(ucp_params_t) is more than this UCX's struct"),
    "unchecked entry point": ("  const char* (*status_string)(ucs_status_t status);\n",
                              "  const char* (*status_string)(ucs_status_t status);\n"
                              "  ucs_status_t (*worker_fence)(ucp_worker_h worker);\n",
                              "Api has a member that ucx_abi_check.cpp does not check"),
    "ptr_is_err": ("static_cast<intptr_t>(UCS_ERR_LAST)", "static_cast<intptr_t>(UCS_ERR_ENDPOINT_TIMEOUT)",
                   "ptr_is_err() is not UCS_PTR_IS_ERR"),
}


@pytest.mark.parametrize("plant", [*PLANTS, *(pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PLANTS)])
def test_a_planted_wrong_declaration_fails_the_check(plant, tmp_path):
    old, new, words = {**PLANTS, **SLOW_PLANTS}[plant]
    text = API_H.read_text()
    assert text.count(old) == 1, f"the plant {plant!r} no longer matches ucx_api.h: update it"
    (tmp_path / "ucx_api.h").write_text(text.replace(old, new))
    r = _check("--api-dir", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert words in r.stdout + r.stderr and "MISMATCH" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_a_wheel_is_read_for_its_headers(tmp_path):
    """A .whl of libucx: its libucx/include is read out of it, and it is named by package and version."""
    include = load_script(SCRIPT, "check_ucx_abi").installed_include()
    wheel = tmp_path / "libucx_cu13-1.99.0-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in include.rglob("*.h"):
            z.write(f, "libucx/include/" + f.relative_to(include).as_posix())
    r = _check(str(wheel))
    assert r.returncode == 0 and r.stdout.startswith("libucx-cu13 1.99.0 (ucp.h 1."), r.stdout + r.stderr


def test_a_source_without_ucp_h_cannot_run_the_check(tmp_path):
    r = _check(str(tmp_path))
    assert r.returncode == 2 and "no ucp/api/ucp.h there" in r.stderr, r.stdout + r.stderr


def test_no_source_and_no_libucx_cannot_run_the_check():
    r = _check(python=(sys.executable, "-S"))   # -S: no site-packages, so no libucx
    assert r.returncode == 2 and "no libucx in this Python" in r.stderr, r.stdout + r.stderr
