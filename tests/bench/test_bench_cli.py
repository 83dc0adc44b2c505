"""`ncclavg bench`: size parsing, the exact-input checker, sweeps on the local and gloo backends, the
JSON/PNG outputs and the one-line errors for bad arguments. Small sizes only: no timing assertions."""
from __future__ import annotations

import json

import pytest
import torch

from ncclavg.bench import cli as bench_cli
from ncclavg.bench import launch as bench_launch
from ncclavg.bench import sweep as bench_sweep
from ncclavg.bench.contenders import Contender, TorchStackMean
from ncclavg.bench.inputs import ExactPattern, count_wrong, fill_periodic
from ncclavg.cli import main

REQUIRED_ROW_KEYS = {"contender", "backend", "dtype", "size_bytes", "count", "n", "time_us", "algbw_gbps",
                     "busbw_gbps", "wrong"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def run_cli(argv, capsys):
    """main() in process: (exit code, stdout, stderr), whether argparse exits or main returns."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------ sizes

@pytest.mark.parametrize("text,value", [("8", 8), ("8B", 8), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20),
                                        ("1G", 1 << 30), ("256MiB", 256 << 20), ("1.5K", 1536), ("4KB", 4096)])
def test_parse_size(text, value):
    assert bench_cli.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "12Q", "-8", "1.3B", "1T", "8 bytes"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception, match="invalid size"):
        bench_cli.parse_size(text)


def test_sweep_sizes_like_nccl_tests():
    assert bench_cli.sweep_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert bench_cli.sweep_sizes(8, 100, 4) == [8, 32]            # max itself only when a step lands on it
    assert bench_cli.sweep_sizes(1024, 1024, 2) == [1024]
    assert bench_cli.sweep_sizes(8, 16, 1.5) == [8, 12]
    assert bench_cli.sweep_sizes(8, 256 << 20, 2)[-1] == 256 << 20 and len(bench_cli.sweep_sizes(8, 256 << 20, 2)) == 26


# --------------------------------------------------------------------------------- exact inputs

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 64])
def test_exact_pattern_mean_is_exact_in_any_order(dtype, n):
    p = ExactPattern(n, dtype, period=4099)
    xs = [p.inputs(r) for r in range(n)]
    ref = torch.stack(xs).double().mean(0)
    assert count_wrong(ref.to(dtype), p.expected()) == 0
    # storage-dtype accumulation, forwards and backwards, then divide: still bit-exact
    for order in (xs, xs[::-1]):
        acc = order[0].clone()
        for x in order[1:]:
            acc += x
        assert count_wrong(acc / n, p.expected()) == 0
    if n > 1:  # the participants hold different data, so a no-op "average" cannot pass
        assert count_wrong(xs[0], p.expected()) > 0.4 * p.period
        total = torch.stack(xs).double().sum(0).to(dtype)          # forgot to divide
        assert count_wrong(total, p.expected()) > 0.4 * p.period


@pytest.mark.parametrize("count", [0, 1, 7, 4098, 4099, 4100, 3 * 4099 + 17])
def test_fill_periodic_and_count_wrong(count):
    p = ExactPattern(3, torch.bfloat16, period=4099)
    base = p.expected()
    dst = torch.empty(count, dtype=torch.bfloat16)
    fill_periodic(dst, base)
    idx = torch.arange(count) % 4099
    assert torch.equal(dst.view(torch.int16), base.view(torch.int16)[idx])
    assert count_wrong(dst, base) == 0
    if count:
        bad = dst.clone()
        bad[count - 1] = float(bad[count - 1]) + 1.0                 # one element off, the very last
        assert count_wrong(bad, base) == 1
        bad[0] = float("nan")
        assert count_wrong(bad, base) == min(count, 2)


def test_count_wrong_is_bitwise():
    base = torch.tensor([0.0, 1.0, 2.0])
    assert count_wrong(torch.tensor([-0.0, 1.0, 2.0]), base) == 1      # -0.0 is not +0.0, bit for bit
    assert count_wrong(torch.tensor([0.0, 1.0, float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))]),
                       base) == 1                                       # one ulp
    with pytest.raises(TypeError, match="out"):
        count_wrong(torch.zeros(3, dtype=torch.float16), base)


# ------------------------------------------------------------------- the sweep catches a wrong contender

class SumInsteadOfMean(Contender):
    key, label = "broken_sum", "sums, forgets to divide"

    def op(self):
        total = torch.stack(self.w.tensors).sum(0)
        for t in self.w.tensors:
            t.copy_(total)


class CorruptsOneElement(Contender):
    key, label = "broken_one", "correct mean except one element of the last tower"

    def op(self):
        mean = torch.stack(self.w.tensors).double().mean(0).to(self.w.tensors[0].dtype)
        for t in self.w.tensors:
            t.copy_(mean)
        self.w.tensors[-1][-1] += 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sweep_counts_wrong_elements_of_broken_contenders(dtype):
    towers = 3
    s = bench_sweep.setup_local(towers, compare=False)
    s.contenders += [TorchStackMean(), SumInsteadOfMean(), CorruptsOneElement()]
    rows = bench_sweep.sweep(s, [8, 1000, 70000], dtype, iters=2, warmup=1, check=True, budget=0.01)
    by = {(r["contender"], r["size_bytes"]): r for r in rows}
    for size in {r["size_bytes"] for r in rows}:
        count = size // ITEMSIZE[dtype]
        assert by[("ncclavg", size)]["wrong"] == 0
        assert by[("torch_stack_mean", size)]["wrong"] == 0
        assert by[("broken_one", size)]["wrong"] == 1
        assert by[("broken_sum", size)]["wrong"] >= min(count, 2)   # nearly every element, every tower
    assert all(r["n"] == towers and r["time_us"] > 0 for r in rows)
    for c in s.contenders:
        c.close()


def test_no_check_reports_none():
    s = bench_sweep.setup_local(2, compare=False)
    rows = bench_sweep.sweep(s, [64], "float32", iters=1, warmup=0, check=False, budget=0.01)
    assert rows[0]["wrong"] is None


# ------------------------------------------------------------------------------- the CLI end to end

def _check_json(path, backend, n, dtype, contenders, sizes):
    doc = json.loads(path.read_text())
    header = doc["header"]
    for key in ("machine", "versions", "arguments", "date"):
        assert key in header
    assert header["machine"]["cpu"] and header["versions"]["torch"]
    assert header["arguments"]["backend"] == backend and header["n"] == n
    rows = doc["rows"]
    assert {r["contender"] for r in rows} == set(contenders)
    assert sorted({r["size_bytes"] for r in rows}) == sizes
    for r in rows:
        assert REQUIRED_ROW_KEYS <= set(r)
        assert r["backend"] == backend and r["dtype"] == dtype and r["n"] == n
        assert r["wrong"] == 0, r
        assert r["count"] * ITEMSIZE[dtype] == r["size_bytes"]
        assert r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n)
    assert doc["summary"]["wrong_total"] == 0
    return doc


def test_cli_local_compare_writes_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (in the test extra)")
    js, png = tmp_path / "local.json", tmp_path / "local.png"
    rc, out, err = run_cli(["bench", "--backend", "local", "--towers", "3", "--compare", "-b", "8", "-e", "64K",
                            "-f", "8", "-n", "3", "-w", "1", "--budget", "0.02", "--json", str(js),
                            "--plot", str(png)], capsys)
    assert rc == 0, err
    _check_json(js, "local", 3, "float32", {"ncclavg", "torch_stack_mean", "torch_add_loop", "copy"},
                [8, 64, 512, 4096, 32768])
    lines = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 5                                   # one table row per size
    assert lines[0].split()[:4] == ["8", "2", "float32", "avg"]
    assert "#wrong" in out and "busbw" in out and "torch stack.mean" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_local_half_precision(tmp_path, capsys):
    js = tmp_path / "bf16.json"
    rc, out, err = run_cli(["bench", "--towers", "5", "-d", "bf16", "-b", "6K", "-e", "6K", "-n", "2",
                            "--budget", "0.02", "--json", str(js)], capsys)
    assert rc == 0, err
    _check_json(js, "local", 5, "bfloat16", {"ncclavg"}, [6144])


def test_cli_gloo_two_ranks(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (in the test extra)")
    js, png = tmp_path / "gloo.json", tmp_path / "gloo.png"
    rc, out, err = run_cli(["bench", "--backend", "gloo", "--nproc", "2", "--compare", "-b", "8", "-e", "32K",
                            "-f", "64", "-n", "3", "-w", "1", "--budget", "0.02", "--timeout", "60",
                            "--json", str(js), "--plot", str(png)], capsys)
    assert rc == 0, err
    doc = _check_json(js, "gloo", 2, "float32", {"ncclavg", "torch_dist", "copy"}, [8, 512, 32768])
    assert doc["header"]["world_size"] == 2 and doc["header"]["launcher"].startswith("spawned")
    assert png.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("argv", [
    ["-b", "1M", "-e", "1K"],                        # min > max
    ["-f", "1"], ["-f", "0.5"], ["-f", "two"],       # factor <= 1
    ["--backend", "mpi"],                            # unknown backend
    ["--backend", "gloo", "--nproc", "0"],
    ["--towers", "0"],
    ["-b", "4"], ["-e", "2G"], ["-b", "12Q"],        # sizes beyond limits / unparsable
    ["-d", "int8"],
    ["-n", "0"], ["-w", "-1"],
    ["--backend", "gloo", "--towers", "2"],
    ["--backend", "local", "--nproc", "2"],
    ["--no-such-option"],
    ["--budget", "0"],
])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    rc, out, err = run_cli(["bench", *argv], capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("ncclavg bench: error: ") and err.count("\n") == 1, err


def test_nccl_without_cuda_is_a_one_line_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the nccl backend would run")
    rc, out, err = run_cli(["bench", "--backend", "nccl", "-e", "1K"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "CUDA" in err


def test_launch_detection_and_nproc_mismatch(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert bench_launch.launched() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert bench_launch.launched() == {"rank": 1, "world_size": 4, "local_rank": 1}
    rc, out, err = run_cli(["bench", "--backend", "gloo", "--nproc", "2"], capsys)
    assert rc == 2 and "WORLD_SIZE" in err and err.count("\n") == 1


def test_free_port_is_below_the_ephemeral_range_and_binds(monkeypatch):
    # A port from the ephemeral range can be taken by any outgoing connection (another job's gloo pairs)
    # between the pick and the rank's bind; one below it only by an explicit bind.
    import socket

    low = bench_launch._ephemeral_low()
    for _ in range(20):
        port = bench_launch.free_port()
        assert 1024 <= port < low or low - max(10000, low - 20000) < 1000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # held ports are skipped: with the room below the range shrunk to one port that is taken, the OS picks
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(bench_launch, "_ephemeral_low", lambda: 10000 + 1000)
        monkeypatch.setattr(bench_launch.random.SystemRandom, "randrange", lambda self, a, b: taken)
        assert bench_launch.free_port() not in (taken, 0)


# --------------------------------------------------- several processes: every timed batch starts together

class Logged(Contender):
    """Leaves its buffers as they are (one participant: the mean is the input) and logs each run."""

    def __init__(self, key, log):
        self.key, self.label, self.log = key, key, log

    def op(self):
        self.log.append(self.key)


def test_several_processes_start_every_timed_batch_together():
    # See Note [Bench timing]: with several processes, a contender timed while a peer still finishes
    # the previous one reads that wait (an 8-byte copy read 41-69 us instead of 1.5 us). Every batch of
    # the timed rounds must follow a barrier and hold one contender's runs only.
    log = []
    ranks = bench_sweep.Ranks()
    ranks.group = object()   # pretend several processes; the reductions over one rank are the identity
    ranks.max = lambda values: list(values)
    ranks.sum = lambda value: value
    ranks.barrier = lambda: log.append("barrier")
    ranks.tight = lambda: log.append("sync")
    s = bench_sweep.Setup("gloo", [torch.device("cpu")], 1, 0, [Logged("a", log), Logged("b", log)], ranks,
                          bench_sweep._no_sync)
    bench_sweep.sweep(s, [64], "float32", iters=20, warmup=2, check=True, budget=0.01)
    batches = "".join("|" if e == "sync" else e[0] for e in log if e != "barrier").split("|")[1:]
    assert batches and all(len(set(b)) == 1 for b in batches), batches   # never two contenders in one batch
    assert {b[0] for b in batches} == {"a", "b"}
