#!/usr/bin/env python3
"""The ABI check of ncclavg's hand-written UCX declarations (csrc/transport/ucx_api.h) against real ucp.h
headers: scripts/ucx_abi_check.cpp compiled and run once per header (static_asserts on enum values and
types, the structs' offsets, field types and sizes, the type of every entry point, the UCP API version;
run-time checks of ptr_is_err() / ptr_status() against UCS_PTR_IS_ERR / UCS_PTR_STATUS).

    python scripts/check_ucx_abi.py [SOURCE ...] [--api-dir DIR] [--cxx g++]

A SOURCE is an include folder holding ucp/api/ucp.h, a `pip install --target` folder (or site-packages) of
libucx-cu12 / -cu13 (its libucx/include), or one of their .whl files (libucx/include is read out of it).
With none, the libucx wheel installed in this Python is checked. Each is named by its package and version
where known, and by the header's own UCP_API_MAJOR.MINOR. --api-dir is the folder whose ucx_api.h is
checked (default: csrc/transport of this checkout; tests plant a wrong copy there). No libucp is linked
or loaded, and no CUDA is needed.

Exit status: 0 when every header matches, 1 when one does not (the compiler's static_assert lines or the
run-time check's words are printed), 2 when the check cannot run (no ucp.h in a source, no SOURCE and no
libucx installed, no compiler).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "ucx_abi_check.cpp"
HEADER = "ucp/api/ucp.h"
WHEEL_INCLUDE = "libucx/include/"
_WHEEL_NAME = re.compile(r"(libucx_cu\d+|libucx)-([\w.]+?)-py3")


class Unusable(Exception):
    """The check cannot run here (exit status 2)."""


def installed_include() -> Path:
    """The include folder of the libucx wheel installed in this Python (found, not imported)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        raise Unusable("no SOURCE given and no libucx in this Python: pip install libucx-cu13 (or -cu12), or "
                       "name a ucp.h include folder, a pip --target folder or a .whl")
    inc = Path(list(spec.submodule_search_locations)[0]) / "include"
    if not (inc / HEADER).is_file():
        raise Unusable(f"the installed libucx has no {HEADER} in {inc}")
    return inc


def header_version(include: Path) -> str:
    version_h = include / "ucp" / "api" / "ucp_version.h"  # ucp.h includes it: UCP_API_MAJOR, _MINOR
    text = version_h.read_text(errors="replace") if version_h.is_file() else ""
    parts = [re.search(rf"#define UCP_API_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def _dist_label(top: Path | None, fallback: str) -> str:
    dist = sorted(top.glob("libucx*.dist-info")) if top else []
    if not dist:
        return fallback
    name, _, version = dist[-1].name[:-len(".dist-info")].partition("-")
    return f"{name.replace('_', '-')} {version}"


def locate(source: str, scratch: Path) -> tuple[Path, str]:
    """(the include folder holding ucp/api/ucp.h, the package's name and version or the folder) for one
    SOURCE."""
    p = Path(source)
    if p.is_file() and p.suffix == ".whl":
        m = _WHEEL_NAME.match(p.name)
        label = f"{m.group(1).replace('_', '-')} {m.group(2)}" if m else p.name
        with zipfile.ZipFile(p) as z:
            members = [n for n in z.namelist() if n.startswith(WHEEL_INCLUDE) and not n.endswith("/")]
            if WHEEL_INCLUDE + HEADER not in members:
                raise Unusable(f"{p}: the wheel has no {WHEEL_INCLUDE}{HEADER}")
            out = scratch / p.stem
            for name in members:  # ucp.h includes the rest of UCX's headers (ucs/, uct/): all of include/
                z.extract(name, out)
        return out / WHEEL_INCLUDE, label
    if not p.is_dir():
        raise Unusable(f"{source}: neither a folder nor a .whl file")
    for inc in (p, p / "libucx" / "include"):
        if (inc / HEADER).is_file():
            # the --target folder (or site-packages) above libucx/include holds the wheel's dist-info
            full = inc.resolve()
            top = p if inc != p else (full.parents[1] if full.as_posix().endswith("libucx/include") else None)
            return inc, _dist_label(top, str(p))
    raise Unusable(f"{source}: no {HEADER} there nor in libucx/include")


def check_one(include: Path, api_dir: Path, cxx: str, scratch: Path) -> tuple[bool, str]:
    """Compiles and runs the checker against one ucp.h include folder: (matched, what it said)."""
    exe = scratch / f"check-{abs(hash(str(include)))}"
    # -isystem: a warning inside UCX's own headers (some release, some compiler) is no mismatch of ours
    cmd = [cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{api_dir}", "-isystem", str(include),
           "-o", str(exe), str(CHECKER)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if build.returncode != 0:
        errors = [ln for ln in build.stderr.splitlines() if "error" in ln] or build.stderr.splitlines()[-20:]
        # the failed static_asserts (each names its declaration) before what follows from them, once each
        errors = sorted(dict.fromkeys(errors), key=lambda ln: "static assertion failed" not in ln)
        return False, "does not compile:\n  " + "\n  ".join(errors[:20])
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    said = (run.stdout + run.stderr).strip()
    return run.returncode == 0, said


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*",
                    help="ucp.h include folders, pip --target folders or .whl files (default: the installed libucx)")
    ap.add_argument("--api-dir", type=Path, default=ROOT / "csrc" / "transport",
                    help="folder of the ucx_api.h to check")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    args = ap.parse_args(argv)
    try:
        if not (args.api_dir / "ucx_api.h").is_file():
            raise Unusable(f"--api-dir: no ucx_api.h in {args.api_dir}")
        if not shutil.which(args.cxx):
            raise Unusable(f"--cxx: no compiler '{args.cxx}' on PATH")
        sources = args.sources or [str(installed_include())]
        with tempfile.TemporaryDirectory(prefix="ucx_abi.") as tmp:
            scratch = Path(tmp)
            located = [locate(s, scratch) for s in sources]
            bad = 0
            for include, label in located:
                ok, said = check_one(include, args.api_dir.resolve(), args.cxx, scratch)
                bad += not ok
                print(f"{label} (ucp.h {header_version(include)}): {'ok' if ok else 'MISMATCH'}: {said}")
    except Unusable as e:
        print(f"check_ucx_abi: {e}", file=sys.stderr)
        return 2
    print(f"ucx_api.h vs {len(located)} ucp.h: {'all match' if not bad else f'{bad} do not match'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
