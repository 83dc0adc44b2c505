"""The straggler report (Note [The straggler report] in ncclavg/transport/stragglers.py, Note [Arrival times]
in csrc/transport/shm_arrivals.h): its verdicts on made-up arrival logs, then real runs: a rank slowed by
a sleep of known length in its step is named, with its lateness within 20% of the sleep, through the
public API (2 and 4 processes), stock DDP over the ncclavg backend, TowerTrainer's epoch records and
summary, and pretend hosts (2 x 2, 2 x 1 and 3 + 1 with their clocks seconds apart); a balanced run names
nobody."""
import json
import os
import time

import pytest
import torch

from _dist_util import init_rank, run_ranks
from ncclavg.transport.stragglers import _report, report

MS = 1e-3
SLEEP_S = 0.04   # long against this machine's scheduling jitter (~1 ms when 4 processes share 2 cores)
# a trainer's step computes between the sleep and the collective that waits for it: each rank's compute,
# which a busy machine stretches by up to some 10 ms, is in the lateness too; 20% of 100 ms holds it
TRAINER_SLEEP_S = 0.1


def _log(late_ms, step_ms=10.0):
    """starts and lateness (s) of made-up calls: late_ms[i] the ranks' lateness in call i."""
    late = torch.tensor(late_ms, dtype=torch.float64) * MS
    starts = (torch.arange(len(late_ms), dtype=torch.int64) * int(step_ms * 1e6))
    return starts, late


def test_a_rank_late_in_most_calls_that_waited_is_named_and_jitter_is_not():
    # rank 2 late by 30 ms in every other call (one bucket of two: the other ran back to back)
    rows = [[0.01, 0.02, 30.0 if i % 2 == 0 else 0.0] for i in range(20)]
    rep = _report(*_log(rows), labels=[0, 1, 2], threshold_s=5e-3, logged=20)
    assert rep.named == [2] and rep.waited == 10
    r2 = rep.ranks[2]
    assert (r2.last, r2.share_last, r2.last_any) == (10, 1.0, 0.5)
    assert r2.median_s == pytest.approx(30 * MS) and r2.p90_s == pytest.approx(30 * MS)
    # the others waited 30 - 0.01 and 30 - 0.02 ms (their mean) in 10 calls, over a span of 19 steps of
    # 10 ms plus the last call's spread
    assert r2.waiting_share == pytest.approx(10 * 29.985 / (190 + 0.02))
    assert "rank 2 was last in 10 of 10 calls that waited, late by 30.0 ms" in rep.summary()
    # balanced: the last rank changes from call to call
    rows = [[(i * 7 + r * 3) % 5 * 3.0 for r in range(3)] for i in range(40)]   # up to 12 ms apart
    rep = _report(*_log(rows), labels=[0, 1, 2], threshold_s=5e-3, logged=40)
    assert rep.waited > 20 and max(r.share_last for r in rep.ranks) < 2 / 3
    assert rep.named == [] and rep.summary().startswith("stragglers: none over 40 calls")


def test_a_spread_under_the_threshold_is_no_wait():
    # ranks 2 ms apart in every call (a busy machine, or the previous call's uneven finish between hosts)
    rows = [[0.0, 1.0, 2.0] for _ in range(10)]
    rep = _report(*_log(rows), labels=[5, 6, 7], threshold_s=5e-3, logged=10)
    assert rep.waited == 0 and rep.named == [] and rep.ranks[2].last_any == 1.0
    assert [r.rank for r in rep.ranks] == [5, 6, 7]   # the group's ranks, not the channel's
    assert _report(*_log(rows), labels=[5, 6, 7], threshold_s=1e-3, logged=10).named == [7]


def test_a_few_late_calls_or_a_short_lateness_name_nobody():
    rows = [[0.0, 0.0]] * 20 + [[0.0, 50.0]] * 2      # two late calls: under the 3 a name needs
    assert _report(*_log(rows), labels=[0, 1], threshold_s=5e-3, logged=22).named == []
    rows = [[0.0, 4.0]] * 20                          # late every time, by less than the threshold
    assert _report(*_log(rows), labels=[0, 1], threshold_s=5e-3, logged=20).named == []
    rep = _report(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.float64), [0, 1], 5e-3, 0)
    assert (rep.calls, rep.named) == (0, [])


class _Channel:
    """A channel's log as the core hands it over (the binding's bytes)."""

    def __init__(self, starts_ns, late_ns, labels, logged):
        self.labels, self._s, self._l, self._n = labels, starts_ns, late_ns, logged

    def arrivals(self, calls):
        s, l = self._s, self._l
        if calls >= 0:
            s, l = s[len(s) - min(calls, len(s)):], l[len(l) - min(calls, len(l)):]
        return self._n, torch.tensor(s, dtype=torch.int64).numpy().tobytes(), torch.tensor(l, dtype=torch.int64).numpy().tobytes()


def test_windows_by_calls_seconds_and_since_and_bad_arguments():
    starts = [i * 1_000_000_000 for i in range(10)]              # one call a second
    late = [[0, 6_000_000 if i >= 5 else 0] for i in range(10)]   # rank 1 late by 6 ms from call 5 on
    ch = _Channel(starts, late, [0, 1], logged=10)
    assert report(ch).named == [1] and report(ch).calls == 10
    assert report(ch, calls=3).calls == 3
    assert report(ch, seconds=2.5).calls == 3
    assert report(ch, since=8).calls == 2 and report(ch, since=8).logged == 10
    assert report(ch, since=0).calls == 10 and report(ch, since=50).calls == 0
    assert report(ch, since=5).named == [1] and report(ch, calls=5).ranks[1].median_s == pytest.approx(6 * MS)
    assert report(ch, threshold_s=0.01).named == []
    for kw, name in (({"calls": 0}, "calls"), ({"seconds": -1}, "seconds"), ({"threshold_s": 0}, "threshold_s"),
                     ({"since": -1}, "since")):
        with pytest.raises(ValueError, match=name):
            report(ch, **kw)


# ---------------------------------------------------------------------- real runs
def _public_api_job(rank, world, port, slow, out_dir):
    init_rank(rank, world, port)
    from ncclavg import Communicator

    comm = Communicator.from_torch_distributed(device="cpu", timeout=60)
    grads = torch.zeros(4096)
    comm.all_reduce_avg([grads])   # the processes meet once before the steps
    for _ in range(8):
        if rank == slow:
            time.sleep(SLEEP_S)   # this rank's "backward" takes longer
        comm.all_reduce_avg([grads])                        # the step's first bucket: waits for the slow rank
        comm.all_reduce_avg([torch.zeros(64)])             # and two more, right after it
        comm.all_reduce_avg_async([torch.zeros(300_000)]).wait()
    rep = comm.straggler_report()
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(rep.as_dict(), f)


@pytest.mark.parametrize("world,slow", [(2, 1), (4, 2), (2, -1), (4, -1)])
def test_the_public_api_names_a_slowed_rank_and_a_balanced_run_names_nobody(tmp_path, world, slow):
    run_ranks(_public_api_job, world, args=(slow, str(tmp_path)), timeout_s=120)
    for r in range(world):
        rep = json.loads((tmp_path / f"r{r}.json").read_text())
        assert rep["calls"] == 1 + 8 * 3, rep
        if slow < 0:
            assert rep["named"] == [], rep
            continue
        assert rep["named"] == [slow], rep
        mine = rep["ranks"][slow]
        # late to each step's first call by the sleep, less what the others spent between their calls
        assert mine["median_s"] == pytest.approx(SLEEP_S, rel=0.2), mine
        assert mine["last"] >= 7 and mine["share_last"] >= 2 / 3, mine


def _ddp_job(rank, world, port, slow, out_dir):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ncclavg.ddp
    from process_group._process_group_workers import init_backend

    init_backend(rank, world, port)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)),
                bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for _ in range(8):
        out = model(x)
        if rank == slow:
            time.sleep(SLEEP_S)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    rep = ncclavg.ddp.straggler_report()
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(rep.as_dict(), f)


def test_stock_ddp_over_the_ncclavg_backend_names_the_slowed_rank(tmp_path):
    run_ranks(_ddp_job, 2, args=(1, str(tmp_path)), timeout_s=120)
    for r in range(2):
        rep = json.loads((tmp_path / f"r{r}.json").read_text())
        assert rep["named"] == [1], rep
        assert rep["ranks"][1]["median_s"] == pytest.approx(SLEEP_S, rel=0.2), rep


def test_straggler_report_refuses_a_group_of_another_backend(tmp_path):
    run_ranks(_gloo_group_job, 2, args=(), timeout_s=60)


def _gloo_group_job(rank, world, port):
    import ncclavg.ddp

    init_rank(rank, world, port)   # a gloo group
    with pytest.raises(ValueError, match="group: not a process group of the ncclavg backend"):
        ncclavg.ddp.straggler_report()


def _trainer_job(rank, world, port, slow, out_dir, layout=None):
    init_rank(rank, world, port)
    if layout:   # pretend hosts for the trainer's communicator (comm/gloo.py asks each rank's host)
        import ncclavg.comm.gloo as comm_gloo

        comm_gloo.host_identity = lambda: f"test-host-{layout[rank]}"
    from ncclavg.train.callbacks import Callback
    from ncclavg.train.data import TensorLoader, load_digits
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    class Slow(Callback):
        def on_step_end(self, trainer, record):   # this rank's next step starts late
            if rank == slow:
                time.sleep(TRAINER_SLEEP_S)

    d = load_digits()
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], timeout=60)
    hist = tr.fit(TensorLoader(d.x_train[:128], d.y_train[:128], batch_size=32, seed=0), epochs=2,
                  callbacks=[Slow()], progress=None)
    out = {"epochs": [h["stragglers"] for h in hist], "summary": tr.last_summary.stragglers.as_dict(),
           "transport": tr.comm.transport}
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(out, f)


# one host (its channel), and two pretend hosts of one process each on UCX (the lanes' log: every rank)
@pytest.mark.parametrize("layout,transport", [(None, "shm"), ([0, 1], "ucx")])
def test_the_trainer_reports_stragglers_per_epoch_and_in_its_summary(tmp_path, monkeypatch, layout, transport):
    monkeypatch.setenv("NCCLAVG_UCX", "auto")
    slow = 1 if layout else 0
    run_ranks(_trainer_job, 2, args=(slow, str(tmp_path), layout), timeout_s=180)
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["transport"] == transport, got["transport"]
        for epoch in got["epochs"]:
            assert epoch["named"] == [slow], epoch
            assert epoch["ranks"][slow]["median_s"] == pytest.approx(TRAINER_SLEEP_S, rel=0.2), epoch
        assert got["summary"]["named"] == [slow]
        assert got["summary"]["calls"] == sum(e["calls"] for e in got["epochs"])


def _hosts_job(rank, world, port, layout, slow, out_dir, skew_ms=None):
    import torch.distributed as dist

    import ncclavg.ddp
    from process_group._process_group_workers import init_backend

    if skew_ms is not None:   # this pretend host's clock between the hosts: Note [Arrival times between hosts]
        os.environ["NCCLAVG_TEST_CLOCK_SKEW_MS"] = str(skew_ms[layout[rank]])
    init_backend(rank, world, port, layout=layout)
    t = torch.zeros(100_000)
    dist.all_reduce(t)
    balanced = ncclavg.ddp.straggler_report()
    for _ in range(8):
        if rank == slow:
            time.sleep(SLEEP_S)
        dist.all_reduce(t)                   # the native path between hosts (one call into the lanes)
        dist.broadcast(torch.zeros(16), 0)   # the runner's job around one call between hosts
    rep = ncclavg.ddp.straggler_report()
    transport = dist.group.WORLD._runner.transport
    lanes = getattr(transport, "arrival_source", None)
    offsets = {} if lanes is None else {p: lanes.clock_offset(p) for p in lanes.peers()}
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump({"transport": dist.group.WORLD.transport, "balanced": balanced and balanced.as_dict(),
                   "offsets": offsets, **rep.as_dict()}, f)


def _hosts_reports(tmp_path, monkeypatch, lanes, layout, slow, skew_ms=None):
    """Every rank's report of _hosts_job on pretend hosts (`layout`: each rank's host), the lanes on
    `lanes` ("ucx" or "gloo")."""
    monkeypatch.setenv("NCCLAVG_UCX", "auto" if lanes == "ucx" else "0")
    run_ranks(_hosts_job, len(layout), args=(layout, slow, str(tmp_path), skew_ms), timeout_s=120)
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(len(layout))]


def test_between_hosts_on_ucx_every_rank_names_the_slowed_rank_of_another_host(tmp_path, monkeypatch):
    """2 x 2 pretend hosts on UCX: the lanes' log covers every rank of every host (Note [Arrival times
    between hosts]), so host 0's ranks name host 1's slowed rank 3 too, each with its lateness."""
    for rep in _hosts_reports(tmp_path, monkeypatch, "ucx", [0, 0, 1, 1], 3):
        assert rep["transport"] == "shm+ucx", rep
        assert rep["calls"] == 1 + 8 * 2, rep   # the user's calls (the lanes' connect is not one)
        assert [x["rank"] for x in rep["ranks"]] == [0, 1, 2, 3], rep
        assert rep["named"] == [3], rep
        assert rep["ranks"][3]["median_s"] == pytest.approx(SLEEP_S, rel=0.2), rep


@pytest.mark.slow
def test_between_hosts_on_gloo_each_host_names_its_own_slowed_rank(tmp_path, monkeypatch):
    """2 x 2 pretend hosts, gloo's lanes: rank 3's host-mate sees it late in the host's channel (each call's
    first step there; its later steps are not logged); host 0's ranks arrive together, and its report
    covers them only (Note [The straggler report])."""
    for r, rep in enumerate(_hosts_reports(tmp_path, monkeypatch, "gloo", [0, 0, 1, 1], 3)):
        assert rep["transport"] == "shm+gloo", rep
        assert rep["calls"] == 1 + 8 * 2, rep
        assert [x["rank"] for x in rep["ranks"]] == ([0, 1] if r < 2 else [2, 3]), rep
        assert rep["named"] == ([] if r < 2 else [3]), rep
        if r >= 2:
            assert rep["ranks"][1]["median_s"] == pytest.approx(SLEEP_S, rel=0.2), rep


# (layout, slowed rank, each pretend host's clock moved by ms): one process per host, where no host's
# channel sees anything; three ranks on one host, whose middle rank the other host knows by its mean
@pytest.mark.parametrize("layout,slow,skew_ms", [([0, 1], 1, [0, 10_000]), ([0, 0, 0, 1], 1, [-5_000, 0])])
def test_hosts_on_clocks_seconds_apart_name_the_slowed_rank(tmp_path, monkeypatch, layout, slow, skew_ms):
    """The offset between two hosts' clocks comes from the lanes' hellos (Note [Arrival times between
    hosts]): here each pretend host's clock is moved by seconds, so a report that used the stamps as they
    are would name the host behind. The estimate's error is half the difference of the two directions'
    least hello delays (tens of microseconds on loopback, up to a few hundred where a busy 2-core machine
    delays a receive): it must be under half the report's 5 ms threshold, which no verdict can then tell
    from a true clock; and the slowed rank is named with its lateness on every rank, the calls before it
    named nobody."""
    world = len(layout)
    reps = _hosts_reports(tmp_path, monkeypatch, "ucx", layout, slow, skew_ms)
    # the others' waits for the slowed rank: exact on its own host (every stamp), and from the other host's
    # view too, where a host's ranks between its first and last are known by their mean (their sum exact):
    # the processes' logs differ only by the offsets' error (well under 1% of the 40 ms waits)
    shares = [rep["ranks"][slow]["waiting_share"] for rep in reps]
    assert max(shares) - min(shares) < 0.03, shares
    for r, rep in enumerate(reps):
        assert rep["transport"] == ("ucx" if world == 2 else "shm+ucx"), rep
        assert [x["rank"] for x in rep["ranks"]] == list(range(world)), rep
        assert rep["named"] == [slow], rep
        assert rep["ranks"][slow]["median_s"] == pytest.approx(SLEEP_S, rel=0.2), rep
        assert rep["balanced"]["named"] == [] and rep["balanced"]["calls"] == 1, rep
        for peer, off in rep["offsets"].items():   # my clock minus theirs
            want = (skew_ms[layout[r]] - skew_ms[layout[int(peer)]]) * 1e6
            assert off is not None and abs(off - want) < 2.5e6, (r, peer, off, want)


def _dump_job(rank, world, port, slow, out_dir):
    import torch.distributed as dist

    from ncclavg.transport import flight
    from process_group._process_group_workers import init_backend

    init_backend(rank, world, port)
    t = torch.zeros(1000)
    for _ in range(6):
        if rank == slow:
            time.sleep(SLEEP_S)
        dist.all_reduce(t)
    flight.dump(dist.group.WORLD, path=out_dir)


def test_a_flight_record_carries_the_report_and_ncclavg_trace_says_it(tmp_path):
    from ncclavg.transport.flight_reader import load, table

    run_ranks(_dump_job, 2, args=(1, str(tmp_path)), timeout_s=120)
    dumps = load([str(tmp_path)])
    assert len(dumps) == 2 and all(d["stragglers"]["named"] == [1] for d in dumps), dumps
    lines = [x for x in table(dumps) if "stragglers among ranks 0,1:" in x]
    assert len(lines) == 2 and all("rank 1 was last in 6 of 6 calls that waited, late by " in x for x in lines), lines


def _profiled_job(rank, world, port, slow, out_dir):
    import torch.distributed as dist
    from torch._C._profiler import _ExperimentalConfig

    from process_group._process_group_workers import init_backend

    init_backend(rank, world, port)
    t = torch.zeros(1000)
    dist.all_reduce(t)
    with torch.profiler.profile(record_shapes=True,
                                experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        dist.all_reduce(t)   # the ranks meet once the profilers run (each takes its own time to start)
        for _ in range(4):
            if rank == slow:
                time.sleep(SLEEP_S)
            dist.all_reduce(t)
    path = os.path.join(out_dir, f"trace{rank}.json")
    prof.export_chrome_trace(path)
    from ncclavg.transport.profiling import _bound
    from ncclavg.transport.stragglers import arrivals

    _, late, labels, _ = arrivals(dist.group.WORLD._runner.transport.host_channel, 5)
    want = [f"ncclavg:last_rank:{labels[int(row.argmax())]}:late<={_bound(float(row.max()) / 1e3)}" for row in late]
    with open(os.path.join(out_dir, f"want{rank}.json"), "w") as f:
        json.dump({"names": want, "late_s": [float(row.max()) / 1e9 for row in late]}, f)


def test_the_profiler_trace_names_the_last_rank_of_each_call(tmp_path):
    run_ranks(_profiled_job, 2, args=(1, str(tmp_path)), timeout_s=120)
    for r in range(2):
        events = json.loads((tmp_path / f"trace{r}.json").read_text())["traceEvents"]
        last = [e["name"] for e in events if e.get("name", "").startswith("ncclavg:last_rank:")]
        want = json.loads((tmp_path / f"want{r}.json").read_text())
        assert last == want["names"], (last, want)   # each call's event says what the channel logged of it
        assert len(last) == 5 and all(x.startswith("ncclavg:last_rank:1:") for x in last[1:]), last
        assert all(t >= 0.8 * SLEEP_S for t in want["late_s"][1:]), want   # the sleep, less the jitter


def test_the_lateness_bounds_of_the_profiler_events():
    from ncclavg.transport.profiling import _bound

    assert [_bound(x) for x in (0.0, 0.7, 1, 3, 512, 513, 1000, 1001, 40_000, 3e6)] == \
        ["1us", "1us", "1us", "4us", "512us", "1ms", "1ms", "2ms", "64ms", "4096ms"]


def test_the_fit_summary_warns_when_a_rank_was_named(capsys):
    from ncclavg.train.fit_report import FitSummary, show_summary

    rows = [[0.0, 30.0]] * 5
    named = _report(*_log(rows), labels=[0, 1], threshold_s=5e-3, logged=5)
    summary = FitSummary(0.9, 1, 100.0, 1.0, 2, 2, ("cpu",), 5, stragglers=named)
    show_summary(summary, "lines")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warning: stragglers: rank 1 was last in 5 of 5 calls that waited, late by 30.0 ms")
    assert out[1].startswith("summary: ")
    calm = _report(*_log([[0.0, 0.0]] * 5), labels=[0, 1], threshold_s=5e-3, logged=5)
    show_summary(FitSummary(0.9, 1, 100.0, 1.0, 2, 2, ("cpu",), 5, stragglers=calm), "lines")
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning")] == []
