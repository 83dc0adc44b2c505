#!/usr/bin/env bash
# Makes a CUDA 12.4 toolkit tree out of Debian's packages of NVIDIA's toolkit, for building ncclavg's
# CUDA 12 part (the ncclavg-cu12 wheel) where no CUDA 12 toolkit is installed: PyPI has no CUDA 12
# nvcc (see Note [The PyPI CUDA toolkit] in build_backend/ncclavg_build.py).
#
#   CUDA_HOME=$(scripts/cuda12_toolkit.sh)     # the tree's path on stdout; progress, nvcc --version on stderr
#
# Downloads three .debs (~1 GB, nearly all of it nvidia-cuda-dev's static libraries, which are not
# extracted), checks their SHA256, extracts what compiling .cu files and linking cudart statically
# needs (~150 MB) and caches the tree in $NCCLAVG_WHEELS_CACHE/cuda12 (default
# ${XDG_CACHE_HOME:-~/.cache}/ncclavg-wheels, as scripts/build_wheels.sh); the .debs are then deleted.
# Needs curl, dpkg-deb and sha256sum; no root, nothing is installed into the system.
# DEBIAN_MIRROR: another Debian mirror (default http://deb.debian.org/debian).
#
# Note [CUDA 12 from Debian]
# Debian's non-free section repackages NVIDIA's CUDA 12.4.1 binaries (source nvidia-cuda-toolkit
# 12.4.1-2, in trixie): nvidia-cuda-toolkit has nvcc, cicc, ptxas, fatbinary, nvlink, cudafe++ and
# libdevice; nvidia-cuda-dev the headers (crt/, cuda_fp16.h, ...) and libcudart_static.a. cuda_fp16.h
# and cuda_bf16.h include <nv/target>, which Debian ships in libcu++-dev (main; CCCL 2.3.2, the version
# CUDA 12.4 comes with). Versions and hashes are pinned: every build uses the same compiler, and a plain
# http mirror cannot swap a file. When Debian replaces a package the download fails (404); take the new
# Version/Filename/SHA256 from dists/trixie/{non-free,main}/binary-amd64/Packages.xz.
# Debian spreads the toolkit over /usr/bin, /usr/lib/nvidia-cuda-toolkit and /usr/include, and its
# nvcc.profile (a link to /etc/nvcc.profile) names those absolute paths. nvcc reads nvcc.profile from
# the directory of its own binary, $(_HERE_), so the tree is laid out as NVIDIA's own toolkit
# (bin/, nvvm/bin/cicc, nvvm/libdevice/, include/, lib64/) with a profile relative to $(_HERE_): it can
# be moved, and setup.py takes it as CUDA_HOME. Debian's bin/g++ wrapper (it picks g++-13, g++-12, ...)
# is left out: nvcc calls the g++ on PATH, which for the wheels is the sysroot wrapper of
# scripts/build_wheels.sh (nvcc 12.4 accepts gcc up to 13).
set -euo pipefail
CACHE=${NCCLAVG_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ncclavg-wheels}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
REV=12.4.1-2   # Debian's revision of the toolkit: the cache folder's name
HOME_DIR="$CACHE/cuda12/$REV"
# file in $MIRROR/pool  sha256
DEBS="
non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319
non-free/n/nvidia-cuda-toolkit/nvidia-cuda-dev_12.4.127~12.4.1-2_amd64.deb d846838f914a0176948d48a8bcade5d6dbcccb5c9374343f6475f5503f173ee0
main/c/cccl/libcu++-dev_2.3.2-2_all.deb 30e911c1909265591b5ea793df0e49e56bed631238b68b3e75c97590c4985686
"
t0=$SECONDS
say() { printf '[cuda12_toolkit %4ss] %s\n' "$((SECONDS - t0))" "$*" >&2; }
die() { echo "cuda12_toolkit.sh: $*" >&2; exit 1; }

if [ ! -e "$HOME_DIR/.ncclavg-ready" ]; then
  for tool in curl dpkg-deb sha256sum; do
    command -v "$tool" >/dev/null || die "needs $tool on PATH (Debian/Ubuntu: apt-get install curl dpkg coreutils)"
  done
  TMP="$HOME_DIR.tmp"
  rm -rf "$TMP"
  mkdir -p "$TMP/debs" "$TMP/x"
  while read -r file sum; do
    [ -n "$file" ] || continue
    deb="$TMP/debs/$(basename "$file")"
    say "download $MIRROR/pool/$file"
    curl -fsSL --retry 3 -o "$deb" "$MIRROR/pool/$file" \
      || die "could not download $MIRROR/pool/$file (on a 404 Debian has replaced the package: update the pins, see Note [CUDA 12 from Debian] in this script)"
    echo "$sum  $deb" | sha256sum -c --quiet - >&2 || die "$deb: SHA256 is not the pinned $sum"
  done <<< "$DEBS"
  say "extract"
  # Only the members named: nvidia-cuda-dev unpacks to 2.5 GB, of which this needs 16 MB.
  T=usr/lib/nvidia-cuda-toolkit
  dpkg-deb --fsys-tarfile "$TMP"/debs/nvidia-cuda-toolkit_*.deb | tar -x -C "$TMP/x" \
    "./$T/bin/nvcc" "./$T/bin/cicc" "./$T/bin/crt" "./$T/libdevice" \
    ./usr/bin/ptxas ./usr/bin/fatbinary ./usr/bin/nvlink ./usr/bin/cudafe++ ./usr/bin/bin2c
  dpkg-deb --fsys-tarfile "$TMP"/debs/nvidia-cuda-dev_*.deb | tar -x -C "$TMP/x" \
    ./usr/include ./usr/lib/x86_64-linux-gnu/libcudart_static.a
  dpkg-deb --fsys-tarfile "$TMP"/debs/libcu++-dev_*.deb | tar -x -C "$TMP/x" ./usr/include/nv ./usr/include/cuda

  # NVIDIA's layout (Note [CUDA 12 from Debian]).
  H="$TMP/home" X="$TMP/x"
  mkdir -p "$H/bin" "$H/nvvm/bin" "$H/lib64"
  mv "$X/$T/bin/nvcc" "$X/$T/bin/crt" "$X"/usr/bin/{ptxas,fatbinary,nvlink,cudafe++,bin2c} "$H/bin/"
  mv "$X/$T/bin/cicc" "$H/nvvm/bin/"
  mv "$X/$T/libdevice" "$H/nvvm/libdevice"
  mv "$X/usr/include" "$H/include"
  mv "$X/usr/lib/x86_64-linux-gnu/libcudart_static.a" "$H/lib64/"
  # nvcc.profile syntax: "+=" prepends, "=+" appends; $(_HERE_) is bin/.
  cat > "$H/bin/nvcc.profile" <<'EOF'
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH              += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES          += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES         =+ $(_SPACE_) "-L$(TOP)/lib64"
EOF

  # A kernel through every stage (cicc, ptxas, fatbinary; cuda_fp16.h for <nv/target>) before the tree
  # is marked ready; needs a host compiler, so it is skipped without one.
  if command -v g++ >/dev/null; then
    say "check: nvcc -c a half-precision kernel, sm_80 + PTX 80 (host compiler $(command -v g++))"
    printf '#include <cuda_fp16.h>\n__global__ void k(__half* x) { x[threadIdx.x] = __hadd(x[threadIdx.x], x[0]); }\n' > "$TMP/k.cu"
    "$H/bin/nvcc" -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=compute_80 \
      -c "$TMP/k.cu" -o "$TMP/k.o" >&2 || die "the toolkit made in $TMP could not compile a kernel (above)"
  else
    say "no g++ on PATH: the compile check is skipped"
  fi
  mv "$H" "$HOME_DIR.new"
  rm -rf "$TMP"
  rm -rf "$HOME_DIR"; mv "$HOME_DIR.new" "$HOME_DIR"
  touch "$HOME_DIR/.ncclavg-ready"
  say "made $HOME_DIR ($(du -sh "$HOME_DIR" | cut -f1)); the .debs are deleted"
fi
"$HOME_DIR/bin/nvcc" --version >&2 || die "$HOME_DIR/bin/nvcc does not run; delete $HOME_DIR and run again"
echo "$HOME_DIR"
