#!/usr/bin/env bash
# Checks an aarch64 wheel (scripts/build_wheels.sh --arch aarch64) on this x86-64 machine: Debian 12's
# arm64 CPython 3.11 (scripts/arm64_root.sh bookworm) run under qemu-aarch64 in user mode, with the
# wheel and numpy's aarch64 wheel from PyPI unpacked into a site directory, from outside the checkout.
#
#   scripts/test_wheel_qemu.sh WHEEL
#
# Checks: `import ncclavg._C` and the SIMD level it picks on a CPU with SVE (qemu's `max`: sve) and on
# one without (`max,sve=off`: neon, and forcing sve there is an error naming NCCLAVG_SIMD, at the
# first use of the level); at each of
# scalar, neon and sve forced (NCCLAVG_SIMD), ops.average_ (float32 and float16) and ops.pack_ /
# unpack_ on numpy arrays, equal bit for bit to the same arithmetic done by numpy, and the same bits at
# every level; `python -m ncclavg info` (it needs no torch); the OpenMP runtime loaded is the wheel's;
# the extension's libraries and symbol versions resolve with Debian 11's arm64 loader (glibc 2.31).
# Not checked: anything that needs torch (no torch under qemu here), speed (qemu emulates).
# Needs qemu-aarch64 (Debian: qemu-user); root and the Debian mirror once for the bookworm root, PyPI
# once for numpy (both cached under NCCLAVG_WHEELS_CACHE, as scripts/build_wheels.sh's).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
[ $# -eq 1 ] && [ -f "$1" ] || { sed -n '2,6p' "$0" >&2; exit 2; }
WHEEL=$(realpath "$1")
case "$(basename "$WHEEL")" in
  *-cp311-cp311-*aarch64.whl) ;;
  *) echo "test_wheel_qemu.sh: $(basename "$WHEEL") is not a CPython 3.11 aarch64 wheel" >&2; exit 2 ;;
esac
QEMU=${QEMU_AARCH64:-qemu-aarch64}
command -v "$QEMU" >/dev/null || { echo "test_wheel_qemu.sh: no $QEMU on PATH (Debian: apt-get install qemu-user)" >&2; exit 2; }
CACHE=${NCCLAVG_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ncclavg-wheels}
t0=$SECONDS
say() { printf '[test_wheel_qemu %4ss] %s\n' "$((SECONDS - t0))" "$*"; }

PYROOT=$(NCCLAVG_WHEELS_CACHE="$CACHE" scripts/arm64_root.sh bookworm)
# numpy's aarch64 wheel for CPython 3.11, downloaded once (any version the wheel's requirement allows).
WHEELS="$CACHE/aarch64/wheels"
if ! ls "$WHEELS"/numpy-*-cp311-cp311-*aarch64*.whl >/dev/null 2>&1; then
  say "numpy for aarch64 from PyPI"
  PIP_CACHE_DIR="$CACHE/pip" python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 -d "$WHEELS" "numpy>=1.22"
fi
NUMPY=$(ls "$WHEELS"/numpy-*-cp311-cp311-*aarch64*.whl | sort -V | tail -1)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Unpacked, not pip-installed: pip under qemu takes minutes and checks nothing more (no build, the
# files as they are in the wheels). The interpreter is bookworm's alone: its stdlib, nothing else.
for w in "$NUMPY" "$WHEEL"; do python3 -m zipfile -e "$w" "$WORK/site"; done
say "$(basename "$WHEEL") and $(basename "$NUMPY") unpacked; CPython $("$QEMU" -L "$PYROOT" "$PYROOT/usr/bin/python3.11" -c 'import platform; print(platform.python_version(), platform.machine())') under $QEMU"
cd "$WORK"
qpy() {  # qpy CPU ARGS...: the aarch64 interpreter on qemu's CPU model CPU, NCCLAVG_SIMD=$SIMD if set
  local cpu=$1; shift
  env -u PYTHONHOME -u NCCLAVG_SIMD ${SIMD:+NCCLAVG_SIMD=$SIMD} PYTHONPATH="$WORK/site" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \
    "$QEMU" -cpu "$cpu" -L "$PYROOT" "$PYROOT/usr/bin/python3.11" "$@"
}

cat > "$WORK/check.py" <<'PY'
"""One SIMD level: the level picked, then the core on numpy arrays against numpy's own arithmetic."""
import hashlib, os, sys
import numpy as np
import ncclavg
from ncclavg import _C, ops

want = sys.argv[1]
level, supported = _C.simd_level(), list(_C.simd_levels_supported())
assert ncclavg.__file__.startswith(os.environ["PYTHONPATH"]), ncclavg.__file__
print(f"  NCCLAVG_SIMD={os.environ.get('NCCLAVG_SIMD', '(unset)')}: level {level} (supported: {', '.join(supported)})")
assert level == want, (level, want)
rng = np.random.default_rng(11)
f32, f16 = np.float32, np.float16
digest = hashlib.sha256()


def bits(a):
    digest.update(a.tobytes())
    return a.view(np.uint32 if a.dtype == f32 else np.uint16)


for dtype, n, size in [(f32, 3, 10_007), (f32, 8, 4_099), (f16, 3, 10_007), (f32, 1, 17), (f32, 2, 0)]:
    xs = [(rng.standard_normal(size) * 100).astype(dtype) for _ in range(n)]
    acc = xs[0].astype(f32)               # the core: fp32 sum in buffer order, divided by n, one rounding
    for x in xs[1:]:
        acc = acc + x.astype(f32)
    expected = (acc / f32(n)).astype(dtype)
    finite = ops.average_(xs, check_finite=True)
    for x in xs:
        assert np.array_equal(bits(x), bits(expected)), (dtype, n, size)
    assert finite is True or (finite is None and (n == 1 or size == 0)), finite
    print(f"  average_ {np.dtype(dtype).name}[{n} x {size}]: equal to numpy bit for bit")
xs = [rng.standard_normal(s).astype(f32) for s in (5, 1000, 0, 4_099)]
offsets = [0, 8, 1008, 1008]
bucket = np.zeros(5_200, f16)
assert ops.pack_(xs, bucket, offsets, 3.0, 4.0, check_finite=True) is True
for x, o in zip(xs, offsets):
    assert np.array_equal(bits(bucket[o:o + x.size]), bits(((x * f32(3.0)) / f32(4.0)).astype(f16)))
outs = [np.empty_like(x) for x in xs]
ops.unpack_(bucket, outs, offsets, 4.0, 3.0)
for y, o in zip(outs, offsets):
    assert np.array_equal(bits(y), bits((bucket[o:o + y.size].astype(f32) * f32(4.0)) / f32(3.0)))
print("  pack_ float32 -> float16 bucket (x 3 / 4), unpack_ back (x 4 / 3): equal to numpy bit for bit")
print(f"RESULT {level} {digest.hexdigest()}")
PY

SIMD=""
fail=0
declare -A digests
say "CPU with SVE (qemu -cpu max): the level picked, then each level forced"
for level in "" scalar neon sve; do
  out=$(SIMD=$level qpy max "$WORK/check.py" "${level:-sve}" 2>&1) || { echo "$out"; echo "FAILED: NCCLAVG_SIMD=$level on -cpu max" >&2; fail=1; continue; }
  echo "$out" | grep -v '^RESULT'
  digests[${level:-auto}]=$(echo "$out" | sed -n 's/^RESULT [a-z]* //p')
done
if [ "$fail" = 0 ]; then
  [ "$(printf '%s\n' "${digests[@]}" | sort -u | wc -l)" = 1 ] \
    && echo "  every level wrote the same bits (sha256 ${digests[scalar]:0:16}...)" \
    || { declare -p digests; echo "FAILED: the levels disagree" >&2; fail=1; }
fi

say "CPU without SVE (qemu -cpu max,sve=off): neon picked; sve forced is an error"
qpy max,sve=off "$WORK/check.py" neon 2>&1 | grep -v '^RESULT' || { echo "FAILED: -cpu max,sve=off" >&2; fail=1; }
if err=$(SIMD=sve qpy max,sve=off -c 'from ncclavg import _C; print(_C.simd_level())' 2>&1); then
  echo "$err"; echo "FAILED: NCCLAVG_SIMD=sve accepted on a CPU without SVE" >&2; fail=1
else
  echo "  NCCLAVG_SIMD=sve: $(echo "$err" | tail -1)"
  echo "$err" | grep -q NCCLAVG_SIMD || { echo "FAILED: the error does not name NCCLAVG_SIMD" >&2; fail=1; }
fi

say "python -m ncclavg info (qemu -cpu max)"
qpy max -m ncclavg info || { echo "FAILED: ncclavg info" >&2; fail=1; }
qpy max -c '
import numpy as np, ncclavg
ncclavg.ops.average_([np.ones(1 << 16, np.float32), np.zeros(1 << 16, np.float32)])   # a parallel region
gomp = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l})
assert len(gomp) == 1 and "ncclavg.libs" in gomp[0], gomp
print("  OpenMP runtime: the wheel'"'"'s own,", gomp[0].rsplit("/", 2)[-2] + "/" + gomp[0].rsplit("/", 1)[-1])
' || { echo "FAILED: the wheel's libgomp" >&2; fail=1; }

say "the extension's needs on glibc 2.31 and gcc 10's libstdc++ (bullseye's arm64 loader, --list)"
# The interpreter above is bookworm's (glibc 2.36; bullseye has no CPython 3.11): the manylinux_2_31
# claim is checked by the oldest loader itself, which reports any symbol version its libraries lack.
OLDROOT=$(NCCLAVG_WHEELS_CACHE="$CACHE" "$REPO/scripts/arm64_root.sh" bullseye)
so=$(ls "$WORK"/site/ncclavg/_C.*.so)
if deps=$("$QEMU" -L "$OLDROOT" "$OLDROOT/lib/ld-linux-aarch64.so.1" \
                --library-path "$OLDROOT/lib/aarch64-linux-gnu:$OLDROOT/usr/lib/aarch64-linux-gnu" --list "$so" 2>&1) && ! grep -q 'not found' <<< "$deps"; then
  sed -n 's|^\s*\(\S*\) => .*/\([^/]*/[^/]*\) (0x.*|  \1 => .../\2|p' <<< "$deps"
else
  echo "$deps"; echo "FAILED: the extension does not load on bullseye's glibc and libstdc++" >&2; fail=1
fi

[ "$fail" = 0 ] || { say "FAILED: $(basename "$WHEEL")"; exit 1; }
say "ok: $(basename "$WHEEL") under $QEMU"
