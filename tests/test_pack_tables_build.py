"""The pack kernel's two segment tables in the real CUDA build (Note [Pack chunk table] in
csrc/cuda/pack_kernel.cu): with CUDA >= 12.1 both the 120-entry and the 1020-entry kernels are compiled,
every one without a stack frame (the table is read from the constant bank, not copied per thread);
with NCCLAVG_PACK_SMALL_TABLE_ONLY (what setup.py defines when an arch below sm_70 is built) only the
small one. Which table a launch uses is tested in the grid emulator (tests/test_cuda_emu.py)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from _paths import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH: nothing to compile with")]


def _compile(tmp_path, *defines):
    obj = tmp_path / "pack.o"
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", "--fmad=false", "-gencode=arch=compute_80,code=sm_80",
                        *defines, "-Xcompiler", "-fPIC", f"-I{ROOT / 'csrc'}", "-Xptxas", "-v", "-c",
                        str(ROOT / "csrc" / "cuda" / "pack_kernel.cu"), "-o", str(obj)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", r.stderr)
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr)]
    return entries, frames


def test_both_tables_are_compiled_without_stack_frames(tmp_path):
    entries, frames = _compile(tmp_path)
    # 4 scale modes x 2 table sizes; the table size is the kernel's second template argument
    assert len(entries) == 8, entries
    assert sum("ELi1020E" in e for e in entries) == 4 and sum("ELi120E" in e for e in entries) == 4, entries
    assert frames == [0] * 8, frames


def test_small_table_only_build(tmp_path):
    entries, frames = _compile(tmp_path, "-DNCCLAVG_PACK_SMALL_TABLE_ONLY")
    assert len(entries) == 4 and all("ELi120E" in e for e in entries), entries
    assert frames == [0] * 4, frames
