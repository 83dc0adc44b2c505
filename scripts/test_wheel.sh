#!/usr/bin/env bash
# Tests a built wheel the way a user gets it: a fresh venv, a PATH with no nvcc and no compiler, run
# from a directory outside the checkout, CUDA_HOME unset.
#
#   scripts/test_wheel.sh WHEEL [--python python3.11] [--no-torch]
#
# --no-torch: only what needs no torch (info, NCCL, the core on numpy arrays): torch==2.13.0 is a
# local CPU wheel for CPython 3.11 on this machine, and from PyPI a multi-GB CUDA build for the others.
# Checks: the install needs no build; `ncclavg info` (CUDA built with the archs and the CUDA major of a
# CUDA wheel; NCCL not found, then found after `pip install nvidia-nccl-cu13`, or -cu12 for an
# ncclavg-cu12 wheel: the NCCL wheel follows the wheel's name); `ncclavg train` (the default run, CPU);
# torch and the wheel's OpenMP in one process (see Note [One OpenMP runtime or two] in
# scripts/build_wheels.sh); the backend registered by `import torch` alone, and a 2-process torchrun DDP
# job that never imports ncclavg training on it; the CPU tests that need no checkout, from a copy of tests/ alone.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEEL=""
PY=python3
TORCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --no-torch) TORCH=0; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) WHEEL=$(realpath "$1"); shift ;;
  esac
done
[ -f "$WHEEL" ] || { echo "test_wheel.sh: give a wheel file" >&2; exit 2; }
PY=$(command -v "$PY")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
say() { printf '[test_wheel %4ss] %s\n' "$((SECONDS - t0))" "$*"; }
pipq() {  # pip -q, its log shown on failure (and without this machine's index-location warnings)
  pip -q "$@" > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; return 1; }
  grep -v '^WARNING: Location' "$WORK/pip.log" || true
}
name=$(basename "$WHEEL")
case "$name" in ncclavg_cu1[23]-*) want_cuda=True ;; *) want_cuda=False ;; esac
case "$name" in ncclavg_cu13-*) want_pypi=True ;; *) want_pypi=False ;; esac  # built with the PyPI toolkit
case "$name" in ncclavg_cu12-*) major=12 ;; *) major=13 ;; esac  # the CUDA major: runtime and NCCL wheel
nccl_wheel=nvidia-nccl-cu$major

# A PATH of everything in /usr/bin and /bin but compilers, linkers and nvcc.
mkdir -p "$WORK/bin"
for f in /usr/bin/* /bin/*; do
  b=$(basename "$f")
  case "$b" in
    gcc*|g++*|cc|c++|cpp*|c89*|c99*|*-gcc*|*-g++*|*-cpp*|clang*|nvcc*|ld|ld.*|*-ld|*-ld.*|as|*-as|tcc) continue ;;
  esac
  [ -e "$WORK/bin/$b" ] || ln -s "$f" "$WORK/bin/$b"
done
"$PY" -m venv "$WORK/venv"
export PATH="$WORK/venv/bin:$WORK/bin"
unset CUDA_HOME CUDA_PATH PYTHONPATH
for tool in gcc g++ cc c++ nvcc ld; do
  if command -v "$tool" >/dev/null; then echo "test_wheel.sh: $tool is on PATH" >&2; exit 1; fi
done
cd "$WORK"

say "pip install $name (no compiler on PATH)"
pipq install --upgrade pip
t1=$SECONDS
pipq install --only-binary=:all: "$WHEEL"
say "installed in $((SECONDS - t1)) s (with numpy)"
[ "$TORCH" = 0 ] || pipq install torch==2.13.0 pytest scikit-learn tqdm

say "ncclavg info"
ncclavg info
python - "$want_cuda" "$want_pypi" "$major" "$nccl_wheel" <<'PY'
import os, sys
import ncclavg
want_cuda, want_pypi = sys.argv[1] == "True", sys.argv[2] == "True"
major, nccl_wheel = sys.argv[3], sys.argv[4]
assert "site-packages" in ncclavg.__file__ and not os.path.exists(os.path.join(os.getcwd(), "setup.py")), ncclavg.__file__
i = ncclavg.build_info()
assert i["cuda"] is want_cuda, i
if want_cuda:
    assert i["cuda_archs"] == ["80", "90"], i["cuda_archs"]
    assert i["build"].get("pypi_toolkit") is want_pypi, i["build"]
    assert i["cuda_runtime"].split(".")[0] == major, (i["cuda_runtime"], major)
if i["nccl"]["loaded"]:  # a system NCCL: the "not found" hint cannot be checked here
    print(f"note: NCCL already found before its wheel: {i['nccl']['path']}")
else:
    assert f"pip install {nccl_wheel}" in i["nccl"]["error"], i["nccl"]
print(f"ok: cuda={i['cuda']} archs={i['cuda_archs']} runtime={i['cuda_runtime']} build: {i['build'].get('decision')}")
PY
say "pip install $nccl_wheel"
pipq install "$nccl_wheel"
python - <<'PY'
import ncclavg
n = ncclavg.build_info()["nccl"]
assert n["loaded"] and n["source"] == "wheel", n
print(f"ok: NCCL {n['version']} from {n['path']} ({n['source']})")
PY

if [ "$TORCH" = 0 ]; then
  say "the core on numpy arrays (no torch)"
  python -c 'import numpy as np, ncclavg; a = [np.full(1001, v, np.float32) for v in (1, 2, 6)]; ncclavg.ops.average_(a); assert all((x == 3).all() for x in a); print("ok: average_ of numpy arrays")'
  say "done: $name (without torch: train and tests not run)"
  exit 0
fi

say "the torch.backends entry point: import torch alone registers the backend; off with NCCLAVG_AUTOLOAD=0"
python -c 'import sys, torch.distributed as dist; assert "ncclavg" in dist.Backend.backend_list, dist.Backend.backend_list; assert "ncclavg" in sys.modules; print("ok: import torch registered ncclavg")'
NCCLAVG_AUTOLOAD=0 python -c 'import sys, torch.distributed as dist; assert "ncclavg" not in dist.Backend.backend_list and "ncclavg" not in sys.modules; print("ok: NCCLAVG_AUTOLOAD=0 turns it off")'

say "a torchrun job that never imports ncclavg trains stock DDP on the backend (2 processes)"
cat > "$WORK/ddp_no_import.py" <<'PY'
import torch, torch.distributed as dist
dist.init_process_group("ncclavg")   # registered by the entry point at `import torch`
assert dist.get_backend() == "ncclavg", dist.get_backend()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1 + dist.get_rank())   # each rank its own data
for _ in range(20):
    x = torch.randn(32, 8, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(every, flat)
assert all(torch.equal(every[0], e) for e in every), "replicas differ"
if dist.get_rank() == 0:
    print(f"ok: {dist.get_world_size()} ranks on {dist.get_backend()}, replicas identical, loss {loss.item():.4f}")
dist.destroy_process_group()
PY
(cd "$WORK" && torchrun --standalone --nproc-per-node 2 ddp_no_import.py)

say "ncclavg train (the default run)"
ncclavg train --metrics "$WORK/m.jsonl" | tee "$WORK/train.log" | tail -3
grep -q '^summary: test_accuracy=0\.9' "$WORK/train.log" || { echo "test_wheel.sh: ncclavg train did not learn" >&2; exit 1; }

say "torch and ncclavg's OpenMP in one process"
python - <<'PY'
import torch, ncclavg
x = [torch.randn(1 << 20) for _ in range(4)]
ref = torch.stack(x).mean(0)
ncclavg.ops.average_(x)
torch.testing.assert_close(x[0], ref)
torch.set_num_threads(2); (torch.randn(512, 512) @ torch.randn(512, 512)).sum()   # torch's OpenMP pool
gomps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
print("ok: average_ matches torch; OpenMP runtimes in the process:", ", ".join(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p in gomps))
PY

say "CPU tests from a copy of tests/ (no checkout)"
cp -r "$ROOT/tests" "$WORK/tests"
rm -rf "$WORK/tests/__pycache__"
# The tests that drive the installed core and need neither the checkout (setup.py, examples, bench)
# nor a GPU; -m "not slow and not gpu" as in the README's quick suite.
python -m pytest -q -p no:cacheprovider -m "not slow and not gpu" --rootdir "$WORK" -W ignore::pytest.PytestUnknownMarkWarning \
  tests/test_average.py tests/test_pack.py tests/test_optim.py tests/test_master.py tests/test_bad_input.py \
  tests/test_info.py tests/test_averager.py tests/comm/test_comm_local.py tests/train/test_trainer.py 2>&1 | tail -5
say "done: $name"
