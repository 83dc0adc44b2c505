"""bench/hosts.py: its arguments (each refused with a message that names it), its refusal where hosts
cannot be emulated, the report's arithmetic on made-up rank files, the commands it launches, and
(slow) a tiny run end to end in network namespaces with the files it writes. The network itself is
tested in test_hosts_net.py."""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "bench" / "hosts.py", "hosts_bench")


@pytest.fixture(scope="module")
def worker():
    return load_script(ROOT / "bench" / "hosts_worker.py", "hosts_worker_mod")


def refused(bench, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        bench.main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("argv,named", [
    (["--links", "2500"], "--links"), (["--links", "fast:0.1"], "--links"), (["--links", "0:0.1"], "--links"),
    (["--links", "2500:5000"], "--links"), (["--links", ","], "--links"), (["--links", "vethx"], "--links"),
    (["--shapes", "2"], "--shapes"), (["--shapes", "1x2"], "--shapes"), (["--shapes", "2x0"], "--shapes"),
    (["--shapes", "10x1"], "--shapes"),
    (["--sizes", "4X"], "--sizes"), (["--sizes", "6"], "--sizes"), (["--sizes", "2G"], "--sizes"),
    (["--sizes", ","], "--sizes"),
    (["--contenders", "nccl"], "--contenders"), (["--contenders", ""], "--contenders"),
    (["--calls", "0"], "--calls"), (["--launches", "0"], "--launches"), (["--warmup", "-1"], "--warmup"),
    (["--load", "-2"], "--load"), (["--nics", "5"], "--nics"), (["--mtu", "100"], "--mtu"),
    (["--timeout", "0"], "--timeout"), (["--ceiling-s", "-1"], "--ceiling-s"), (["--tag", "a b"], "--tag"),
    (["--mpi-mca", "btl"], "--mpi-mca"), (["--mpi-mca", "Bad Name=1"], "--mpi-mca"),
    (["--nic-use", "both"], "--nic-use"),
])
def test_bad_arguments_are_refused_naming_the_argument(bench, capsys, argv, named):
    assert named in refused(bench, capsys, *argv)


def test_good_arguments_make_the_plan(bench):
    args = bench.parser().parse_args(["--shapes", "2x2,3x1", "--links", "2500:0.1,1000:0.5",
                                      "--sizes", "4K,256KiB,4M,8", "--contenders", "ncclavg,gloo,ncclavg",
                                      "--mpi-mca", "btl_tcp_links=2"])
    bench.check(args)
    assert args.sizes == [4096, 256 << 10, 4 << 20, 8]
    assert args.contenders == ["ncclavg", "gloo"]
    assert args.mpi_mca == (("btl_tcp_links", "2"),)
    link = bench.net_mod.Link
    assert args.plan == [((2, 2), link(2500, 0.1)), ((3, 1), link(2500, 0.1)),
                         ((2, 2), link(1000, 0.5)), ((3, 1), link(1000, 0.5))]


def test_a_veth_link_joins_the_plan(bench):
    args = bench.parser().parse_args(["--shapes", "2x1", "--links", "veth,2500:0.1"])
    bench.check(args)
    link = bench.net_mod.Link
    assert args.plan == [((2, 1), bench.net_mod.VETH), ((2, 1), link(2500, 0.1))]
    assert args.plan[0][1].veth and not args.plan[1][1].veth


def test_the_default_plan_is_the_baseline(bench):
    args = bench.parser().parse_args([])
    bench.check(args)
    link = bench.net_mod.Link
    assert args.plan == [((2, 2), link(2500, 0.1)), ((2, 1), link(2500, 0.1)), ((2, 2), link(1000, 0.5))]
    assert args.sizes == [4 << 10, 256 << 10, 4 << 20, 32 << 20]
    assert args.contenders == ["gloo", "ncclavg", "ncclavg-gloo", "ncclavg-api", "mpi", "mpi-tcp"]


def test_the_network_refuses_shapes_it_cannot_make(bench):
    hn = bench.net_mod
    for kw, word in (({"hosts_n": 1}, "hosts"), ({"hosts_n": 2, "nics": 0}, "nics"),
                     ({"hosts_n": 2, "mtu": 70000}, "mtu")):
        with pytest.raises(ValueError, match=word):
            hn.Network(link=hn.Link(100, 1), **kw)


# ------------------------------------------------------------------------------------ refusing to run
def test_not_root_is_refused_clearly(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench.net_mod.os, "geteuid", lambda: 1000)
    assert bench.main(["--shapes", "2x1"]) == 2
    assert "need root (running as uid 1000)" in capsys.readouterr().err


@pytest.mark.parametrize("missing,package", [("ip", "iproute2"), ("tc", "iproute2"), ("gcc", "gcc")])
def test_a_missing_tool_is_named(bench, monkeypatch, capsys, missing, package):
    real = bench.net_mod.tool
    monkeypatch.setattr(bench.net_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench.net_mod, "tool", lambda name: None if name == missing else real(name) or "/bin/true")
    assert bench.main(["--shapes", "2x1"]) == 2
    assert f"`{missing}` ({package}) is not installed" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- the report
def launch_file(times_by_rank, tx_calls, tx_syncs, calls, cpu_calls=None, cpu_syncs=None):
    """A made-up result file: every rank's call times for one size (4096 B), the NIC bytes of local rank
    0 of each host (one rank per host here), and (when given) each rank's CPU seconds over the calls
    with their syncs and over the syncs alone."""
    ranks = []
    for r, times in enumerate(times_by_rank):
        ranks.append({"rank": r, "host": r, "local_rank": 0, "sizes": {"4096": {
            "times_s": times, "wrong": 0,
            "calls_bytes": {"nvbhn0": {"tx_bytes": tx_calls[r], "rx_bytes": 0}},
            "syncs_bytes": {"nvbhn0": {"tx_bytes": tx_syncs[r], "rx_bytes": 0}}}}})
        if cpu_calls is not None:
            ranks[-1]["sizes"]["4096"].update(calls_cpu_s=cpu_calls[r], syncs_cpu_s=cpu_syncs[r])
    return {"contender": "x", "world": len(ranks), "ranks": ranks}


def test_a_call_is_as_slow_as_its_slowest_rank_and_the_median_spans_the_launches(bench):
    rep = bench.report
    a = launch_file([[1.0, 5.0, 3.0], [2.0, 1.0, 3.5]], [4096 * 3 + 300, 4096 * 3 + 300], [300, 300], 3)
    b = launch_file([[4.0, 4.0, 4.0], [0.5, 0.5, 0.5]], [4096 * 6 + 300, 4096 * 6 + 300], [300, 300], 3)
    assert rep.call_samples(a, 4096) == [2.0, 5.0, 3.5]
    shape = {"hosts": 2, "procs": 1, "link": {"rate_mbit": 1000, "delay_ms": 0.5}, "sizes": [4096],
             "contenders": ["gloo", "ncclavg"],
             "launches": [{"contender": "gloo", "index": 0, "result": a},
                          {"contender": "ncclavg", "index": 1, "result": b},
                          {"contender": "gloo", "index": 2, "result": b},
                          {"contender": "ncclavg", "index": 3, "error": "exit 1"}]}
    rows = {r["contender"]: r for r in rep.merge(shape, calls=3)}
    g = rows["gloo"]
    assert g["calls"] == 6 and g["launches"] == 2
    assert g["median_s"] == 4.0                       # median of 2, 5, 3.5, 4, 4, 4
    assert g["wire_bytes_per_op"] == (4096 + 4096 * 2) / 2   # per launch (sent - syncs) / calls, median
    assert g["wire_over_size"] == 1.5
    t_star = 2 * 1 / 2 * 4096 / (1000e6 / 8)
    assert g["t_star_over_t"] == pytest.approx(t_star / 4.0)
    assert rows["ncclavg"]["launches"] == 1 and rows["ncclavg"]["median_s"] == 4.0
    assert rep.ratio(rep.merge(shape, 3), 4096, "ncclavg", "gloo") == 1.0
    lines = rep.shape_lines(shape, rep.merge(shape, 3))
    assert any("ncclavg #3: exit 1" in x for x in lines)


def test_cpu_per_call_sums_the_ranks_less_the_syncs_and_takes_the_median_over_launches(bench):
    rep = bench.report
    # 3 calls; the ranks' (calls with syncs - syncs alone) / 3 summed: launch a 0.3 + 0.6 = 0.9 s,
    # b 0.03 + 0.06 = 0.09 s, c 0.6 + 0.9 = 1.5 s; their median is a's
    a = launch_file([[1.0] * 3, [1.0] * 3], [0, 0], [0, 0], 3, cpu_calls=[1.2, 2.1], cpu_syncs=[0.3, 0.3])
    b = launch_file([[1.0] * 3, [1.0] * 3], [0, 0], [0, 0], 3, cpu_calls=[0.19, 0.28], cpu_syncs=[0.1, 0.1])
    c = launch_file([[1.0] * 3, [1.0] * 3], [0, 0], [0, 0], 3, cpu_calls=[2.1, 3.0], cpu_syncs=[0.3, 0.3])
    old = launch_file([[1.0] * 3, [1.0] * 3], [0, 0], [0, 0], 3)   # written before ranks measured CPU
    assert rep.cpu_per_op(a, 4096, 3) == pytest.approx(0.9) and rep.cpu_per_op(old, 4096, 3) is None
    shape = {"hosts": 2, "procs": 1, "link": {"rate_mbit": 1000, "delay_ms": 0.5}, "sizes": [4096],
             "contenders": ["gloo", "mpi"],
             "launches": [{"contender": "gloo", "index": i, "result": r} for i, r in enumerate((a, b, c))] +
                         [{"contender": "mpi", "index": 3, "result": old}]}
    rows = {r["contender"]: r for r in rep.merge(shape, calls=3)}
    assert rows["gloo"]["cpu_s_per_op"] == pytest.approx(0.9)
    assert rows["mpi"]["cpu_s_per_op"] is None
    lines = rep.table(shape, rep.merge(shape, 3))
    head = [x.strip() for x in lines[0].strip("|").split("|")]
    assert head[-1] == "CPU ms/call gloo / Open MPI"
    assert lines[2].rstrip(" |").endswith("| 900.0 / -")
    assert "`CPU ms/call`" in rep.COLUMNS and "delay line" in rep.COLUMNS


def test_an_unshaped_veth_link_takes_the_measured_tcp_ceiling_as_its_rate(bench):
    rep = bench.report
    a = launch_file([[0.001] * 3, [0.001] * 3], [4096 * 3, 4096 * 3], [0, 0], 3)
    shape = {"hosts": 2, "procs": 1, "nics": 1, "link": {"rate_mbit": 0.0, "delay_ms": 0.0, "veth": True},
             "sizes": [4096], "contenders": ["gloo"], "launches": [{"contender": "gloo", "index": 0, "result": a}],
             "measured": {"tcp_one_way_mbit": 20000.0, "tcp_both_ways_mbit": [9000.0, 11000.0],
                          "tcp_per_nic_mbit": [20000.0], "rtt_ms": {"min": 0.05, "median": 0.07},
                          "ucx_perftest": {"tag_bw_mbit": 5000.0, "tag_lat_ms": 0.02}}}
    assert rep.reference_mbit(shape) == 10000.0                       # each way at once, their mean
    assert rep.reference_mbit(dict(shape, collective="broadcast")) == 20000.0   # one way
    row = rep.merge(shape, 3)[0]
    assert row["t_star_over_t"] == pytest.approx(rep.t_star_s(4096, 2, 10000.0) / 0.001)
    assert rep.shape_title(shape) == "2 hosts x 1 process, unshaped veth"
    text = "\n".join(rep.shape_lines(shape, rep.merge(shape, 3)))
    assert "(no delay configured)" in text and "R = 10000 Mbit/s, the TCP ceiling measured above" in text
    assert "0.500 of the TCP ceiling" in text and "| size | T* (TCP) ms |" in text
    unmeasured = {k: v for k, v in shape.items() if k != "measured"}
    assert rep.merge(unmeasured, 3)[0]["t_star_over_t"] is None       # no rate to compare with
    assert "| 4 KiB | - |" in "\n".join(rep.table(unmeasured, rep.merge(unmeasured, 3)))


def test_t_star_is_two_h_minus_one_over_h_of_the_size_at_the_line_rate(bench):
    rep = bench.report
    assert rep.t_star_s(32 << 20, 2, 2500) == pytest.approx((32 << 20) / 312.5e6)
    assert rep.t_star_s(3 << 20, 3, 1000) == pytest.approx(4 / 3 * (3 << 20) / 125e6)
    # a broadcast: every other host receives the whole size over its one link
    assert rep.t_star_s(32 << 20, 3, 2500, "broadcast") == pytest.approx((32 << 20) / 312.5e6)
    # an all-gather or reduce-scatter of S in all: each host receives (sends) the other hosts' (H-1)/H of it
    for c in ("all_gather", "reduce_scatter"):
        assert rep.t_star_s(3 << 20, 3, 1000, c) == pytest.approx(2 / 3 * (3 << 20) / 125e6)


def test_the_best_mpi_is_the_faster_of_the_two_at_each_size(bench):
    rep = bench.report
    rows = [{"size": 8, "contender": "ncclavg", "median_s": 2.0}, {"size": 8, "contender": "mpi", "median_s": 8.0},
            {"size": 8, "contender": "mpi-tcp", "median_s": 4.0}, {"size": 16, "contender": "ncclavg", "median_s": 2.0},
            {"size": 16, "contender": "mpi", "median_s": None}]
    assert rep.ratio(rows, 8, "ncclavg", "best MPI") == 0.5
    assert rep.ratio(rows, 16, "ncclavg", "best MPI") is None


def test_the_result_files_are_named_by_machine_date_and_tag(bench, tmp_path):
    args = bench.parser().parse_args(["--tag", "loaded", "--out-dir", str(tmp_path)])
    md, js = bench.result_paths(args, {"cpu": "AMD EPYC 7B13 64-Core Processor", "cores": 2, "date": "2026-12-06"})
    assert md.name == "hosts-amd-epyc-7b13-64-core-processor-2c-2026-12-06-loaded.md"
    assert js == md.with_suffix(".json")


# ---------------------------------------------------------------------------------- what it launches
def test_each_local_rank_can_be_told_its_nic(worker):
    names = ["nvbhn0", "nvbhn1"]
    assert [worker.gloo_ifname(names, "one", r) for r in range(3)] == ["nvbhn0"] * 3
    assert [worker.gloo_ifname(names, "per-rank", r) for r in range(3)] == ["nvbhn0", "nvbhn1", "nvbhn0"]
    assert worker.gloo_ifname(names, "all", 1) == "nvbhn0,nvbhn1"
    with pytest.raises(ValueError, match="nic_use"):
        worker.gloo_ifname(names, "some", 0)


def test_the_worker_accepts_what_the_launcher_passes(bench, worker, tmp_path):
    args = bench.parser().parse_args(["--sizes", "4K,8", "--calls", "3", "--nics", "2", "--nic-use", "per-rank",
                                      "--collective", "broadcast"])
    bench.check(args)
    net = bench.net_mod.Network(2, bench.net_mod.Link(100, 1), nics=2)
    for c in ("gloo", "mpi-tcp"):
        got = worker.parse(bench.launch.worker_args(c, args, net, tmp_path / "r.json"))
        assert got.contender == c and got.sizes == [4096, 8] and got.calls == 3 and got.collective == "broadcast"
        assert got.ifnames == ["nvbhn0", "nvbhn1"] and got.nic_use == "per-rank"
        assert got.hostnames == [h.hostname for h in net.hosts]


class BusySide:
    """A stand-in for a contender in measure(): its call burns CPU, its sync does not; not local rank 0,
    so no NIC is read."""
    rank, local_rank, world = 1, 1, 2

    def buffer(self, n):
        return [0.0] * n

    def op(self, x):
        t0 = time.process_time()
        while time.process_time() - t0 < 0.005:
            pass

    def sync(self):
        pass

    def check(self, n):
        return 0


def test_each_rank_measures_its_cpu_over_the_calls_and_over_the_syncs_alone(bench, worker):
    args = worker.parse(["--contender", "gloo", "--sizes", "8,16", "--calls", "4", "--warmup", "0",
                         "--ifnames", "nvbhn0", "--result", "unused"])
    got = worker.measure(BusySide(), args)
    for size in ("8", "16"):
        s = got[size]
        assert s["calls_cpu_s"] >= 4 * 0.005 and s["syncs_cpu_s"] < s["calls_cpu_s"]
        assert s["calls_bytes"] is None


def test_torchrun_runs_one_node_per_host_with_a_static_rendezvous(bench):
    net = bench.net_mod.Network(3, bench.net_mod.Link(100, 1))
    cmd = bench.launch.torchrun_command(net, 2, 2, 29700, ["--x"])
    assert cmd[:4] == [net.ip, "netns", "exec", net.hosts[2].netns]
    assert cmd[4:7] == [sys.executable, "-m", "torch.distributed.run"]
    flags = dict(zip(cmd[7:-1:2], cmd[8:-1:2]))
    assert flags["--nnodes"] == "3" and flags["--nproc-per-node"] == "2" and flags["--node-rank"] == "2"
    assert flags["--master-addr"] == "10.233.0.1" and flags["--master-port"] == "29700"
    assert cmd[-1] == "--x"


def test_open_mpi_reaches_the_hosts_through_the_agent_with_its_own_settings(bench, tmp_path):
    net = bench.net_mod.Network(2, bench.net_mod.Link(100, 1), nics=2)
    net.workdir = tmp_path
    venv = tmp_path / "venv"
    for variant, btl in (("mpi", "self,sm,tcp"), ("mpi-tcp", "self,tcp")):
        cmd = bench.launch.mpi_command(net, 2, venv, ["--y"], variant, (("btl_tcp_links", "2"),))
        assert cmd[:4] == [net.ip, "netns", "exec", net.hosts[0].netns]
        assert "--uts" in cmd                                           # a hostname of its own
        text = " ".join(cmd)
        assert f"--host {net.hosts[0].hostname}:2,{net.hosts[1].hostname}:2 -n 4" in text
        assert f"--prtemca plm_ssh_agent {tmp_path / 'mpi-agent.sh'}" in text
        assert f"--mca btl {btl} " in text and "--mca mpi_yield_when_idle 1" in text
        assert "--mca btl_tcp_if_include nvbhn0,nvbhn1" in text and "--bind-to none" in text
        assert "--mca btl_tcp_links 2" in text and cmd[-1] == "--y"
        assert ("--mca coll ^han" in text) == (variant == "mpi-tcp")
    agent = (tmp_path / "mpi-agent.sh").read_text()
    for h in net.hosts:
        assert f"{h.hostname}) ns={h.netns} ;;" in agent


def test_the_load_is_busy_processes_at_the_lowest_priority_named_by_the_run(bench):
    procs = bench.launch.start_load(2, "nvbh1x99")
    try:
        for p in procs:
            deadline = time.monotonic() + 30   # setpriv and nice exec the interpreter in turn
            while open(f"/proc/{p.pid}/cmdline", "rb").read().split(b"\0")[:1] != [sys.executable.encode()]:
                assert time.monotonic() < deadline, "the load process never became python"
                time.sleep(0.01)
            assert b"nvbh1x99-load" in open(f"/proc/{p.pid}/cmdline", "rb").read().split(b"\0")
            assert int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[16]) == 19   # its nice value
        assert sorted(bench.net_mod.tagged_pids("nvbh1x99")) == sorted(p.pid for p in procs)
    finally:
        bench.launch.stop_load(procs)


# ------------------------------------------------------------------------------------- end to end
@pytest.mark.slow   # ~40 s: two namespaces, three torchrun launches of two nodes each
# the all-reduce, and (slow: ~20 s each) the collectives that move slices: each result checked exactly
@pytest.mark.parametrize("collective", ["all_reduce", pytest.param("all_gather", marks=pytest.mark.slow),
                                        pytest.param("reduce_scatter", marks=pytest.mark.slow)])
def test_a_tiny_run_writes_its_table_and_json(bench, tmp_path, collective):
    try:
        bench.net_mod.preflight()
    except bench.net_mod.HostsUnavailable as e:
        pytest.skip(f"emulated hosts need network namespaces and TUN devices: {e}")
    argv = ["--shapes", "2x1", "--links", "2500:0.1", "--sizes", "4K,64K", "--calls", "3", "--warmup", "1",
            "--note", "a test's run",
            "--launches", "1", "--contenders", "gloo,ncclavg,ncclavg-api", "--ceiling-s", "0.5", "--timeout", "180",
            "--out-dir", str(tmp_path), "--tag", "test", "--collective", collective]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "hosts.py"), *argv], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    md = list(tmp_path.glob("hosts-*-test.md"))
    js = list(tmp_path.glob("hosts-*-test.json"))
    assert len(md) == 1 and len(js) == 1
    text = md[0].read_text()
    command = shlex.join(["python", "bench/hosts.py", *argv])
    assert f"Command: `{command}`" in text
    assert "| 4 KiB |" in text and "| 64 KiB |" in text and "Load: 0 busy" in text and "\na test's run\n" in text
    data = json.loads(js[0].read_text())
    assert data["command"] == command
    shape = data["shapes"][0]
    assert [ln["contender"] for ln in shape["launches"]] == ["gloo", "ncclavg", "ncclavg-api"]
    assert all(ln.get("result") for ln in shape["launches"]), [ln.get("error") for ln in shape["launches"]]
    for row in shape["rows"]:
        assert row["median_s"] > 0 and row["calls"] == 3 and row["wrong"] == 0
        # each host sent at least its share over its NIC per call: S for 2 hosts (an all-reduce), S / 2 (the
        # other host's half of an all-gather or reduce-scatter)
        share = row["size"] if collective == "all_reduce" else row["size"] // 2
        assert row["wire_bytes_per_op"] >= share, row
        assert row["cpu_s_per_op"] is not None, row
    assert shape["measured"]["tcp_one_way_mbit"] > 0 and shape["measured"]["rtt_ms"]["min"] >= 0.2
    assert data["load"]["busy"] == 0 and len(data["load"]["start"]) == 3
    assert bench.net_mod.leftovers() == []


@pytest.mark.slow   # ~15 s: a run interrupted while its first launch runs
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_removes_everything_it_made(bench, tmp_path, sig):
    hn = bench.net_mod
    try:
        hn.preflight()
    except hn.HostsUnavailable as e:
        pytest.skip(f"emulated hosts need network namespaces and TUN devices: {e}")
    run = subprocess.Popen([sys.executable, str(ROOT / "bench" / "hosts.py"), "--shapes", "2x1", "--links", "100:1",
                            "--sizes", "32M", "--calls", "50", "--launches", "1", "--contenders", "gloo", "--load", "1",
                            "--ceiling-s", "0.2", "--out-dir", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"{hn.PREFIX}{run.pid}x"
    try:
        deadline = time.monotonic() + 120
        while not any(any("hosts_worker.py" in a for a in argv) and any(prefix in a for a in argv)
                      for argv in hn._cmdlines().values()):   # a rank of the run (its --result names the run)
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)   # the ranks are up and talking
        run.send_signal(sig)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130, err[-3000:]
    assert "interrupted" in err and "launch 0 gloo" not in err   # during the launch (it needs minutes)
    assert not list(tmp_path.iterdir())                                    # no result files
    assert [n for n in hn.namespaces() if n.startswith(prefix)] == []
    assert [p for p, argv in hn._cmdlines().items() if any(prefix in a for a in argv)] == []
    for base in (hn.ETC_NETNS, Path("/dev/shm"), Path("/tmp")):
        assert not base.exists() or [p for p in base.iterdir() if prefix in p.name] == []
