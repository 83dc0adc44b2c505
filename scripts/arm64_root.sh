#!/usr/bin/env bash
# Makes (once, cached) an arm64 Debian root file system and prints its directory,
# $NCCLAVG_WHEELS_CACHE/aarch64/SUITE. For the aarch64 wheel:
#   bullseye  g++, libc6-dev and what they depend on: the cross compiler's --sysroot
#             (scripts/build_wheels.sh --arch aarch64, Note [The aarch64 wheel] there)
#   bookworm  CPython 3.11 (python3.11-minimal, libpython3.11-stdlib, libpython3.11-dev): its headers
#             and sysconfigdata for the cross build, its interpreter for scripts/test_wheel_qemu.sh
#
#   scripts/arm64_root.sh bullseye|bookworm
#
# Note [Foreign roots, never run]
# debootstrap --foreign --arch arm64 resolves the dependencies, downloads the packages and checks them
# against the mirror's signed index, but on an x86-64 machine unpacks only the base set and leaves the
# second stage (the maintainer scripts, which would run inside the root) undone. Nothing here needs
# those scripts: a sysroot is headers and libraries, and one interpreter runs under qemu-aarch64 -L
# with nothing configured. So every downloaded .deb is unpacked with dpkg-deb -x, and absolute
# symlinks are made relative (from outside a chroot they point into this host). Needs root and the
# Debian mirror the first time (~20 s per suite); the .debs are cached too ($CACHE/aarch64/debs).
set -euo pipefail
SUITE=${1:-}
case "$SUITE" in
  bullseye) set -- g++ libc6-dev ;;
  bookworm) set -- python3.11-minimal libpython3.11-stdlib libpython3.11-dev ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
CACHE=${NCCLAVG_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ncclavg-wheels}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS="$CACHE/aarch64/$SUITE"
want="$SUITE arm64 minbase: $*"   # the marker holds what was asked for: another list remakes the root
if [ -e "$ROOTFS/.ncclavg-ready" ] && [ "$(cat "$ROOTFS/.ncclavg-ready")" = "$want" ]; then
  echo "$ROOTFS"; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "arm64_root.sh: debootstrap needs root (once; the $SUITE root is cached in $ROOTFS)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "arm64_root.sh: apt-get install debootstrap" >&2; exit 2; }
echo "arm64_root.sh: debootstrap --foreign --arch arm64 $SUITE ($*) from $MIRROR" >&2
mkdir -p "$CACHE/aarch64/debs"
rm -rf "$ROOTFS.tmp"
log="$CACHE/aarch64/$SUITE.log"
nice -n 19 debootstrap --foreign --arch arm64 --variant=minbase --include="$(echo "$*" | tr ' ' ,)" \
  --cache-dir="$CACHE/aarch64/debs" "$SUITE" "$ROOTFS.tmp" "$MIRROR" > "$log" 2>&1 \
  || { tail -20 "$log" >&2; exit 1; }
for deb in "$ROOTFS.tmp"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$ROOTFS.tmp"; done
rm -f "$ROOTFS.tmp"/var/cache/apt/archives/*.deb   # a copy of what $CACHE/aarch64/debs holds
find "$ROOTFS.tmp" -xdev -type l -lname '/*' -print0 | while IFS= read -r -d '' l; do
  ln -sfn "$(realpath -m -s --relative-to="$(dirname "$l")" "$ROOTFS.tmp$(readlink "$l")")" "$l"
done
echo "$want" > "$ROOTFS.tmp/.ncclavg-ready"
rm -rf "$ROOTFS"; mv "$ROOTFS.tmp" "$ROOTFS"
echo "$ROOTFS"
