"""The `ncclavg` backend's flight recorder (ncclavg/transport/flight.py) and its reader (flight_reader.py,
`ncclavg trace`): a frozen peer's last collectives on both ranks and the reader's verdict on them; the
ring's bound; dumps written whole; the reader on hand-made dumps."""
import json
import os
import signal

import _transport_flight_workers as FW
import pytest
from _fault_util import read_reports, spawn_ranks

from ncclavg.transport import flight, flight_reader

TIMEOUT = 4.0


@pytest.mark.slow
def test_a_frozen_peer_is_named_by_the_dumps(tmp_path):
    codes = spawn_ranks(FW.frozen_peer_job, 2, (str(tmp_path), TIMEOUT), timeout_s=120)
    assert codes[1] == -signal.SIGSTOP, codes
    assert read_reports(tmp_path, 2)[0]["type"] == "BackendTimeoutError"
    dumps = flight_reader.load([str(tmp_path)])
    by_rank = {d["rank"]: d for d in dumps}
    assert sorted(by_rank) == [0, 1]
    # three all_reduces and a barrier in step: seq 1-4 done on both; rank 0's broadcast, seq 5, failed
    frozen, survivor = by_rank[1], by_rank[0]
    assert frozen["reason"] == "on demand" and frozen["last_seq"] == 4
    assert [e["state"] for e in frozen["entries"]] == ["done"] * 4
    last = survivor["entries"][-1]
    assert (last["seq"], last["op"], last["state"], last["root"], last["count"], last["dtype"]) == \
        (5, "broadcast", "failed", 0, 7, "float64"), last
    assert "rank 1 stopped responding" in last["error"] and survivor["failure"]
    lines = flight_reader.verdict(dumps)
    text = "\n".join(lines)
    assert "rank 1 last completed seq 4 (barrier" in text, text
    assert "rank 0 failed in seq 5 (broadcast" in text and "which rank 1 never issued" in text, text


def _rec(capacity, group="0", rank=0):
    return flight.Recorder(group, rank, 2, rank, "shm", capacity)


def test_fast_and_queued_calls_get_the_same_numbers_and_words(tmp_path):
    """One rank calls synchronously (the fast paths: no Job), the other asynchronously (the runner), and the
    other way round: both ranks' dumps list the same calls under the same numbers."""
    from _dist_util import run_ranks

    run_ranks(FW.mixed_paths_job, 2, args=(str(tmp_path),), timeout_s=120)
    dumps = {d["rank"]: d for d in flight_reader.load([str(tmp_path)])}
    calls = {r: [(e["seq"], e["call"], e["state"]) for e in d["entries"]] for r, d in dumps.items()}
    assert calls[0] == calls[1] and len(calls[0]) == 9, calls
    assert {c for _, c, _ in calls[0]} >= {"all_reduce(SUM) of 5 float32", "all_reduce(AVG) of 5 float32"}, calls


def test_the_public_apis_fast_calls_are_recorded_as_its_jobs_are(tmp_path, monkeypatch):
    """Note [Calls run now] in ncclavg/transport/runner.py: a call of the public API that runs without a job
    (the native all_reduce_avg, and broadcast_tensors, all_gather, reduce_scatter_avg through Runner.now) is
    in the flight record under the same words as when it queues behind a job."""
    from _dist_util import run_ranks

    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(FW.api_mixed_paths_job, 2, args=(str(tmp_path),), timeout_s=120)
    for d in flight_reader.load([str(tmp_path)]):
        entries = [e for e in d["entries"] if e["count"] != 1 << 18]   # (the averages that held the runner)
        words = [e["call"] for e in entries]
        assert all(e["state"] == "done" for e in d["entries"]), d["entries"]
        fast, general = words[:4], words[4:]
        assert fast == general and len(fast) == 4, words
        assert fast[0].startswith("Communicator.all_reduce_avg") and "5 float32" in fast[0], fast


def test_the_ring_keeps_the_last_n(tmp_path):
    import torch

    from ncclavg.transport import calls

    rec = _rec(5)
    t = torch.ones(3)
    for _ in range(12):
        r = rec.issue(calls.make("all_reduce", t.dtype, count=3), [t])
        flight.start(r)
        flight.finish(r, None)
    rec.done(("all_reduce", torch.distributed.ReduceOp.SUM, None), t.dtype, 3)   # a fast path's record: described as the runner's
    snap = rec.snapshot("test")
    assert [e["seq"] for e in snap["entries"]] == [9, 10, 11, 12, 13]
    assert snap["last_seq"] == 13 and len(rec.ring) == 5
    assert snap["entries"][0]["call"] == "all_reduce of 3 float32" and snap["entries"][0]["state"] == "done"
    assert snap["entries"][-1]["call"] == "all_reduce(SUM) of 3 float32", snap["entries"][-1]
    assert snap["entries"][-1]["op"] == "all_reduce" and snap["entries"][-1]["state"] == "done"


def test_buffer_size_from_the_environment(monkeypatch):
    monkeypatch.setenv(flight.ENV_SIZE, "0")
    assert flight.for_group("0", 0, 2, 0, "shm") is None
    monkeypatch.setenv(flight.ENV_SIZE, "7")
    assert flight.for_group("0", 0, 2, 0, "shm").capacity == 7
    monkeypatch.setenv(flight.ENV_SIZE, "-1")
    with pytest.raises(ValueError, match=flight.ENV_SIZE):
        flight.buffer_size()


def test_a_dump_is_written_whole(tmp_path, monkeypatch):
    rec = _rec(4)
    target = tmp_path / "d.json"
    target.write_text("the previous dump")
    real = json.dump

    def half_then_die(obj, f, **kw):   # the writer dies midway: the previous file stays as it was
        f.write('{"format": 1, "entr')
        raise OSError("disk full")

    monkeypatch.setattr(flight.json, "dump", half_then_die)
    with pytest.raises(OSError):
        rec.dump("test", str(target))
    assert target.read_text() == "the previous dump" and os.listdir(tmp_path) == ["d.json"]
    monkeypatch.setattr(flight.json, "dump", real)
    assert rec.dump("test", str(tmp_path)) == str(tmp_path / "ncclavg-trace-rank0-group0.json")
    assert json.loads((tmp_path / "ncclavg-trace-rank0-group0.json").read_text())["reason"] == "test"
    monkeypatch.delenv(flight.ENV_DIR, raising=False)
    assert rec.dump("no directory") is None   # a summary on stderr instead


def _dump(rank, entries, size=2, group="0"):
    ents = [dict({"op": "all_reduce", "dtype": "float32", "count": 1024, "root": None, "state": "done", "error": None},
                 **e) for e in entries]
    for e in ents:
        e.setdefault("call", f"{e['op']} of {e['count']} {e['dtype']}")
    return {"format": 1, "group": group, "rank": rank, "size": size, "entries": ents,
            "last_seq": max((e["seq"] for e in ents), default=0), "_file": f"rank{rank}.json"}


def test_reader_one_rank_behind():
    r0 = _dump(0, [{"seq": s} for s in range(38, 42)] +
               [{"seq": 42, "op": "broadcast", "count": 4, "root": 0, "state": "running"}])
    r1 = _dump(1, [{"seq": s} for s in range(38, 42)])
    text = "\n".join(flight_reader.verdict([r0, r1]))
    assert "rank 1 last completed seq 41 (all_reduce of 1024 float32); it issued nothing after seq 41" in text, text
    assert "rank 0 waits in seq 42 (broadcast of 4 float32, running), which rank 1 never issued" in text, text


def test_reader_mismatched_op():
    r0 = _dump(0, [{"seq": 1}, {"seq": 2, "op": "broadcast", "root": 0, "state": "failed", "error": "mismatch"}])
    r1 = _dump(1, [{"seq": 1}, {"seq": 2, "state": "failed", "error": "mismatch"}])
    lines = flight_reader.verdict([r0, r1])
    assert "the ranks called different collectives at seq 2:" in lines[1], lines
    assert lines[2].startswith("    rank 0: broadcast") and lines[3].startswith("    rank 1: all_reduce"), lines


def test_reader_all_agree_and_in_step_stalls():
    done = [_dump(r, [{"seq": s} for s in range(1, 4)], size=3) for r in range(3)]
    assert flight_reader.verdict(done)[-1] == "  all ranks agree: every rank issued and completed seq 3 " \
                                              "(all_reduce of 1024 float32)"
    stalled = [_dump(r, [{"seq": 1}, {"seq": 2, "state": "running" if r == 2 else "done", "issued": 100.0 + 9 * r}],
                     size=3) for r in range(3)]
    lines = flight_reader.verdict(stalled)
    assert "in step (every rank issued seq 2)" in lines[1] and "rank(s) [2]" in lines[1], lines
    assert lines[-1].startswith("  rank 2 issued seq 2 18.0 s after rank 0: it was held up before it"), lines
    missing = flight_reader.verdict(done[:2])
    assert "no dump of rank(s) [2]" in missing[1], missing


def test_trace_command(tmp_path, capsys):
    from ncclavg.cli import main

    for d in (_dump(0, [{"seq": 1}, {"seq": 2, "state": "running"}]), _dump(1, [{"seq": 1}])):
        flight.write_atomically(str(tmp_path / f"ncclavg-trace-rank{d['rank']}-group0.json"), d)
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 waits in seq 2" in out and "which rank 1 never issued" in out, out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["trace", str(tmp_path / "bad.json")]) == 2
    assert "not a flight recorder dump" in capsys.readouterr().err


def test_sigusr1_dumps_every_group(tmp_path, monkeypatch):
    previous = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(flight.ENV_SIGNAL, "1")
    monkeypatch.setattr(flight, "_signal_installed", False)
    try:
        rec = flight.for_group("sig", 1, 2, 1, "shm")
        os.kill(os.getpid(), signal.SIGUSR1)   # the handler runs on this (the main) thread before the next line
        with open(tmp_path / rec.file_name()) as f:
            assert json.load(f)["reason"] == "signal"
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------- Note [What the recorder says]
@pytest.mark.parametrize("face", ["torch", "api"])
@pytest.mark.parametrize("trace", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no-trace-dir", "trace-dir"])
def test_a_mismatch_is_said_once_by_the_exception(tmp_path, face, trace):
    from _dist_util import run_ranks

    trace_dir = str(tmp_path / "trace") if trace else ""
    run_ranks(FW.quiet_mismatch_job, 2, args=(str(tmp_path), face, trace_dir), timeout_s=120)
    reports = read_reports(tmp_path, 2)
    for r in range(2):
        rep = reports[r]
        assert rep["type"] in ("BackendMismatchError", "CollectiveMismatchError"), rep
        assert "out of step" in rep["msg"] and "4 float32" in rep["msg"] and "5 float32" in rep["msg"], rep
        stderr = (tmp_path / f"stderr{r}").read_text()
        assert "flight recorder" not in stderr and "out of step" not in stderr, stderr
    if trace:   # the record is kept all the same
        assert len(os.listdir(trace_dir)) == 2


def _failed_rec(tmp_path, monkeypatch, trace):
    rec = _rec(8)
    if trace:
        monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    else:
        monkeypatch.delenv(flight.ENV_DIR, raising=False)
    return rec


@pytest.mark.parametrize("trace", [False, True])
def test_a_timeout_or_lost_peer_is_reported_once_and_whole(tmp_path, monkeypatch, capfd, trace):
    rec = _failed_rec(tmp_path, monkeypatch, trace)
    writes = []
    real = os.write
    monkeypatch.setattr(flight.os, "write", lambda fd, data: writes.append(fd) or real(fd, data))
    rec.failed("ncclavg allreduce did not complete within 2 s (rank 1 stopped responding)", loud=True)
    rec.failed("a second failure is not reported", loud=True)
    err = capfd.readouterr().err
    if trace:
        assert err.count(str(tmp_path)) == 1 and "ncclavg trace" in err, err
        assert os.listdir(tmp_path) == [rec.file_name()]
    else:
        assert err.count("ncclavg flight recorder") == 1 and "did not complete within 2 s" in err, err
    assert "second failure" not in err
    assert len(writes) == 1   # one write(2): two ranks' reports on one terminal never interleave line by line


@pytest.mark.parametrize("trace", [False, True])
def test_a_mismatch_is_recorded_silently(tmp_path, monkeypatch, capfd, trace):
    rec = _failed_rec(tmp_path, monkeypatch, trace)
    rec.failed("collectives out of step: rank 0 called all_reduce(SUM) of 4 float32, rank 1 ...", loud=False)
    assert capfd.readouterr().err == ""
    assert os.listdir(tmp_path) == ([rec.file_name()] if trace else [])
