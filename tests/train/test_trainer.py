"""TowerTrainer on CPU towers: N towers == single-tower full-batch training, amp, clipping, schedules."""
import functools
import math

import pytest
import torch
from _training_reference import OPTIMIZERS, assert_params_close, fp32_training_spread
from torch import nn

from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.models import build_model
from ncclavg.train.schedules import ExponentialDecay
from ncclavg.train.trainer import TowerTrainer

STEPS = 10


@pytest.fixture(scope="module")
def digits():
    return load_digits()


# 96 samples in batches of 24: every split even. 101 in batches of 23: uneven splits in every batch and a
# last batch of 9. 97 in batches of 24: a last batch of ONE sample (towers 1.. idle).
DATASETS = {"even": (96, 24), "uneven": (101, 23), "one_sample_last": (97, 24)}


@functools.lru_cache(maxsize=None)
def _mlp_reference(opt_name, data):
    n, bs = DATASETS[data]
    x, y = load_digits().x_train[:n], load_digits().y_train[:n]
    return fp32_training_spread(lambda: build_model("mlp", seed=0), lambda: TensorLoader(x, y, batch_size=bs, seed=3),
                                opt_name, STEPS)


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("data", list(DATASETS))
def test_n_towers_equal_single_tower_full_batch(digits, master, opt_name, data):
    n, bs = DATASETS[data]
    x, y = digits.x_train[:n], digits.y_train[:n]
    want, floor = _mlp_reference(opt_name, data)
    for towers in (1, 2, 3, 4):
        with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * towers, master=master,
                          **OPTIMIZERS[opt_name]) as tr:
            tr.fit(TensorLoader(x, y, batch_size=bs, seed=3), epochs=100, max_steps=STEPS)
            assert tr.step == STEPS
            got = tr.master_params()
            assert_params_close(got, want, floor)
            # Every tower holds the master weights (identical replicas after each step).
            for t in range(towers):
                assert all(torch.equal(p.detach().float(), m) for p, m in zip(tr.tower_params[t], got))


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_cnn_with_clipping_matches_reference(digits, master):
    x, y = digits.x_train[:70], digits.y_train[:70]
    want, floor = fp32_training_spread(lambda: build_model("cnn", seed=1),
                                       lambda: TensorLoader(x, y, batch_size=20, seed=0), "sgd_nesterov", 6, grad_clip=0.5)
    with TowerTrainer(build_model("cnn", seed=1), devices=["cpu"] * 3, master=master, grad_clip=0.5,
                      **OPTIMIZERS["sgd_nesterov"]) as tr:
        tr.fit(TensorLoader(x, y, batch_size=20, seed=0), epochs=10, max_steps=6)
        assert_params_close(tr.master_params(), want, floor)


def test_towers_start_identical_and_model_is_tower_zero():
    model = build_model("mlp", seed=4)
    before = [p.detach().clone() for p in model.parameters()]
    with TowerTrainer(model, devices=["cpu"] * 3) as tr:
        assert tr.model is model and tr.num_towers == 3
        for t in range(3):
            assert all(torch.equal(p, b) for p, b in zip(tr.towers[t].parameters(), before))
        assert tr.towers[1] is not tr.towers[0]
        assert tr.towers[1].net[1].weight.data_ptr() != model.net[1].weight.data_ptr()


def test_step_record_and_phase_times(digits):
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], master="cpu") as tr:
        rec = tr.train_step((digits.x_train[:33], digits.y_train[:33]))
    assert rec["step"] == 1 and rec["samples"] == 33 and 0.0 <= rec["accuracy"] <= 1.0
    assert math.isfinite(rec["loss"]) and rec["samples_per_s"] > 0 and not rec["skipped"]
    for phase in ("compute", "reduce", "offload", "optimizer", "broadcast"):
        assert rec["t_" + phase] >= 0.0
    assert rec["t_compute"] > 0 and rec["t_optimizer"] > 0


def test_evaluate_matches_manual_and_keeps_training_position(digits):
    loader = TensorLoader(digits.x_test, digits.y_test, batch_size=50, shuffle=False)
    with TowerTrainer(build_model("cnn", seed=2), devices=["cpu"] * 3) as tr:
        ev = tr.evaluate(loader)
        with torch.no_grad():
            out = tr.model(digits.x_test)
            model64 = build_model("cnn", seed=0).double()
            model64.load_state_dict(tr.model.state_dict())  # the same weights, exactly, in float64
            loss64 = float(nn.functional.cross_entropy(model64(digits.x_test.double()), digits.y_test))
        assert ev["samples"] == len(digits.y_test)
        assert ev["accuracy"] == pytest.approx(float((out.argmax(1) == digits.y_test).float().mean()))
        # evaluate() is another float32 computation of the loss (batches of 50, each split over 3 towers),
        # as far from the exact loss as the full-batch reference: within 2 of the reference's own float32
        # error (its distance to the float64 loss) by the triangle inequality; never below one float32 ulp
        # (2^-23 relative) of the loss, a float32 value. Measured: 0.2 of that. Unweighted batch means or a
        # dropped slice are off by 3e-4 to 8e-4 relative.
        loss = float(nn.functional.cross_entropy(out, digits.y_test))
        floor = max(2.0 ** -23, abs(loss - loss64) / loss64)
        assert ev["loss"] == pytest.approx(loss, rel=2 * floor)
    assert (loader.epoch, loader.batch) == (0, 0)


def test_schedule_drives_the_learning_rate(digits):
    sched = ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2, optimizer="sgd", lr=0.1,
                      lr_schedule=sched) as tr:
        lrs = [tr.train_step((digits.x_train[:8], digits.y_train[:8]))["lr"] for _ in range(5)]
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025]


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_runs_on_cpu_and_learns(digits, master, amp):
    loader = TensorLoader(digits.x_train, digits.y_train, batch_size=64, seed=0)
    model = build_model("cnn" if amp == "bf16" else "mlp", seed=0)  # CPU fp16 convolutions are slow
    with TowerTrainer(model, devices=["cpu"] * 2, amp=amp, master=master, lr=3e-3) as tr:
        before = [p.detach().clone() for p in tr.model.parameters()]
        hist = tr.fit(loader, epochs=2)
        ev = tr.evaluate(TensorLoader(digits.x_test, digits.y_test, batch_size=128, shuffle=False))
        assert all(p.dtype == torch.float32 for p in tr.model.parameters())  # fp32 weights, autocast compute
        assert not all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    assert hist[-1]["loss"] < hist[0]["loss"] and math.isfinite(hist[-1]["loss"])
    assert ev["accuracy"] > 0.8


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_fp16_skips_non_finite_steps_and_backs_off(master):
    model = nn.Sequential(nn.Linear(4, 3))
    with TowerTrainer(model, devices=["cpu"] * 2, amp="fp16", master=master, init_loss_scale=1024.0) as tr:
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        good = tr.train_step((x, y))
        assert not good["skipped"] and tr.scaler.scale == 1024.0
        before = [p.detach().clone() for p in model.parameters()]
        bad_x = x.clone()
        bad_x[4, 0] = float("inf")  # only tower 1 sees it: the average must still be caught
        rec = tr.train_step((bad_x, y))
        assert rec["skipped"] and tr.scaler.scale == 512.0
        for t in range(2):
            assert all(torch.equal(p, b) for p, b in zip(tr.tower_params[t], before))
        assert not tr.train_step((x, y))["skipped"]


def test_frozen_parameters_and_buffers_are_kept(digits):
    model = build_model("cnn", seed=0)
    model.features[0].weight.requires_grad_(False)
    model.register_buffer("counter", torch.tensor([3.0]))
    frozen = model.features[0].weight.detach().clone()
    with TowerTrainer(model, devices=["cpu"] * 2) as tr:
        tr.train_step((digits.x_train[:16], digits.y_train[:16]))
        assert tr.plan.param_numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
        for tower in tr.towers:
            assert torch.equal(tower.features[0].weight, frozen)
            assert float(tower.counter) == 3.0


def test_sequential_towers_give_the_same_result(digits):
    batch = (digits.x_train[:40], digits.y_train[:40])
    out = []
    for concurrent in (True, False):
        with TowerTrainer(build_model("cnn", seed=0), devices=["cpu"] * 2, concurrent=concurrent) as tr:
            for _ in range(3):
                tr.train_step(batch)
            out.append(tr.master_params())
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_batchnorm_running_stats_are_the_tower_mean():
    """Running statistics are synced on read to the mean over towers (see Note [Lazy buffer sync])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(40, 4) * 3 + 1, torch.randint(0, 3, (40,))
    with TowerTrainer(model, devices=["cpu"] * 2, optimizer="sgd", lr=1e-3) as tr:
        tr.train_step((x, y))
        # Each tower saw its half: the synced running mean is the mean of the two towers' EMAs.
        bn = [t[1] for t in tr.towers]
        want_mean = (bn[0].running_mean + bn[1].running_mean) / 2
        assert not torch.allclose(bn[0].running_mean, bn[1].running_mean)
        tr.sync_buffers()
        for b in bn:
            # Bit for bit: float32 (a + b) / 2 is the exact mean rounded once (the halving is exact), and so is
            # sync_buffers' float64 mean (the sum of two floats is exact there) copied into float32.
            assert torch.equal(b.running_mean, want_mean)
            assert int(b.num_batches_tracked) == 1
        ev = tr.evaluate([(x, y)])
        assert ev["samples"] == 40 and 0.0 <= ev["accuracy"] <= 1.0


def test_regression_multiple_inputs_and_tuple_outputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Linear(2, 1)

        def forward(self, u, v):
            return self.a(u) + self.b(v), {"aux": u.sum()}

    def loss_fn(out, target):
        return nn.functional.mse_loss(out[0].squeeze(1), target)

    g = torch.Generator().manual_seed(1)
    u, v = torch.randn(30, 3, generator=g), torch.randn(30, 2, generator=g)
    target = u @ torch.tensor([1.0, -2.0, 0.5]) + v @ torch.tensor([0.3, 0.7])
    with TowerTrainer(TwoInputs(), devices=["cpu"] * 3, optimizer="sgd", lr=0.1, momentum=0.0,
                      loss_fn=loss_fn) as tr:
        hist = tr.fit(TensorLoader(u, v, target, batch_size=10, seed=0), epochs=30)
        ev = tr.evaluate(TensorLoader(u, v, target, batch_size=30, shuffle=False))
    assert hist[-1]["accuracy"] is None and ev["accuracy"] is None
    assert hist[-1]["loss"] < 0.01 * hist[0]["loss"] and ev["loss"] < 1e-2
