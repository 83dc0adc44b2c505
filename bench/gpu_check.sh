#!/usr/bin/env bash
# bench/gpu_check.sh: everything ncclavg needs checked on a GPU machine, in one command of <= 8 minutes.
#
#   bench/gpu_check.sh            build for sm_90 (NCCLAVG_CUDA=1), `ncclavg info`, `pytest -m gpu`,
#                                 the GPU benchmarks (bench/gpu_bench.py, the `ncclavg bench --backend nccl`
#                                 sweep, bench/trainer.py), compute-sanitizer memcheck over
#                                 the kernel tests, and a wheel built with --no-build-isolation
#   bench/gpu_check.sh --dry-run  walks every step without a GPU: the CUDA build (when a toolkit is
#                                 present) into a scratch folder, import + info of that build, the GPU
#                                 tests collected and run (they skip), gpu_bench.py --dry-run
#
# Assumes the machine's python3 ($PYTHON) already has torch, cupy, pybind11 and an NCCL, and that
# nothing can be downloaded: no isolated builds, no installs. Results go under $OUT (or ./gpu-out):
# logs/<step>.log, gpu_bench.json, pytest-gpu.xml, gpu_check.json; the last lines printed are a table.
# Every step has its own time limit, all of them share one budget (GPU_CHECK_BUDGET_S, 470 s), and a
# failing step is recorded without stopping the later ones. Exit status: 0 when every step passed.
set -u

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run)" >&2; exit 2 ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-$ROOT/gpu-out}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
ARCHS=${NCCLAVG_CUDA_ARCHS:-90}
mkdir -p "$OUT_DIR/logs" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STEPS="$OUT_DIR/steps.tsv"
: > "$STEPS"
START=$(date +%s)
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_S CMD...: runs CMD with min(LIMIT_S, what is left of the budget), logs it, records it.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START) - 15))
  local log="$OUT_DIR/logs/$name.log"
  if ((left < 20)); then
    printf '%s\tskipped\t-\t0\tbudget of %ss spent\n' "$name" "$BUDGET" >> "$STEPS"
    echo "== $name: skipped (budget spent)"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  # through `bash -c` so that the step may be one of the (exported) functions below
  timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  local status=pass
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status=fail; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$dt" "logs/$name.log" >> "$STEPS"
  echo "   $status (rc $rc, ${dt}s) -> $log"
  if [[ $status != pass ]]; then tail -n 15 "$log" | sed 's/^/   | /'; fi
  return 0
}

env_report() {
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
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
# the checkout's own build (the one its tests use) is left alone.
STAGE="$OUT_DIR/dry-stage"
dry_build() {
  rm -rf "$STAGE" && mkdir -p "$STAGE/ncclavg" || return 1
  NCCLAVG_CUDA=${NCCLAVG_CUDA:-auto} NCCLAVG_CUDA_ARCHS=$ARCHS "$PY" setup.py build_ext \
    --build-temp "$ROOT/build/gpu_check/temp-dry" --build-lib "$OUT_DIR/dry-lib" || return 1
  # the package's sources, subpackages included (comm/, train/, bench/), then the fresh build
  tar -C ncclavg --exclude=__pycache__ --exclude='*.so' -cf - . | tar -C "$STAGE/ncclavg" -xf - &&
    cp "$OUT_DIR"/dry-lib/ncclavg/_C*.so "$STAGE/ncclavg/"
}
dry_import() {
  (cd "$STAGE" && PYTHONPATH="$STAGE" "$PY" - <<'EOF'
import ncclavg, ncclavg._ext as ext
import ncclavg.bench.cli, ncclavg.comm, ncclavg.train.trainer  # every layer of the staged copy loads
info = ncclavg.build_info()
print("imported", ncclavg.__file__)
print("cuda_built", info["cuda"], "archs", info["cuda_archs"], "NcclComm", hasattr(ext._C, "NcclComm"))
print("devices", info["device_count"], info["driver_error"])
print("nccl", info["nccl"]["version"] or "not found")
EOF
  ) && (cd "$STAGE" && PYTHONPATH="$STAGE" "$PY" -m ncclavg info)
}
sanitizer_cmd() {
  local cs
  cs=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  echo "$cs"
}
run_sanitizer() {
  local cs
  cs=$(sanitizer_cmd)
  [[ -x $cs ]] || { echo "compute-sanitizer not found (looked on PATH and $cs)"; return 1; }
  "$cs" --tool memcheck --error-exitcode 3 "$PY" -m pytest -q -p no:cacheprovider \
    "tests/test_gpu_average.py::test_average_exact_inputs_bit_for_bit[float32]" \
    "tests/test_gpu_pack.py::test_many_tensors_exact_round_trip[float32]"
}
dry_sanitizer() {
  local cs
  cs=$(sanitizer_cmd)
  if [[ -x $cs ]]; then echo "would run: $cs --tool memcheck over the kernel tests"; else echo "compute-sanitizer not present here ($cs); on the GPU machine it runs memcheck over the kernel tests"; fi
}
dry_wheel() {
  "$PY" -m pip --version && "$PY" -c "import setuptools, pybind11; print('setuptools', setuptools.__version__, 'pybind11', pybind11.__version__)"
  echo "would run: $PY -m pip wheel --no-build-isolation --no-deps -w \$OUT/wheel ."
}

export DRY PY STAGE OUT_DIR ROOT ARCHS
export -f env_report dry_build dry_import sanitizer_cmd run_sanitizer dry_sanitizer dry_wheel

if ((DRY)); then
  echo "gpu_check.sh --dry-run: $ROOT -> $OUT_DIR"
  step env 60 env_report
  step build 400 dry_build
  step import 60 dry_import
  step tests_list 120 "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests
  step tests 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors tests
  step sanitizer 30 dry_sanitizer
  step bench 120 "$PY" bench/gpu_bench.py --dry-run --out "$OUT_DIR/gpu_bench.json"
  # The sweep and trainer steps on the CPU path, small: checks their arguments and outputs.
  step sweep 90 "$PY" -m ncclavg bench --backend local --towers 2 -b 8 -e 64K --quiet \
    --json "$OUT_DIR/bench-local.json"
  step trainer 90 "$PY" bench/trainer.py --quick --json "$OUT_DIR/trainer_cpu.json"
  step wheel 60 dry_wheel
else
  echo "gpu_check.sh: $ROOT -> $OUT_DIR (budget ${BUDGET}s)"
  timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv \
    || echo "nvidia-smi: not available"
  step env 30 env_report
  step build 240 env NCCLAVG_CUDA=1 NCCLAVG_CUDA_ARCHS="$ARCHS" "$PY" setup.py build_ext --inplace \
    --build-temp "$ROOT/build/gpu_check/temp"
  step info 60 "$PY" -m ncclavg info
  # A test module of another area that cannot be imported here must not stop the GPU tests.
  step tests 270 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT_DIR/pytest-gpu.xml" tests
  step bench 150 "$PY" bench/gpu_bench.py --out "$OUT_DIR/gpu_bench.json"
  step sweep 90 "$PY" -m ncclavg bench --backend nccl --towers 1 --compare -b 8 -e 256M \
    --json "$OUT_DIR/bench-nccl.json" --plot "$OUT_DIR/bench-nccl.png"
  step trainer 90 "$PY" bench/trainer.py --json "$OUT_DIR/trainer_gpu.json"
  step sanitizer 90 run_sanitizer
  step wheel 120 env NCCLAVG_CUDA=1 NCCLAVG_CUDA_ARCHS="$ARCHS" "$PY" -m pip wheel --no-build-isolation \
    --no-deps --no-index -w "$OUT_DIR/wheel" .
fi

# The summary: gpu_check.json and the short table, printed last.
"$PY" - "$OUT_DIR" "$DRY" "$(($(date +%s) - START))" <<'EOF'
import json, re, sys
from pathlib import Path
out, dry, total = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, rc, secs, log = line.split("\t")
    steps.append({"step": name, "status": status, "rc": rc, "seconds": int(secs), "log": log})
doc = {"dry_run": dry, "seconds": total, "steps": steps}
junit = out / "pytest-gpu.xml"
if junit.exists():
    head = junit.read_text()[:2000]
    m = re.search(r'<testsuite[^>]*', head)
    if m:
        doc["tests"] = {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', m.group(0))}
info_log = out / "logs" / ("import.log" if dry else "info.log")
if info_log.exists():
    for line in info_log.read_text().splitlines():
        if line.startswith("NCCL") or line.startswith("nccl "):
            text = line.split(None, 1)[1].strip() if " " in line else line
            doc["nccl"] = text if len(text) < 120 else text[:117] + "..."
bench = out / "gpu_bench.json"
if bench.exists():
    try:
        b = json.loads(bench.read_text())
        doc["bench"] = {name: sec.get("status") for name, sec in b.get("sections", {}).items()}
        doc["device"] = b.get("header", {}).get("device") or ", ".join(b.get("header", {}).get("devices", []))
    except ValueError as e:
        doc["bench"] = f"unreadable: {e}"
(out / "gpu_check.json").write_text(json.dumps(doc, indent=2))
ok = all(s["status"] in ("pass", "skipped") for s in steps)
print()
print(f"gpu_check {'DRY RUN ' if dry else ''}summary ({total}s; {out / 'gpu_check.json'})")
if doc.get("device"):
    print(f"  device: {doc['device']}")
if doc.get("nccl"):
    print(f"  NCCL:   {doc['nccl']}")
if doc.get("tests"):
    t = doc["tests"]
    print(f"  tests:  {t.get('tests', 0)} run, {t.get('failures', 0)} failed, {t.get('errors', 0)} errors, "
          f"{t.get('skipped', 0)} skipped")
print(f"  {'step':<11}{'status':<9}{'seconds':>8}  log")
for s in steps:
    print(f"  {s['step']:<11}{s['status']:<9}{s['seconds']:>8}  {s['log']}")
print("  RESULT: " + ("all steps passed" if ok else "FAILED steps: " +
                      ", ".join(s["step"] for s in steps if s["status"] not in ("pass", "skipped"))))
sys.exit(0 if ok else 1)
EOF
