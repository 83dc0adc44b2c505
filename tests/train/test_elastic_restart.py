"""Elastic restart (Note [Elastic restart] in ncclavg/train/cli.py): under `torchrun --max-restarts 1`
a worker killed mid-run makes the group restart from the newest complete checkpoint, and the run ends
with the weights of an uninterrupted one, bit for bit (CPU towers)."""
import os
import subprocess
import sys

import pytest
import torch
from _paths import ROOT, TESTS

from ncclavg.train import checkpoint as ckpt

# digits MLP, batch 48: 30 steps per epoch; the kill falls in epoch 3, after the epoch-2 checkpoint
ARGS = ["--model", "mlp", "--batch-size", "48", "--epochs", "4", "--towers", "2", "--no-progress",
        "--checkpoint-dir", "ck"]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
               NCCLAVG_TIMEOUT="60", **extra)
    return env


def _torchrun(cwd, *launcher, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *launcher,
           str(TESTS / "_elastic_train.py"), *ARGS]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=400)


@pytest.mark.slow
def test_killed_worker_restarts_from_checkpoint_bit_for_bit(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r = _torchrun(tmp_path / "a", "--max-restarts", "1",
                  env=_env(ELASTIC_VICTIM_RANK="1", ELASTIC_KILL_STEP="75"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "after torchrun restart 1" in out and "(step 60, epoch 2)" in out, out[-6000:]
    assert out.count("summary: ") == 1
    ref = _torchrun(tmp_path / "b", env=_env(ELASTIC_VICTIM_RANK="none", ELASTIC_KILL_STEP="0"))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    got = ckpt.load(ckpt.resolve(str(tmp_path / "a" / "ck")))
    want = ckpt.load(ckpt.resolve(str(tmp_path / "b" / "ck")))
    assert got["step"] == want["step"] == 120
    assert all(torch.equal(g, w) for g, w in zip(got["master"]["params"], want["master"]["params"]))


def test_restart_without_a_checkpoint_dir_starts_afresh(tmp_path, monkeypatch):
    """The restart rule itself: no --checkpoint-dir, or an empty one, or no restart -> nothing to resume."""
    import argparse

    from ncclavg.train.cli import _elastic_resume

    args = argparse.Namespace(checkpoint_dir=None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _elastic_resume(args) is None
    args.checkpoint_dir = str(tmp_path / "missing")
    assert _elastic_resume(args) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    args.checkpoint_dir = str(tmp_path)
    ckpt.save(str(tmp_path / "ckpt-000000005.ckpt"), {"x": 1})
    assert _elastic_resume(args) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert _elastic_resume(args) == str(tmp_path / "ckpt-000000005.ckpt")
