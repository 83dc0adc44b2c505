"""bench/scale.py: one --quick run end to end (every shape, the DDP rows, ratios that follow from the rows,
shard_master rows or the note that this build has none), plus the pure helpers. No timing assertions."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _paths import ROOT, load_script

SHAPES = ("1x4", "2x2", "4x1")


@pytest.fixture(scope="module")
def scale():
    return load_script(ROOT / "bench" / "scale.py", "scale_bench")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("NCCLAVG_DEBUG", None)
    cmd = [sys.executable, "bench/scale.py", "--quick", "--json", str(out / "s.json"), "--md", str(out / "s.md")]
    # the bench bounds every wait itself (60 s per order); this bound only catches a launcher gone wrong
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "s.json").read_text()), (out / "s.md").read_text(), proc.stdout


@pytest.mark.slow
def test_quick_run_has_every_shape_and_the_ddp_rows(quick_run):
    result, md, stdout = quick_run
    h = result["header"]
    assert h["benchmark"] == "scale" and h["machine"]["cores"] >= 1 and h["machine"]["cpu"]
    assert h["memcpy_gbps_start"] > 0 and h["memcpy_gbps_end"] > 0 and "threads_rule" in h
    rows = result["rows"]
    (wl,) = {r["workload"] for r in rows}
    nc = {r["shape"]: r for r in rows if r["kind"] == "ncclavg" and not r["shard_master"] and " tcp" not in r["name"]}
    assert set(nc) == set(SHAPES)
    # one host: the shared-memory channel between processes, torch.distributed for the "tcp" rows and DDP
    transports = {r["name"]: r["transport"] for r in rows}
    assert transports["ncclavg 1x4"] == "none (one process)"
    assert transports["ncclavg 2x2"] == transports["ncclavg 4x1"] == "shm"
    assert transports["ncclavg 2x2 tcp"] == transports["ncclavg 4x1 tcp"] == "gloo"
    assert transports["ddp 4x1 (fused)"] == "gloo (DDP)"
    assert "Transport between processes" in md
    for shape, r in nc.items():
        p, t = (int(v) for v in shape.split("x"))
        assert (r["processes"], r["towers_per_process"]) == (p, t) and r["threads_per_process"] >= 1
    ddp = {r["name"]: r for r in rows if r["kind"] == "ddp"}
    assert set(ddp) == {"ddp 4x1 (fused)", "ddp 4x1 (foreach)"}
    assert all(r["shape"] == "4x1" and r["processes"] == 4 for r in ddp.values())
    batch = rows[0]["global_batch"]
    for r in rows:
        assert r["global_batch"] == batch and r["params"] == rows[0]["params"]   # the same work for all
        assert r["samples_per_s"] > 0 and r["step_s"] > 0 and r["steps_timed"] == len(r["steps_s"]) > 0
        assert r["samples_per_s"] == pytest.approx(batch / r["step_s"])
        assert r["phases_s"]["compute"] > 0 and r["phases_s"]["optimizer"] > 0
        assert r["time_us"] == pytest.approx(r["step_s"] * 1e6)
        assert r["best_round_step_s"] == min(r["block_median_s"]) > 0
    best = min(ddp.values(), key=lambda r: r["step_s"])
    for r in (r for r in rows if r["kind"] == "ncclavg"):
        for cid, d in ddp.items():
            assert r["ratio_vs_ddp"][cid] == pytest.approx(d["step_s"] / r["step_s"])
            assert r["ratio_vs_ddp"][cid] == pytest.approx(r["samples_per_s"] / d["samples_per_s"])
            assert r["paired_ratio_vs_ddp"][cid] > 0
        assert r["best_ddp"] == best["name"] and r["torch_time_us"] == pytest.approx(best["time_us"])
        assert r["speedup_vs_torch"] == pytest.approx(best["step_s"] / r["step_s"])   # the cpu_suite contract
        assert r["case"]
    for r in rows:
        assert f"| {wl} | {r['name']} |" in md and r["name"] in stdout


@pytest.mark.slow
def test_quick_run_follows_the_cpu_suite_contract(quick_run):
    suite = load_script(ROOT / "bench" / "cpu_suite.py", "cpu_suite")
    result = quick_run[0]
    summary = suite.summary_rows(result, copy_gbps=10.0)
    mine = [r for r in result["rows"] if r["kind"] == "ncclavg"]
    assert [s["case"] for s in summary] == [r["case"] for r in mine]   # DDP rows are the reference, not cases
    assert [s["speedup_vs_torch"] for s in summary] == pytest.approx([r["speedup_vs_torch"] for r in mine])


@pytest.mark.slow
def test_quick_run_reports_shard_master_or_its_absence(quick_run, scale):
    result, md, _ = quick_run
    shard_rows = [r for r in result["rows"] if r["shard_master"]]
    if scale.shard_available():
        assert {r["shape"] for r in shard_rows} == {"2x2", "4x1"} and not result["not_available"]
        assert all(r["samples_per_s"] > 0 and "ratio_vs_ddp" in r for r in shard_rows)
    else:
        assert not shard_rows   # no made-up numbers
        assert {m["name"] for m in result["not_available"]} == {"ncclavg 2x2+shard", "ncclavg 4x1+shard"}
        assert all(m["status"] == "not available in this build" for m in result["not_available"])
        assert "not available in this build" in result["header"]["shard_master"]
        assert "not available in this build" in md


def test_plan_and_threads(scale):
    ids = lambda groups: [[c["id"] for c in g["contenders"]] for g in groups]   # noqa: E731
    assert ids(scale.plan_groups(False)) == [["ncclavg 1x4"], ["ncclavg 2x2", "ncclavg 2x2 tcp"],
                                             ["ncclavg 4x1", "ncclavg 4x1 tcp", "ddp 4x1 (fused)", "ddp 4x1 (foreach)"]]
    assert ids(scale.plan_groups(True))[1:] == [["ncclavg 2x2", "ncclavg 2x2 tcp", "ncclavg 2x2+shard"],
                                                ["ncclavg 4x1", "ncclavg 4x1 tcp", "ncclavg 4x1+shard",
                                                 "ddp 4x1 (fused)", "ddp 4x1 (foreach)"]]
    # the "tcp" rows build their communicator with NCCLAVG_SHM=0, the others with the default
    assert {c["id"]: c["shm"] for g in scale.plan_groups(True) for c in g["contenders"] if c["kind"] == "ncclavg"} == {
        "ncclavg 1x4": "auto", "ncclavg 2x2": "auto", "ncclavg 2x2 tcp": "0", "ncclavg 2x2+shard": "auto",
        "ncclavg 4x1": "auto", "ncclavg 4x1 tcp": "0", "ncclavg 4x1+shard": "auto"}
    assert [g["processes"] for g in scale.plan_groups(True)] == [1, 2, 4]
    assert scale.threads_for(2, 4, 1) == 1 and scale.threads_for(2, 1, 4) == 1
    assert scale.threads_for(16, 2, 2) == 4 and scale.threads_for(16, 1, 4) == 4
    wls = [{"name": "a"}, {"name": "b"}]
    assert scale.not_available(wls, True) == []
    missing = scale.not_available(wls, False)
    assert [(m["workload"], m["name"]) for m in missing] == [
        ("a", "ncclavg 2x2+shard"), ("a", "ncclavg 4x1+shard"), ("b", "ncclavg 2x2+shard"), ("b", "ncclavg 4x1+shard")]
    assert {m["status"] for m in missing} == {"not available in this build"}
    assert "| a | ncclavg 2x2+shard | not available in this build |" in scale.table([], missing)


def test_ratios_follow_from_the_rows(scale):
    def row(cid, kind, step, blocks):
        return {"workload": "w", "name": cid, "kind": kind, "step_s": step, "time_us": step * 1e6,
                "block_median_s": blocks, "params": 1000, "global_batch": 64}
    rows = [row("ncclavg 2x2", "ncclavg", 0.010, [0.010, 0.020]), row("ddp 4x1 (fused)", "ddp", 0.020, [0.030, 0.020]),
            row("ddp 4x1 (foreach)", "ddp", 0.030, [0.030, 0.060])]
    scale.add_ratios(rows)
    r = rows[0]
    assert r["ratio_vs_ddp"] == pytest.approx({"ddp 4x1 (fused)": 2.0, "ddp 4x1 (foreach)": 3.0})
    assert r["paired_ratio_vs_ddp"] == pytest.approx({"ddp 4x1 (fused)": 2.0, "ddp 4x1 (foreach)": 3.0})
    assert r["best_ddp"] == "ddp 4x1 (fused)" and r["speedup_vs_torch"] == pytest.approx(2.0)
    assert "ratio_vs_ddp" not in rows[1]
