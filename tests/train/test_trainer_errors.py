"""Bad input to TowerTrainer: clear errors naming the argument, nothing written, the model untouched."""
import json
import os

import pytest
import torch
from torch import nn

from ncclavg.train.callbacks import Callback, CheckpointCallback, MetricsLogger, PlotCallback
from ncclavg.train.data import TensorLoader
from ncclavg.train.models import build_model
from ncclavg.train.trainer import TowerTrainer


def _snapshot(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def _unchanged(model, snap):
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), snap))


@pytest.mark.parametrize("devices,match", [
    ([], r"devices: the list is empty"),
    (["cpu", "tpu:0"], r"devices\[1\]: unknown device 'tpu:0'"),
    (["cpu", "gpu0"], r"devices\[1\]"),
    (["cpu", "meta"], r"devices\[1\].*not supported"),
    ([-1], r"devices\[0\]"),
])
def test_bad_devices(devices, match):
    model = build_model("mlp", seed=0)
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        TowerTrainer(model, devices=devices)
    assert _unchanged(model, snap)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_gpu_is_named():
    with pytest.raises(ValueError, match=r"devices\[0\]: cuda:0 needs a GPU, and torch sees none: "):
        TowerTrainer(build_model("mlp"), devices=["cuda:0"])
    with pytest.raises(ValueError, match=r"devices\[1\]"):
        TowerTrainer(build_model("mlp"), devices=["cpu", 3])


def test_bad_devices_type():
    with pytest.raises(TypeError, match="devices"):
        TowerTrainer(build_model("mlp"), devices={"cpu": 1})


def test_model_without_parameters():
    class NoParams(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(ValueError, match="model: NoParams has no trainable parameters"):
        TowerTrainer(NoParams(), devices=["cpu"])
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model: .*no trainable parameters"):
        TowerTrainer(frozen, devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="model"):
        TowerTrainer(lambda x: x, devices=["cpu"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer="rmsprop"), "optimizer"),
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(momentum=1.5, optimizer="sgd"), "momentum"),
    (dict(nesterov=True, optimizer="adamw"), "nesterov"),
    (dict(amp="int8"), "amp"),
    (dict(master="gpu"), "master"),
    (dict(grad_clip=-1.0), "grad_clip"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(lr_schedule="linear"), "lr_schedule"),
    (dict(seed="x"), "seed"),
    (dict(betas=(0.9, 1.5)), "betas"),
])
def test_bad_hyper_parameters_name_the_argument(kwargs, match):
    model = build_model("mlp", seed=0)
    snap = _snapshot(model)
    with pytest.raises((ValueError, TypeError), match=match):
        TowerTrainer(model, devices=["cpu", "cpu"], **kwargs)
    assert _unchanged(model, snap)


def test_batch_smaller_than_towers(tmp_path):
    model = build_model("mlp", seed=0)
    x, y = torch.randn(10, 1, 8, 8), torch.randint(0, 10, (10,))
    with TowerTrainer(model, devices=["cpu"] * 3) as tr:
        snap = _snapshot(model)
        with pytest.raises(ValueError, match=r"batch: has 2 samples, fewer than the 3 towers"):
            tr.train_step((x[:2], y[:2]))
        assert tr.step == 0 and _unchanged(model, snap)
        loader = TensorLoader(x, y, batch_size=2)
        callbacks = [MetricsLogger(tmp_path / "m.jsonl"), CheckpointCallback(tmp_path / "ck"),
                     PlotCallback(tmp_path / "p.png")]
        with pytest.raises(ValueError, match=r"batch_size: the loader's batch size 2 is smaller than the number "
                                             r"of towers \(3\)"):
            tr.fit(loader, epochs=1, callbacks=callbacks)
        assert os.listdir(tmp_path) == []
        assert (loader.epoch, loader.batch) == (0, 0) and tr.step == 0 and _unchanged(model, snap)


@pytest.mark.parametrize("batch,match,exc", [
    (torch.zeros(4, 3), "batch: expected a tuple/list", TypeError),
    ((torch.zeros(4, 3),), "batch: expected a tuple/list", TypeError),
    ((torch.zeros(4, 3), torch.zeros(5, dtype=torch.long)), r"batch\[1\]: has 5 samples", ValueError),
    ((torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)), "batch: is empty", ValueError),
    ((torch.zeros(4, 3), [0, 1, 2, 3]), r"batch\[1\]: expected a torch.Tensor", TypeError),
])
def test_bad_batches(batch, match, exc):
    with TowerTrainer(nn.Linear(3, 2), devices=["cpu"] * 2) as tr:
        with pytest.raises(exc, match=match):
            tr.train_step(batch)
        assert tr.step == 0


def test_bad_fit_arguments(tmp_path):
    with TowerTrainer(nn.Linear(3, 2), devices=["cpu"] * 2) as tr:
        loader = TensorLoader(torch.zeros(8, 3), torch.zeros(8, dtype=torch.long), batch_size=4)
        with pytest.raises(ValueError, match="epochs"):
            tr.fit(loader, epochs=0)
        with pytest.raises(ValueError, match="max_steps"):
            tr.fit(loader, epochs=1, max_steps=0)
        with pytest.raises(TypeError, match=r"callbacks\[0\]"):
            tr.fit(loader, epochs=1, callbacks=[print])
        with pytest.raises(ValueError, match="path: directory .* does not exist"):
            tr.save(str(tmp_path / "missing" / "x.ckpt"))
        assert tr.step == 0 and os.listdir(tmp_path) == []


def test_loss_fn_must_return_a_scalar():
    with TowerTrainer(nn.Linear(3, 2), devices=["cpu"] * 2,
                      loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")) as tr:
        with pytest.raises(ValueError, match="loss_fn: must return a scalar"):
            tr.train_step((torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))


def test_plain_iterable_with_small_batches_fails_before_any_step():
    model = nn.Linear(3, 2)
    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    with TowerTrainer(model, devices=["cpu"] * 4) as tr:
        snap = _snapshot(model)
        with pytest.raises(ValueError, match="batch: has 2 samples, fewer than the 4 towers"):
            tr.fit([(x[i:i + 2], y[i:i + 2]) for i in range(0, 12, 2)], epochs=1)
        assert tr.step == 0 and _unchanged(model, snap)
        # A short trailing remainder after full batches is fine (towers without a sample contribute 0).
        tr.fit([(x[:5], y[:5]), (x[5:10], y[5:10]), (x[10:], y[10:])], epochs=1)
        assert tr.step == 3


class _Boom(Exception):
    pass


class _FailAt(Callback):
    """Raises at one step; its on_fit_error raises too, which must not hide the first error."""

    def __init__(self, step):
        self.step, self.errors = step, []

    def on_step_end(self, trainer, record):
        if trainer.step == self.step:
            raise _Boom(f"injected at step {self.step}")

    def on_fit_error(self, trainer, error):
        self.errors.append(error)
        raise OSError("cleanup failed too")

    def on_fit_end(self, trainer, history):
        raise AssertionError("on_fit_end after a failed fit")


def test_failing_fit_saves_no_checkpoint_and_records_the_error(tmp_path):
    """Note [Callbacks when fit fails]: a fit that raises mid-epoch calls on_fit_error, not on_fit_end;
    the checkpoint directory keeps only the periodic checkpoints (none at the failing step), the metrics
    file ends with the error, and the training error propagates with a cleanup failure as a note."""
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    loader = TensorLoader(x, y, batch_size=16, seed=0)   # 4 steps per epoch: the failure is at step 6
    failer = _FailAt(6)
    metrics = MetricsLogger(tmp_path / "m.jsonl")
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2) as tr:
        with pytest.raises(_Boom, match="injected at step 6") as info:
            tr.fit(loader, epochs=3, callbacks=[failer, metrics, CheckpointCallback(tmp_path / "ck", keep=5),
                                                PlotCallback(tmp_path / "p.png")])
        assert tr.step == 6 and tr.last_fit["samples"] == 6 * 16
    assert failer.errors == [info.value]
    assert any("_FailAt.on_fit_error raised OSError: cleanup failed too" in n for n in info.value.__notes__)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-000000004.ckpt"]   # epoch 1's; nothing at step 6
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1] == {"event": "fit_error", "step": 6, "epochs": 1, "error": "_Boom: injected at step 6"}
    assert (tmp_path / "p.png").stat().st_size > 0   # the completed epoch is plotted


def test_keyboard_interrupt_is_a_failed_fit(tmp_path):
    """Ctrl-C inside fit is handled like any failure (BaseException): no end-of-fit checkpoint."""
    class Interrupt(Callback):
        def on_step_end(self, trainer, record):
            if trainer.step == 2:
                raise KeyboardInterrupt

    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2) as tr:
        with pytest.raises(KeyboardInterrupt):
            tr.fit(TensorLoader(x, y, batch_size=8, seed=0), epochs=2,
                   callbacks=[Interrupt(), CheckpointCallback(tmp_path / "ck")])
    assert not (tmp_path / "ck").exists()   # the directory is made by the first save
