"""Checkpoint / resume of TowerTrainer: save at step k, load, continue to 2k == uninterrupted (bitwise)."""
import os

import pytest
import torch
from torch import nn

from ncclavg.train import checkpoint as ckpt
from ncclavg.train.callbacks import Callback, CheckpointCallback, MetricsLogger
from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.metrics import read_jsonl
from ncclavg.train.models import build_model
from ncclavg.train.towers import split_sizes
from ncclavg.train.trainer import TowerTrainer


@pytest.fixture(scope="module")
def data():
    s = load_digits()
    return s.x_train[:250], s.y_train[:250]


class StepLog(Callback):
    def __init__(self):
        self.records = []

    def on_step_end(self, trainer, record):
        self.records.append((record["step"], record["loss"], record["lr"], record.get("loss_scale")))


def _loader(data):
    return TensorLoader(*data, batch_size=32, seed=11)  # 8 batches per epoch, the last one of 26


CONFIGS = {
    "cpu_adamw_cosine": dict(master="cpu", optimizer="adamw", lr=3e-3, lr_schedule="cosine", weight_decay=0.01),
    "device_sgd_exp": dict(master="device", optimizer="sgd", lr=0.05, nesterov=True,
                           lr_schedule={"kind": "exponential", "decay_steps": 3, "decay_rate": 0.7}),
    "cpu_fp16_clip": dict(master="cpu", optimizer="adam", lr=1e-3, amp="fp16", grad_clip=1.0,
                          init_loss_scale=2.0 ** 20),
    "device_bf16": dict(master="device", optimizer="adamw", lr=2e-3, amp="bf16"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [5, 8])  # mid-epoch, and exactly at the end of epoch 1
def test_resume_is_bitwise(tmp_path, data, name, k):
    cfg = dict(devices=["cpu"] * 3, seed=7, **CONFIGS[name])
    full_log = StepLog()
    arch = "mlp" if cfg.get("amp") == "fp16" else "cnn"  # CPU fp16 convolutions are slow
    full = TowerTrainer(build_model(arch, seed=0), **cfg)
    full.fit(_loader(data), epochs=3, max_steps=2 * k, callbacks=[full_log])

    first = TowerTrainer(build_model(arch, seed=0), **cfg)
    first.fit(_loader(data), epochs=3, max_steps=k)
    path = first.save(str(tmp_path / "k.ckpt"))
    first.close()

    # A different initialisation: everything must come from the checkpoint.
    resumed_log = StepLog()
    resumed = TowerTrainer.load(path, build_model(arch, seed=123))
    assert resumed.step == k and resumed.config["master"] == cfg["master"]
    resumed.fit(_loader(data), epochs=3, max_steps=2 * k, callbacks=[resumed_log])

    assert resumed.step == full.step == 2 * k
    assert resumed_log.records == full_log.records[k:]
    for a, b in zip(full.master_params(), resumed.master_params()):
        assert torch.equal(a, b)
    for t in range(3):
        for a, b in zip(full.tower_params[t], resumed.tower_params[t]):
            assert torch.equal(a, b)
    keys = ("epoch", "step", "loss", "accuracy", "samples", "lr")  # not the timings
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
    if full.scaler is not None:
        assert full.scaler.state_dict() == resumed.scaler.state_dict()
    full.close()
    resumed.close()


def _rel_distance(got, want):
    """The largest, over parameter tensors, L2 norm of the difference over the norm of `want`."""
    return max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))


def _fp32_floor(data, steps, lr):
    """The noise floor of `steps` steps of fp32 AdamW(lr) training of the mlp on _loader(data), measured as in
    Note [Tolerance of training equivalence tests] (tests/train/test_trainer.py): the largest distance from
    the reference (batch in one slice, foreach kernel) of the same training with the batch's gradient
    accumulated over 1..4 slices x torch's loop / foreach / fused kernels; never below one fp32 ulp."""
    runs = []
    for chunks in (1, 2, 3, 4):
        for extra in ({"foreach": False}, {"foreach": True}, {"fused": True}):
            model = build_model("mlp", seed=0)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, **extra)
            for _, (x, y) in zip(range(steps), _loader(data)):   # 8 batches per epoch: steps <= 8
                opt.zero_grad()
                lo = 0
                for size in split_sizes(len(y), chunks):
                    (nn.functional.cross_entropy(model(x[lo:lo + size]), y[lo:lo + size]) * (size / len(y))).backward()
                    lo += size
                opt.step()
            runs.append([p.detach().clone() for p in model.parameters()])
    return max(2.0 ** -23, max(_rel_distance(r, runs[1]) for r in runs))


def test_resume_across_master_kinds_and_tower_counts(tmp_path, data):
    """The checkpoint format does not depend on the engine or the number of towers."""
    cfg = dict(optimizer="adamw", lr=3e-3, seed=1)
    a = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2, master="cpu", **cfg)
    loader_a = _loader(data)
    a.fit(loader_a, epochs=2, max_steps=4)
    path = a.save(str(tmp_path / "a.ckpt"))
    b = TowerTrainer.load(path, build_model("mlp", seed=0), devices=["cpu"] * 3, master="device")
    assert all(torch.equal(x, y) for x, y in zip(a.master_params(), b.master_params()))
    a.fit(loader_a, epochs=2, max_steps=8)  # the same loader object continues where it stopped
    b.fit(_loader(data), epochs=2, max_steps=8)
    # a and b are two fp32 implementations of the same 8 steps (2 towers with the CPU master, then 3 with the
    # device one): each within 2 noise floors of the reference (Note [Tolerance of training equivalence
    # tests]), so within 4 floors of each other (triangle inequality). Measured: 0.08 of that.
    assert _rel_distance(a.master_params(), b.master_params()) <= 4 * _fp32_floor(data, 8, lr=3e-3)
    a.close()
    b.close()


def test_checkpoint_callback_and_restore_from_directory(tmp_path, data):
    run = tmp_path / "run"
    metrics = tmp_path / "m.jsonl"
    cfg = dict(devices=["cpu"] * 2, optimizer="adamw", lr=3e-3)
    tr = TowerTrainer(build_model("mlp", seed=0), **cfg)
    saver = CheckpointCallback(run, every_epochs=1, keep=2)
    tr.fit(_loader(data), epochs=3, callbacks=[saver, MetricsLogger(metrics)])
    steps = [s for s, _ in ckpt.CheckpointManager(run).list()]
    assert steps == [16, 24] and saver.last_path.endswith("ckpt-000000024.ckpt")
    records = read_jsonl(metrics)
    assert [r["event"] for r in records].count("epoch") == 3
    assert records[0]["event"] == "fit_start" and records[-1]["event"] == "fit_end"
    assert sum(r["event"] == "step" for r in records) == 24

    again = TowerTrainer(build_model("mlp", seed=5), **cfg)
    assert again.restore(str(run)).endswith("ckpt-000000024.ckpt")
    assert again.step == 24 and again.epoch == 3 and len(again.history) == 3
    assert all(torch.equal(x, y) for x, y in zip(tr.master_params(), again.master_params()))
    # Training is complete: fitting to the same epoch count does nothing more.
    again.fit(_loader(data), epochs=3)
    assert again.step == 24
    tr.close()
    again.close()


def test_corrupted_checkpoint_is_rejected_with_the_file_name(tmp_path, data):
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2)
    tr.train_step(next(iter(_loader(data))))
    path = tr.save(str(tmp_path / "c.ckpt"))
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(path, "wb").write(bytes(raw))
    model = build_model("mlp", seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ckpt.CheckpointError, match="checksum") as ei:
        TowerTrainer.load(path, model)
    assert path in str(ei.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    tr.close()


def test_checkpoint_from_another_model_is_rejected_and_nothing_changes(tmp_path, data):
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2)
    path = tr.save(str(tmp_path / "mlp.ckpt"))
    files = sorted(os.listdir(tmp_path))
    cnn = build_model("cnn", seed=0)
    before = [p.detach().clone() for p in cnn.parameters()]
    with pytest.raises(ckpt.CheckpointError, match="different model") as ei:
        TowerTrainer.load(path, cnn)
    assert ei.value.check == "content" and path in str(ei.value)
    other = TowerTrainer(build_model("cnn", seed=0), devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="different model"):
        other.restore(path)
    assert other.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, cnn.parameters()))
    assert sorted(os.listdir(tmp_path)) == files
    # Same architecture, different width: the message names the parameter.
    from ncclavg.train.models import DigitsMLP

    with pytest.raises(ValueError, match=r"net\.1\.weight"):
        TowerTrainer.load(path, DigitsMLP(hidden=(32, 64)))
    tr.close()
    other.close()
