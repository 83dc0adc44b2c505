"""Crash safety of checkpoints: SIGKILL at random points of save(), and damaged files (truncated,
bit-flipped) that must be refused with an error naming the file and the check that failed."""
import json
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
from _paths import ROOT, TESTS
from torch import nn

from ncclavg import TowerTrainer
from ncclavg.train import checkpoint as ckpt


@pytest.mark.slow   # ~4 s
def test_sigkill_during_save_keeps_the_newest_complete_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(TESTS / "_ckpt_kill_worker.py"), str(tmp_path), "7", "20"],
                          capture_output=True, text=True, timeout=150, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["errors"] == [], res["errors"]
    trials = res["trials"]
    assert len(trials) == 20 and all(t["killed"] for t in trials), trials
    # most kills land between a save's start and its return (the rest just after it)
    inside = sum(t["inside_save"] for t in trials)
    assert inside >= 5, (inside, trials)
    seen_complete = False
    for t in trials:
        if t["latest"] is None:   # only possible before the first save ever completed
            assert not seen_complete, t
            continue
        seen_complete = True
        assert t["matches_reference"] is True, t   # the checkpoint holds the reference run's weights
    assert seen_complete
    final = res["final"]
    assert final["end"] == 120 and final["start"] > 0 and final["mismatched_steps"] == [], final
    assert res["temps_left"] == [], res["temps_left"]   # crashed saves' temp files were cleaned up
    assert res["files_left"] == ["ckpt-000000110.ckpt", "ckpt-000000120.ckpt"], res["files_left"]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _trained(tmp_path):
    torch.manual_seed(0)
    tr = TowerTrainer(Small(), devices=["cpu", "cpu"], lr=1e-2, concurrent=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        tr.train_step((torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)))
    return tr, tr.save(str(tmp_path / "good.ckpt"))


def _damages(size, rng):
    """(name, function bytes -> bytes, expected check): every header field, and the payload."""
    out = [("empty", lambda d: b"", "header")]
    for cut in sorted({1, 7, 8, 12, 20, 51} | {rng.randrange(1, 52) for _ in range(3)}):
        out.append((f"truncated to {cut} bytes", lambda d, c=cut: d[:c], "header"))
    for cut in sorted({52, size - 1} | {rng.randrange(53, size - 1) for _ in range(5)}):
        out.append((f"truncated to {cut} bytes", lambda d, c=cut: d[:c], "length"))
    fields = [("magic", 0, 8, "magic"), ("version", 8, 12, "version"), ("length", 12, 20, "length"),
              ("checksum", 20, 52, "checksum"), ("payload", 52, size, "checksum")]
    for field, lo, hi, check in fields:
        for _ in range(3 if field == "payload" else 1):
            pos, bit = rng.randrange(lo, hi), rng.randrange(8)
            out.append((f"bit {bit} of byte {pos} ({field}) flipped",
                        lambda d, p=pos, b=bit: d[:p] + bytes([d[p] ^ (1 << b)]) + d[p + 1:], check))
    return out


def test_damaged_checkpoints_are_refused_naming_file_and_check(tmp_path):
    tr, good = _trained(tmp_path)
    data = open(good, "rb").read()
    before = [p.detach().clone() for p in tr.master_params()]
    rng = random.Random(3)
    damages = _damages(len(data), rng)
    assert len(damages) >= 20
    for name, damage, check in damages:
        path = str(tmp_path / "bad.ckpt")
        with open(path, "wb") as f:
            f.write(damage(data))
        model = Small()
        snap = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ckpt.CheckpointError) as ei:
            TowerTrainer.load(path, model)
        assert ei.value.check == check and ei.value.path == path, (name, str(ei.value))
        assert path in str(ei.value) and f"{check} check failed" in str(ei.value), (name, str(ei.value))
        assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters())), name   # untouched
        with pytest.raises(ckpt.CheckpointError, match=f"{check} check failed"):
            tr.restore(path)
        assert all(torch.equal(a, b) for a, b in zip(before, tr.master_params())), name
    tr.close()


def test_directory_with_a_damaged_newest_checkpoint_falls_back(tmp_path):
    tr, _ = _trained(tmp_path)
    manager = ckpt.CheckpointManager(tmp_path / "dir", keep=3)
    tr.save("", _manager=manager)
    older = [p.detach().clone() for p in tr.master_params()]
    tr.train_step((torch.randn(8, 6), torch.randint(0, 3, (8,))))
    newest = tr.save("", _manager=manager)
    with open(newest, "r+b") as f:     # cut short: the header promises more than the file holds
        f.truncate(os.path.getsize(newest) // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = TowerTrainer.load(str(tmp_path / "dir"), Small())
    assert any(newest in str(w.message) and "length check failed" in str(w.message) for w in caught), caught
    assert resumed.step == 2
    assert all(torch.equal(a, b) for a, b in zip(older, resumed.master_params()))
    tr.close()
    resumed.close()
