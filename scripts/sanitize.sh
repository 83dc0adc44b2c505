#!/usr/bin/env bash
# Builds the CPU core with AddressSanitizer + UndefinedBehaviorSanitizer into a scratch copy of the
# checkout and runs the CPU test suite against it. Any sanitizer report fails the run.
#   scripts/sanitize.sh [pytest args...]      (default: the whole suite minus slow tests)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

# A copy, so the sanitized core never replaces the normal build of the checkout.
git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 cp --parents -t "$SCRATCH")
cd "$SCRATCH"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
NCCLAVG_CUDA=0 NCCLAVG_CXXFLAGS="$SAN -O1" NCCLAVG_LDFLAGS="$SAN" \
  "$PY" setup.py -q build_ext --inplace > build.log 2>&1 || { cat build.log; exit 1; }

ldd ncclavg/_C*.so | grep -q libasan || { echo "the sanitized core does not link libasan"; exit 1; }

# The interpreter is not sanitized, so the runtime is preloaded; leak checking is off because CPython
# and torch keep allocations alive until exit by design.
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBUBSAN=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$LIBASAN $LIBUBSAN"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
if [ "$#" -eq 0 ]; then set -- -q -m "not slow and not gpu" -p no:cacheprovider; fi
"$PY" -c 'import ncclavg._C as c, sys; print("testing", c.__file__); sys.exit(0 if c.__file__.startswith(sys.argv[1]) else 1)' "$SCRATCH"
"$PY" -m pytest "$@"
echo "sanitizers: clean"
