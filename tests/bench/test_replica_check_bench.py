"""bench/replica_check.py runs end to end on a small size and writes what it says it measures (its
numbers are the benchmark's business, not a test's)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_replica_check_bench_writes_every_contender_and_the_training_share(tmp_path):
    stem = tmp_path / "rc"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "replica_check.py"), "--sizes", "4096",
                           "--rounds", "2", "--steps", "3", "--out", str(stem)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads((tmp_path / "rc.json").read_text())
    assert [r["contender"] for r in got["digest"]] == ["ncclavg digest", "torch.hash_tensor", "hashlib.blake2b",
                                                      "read (torch.sum)"]
    assert all(r["bytes"] == 4096 and r["GB_s"] > 0 for r in got["digest"])
    train = got["train"]
    assert train["steps"] == 3 and train["interval"] == 100 and train["digested_bytes"] > 0
    assert train["share_at_default_interval"] == pytest.approx(train["check_ms"] / (100 * train["step_ms"]))
    assert "of the step time every 100 steps" in proc.stdout
