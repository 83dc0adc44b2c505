"""Checkpoint files: atomic write, checksum, errors that name the file and the failed check."""
import os

import pytest
import torch

from ncclavg.train import checkpoint as ckpt


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(100, generator=g), "step": 7, "nested": {"lr": 0.1, "t": (1, 2)}}


def test_round_trip(tmp_path):
    path = ckpt.save(tmp_path / "a.ckpt", _state())
    out = ckpt.load(path)
    assert torch.equal(out["w"], _state()["w"]) and out["step"] == 7 and out["nested"]["t"] == (1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temp file left behind


@pytest.mark.parametrize("damage,check", [
    (lambda d: d[:-10], "length"),
    (lambda d: d[:20], "header"),
    (lambda d: d + b"junk", "length"),
    (lambda d: d[:60] + bytes([d[60] ^ 0x01]) + d[61:], "checksum"),
    (lambda d: b"XXXXXXXX" + d[8:], "magic"),
])
def test_damaged_files_raise_naming_file_and_check(tmp_path, damage, check):
    path = ckpt.save(tmp_path / "a.ckpt", _state())
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    with pytest.raises(ckpt.CheckpointError) as ei:
        ckpt.load(path)
    assert ei.value.check == check
    assert str(path) in str(ei.value) and check in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_missing_file_and_missing_directory(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="exists"):
        ckpt.load(tmp_path / "nope.ckpt")
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.save(tmp_path / "no" / "dir.ckpt", _state())
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_previous_file_and_leaves_no_temp(tmp_path):
    path = ckpt.save(tmp_path / "a.ckpt", {"v": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        ckpt.save(path, {"v": Unpicklable()})
    assert ckpt.load(path)["v"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]


def test_manager_keeps_newest_and_skips_corrupt(tmp_path):
    m = ckpt.CheckpointManager(tmp_path / "run", keep=2)
    assert m.latest() is None and not (tmp_path / "run").exists()
    for step in (10, 20, 30):
        m.save({"step": step}, step)
    assert [s for s, _ in m.list()] == [20, 30]
    assert m.latest() == m.path_for(30)
    # Corrupt the newest: latest() falls back to the previous complete one.
    data = open(m.path_for(30), "rb").read()
    open(m.path_for(30), "wb").write(data[:-1])
    with pytest.warns(RuntimeWarning, match="checksum|length"):
        assert m.latest() == m.path_for(20)
    with pytest.warns(RuntimeWarning):
        assert ckpt.resolve(tmp_path / "run") == m.path_for(20)
    with pytest.raises(ckpt.CheckpointError, match="exists"):
        ckpt.resolve(tmp_path / "empty-and-missing")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ckpt.CheckpointError, match="no complete"):
        ckpt.resolve(tmp_path / "empty")


def test_two_runs_with_one_seed_record_the_same_rng_states(tmp_path):
    """The RNG states a checkpoint records come from the run's seed, not from whatever numpy's and
    Python's global generators held before (unseeded, they differ from process to process)."""
    import random

    import numpy as np

    import ncclavg
    from ncclavg.train.data import TensorLoader, load_digits
    from ncclavg.train.models import build_model

    d = load_digits()
    states = []
    for k, path in enumerate((tmp_path / "a.ckpt", tmp_path / "b.ckpt")):
        np.random.seed(1000 + k)   # what earlier code left in the global generators, different each time
        random.seed(2000 + k)
        tr = ncclavg.TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], lr=3e-3, seed=7)
        tr.fit(TensorLoader(d.x_train[:128], d.y_train[:128], batch_size=64, seed=1), epochs=1)
        tr.save(str(path))
        states.append(ckpt.load(str(path))["rng"])
    a, b = states
    assert torch.equal(a["torch"], b["torch"])
    assert a["numpy"][0] == b["numpy"][0] and torch.equal(a["numpy"][1], b["numpy"][1]) and a["numpy"][2:] == b["numpy"][2:]
    assert tuple(a["python"][1]) == tuple(b["python"][1])
