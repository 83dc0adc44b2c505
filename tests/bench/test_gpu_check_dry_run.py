"""bench/gpu_check.sh --dry-run walks every step of the GPU check without a GPU, in the GPU run's two
calls (--part core, then --part extra) and their order: the CUDA build (when a toolkit is here) into a
scratch folder, import + info of that build, the GPU tests collected and run one process per file (they
skip) and the forced-reduction reruns, gpu_bench.py --dry-run (JSON marked dry_run), the trainer on CPU
towers, the sanitizer driver on CPU tensors and the refusal detector. $OUT is left as a GPU machine sends
it back: the summary, the benchmarks' files and one archive of the logs. The fast tests of the same
machinery are test_gpu_check_script.py, test_gpu_check_files.py and test_gpu_check_summary.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _paths import ROOT, load_script

PARTS = {"core": ["build", "info", "tests", "forced", "bench"],
         "extra": ["build", "info", "trainer", "sanitizer"]}


def toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc")) or bool(home and (Path(home) / "bin" / "nvcc").exists())


def dry_run(tmp_path, part):
    """One call, as the lease makes it: its own empty $OUT. Returns (stdout, out, gpu_check.json, logs)."""
    out, tmp = tmp_path / part, tmp_path / f"tmp-{part}"
    tmp.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, TMPDIR=str(tmp))
    env.pop("GPU_CHECK_STEPS", None)
    env.pop("GPU_CHECK_BUDGET_S", None)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--part", part],
                       capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["ok"] is True and doc["part"] == part
    assert [s["step"] for s in doc["steps"]] == PARTS[part]
    assert all(s["status"] == "pass" for s in doc["steps"]), doc["steps"]
    assert sum(s["limit_s"] for s in doc["steps"]) + 25 <= doc["budget_s"]
    assert all(p.is_file() for p in out.iterdir()) and doc["out_problems"] == []
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("gpu_check.")]   # scratch gone
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
        logs = {n: tar.extractfile(f"logs/{n}.log").read().decode() for n in PARTS[part]}
    return r.stdout, out, doc, names, logs


@pytest.mark.slow
def test_gpu_check_dry_run_walks_both_calls(tmp_path):
    # the core call: without a GPU every GPU test skips, and the RESULT line says how many and why
    stdout, out, doc, names, log = dry_run(tmp_path, "core")
    skipped = doc["tests"]["counts"]["skipped"]
    want_result = f"all steps passed; {skipped} GPU tests skipped ("
    assert skipped > 0 and stdout.rstrip().splitlines()[-1].startswith("  RESULT: " + want_result)
    assert doc["result"].startswith(want_result)
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "logs.tar.gz", "gpu_bench.json"}
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert bench["header"]["dry_run"] is True
    assert set(bench["sections"]) == {"copy", "average", "pack", "allreduce", "pinned"}
    ids = [c["id"] for c in doc["tests"]["cases"]]   # per-test outcomes, from the junit XML of each process
    assert any(i.startswith("tests/comm/test_gpu_nccl.py::") for i in ids)
    assert any(i.startswith("tests/test_gpu_average.py::") for i in ids)
    for reduction in ("sum_divide:2", "premulsum:2"):   # the forced reruns, labelled
        assert f"tests/comm/test_gpu_nccl.py::test_ordering_after_the_callers_stream_and_before_the_readers " \
               f"[NCCLAVG_TEST_REDUCTION={reduction}]" in ids
    assert doc["tests"]["counts"]["total"] == len(ids) and doc["tests"]["counts"]["failed"] == 0
    files = load_script(ROOT / "bench" / "gpu_check" / "gpu_check_files.py", "gpu_check_files")
    groups = [g["name"] for g in files.groups("tests") + files.groups("forced")]
    assert names == ({f"logs/{s}.log" for s in PARTS["core"]} | {"steps.tsv"} | {f"junit/{g}.xml" for g in groups}
                     | {f"junit/{g}.jsonl" for g in groups})
    assert "nccl_init: not run in a dry run" in log["info"]
    if toolkit_present():
        assert "cuda_built True" in log["info"] and "NcclComm True" in log["info"], log["info"]

    # the extra call: no tests, so no count of skipped ones
    stdout, out, doc, names, log = dry_run(tmp_path, "extra")
    assert stdout.rstrip().splitlines()[-1] == "  RESULT: all steps passed" and "tests" not in doc
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "logs.tar.gz", "trainer_cpu.json"}
    assert json.loads((out / "trainer_cpu.json").read_text())
    assert names == {f"logs/{s}.log" for s in PARTS["extra"]} | {"steps.tsv"}
    assert "not supported here" in log["sanitizer"] and ", 0 wrong" in log["sanitizer"]


def test_gpu_check_rejects_unknown_arguments():
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--bogus" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--iters", "0"], "--iters"),
    (["--sizes", "8,abc"], "abc"),
    (["--only", "copy,nope"], "--only"),
    (["--towers", "0"], "--towers"),
    (["--init-timeout", "0"], "--init-timeout"),
])
def test_gpu_bench_rejects_bad_arguments(args, message, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", "--out",
                        str(tmp_path / "x.json"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.json").exists()
