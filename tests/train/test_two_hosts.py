"""`ncclavg train` on two hosts for real: two network namespaces joined by a veth pair, one torchrun node
in each (Note [Two hosts from network namespaces] in tests/_netns.py), 2 CPU towers per node. The run
takes the steps of one process with 4 towers (Note [Towers of several processes]), and losing the second
host ends the first with an error within the communicators' timeout."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from _netns import two_hosts_fixture
from _paths import ROOT
from _training_reference import rel_distance

from ncclavg.train import checkpoint as ckpt

SUMMARY = re.compile(r"^summary: test_accuracy=\d\.\d{3} epochs=(?P<epochs>\d+) samples_per_s=\S+ wall_s=\S+ "
                     r"processes=(?P<processes>\d+) towers=(?P<towers>\d+) devices=(?P<devices>\S+)$", re.M)
COMMON = ["--model", "mlp", "--batch-size", "48", "--lr-schedule", "constant", "--no-progress"]
STEPS = 60   # 2 epochs of the 1438 digits training samples in batches of 48
RUN_TIMEOUT_S = 180   # a bound for a hang, far above the seconds a run takes


@pytest.fixture
def hosts():
    yield from two_hosts_fixture()


def base_env(timeout_s):
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                NCCLAVG_TIMEOUT=str(timeout_s), PYTHONUNBUFFERED="1")


def train_cmd(*args):
    return ["-m", "ncclavg", "train", *COMMON, *args]


def single_processes(runs, cwd):
    """`python -m ncclavg train` once per argument list of `runs`, all at once (each run is deterministic,
    whatever else the machine does); returns their outputs."""
    procs = [subprocess.Popen([sys.executable, *train_cmd(*args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=cwd, env=base_env(120)) for args in runs]
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
    finally:
        stop(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def master_of(directory):
    return ckpt.load(ckpt.resolve(str(directory)))["master"]["params"]


class Output:
    """The merged stdout and stderr of a process, read as they come (so the pipe never fills)."""

    def __init__(self, proc, marker=None):
        self.lines: list[str] = []
        self.seen = threading.Event()   # set once a line holds `marker`
        self._thread = threading.Thread(target=self._read, args=(proc.stdout, marker), daemon=True)
        self._thread.start()

    def _read(self, stream, marker):
        for line in stream:
            self.lines.append(line)
            if marker is not None and marker in line:
                self.seen.set()

    def text(self, join_s=10.0):
        self._thread.join(join_s)   # the process has exited: read to the end of its output
        return "".join(self.lines)


def start_nodes(hosts, args, cwds, timeout_s, marker=None, nproc=1):
    """Node 1, then node 0, of a two-node torchrun job running `python -m ncclavg train args`."""
    procs, outs = [None, None], [None, None]
    for k in (1, 0):
        procs[k] = subprocess.Popen(hosts.torchrun(k, *train_cmd(*args), nproc=nproc), cwd=cwds[k],
                                    env=hosts.env(k, base_env(timeout_s)), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        outs[k] = Output(procs[k], marker if k == 0 else None)
    return procs, outs


def stop(procs):
    for p in procs:
        if p is not None:
            p.kill()
            p.wait()


# 2 hosts x 1 process x 2 towers: UCX's lanes between the processes ("ucx"); 2 hosts x 2 processes x 1
# tower: a shared-memory channel within each host, UCX's lanes between the hosts ("shm+ucx", Note [Lanes
# between hosts] in csrc/transport/host_lanes.cpp); gloo's lanes in the second case with NCCLAVG_UCX=0
# ("shm+gloo"). Either way 4 towers in all.
@pytest.mark.slow   # ~15 s each: two network namespaces, a torchrun node in each
@pytest.mark.parametrize("nproc,towers,transport", [(1, "2", "ucx"), (2, "1", "shm+ucx"), (2, "1", "shm+gloo")])
def test_two_hosts_take_the_steps_of_one_process_of_four(hosts, tmp_path, nproc, towers, transport, monkeypatch):
    if transport == "shm+gloo":
        monkeypatch.setenv("NCCLAVG_UCX", "0")
    # Each host runs in a folder of its own (its disk): rank 0 alone writes the checkpoints.
    cwds = [tmp_path / f"host{k}" for k in (0, 1)]
    for d in cwds:
        d.mkdir()
    procs, outs = start_nodes(hosts, ["--epochs", "2", "--towers", towers, "--checkpoint-dir", "ck"], cwds, 120,
                              nproc=nproc)
    try:
        rcs = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        stop(procs)
    out0, out1 = (o.text() for o in outs)
    assert rcs == [0, 0], f"host 0 (exit {rcs[0]}):\n{out0[-4000:]}\nhost 1 (exit {rcs[1]}):\n{out1[-4000:]}"
    sums = SUMMARY.findall(out0)
    assert len(sums) == 1 and not SUMMARY.search(out1), out0 + out1   # rank 0 alone prints
    processes = str(2 * nproc)
    assert sums[0] == ("2", processes, "4", ",".join(["cpu"] * int(towers)))
    assert f"towers: 4 in {processes} processes" in out0 and f"{transport} between them" in out0, out0
    assert len(os.listdir(cwds[0] / "ck")) == 2   # one checkpoint per epoch, by rank 0 only
    assert not (cwds[1] / "ck").exists() or not os.listdir(cwds[1] / "ck")
    got = master_of(cwds[0] / "ck")

    # The gradients crossed the wire: per step, each host receives at least the half of the gradient
    # bucket that the other host reduced (fp32), whatever gloo's algorithm.
    params = sum(p.numel() for p in got)
    for k in (0, 1):
        assert hosts.rx_bytes(k) >= STEPS * params * 4 // 2, f"host {k} received too little over the veth"

    # Two hosts add the towers' gradients in another order than one process with 4 towers: the result is
    # as far from it as one process with 2 or 3 towers (another split of the batch, equally valid) is:
    # the noise floor measured here, two floors allowed (Note [Tolerance of training equivalence tests]).
    single_processes([["--epochs", "2", "--towers", t, "--checkpoint-dir", f"one{t}"] for t in ("4", "2", "3")],
                     cwd=tmp_path)
    want = master_of(tmp_path / "one4")
    floor = max(2.0 ** -23, *(rel_distance(master_of(tmp_path / f"one{t}"), want) for t in (2, 3)))
    dist = rel_distance(got, want)
    assert dist <= 2 * floor, f"relative distance {dist:.3e} > 2 x the noise floor {floor:.3e}"


@pytest.mark.slow
def test_losing_the_second_host_ends_the_first_with_an_error_within_the_timeout(hosts, tmp_path):
    timeout_s = 10   # NCCLAVG_TIMEOUT: the communicators' bound on any collective
    # Host 0's worker learns of the loss at its next collective: at once when the kernel resets the dead
    # worker's connections, at the latest when the timeout expires. Naming the lost rank then takes at
    # most DIAGNOSE_S (2 s, ncclavg/transport/liveness.py) and torchrun notices its worker's exit within a
    # second; 15 s more cover those and a busy 2-core machine. A hang would last until RUN_TIMEOUT_S.
    bound_s = timeout_s + 15
    cwds = [tmp_path, tmp_path]
    procs, outs = start_nodes(hosts, ["--epochs", "50", "--towers", "2"], cwds, timeout_s, marker="epoch 1/50")
    try:
        assert outs[0].seen.wait(RUN_TIMEOUT_S), "host 0 never finished an epoch:\n" + outs[0].text(0)[-4000:]
        assert procs[0].poll() is None and procs[1].poll() is None, outs[0].text(0)[-4000:]
        # Host 1 goes away: every process in its namespace is killed, its torchrun agent first (so that it
        # cannot react to its worker's death), then its worker.
        t_kill = time.monotonic()
        procs[1].kill()
        killed = hosts.kill_all(1)
        assert any(pid != procs[1].pid for pid in killed), "host 1 had no worker to kill"
        try:
            rc0 = procs[0].wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            rc0 = None
        elapsed = time.monotonic() - t_kill
    finally:
        stop(procs)
    out0 = outs[0].text()
    assert rc0 is not None, f"host 0 still ran {elapsed:.1f} s after host 1 was lost:\n{out0[-4000:]}"
    assert rc0 != 0, out0[-4000:]
    assert elapsed <= bound_s, f"host 0 took {elapsed:.1f} s to fail:\n{out0[-4000:]}"
    # the worker's error, through torchrun's output: which collective failed and which rank was lost
    assert re.search(r"(CommError|CommTimeoutError): .*rank 1 stopped responding", out0), out0[-4000:]
    assert "summary:" not in out0


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
def test_hosts_that_find_different_checkpoints_refuse_to_start(hosts, tmp_path):
    """No shared file system: each host's `ck` holds another run's checkpoint (host 0 one after epoch 2,
    host 1 one after epoch 1). Resuming from them would train on with two optimizer states; every
    process refuses instead (check_same_start in ncclavg/train/distributed.py), naming what each found."""
    cwds = [tmp_path / f"host{k}" for k in (0, 1)]
    for d, epochs in zip(cwds, ("2", "1")):
        d.mkdir()
        single_processes([["--epochs", epochs, "--towers", "1", "--checkpoint-dir", "ck"]], cwd=d)
    procs, outs = start_nodes(hosts, ["--epochs", "3", "--towers", "1", "--resume", "ck"], cwds, 60)
    try:
        rcs = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        stop(procs)
    out0, out1 = (o.text() for o in outs)
    assert rcs[0] != 0 and rcs[1] != 0, (rcs, out0[-3000:], out1[-3000:])
    for out in (out0, out1):
        assert re.search(r"the processes would start from different points \(rank 0: step 60 from \S+; "
                         r"rank 1: step 30 from \S+\)", out), out[-3000:]
        assert "epoch 3/3" not in out
