"""Benchmark results on disk (ncclavg.bench.report.dump_json, used by `ncclavg bench` and the scripts in
bench/): written whole or not at all, so a run stopped or failing halfway never leaves a truncated
result file where an older whole one was."""
import json
import os

import pytest

from ncclavg.bench import report


def test_written_whole_with_its_folder(tmp_path):
    path = tmp_path / "deep" / "r.json"
    report.dump_json(str(path), {"a": [1, 2]}, indent=2)
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
    assert sorted(os.listdir(path.parent)) == ["r.json"]


def test_a_payload_that_cannot_be_encoded_leaves_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    report.dump_json(str(path), {"old": 1})
    with pytest.raises(TypeError):
        report.dump_json(str(path), {"new": object()})
    assert json.loads(path.read_text()) == {"old": 1} and os.listdir(tmp_path) == ["r.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    report.dump_json(str(path), {"old": 1})

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        report.dump_json(str(path), {"new": 2})
    assert json.loads(path.read_text()) == {"old": 1} and os.listdir(tmp_path) == ["r.json"]
