#!/usr/bin/env python3
"""The ABI check of ncclavg's hand-written NCCL declarations (csrc/cuda/nccl_api.h) against real nccl.h
headers: scripts/nccl_abi_check.cpp compiled and run once per header (static_asserts on enum values,
sizes, ncclConfig_t's offsets and field types, the type of every entry point; run-time checks of
default_config() against NCCL_CONFIG_INITIALIZER).

    python scripts/check_nccl_abi.py SOURCE [SOURCE ...] [--api-dir DIR] [--cxx g++] [--cuda-include DIR]

A SOURCE is a folder holding nccl.h, a `pip install --target` folder of nvidia-nccl-cu12 / -cu13 (its
nvidia/nccl/include/nccl.h), or one of their .whl files (nccl.h is read out of it). Each is named by its
package and version where known, and by the header's own NCCL_MAJOR.MINOR.PATCH. --api-dir is the folder
whose nccl_api.h is checked (default: csrc/cuda of this checkout; tests plant a wrong copy there).
nccl.h includes cuda_runtime.h: the CUDA toolkit's include folder comes from --cuda-include, CUDA_HOME,
nvcc's location or /usr/local/cuda.

Exit status: 0 when every header matches, 1 when one does not (the compiler's static_assert lines or the
run-time check's words are printed), 2 when the check cannot run (no nccl.h in a source, no compiler, no
cuda_runtime.h).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "nccl_abi_check.cpp"
WHEEL_HEADER = "nvidia/nccl/include/nccl.h"
_WHEEL_NAME = re.compile(r"(nvidia_nccl_cu\d+)-([\w.]+?)-py3")


class Unusable(Exception):
    """The check cannot run here (exit status 2)."""


def cuda_include(explicit: str | None = None) -> Path:
    candidates = [explicit] if explicit else []
    if not explicit:
        for var in ("CUDA_HOME", "CUDA_PATH"):
            if os.environ.get(var):
                candidates.append(os.path.join(os.environ[var], "include"))
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include"))
        candidates.append("/usr/local/cuda/include")
    for c in candidates:
        if (Path(c) / "cuda_runtime.h").is_file():
            return Path(c).resolve()
    raise Unusable(f"no cuda_runtime.h (nccl.h includes it) in {', '.join(candidates)}: give --cuda-include "
                   "or set CUDA_HOME")


def header_version(nccl_h: Path) -> str:
    text = nccl_h.read_text(errors="replace")
    parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def locate(source: str, scratch: Path) -> tuple[Path, str]:
    """(the folder holding nccl.h, the package's name and version or the folder) for one SOURCE."""
    p = Path(source)
    if p.is_file() and p.suffix == ".whl":
        m = _WHEEL_NAME.match(p.name)
        label = f"{m.group(1).replace('_', '-')} {m.group(2)}" if m else p.name
        with zipfile.ZipFile(p) as z:
            if WHEEL_HEADER not in z.namelist():
                raise Unusable(f"{p}: the wheel has no {WHEEL_HEADER}")
            out = scratch / p.stem
            out.mkdir(parents=True, exist_ok=True)
            (out / "nccl.h").write_bytes(z.read(WHEEL_HEADER))
        return out, label
    if not p.is_dir():
        raise Unusable(f"{source}: neither a folder nor a .whl file")
    for inc in (p, p / "nvidia" / "nccl" / "include"):
        if (inc / "nccl.h").is_file():
            # the --target folder (or site-packages) above nvidia/nccl/include holds the wheel's dist-info
            top = p if inc != p else (inc.parents[2] if inc.as_posix().endswith("nvidia/nccl/include") else None)
            dist = sorted(top.glob("nvidia_nccl_cu*.dist-info")) if top else []
            label = str(p)
            if dist:
                name, _, version = dist[-1].name[:-len(".dist-info")].partition("-")
                label = f"{name.replace('_', '-')} {version}"
            return inc, label
    raise Unusable(f"{source}: no nccl.h there nor in nvidia/nccl/include")


def check_one(include: Path, api_dir: Path, cxx: str, cuda_inc: Path, scratch: Path) -> tuple[bool, str]:
    """Compiles and runs the checker against one nccl.h folder: (matched, what it said)."""
    exe = scratch / f"check-{abs(hash(str(include)))}"
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{api_dir}", f"-I{include}", f"-I{cuda_inc}",
           "-o", str(exe), str(CHECKER)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if build.returncode != 0:
        errors = [ln for ln in build.stderr.splitlines() if "error" in ln] or build.stderr.splitlines()[-20:]
        return False, "does not compile:\n  " + "\n  ".join(errors[:20])
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    said = (run.stdout + run.stderr).strip()
    return run.returncode == 0, said


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="nccl.h folders, pip --target folders or .whl files")
    ap.add_argument("--api-dir", type=Path, default=ROOT / "csrc" / "cuda", help="folder of the nccl_api.h to check")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--cuda-include", default=None)
    args = ap.parse_args(argv)
    try:
        if not (args.api_dir / "nccl_api.h").is_file():
            raise Unusable(f"--api-dir: no nccl_api.h in {args.api_dir}")
        if not shutil.which(args.cxx):
            raise Unusable(f"--cxx: no compiler '{args.cxx}' on PATH")
        cuda_inc = cuda_include(args.cuda_include)
        with tempfile.TemporaryDirectory(prefix="nccl_abi.") as tmp:
            scratch = Path(tmp)
            located = [locate(s, scratch) for s in args.sources]
            bad = 0
            for include, label in located:
                ok, said = check_one(include, args.api_dir.resolve(), args.cxx, cuda_inc, scratch)
                bad += not ok
                print(f"{label} (nccl.h {header_version(include / 'nccl.h')}): {'ok' if ok else 'MISMATCH'}: {said}")
    except Unusable as e:
        print(f"check_nccl_abi: {e}", file=sys.stderr)
        return 2
    print(f"nccl_api.h vs {len(located)} nccl.h: {'all match' if not bad else f'{bad} do not match'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
