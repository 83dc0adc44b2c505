"""Digits / synthetic data, the resumable loader, models and LR schedules."""
import math

import pytest
import torch

from ncclavg.train import schedules
from ncclavg.train.data import TensorLoader, epoch_permutation, load_digits, synthetic
from ncclavg.train.models import DigitsCNN, DigitsMLP, build_model


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_digits_split_is_deterministic_stratified_and_normalised(digits):
    again = load_digits()
    assert torch.equal(digits.x_train, again.x_train) and torch.equal(digits.y_test, again.y_test)
    assert digits.x_train.shape[1:] == (1, 8, 8) and digits.x_train.dtype == torch.float32
    assert len(digits.y_train) + len(digits.y_test) == 1797
    assert abs(len(digits.y_test) / 1797 - 0.2) < 0.01
    # Train statistics are standardised; the test part uses the same transform (no leakage). Checked in float64
    # against the float32 arithmetic of _standardise (u = 2^-24, gamma_k = k*u / (1 - k*u)): x' = (x - m) / s
    # rounds twice (gamma_2). The raw pixels are integers 0..16 summing to < 2^24, so numpy's float32 mean m is
    # the exact mean rounded once; some pixels are 0, so m / s = -min(x'). Hence |mean(x')| <= u * m / s +
    # gamma_2 * mean|x'| <= gamma_3 * (|min x'| + mean|x'|). numpy's float32 std s: the rounded squared
    # differences (gamma_3 each), its partial pairwise sum (< 64 roundings deep at this size: leaves of <= 128
    # terms in 8 accumulators, < 10 halvings), the division by N, and the sqrt (halves that, adds u); x' adds
    # gamma_2 * rms(x'). Statistics of the test part or of all the data are off by >= 2e-4 (mean), 2e-5 (std).
    x = digits.x_train.double()
    gamma = lambda k: k * 2.0 ** -24 / (1 - k * 2.0 ** -24)  # noqa: E731
    assert abs(float(x.mean())) <= gamma(3) * (abs(float(x.min())) + float(x.abs().mean()))
    std_bound = (gamma(3) + gamma(64) + 2.0 ** -24) / 2 + 2.0 ** -24 + gamma(2) * float(x.square().mean().sqrt())
    assert abs(float(x.std(correction=0)) - 1) <= std_bound   # numpy's std: no Bessel correction
    # Stratified: every class has (about) its share in the test part.
    counts = torch.bincount(digits.y_test, minlength=10)
    assert int(counts.min()) >= 33 and int(counts.max()) <= 39
    other = load_digits(seed=1)
    assert not torch.equal(other.y_train, digits.y_train)


def test_bad_fraction_names_argument():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.5)
    with pytest.raises(ValueError, match="num_samples"):
        synthetic(num_samples=1)


def test_synthetic_shapes_and_seed():
    s = synthetic(num_samples=100, input_shape=(1, 8, 8), num_classes=5, seed=3)
    assert s.x_train.shape == (80, 1, 8, 8) and s.x_test.shape == (20, 1, 8, 8)
    assert int(s.y_train.max()) < 5
    assert torch.equal(s.x_train, synthetic(num_samples=100, num_classes=5, seed=3).x_train)


def test_loader_covers_every_sample_once_per_epoch_and_resumes():
    x = torch.arange(23, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(23)
    loader = TensorLoader(x, y, batch_size=5, seed=7)
    assert len(loader) == 5 and loader.batch_sizes() == [5, 5, 5, 5, 3]
    epoch0 = [b for b in loader]
    assert loader.epoch == 1 and loader.batch == 0
    seen = torch.cat([b[1] for b in epoch0])
    assert sorted(seen.tolist()) == list(range(23))
    assert torch.equal(torch.cat([b[0] for b in epoch0]).squeeze(1).long(), seen)  # x and y stay paired
    epoch1 = [b[1] for b in loader]
    assert not torch.equal(torch.cat(epoch1), seen)  # reshuffled

    # Stop after two batches of epoch 2, save, restore into a fresh loader: same remaining batches.
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batch"]) == (2, 2)
    rest = [b[1] for b in it]
    fresh = TensorLoader(x, y, batch_size=5, seed=7)
    fresh.load_state_dict(state)
    resumed = [b[1] for b in fresh]
    assert len(resumed) == len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, resumed))
    assert fresh.epoch == 3


def test_loader_batches_does_not_move_position_and_no_shuffle_keeps_order():
    x = torch.arange(10)
    loader = TensorLoader(x, x, batch_size=4, shuffle=False)
    assert [b[0].tolist() for b in loader.batches()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (loader.epoch, loader.batch) == (0, 0)
    assert torch.equal(epoch_permutation(10, 1, 2), epoch_permutation(10, 1, 2))


def test_loader_rejects_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        TensorLoader(torch.zeros(4), batch_size=0)
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        TensorLoader(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="empty"):
        TensorLoader(torch.zeros(0))
    loader = TensorLoader(torch.zeros(10), batch_size=4)
    with pytest.raises(ValueError, match="num_samples"):
        loader.load_state_dict({"epoch": 0, "batch": 0, "num_samples": 11, "batch_size": 4})


@pytest.mark.parametrize("name,cls", [("cnn", DigitsCNN), ("mlp", DigitsMLP)])
def test_models_shapes_and_seeded_init(name, cls):
    m = build_model(name, seed=5)
    assert isinstance(m, cls)
    assert m(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    m2 = build_model(name, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    state = torch.get_rng_state()
    build_model(name, seed=6)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is untouched
    with pytest.raises(ValueError, match="model"):
        build_model("resnet")


def test_schedules_values_and_round_trip():
    exp = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert [exp(s) for s in (0, 9, 10, 25)] == [0.1, 0.1, 0.05, 0.025]
    smooth = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5, staircase=False)
    assert math.isclose(smooth(5), 0.1 * 0.5 ** 0.5)
    cos = schedules.CosineWarmup(1.0, total_steps=110, warmup_steps=10, min_lr=0.0)
    assert math.isclose(cos(0), 0.1) and math.isclose(cos(9), 1.0) and math.isclose(cos(10), 1.0)
    assert math.isclose(cos(60), 0.5) and cos(110) == 0.0 and cos(500) == 0.0
    assert all(cos(s) >= cos(s + 1) for s in range(10, 110))
    for sch in (exp, smooth, cos, schedules.Constant(0.3)):
        again = schedules.from_state_dict(sch.state_dict())
        assert again == sch and all(again(s) == sch(s) for s in range(0, 200, 7))


def test_make_schedule_and_errors():
    assert schedules.make_schedule(None, 0.2)(100) == 0.2
    assert schedules.make_schedule("exp", 1.0, steps_per_epoch=4)(4) == 0.9
    spec = {"kind": "exponential", "decay_steps": 2, "decay_rate": 0.1}
    assert schedules.make_schedule(spec, 1.0)(2) == pytest.approx(0.1)
    assert isinstance(schedules.make_schedule("cosine", 1.0, total_steps=100), schedules.CosineWarmup)
    with pytest.raises(ValueError, match="lr_schedule"):
        schedules.make_schedule("cosine", 1.0)
    with pytest.raises(ValueError, match="lr_schedule"):
        schedules.make_schedule("linear", 1.0)
    with pytest.raises(TypeError, match="lr_schedule"):
        schedules.make_schedule(lambda s: 0.1, 1.0)
    with pytest.raises(ValueError, match="decay_steps"):
        schedules.ExponentialDecay(0.1, decay_steps=0, decay_rate=0.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.CosineWarmup(0.1, total_steps=5, warmup_steps=6)
