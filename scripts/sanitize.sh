#!/usr/bin/env bash
# Builds the CPU core with AddressSanitizer + UndefinedBehaviorSanitizer into a scratch copy of the
# checkout and runs the CPU test suite against it. Any sanitizer report fails the run.
#   scripts/sanitize.sh [pytest args...]
# Default: the tests that drive the C++ core (average, pack, the fused optimizers and master weights,
# the Buffer boundary, local/gloo communicators and the shared-memory channel, averager, trainer,
# bad-input battery, fuzzing and the fault tests), about 3 minutes on 2 cores including the build. The whole suite under ASan takes well
# over 5 minutes there and adds only pure-Python paths; pass `tests/` to run it all anyway.
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

# ldd's whole output first: `ldd | grep -q` under pipefail fails at random when grep exits early and
# ldd dies of SIGPIPE.
LINKED=$(ldd ncclavg/_C*.so)
case "$LINKED" in
  *libasan*) ;;
  *) echo "the sanitized core does not link libasan:"; echo "$LINKED"; exit 1 ;;
esac

# The interpreter is not sanitized, so the runtime is preloaded; leak checking is off because CPython
# and torch keep allocations alive until exit by design.
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBUBSAN=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$LIBASAN $LIBUBSAN"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
if [ "$#" -eq 0 ]; then
  set -- -q -m "not slow and not gpu" -p no:cacheprovider \
    tests/test_average.py tests/test_pack.py tests/test_bad_input.py tests/test_bad_input_battery.py \
    tests/comm/test_comm_local.py tests/comm/test_comm_gloo.py tests/transport/test_shm_channel.py tests/transport/test_shm_misuse.py \
    tests/transport/test_ucx_lanes.py \
    tests/test_averager.py tests/test_bucketing.py \
    tests/test_optim_kernels.py tests/test_optim.py tests/test_optim_fast_paths.py tests/test_master.py tests/train/test_trainer.py \
    tests/test_fuzz.py tests/train/test_faults_nonfinite.py tests/comm/test_faults_comm.py tests/train/test_faults_checkpoint.py
fi
"$PY" -c 'import ncclavg._C as c, sys; print("testing", c.__file__); sys.exit(0 if c.__file__.startswith(sys.argv[1]) else 1)' "$SCRATCH"
"$PY" -m pytest "$@"
echo "sanitizers: clean"
