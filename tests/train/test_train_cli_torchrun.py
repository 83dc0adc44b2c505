"""`ncclavg train` under torchrun (Note [Towers of several processes]): one summary from rank 0 counting
every process's towers, checkpoints written once, and resume onto another shape of processes x towers."""
import os
import re
import subprocess
import sys

import pytest
import torch
from _paths import ROOT
from _training_reference import rel_distance

from ncclavg.train import checkpoint as ckpt

SUMMARY = re.compile(r"^summary: test_accuracy=(?P<acc>\d\.\d{3}) epochs=(?P<epochs>\d+) samples_per_s=\S+ "
                     r"wall_s=\S+ processes=(?P<processes>\d+) towers=(?P<towers>\d+) devices=(?P<devices>\S+)$",
                     re.M)


def torchrun(nproc, *args, cwd, timeout=300):
    """`torchrun --standalone --nproc_per_node nproc -m ncclavg train ...` with this interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCLAVG_TIMEOUT="120")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "ncclavg", "train", "--no-progress", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def single(*args, cwd, timeout=300):
    cmd = [sys.executable, "-m", "ncclavg", "train", "--no-progress", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def master_of(directory):
    path = ckpt.resolve(str(directory))
    master = ckpt.load(path)["master"]
    if "sharded" in master:   # a set of parts: Note [Sharded checkpoints]
        from ncclavg.train.sharded import assemble_master

        master = assemble_master(master["sharded"], path)
    return master["params"]


@pytest.mark.slow   # ~6 s: torchrun and two trainers
def test_two_processes_of_two_towers_print_once_and_learn(tmp_path):
    out = torchrun(2, "--towers", "2", "--checkpoint-dir", "ck", "--metrics", "m.jsonl", cwd=tmp_path)
    sums = SUMMARY.findall(out)
    assert len(sums) == 1, out   # rank 0 alone prints
    acc, epochs, processes, towers, devices = sums[0]
    assert (processes, towers, devices) == ("2", "4", "cpu,cpu")
    assert float(acc) >= 0.95   # the single-process default reaches it too (tests/train/test_train_cli.py)
    assert out.count("epoch 1/10") == 1 and "towers: 4 in 2 processes (cpu,cpu on rank 0, shm between them)" in out
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-000000207.ckpt", "ckpt-000000230.ckpt"]
    assert (tmp_path / "m.jsonl").exists()


@pytest.mark.slow
def test_resume_onto_other_shapes_and_back(tmp_path):
    """1 x 4 for two epochs, then 2 x 2 and 4 x 1 from that checkpoint, and 1 x 4 again from the 2 x 2
    one: every run continues at the step reached. The same shape resumed is bit for bit the uninterrupted
    run. Another shape sums the gradients in another order, so it is as far from the uninterrupted run as
    one process with 2 or 3 towers resumed from the same checkpoint (another split, equally valid): the
    noise floor measured here; two floors allowed (Note [Tolerance of training equivalence tests])."""
    common = ["--model", "mlp", "--batch-size", "48", "--lr-schedule", "constant"]
    single("--epochs", "2", "--towers", "4", "--checkpoint-dir", "a", *common, cwd=tmp_path)
    full = tmp_path / "full"
    single("--epochs", "3", "--towers", "4", "--checkpoint-dir", str(full), *common, cwd=tmp_path)

    out = torchrun(2, "--epochs", "3", "--towers", "2", "--resume", "a", "--checkpoint-dir", "b", *common,
                   cwd=tmp_path)
    assert "(step 60, epoch 2)" in out and SUMMARY.findall(out)[0][2:4] == ("2", "4")
    out = torchrun(4, "--epochs", "3", "--towers", "1", "--resume", "a", "--checkpoint-dir", "c", *common,
                   cwd=tmp_path)
    assert SUMMARY.findall(out)[0][2:4] == ("4", "4")
    out = single("--epochs", "4", "--towers", "4", "--resume", "b", "--checkpoint-dir", "d", *common,
                 cwd=tmp_path)
    assert "(step 90, epoch 3)" in out and SUMMARY.findall(out)[0][1] == "4"

    want = master_of(full)
    for towers in ("2", "3"):
        single("--epochs", "3", "--towers", towers, "--resume", "a", "--checkpoint-dir", f"floor{towers}",
               *common, cwd=tmp_path)
    floor = max(2.0 ** -23, *(rel_distance(master_of(tmp_path / f"floor{t}"), want) for t in (2, 3)))
    for shape in ("b", "c"):
        dist = rel_distance(master_of(tmp_path / shape), want)
        assert dist <= 2 * floor, f"{shape}: relative distance {dist:.3e} > 2 x the noise floor {floor:.3e}"
    # the same shape resumed: bit for bit
    single("--epochs", "3", "--towers", "4", "--resume", "a", "--checkpoint-dir", "e", *common, cwd=tmp_path)
    assert all(torch.equal(g, w) for g, w in zip(master_of(tmp_path / "e"), want))


@pytest.mark.slow   # ~6 s: a torchrun launch of two processes
def test_batch_smaller_than_all_towers_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "ncclavg", "train", "--towers", "2", "--batch-size", "3", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode != 0
    assert "--batch-size: 3 is smaller than the number of towers of all processes (4)" in r.stdout + r.stderr


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
def test_shard_master_run_matches_unsharded_and_resumes(tmp_path):
    """--shard-master (Note [Sharded CPU master]) says so in the header and takes the unsharded run's steps:
    its weights are as far from the unsharded 2 x 2 run as that is from 1 x 4 (another equally valid
    summation order: the noise floor, measured here; two floors allowed). Its checkpoint is the portable
    unsharded one: a single process resumes it."""
    common = ["--model", "mlp", "--batch-size", "48", "--epochs", "2"]
    out = torchrun(2, "--towers", "2", "--shard-master", "--checkpoint-dir", "s", "--keep", "1", *common,
                   cwd=tmp_path)
    assert "master=cpu sharded over 2 processes" in out
    # Note [Sharded checkpoints]: one part per process next to the checkpoint; older sets pruned whole
    assert sorted(os.listdir(tmp_path / "s")) == ["ckpt-000000060.ckpt", "ckpt-000000060.ckpt.part0-of-2",
                                                  "ckpt-000000060.ckpt.part1-of-2"]
    torchrun(2, "--towers", "2", "--checkpoint-dir", "u", *common, cwd=tmp_path)
    single("--towers", "4", "--checkpoint-dir", "one", *common, cwd=tmp_path)
    floor = max(2.0 ** -23, rel_distance(master_of(tmp_path / "u"), master_of(tmp_path / "one")))
    dist = rel_distance(master_of(tmp_path / "s"), master_of(tmp_path / "u"))
    assert dist <= 2 * floor, f"relative distance {dist:.3e} > 2 x the noise floor {floor:.3e}"
    out = single("--towers", "4", "--model", "mlp", "--batch-size", "48", "--epochs", "3", "--resume", "s",
                 cwd=tmp_path)
    assert "(step 60, epoch 2)" in out and SUMMARY.findall(out)[0][1] == "3"
