"""bench/cpu_suite.py: the --json contract (times or ratios), failing and missing scripts, the markdown
table, and one quick end-to-end run on the local sweep. No timing assertions."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def suite():
    return load_script(ROOT / "bench" / "cpu_suite.py", "cpu_suite")


def test_summary_from_times_and_from_ratios(suite):
    result = {"header": {}, "rows": [
        {"case": "64 MiB fp32", "time_us": 100.0, "torch_time_us": 250.0, "copy_time_us": 80.0},
        {"name": "adamw 10M", "speedup_vs_torch": 3.0, "fraction_of_copy_bw": 0.5, "gbps": 5.0},
        {"case": "no ratio here", "time_us": 1.0},
    ]}
    rows = suite.summary_rows(result, copy_gbps=10.0)
    assert [r["case"] for r in rows] == ["64 MiB fp32", "adamw 10M"]
    assert rows[0]["speedup_vs_torch"] == pytest.approx(2.5) and rows[0]["fraction_of_copy_bw"] == pytest.approx(0.8)
    assert rows[1]["speedup_vs_torch"] == 3.0 and rows[1]["fraction_of_suite_copy_bw"] == pytest.approx(0.5)
    assert suite.summary_rows({"no": "rows"}, 10.0) == []
    # rows that name a "contender" but are no size sweep are read like any other rows
    other = {"rows": [{"contender": "ncclavg", "case": "step", "time_us": 10.0, "torch_time_us": 30.0}]}
    assert [(r["case"], r["speedup_vs_torch"]) for r in suite.summary_rows(other, 10.0)] == [("step", pytest.approx(3.0))]


def test_summary_of_an_ncclavg_bench_file(suite):
    def row(c, size, t):
        return {"contender": c, "size_bytes": size, "time_us": t, "busbw_gbps": 1.0}
    big, small = 4 << 20, 1024
    result = {"rows": [row("ncclavg", small, 10), row("torch_stack_mean", small, 20), row("torch_add_loop", small, 15),
                       row("copy", small, 5), row("ncclavg", big, 100), row("torch_stack_mean", big, 400),
                       row("torch_add_loop", big, 300), row("copy", big, 90)]}
    rows = {r["case"].split(" (")[0]: r for r in suite.summary_rows(result, 10.0)}
    assert rows["sizes >= 1 MiB"]["speedup_vs_torch"] == pytest.approx(3.0)     # vs the BEST torch peer
    assert rows["sizes >= 1 MiB"]["fraction_of_copy_bw"] == pytest.approx(0.9)
    assert rows["sizes < 1 MiB"]["speedup_vs_torch"] == pytest.approx(1.5)


def test_run_script_ok_and_failed(suite, tmp_path):
    ok = tmp_path / "ok_bench.py"
    ok.write_text(textwrap.dedent("""
        import json, sys
        path = sys.argv[sys.argv.index("--json") + 1]
        json.dump({"header": {"machine": "m"}, "rows": [{"case": "x", "time_us": 2, "torch_time_us": 4}]}, open(path, "w"))
    """))
    bad = tmp_path / "bad_bench.py"
    bad.write_text("import sys\nprint('first', file=sys.stderr)\nsys.exit('it broke')\n")
    entry = suite.run_script("ok", [str(ok)], timeout=60)
    assert entry["status"] == "ok" and entry["result"]["rows"][0]["case"] == "x"
    entry = suite.run_script("bad", [str(bad)], timeout=60)
    assert entry["status"] == "failed" and "it broke" in entry["error"]


def test_markdown_lists_missing_failed_and_ok(suite):
    doc = {"date": "2025-01-01", "copy_gbps_start": 10.0, "copy_gbps_end": 9.0,
           "arguments": {"copy_mib": 256},
           "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 4, "simd_level": "avx2", "openmp_threads": 2},
           "versions": {"torch": "2", "ncclavg": "0.1", "python": "3"},
           "benchmarks": {
               "pack": {"status": "missing", "note": "bench/pack.py does not exist"},
               "optim": {"status": "failed", "error": "exit code 1: boom"},
               "average": {"status": "ok", "seconds": 1, "summary": [
                   {"case": "1M", "time_us": 3.0, "speedup_vs_torch": 2.0, "fraction_of_copy_bw": 0.75,
                    "fraction_of_suite_copy_bw": None}]}}}
    md = suite.to_markdown(doc)
    assert "| pack | missing: bench/pack.py does not exist |" in md
    assert "exit code 1: boom" in md
    assert "| average | 1M | 3.0 | 2.00x | 75% |  |" in md


def test_suite_end_to_end_quick(suite, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    rc = suite.main(["--only", "sweep-local", "--quick", "--copy-mib", "16", "--out", str(tmp_path)])
    assert rc == 0
    (js,) = tmp_path.glob("cpu-*.json")
    doc = json.loads(js.read_text())
    b = doc["benchmarks"]["sweep-local"]
    assert b["status"] == "ok" and b["result"]["summary"]["wrong_total"] == 0
    assert any(r["speedup_vs_torch"] for r in b["summary"])
    assert doc["copy_gbps_start"] > 0 and doc["arguments"]["out"] == "(a folder outside the checkout)"
    assert js.with_suffix(".md").read_text().startswith("# CPU benchmarks")


def test_results_without_rows_give_their_ratio_leaves(suite):
    result = {"machine": {}, "pack": {"seconds": {"x": 1.0},
                                      "ratios": {"pack_speedup_vs_torch_cat": 1.5, "pack_fraction_of_copy_bandwidth": 0.7}}}
    rows = {r["case"]: r for r in suite.summary_rows(result, 10.0)}
    assert rows["pack.ratios.pack_speedup_vs_torch_cat"]["speedup_vs_torch"] == 1.5
    assert rows["pack.ratios.pack_fraction_of_copy_bandwidth"]["fraction_of_copy_bw"] == 0.7
    assert len(rows) == 2


def test_script_command_follows_the_contract_or_falls_back_to_out(suite, tmp_path):
    follows = tmp_path / "a.py"
    follows.write_text('ap.add_argument("--json")\nap.add_argument("--quick")\n')
    legacy = tmp_path / "b.py"
    legacy.write_text('ap.add_argument("--out")\n')
    assert suite.script_command(follows, quick=True) == (["bench/a.py", "--quick"], "--json")
    assert suite.script_command(follows, quick=False) == (["bench/a.py"], "--json")
    assert suite.script_command(legacy, quick=True) == (["bench/b.py"], "--out")
