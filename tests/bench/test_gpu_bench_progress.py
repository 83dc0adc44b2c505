"""bench/gpu_bench.py keeps what it measured when a run stops part way: the JSON is rewritten after each
section and names the section it was in. The sections themselves need a GPU; here they are replaced by
stand-ins that look at the file on disk while they "run", and the last one is interrupted the way a
step's time limit interrupts it (an exception that is not an Exception, which no section handler
catches)."""
from __future__ import annotations

import json

import pytest

from _paths import ROOT, load_script

torch = pytest.importorskip("torch")


@pytest.fixture
def bench():
    return load_script(ROOT / "bench" / "gpu_bench.py", "gpu_bench")


def test_each_section_is_on_disk_before_the_next_and_a_cut_run_names_where_it_stopped(bench, tmp_path,
                                                                                       monkeypatch):
    out = tmp_path / "gpu_bench.json"
    seen = []   # (section, the statuses on disk while it ran)

    def on_disk():
        return {k: v["status"] for k, v in json.loads(out.read_text())["sections"].items()}

    def stand_in(name, result=None):
        def run(torch_, a, res, *rest):
            seen.append((name, on_disk()))
            res["rows"].append({"what": name, "gbps": 1.0, "time_us": 1.0})
            return result
        return run

    def cut_short(torch_, a, res):
        seen.append(("allreduce", on_disk()))
        raise KeyboardInterrupt   # what the step's SIGINT at its limit raises

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "stand-in")
    monkeypatch.setattr(bench, "bench_copy", stand_in("copy", 100.0))
    monkeypatch.setattr(bench, "bench_average", stand_in("average"))
    monkeypatch.setattr(bench, "bench_pack", stand_in("pack"))
    monkeypatch.setattr(bench, "bench_pinned", stand_in("pinned"))
    monkeypatch.setattr(bench, "bench_allreduce", cut_short)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--out", str(out)])
    assert [name for name, _ in seen] == list(bench.SECTIONS)
    # while a section runs, the ones before it are on disk as done and it is marked running
    for i, (name, statuses) in enumerate(seen):
        assert statuses == {**{n: "ok" for n in bench.SECTIONS[:i]}, name: "running"}, (name, statuses)
    doc = json.loads(out.read_text())
    assert {k: v["status"] for k, v in doc["sections"].items()} == {
        "copy": "ok", "average": "ok", "pack": "ok", "pinned": "ok", "allreduce": "running"}
    assert doc["sections"]["pinned"]["rows"] == [{"what": "pinned", "gbps": 1.0, "time_us": 1.0}]
    assert not list(tmp_path.glob("*.tmp"))   # written by rename: no half file left behind


def test_a_section_that_skips_itself_stays_skipped(bench, tmp_path, monkeypatch):
    def skips(torch_, a, res, copy_bw):
        res["status"], res["reason"] = "skipped", "not in this checkout"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "stand-in")
    monkeypatch.setattr(bench, "bench_copy", lambda *args: 100.0)
    monkeypatch.setattr(bench, "bench_pack", skips)
    out = tmp_path / "b.json"
    assert bench.main(["--out", str(out), "--only", "pack"]) == 0
    assert json.loads(out.read_text())["sections"]["pack"]["status"] == "skipped"
