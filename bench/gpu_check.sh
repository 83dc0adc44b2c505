#!/usr/bin/env bash
# bench/gpu_check.sh: everything ncclavg needs checked on a GPU machine, in two calls that fit a 15-minute
# lease with room to rerun the first (the machine's start takes 2-3 minutes of it: 180 + 2 x 345 <= 900).
#
#   bench/gpu_check.sh [--part core]  the core call, <= 345 s: build for sm_90 in place (NCCLAVG_CUDA=1),
#                                 info (environment report, `ncclavg info`, one NCCL init logged with
#                                 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV), tests (`pytest -m gpu`, one
#                                 process per test file: bench/gpu_check/gpu_check_files.py), forced
#                                 (the ordering and Work-lifetime tests again with
#                                 NCCLAVG_TEST_REDUCTION=sum_divide:2, then premulsum:2, so that they test
#                                 something on one rank), bench (bench/gpu_bench.py: kernels, copies,
#                                 one-rank NCCL)
#   bench/gpu_check.sh --part extra   the optional second call while the machine is warm, <= 240 s: the
#                                 build again (objects reused: a link only), info, trainer (bench/trainer.py
#                                 on CUDA towers), sanitizer (compute-sanitizer memcheck over
#                                 bench/gpu_check/sanitizer_driver.py). The wheel build needs no GPU
#                                 (.ci/run builds and tests the wheel) and a sweep over one tower measures
#                                 nothing that gpu_bench.py's one-rank rows do not: neither takes lease time.
#   bench/gpu_check.sh --part all     both in one call (on a machine of your own), <= 450 s
#   ... --dry-run                 the same steps without a GPU: the build (CUDA when a toolkit is here) into
#                                 a scratch folder, import + info of that build, the GPU tests and the
#                                 forced reruns (they skip), gpu_bench.py --dry-run, the trainer on CPU
#                                 towers, the sanitizer driver on CPU tensors and the refusal detector
#   ... --plan                    prints the steps, their limits and the budget arithmetic, runs nothing
#
# The programs only this check runs live in bench/gpu_check/ (its README.md says which does what); the
# benchmarks it runs (gpu_bench.py, trainer.py) are bench/'s own and also run alone.
#
# Assumes the machine's python3 ($PYTHON) already has torch, cupy, pybind11 and an NCCL, and that nothing
# can be downloaded: no isolated builds, no installs.
#
# Time: every step has its own limit (the tables below) and a step starts only when its whole limit still
# fits in the budget (GPU_CHECK_BUDGET_S, default per part: the table below), less END_S kept for the
# summary and the packing. The limits add up to at most the budget less RESERVE_S, so normally nothing is
# cut; a step that is cut, not selected (GPU_CHECK_STEPS=build,tests,... runs only those of the part) or
# refused by the machine is "not run", never "pass". A failing step is recorded without stopping the
# later ones.
#
# Output: only what comes back from a GPU machine's $OUT (at most 8 files, 16 MiB each, plain names) is
# left in $OUT (default ./gpu-out/<part>; files of an earlier run there are replaced):
#   gpu_check.json   the part, steps, per-test outcomes, device, versions, the NCCL init's modes, RESULT
#   logs.tar.gz      logs/<step>.log, steps.tsv, junit/<group>.xml and .jsonl (one per pytest process)
#   the benchmarks' own files: gpu_bench.json (core); trainer_gpu.json (extra); dry run: trainer_cpu.json
#   in its place
# Scratch (the dry build, logs before packing) lives in a temp folder that is removed at exit.
# The script checks $OUT against those rules at the end. The last lines printed are the table and one
# RESULT line: "all steps passed", "incomplete: not run: ..." or "FAILED: ...", followed by
# "; N GPU tests skipped (k: reason; ...)" when GPU tests skipped (what they test was not checked).
# Exit status: 0 when every step ran and passed, 1 otherwise, 2 for bad usage.
set -u

DRY=0 PLAN=0 PART=core
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --plan) PLAN=1 ;;
    --part) [[ $# -ge 2 ]] || { echo "gpu_check.sh: --part needs core, extra or all" >&2; exit 2; }; PART=$2; shift ;;
    --part=*) PART=${1#--part=} ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --part core|extra|all, --dry-run, --plan)" >&2; exit 2 ;;
  esac
  shift
done

# The steps of each part, by value, and every step's limit in seconds. The GPU limits are sized for an
# H200 machine with 16 cores (the build is ~30 s on 2 cores here; the tests spawn NCCL ranks; memcheck
# slows torch down); the dry ones for a 2-core CI runner that builds the whole core and its CUDA part from
# scratch (~2-4 min there, longer when the machine is shared), with budgets of their own: no lease bounds
# a dry run. The extra part builds too: after the core call the objects are there and only the link runs;
# on a fresh machine it is the whole build.
case "$PART" in
  core)  STEPS=(build info tests forced bench);                     GPU_BUDGET=345 DRY_BUDGET=620 ;;
  extra) STEPS=(build info trainer sanitizer);                      GPU_BUDGET=240 DRY_BUDGET=470 ;;
  all)   STEPS=(build info tests forced bench trainer sanitizer);   GPU_BUDGET=450 DRY_BUDGET=720 ;;
  *) echo "gpu_check.sh: --part must be core, extra or all, got '$PART'" >&2; exit 2 ;;
esac
# tests: 11 test files, each a pytest process (torch's import and a CUDA context each, ~3-4 s on the
# H200 machine) plus their tests; a hung test costs its TEST_TIMEOUT_S, not the step. forced: 2
# processes of 3 tests each. info: the environment report, `ncclavg info` and one NCCL init.
declare -A GPU_LIMIT=([build]=70 [info]=30 [tests]=140 [forced]=30 [bench]=50 [trainer]=45 [sanitizer]=40)
declare -A DRY_LIMIT=([build]=300 [info]=40 [tests]=150 [forced]=60 [bench]=30 [trainer]=60 [sanitizer]=30)
TEST_TIMEOUT_S=60
if ((DRY)); then BUDGET=${GPU_CHECK_BUDGET_S:-$DRY_BUDGET}; else BUDGET=${GPU_CHECK_BUDGET_S:-$GPU_BUDGET}; fi
RESERVE_S=25   # kept out of the plan: nvidia-smi at the start (<= 10 s), END_S, and the steps' overheads
END_S=12       # kept at the end, at run time: the summary and the packing (a few seconds)
KILL_S=3       # a step past its limit gets SIGTERM, and SIGKILL this much later
LIMITS=()
for s in "${STEPS[@]}"; do
  if ((DRY)); then LIMITS+=("${DRY_LIMIT[$s]}"); else LIMITS+=("${GPU_LIMIT[$s]}"); fi
done

[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: GPU_CHECK_BUDGET_S must be whole seconds, got '$BUDGET'" >&2; exit 2; }
SELECTED=" ${STEPS[*]} "
if [[ -n ${GPU_CHECK_STEPS:-} ]]; then
  SELECTED=" ${GPU_CHECK_STEPS//,/ } "
  for s in $SELECTED; do
    [[ " ${STEPS[*]} " == *" $s "* ]] || { echo "gpu_check.sh: GPU_CHECK_STEPS: unknown step '$s' (steps of --part $PART: ${STEPS[*]})" >&2; exit 2; }
  done
fi

plan() {
  local i sum=0 line=""
  for i in "${!STEPS[@]}"; do
    sum=$((sum + LIMITS[i]))
    line+="${line:+ + }${STEPS[i]} ${LIMITS[i]}"
  done
  echo "plan ($PART): $line = ${sum}s of limits + ${RESERVE_S}s reserve = $((sum + RESERVE_S))s, budget ${BUDGET}s"
  if ((sum + RESERVE_S > BUDGET)); then
    echo "plan: over the budget by $((sum + RESERVE_S - BUDGET))s: the last steps will be cut (not run)"
    return 1
  fi
}
if ((PLAN)); then plan; exit; fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-$ROOT/gpu-out/$PART}
PY=${PYTHON:-python3}
ARCHS=${NCCLAVG_CUDA_ARCHS:-90}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# What an earlier run (this layout or the older one) left in $OUT, so that the check at the end counts
# this run's files only.
rm -rf "$OUT_DIR"/{gpu_check.json,logs.tar.gz,gpu_bench.json,trainer_gpu.json,bench-nccl.json,bench-nccl.png} \
  "$OUT_DIR"/{trainer_cpu.json,bench-local.json,bench-local.png,logs,steps.tsv,pytest-gpu.xml,junit,dry-stage,dry-lib,wheel}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$SCRATCH"' EXIT
KEEP=$SCRATCH/keep   # what goes into logs.tar.gz
mkdir -p "$KEEP/logs" || exit 1
: > "$KEEP/steps.tsv"
START=$(date +%s)
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1   # a step killed at its limit still leaves what it printed in its log

# A signal (the lease's own timeout, ^C) stops the step in flight, records the rest as not run, and still
# packs and summarises: the logs are only in $SCRATCH until then.
INTERRUPTED=0 CUR_PID=""
trap 'INTERRUPTED=1; [[ -n $CUR_PID ]] && kill -TERM "$CUR_PID" 2> /dev/null' TERM INT HUP

NOT_RUN_RC=86   # a step's way of saying "not run" (reason: its log's last line, "not run: <reason>")

record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$KEEP/steps.tsv"; }

# step NAME LIMIT_S CMD...: runs CMD under LIMIT_S when that still fits the budget, logs it, records it.
step() {
  local name=$1 limit=$2
  shift 2
  local log="$KEEP/logs/$name.log"
  local used=$(($(date +%s) - START))
  local why=""
  if ((INTERRUPTED)); then
    why="interrupted: a signal stopped the run"
  elif [[ $SELECTED != *" $name "* ]]; then
    why="not selected: GPU_CHECK_STEPS=${GPU_CHECK_STEPS:-}"
  elif ((used + limit + KILL_S > BUDGET - END_S)); then
    why="budget: $((BUDGET - END_S - used))s left of ${BUDGET}s, the step needs $((limit + KILL_S))s"
  fi
  if [[ -n $why ]]; then
    record "$name" "not run" - 0 "$limit" "$why"
    echo "== $name: not run ($why)"
    return 0
  fi
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s) rc
  # Through `bash -c` so that the step may be one of the (exported) functions below; in the background so
  # that a signal's trap runs at once instead of after the step.
  STEP_LIMIT=$limit timeout --kill-after=$KILL_S "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1 < /dev/null &
  CUR_PID=$!
  wait "$CUR_PID"
  rc=$?
  if ((INTERRUPTED)); then  # the trap woke `wait` and stopped the step: reap it for its real status
    local rc2
    wait "$CUR_PID" 2> /dev/null
    rc2=$?
    ((rc2 == 127)) || rc=$rc2
  fi
  CUR_PID=""
  local dt=$(($(date +%s) - t0))
  local status=pass reason=""
  if ((INTERRUPTED)); then status=interrupted reason="interrupted: a signal stopped the run"
  elif ((rc == 124 || rc == 137)); then status=timeout reason="timeout: killed at its ${limit}s limit"
  elif ((rc == NOT_RUN_RC)) && tail -n 1 "$log" | grep -q '^not run: '; then
    status="not run" reason=$(tail -n 1 "$log" | sed 's/^not run: //')
  elif ((rc != 0)); then status=fail
  fi
  record "$name" "$status" "$rc" "$dt" "$limit" "$reason"
  echo "   $status (rc $rc, ${dt}s)${reason:+: $reason}"
  if [[ $status != pass && $status != "not run" ]]; then tail -n 15 "$log" | sed 's/^/   | /'; fi
  return 0
}

env_report() {
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  if command -v nvidia-smi > /dev/null; then
    timeout 15 nvidia-smi || true
    timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
  else
    echo "nvidia-smi: not present"
    ((DRY)) || return 1
  fi
  command -v nvcc > /dev/null && nvcc --version | tail -n 2
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "cupy", "pybind11", "numpy", "setuptools"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "not importable:", type(e).__name__, e)
try:
    import torch
    print("torch cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
except Exception as e:
    print("torch cuda/nccl: ", type(e).__name__, e)
EOF
}

# The dry run builds into a scratch folder and imports that build from a staged copy of the package, so
# the checkout's own build (the one its tests use) is left alone. Its objects stay in build/gpu_check/
# (ignored), so a second dry run compiles nothing.
STAGE="$SCRATCH/dry-stage"
if ((DRY)); then BUILD_TEMP="$ROOT/build/gpu_check/temp-dry" CUDA_MODE=${NCCLAVG_CUDA:-auto}
else BUILD_TEMP="$ROOT/build/gpu_check/temp" CUDA_MODE=1; fi

do_build() {
  if ((DRY)); then
    rm -rf "$STAGE" && mkdir -p "$STAGE/ncclavg" || return 1
    NCCLAVG_CUDA=$CUDA_MODE NCCLAVG_CUDA_ARCHS=$ARCHS "$PY" setup.py build_ext \
      --build-temp "$BUILD_TEMP" --build-lib "$SCRATCH/dry-lib" || return 1
    # the package's sources, subpackages included (comm/, train/, bench/), then the fresh build
    tar -C ncclavg --exclude=__pycache__ --exclude='*.so' -cf - . | tar -C "$STAGE/ncclavg" -xf - &&
      cp "$SCRATCH"/dry-lib/ncclavg/_C*.so "$STAGE/ncclavg/"
  else
    NCCLAVG_CUDA=1 NCCLAVG_CUDA_ARCHS=$ARCHS "$PY" setup.py build_ext --inplace --build-temp "$BUILD_TEMP"
  fi
}
do_info() {
  local rc=0
  env_report || rc=1
  echo
  if ((DRY)); then
    [[ -d $STAGE/ncclavg ]] || { echo "no staged build ($STAGE): the build step did not run"; return 1; }
    (cd "$STAGE" && PYTHONPATH="$STAGE" "$PY" - <<'EOF'
import ncclavg, ncclavg._ext as ext
import ncclavg.bench.cli, ncclavg.comm, ncclavg.train.trainer  # every layer of the staged copy loads
info = ncclavg.build_info()
print("imported", ncclavg.__file__)
print("cuda_built", info["cuda"], "archs", info["cuda_archs"], "NcclComm", hasattr(ext._C, "NcclComm"))
print("devices", info["device_count"], info["driver_error"])
EOF
    ) && (cd "$STAGE" && PYTHONPATH="$STAGE" "$PY" -m ncclavg info) || rc=1
  else
    "$PY" -m ncclavg info || rc=1
  fi
  echo
  nccl_init_log || rc=1
  return $rc
}
# One NCCL init (a one-rank NcclComm on GPU 0) with NCCL's own INIT and ENV lines: which memory mode
# (cuMem, cuMem host allocations), runtime connect and direct mode this NCCL takes on this machine, which
# decide how an abort ends (Note [Connections inside the bounded init] in csrc/cuda/comm_init.cpp);
# gpu_check_summary.py picks those lines out into gpu_check.json.
nccl_init_log() {
  if ((DRY)); then
    echo "nccl_init: not run in a dry run (would run: NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV, one NcclComm on cuda:0)"
    return 0
  fi
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV timeout --kill-after=2 20 "$PY" - <<'EOF'
import ncclavg.comm  # noqa: F401  (the NCCL_RUNTIME_CONNECT default: Note [Setting NCCL_RUNTIME_CONNECT once])
from ncclavg import _ext
NcclComm = _ext.nccl_comm_class()
c = NcclComm.init_all([0], 15.0)
print("nccl_init: done; collective_mode", c.collective_mode, "|", c.collective_mode_reason, flush=True)
c.destroy()
EOF
}
do_tests() {
  # One pytest process per test file (bench/gpu_check/gpu_check_files.py): a hung or crashed test costs
  # that test (Note [A hung test costs that test]), a test module that cannot be imported costs that
  # module, one that needs a missing optional package is a skip (bench/gpu_check/gpu_check_pytest.py). The
  # outcomes land in junit/<file>.xml; -rA puts them in the log too, so a step killed at its limit still
  # says which passed.
  "$PY" bench/gpu_check/gpu_check_files.py tests --out "$KEEP/junit" --test-timeout "$TEST_TIMEOUT_S"
}
do_forced() {
  # The stream-ordering and Work-lifetime tests with a forced reduction: see
  # bench/gpu_check/gpu_check_files.py.
  "$PY" bench/gpu_check/gpu_check_files.py forced --out "$KEEP/junit" --test-timeout "$TEST_TIMEOUT_S"
}
do_bench() {
  if ((DRY)); then "$PY" bench/gpu_bench.py --dry-run --out "$OUT_DIR/gpu_bench.json"
  else "$PY" bench/gpu_bench.py --out "$OUT_DIR/gpu_bench.json"; fi
}
do_trainer() {
  if ((DRY)); then "$PY" bench/trainer.py --quick --json "$OUT_DIR/trainer_cpu.json"
  else "$PY" bench/trainer.py --budget-s 30 --json "$OUT_DIR/trainer_gpu.json"; fi   # within its 45 s
}
sanitizer_path() { command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"; }
do_sanitizer() {
  local cs rc
  cs=$(sanitizer_path)
  if ((DRY)); then
    # No device to check here: run the driver on CPU tensors (its own checks), and test the detector that
    # tells "refused here" from a finding.
    # (the staged build when the build step made one, as the info step imports it)
    if [[ -d $STAGE/ncclavg ]]; then
      (cd "$STAGE" && PYTHONPATH="$STAGE" "$PY" "$ROOT/bench/gpu_check/sanitizer_driver.py" --device cpu)
    else
      "$PY" bench/gpu_check/sanitizer_driver.py --device cpu
    fi || { echo "the sanitizer driver failed on the CPU"; return 1; }
    printf '========= COMPUTE-SANITIZER\n========= Error: Device not supported\n' > "$SCRATCH/refused.txt"
    printf '========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 1 error\n' > "$SCRATCH/found.txt"
    "$PY" bench/gpu_check/gpu_check_summary.py refused "$SCRATCH/refused.txt" || { echo "detector missed a refusal"; return 1; }
    if "$PY" bench/gpu_check/gpu_check_summary.py refused "$SCRATCH/found.txt"; then echo "detector took a finding for a refusal"; return 1; fi
    if [[ -x $cs ]]; then "$cs" --version | tail -n 1; fi
    echo "would run: $cs --tool memcheck --report-api-errors no --error-exitcode 3 $PY bench/gpu_check/sanitizer_driver.py"
    return 0
  fi
  [[ -x $cs ]] || { echo "not run: not installed here: no compute-sanitizer on PATH or at $cs"; return "$NOT_RUN_RC"; }
  # A small driver (a few tensors through every kernel), not the test suite: memcheck slows torch down too.
  # API errors the code expects and handles (probing, capability checks) are not memory errors. Its own
  # limit, inside the step's, so that a refusal that ends in a hang is still recognised below, and so that
  # a run that did not finish is "not run" (it checked only part of the kernels), not a failure.
  local inner=$((STEP_LIMIT - 6))
  timeout --kill-after=2 "$inner" \
    "$cs" --tool memcheck --report-api-errors no --error-exitcode 3 "$PY" bench/gpu_check/sanitizer_driver.py 2>&1 \
    | tee "$SCRATCH/sanitizer.out"
  rc=${PIPESTATUS[0]}
  # Some runtimes refuse the sanitizer ("Device not supported"); then it checked nothing, pass or fail.
  if "$PY" bench/gpu_check/gpu_check_summary.py refused "$SCRATCH/sanitizer.out" > "$SCRATCH/refused.txt"; then
    echo "not run: $(cat "$SCRATCH/refused.txt")"
    return "$NOT_RUN_RC"
  fi
  if ((rc == 124 || rc == 137)); then
    if grep -qE "ERROR SUMMARY: [1-9]|^========= (Invalid|Program hit|Uninitialized|Race)" "$SCRATCH/sanitizer.out"; then
      echo "memcheck stopped at its ${inner}s limit, after reporting the errors above"
      return 3
    fi
    echo "not run: timeout: memcheck did not finish the driver in ${inner}s (no error found before that)"
    return "$NOT_RUN_RC"
  fi
  return "$rc"
}
export DRY PY STAGE OUT_DIR ROOT ARCHS SCRATCH KEEP BUILD_TEMP CUDA_MODE NOT_RUN_RC TEST_TIMEOUT_S
export -f env_report do_build do_info nccl_init_log do_tests do_forced do_bench do_trainer sanitizer_path do_sanitizer

MODE=""; ((DRY)) && MODE=" --dry-run"
echo "gpu_check.sh --part $PART$MODE: $ROOT -> $OUT_DIR (budget ${BUDGET}s)"
plan
((DRY)) || timeout 10 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv \
  || echo "nvidia-smi: not available"
for i in "${!STEPS[@]}"; do
  step "${STEPS[i]}" "${LIMITS[i]}" "do_${STEPS[i]}"
done

# The summary (gpu_check.json, the table, the RESULT line), the archive of the logs and the check of $OUT.
"$PY" bench/gpu_check/gpu_check_summary.py finish --out "$OUT_DIR" --keep "$KEEP" --part "$PART" $MODE \
  --seconds $(($(date +%s) - START)) --budget "$BUDGET"
rc=$?
case $rc in
  0) exit 0 ;;
  10) exit 1 ;;
  *)  # the helper broke: keep the logs anyway
    tar -C "$KEEP" -czf "$OUT_DIR/logs.tar.gz" . 2> /dev/null
    echo "  RESULT: FAILED: the summary helper (bench/gpu_check/gpu_check_summary.py) exited $rc; logs in $OUT_DIR/logs.tar.gz"
    exit 1 ;;
esac
