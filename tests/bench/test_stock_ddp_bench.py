"""bench/stock_ddp.py: one --quick run end to end (every contender at 2 processes, ratios that follow from
the rows, the note), and its argument checks. No timing assertions."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _paths import ROOT


def _run(*args, timeout=400):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "bench/stock_ddp.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_run_has_every_contender(tmp_path):
    proc = _run("--quick", "--procs", "2", "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "s.json").read_text())
    rows = result["rows"]
    kinds = {r["contender"] for r in rows}
    assert kinds == {"ddp gloo", "ddp ncclavg", "ddp gloo+hook", "fsdp2 gloo", "fsdp2 ncclavg", "fsdp2 gloo+comms"}
    assert result["transports"] == {"2": "shm"}
    by = {r["contender"]: r for r in rows}
    for k, ref in (("ddp ncclavg", "ddp gloo"), ("fsdp2 ncclavg", "fsdp2 gloo")):
        assert by[k]["x_gloo"] == pytest.approx(by[k]["samples_per_s"] / by[ref]["samples_per_s"])
    note = (tmp_path / "s.md").read_text()
    assert "Load average" in note and "| mlp-tiny | 2 | ddp ncclavg |" in note


@pytest.mark.parametrize("args,needle", [(["--procs", "1"], "--procs"), (["--procs", "x"], "--procs"),
                                         (["--steps", "0"], "--steps"), (["--kinds", "ddp nope"], "--kinds"),
                                         (["--workloads", "nope"], "--workloads")])
def test_bad_arguments_exit_2_naming_the_flag(args, needle):
    proc = _run(*args, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
